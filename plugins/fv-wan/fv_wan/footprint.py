"""Memory footprints of Wan's steps, from the component configs alone (no weights).

Admission reserves what a request's loops keep (``resident``) plus the largest
transient of any one step (``peak``). These functions derive both from the card's
real dimensions, mirroring what fv-wan's modules allocate:

* **DiT step** (:func:`dit_step_peak_bytes`): per token, the largest of three phases of
  one block. Alive throughout: the patch-embedded tokens (kept for the whole forward),
  the block's input (held by the caller) and, once the block updated it, the block's
  stream. Self-attention adds the fp32 copy of the stream its residual starts from
  (evaluated first), the modulated norm, q, k, v, the attention output, its flattened
  copy and the output projection (or, while RoPE runs, its fp32 halves); the FFN adds
  the norm, the stream's fp32 copy, and the projection and its GELU at ``ffn_dim``;
  the residual after it three fp32 hidden-width tensors. Plus the fp32 six-way
  modulation and the timestep projections (per token when timesteps are per token,
  Wan 2.2 TI2V), the RoPE tables, and the projected context with its cross-attention
  K and V. Attention is assumed memory-efficient (flash / efficient SDPA: no
  tokens x tokens score matrix).
* **VAE decode step** (:func:`vae_decode_step`): the causal decoder run on one latent
  frame, stage by stage at each stage's channels, size and frame count: a residual
  block holds its input (and the stage's input, held by the caller), both causal
  convs' time-padded input buffers (frames + 2), the first conv's output, its shortcut
  when channels change and the norm's fp32 denominators; an upsampler its input, the
  temporal conv's doubled output, the 2x nearest copy and the conv after it; the mid
  block's per-frame attention its tensors and the pixels x pixels score matrix. The
  causal history kept between steps is two frames of every cached conv's input
  (:attr:`VAEStepFootprint.cache_bytes`).
* **VAE encode** (:func:`vae_encode_peak_bytes`): the encoder over one chunk of
  ``temporal_compression`` frames, with the same rules, its history included.
* **Text encoder** (:func:`text_encoder_peak_bytes`): UMT5 in fp32 with T5 proportions
  (``d_ff = 2.5 d_model``, 64-wide heads) where the card does not carry the encoder's
  config: per row the attention scores, position bias and softmax (heads x L x L) and
  the gated FFN.

* **Weights** (:func:`parameter_count`): each component's weight elements, the module
  built on the meta device as ``fv_wan.instance`` loads it (one half of the VAE; the
  released UMT5-XXL / CLIP ViT-H/14 encoders for real cards). Cards declare it as
  ``ComponentSpec.parameters``; the kernel's pre-flight refuses weights that do not fit.

Each activation figure is multiplied by :data:`ALLOWANCE` for what is not modelled (allocator
rounding, library workspaces, small temporaries). ``bench/bench_footprint.py``
measures the same calls on a GPU; ``docs/architecture.md`` ("Admission") has the
numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from fv_wan.models.transformer import WanTransformer, WanTransformerConfig
from fv_wan.models.vae import WanVAE, WanVAEConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from fv_kernel.api import ComponentSpec

__all__ = [
    "ALLOWANCE",
    "element_bytes",
    "dit_step_peak_bytes",
    "VAEStepFootprint",
    "vae_decode_step",
    "vae_encode_peak_bytes",
    "text_encoder_peak_bytes",
    "image_encoder_peak_bytes",
    "parameter_count",
]

#: Margin on every modelled peak for what the model leaves out (allocator rounding, cuBLAS /
#: cuDNN workspaces, small temporaries); measured peaks came within 2% of the model.
ALLOWANCE = 1.05
_FP32 = 4
_CACHE_T = 2  # frames of causal history a cached conv keeps (fv_wan.models.vae_blocks.CACHE_T)


def element_bytes(precision: str) -> int:
    return 2 if precision in ("bf16", "fp16") else _FP32


# --------------------------------------------------------------------------- DiT


def dit_step_peak_bytes(
    config: WanTransformerConfig,
    tokens: int,
    *,
    precision: str,
    rows: int = 1,
    context_tokens: int = 512,
    per_token_timesteps: bool = False,
) -> int:
    """Transient bytes of one transformer forward over ``rows`` rows of ``tokens`` tokens."""
    d, f, e = config.inner_dim, config.ffn_dim, element_bytes(precision)
    # At the output projection: 9 compute-dtype hidden widths and the residual's fp32 stream. While
    # RoPE rotates k: 7 of them, the fp32 stream and three fp32 half-width temporaries.
    attention = max(9 * e + _FP32, 7 * e + _FP32 + 3 * _FP32 // 2) * d
    ffn = (4 * e + _FP32) * d + 2 * e * f
    residual = (4 * e + 3 * _FP32) * d
    per_token = max(attention, ffn, residual) + config.attention_head_dim * _FP32  # + the RoPE cos/sin tables
    timesteps = tokens if per_token_timesteps else 1
    modulation = timesteps * d * (6 * _FP32 + 7 * e)
    context = 3 * context_tokens * d * e
    return int(ALLOWANCE * rows * (tokens * per_token + modulation + context))


# --------------------------------------------------------------------------- VAE


@dataclass(frozen=True)
class VAEStepFootprint:
    #: Largest transient of the step's activations (history excluded).
    activation_bytes: int
    #: Causal history the stream keeps between steps (steady state), in the VAE's dtype.
    cache_bytes: int


class _Walk:
    """Accumulates the largest live set (bytes) and the cached history while walking a network."""

    def __init__(self, element: int) -> None:
        self.e = element
        self.peak = 0
        self.cache = 0

    def live(self, elements: int, extra_bytes: int = 0) -> None:
        self.peak = max(self.peak, elements * self.e + extra_bytes)

    def cached(self, elements: int) -> None:
        self.cache += elements * self.e

    def resblock(self, c_in: int, c_out: int, frames: int, pixels: int, held: int = 0) -> None:
        """``held``: channels of a tensor at this size the caller keeps alive (the stage's input)."""
        shortcut = c_out * frames if c_in != c_out else 0
        buffers = c_in * (frames + _CACHE_T) + c_out * (frames + _CACHE_T)
        self.live(pixels * (held * frames + c_in * frames + shortcut + buffers + c_out * frames), frames * pixels * _FP32)
        self.cached(_CACHE_T * (c_in + c_out) * pixels)

    def causal_conv(self, c_in: int, c_out: int, frames: int, pixels: int) -> None:
        self.live(pixels * (c_in * frames + c_in * (frames + _CACHE_T) + c_out * frames))
        self.cached(_CACHE_T * c_in * pixels)

    def attention(self, channels: int, frames: int, pixels: int) -> None:
        # the block's and its caller's input, norm, q/k/v, attended, projection, sum; the per-frame scores
        self.live(frames * (9 * channels * pixels + pixels * pixels))

    def footprint(self) -> VAEStepFootprint:
        return VAEStepFootprint(activation_bytes=int(ALLOWANCE * self.peak), cache_bytes=self.cache)


def vae_decode_step(config: WanVAEConfig, latent_height: int, latent_width: int, *, element: int, first: bool = False) -> VAEStepFootprint:
    """Footprint of decoding one latent frame (a later frame unless ``first``) at the given latent size."""
    walk = _Walk(element)
    dims = [(config.decoder_base_dim or config.base_dim) * m for m in (config.dim_mult[-1], *config.dim_mult[::-1])]
    upsample_in_time = config.temperal_downsample[::-1]
    last = len(config.dim_mult) - 1
    h, w, frames = latent_height, latent_width, 1
    walk.causal_conv(config.z_dim, dims[0], frames, h * w)
    walk.resblock(dims[0], dims[0], frames, h * w)
    walk.attention(dims[0], frames, h * w)
    walk.resblock(dims[0], dims[0], frames, h * w, held=dims[0])
    for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
        up = i != last
        temporal = up and upsample_in_time[i]
        stage_in = in_dim if config.is_residual or i == 0 else in_dim // 2
        c_in = stage_in
        for block in range(config.num_res_blocks + 1):
            walk.resblock(c_in, out_dim, frames, h * w, held=stage_in if block else 0)
            c_in = out_dim
        if not up:
            continue
        up_out = out_dim if config.is_residual else out_dim // 2
        doubles = temporal and not first
        after = frames * 2 if doubles else frames
        time_conv = 2 * out_dim * frames + out_dim * (frames + _CACHE_T) if doubles else 0
        held = stage_in * frames if config.is_residual else 0  # the 2.2 shortcut's input
        walk.live(h * w * (held + out_dim * frames + time_conv) + 4 * h * w * after * (out_dim + up_out))
        if temporal:
            walk.cached(_CACHE_T * out_dim * h * w)
        h, w, frames = 2 * h, 2 * w, after
    walk.causal_conv(dims[-1], config.out_channels, frames, h * w)
    walk.live(h * w * (2 * dims[-1] * frames + dims[-1] * (frames + _CACHE_T) + config.out_channels * frames))
    return walk.footprint()


def vae_encode_peak_bytes(config: WanVAEConfig, height: int, width: int, *, frames: int, element: int) -> int:
    """Largest transient of encoding ``frames`` frames at ``height`` x ``width``, its history included.

    The encoder runs the first frame alone, then chunks of ``temporal_compression`` frames.
    """
    walk = _Walk(element)
    patch = config.patch_size or 1
    h, w = height // patch, width // patch
    frames = config.temporal_compression if frames > 1 else 1
    dims = [config.base_dim * m for m in (1, *config.dim_mult)]
    last = len(config.dim_mult) - 1
    walk.causal_conv(config.in_channels, dims[0], frames, h * w)
    for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
        c_in = in_dim
        for block in range(config.num_res_blocks):
            # 2.2 stages keep their input for the average-pool shortcut
            walk.resblock(c_in, out_dim, frames, h * w, held=in_dim if config.is_residual and block else 0)
            c_in = out_dim
        if i == last:
            continue
        temporal = config.temperal_downsample[i]
        # padded input, the strided conv's output, and the temporal conv over (history + frames)
        walk.live(frames * out_dim * ((h + 1) * (w + 1) + 2 * (h // 2) * (w // 2)))
        h, w = h // 2, w // 2
        if temporal:
            walk.cached(out_dim * h * w)
            frames = max(frames // 2, 1)
    walk.resblock(dims[-1], dims[-1], frames, h * w)
    walk.attention(dims[-1], frames, h * w)
    walk.resblock(dims[-1], dims[-1], frames, h * w, held=dims[-1])
    walk.causal_conv(dims[-1], 2 * config.z_dim, frames, h * w)
    step = walk.footprint()
    return step.activation_bytes + step.cache_bytes


# --------------------------------------------------------------------------- encoders


def text_encoder_peak_bytes(d_model: int, tokens: int, rows: int) -> int:
    """UMT5 forward (fp32) over ``rows`` x ``tokens``: scores, position bias and softmax, plus the gated FFN."""
    heads = max(d_model // 64, 1)
    d_ff = (5 * d_model) // 2
    attention = 3 * heads * tokens * tokens
    hidden = tokens * (4 * d_model + 2 * d_ff)
    return int(ALLOWANCE * rows * _FP32 * (attention + hidden))


def image_encoder_peak_bytes(hidden: int, tokens: int) -> int:
    """CLIP vision tower (fp32) over one image's ``tokens`` patches: hidden states, q/k/v, the 4x MLP, scores."""
    heads = max(hidden // 80, 1)
    return int(ALLOWANCE * _FP32 * (tokens * 12 * hidden + 3 * heads * tokens * tokens))


# --------------------------------------------------------------------------- weights

#: The released encoders a real card loads with ``from_pretrained`` (its card config does not carry them):
#: UMT5-XXL's encoder (``google/umt5-xxl``, as Wan's text_encoder/config.json) and the CLIP ViT-H/14
#: vision tower of Wan 2.1 I2V (image_encoder/config.json).
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, feed_forward_proj="gated-gelu")
CLIP_VIT_H14 = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                    image_size=224, patch_size=14, projection_dim=1024, hidden_act="gelu")


def _elements(module: "torch.nn.Module") -> int:
    return sum(t.numel() for t in module.parameters()) + sum(t.numel() for t in module.buffers())


@lru_cache(maxsize=64)
def _meta_count(kind: str, component_id: str, config_json: str) -> int:
    import torch

    from fv_kernel.api import ComponentSpec

    from fv_wan.instance import _component_config  # the loaders' parse: the same typed errors (InvalidCard)

    spec = ComponentSpec.model_validate_json(config_json)
    with torch.device("meta"):
        if kind == "dit":
            return _elements(WanTransformer(_component_config(spec, WanTransformerConfig, WanTransformerConfig.from_diffusers_config)))
        if kind == "vae":
            vae = WanVAE(_component_config(spec, WanVAEConfig, WanVAEConfig.from_diffusers_config))
            # fv_wan.instance.load_vae keeps one half: the encoder (+ quant_conv) or the decoder (+ post_quant_conv).
            dropped = ("decoder", "post_quant_conv") if component_id == "vae_encoder" else ("encoder", "quant_conv")
            return _elements(vae) - sum(_elements(getattr(vae, name)) for name in dropped)
        if kind == "text_encoder":
            from transformers import UMT5Config, UMT5EncoderModel

            from fv_wan.component_configs import WanTextEncoderConfig
            from fv_wan.models.encoders import WanTextEncoder

            text = _component_config(spec, WanTextEncoderConfig, WanTextEncoderConfig.model_validate)
            if text.tiny is not None:
                return _elements(WanTextEncoder.tiny(0, **text.tiny.model_dump()))
            return _elements(UMT5EncoderModel(UMT5Config(**UMT5_XXL)))
        if kind == "image_encoder":
            from transformers import CLIPVisionConfig, CLIPVisionModel

            from fv_wan.component_configs import WanImageEncoderConfig
            from fv_wan.models.encoders import WanImageEncoder

            image = _component_config(spec, WanImageEncoderConfig, WanImageEncoderConfig.model_validate)
            if image.tiny is not None:
                return _elements(WanImageEncoder.tiny(0, **image.tiny.model_dump()))
            return _elements(CLIPVisionModel(CLIPVisionConfig(**CLIP_VIT_H14)))
    raise KeyError(f"fv-wan counts no weights of component kind {kind!r}")


def parameter_count(spec: "ComponentSpec") -> int:
    """Weight elements (parameters and buffers) of a Wan component as ``fv_wan.instance`` loads it,
    counted on the meta device (nothing allocated); the card's ``ComponentSpec.parameters``."""
    return _meta_count(spec.kind, spec.component_id, spec.model_dump_json())
