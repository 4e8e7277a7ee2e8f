"""The Cosmos 3 two-tower mixture-of-transformers, with separately callable loops.

One resident ``Cosmos3MoT`` holds both towers once. The runtime drives it through
explicit paths instead of one opaque forward:

* reasoner (text) loop: ``text_prefill`` then ``text_decode_step`` with an explicit
  ``TextKV`` passed in and returned;
* diffusion loop: ``text_kv_for_generation`` once per prompt (per guidance branch),
  then ``generate_batch`` every step against that cached text K/V, for every row
  (request x guidance branch) of one shape at once (``generate_forward``: one row).

Parameter names equal diffusers' ``Cosmos3OmniTransformer`` so its checkpoints load
with ``load_state_dict(strict=True)`` and no key map.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .config import Cosmos3Config
from .kv import KVPurpose, TextKV
from .layers import (
    AttentionFn,
    DomainAwareLinear,
    GatedMLP,
    MRoPE,
    RMSNorm,
    TimestepEmbedder,
    apply_rope,
    sdpa_attention,
)
from .positions import generation_positions, text_positions, video_patch_grid


def _head_norm(config: Cosmos3Config) -> RMSNorm:
    return RMSNorm(config.head_dim, config.rms_norm_eps, multiply_in_fp32=config.hidden_act == "relu2")


def _hidden_norm(config: Cosmos3Config) -> RMSNorm:
    return RMSNorm(config.hidden_size, config.rms_norm_eps, multiply_in_fp32=config.hidden_act == "relu2")


class Cosmos3MoTAttention(nn.Module):
    """Both towers' attention weights of one layer (reasoner: to_*, generator: add_* / to_add_out)."""

    def __init__(self, config: Cosmos3Config) -> None:
        super().__init__()
        c = config
        q_dim = c.num_attention_heads * c.head_dim
        kv_dim = c.num_key_value_heads * c.head_dim
        # Reasoner ("und") tower.
        self.to_q = nn.Linear(c.hidden_size, q_dim, bias=c.attention_bias)
        self.to_k = nn.Linear(c.hidden_size, kv_dim, bias=c.attention_bias)
        self.to_v = nn.Linear(c.hidden_size, kv_dim, bias=c.attention_bias)
        self.to_out = nn.Linear(q_dim, c.hidden_size, bias=c.attention_bias)
        self.norm_q: nn.Module = _head_norm(c) if c.qk_norm_for_text else nn.Identity()
        self.norm_k: nn.Module = _head_norm(c) if c.qk_norm_for_text else nn.Identity()
        self.k_norm_und_for_gen: nn.Module | None = _head_norm(c) if c.has_und_k_norm_for_gen else None
        # Generator ("gen") tower.
        self.add_q_proj = nn.Linear(c.hidden_size, q_dim, bias=c.attention_bias)
        self.add_k_proj = nn.Linear(c.hidden_size, kv_dim, bias=c.attention_bias)
        self.add_v_proj = nn.Linear(c.hidden_size, kv_dim, bias=c.attention_bias)
        self.to_add_out = nn.Linear(q_dim, c.hidden_size, bias=c.attention_bias)
        self.norm_added_q = _head_norm(c)
        self.norm_added_k = _head_norm(c)


class Cosmos3MoTLayer(nn.Module):
    def __init__(self, config: Cosmos3Config) -> None:
        super().__init__()
        self.self_attn = Cosmos3MoTAttention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.mlp_moe_gen = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = _hidden_norm(config)
        self.input_layernorm_moe_gen = _hidden_norm(config)
        self.post_attention_layernorm = _hidden_norm(config)
        self.post_attention_layernorm_moe_gen = _hidden_norm(config)


@dataclass(frozen=True)
class GeneratorOutput:
    """Velocity predictions, zero at clean (conditioning) frames.

    From ``generate_forward``: video (1, C, T, H, W); sound (sound_dim, T_sound) or None; action
    (T_action, action_dim) or None. From ``generate_batch``: the same with a leading batch on each.
    """

    video: torch.Tensor
    sound: torch.Tensor | None = None
    action: torch.Tensor | None = None


@dataclass(frozen=True)
class _TextTowerResult:
    hidden: torch.Tensor | None  # (B, T, hidden), pre final norm; None when the last MLP was skipped
    kv: TextKV  # the K/V of the tokens just processed (not including ``past``)


