"""Configuration of the Cosmos 3 two-tower MoT.

Field names follow diffusers' ``Cosmos3OmniTransformer`` config so a diffusers
``config.json`` maps onto this model one-to-one (see ``from_diffusers_config``).
"""

from __future__ import annotations

from types import MappingProxyType

from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, model_validator

# Keys diffusers writes into every config.json that carry no architecture.
_DIFFUSERS_META_PREFIX = "_"
# Load-time hints diffusers accepts in the config but never reads for the architecture.
_DIFFUSERS_IGNORED_FIELDS = frozenset({"dtype", "attention_dropout"})


#: What the released Nano and Super configs share: GQA with 8 KV heads of 128, and the
#: sound and action generation heads (per the reference notes; no checkpoint config was
#: available to confirm the modality sizes).
_RELEASED_COMMON: Mapping[str, Any] = MappingProxyType(dict(
    num_key_value_heads=8, head_dim=128, sound_gen=True, sound_dim=64, action_gen=True, action_dim=64,
    num_embodiment_domains=32,
))


class Cosmos3Config(BaseModel):
    """Architecture of one Cosmos 3 checkpoint (both towers share these sizes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Backbone (identical sizes for the reasoner and the generator tower).
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    # "silu": Qwen3-VL SwiGLU (Nano/Super); "relu2": Nemotron squared-ReLU MLP (Edge).
    hidden_act: Literal["silu", "relu2"] = "silu"
    qk_norm_for_text: bool = True
    # Edge only: a separate k-norm applied to the text keys the generator attends to.
    use_und_k_norm_for_gen: bool = False

    # Interleaved 3D mRoPE.
    rope_theta: float = 5_000_000.0
    rope_axes_dim: tuple[int, int, int] = (24, 20, 20)

    # Vision latents (Wan 2.2 VAE) and patchification.
    latent_channel: int = 48
    latent_patch_size: int = 2
    patch_latent_dim: int = 192

    # Generation-side positions.
    base_fps: int = 24
    enable_fps_modulation: bool = True
    unified_3d_mrope_reset_spatial_ids: bool = True
    unified_3d_mrope_temporal_modality_margin: int = 15000
    # The VAE's temporal compression; the diffusers pipeline reads it from the VAE config.
    vae_temporal_compression: int = 4

    # Timestep embedding: t * timestep_scale goes into a 256-dim sinusoid.
    timestep_scale: float = 0.001

    # Optional modalities.
    sound_gen: bool = False
    sound_dim: int | None = None
    sound_latent_fps: float = 25.0
    action_gen: bool = False
    action_dim: int | None = None
    num_embodiment_domains: int = 32

    @model_validator(mode="after")
    def _check_consistency(self) -> "Cosmos3Config":
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if sum(self.rope_axes_dim) != self.head_dim // 2:
            raise ValueError(
                f"rope_axes_dim {list(self.rope_axes_dim)} must sum to head_dim // 2 = {self.head_dim // 2}"
            )
        expected_patch_dim = self.latent_channel * self.latent_patch_size**2
        if self.patch_latent_dim != expected_patch_dim:
            raise ValueError(
                f"patch_latent_dim ({self.patch_latent_dim}) must equal latent_channel * latent_patch_size**2 "
                f"= {expected_patch_dim}"
            )
        if self.sound_gen and self.sound_dim is None:
            raise ValueError("sound_dim must be set when sound_gen=True")
        if self.action_gen and self.action_dim is None:
            raise ValueError("action_dim must be set when action_gen=True")
        return self

    # --- derived -----------------------------------------------------------------------

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def has_und_k_norm_for_gen(self) -> bool:
        # diffusers only builds the extra norm when the text path has no k-norm of its own.
        return self.use_und_k_norm_for_gen and not self.qk_norm_for_text

    # --- constructors ------------------------------------------------------------------

    @classmethod
    def from_diffusers_config(cls, config: dict[str, Any]) -> "Cosmos3Config":
        """Build from a diffusers ``Cosmos3OmniTransformer`` config dict (``config.json``).

        ``_class_name``-style metadata and load-time hints (``dtype``) are dropped; every
        other unknown key is rejected by the model (extra="forbid").
        """
        fields: dict[str, Any] = {
            key: value
            for key, value in config.items()
            if not key.startswith(_DIFFUSERS_META_PREFIX) and key not in _DIFFUSERS_IGNORED_FIELDS
        }
        rope_scaling = fields.pop("rope_scaling", None)
        if fields.get("rope_axes_dim") is None:
            fields.pop("rope_axes_dim", None)
            if rope_scaling is not None:
                if not isinstance(rope_scaling, dict):
                    raise ValueError(f"rope_scaling must be a dict or null, got {type(rope_scaling).__name__}")
                fields["rope_axes_dim"] = tuple(rope_scaling.get("mrope_section", (24, 20, 20)))
        else:
            fields["rope_axes_dim"] = tuple(fields["rope_axes_dim"])
        return cls(**fields)

    @classmethod
    def nano(cls, **overrides: Any) -> "Cosmos3Config":
        """Cosmos 3 Nano (16B total, two towers of hidden 4096 x 36 layers)."""
        base: dict[str, Any] = dict(
            _RELEASED_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32
        )
        return cls(**{**base, **overrides})

    @classmethod
    def super_(cls, **overrides: Any) -> "Cosmos3Config":
        """Cosmos 3 Super (64B total; hidden 5120 != heads x head_dim = 8192)."""
        base: dict[str, Any] = dict(
            _RELEASED_COMMON, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64
        )
        return cls(**{**base, **overrides})

    @classmethod
    def tiny(cls, **overrides: Any) -> "Cosmos3Config":
        """A CPU-test config reaching every path (hidden 48 != 4 heads x 16, GQA 2:1)."""
        base: dict[str, Any] = dict(
            vocab_size=272,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_axes_dim=(4, 2, 2),
            latent_channel=4,
            latent_patch_size=2,
            patch_latent_dim=16,
            sound_gen=True,
            sound_dim=4,
            action_gen=True,
            action_dim=6,
            num_embodiment_domains=3,
        )
        return cls(**{**base, **overrides})

    def to_diffusers_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``diffusers.Cosmos3OmniTransformer(**kwargs)``."""
        kwargs = self.model_dump(exclude={"vae_temporal_compression"})
        kwargs["rope_axes_dim"] = list(self.rope_axes_dim)
        return kwargs
