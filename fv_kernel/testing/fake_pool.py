"""A fake pool for scheduler tests and simulations: cards whose steps cost what you say.

``fake-video``, ``fake-image`` and ``fake-ar`` cards run loops whose step is a tiny
tensor update plus an optional sleep that stands in for device time. The sleep for
a batch of ``b`` steps is ``cost(b)`` from a profile (e.g. measured single-frame
times at batch 1, 8 and 32), so batching pays exactly as much as the profile says.

Failure injection, per request, through the prompt text: ``fail@K`` raises at step K,
``nan@K`` returns NaN at step K.
"""

from __future__ import annotations

import re
import time
from typing import Any, Mapping

import torch

from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.instance import ModelInstance
from fv_kernel.loop.plan import StepOp
from fv_kernel.card.spec import (
    CapabilityMatrix,
    CheckpointManifest,
    ComponentCheckpoint,
    ComponentSpec,
    GenerationDefaults,
    LoopSpec,
    ModelCard,
    ParitySpec,
    PrecisionContract,
    ProgramSpec,
    RecipeSpec,
    StepCostSpec,
)
from fv_kernel.loop.contract import LoopContext
from fv_kernel.loop.contract import Done, Loop, LoopResult, LoopState
from fv_kernel.loop.plan import ResourceRequest, ShapeSignature, StepEstimate, StepResult, WorkKind, WorkPlan
from fv_kernel.request.artifacts import LatentArtifact, Provenance
from fv_kernel.request.request import Request
from fv_kernel.request.types import TaskType

__all__ = ["BatchCostProfile", "fake_card", "FakeStepLoop", "FakeARLoop", "build_fake_instance", "injected_at"]

_MODULE = "fv_kernel.testing.fake_pool"


class BatchCostProfile:
    """Seconds for a batch of ``b`` steps, linearly interpolated between measured points."""

    def __init__(self, points: Mapping[int, float]) -> None:
        if not points:
            raise ValueError("a cost profile needs at least one (batch, seconds) point")
        self.points = sorted(points.items())

    def __call__(self, batch: int) -> float:
        pts = self.points
        if batch <= pts[0][0]:
            return pts[0][1] * batch / pts[0][0]
        for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
            if batch <= b1:
                return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
        (b0, s0), (b1, s1) = pts[-2:] if len(pts) > 1 else (pts[0], (pts[0][0] * 2, pts[0][1] * 2))
        return s1 + (s1 - s0) * (batch - b1) / (b1 - b0)


class FakeState(LoopState):
    value: torch.Tensor
    total: int
    fail_at: int | None = None
    nan_at: int | None = None
    #: Precomputed flags: the fake loop's own per-step cost stays out of scheduler measurements.
    no: torch.Tensor = torch.tensor([False])
    yes: torch.Tensor = torch.tensor([True])


def injected_at(prompt: str, what: str) -> int | None:
    """K from ``{what}@K`` in ``prompt`` (failure injection for the toy cards), None when absent."""
    match = re.search(rf"{what}@(\d+)", prompt)
    return int(match.group(1)) if match else None


def _injected(request: Request, what: str) -> int | None:
    return injected_at(request.text("prompt") or "", what)


class FakeStepLoop(Loop[FakeState]):
    """``steps`` steps of ``value += 1``; kind and cost come from the card's LoopSpec."""

    kind = "diffusion_denoise"
    state_type = FakeState

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> FakeState:
        steps = request.ar.max_tokens if request.ar is not None else (request.diffusion.steps or 1)
        seed = request.ar.seed if request.ar is not None else request.diffusion.seed
        return FakeState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id,
            value=torch.full((1, 4), float(seed)), total=steps,
            fail_at=_injected(request, "fail"), nan_at=_injected(request, "nan"),
        )

    def next(self, state: FakeState) -> WorkPlan | Done:
        if state.step >= state.total:
            return Done()
        kind = WorkKind(model_kind(self.spec))
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=kind, op="fake_step",
            inputs={"value": state.value,
                    "fail": state.yes if state.step == state.fail_at else state.no,
                    "nan": state.yes if state.step == state.nan_at else state.no},
            params={"step_kind": kind.value},
            shape_sig=ShapeSignature.of(tokens=1),
        )

    def advance(self, state: FakeState, result: StepResult) -> FakeState:
        return state.model_copy(update={"value": result.outputs["value"], "step": state.step + 1})

    def finalize(self, state: FakeState) -> LoopResult:
        artifact = LatentArtifact(latent=state.value, provenance=Provenance(model_id="", loop_id=self.loop_id, request_id=state.request_id))
        return LoopResult(loop_id=self.loop_id, artifacts=[artifact])

    def partial(self, state: FakeState) -> LoopResult | None:
        artifact = LatentArtifact(latent=state.value, provenance=Provenance(model_id="", loop_id=self.loop_id, request_id=state.request_id, partial=True))
        return LoopResult(loop_id=self.loop_id, artifacts=[artifact])

    def progress(self, state: FakeState) -> tuple[int, int | None]:
        return state.step, state.total

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        steps = request.ar.max_tokens if request.ar is not None else (request.diffusion.steps or 1)
        extra = model.card.components["core"].config
        return ResourceRequest(
            # The runtime prices these with its calibrated cost model (the plans' kind and shape).
            steps=(StepEstimate(loop_id=self.loop_id, kind=WorkKind(model_kind(self.spec)),
                                shape_sig=ShapeSignature.of(tokens=1), count=steps),),
            resident_bytes=int(extra.get("resident_bytes", 0)), peak_bytes=int(extra.get("peak_bytes", 0)),
            cache_blocks=int(extra.get("cache_blocks", 0)),
        )


