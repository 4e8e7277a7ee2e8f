"""A complete third-party model-card plugin: ``fv-tinyvideo``, a text-to-video card.

Three loops pass their outputs along (encode -> denoise -> decode); the denoise loop runs
classifier-free guidance as two branches of one step; the decode loop streams each frame
as a preview chunk and returns a ``VideoArtifact``; every loop tells admission what it
will cost (``estimate``). Everything is tiny and random-initialised, so it runs on a CPU
in well under a second.

Run it:  python docs/examples/video_card_plugin.py
(``tests/test_docs_examples.py`` runs it, registers it as a plugin on a host, runs it
through the Engine, and runs the conformance kit's ``CardConformance`` on it.)

Packaged, this file is ``fv_tinyvideo/plugin.py``: the ``fv.plugins`` entry point names it
and ``fv-plugin.yaml`` declares ``model_cards: [{name: tinyvideo}]`` (docs/plugins.md).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import torch
from torch import nn

from fv_kernel.api import (
    CapabilityMatrix,
    CheckpointManifest,
    ComponentCheckpoint,
    ComponentSpec,
    Done,
    EmitSpec,
    Engine,
    GenerationDefaults,
    GenerationResult,
    InstanceOptions,
    Loop,
    LoopContext,
    LoopResult,
    LoopSpec,
    LoopState,
    ModelCard,
    ModelInstance,
    OutputSpec,
    ParitySpec,
    PrecisionContract,
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
    TextPart,
    VideoArtifact,
    WorkKind,
    WorkPlan,
    bound_sampler,
    build_instance,
    builtin_guidance_policies,
    hookimpl,
    sampler_from_state,
)

# Cards name code by "module:attr" strings. Packaged, MODULE is "fv_tinyvideo.plugin"; run as a
# script (or loaded by the test), this file registers itself under its own name so they resolve.
MODULE = "video_card_plugin"
sys.modules.setdefault(MODULE, sys.modules[__name__])

TEXT_TOKENS, WIDTH, LATENT_CHANNELS, VAE_SCALE = 8, 16, 4, 2
FP32 = 4


# --------------------------------------------------------------------------- 1. components
# Plain nn.Modules, batch on dim 0. They hold weights only, never per-request state.


class TinyTextEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, L) bytes -> (B, L, WIDTH)
        return self.embed(ids)


class TinyVideoDiT(nn.Module):
    """Predicts the flow velocity of (B, C, F, h, w) latents from a timestep and the text."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Conv3d(LATENT_CHANNELS, LATENT_CHANNELS, kernel_size=1)
        self.cond = nn.Linear(WIDTH + 1, LATENT_CHANNELS)

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        cond = self.cond(torch.cat([context.mean(dim=1), t.view(-1, 1) / 1000.0], dim=-1))
        return self.mix(x) + cond.view(-1, LATENT_CHANNELS, 1, 1, 1)


