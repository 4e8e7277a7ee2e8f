"""Causal Wan parity: chunk-by-chunk generation with the slab KV cache equals the same weights run
as one sequence under a block-causal attention mask.

The reference below is written from scratch with plain torch ops (patch embedding, timestep
sinusoid, adaLN blocks, 3-axis RoPE, explicit masked softmax attention, head, unpatchify) over
the transformer's state dict: it shares no code with ``fv_wan.models`` or ``fv_wan.causal``.
It replays the Self-Forcing sampler chunk by chunk: each chunk's forward sees the clean latents
of the earlier chunks at t = 0 (what the KV refresh commits) and its own noisy latents at t, in
one sequence whose mask lets a token attend to its own chunk and to the earlier chunks of its
window (sink + local).

Negative controls put a bug into the code under test and check the comparison fails: a chunk that
sees a future chunk, a stale KV entry after the refresh (the t=0 commit skipped), a wrong RoPE offset.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fv_kernel.api import (
    DiffusionParams, Done, InstanceOptions, LoopContext, Request, StepResult, TaskType, TextPart, build_instance,
)
from fv_wan import causal as causal_module
from fv_wan.cards import wan_cards
from fv_wan.causal import CausalRecipe, causal_card
from fv_wan.models import causal_transformer

SIZE = 32  # pixels: 4x4 latents, 2x2 tokens per latent frame on the tiny card
CHUNKS = 3


# --------------------------------------------------------------------------- the code under test, driven


def tiny_causal_card(*, sink: int = 0, local: int = 8, model_id: str = "wan-tiny-causal", sessions: int = 2,
                     prompt_update: str = "restart") -> Any:
    base = next(c for c in wan_cards() if c.model_id == "wan-tiny")
    recipe = CausalRecipe(max_height=SIZE, max_width=SIZE, sink_chunks=sink, local_chunks=local, max_sequence_length=16,
                          prompt_update=prompt_update)
    return causal_card(base, model_id=model_id, summary="tiny causal (tests)", recipe=recipe, sessions=sessions,
                       recipe_spec=base.recipe.model_copy(update={"assumes_loop": "realtime", "method": "self_forcing_dmd"}))


def tiny_instance(**card_kwargs: Any) -> Any:
    card = tiny_causal_card(**card_kwargs)
    instance = build_instance(card, InstanceOptions(device="cpu", precision="fp32"))
    instance.load_for_task(TaskType.TEXT_TO_VIDEO)
    return instance


def make_request(card_id: str, prompt: str = "a red ball", seed: int = 3, **diffusion: Any) -> Request:
    params = dict(height=SIZE, width=SIZE, fps=8.0, seed=seed, frames=1 + 4 * (3 * CHUNKS - 1))
    params.update(diffusion)
    return Request(model=card_id, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=prompt),),
                   diffusion=DiffusionParams(**params))


def run_loop(instance: Any, request: Request, *, state: Any = None, until_chunk: int | None = None) -> tuple[Any, list[Any]]:
    """Drive the card's realtime loop step by step with the instance's ops; returns the final state and the plans."""
    loop = instance.loop("realtime")
    ctx = LoopContext(request=request, executor=None)  # type: ignore[arg-type]
    state = loop.init(request, instance, ctx) if state is None else state
    plans = []
    while until_chunk is None or state.chunk_index < until_chunk:
        plan = loop.next(state)
        if isinstance(plan, Done):
            break
        plans.append(plan)
        state = loop.advance(state, StepResult(outputs=instance.op(plan.op).fn(plan.inputs, plan.params)))
    return state, plans


def generated_latents(plans: list[Any]) -> list[torch.Tensor]:
    """Each chunk's clean latents, as handed to its decode step."""
    return [p.inputs["z"] for p in plans if p.op == "vae_decode_chunk"]


# --------------------------------------------------------------------------- the independent reference


