"""Guidance policies vs diffusers' guiders / rescale math, branch selection, and dispatch."""

from __future__ import annotations

import pytest
import torch
from diffusers.guiders import ClassifierFreeGuidance, ClassifierFreeZeroStarGuidance
from diffusers.guiders.guider_utils import rescale_noise_cfg
from pydantic import ValidationError

from fv_kernel.loop.guidance import (
    COND,
    UNCOND,
    CFGNormalize,
    CFGZeroStar,
    ConditionalOnly,
    EmbeddedGuidance,
    GuidanceError,
    GuidancePolicy,
    GuidanceRescale,
    StandardCFG,
    builtin_guidance_policies,
    rescale_to_reference_std,
    run_branches,
    split_branches,
    stack_branches,
    zero_star_scale,
)

SHAPE = (3, 4, 2, 5, 5)


def _pair(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cond = torch.randn(SHAPE, generator=g)
    # Correlated uncond so CFG-Zero*'s projection is far from trivial.
    uncond = 0.6 * cond + 0.5 * torch.randn(SHAPE, generator=g)
    return {COND: cond.to(dtype), UNCOND: uncond.to(dtype)}


def _diffusers(guider, outputs: dict[str, torch.Tensor], step: int, steps: int = 10) -> torch.Tensor:
    guider.set_state(step=step, num_inference_steps=steps, timestep=None)
    uncond = outputs.get(UNCOND) if guider.num_conditions == 2 else None
    return guider.forward(outputs[COND], uncond).pred


@pytest.mark.parametrize("scale", [2.0, 5.0, 7.5])
def test_standard_cfg_matches_diffusers(scale: float) -> None:
    outputs = _pair(1)
    ours = StandardCFG().combine(outputs, scale, step_index=0)
    assert torch.equal(ours, _diffusers(ClassifierFreeGuidance(guidance_scale=scale), outputs, 0))


def test_standard_cfg_branch_selection() -> None:
    wan, cosmos = StandardCFG(), StandardCFG(active_when="not_one")
    assert wan.branches(5.0) == (COND, UNCOND)
    assert wan.branches(1.0) == wan.branches(0.5) == (COND,)  # Wan: guidance_scale > 1
    assert cosmos.branches(1.0) == (COND,)
    assert cosmos.branches(0.5) == (COND, UNCOND)  # Cosmos 3 / guiders: != 1
    outputs = _pair(2)
    assert wan.combine({COND: outputs[COND]}, 1.0, step_index=0) is outputs[COND]
    # Below one, the "not_one" semantics guide (away from cond) exactly like the diffusers guider.
    ours = cosmos.combine(outputs, 0.5, step_index=0)
    assert torch.equal(ours, _diffusers(ClassifierFreeGuidance(guidance_scale=0.5), outputs, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_cfg_zero_star_matches_diffusers(dtype: torch.dtype, scale: float) -> None:
    outputs = _pair(3, dtype)
    policy = CFGZeroStar(zero_init_steps=2)
    guider = ClassifierFreeZeroStarGuidance(guidance_scale=scale, zero_init_steps=2)
    for step in range(5):
        names = policy.branches(scale)
        ours = policy.combine({n: outputs[n] for n in names}, scale, step_index=step)
        theirs = _diffusers(guider, outputs, step, steps=5)
        assert ours.dtype == dtype
        assert torch.equal(ours, theirs), f"step {step}"
        if step < 2:
            assert torch.count_nonzero(ours) == 0


def test_zero_star_scale_is_the_per_sample_projection() -> None:
    outputs = _pair(4)
    st = zero_star_scale(outputs[COND], outputs[UNCOND])
    assert st.shape == (SHAPE[0], 1, 1, 1, 1)
    c, u = outputs[COND].double().flatten(1), outputs[UNCOND].double().flatten(1)
    expected = (c * u).sum(1) / (u * u).sum(1)
    torch.testing.assert_close(st.flatten().double(), expected, rtol=1e-5, atol=0)
    # The projected uncond is the least-squares fit of cond: the residual is orthogonal to uncond.
    residual = (outputs[COND] - outputs[UNCOND] * st).flatten(1)
    assert (residual * outputs[UNCOND].flatten(1)).sum(1).abs().max() < 1e-3
    with pytest.raises(GuidanceError, match="batch dim"):
        zero_star_scale(torch.ones(4), torch.ones(4))


@pytest.mark.parametrize("phi", [0.0, 0.3, 0.7, 1.0])
def test_guidance_rescale_matches_diffusers_guider(phi: float) -> None:
    outputs = _pair(5)
    policy = GuidanceRescale(inner=StandardCFG(), phi=phi)
    ours = policy.combine(outputs, 6.0, step_index=0)
    theirs = _diffusers(ClassifierFreeGuidance(guidance_scale=6.0, guidance_rescale=phi), outputs, 0)
    assert torch.equal(ours, theirs)
    guided = StandardCFG().combine(outputs, 6.0, step_index=0)
    reference = rescale_noise_cfg(guided, outputs[COND], phi)
    assert torch.equal(rescale_to_reference_std(guided, outputs[COND], phi), reference)
    if phi == 1.0:  # fully rescaled: per-sample std equals the conditional one
        dims = list(range(1, len(SHAPE)))
        torch.testing.assert_close(ours.std(dim=dims), outputs[COND].std(dim=dims))


def test_guidance_rescale_over_cfg_zero_star() -> None:
    outputs = _pair(6)
    policy = GuidanceRescale(inner=CFGZeroStar(zero_init_steps=1), phi=0.5)
    guider = ClassifierFreeZeroStarGuidance(guidance_scale=4.0, zero_init_steps=1, guidance_rescale=0.5)
    assert torch.equal(policy.combine(outputs, 4.0, step_index=3), _diffusers(guider, outputs, 3))
    # At a zero-init step diffusers divides by a zero std and returns NaN; we keep the zeros.
    assert torch.isnan(_diffusers(guider, outputs, 0)).all()
    zero = policy.combine(outputs, 4.0, step_index=0)
    assert torch.count_nonzero(zero) == 0
    # Inactive inner policy: nothing to rescale, the conditional prediction passes through.
    cond_only = {COND: outputs[COND]}
    assert policy.branches(1.0) == (COND,)
    assert policy.combine(cond_only, 1.0, step_index=3) is outputs[COND]


def test_cfg_normalize_matches_qwenimage_formula() -> None:
    # diffusers' QwenImage-Layered pipeline: comb * (||cond|| / ||comb||) over the last dim.
    outputs = _pair(7)
    comb = outputs[UNCOND] + 3.0 * (outputs[COND] - outputs[UNCOND])
    expected = comb * (torch.norm(outputs[COND], dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    ours = CFGNormalize(inner=StandardCFG()).combine(outputs, 3.0, step_index=0)
    assert torch.equal(ours, expected)
    torch.testing.assert_close(ours.norm(dim=-1), outputs[COND].norm(dim=-1))


def test_embedded_and_conditional_only_are_single_branch_identity() -> None:
    outputs = _pair(8)
    embedded, none = EmbeddedGuidance(), ConditionalOnly()
    for policy in (embedded, none):
        assert policy.branches(3.5) == (COND,)
        assert policy.combine({COND: outputs[COND]}, 3.5, step_index=4) is outputs[COND]
        assert not policy.is_distribution_altering
    assert embedded.forward_kwargs(3.5) == {"guidance": 3.5}
    assert EmbeddedGuidance(kwarg="guidance_scale").forward_kwargs(2) == {"guidance_scale": 2.0}
    assert none.forward_kwargs(3.5) == {} and StandardCFG().forward_kwargs(3.5) == {}
    assert StandardCFG().is_distribution_altering and CFGZeroStar().is_distribution_altering
    assert GuidanceRescale(inner=StandardCFG()).is_distribution_altering
    assert GuidanceRescale(inner=EmbeddedGuidance()).forward_kwargs(2.0) == {"guidance": 2.0}


def test_missing_branch_and_bad_scale() -> None:
    outputs = _pair(9)
    with pytest.raises(GuidanceError, match=r"missing \['uncond'\]"):
        StandardCFG().combine({COND: outputs[COND]}, 5.0, step_index=0)
    with pytest.raises(GuidanceError, match="share one shape"):
        StandardCFG().combine({COND: outputs[COND], UNCOND: outputs[UNCOND][:1]}, 5.0, step_index=0)
    for scale in (float("nan"), float("inf"), "5"):
        with pytest.raises(GuidanceError, match="finite number"):
            StandardCFG().branches(scale)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: StandardCFG(active_when="always"), "active_when"),
        (lambda: StandardCFG(scale=3.0), "scale"),
        (lambda: CFGZeroStar(zero_init_steps=-1), "zero_init_steps"),
        (lambda: GuidanceRescale(inner=StandardCFG(), phi=1.5), "phi"),
        (lambda: GuidanceRescale(phi=0.5), "inner"),
        (lambda: EmbeddedGuidance(kwarg=""), "kwarg"),
    ],
)
def test_config_validation(build, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        build()


def test_signatures_and_builtin_names() -> None:
    a = GuidanceRescale(inner=CFGZeroStar(zero_init_steps=2), phi=0.5).config_signature()
    assert a == GuidanceRescale(inner=CFGZeroStar(zero_init_steps=2), phi=0.5).config_signature()
    assert a != GuidanceRescale(inner=CFGZeroStar(zero_init_steps=3), phi=0.5).config_signature()
    assert "cfg_zero_star" in a and a.startswith("rescale:")
    names = builtin_guidance_policies()
    assert set(names) == {"cfg", "cfg_zero_star", "rescale", "cfg_normalize", "embedded", "none"}
    assert all(issubclass(cls, GuidancePolicy) for cls in names.values())


# --------------------------------------------------------------------------- dispatch


def _toy_forward(latents: torch.Tensor, text: torch.Tensor, timestep: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-sample model (no cross-batch mixing, no batch-size-dependent kernels)."""
    assert mode == "video"
    context = text.mean(dim=1)[:, :, None, None, None]
    return torch.tanh(latents * context[:, :4] + timestep.reshape(-1, 1, 1, 1, 1) / 1000)


@pytest.mark.parametrize(
    "policy", [StandardCFG(), CFGZeroStar(zero_init_steps=0), GuidanceRescale(inner=StandardCFG(), phi=0.7)]
)
def test_batched_and_sequential_dispatch_are_identical(policy: GuidancePolicy) -> None:
    g = torch.Generator().manual_seed(10)
    latents = torch.randn(2, 4, 2, 3, 3, generator=g)
    text = {COND: torch.randn(2, 6, 8, generator=g), UNCOND: torch.zeros(2, 6, 8)}
    timestep = torch.full((2,), 757.0)
    scale = 5.0
    inputs = {
        name: {"latents": latents, "text": text[name], "timestep": timestep, "mode": "video"}
        for name in policy.branches(scale)
    }
    sequential = run_branches(_toy_forward, inputs, batched=False)
    batched = run_branches(_toy_forward, inputs, batched=True)
    assert list(batched) == list(sequential) == [COND, UNCOND]
    for name in sequential:
        assert torch.equal(batched[name], sequential[name])
    assert torch.equal(
        policy.combine(batched, scale, step_index=1), policy.combine(sequential, scale, step_index=1)
    )
    assert not torch.equal(sequential[COND], sequential[UNCOND])  # the branches really differ


def test_stack_and_split_round_trip_and_errors() -> None:
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    parts = split_branches(stack_branches([a, b]), (COND, UNCOND))
    assert torch.equal(parts[COND], a) and torch.equal(parts[UNCOND], b)
    with pytest.raises(GuidanceError, match="equal trailing shapes"):
        stack_branches([torch.randn(2, 3), torch.randn(2, 4)])
    with pytest.raises(GuidanceError, match="cannot split into 2"):
        split_branches(torch.randn(3, 2), (COND, UNCOND))
    with pytest.raises(GuidanceError, match="distinct"):
        split_branches(torch.randn(4, 2), (COND, COND))
    inputs = {COND: {"x": a, "mode": "a"}, UNCOND: {"x": b, "mode": "b"}}
    with pytest.raises(GuidanceError, match="'mode' differs"):
        run_branches(lambda x, mode: x, inputs, batched=True)
    with pytest.raises(GuidanceError, match="kwargs"):
        run_branches(lambda x: x, {COND: {"x": a}, UNCOND: {"y": b}}, batched=True)
