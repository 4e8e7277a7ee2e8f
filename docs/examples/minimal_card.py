"""A complete, minimal fv card: one component, one flow-matching denoise loop, one program.

Run it:  python docs/examples/minimal_card.py
(``tests/test_docs_and_cli.py`` runs it too, so this file stays true to the code.)
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

import torch

from fv_kernel.api import (
    CapabilityMatrix,
    CheckpointManifest,
    ComponentCheckpoint,
    ComponentSpec,
    Done,
    Engine,
    FlowEulerSampler,
    GenerationDefaults,
    InstanceOptions,
    LatentArtifact,
    Loop,
    LoopContext,
    LoopResult,
    LoopSpec,
    LoopState,
    ModelCard,
    ModelInstance,
    ParitySpec,
    PrecisionContract,
    ProgramSpec,
    Provenance,
    RecipeSpec,
    Request,
    SamplerBinding,
    SamplerState,
    ShapeSignature,
    StepOp,
    StepResult,
    TaskType,
    TextPart,
    WorkKind,
    WorkPlan,
    build_instance,
)

# Cards reference code by "module:attr" strings (validated without importing it). Run as a
# script, this file registers itself under its module name so those strings resolve.
MODULE = "minimal_card"
sys.modules.setdefault(MODULE, sys.modules[__name__])


# 1. The model: any nn.Module. Per-request state never lives on it.
class TinyVelocityNet(torch.nn.Module):
    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(channels + 1, 32), torch.nn.SiLU(), torch.nn.Linear(32, channels))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = t.view(-1, 1).expand(x.shape[0], 1) / 1000.0
        return self.net(torch.cat([x, t], dim=-1))


# 2. The loop's typed state: everything that changes between steps.
class DenoiseState(LoopState):
    latents: torch.Tensor
    sampler_state: SamplerState
    steps: int


# 3. The loop: next() describes a step (no kernels), advance() folds the result in.
class TinyDenoiseLoop(Loop[DenoiseState]):
    kind = "diffusion_denoise"
    state_type = DenoiseState

    def sampler(self) -> FlowEulerSampler:
        assert self.spec.sampler is not None
        return FlowEulerSampler(**self.spec.sampler.config)

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> DenoiseState:
        steps = request.diffusion.steps or 1
        noise = torch.randn(1, 4, generator=torch.Generator().manual_seed(request.diffusion.seed))
        return DenoiseState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id,
            latents=noise, sampler_state=self.sampler().init_state(steps), steps=steps,
        )

    def next(self, state: DenoiseState) -> WorkPlan | Done:
        sampler = self.sampler()
        if sampler.is_done(state.sampler_state):
            return Done()
        t = sampler.timestep(state.sampler_state).reshape(1).float()
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.DIFFUSION_STEP, op="velocity",
            inputs={"x": state.latents, "t": t}, shape_sig=ShapeSignature.of(tokens=1),
        )

    def advance(self, state: DenoiseState, result: StepResult) -> DenoiseState:
        sampler_state, latents = self.sampler().step(state.sampler_state, result.outputs["v"], state.latents)
        return state.model_copy(update={"latents": latents, "sampler_state": sampler_state, "step": state.step + 1})

    def finalize(self, state: DenoiseState) -> LoopResult:
        provenance = Provenance(model_id="demo-tiny", loop_id=self.loop_id, request_id=state.request_id)
        return LoopResult(loop_id=self.loop_id, artifacts=[LatentArtifact(latent=state.latents, provenance=provenance)])

    def progress(self, state: DenoiseState) -> tuple[int, int | None]:
        return state.step, state.steps


# 4. The factory: builds the resident instance and its executable ops.
def build(card: ModelCard, options: InstanceOptions) -> ModelInstance:
    def load(component_id: str) -> torch.nn.Module:
        torch.manual_seed(card.checkpoint.components[component_id].random_init_seed or 0)
        return TinyVelocityNet().eval()

    def ops(instance: ModelInstance) -> dict[str, StepOp]:
        net = instance.components["net"]

        def velocity(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            return {"v": net(inputs["x"], inputs["t"])}

        return {"velocity": StepOp("velocity", velocity)}

    return ModelInstance(card=card, options=options, component_loader=load, ops_builder=ops)


# 5. The card: a (recipe, runtime) pair, validated before any weights load.
CARD = ModelCard(
    model_id="demo-tiny",
    family="demo",
    components={"net": ComponentSpec(component_id="net", kind="dit", builder=f"{MODULE}:TinyVelocityNet")},
    loops={"denoise": LoopSpec(
        loop_id="denoise", kind="diffusion_denoise", implementation=f"{MODULE}:TinyDenoiseLoop",
        sampler=SamplerBinding(name="euler", config={"shift": 3.0}),
    )},
    programs={TaskType.TEXT_TO_IMAGE: ProgramSpec(loops=("denoise",))},
    capabilities=CapabilityMatrix(
        tasks=frozenset({TaskType.TEXT_TO_IMAGE}),
        defaults=GenerationDefaults(height=1, width=1, frames=1, fps=1.0, steps=8, guidance=1.0),
    ),
    recipe=RecipeSpec(method="base"),
    parity=ParitySpec(level="C1", reference="none: a documentation example"),
    precision=PrecisionContract(default="fp32", supported=frozenset({"fp32"})),
    checkpoint=CheckpointManifest(
        layout="embedded",
        components={"net": ComponentCheckpoint(required_for=frozenset({TaskType.TEXT_TO_IMAGE}), random_init_seed=0)},
    ),
    factory=f"{MODULE}:build",
)


def main() -> None:
    engine = Engine()
    engine.add_instance(build_instance(CARD))
    request = Request(model="demo-tiny", task=TaskType.TEXT_TO_IMAGE, inputs=(TextPart(text="anything"),))
    result = engine.generate(request)
    print(result.status, result.artifacts[0].latent)


if __name__ == "__main__":
    main()