class TinyDecoder(nn.Module):
    """One latent frame (B, C, h, w) -> RGB pixels (B, 3, h*2, w*2) in [0, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.to_rgb = nn.Conv2d(LATENT_CHANNELS, 3, kernel_size=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(nn.functional.interpolate(self.to_rgb(z), scale_factor=VAE_SCALE))


def build_component(component_id: str) -> nn.Module:
    return {"text_encoder": TinyTextEncoder, "dit": TinyVideoDiT, "vae": TinyDecoder}[component_id]()


# --------------------------------------------------------------------------- 2. loops
# Each loop keeps everything that changes in a typed LoopState (it round-trips through bytes),
# describes one step at a time in next() without running kernels, and folds results in advance().


def _byte_ids(text: str) -> torch.Tensor:
    ids = list(text.encode("utf-8"))[:TEXT_TOKENS]
    return torch.tensor(ids + [0] * (TEXT_TOKENS - len(ids)), dtype=torch.long)


class EncodeState(LoopState):
    ids: torch.Tensor  # (2, L): the prompt and the negative prompt
    embeds: torch.Tensor | None = None


class EncodeLoop(Loop[EncodeState]):
    """One step: both prompts through the text encoder. Its outputs feed the denoise loop."""

    kind = "text_encode"
    state_type = EncodeState

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> EncodeState:
        ids = torch.stack([_byte_ids(request.text("prompt") or ""), _byte_ids(request.text("negative_prompt") or "")])
        return EncodeState(request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id, ids=ids)

    def next(self, state: EncodeState) -> WorkPlan | Done:
        if state.embeds is not None:
            return Done()
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.ENCODER_CHUNK, op="encode_text",
            inputs={"ids": state.ids}, shape_sig=ShapeSignature.of(tokens=TEXT_TOKENS),
        )

    def advance(self, state: EncodeState, result: StepResult) -> EncodeState:
        return state.model_copy(update={"embeds": result.outputs["embeds"], "step": state.step + 1})

    def finalize(self, state: EncodeState) -> LoopResult:
        assert state.embeds is not None
        # Outputs, not artifacts: the program hands them to the next loop as ctx.upstream.
        return LoopResult(
            loop_id=self.loop_id, outputs={"prompt_embeds": state.embeds[0:1], "negative_embeds": state.embeds[1:2]}
        )

    def progress(self, state: EncodeState) -> tuple[int, int | None]:
        return state.step, 1

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        return ResourceRequest(
            steps=(StepEstimate(loop_id=self.loop_id, kind=WorkKind.ENCODER_CHUNK, shape_sig=ShapeSignature.of(tokens=TEXT_TOKENS)),),
            resident_bytes=FP32 * 2 * TEXT_TOKENS * WIDTH,
        )


class DenoiseState(LoopState):
    latents: torch.Tensor
    sampler_state: SamplerState
    prompt_embeds: torch.Tensor
    negative_embeds: torch.Tensor
    guidance: float
    total_steps: int


class DenoiseLoop(Loop[DenoiseState]):
    """Flow matching with CFG: each step is one WorkPlan whose batch rows are the guidance branches."""

    kind = "diffusion_denoise"
    state_type = DenoiseState

    def _policy(self) -> Any:
        return builtin_guidance_policies()[self.spec.guidance or "cfg"]()

    def _latent_shape(self, request: Request) -> tuple[int, ...]:
        d = request.diffusion
        assert d.height and d.width and d.frames
        return (1, LATENT_CHANNELS, d.frames, d.height // VAE_SCALE, d.width // VAE_SCALE)

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> DenoiseState:
        d = request.diffusion
        assert d.steps is not None and self.spec.sampler is not None
        # The card's sampler, or one the request names that an enabled plugin registers (e.g. euler-shift3).
        sampler = bound_sampler(self.spec.sampler, requested=d.sampler, shift=d.shift)
        noise = torch.randn(self._latent_shape(request), generator=torch.Generator().manual_seed(d.seed))
        return DenoiseState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id,
            latents=noise, sampler_state=sampler.init_state(d.steps), guidance=float(d.guidance or 0.0),
            prompt_embeds=ctx.upstream["prompt_embeds"], negative_embeds=ctx.upstream["negative_embeds"],
            total_steps=d.steps,
        )

    def next(self, state: DenoiseState) -> WorkPlan | Done:
        sampler = sampler_from_state(state.sampler_state)  # the state names its sampler; no object kept
        if sampler.is_done(state.sampler_state):
            return Done()
        branches = self._policy().branches(state.guidance)  # ("cond", "uncond") with CFG, ("cond",) without
        n = len(branches)
        context = torch.cat([state.prompt_embeds if b == "cond" else state.negative_embeds for b in branches])
        t = sampler.timestep(state.sampler_state).reshape(1).expand(n).float()
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.DIFFUSION_STEP, op="velocity",
            inputs={"x": state.latents.expand(n, *state.latents.shape[1:]), "t": t, "context": context},
            shape_sig=ShapeSignature.of(tokens=int(state.latents[0, 0].numel()), branches=n), tag="+".join(branches),
        )

    def advance(self, state: DenoiseState, result: StepResult) -> DenoiseState:
        policy = self._policy()
        branches = policy.branches(state.guidance)
        velocity = policy.combine(dict(zip(branches, result.outputs["v"].split(1))), state.guidance, step_index=state.step)
        sampler = sampler_from_state(state.sampler_state)
        sampler_state, latents = sampler.step(state.sampler_state, velocity, state.latents)
        return state.model_copy(update={"latents": latents, "sampler_state": sampler_state, "step": state.step + 1})

    def finalize(self, state: DenoiseState) -> LoopResult:
        return LoopResult(loop_id=self.loop_id, outputs={"latents": state.latents})

    def progress(self, state: DenoiseState) -> tuple[int, int | None]:
        return state.step, state.total_steps

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        """Every step as next() will plan it, priced by the runtime's cost model, and the bytes it keeps."""
        d = request.diffusion
        assert d.steps is not None
        shape = self._latent_shape(request)
        tokens = shape[2] * shape[3] * shape[4]
        branches = len(self._policy().branches(float(d.guidance or 0.0)))
        latent_bytes = FP32 * LATENT_CHANNELS * tokens
        return ResourceRequest(
            steps=(StepEstimate(loop_id=self.loop_id, kind=WorkKind.DIFFUSION_STEP,
                                shape_sig=ShapeSignature.of(tokens=tokens, branches=branches), count=d.steps),),
            resident_bytes=latent_bytes * 2,  # latents and the sampler's state
            peak_bytes=latent_bytes * branches * 3,  # the branch rows in, their velocities out, the mix
        )