class Cosmos3MoT(nn.Module):
    """Both Cosmos 3 towers, held once; see the module docstring for the loop API."""

    def __init__(self, config: Cosmos3Config, attention: AttentionFn = sdpa_attention) -> None:
        super().__init__()
        self.config = config
        # Swappable kernel; a module attribute, but per-model, never per-request.
        self.attention: AttentionFn = attention
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([Cosmos3MoTLayer(c) for _ in range(c.num_hidden_layers)])
        self.norm = _hidden_norm(c)
        self.norm_moe_gen = _hidden_norm(c)
        self.rotary_emb = MRoPE(c.head_dim, c.rope_theta, c.rope_axes_dim)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.proj_in = nn.Linear(c.patch_latent_dim, c.hidden_size, bias=True)
        self.proj_out = nn.Linear(c.hidden_size, c.patch_latent_dim, bias=True)
        self.time_embedder = TimestepEmbedder(c.hidden_size)
        if c.action_gen:
            assert c.action_dim is not None  # guaranteed by Cosmos3Config
            self.action_proj_in = DomainAwareLinear(c.action_dim, c.hidden_size, c.num_embodiment_domains)
            self.action_proj_out = DomainAwareLinear(c.hidden_size, c.action_dim, c.num_embodiment_domains)
            self.action_modality_embed = nn.Parameter(torch.zeros(c.hidden_size))
        if c.sound_gen:
            assert c.sound_dim is not None
            self.audio_proj_in = nn.Linear(c.sound_dim, c.hidden_size, bias=True)
            self.audio_proj_out = nn.Linear(c.hidden_size, c.sound_dim, bias=True)
            self.audio_modality_embed = nn.Parameter(torch.zeros(c.hidden_size))

    # ------------------------------------------------------------------ helpers

    @property
    def _compute_dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def _split_heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, heads, self.config.head_dim)

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (3, B, L) -> cos/sin (B, L, head_dim)."""
        return self.rotary_emb(positions.to(self.embed_tokens.weight.device), self._compute_dtype)

    @staticmethod
    def _text_position_ids(position_ids: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        """Accept (B, T) text ids (used on all three axes) or full (3, B, T) ids."""
        if position_ids.ndim == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        if position_ids.ndim != 3 or position_ids.shape[0] != 3 or position_ids.shape[2] != length:
            raise ValueError(f"position_ids must be (B, {length}) or (3, B, {length}), got {tuple(position_ids.shape)}")
        if position_ids.shape[1] not in (1, batch):
            raise ValueError(f"position_ids batch {position_ids.shape[1]} does not match input batch {batch}")
        return position_ids.expand(3, batch, length)

    def _check_kv(self, kv: TextKV, wanted: KVPurpose) -> None:
        if kv.num_layers != self.config.num_hidden_layers:
            raise ValueError(f"TextKV has {kv.num_layers} layers, model has {self.config.num_hidden_layers}")
        if self.config.has_und_k_norm_for_gen and kv.purpose != wanted:
            raise ValueError(
                f"TextKV purpose is {kv.purpose!r} but {wanted!r} is needed: with use_und_k_norm_for_gen the "
                "generator attends to differently normalised text keys; build it with "
                + ("text_kv_for_generation()" if wanted == "generator" else "text_prefill()")
            )

    # ------------------------------------------------------------------ reasoner tower

    def _text_tower(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        past: TextKV | None,
        purpose: KVPurpose,
        skip_last_mlp: bool,
        past_valid: torch.Tensor | None = None,
        past_has_room: bool = False,
    ) -> _TextTowerResult:
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (B, T), got {tuple(input_ids.shape)}")
        batch, length = input_ids.shape
        # Loop plans build ids on the host; the tower runs where its weights are (masks too).
        device = self.embed_tokens.weight.device
        input_ids = input_ids.to(device)
        past_valid = None if past_valid is None else past_valid.to(device)
        past_len = 0 if past is None else past.length
        if past_has_room:
            # ``past`` ends in ``length`` free slots: the new tokens' K/V goes there, attention reads it in place.
            if past is None or past_len < length:
                raise ValueError(f"past_has_room needs a past with room for {length} new token(s)")
            past_len -= length
        if past is not None and past.batch_size != batch:
            raise ValueError(f"TextKV batch {past.batch_size} != input batch {batch}")
        if position_ids is None:
            position_ids = text_positions(length, past_len).unsqueeze(1)
        cos, sin = self._rope_tables(self._text_position_ids(position_ids, batch, length))

        # Causality: new token i sees every cached token and new tokens <= i.
        is_causal = past is None and length > 1
        attn_mask = None
        if past is not None and length > 1:
            attn_mask = torch.ones(length, past_len + length, dtype=torch.bool, device=input_ids.device).tril(
                diagonal=past_len
            )
        if past_valid is not None:
            # Batched decode over right-padded caches of different lengths: hide each row's padding.
            if past is None or past_valid.shape != (batch, past_len):
                raise ValueError(f"past_valid must be (B, past_len) = ({batch}, {past_len}), got {tuple(past_valid.shape)}")
            causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
            attn_mask = torch.cat(
                [past_valid[:, None, None, :].expand(batch, 1, length, past_len), causal.expand(batch, 1, length, length)],
                dim=-1,
            )

        c = self.config
        hidden = self.embed_tokens(input_ids)
        new_keys: list[torch.Tensor] = []
        new_values: list[torch.Tensor] = []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.norm_q(self._split_heads(attn.to_q(x), c.num_attention_heads)).transpose(1, 2)
            k = attn.norm_k(self._split_heads(attn.to_k(x), c.num_key_value_heads)).transpose(1, 2)
            v = self._split_heads(attn.to_v(x), c.num_key_value_heads).transpose(1, 2)
            q_rot = apply_rope(q, cos, sin)
            k_rot = apply_rope(k, cos, sin)
            if purpose == "generator" and attn.k_norm_und_for_gen is not None:
                new_keys.append(apply_rope(attn.k_norm_und_for_gen(k), cos, sin))
            else:
                new_keys.append(k_rot)
            new_values.append(v)
            if skip_last_mlp and i == last:
                # The K/V of the last layer is all the generator needs from it.
                return _TextTowerResult(hidden=None, kv=TextKV(tuple(new_keys), tuple(new_values), purpose))
            if past is not None and past_has_room:
                # Same keys, same order as the concatenation below; no copy of the history per layer.
                k_all, v_all = past.keys[i], past.values[i]
                k_all[:, :, past_len:].copy_(k_rot)
                v_all[:, :, past_len:].copy_(v)
            elif past is not None:
                k_all = torch.cat([past.keys[i], k_rot], dim=2)
                v_all = torch.cat([past.values[i], v], dim=2)
            else:
                k_all, v_all = k_rot, v
            out = self.attention(q_rot, k_all, v_all, is_causal=is_causal, attn_mask=attn_mask)
            hidden = hidden + attn.to_out(out.transpose(1, 2).reshape(batch, length, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return _TextTowerResult(hidden=hidden, kv=TextKV(tuple(new_keys), tuple(new_values), purpose))

    def _logits(self, hidden: torch.Tensor, all_positions: bool) -> torch.Tensor:
        if not all_positions:
            hidden = hidden[:, -1:]
        return self.lm_head(self.norm(hidden))

    def text_prefill(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        all_logits: bool = False,
    ) -> tuple[torch.Tensor, TextKV]:
        """Causal reasoner pass over a prompt.

        input_ids: (B, T). position_ids: (3, B, T), (B, T) or None for (i, i, i).
        Returns logits (B, 1, V) for the last token (or (B, T, V) with ``all_logits``)
        and the prompt's reasoner ``TextKV``.
        """
        result = self._text_tower(input_ids, position_ids, None, "reasoner", skip_last_mlp=False)
        assert result.hidden is not None
        return self._logits(result.hidden, all_logits), result.kv

    def text_decode_step(
        self,
        token_ids: torch.Tensor,
        kv: TextKV,
        positions: torch.Tensor | None = None,
        *,
        all_logits: bool = False,
    ) -> tuple[torch.Tensor, TextKV]:
        """Extend a reasoner cache by one (or a few) tokens.

        token_ids: (B, n). positions: as in ``text_prefill``; None continues at ``kv.length``.
        Returns logits (B, 1, V) (or (B, n, V)) and the extended cache (a new object).
        """
        self._check_kv(kv, "reasoner")
        result = self._text_tower(token_ids, positions, kv, "reasoner", skip_last_mlp=False)
        assert result.hidden is not None
        return self._logits(result.hidden, all_logits), kv.append(result.kv)

    def text_extend(
        self,
        token_ids: torch.Tensor,
        past: TextKV,
        positions: torch.Tensor | None = None,
        *,
        past_valid: torch.Tensor | None = None,
        past_has_room: bool = False,
    ) -> tuple[torch.Tensor, TextKV]:
        """Like ``text_decode_step`` but returns only the new tokens' K/V (for a paged cache
        that stores them itself), and accepts right-padded caches: ``past_valid`` (B, past_len)
        marks each row's real cached tokens, so rows of different lengths decode as one batch.
        Returns logits (B, n, V) and the new tokens' ``TextKV``.

        ``past_has_room``: ``past``'s last n token slots are free (``past.length`` = past_len + n): a
        buffer from ``PagedKVPool.gather_padded(..., extra=n)``, or the pool's own storage viewed by
        ``PagedKVPool.window``. Each layer writes the new tokens' K/V into those slots and attends over
        ``past`` as it is, instead of concatenating a copy of the whole history per layer; same result.
        """
        self._check_kv(past, "reasoner")
        result = self._text_tower(token_ids, positions, past, "reasoner", skip_last_mlp=False, past_valid=past_valid,
                                  past_has_room=past_has_room)
        assert result.hidden is not None
        return self._logits(result.hidden, True), result.kv

    def text_kv_for_generation(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> TextKV:
        """The per-layer reasoner K/V of a prompt, as the generator's queries see it.

        Depends on the prompt only, so compute it once per request and guidance branch.
        Skips ``norm``/``lm_head`` and the last layer's MLP, which the K/V cannot depend on.
        Equals ``text_prefill``'s cache on Nano/Super (shared weights); on Edge the keys
        additionally pass through ``k_norm_und_for_gen``.
        """
        return self._text_tower(input_ids, position_ids, None, "generator", skip_last_mlp=True).kv

    # ------------------------------------------------------------------ generator tower

    def _patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, T, H, W) -> (B, T * h * w, p * p * C), zero-padding H, W up to a multiple of p."""
        p = self.config.latent_patch_size
        b, c, t, h, w = latents.shape
        pad_h, pad_w = (-h) % p, (-w) % p
        if pad_h or pad_w:
            latents = nn.functional.pad(latents, (0, pad_w, 0, pad_h))
        hp, wp = (h + pad_h) // p, (w + pad_w) // p
        x = latents.reshape(b, c, t, hp, p, wp, p).permute(0, 2, 3, 5, 4, 6, 1)  # b, t, h, w, p, q, c
        return x.reshape(b, t * hp * wp, p * p * c)

    def _unpatchify(self, tokens: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
        """(B, frames * h * w, p * p * C) -> (B, C, frames, H, W), cropping the padding."""
        p = self.config.latent_patch_size
        c = self.config.latent_channel
        hp, wp = -(-height // p), -(-width // p)
        b = tokens.shape[0]
        x = tokens.reshape(b, frames, hp, wp, p, p, c).permute(0, 6, 1, 2, 4, 3, 5)  # b, c, t, h, p, w, q
        return x.reshape(b, c, frames, hp * p, wp * p)[:, :, :, :height, :width]

    def _time_embedding(self, timestep: float | torch.Tensor, batch: int, count: int, name: str) -> torch.Tensor:
        """(B, count, hidden) embedding rows for ``count`` noisy tokens of each of ``batch`` rows, from a scalar
        (every row), one timestep per row (B,), or one per token of each row (B, count)."""
        device = self.embed_tokens.weight.device
        t = torch.as_tensor(timestep, dtype=torch.float32, device=device)
        if t.numel() == 1:
            t = t.reshape(1, 1).expand(batch, 1)
        elif t.numel() == batch and t.ndim <= 1:
            t = t.reshape(batch, 1)
        elif t.numel() == batch * count:
            t = t.reshape(batch, count)
        else:
            raise ValueError(
                f"{name}: expected a scalar, {batch} per-row or {batch}x{count} per-token timesteps, got shape "
                f"{tuple(t.shape)}"
            )
        per_row = t.shape[1]
        emb = self.time_embedder(t.reshape(-1) * self.config.timestep_scale).to(self._compute_dtype)
        return emb.reshape(batch, per_row, -1).expand(batch, count, -1)

    @staticmethod
    def _noisy_indexes(noisy: torch.Tensor | list[int] | None, total: int, name: str, device: torch.device) -> torch.Tensor:
        if noisy is None:
            return torch.arange(total, device=device)
        idx = torch.as_tensor(noisy, dtype=torch.long, device=device).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= total):
            raise ValueError(f"{name} must index frames in [0, {total}), got {idx.tolist()}")
        return idx

    def generate_forward(
        self,
        text_kv: TextKV,
        video_latents: torch.Tensor,
        timestep: float | torch.Tensor,
        *,
        fps: float = 24.0,
        video_noisy_frames: torch.Tensor | list[int] | None = None,
        sound_latents: torch.Tensor | None = None,
        sound_timestep: float | torch.Tensor | None = None,
        action: torch.Tensor | None = None,
        action_domain: int | torch.Tensor | None = None,
        action_noisy_frames: torch.Tensor | list[int] | None = None,
        action_timestep: float | torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> GeneratorOutput:
        """One generator (denoiser) evaluation of one item against a cached prompt K/V
        (``generate_batch`` with a batch of one).

        text_kv: from ``text_kv_for_generation`` (batch 1); never recomputed here.
        video_latents: (1, C, T, H, W) normalised VAE latents (clean frames included).
        timestep: the flow timestep sigma * 1000 (scalar, or one per noisy video token);
            sound/action default to the same timestep.
        video_noisy_frames: latent-frame indexes that are noisy (default: all); the
            others are clean conditioning frames: no timestep embedding, zero velocity.
        sound_latents: (sound_dim, T_sound); action: (T_action, action_dim) padded to
            ``action_dim``, with ``action_domain`` the embodiment id.
        position_ids: (3, N_gen) override; default mirrors the diffusers pipeline
            (media start at text_len + margin, FPS-modulated temporal ids).
        """
        self._check_kv(text_kv, "generator")
        if text_kv.batch_size != 1:
            raise ValueError(f"generate_forward runs one item; text_kv batch is {text_kv.batch_size} (use generate_batch)")
        c = self.config
        if video_latents.ndim != 5 or video_latents.shape[0] != 1:
            raise ValueError(f"video_latents must be (1, {c.latent_channel}, T, H, W), got {tuple(video_latents.shape)}")
        if sound_latents is not None and not c.sound_gen:
            raise ValueError("sound_latents given but the config has sound_gen=False")
        if sound_latents is not None and (sound_latents.ndim != 2 or sound_latents.shape[0] != c.sound_dim):
            raise ValueError(f"sound_latents must be ({c.sound_dim}, T_sound), got {tuple(sound_latents.shape)}")
        if action is not None and not c.action_gen:
            raise ValueError("action given but the config has action_gen=False")
        if action is not None and (action.ndim != 2 or action.shape[1] != c.action_dim):
            raise ValueError(f"action must be (T_action, {c.action_dim}) (zero-padded), got {tuple(action.shape)}")
        if action_domain is not None and torch.as_tensor(action_domain).numel() != 1:
            raise ValueError(f"action_domain must be a single id, got {torch.as_tensor(action_domain).tolist()}")

        def one_row(t: float | torch.Tensor | None) -> float | torch.Tensor | None:
            # A per-token timestep of the single item is one row of per-token timesteps.
            return t.reshape(1, -1) if isinstance(t, torch.Tensor) and t.numel() > 1 else t

        out = self.generate_batch(
            text_kv, video_latents, one_row(timestep), fps=fps, video_noisy_frames=video_noisy_frames,  # type: ignore[arg-type]
            sound_latents=None if sound_latents is None else sound_latents.unsqueeze(0),
            sound_timestep=one_row(sound_timestep), action=None if action is None else action.unsqueeze(0),
            action_domain=action_domain, action_noisy_frames=action_noisy_frames,
            action_timestep=one_row(action_timestep), position_ids=position_ids,
        )
        return GeneratorOutput(
            video=out.video, sound=None if out.sound is None else out.sound[0],
            action=None if out.action is None else out.action[0],
        )

    def generate_batch(
        self,
        text_kv: TextKV,
        video_latents: torch.Tensor,
        timestep: float | torch.Tensor,
        *,
        fps: float = 24.0,
        video_noisy_frames: torch.Tensor | list[int] | None = None,
        sound_latents: torch.Tensor | None = None,
        sound_timestep: float | torch.Tensor | None = None,
        action: torch.Tensor | None = None,
        action_domain: int | torch.Tensor | None = None,
        action_noisy_frames: torch.Tensor | list[int] | None = None,
        action_timestep: float | torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> GeneratorOutput:
        """One generator evaluation of B items of one shape as one batch.

        The items share the geometry (latent shape, text length, sound and action lengths,
        noisy frames, fps), so they share positions and every tensor stacks on dim 0 with
        no padding or mask; they differ in their prompt K/V (``text_kv``, batch B), latents,
        timesteps and (per row) action domain. Items of different text lengths (guidance
        branches with different prompts) are different shapes: run one call per shape.

        video_latents: (B, C, T, H, W); timestep: scalar, (B,) or (B, noisy video tokens);
        sound_latents: (B, sound_dim, T_sound); action: (B, T_action, action_dim) with
        ``action_domain`` one id or (B,) ids. Returns video (B, C, T, H, W), sound
        (B, sound_dim, T_sound), action (B, T_action, action_dim).
        """
        c = self.config
        self._check_kv(text_kv, "generator")
        if video_latents.ndim != 5 or video_latents.shape[1] != c.latent_channel:
            raise ValueError(
                f"video_latents must be (B, {c.latent_channel}, T, H, W), got {tuple(video_latents.shape)}"
            )
        batch = video_latents.shape[0]
        if text_kv.batch_size != batch:
            raise ValueError(f"text_kv batch {text_kv.batch_size} != video_latents batch {batch}")
        device = self.embed_tokens.weight.device
        dtype = self._compute_dtype
        _, _, frames, height, width = video_latents.shape
        grid = video_patch_grid(tuple(video_latents.shape), c.latent_patch_size)
        tokens_per_frame = grid[1] * grid[2]

        # Video tokens; timestep embedding is added to noisy frames only (no AdaLN).
        video_noisy = self._noisy_indexes(video_noisy_frames, frames, "video_noisy_frames", device)
        video_tokens = self.proj_in(self._patchify(video_latents.to(dtype)))
        noisy_video_rows = (video_noisy[:, None] * tokens_per_frame + torch.arange(tokens_per_frame, device=device)).reshape(-1)
        if noisy_video_rows.numel():
            temb = self._time_embedding(timestep, batch, noisy_video_rows.numel(), "timestep")
            video_tokens = video_tokens.index_add(1, noisy_video_rows, temb)
        segments = [video_tokens]

        sound_len = 0
        if sound_latents is not None:
            if not c.sound_gen:
                raise ValueError("sound_latents given but the config has sound_gen=False")
            if sound_latents.ndim != 3 or sound_latents.shape[:2] != (batch, c.sound_dim):
                raise ValueError(f"sound_latents must be ({batch}, {c.sound_dim}, T_sound), got {tuple(sound_latents.shape)}")
            sound_len = sound_latents.shape[2]
            sound_tokens = self.audio_proj_in(sound_latents.transpose(1, 2).to(dtype)) + self.audio_modality_embed
            sound_t = timestep if sound_timestep is None else sound_timestep
            sound_tokens = sound_tokens + self._time_embedding(sound_t, batch, sound_len, "sound_timestep")
            segments.append(sound_tokens)

        action_len = 0
        action_noisy = torch.empty(0, dtype=torch.long, device=device)
        domain_ids = torch.empty(batch, 0, dtype=torch.long, device=device)
        if action is not None:
            if not c.action_gen:
                raise ValueError("action given but the config has action_gen=False")
            if action.ndim != 3 or action.shape[0] != batch or action.shape[2] != c.action_dim:
                raise ValueError(
                    f"action must be ({batch}, T_action, {c.action_dim}) (zero-padded), got {tuple(action.shape)}"
                )
            if action_domain is None:
                raise ValueError("action_domain (embodiment id) is required with action")
            action_len = action.shape[1]
            domain = torch.as_tensor(action_domain, dtype=torch.long, device=device).reshape(-1)
            if domain.numel() not in (1, batch):
                raise ValueError(f"action_domain must be one id or {batch} (one per row), got {domain.tolist()}")
            domain_ids = domain.reshape(-1, 1).expand(batch, action_len)
            action_tokens = self.action_proj_in(action.reshape(-1, c.action_dim).to(dtype), domain_ids.reshape(-1))
            action_tokens = action_tokens.reshape(batch, action_len, -1) + self.action_modality_embed
            action_noisy = self._noisy_indexes(action_noisy_frames, action_len, "action_noisy_frames", device)
            if action_noisy.numel():
                action_t = timestep if action_timestep is None else action_timestep
                temb = self._time_embedding(action_t, batch, action_noisy.numel(), "action_timestep")
                action_tokens = action_tokens.index_add(1, action_noisy, temb)
            segments.append(action_tokens)

        gen = torch.cat(segments, dim=1)  # (B, N_gen, hidden)
        n_gen = gen.shape[1]
        if position_ids is None:
            position_ids = generation_positions(
                c, text_len=text_kv.length, video_grid=grid, fps=fps, sound_len=sound_len, action_len=action_len
            )
        if position_ids.shape != (3, n_gen):
            raise ValueError(f"position_ids must be (3, {n_gen}) for the generator tokens, got {tuple(position_ids.shape)}")
        cos, sin = self._rope_tables(position_ids.unsqueeze(1))  # (1, N_gen, D): one table for every row

        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm_moe_gen(gen)
            q = attn.norm_added_q(self._split_heads(attn.add_q_proj(x), c.num_attention_heads)).transpose(1, 2)
            k = attn.norm_added_k(self._split_heads(attn.add_k_proj(x), c.num_key_value_heads)).transpose(1, 2)
            v = self._split_heads(attn.add_v_proj(x), c.num_key_value_heads).transpose(1, 2)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            # Bidirectional over [prompt K/V ; generator K/V], each row against its own prompt.
            k_all = torch.cat([text_kv.keys[i].to(k.dtype), k], dim=2)
            v_all = torch.cat([text_kv.values[i].to(v.dtype), v], dim=2)
            out = self.attention(q, k_all, v_all, is_causal=False, attn_mask=None)
            gen = gen + attn.to_add_out(out.transpose(1, 2).reshape(batch, n_gen, -1))
            gen = gen + layer.mlp_moe_gen(layer.post_attention_layernorm_moe_gen(gen))
        gen = self.norm_moe_gen(gen)

        num_video = frames * tokens_per_frame
        video_pred = torch.zeros(batch, c.latent_channel, frames, height, width, dtype=gen.dtype, device=device)
        if video_noisy.numel():
            patches = self.proj_out(gen[:, noisy_video_rows])
            video_pred[:, :, video_noisy] = self._unpatchify(patches, video_noisy.numel(), height, width)

        sound_pred = None
        if sound_latents is not None:
            sound_pred = self.audio_proj_out(gen[:, num_video : num_video + sound_len]).transpose(1, 2)

        action_pred = None
        if action is not None:
            start = num_video + sound_len
            action_pred = torch.zeros(batch, action_len, c.action_dim, dtype=gen.dtype, device=device)  # type: ignore[arg-type]
            if action_noisy.numel():
                rows = gen[:, start + action_noisy].reshape(-1, c.hidden_size)
                ids = domain_ids[:, : action_noisy.numel()].reshape(-1)
                action_pred[:, action_noisy] = self.action_proj_out(rows, ids).reshape(batch, action_noisy.numel(), -1)
        return GeneratorOutput(video=video_pred, sound=sound_pred, action=action_pred)

    def generate_forward_recompute(
        self,
        input_ids: torch.Tensor,
        video_latents: torch.Tensor,
        timestep: float | torch.Tensor,
        **kwargs: object,
    ) -> GeneratorOutput:
        """``generate_forward`` that recomputes the prompt's text tower on every call,
        as diffusers does each step (the baseline for the cached-text-K/V benchmark)."""
        text_kv = self.text_kv_for_generation(input_ids)
        return self.generate_forward(text_kv, video_latents, timestep, **kwargs)  # type: ignore[arg-type]