class FakeARLoop(FakeStepLoop):
    """The same fake loop, declared as an AR decode loop (its steps are ``ar_token`` units)."""

    kind = "ar_decode"


def model_kind(spec: LoopSpec) -> str:
    return {"ar_decode": "ar_token", "vae_decode": "vae_tile"}.get(spec.kind, "diffusion_step")


def build_fake_instance(card: ModelCard, options: InstanceOptions) -> ModelInstance:
    config = card.components["core"].config
    profile = BatchCostProfile({int(k): float(v) for k, v in (config.get("cost_profile") or {1: 0.0}).items()})
    batch_invariant = bool(config.get("batch_invariant", True))

    def fake_step(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        value = inputs["value"]
        delay = profile(int(value.shape[0]))
        if delay > 0:
            time.sleep(delay)
        if bool(inputs["fail"].any()):
            raise RuntimeError("injected failure")
        out = value + 1
        # Poison only the rows of requests that asked for it, as a real per-sample NaN would.
        out = torch.where(inputs["nan"].view(-1, 1), torch.full_like(out, float("nan")), out)
        return {"value": out}

    ops = {"fake_step": StepOp("fake_step", fake_step, batch_invariant=batch_invariant)}
    return ModelInstance(
        card=card, options=options, component_loader=lambda cid: object(), ops_builder=lambda inst: dict(ops),
        weights_version="fake",
    )


def fake_card(
    model_id: str = "fake-video",
    *,
    loop_kind: str = "diffusion_denoise",
    step_seconds: float = 0.01,
    cost_profile: Mapping[int, float] | None = None,
    resident_bytes: int = 0,
    peak_bytes: int = 0,
    cache_blocks: int = 0,
    batchable: bool = True,
    batch_invariant: bool = True,
) -> ModelCard:
    """A fake card; ``cost_profile`` maps batch size to the sleep of one batched step (default: none)."""
    task = TaskType.TEXT_GENERATION if loop_kind == "ar_decode" else TaskType.TEXT_TO_VIDEO
    loop = LoopSpec(
        loop_id="run", kind=loop_kind, batchable=batchable,
        implementation=f"{_MODULE}:{'FakeARLoop' if loop_kind == 'ar_decode' else 'FakeStepLoop'}",
        step_cost=StepCostSpec(unit="tokens", fixed_seconds=step_seconds, conservative_factor=1.0),
    )
    return ModelCard(
        model_id=model_id, family="fake",
        components={"core": ComponentSpec(component_id="core", kind="dit", builder=f"{_MODULE}:build_fake_instance", config={
            "cost_profile": {str(k): v for k, v in (cost_profile or {}).items()}, "resident_bytes": resident_bytes,
            "peak_bytes": peak_bytes, "cache_blocks": cache_blocks, "batch_invariant": batch_invariant})},
        loops={"run": loop},
        programs={task: ProgramSpec(loops=("run",))},
        capabilities=CapabilityMatrix(
            tasks=frozenset({task}),
            defaults=None if task is TaskType.TEXT_GENERATION else GenerationDefaults(height=8, width=8, frames=1, fps=1.0, steps=4, guidance=1.0),
        ),
        recipe=RecipeSpec(), parity=ParitySpec(level="C1", reference="none"),
        precision=PrecisionContract(default="fp32", supported=frozenset({"fp32"})),
        checkpoint=CheckpointManifest(layout="embedded", components={"core": ComponentCheckpoint(required_for=frozenset({task}))}),
        factory=f"{_MODULE}:build_fake_instance",
    )