class DecodeState(LoopState):
    latents: torch.Tensor
    frames: list[torch.Tensor] = []
    fps: float


class DecodeLoop(Loop[DecodeState]):
    """One step per latent frame; each decoded frame is streamed as a preview chunk."""

    kind = "vae_decode"
    state_type = DecodeState

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> DecodeState:
        return DecodeState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id,
            latents=ctx.upstream["latents"], fps=float(request.diffusion.fps or 8.0),
        )

    def next(self, state: DecodeState) -> WorkPlan | Done:
        index = len(state.frames)
        if index >= state.latents.shape[2]:
            return Done()
        z = state.latents[:, :, index]
        start = index / state.fps
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.VAE_TILE, op="decode_frame",
            inputs={"z": z}, shape_sig=ShapeSignature.of(tokens=int(z[0, 0].numel())),
            # The driver streams the step's "frame" output as a media.chunk (to requests that ask for previews).
            emits=[EmitSpec(stream="video", modality="video", preview=True, from_output="frame", pts=(start, start + 1 / state.fps))],
        )

    def advance(self, state: DecodeState, result: StepResult) -> DecodeState:
        return state.model_copy(update={"frames": [*state.frames, result.outputs["frame"]], "step": state.step + 1})

    def finalize(self, state: DecodeState) -> LoopResult:
        frames = torch.cat(state.frames, dim=0)  # (F, 3, H, W) in [0, 1]
        provenance = Provenance(model_id=CARD.model_id, loop_id=self.loop_id, request_id=state.request_id)
        return LoopResult(loop_id=self.loop_id, artifacts=[VideoArtifact(frames=frames, fps=state.fps, provenance=provenance)])

    def progress(self, state: DecodeState) -> tuple[int, int | None]:
        return state.step, int(state.latents.shape[2])

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        d = request.diffusion
        assert d.height and d.width and d.frames
        frame_bytes = FP32 * 3 * d.height * d.width
        pixels = (d.height // VAE_SCALE) * (d.width // VAE_SCALE)
        return ResourceRequest(
            steps=(StepEstimate(loop_id=self.loop_id, kind=WorkKind.VAE_TILE, shape_sig=ShapeSignature.of(tokens=pixels), count=d.frames),),
            resident_bytes=frame_bytes * d.frames,  # the decoded frames, until the artifact is made
            peak_bytes=frame_bytes * 2,
        )


# --------------------------------------------------------------------------- 3. the factory


def build(card: ModelCard, options: InstanceOptions) -> ModelInstance:
    """The card's factory: components load lazily (seeded here; from a checkpoint in a real family)."""

    def load(component_id: str) -> nn.Module:
        torch.manual_seed(card.checkpoint.components[component_id].random_init_seed or 0)
        return build_component(component_id).eval().requires_grad_(False)

    def ops(instance: ModelInstance) -> dict[str, StepOp]:
        built: dict[str, StepOp] = {}
        if "text_encoder" in instance.components:
            encoder = instance.components["text_encoder"]
            built["encode_text"] = StepOp("encode_text", lambda inputs, params: {"embeds": encoder(inputs["ids"])})
        if "dit" in instance.components:
            dit = instance.components["dit"]
            built["velocity"] = StepOp("velocity", lambda inputs, params: {"v": dit(inputs["x"], inputs["t"], inputs["context"])})
        if "vae" in instance.components:
            vae = instance.components["vae"]
            built["decode_frame"] = StepOp("decode_frame", lambda inputs, params: {"frame": vae(inputs["z"])})
        return built

    return ModelInstance(card=card, options=options, component_loader=load, ops_builder=ops, weights_version="seeded")


# --------------------------------------------------------------------------- 4. the card

T2V = frozenset({TaskType.TEXT_TO_VIDEO})

CARD = ModelCard(
    model_id="tinyvideo",
    family="tinyvideo",
    summary="A documentation example: encode -> denoise (CFG) -> decode with previews.",
    components={
        cid: ComponentSpec(component_id=cid, kind=kind, builder=f"{MODULE}:build_component")
        for cid, kind in (("text_encoder", "text_encoder"), ("dit", "dit"), ("vae", "vae"))
    },
    loops={
        "encode": LoopSpec(loop_id="encode", kind="text_encode", implementation=f"{MODULE}:EncodeLoop"),
        "denoise": LoopSpec(
            loop_id="denoise", kind="diffusion_denoise", implementation=f"{MODULE}:DenoiseLoop",
            sampler=SamplerBinding(name="euler", config={"shift": 2.0}), guidance="cfg",
        ),
        "decode": LoopSpec(loop_id="decode", kind="vae_decode", implementation=f"{MODULE}:DecodeLoop"),
    },
    programs={TaskType.TEXT_TO_VIDEO: ProgramSpec(loops=("encode", "denoise", "decode"), returns=frozenset({"video"}))},
    capabilities=CapabilityMatrix(
        tasks=T2V,
        defaults=GenerationDefaults(height=8, width=8, frames=3, fps=8.0, steps=4, guidance=4.0),
        spatial_multiple=VAE_SCALE,
    ),
    recipe=RecipeSpec(method="base"),
    parity=ParitySpec(level="C1", reference="none: a documentation example"),
    precision=PrecisionContract(default="fp32", supported=frozenset({"fp32"})),
    checkpoint=CheckpointManifest(
        layout="embedded",
        components={cid: ComponentCheckpoint(required_for=T2V, random_init_seed=seed)
                    for seed, cid in enumerate(("text_encoder", "dit", "vae"))},
    ),
    factory=f"{MODULE}:build",
)


# --------------------------------------------------------------------------- 5. the plugin hook


@hookimpl
def fv_register_model_cards(register: Any) -> None:
    register(CARD.model_id, CARD)  # cheap: the card is data; weights load when an engine needs them


# --------------------------------------------------------------------------- run it


def generate(engine: Engine, request: Request) -> tuple[GenerationResult, list[Any]]:
    """Submit ``request`` and collect its preview chunks as they stream."""

    async def go() -> tuple[GenerationResult, list[Any]]:
        chunks = []
        async with engine.running():
            handle = engine.submit(request)
            async for event in handle.events():
                if event.type == "media.chunk":
                    chunks.append(event)
            return await handle.result(), chunks

    return asyncio.run(go())


def main() -> None:
    engine = Engine()
    engine.add_instance(build_instance(CARD))
    request = Request(
        model="tinyvideo", task=TaskType.TEXT_TO_VIDEO,
        inputs=(TextPart(text="a red ball"), TextPart(text="blurry", role="negative_prompt")),
        output=OutputSpec(stream_previews=True),
    )
    result, chunks = generate(engine, request)
    video = result.raise_for_status().artifact("video")
    assert isinstance(video, VideoArtifact)
    print(result.status, f"{len(chunks)} preview chunks", "video", tuple(video.frames.shape))


if __name__ == "__main__":
    main()
