"""fv-mine's plugin module after its migration to plugin API 2 (docs/plugins.md, "Migrating a plugin
from API 1 to 2"): a sampler, a denoise loop, a custom program and a card, registered by two hooks.

Packaged, this file is ``fv_mine/plugin.py`` beside the guide's ``fv-plugin.yaml``, so the card
names its code ``"fv_mine.plugin:..."``. ``tests/test_docs_migration.py`` installs it that way,
loads it through a plugin host, runs the card through the Engine and the conformance kits, and
checks that every "after" block of the guide is a verbatim part of this file.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from fv_kernel.api import (
    Artifact,
    CapabilityMatrix,
    CheckpointManifest,
    ComponentCheckpoint,
    ComponentSpec,
    Done,
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
    Program,
    ProgramSpec,
    Provenance,
    RecipeSpec,
    Request,
    ResourceRequest,
    SamplerBinding,
    SamplerState,
    ShapeSignature,
    StepEstimate,
    StepOp,
    StepResult,
    TaskType,
    WorkKind,
    WorkPlan,
    bound_sampler,
    hookimpl,
    sampler_from_state,
)


# A plugin sampler: registered under its own `name`, usable by name wherever the deployment enables fv-mine.
class EulerShift5(FlowEulerSampler):
    name = "euler-shift5"
    shift: float = 5.0


# The model: any nn.Module; per-request state never lives on it.
class VelocityNet(torch.nn.Module):
    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(channels + 1, 32), torch.nn.SiLU(), torch.nn.Linear(32, channels))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = t.view(-1, 1) / 1000.0
        return self.net(torch.cat([x, t], dim=-1))


class DenoiseState(LoopState):
    latents: torch.Tensor
    sampler_state: SamplerState  # the sampler is rebuilt from it: nothing per request on the loop


class DenoiseLoop(Loop[DenoiseState]):
    kind = "diffusion_denoise"
    state_type = DenoiseState

    def bind(self, instance: ModelInstance) -> None:
        # New in 2.0: called once when the instance builds the loop, before any request.
        self.channels = int(instance.card.components["net"].config["channels"])

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> DenoiseState:
        d = request.diffusion
        # The card's sampler (a plugin's too), or the registered one the request names.
        sampler = bound_sampler(self.spec.sampler, requested=d.sampler, shift=d.shift)
        noise = torch.randn(1, self.channels, generator=torch.Generator().manual_seed(d.seed))
        return DenoiseState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id,
            latents=noise, sampler_state=sampler.init_state(d.steps),
        )

    def next(self, state: DenoiseState) -> WorkPlan | Done:
        sampler = sampler_from_state(state.sampler_state)  # resolved in the deployment's registry
        if sampler.is_done(state.sampler_state):
            return Done()
        t = sampler.timestep(state.sampler_state).reshape(1).float()
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.DIFFUSION_STEP, op="velocity",
            inputs={"x": state.latents, "t": t},  # per-request scalars are rows of inputs, never params
            shape_sig=ShapeSignature.of(tokens=1),
        )

    def advance(self, state: DenoiseState, result: StepResult) -> DenoiseState:
        sampler = sampler_from_state(state.sampler_state)
        sampler_state, latents = sampler.step(state.sampler_state, result.outputs["v"], state.latents)
        return state.model_copy(update={"latents": latents, "sampler_state": sampler_state, "step": state.step + 1})

    def finalize(self, state: DenoiseState) -> LoopResult:
        provenance = Provenance(model_id="mine-tiny", loop_id=self.loop_id, request_id=state.request_id)
        return LoopResult(loop_id=self.loop_id, artifacts=[LatentArtifact(latent=state.latents, provenance=provenance)])

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        # 2.0: describe the steps next() will plan; the runtime prices them with its calibrated cost model.
        step = StepEstimate(
            loop_id=self.loop_id, kind=WorkKind.DIFFUSION_STEP, shape_sig=ShapeSignature.of(tokens=1),
            count=request.diffusion.steps,
        )
        latent_bytes = 4 * self.channels
        return ResourceRequest(steps=(step,), resident_bytes=2 * latent_bytes, peak_bytes=4 * 32 + latent_bytes)


class Generate(Program):
    resumable = True  # it runs every loop through run_loop: a checkpoint can resume it at any step

    def loop_ids(self, request: Request) -> list[str]:
        return ["denoise"]

    async def run(self, model: ModelInstance, ctx: LoopContext) -> list[Artifact]:
        result = await self.run_loop("denoise", model, ctx)  # API 1: await drive(model.loop("denoise"), model, ctx)
        return list(result.artifacts)


def build(card: ModelCard, options: InstanceOptions) -> ModelInstance:
    def load(component_id: str) -> torch.nn.Module:
        torch.manual_seed(card.checkpoint.components[component_id].random_init_seed or 0)
        return VelocityNet(**card.components[component_id].config).eval()

    def ops(instance: ModelInstance) -> dict[str, StepOp]:
        net = instance.components["net"]

        def velocity(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            return {"v": net(inputs["x"], inputs["t"])}

        return {"velocity": StepOp("velocity", velocity)}

    return ModelInstance(card=card, options=options, component_loader=load, ops_builder=ops)


DENOISE = LoopSpec(
    loop_id="denoise", kind="diffusion_denoise", implementation="fv_mine.plugin:DenoiseLoop",
    sampler=SamplerBinding(name="euler-shift5"),  # a plugin's sampler, by name (or "fv-mine/euler-shift5")
)

CARD = ModelCard(
    model_id="mine-tiny",
    family="mine",
    components={"net": ComponentSpec(
        component_id="net", kind="dit", builder="fv_mine.plugin:VelocityNet", config={"channels": 4},
    )},
    loops={"denoise": DENOISE},
    programs={TaskType.TEXT_TO_IMAGE: ProgramSpec(implementation="fv_mine.plugin:Generate", returns=frozenset({"latent"}))},
    capabilities=CapabilityMatrix(
        tasks=frozenset({TaskType.TEXT_TO_IMAGE}), uses_guidance=False,
        defaults=GenerationDefaults(height=1, width=1, frames=1, fps=1.0, steps=6, guidance=1.0),
    ),
    recipe=RecipeSpec(method="base"),
    parity=ParitySpec(level="C1", reference="none: a documentation example"),
    precision=PrecisionContract(default="fp32", supported=frozenset({"fp32"})),
    checkpoint=CheckpointManifest(
        layout="embedded",
        components={"net": ComponentCheckpoint(required_for=frozenset({TaskType.TEXT_TO_IMAGE}), random_init_seed=0)},
    ),
    factory="fv_mine.plugin:build",
)


@hookimpl
def fv_register_samplers(register: Any) -> None:
    register(EulerShift5.name, EulerShift5)  # 2.0: under the class's own `name`, or the plugin is refused


@hookimpl
def fv_register_model_cards(register: Any) -> None:
    register(CARD.model_id, CARD)  # 2.0: under the card's own `model_id`
