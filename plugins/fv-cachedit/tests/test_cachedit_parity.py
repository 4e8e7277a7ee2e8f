"""Decision parity with the cache-dit library (1.5.3) on the same tiny model, inputs and settings.

A plain ``nn.Module`` whose ``blocks`` follow cache-dit's ``ForwardPattern.Pattern_3``
(``block(hidden_states, temb) -> hidden_states``) is driven by a flow-matching Euler loop
with CFG run as two forwards per step (cond, then uncond), once under
``cache_dit.enable_cache`` and once through fv-cachedit's interceptors with one state per
branch. The per-step, per-branch reuse decisions must be the same, and so (same kernels,
same order) must the final latents, bit for bit.

Differences by design (and how the test keeps them out of the comparison):

- cache-dit infers the step by counting transformer calls on the model and assumes cond
  and uncond alternate; fv takes the step index and branch from the loop. Equal here
  because the driver alternates; :func:`test_interleaving_two_requests_corrupts_cache_dit_not_fv`
  shows where they part.
- cache-dit's TaylorSeer state starts counting one call late and only takes derivatives
  from its 4th update (the 2nd derivative from its 5th); fv builds the ladder from the
  second computed step. With ``max_warmup_steps >= 3 + order`` (cache-dit's default is 8)
  both ladders are full before the first reuse, and the two agree exactly.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")
cache_dit = pytest.importorskip("cache_dit")

from fv_cachedit import DBCache, FBCache, TaylorSeer  # noqa: E402
from fv_kernel.extend.interceptors import BlockCall  # noqa: E402

DIM, TOKENS, STEPS, GUIDANCE = 16, 12, 24, 4.0


class Block(nn.Module):
    """A modulated MLP block: ``hidden + mlp(norm(hidden) * (1 + scale) + shift)``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM, elementwise_affine=False)
        self.modulation = nn.Linear(DIM, 2 * DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.modulation(temb).unsqueeze(1).chunk(2, dim=-1)
        return hidden_states + self.mlp(self.norm(hidden_states) * (1 + scale) + shift)


class TinyDiT(nn.Module):
    def __init__(self, layers: int = 6) -> None:
        super().__init__()
        self.proj_in = nn.Linear(4, DIM)
        self.time = nn.Sequential(nn.Linear(1, DIM), nn.SiLU(), nn.Linear(DIM, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.proj_out = nn.Linear(DIM, 4)

    def embed(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.proj_in(x), self.time(t.view(-1, 1)) + cond

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        hidden, temb = self.embed(x, t, cond)
        for block in self.blocks:
            hidden = block(hidden, temb)
        return self.proj_out(hidden)


class Blocks:
    """TinyDiT's block stack for one forward, as fv's block hooks see it."""

    def __init__(self, model: TinyDiT, temb: torch.Tensor) -> None:
        self.model, self.temb = model, temb

    @property
    def num_blocks(self) -> int:
        return len(self.model.blocks)

    def run(self, start: int, stop: int, hidden: torch.Tensor) -> torch.Tensor:
        for index in range(start, stop):
            hidden = self.model.blocks[index](hidden, self.temb)
        return hidden


def make_model(seed: int = 0) -> TinyDiT:
    torch.manual_seed(seed)
    return TinyDiT().eval()


def denoise(forward: Any, seed: int) -> torch.Tensor:
    """Euler flow matching with CFG as two forwards per step (cond first, as cache-dit expects)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, TOKENS, 4, generator=generator)
    cond, uncond = torch.randn(1, DIM, generator=generator), torch.zeros(1, DIM)
    sigmas = torch.linspace(1.0, 0.0, STEPS + 1)
    for step in range(STEPS):
        t = sigmas[step].reshape(1) * 1000
        v_cond = forward(x, t, cond, step, "cond")
        v_uncond = forward(x, t, uncond, step, "uncond")
        x = x + (sigmas[step + 1] - sigmas[step]) * (v_uncond + GUIDANCE * (v_cond - v_uncond))
    return x


def run_cache_dit(settings: dict[str, Any], taylorseer_order: int | None, seed: int = 1) -> tuple[torch.Tensor, dict[str, list[int]]]:
    model = make_model()
    calibrator = None
    if taylorseer_order is not None:
        calibrator = cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=taylorseer_order)
    config = cache_dit.DBCacheConfig(
        Fn_compute_blocks=settings["fn_compute_blocks"], Bn_compute_blocks=settings["bn_compute_blocks"],
        residual_diff_threshold=settings["residual_diff_threshold"], max_warmup_steps=settings["max_warmup_steps"],
        warmup_interval=settings["warmup_interval"], max_cached_steps=settings["max_cached_steps"],
        max_continuous_cached_steps=settings["max_continuous_cached_steps"], enable_separate_cfg=True,
        num_inference_steps=STEPS,
    )
    adapter = cache_dit.BlockAdapter(
        transformer=model, blocks=model.blocks, forward_pattern=cache_dit.ForwardPattern.Pattern_3,
        check_forward_pattern=False,
    )
    cache_dit.enable_cache(adapter, cache_config=config, calibrator_config=calibrator)
    with torch.no_grad():
        out = denoise(lambda x, t, c, step, branch: model(x, t, c), seed)
    [stats] = cache_dit.summary(model, logging=False)[:1]
    return out, {"cond": list(stats.cached_steps), "uncond": list(stats.cfg_cached_steps)}


def run_fv(interceptor: DBCache, params: Any, seed: int = 1) -> tuple[torch.Tensor, dict[str, list[int]]]:
    model = make_model()
    states: dict[str, dict[str, Any]] = {"cond": {}, "uncond": {}}

    def forward(x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, step: int, branch: str) -> torch.Tensor:
        hidden, temb = model.embed(x, t, cond)
        call = BlockCall(request_id="r", loop_id="denoise", branch=branch, step_index=step, num_steps=STEPS)
        hidden = interceptor.run_blocks(Blocks(model, temb), hidden, states[branch], params, call)
        return model.proj_out(hidden)

    with torch.no_grad():
        out = denoise(forward, seed)
    return out, {branch: list(state.get("cached_steps", [])) for branch, state in states.items()}


BASE = dict(fn_compute_blocks=1, bn_compute_blocks=0, residual_diff_threshold=0.08, max_warmup_steps=2, warmup_interval=1,
            max_cached_steps=-1, max_continuous_cached_steps=-1)
CASES = {
    "fbcache-0.05": dict(BASE, residual_diff_threshold=0.05),
    "fbcache-0.12": dict(BASE, residual_diff_threshold=0.12),
    "F2B1-0.08": dict(BASE, fn_compute_blocks=2, bn_compute_blocks=1),
    "F2B2-0.3-caps": dict(BASE, fn_compute_blocks=2, bn_compute_blocks=2, residual_diff_threshold=0.3, max_cached_steps=8,
                          max_continuous_cached_steps=2),
    "warmup-interval": dict(BASE, residual_diff_threshold=0.2, max_warmup_steps=8, warmup_interval=3),
    "taylorseer-1": dict(BASE, residual_diff_threshold=0.15, max_warmup_steps=4),
    "taylorseer-2": dict(BASE, residual_diff_threshold=0.15, max_warmup_steps=5),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_skip_decisions_and_outputs_match_cache_dit(case: str) -> None:
    settings = CASES[case]
    order = int(case.split("-")[1]) if case.startswith("taylorseer") else None
    if order is not None:
        interceptor: DBCache = TaylorSeer(TaylorSeer.config_model(**settings, taylorseer_order=order))
    elif settings["fn_compute_blocks"] == 1:
        interceptor = FBCache(FBCache.config_model(**{k: v for k, v in settings.items() if k != "fn_compute_blocks"}))
    else:
        interceptor = DBCache(DBCache.config_model(**settings))
    params = interceptor.parse_params({})
    reference_out, reference = run_cache_dit(settings, order)
    fv_out, decisions = run_fv(interceptor, params)
    assert decisions == reference, f"{case}: fv {decisions} vs cache-dit {reference}"
    assert torch.equal(fv_out, reference_out), f"{case}: max diff {(fv_out - reference_out).abs().max().item()}"


def test_the_cases_exercise_both_outcomes() -> None:
    """Guards the parity test against passing vacuously (nothing cached, or everything)."""
    some_cached = some_computed_after_warmup = 0
    for settings in (CASES["fbcache-0.05"], CASES["fbcache-0.12"], CASES["F2B1-0.08"]):
        interceptor = DBCache(DBCache.config_model(**settings))
        _, decisions = run_fv(interceptor, interceptor.parse_params({}))
        cached = decisions["cond"]
        some_cached += bool(cached)
        some_computed_after_warmup += len(cached) < STEPS - settings["max_warmup_steps"]
    assert some_cached >= 2 and some_computed_after_warmup >= 2


def test_interleaving_two_requests_corrupts_cache_dit_not_fv() -> None:
    """The design difference: cache-dit keeps one step counter and one residual per model;
    fv keeps both per request. Two requests stepping alternately on one model:
    cache-dit's decisions change, fv's equal each request's serial run."""
    settings = CASES["fbcache-0.12"]

    def alternate(forward_for: Any) -> list[list[Any]]:
        calls: list[list[Any]] = [[], []]
        generators = [torch.Generator().manual_seed(s) for s in (1, 2)]
        xs = [torch.randn(1, TOKENS, 4, generator=g) for g in generators]
        conds = [torch.randn(1, DIM, generator=g) for g in generators]
        sigmas = torch.linspace(1.0, 0.0, STEPS + 1)
        for step in range(STEPS):
            t = sigmas[step].reshape(1) * 1000
            for r in (0, 1):
                v_c = forward_for(r, xs[r], t, conds[r], step, "cond")
                v_u = forward_for(r, xs[r], t, torch.zeros(1, DIM), step, "uncond")
                xs[r] = xs[r] + (sigmas[step + 1] - sigmas[step]) * (v_u + GUIDANCE * (v_c - v_u))
        calls[0], calls[1] = [xs[0]], [xs[1]]
        return calls

    # fv: one interceptor, one model, two requests' states.
    model = make_model()
    interceptor = FBCache(FBCache.config_model(**{k: v for k, v in settings.items() if k != "fn_compute_blocks"}))
    params = interceptor.parse_params({})
    states = [{"cond": {}, "uncond": {}}, {"cond": {}, "uncond": {}}]

    def fv_forward(r: int, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor, step: int, branch: str) -> torch.Tensor:
        hidden, temb = model.embed(x, t, c)
        call = BlockCall(request_id=str(r), loop_id="denoise", branch=branch, step_index=step, num_steps=STEPS)
        return model.proj_out(interceptor.run_blocks(Blocks(model, temb), hidden, states[r][branch], params, call))

    with torch.no_grad():
        fv_interleaved = alternate(fv_forward)
    fv_serial = [run_fv(interceptor, params, seed=s)[0] for s in (1, 2)]
    assert torch.equal(fv_interleaved[0][0], fv_serial[0]) and torch.equal(fv_interleaved[1][0], fv_serial[1])

    # cache-dit: the same two requests alternating on one cached model.
    cached_model = make_model()
    config = cache_dit.DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.12,
                                     max_warmup_steps=2, enable_separate_cfg=True)
    cache_dit.enable_cache(cache_dit.BlockAdapter(transformer=cached_model, blocks=cached_model.blocks,
                                                  forward_pattern=cache_dit.ForwardPattern.Pattern_3,
                                                  check_forward_pattern=False), cache_config=config)
    with torch.no_grad():
        cd_interleaved = alternate(lambda r, x, t, c, step, branch: cached_model(x, t, c))
    cd_serial, _ = run_cache_dit(settings, None, seed=1)
    assert not torch.equal(cd_interleaved[0][0], cd_serial), "cache-dit shares one state across the two requests"