def _linear(x: torch.Tensor, sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return x @ sd[f"{name}.weight"].T + sd[f"{name}.bias"]


def _layer_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight + bias
    return y


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _rope_angles(head_dim: int, frames: int, height: int, width: int) -> torch.Tensor:
    """(L, head_dim/2) rotation angles: time, height, width frequency bands over absolute positions."""
    spatial = 2 * (head_dim // 6)
    dims = (head_dim - 2 * spatial, spatial, spatial)
    grids = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    parts = []
    for dim, pos in zip(dims, grids):
        inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        parts.append(pos.reshape(-1, 1).double() * inv[None])
    return torch.cat(parts, dim=1)


def _rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x (L, H, D): rotate pairs (x[2i], x[2i+1]) by angles (L, D/2)."""
    cos, sin = angles.cos().float()[:, None], angles.sin().float()[:, None]
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q (Lq, H, D), k/v (Lk, H, D); mask (Lq, Lk) True = may attend."""
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def reference_forward(sd: dict[str, torch.Tensor], cfg: Any, x: torch.Tensor, t_tokens: torch.Tensor,
                      text: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Wan's flow prediction for x (C, F, H, W) with per-token timesteps and a token mask; plain torch."""
    heads, hd, eps = cfg.num_attention_heads, cfg.attention_head_dim, cfg.eps
    pt, ph, pw = cfg.patch_size
    tokens = F.conv3d(x[None], sd["patch_embedding.weight"], sd["patch_embedding.bias"], stride=(pt, ph, pw))[0]
    f, h, w = tokens.shape[1:]
    tokens = tokens.flatten(1).T  # (L, D)
    half = cfg.freq_dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    angles_t = t_tokens[:, None].float() * freqs[None]
    sinusoid = torch.cat([angles_t.cos(), angles_t.sin()], dim=-1)
    temb = _linear(F.silu(_linear(sinusoid, sd, "condition_embedder.time_embedder.linear_1")), sd,
                   "condition_embedder.time_embedder.linear_2")
    tproj = _linear(F.silu(temb), sd, "condition_embedder.time_proj").reshape(-1, 6, tokens.shape[1])
    context = _linear(_gelu_tanh(_linear(text, sd, "condition_embedder.text_embedder.linear_1")), sd,
                      "condition_embedder.text_embedder.linear_2")
    rope = _rope_angles(hd, f, h, w)
    xs = tokens
    for i in range(cfg.num_layers):
        p = f"blocks.{i}"
        mod = sd[f"{p}.scale_shift_table"][0][None] + tproj  # (L, 6, D)
        shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = mod.unbind(1)
        n = _layer_norm(xs, eps) * (1 + scale_sa) + shift_sa
        q = _rms_norm(_linear(n, sd, f"{p}.attn1.to_q"), sd[f"{p}.attn1.norm_q.weight"], eps).reshape(-1, heads, hd)
        k = _rms_norm(_linear(n, sd, f"{p}.attn1.to_k"), sd[f"{p}.attn1.norm_k.weight"], eps).reshape(-1, heads, hd)
        v = _linear(n, sd, f"{p}.attn1.to_v").reshape(-1, heads, hd)
        att = _attention(_rotate(q, rope), _rotate(k, rope), v, mask).reshape(xs.shape[0], -1)
        xs = xs + _linear(att, sd, f"{p}.attn1.to_out.0") * gate_sa
        n = _layer_norm(xs, eps, sd[f"{p}.norm2.weight"], sd[f"{p}.norm2.bias"])
        q = _rms_norm(_linear(n, sd, f"{p}.attn2.to_q"), sd[f"{p}.attn2.norm_q.weight"], eps).reshape(-1, heads, hd)
        k = _rms_norm(_linear(context, sd, f"{p}.attn2.to_k"), sd[f"{p}.attn2.norm_k.weight"], eps).reshape(-1, heads, hd)
        v = _linear(context, sd, f"{p}.attn2.to_v").reshape(-1, heads, hd)
        xs = xs + _linear(_attention(q, k, v, None).reshape(xs.shape[0], -1), sd, f"{p}.attn2.to_out.0")
        n = _layer_norm(xs, eps) * (1 + scale_ff) + shift_ff
        xs = xs + _linear(_gelu_tanh(_linear(n, sd, f"{p}.ffn.net.0.proj")), sd, f"{p}.ffn.net.2") * gate_ff
    shift, scale = (sd["scale_shift_table"][0][None] + temb[:, None]).unbind(1)
    out = _linear(_layer_norm(xs, eps) * (1 + scale) + shift, sd, "proj_out")
    out = out.reshape(f, h, w, pt, ph, pw, -1).permute(6, 0, 3, 1, 4, 2, 5)
    return out.reshape(-1, f * pt, h * ph, w * pw)


def block_causal_mask(chunks: int, tokens_per_chunk: int, *, sink: int, local: int) -> torch.Tensor:
    """Token q (in chunk cq) may attend token k (in chunk ck) iff ck == cq, or ck < cq and ck is a sink
    chunk or one of the latest ``local - 1`` chunks before cq."""
    chunk = torch.arange(chunks).repeat_interleave(tokens_per_chunk)
    cq, ck = chunk[:, None], chunk[None, :]
    return (ck <= cq) & ((ck < sink) | (ck > cq - local))


#: Self-Forcing's warped steps, computed here from the shift formula t = 1000 * s*sigma / (1 + (s-1)*sigma).
def reference_timesteps(shift: float = 5.0) -> list[float]:
    return [1000 * shift * s / (1 + (shift - 1) * s) for s in (1.0, 0.75, 0.5, 0.25)]


def reference_generation(sd: dict[str, torch.Tensor], cfg: Any, text: torch.Tensor, *, seed: int, chunks: int,
                         latent_shape: tuple[int, ...], sink: int, local: int) -> list[torch.Tensor]:
    """The SF sampler over the reference forward: chunk by chunk, each step one masked full-sequence forward."""
    gen = torch.Generator().manual_seed(seed)
    ts = reference_timesteps()
    c, fpc, h, w = latent_shape
    tokens_per_chunk = fpc * (h // cfg.patch_size[1]) * (w // cfg.patch_size[2])
    done: list[torch.Tensor] = []
    for n in range(chunks):
        x = torch.randn((1, c, fpc, h, w), generator=gen)[0]
        mask = block_causal_mask(n + 1, tokens_per_chunk, sink=sink, local=local)
        for i, t in enumerate(ts):
            seq = torch.cat([*done, x], dim=1)
            t_tokens = torch.tensor([0.0] * (n * tokens_per_chunk) + [t] * tokens_per_chunk)
            flow = reference_forward(sd, cfg, seq, t_tokens, text[0], mask)[:, n * fpc :]
            x0 = x - t / 1000 * flow
            if i + 1 < len(ts):
                s = ts[i + 1] / 1000
                x = (1 - s) * x0 + s * torch.randn((1, c, fpc, h, w), generator=gen)[0]
        done.append(x0)
    return done


def _reference_for(instance: Any, state: Any, *, sink: int, local: int, chunks: int = CHUNKS, seed: int = 3) -> list[torch.Tensor]:
    model = instance.component("transformer")
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    return reference_generation(sd, model.config, state.context, seed=seed, chunks=chunks,
                                latent_shape=state.latent_shape, sink=sink, local=local)


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x[0] - y).abs().max()) for x, y in zip(a, b))


# --------------------------------------------------------------------------- tests


def test_warped_timesteps_are_self_forcing_s() -> None:
    recipe = CausalRecipe(max_height=SIZE, max_width=SIZE)
    assert recipe.timesteps == pytest.approx([1000.0, 937.5, 833.3333333, 625.0], abs=1e-6)
    assert recipe.timesteps == pytest.approx(reference_timesteps(), abs=1e-6)


@pytest.mark.parametrize(("sink", "local"), [(0, 8), (1, 2)], ids=["global", "sink1-local2"])
def test_chunked_kv_generation_equals_one_masked_sequence(sink: int, local: int) -> None:
    instance = tiny_instance(sink=sink, local=local)
    chunks = CHUNKS + (1 if sink else 0)  # the window variant runs long enough to evict
    request = make_request("wan-tiny-causal", frames=1 + 4 * (3 * chunks - 1))
    state, plans = run_loop(instance, request)
    assert state.chunk_index == chunks
    got = generated_latents(plans)
    want = _reference_for(instance, state, sink=sink, local=local, chunks=chunks)
    assert max_diff(got, want) <= 1e-5
    if sink:
        pool = instance.block_pools()["chunk_kv"]
        assert pool.evictions >= 1  # the window really rolled
        assert state.window.positions == (0, chunks - 2, chunks - 1)  # sink, then local (itself last)


def test_window_mask_matters() -> None:
    """The window variant's reference differs from the global one: the sink+local check is not vacuous."""
    instance = tiny_instance(sink=1, local=2)
    chunks = CHUNKS + 1
    state, plans = run_loop(instance, make_request("wan-tiny-causal", frames=1 + 4 * (3 * chunks - 1)))
    got = generated_latents(plans)
    assert max_diff(got, _reference_for(instance, state, sink=0, local=8, chunks=chunks)) > 1e-3


def test_negative_control_stale_kv_after_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip the t=0 commit: the slab keeps the K/V of the last noisy step (at t=625), not the clean chunk's."""
    instance = tiny_instance()

    def stale(self: Any, state: Any) -> tuple[torch.Tensor, float]:
        return state.latents, self._timesteps[-1]

    monkeypatch.setattr(causal_module.CausalWanRolloutLoop, "commit_inputs", stale)
    state, plans = run_loop(instance, make_request("wan-tiny-causal"))
    assert max_diff(generated_latents(plans), _reference_for(instance, state, sink=0, local=8)) > 1e-3


def test_negative_control_wrong_rope_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk's RoPE positions restart at frame 0 (chunk-relative instead of absolute)."""
    instance = tiny_instance()
    original = causal_transformer.chunk_rotary
    monkeypatch.setattr(causal_transformer, "chunk_rotary", lambda model, grid, start_frame: original(model, grid, 0))
    state, plans = run_loop(instance, make_request("wan-tiny-causal"))
    assert max_diff(generated_latents(plans), _reference_for(instance, state, sink=0, local=8)) > 1e-3


def test_teacher_forced_chunks_equal_masked_sequence_and_future_leak_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clean chunks committed one after another through the op; each chunk then evaluated noisy against its
    window's committed K/V equals the masked full-sequence forward. Negative control: a history read that
    forgets ``upto`` (so a chunk sees the chunks after it, already committed) fails the same comparison."""
    instance = tiny_instance()
    pool = instance.block_pools()["chunk_kv"]
    model = instance.component("transformer")
    cfg = model.config
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(11)
    fpc, h = 3, SIZE // 8
    clean = [torch.randn((1, cfg.in_channels, fpc, h, h), generator=gen) for _ in range(CHUNKS)]
    text = torch.randn((1, 16, cfg.text_dim), generator=gen)
    forward = instance.op("causal_forward").fn
    window = pool.open("teacher", causal_module.CausalRecipe(max_height=SIZE, max_width=SIZE, local_chunks=8).window)
    for n in range(CHUNKS):
        window, _ = pool.append(window, n)
        slabs, positions = pool.window_tensors(window)
        forward({"latents": clean[n], "timestep": torch.zeros(1), "context": text, "window_slabs": slabs[None],
                 "window_positions": positions[None], "chunk_index": torch.tensor([n]),
                 "start_frame": torch.tensor([n * fpc]), "commit": torch.tensor([True])},
                {"sink_slabs": window.spec.sink_slabs, "local_slabs": window.spec.local_slabs})
    t = 700.0
    noisy = [0.3 * c + 0.7 * torch.randn(c.shape, generator=gen) for c in clean]
    tokens_per_chunk = fpc * (h // 2) ** 2

    def evaluate() -> float:
        worst = 0.0
        for n in range(CHUNKS):
            history = causal_module._PoolHistory(pool, window, n)
            got = causal_transformer.causal_chunk_forward(model, noisy[n], torch.tensor([t]), text, start_frame=n * fpc,
                                                          history=history)
            seq = torch.cat([*(c[0] for c in clean[:n]), noisy[n][0]], dim=1)
            t_tokens = torch.tensor([0.0] * (n * tokens_per_chunk) + [t] * tokens_per_chunk)
            mask = block_causal_mask(n + 1, tokens_per_chunk, sink=0, local=8)
            want = reference_forward(sd, cfg, seq, t_tokens, text[0], mask)[:, n * fpc :]
            worst = max(worst, float((got[0] - want).abs().max()))
        return worst

    assert evaluate() <= 1e-5
    original = causal_module._PoolHistory.__init__
    monkeypatch.setattr(causal_module._PoolHistory, "__init__",
                        lambda self, pool, window, upto: original(self, pool, window, None))  # type: ignore[arg-type]
    assert evaluate() > 1e-3
    pool.close(window)
