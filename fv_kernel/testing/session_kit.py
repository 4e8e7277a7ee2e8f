"""``toy-chunk``: a tiny model-agnostic causal chunk card for session tests (CPU, fp32, seeded weights).

Each chunk is a few steps, each its own WorkPlan: a text encode when the prompt version
changed, ``steps`` denoise steps (x0 prediction, re-noised with fresh noise from the state's
generator), a KV commit (the clean chunk's keys/values into a slab of the instance's
:class:`~fv_kernel.cache.slab_kv.SlabKVPool`, windowed sink + local) and a decode. A chunk
attends to the window's earlier chunks, so losing the K/V changes every later chunk: that is
what the suspend/resume tests rely on. A prompt containing ``"boom"`` makes the text encode
raise (fault injection for failure-isolation tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from pydantic import Field
from torch import nn

from fv_kernel.cache.slab_kv import SlabKVConfig, SlabKVPool, SlabWindow, SlabWindowSpec
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
from fv_kernel.errors import InvalidRequest
from fv_kernel.loop.contract import Done, LoopContext, LoopResult, ResidentModel
from fv_kernel.loop.plan import ResourceRequest, ShapeSignature, StepEstimate, StepOp, StepResult, WorkKind, WorkPlan
from fv_kernel.loop.realtime import SESSION_UPSTREAM, ChunkRolloutLoop, ChunkRolloutState, ReadyChunk
from fv_kernel.model.instance import ModelInstance
from fv_kernel.model.options import InstanceOptions
from fv_kernel.request.artifacts import Provenance, VideoArtifact
from fv_kernel.request.request import Request
from fv_kernel.request.types import TaskType
from fv_kernel.state import generator_from_state, new_generator_state

__all__ = ["ChunkToyInstance", "ToyChunkLoop", "ToyChunkState", "build_chunk_toy_instance", "chunk_toy_card"]

_MODULE = "fv_kernel.testing.session_kit"
DIM = 8
TEXT_BYTES = 32
FAULT_WORD = "boom"


class ToyChunkNet(nn.Module):
    """Text embedding, a chunk denoiser that attends to earlier chunks' K/V, and the K/V projection."""

    def __init__(self) -> None:
        super().__init__()
        self.text = nn.Linear(256, DIM)
        self.q = nn.Linear(3 + DIM + 1, DIM)
        self.out = nn.Linear(DIM, 3)
        self.k = nn.Linear(3 + DIM, DIM)
        self.v = nn.Linear(3 + DIM, DIM)

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        hist = torch.nn.functional.one_hot(ids, 256).float().mean(1)
        return torch.tanh(self.text(hist * 8))

    def denoise(self, x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, hk: torch.Tensor, hv: torch.Tensor) -> torch.Tensor:
        b, f = x.shape[:2]
        feat = x.mean((3, 4))  # (B, F, 3)
        q = self.q(torch.cat([feat, ctx[:, None].expand(b, f, DIM), t[:, None, None].expand(b, f, 1)], -1))
        if hk.shape[1]:
            att = torch.softmax(q @ hk.transpose(1, 2) / math.sqrt(DIM), -1) @ hv  # (B, F, D)
        else:
            att = torch.zeros_like(q)
        gain = self.out(att * 4 + ctx[:, None])[..., None, None]  # (B, F, 3, 1, 1)
        return torch.sigmoid(2 * (x - 0.5) * (1 - t)[:, None, None, None, None] + 2 * gain)

    def kv(self, x0: torch.Tensor, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, f = x0.shape[:2]
        h = torch.cat([x0.mean((3, 4)), ctx[:, None].expand(b, f, DIM)], -1)
        return self.k(h), self.v(h)


class ToyChunkState(ChunkRolloutState):
    rng: torch.Tensor
    height: int
    width: int
    #: The prompt version the context embedding was encoded for (None: not yet).
    encoded_version: int | None = None
    context: torch.Tensor | None = None
    #: The chunk being generated: its noisy latent, denoise steps done, last x0, whether its K/V is committed.
    x: torch.Tensor
    step_in_chunk: int = 0
    x0: torch.Tensor | None = None
    committed: bool = False
    window: SlabWindow | None = None
    #: The window's K/V copied out by ``suspend`` (None while the pool holds it).
    kv_snapshot: dict[str, torch.Tensor] | None = None
    #: Offline runs (no session) keep every decoded chunk for the artifact; a session emits and forgets them.
    offline: bool = False
    offline_frames: list[torch.Tensor] = Field(default_factory=list)


def _ids(prompt: str) -> torch.Tensor:
    raw = list(prompt.encode("utf-8")[:TEXT_BYTES])
    return torch.tensor([raw + [0] * (TEXT_BYTES - len(raw))], dtype=torch.long)


class ToyChunkLoop(ChunkRolloutLoop[ToyChunkState]):
    state_type = ToyChunkState

    def bind(self, instance: Any) -> None:
        cfg = self.spec.config
        self.frames_per_chunk = int(cfg.get("frames_per_chunk", 2))
        self.steps = int(cfg.get("steps", 2))
        self.timesteps = [1.0 - i / self.steps for i in range(self.steps)]
        self.window_spec = SlabWindowSpec(sink_slabs=int(cfg.get("sink", 1)), local_slabs=int(cfg.get("local", 2)))

        # The instance's pool (per instance, like the weights); per-session data lives in the state's window.
        self._pool: SlabKVPool = instance.block_pools()["chunk_kv"]

    def _noise(self, state: ToyChunkState) -> tuple[torch.Tensor, torch.Tensor]:
        gen = generator_from_state(state.rng)
        noise = torch.rand((1, self.frames_per_chunk, 3, state.height, state.width), generator=gen)
        return noise, gen.get_state()

    def init(self, request: Request, model: ResidentModel, ctx: LoopContext) -> ToyChunkState:
        fields = self.session_fields(request, ctx)
        offline = SESSION_UPSTREAM not in ctx.upstream
        if offline:  # as many chunks as the request's frames need
            frames = request.diffusion.frames or self.frames_per_chunk
            fields["max_chunks"] = max(1, math.ceil(frames / self.frames_per_chunk))
        assert request.diffusion.height is not None and request.diffusion.width is not None
        state = ToyChunkState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id,
            rng=new_generator_state(request.diffusion.seed), height=request.diffusion.height,
            width=request.diffusion.width, x=torch.zeros(0), window=self._pool.open(request.request_id, self.window_spec),
            offline=offline, **fields,
        )
        noise, rng = self._noise(state)
        return state.model_copy(update={"x": noise, "rng": rng})

    def restore(self, state: ToyChunkState, model: ResidentModel, ctx: LoopContext) -> ToyChunkState:
        if state.kv_snapshot is None or state.window is None:
            return state
        window = self._pool.restore(state.request_id, state.window.spec, state.kv_snapshot, state.window.positions)
        return state.model_copy(update={"window": window, "kv_snapshot": None})

    def suspend(self, state: ToyChunkState, ctx: LoopContext) -> ToyChunkState:
        assert state.window is not None
        return state.model_copy(update={"kv_snapshot": self._pool.snapshot(state.window)})

    def release(self, owner: str, model: ResidentModel) -> None:
        self._pool.close_owner(owner)

    def cancel_stream(self, state: ToyChunkState) -> ToyChunkState:
        # Abandon the chunk in progress too: start it over from fresh noise.
        noise, rng = self._noise(state)
        return state.model_copy(update={
            "ready": [], "x": noise, "rng": rng, "step_in_chunk": 0, "x0": None, "committed": False,
        })

    def _plan(self, state: ToyChunkState, op: str, kind: WorkKind, inputs: dict[str, torch.Tensor], tag: str) -> WorkPlan:
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=kind, op=op, inputs=inputs, tag=tag,
            shape_sig=ShapeSignature.of(frames=self.frames_per_chunk, height=state.height, width=state.width),
            batchable=False,
        )

    def next(self, state: ToyChunkState) -> WorkPlan | Done:
        if self.finished(state):
            return Done()
        if state.encoded_version != state.prompt_version:
            return self._plan(state, "chunk_text", WorkKind.ENCODER_CHUNK, {"ids": _ids(state.prompt)}, "text")
        assert state.context is not None
        if state.step_in_chunk < self.steps:
            assert state.window is not None
            # The chunk's history: the window's earlier chunks (this chunk's own slab is written at commit).
            hk, hv = self._pool.read(state.window, 0, upto=state.chunk_index)
            t = torch.tensor([self.timesteps[state.step_in_chunk]])
            inputs = {"x": state.x, "t": t, "ctx": state.context, "hk": hk[None, :, 0], "hv": hv[None, :, 0]}
            return self._plan(state, "chunk_denoise", WorkKind.CHUNK_STEP, inputs, "denoise")
        assert state.x0 is not None
        if not state.committed:
            return self._plan(state, "chunk_commit", WorkKind.CHUNK_STEP, {"x0": state.x0, "ctx": state.context}, "commit")
        return self._plan(state, "chunk_decode", WorkKind.VAE_TILE, {"x0": state.x0}, "decode")

    def advance(self, state: ToyChunkState, result: StepResult) -> ToyChunkState:
        out = result.outputs
        step = state.step + 1
        if "context" in out:
            return state.model_copy(update={"context": out["context"], "encoded_version": state.prompt_version, "step": step})
        if "x0" in out:
            x0 = out["x0"]
            done = state.step_in_chunk + 1
            update: dict[str, Any] = {"x0": x0, "step_in_chunk": done, "step": step}
            if done < self.steps:  # re-noise to the next timestep with fresh noise
                noise, rng = self._noise(state)
                sigma = self.timesteps[done]
                update.update(x=(1 - sigma) * x0 + sigma * noise, rng=rng)
            return state.model_copy(update=update)
        if "k" in out:
            assert state.window is not None
            pool = self._pool
            window, slab = pool.append(state.window, state.chunk_index)
            pool.write(slab, 0, out["k"][0][:, None], out["v"][0][:, None])
            return state.model_copy(update={"window": window, "committed": True, "step": step})
        frames = out["frames"][0]
        chunk = ReadyChunk(
            chunk_index=state.chunk_index, frames=frames, frame_start=state.chunk_index * self.frames_per_chunk,
            prompt_version=state.prompt_version,
        )
        noise, rng = self._noise(state)
        state = state.model_copy(update={
            "ready": [*state.ready, chunk], "chunk_index": state.chunk_index + 1, "step": step,
            "x": noise, "rng": rng, "step_in_chunk": 0, "x0": None, "committed": False,
            "offline_frames": [*state.offline_frames, frames] if state.offline else [],
        })
        return self.apply_pending_prompt(state)  # the chunk boundary: a queued prompt becomes current here

    def finalize(self, state: ToyChunkState) -> LoopResult:
        self._pool.close_owner(state.request_id)
        frames = torch.cat(state.offline_frames) if state.offline_frames else torch.zeros(0, 3, state.height, state.width)
        provenance = Provenance(model_id="", loop_id=self.loop_id, request_id=state.request_id)
        video = VideoArtifact(frames=frames, fps=state.fps, provenance=provenance)
        return LoopResult(loop_id=self.loop_id, artifacts=[video])

    def estimate(self, request: Request, model: ResidentModel) -> ResourceRequest:
        sig = ShapeSignature.of(frames=self.frames_per_chunk, height=request.diffusion.height or 8,
                                width=request.diffusion.width or 8)
        per_chunk = (
            StepEstimate(loop_id=self.loop_id, kind=WorkKind.CHUNK_STEP, shape_sig=sig, count=self.steps + 1),
            StepEstimate(loop_id=self.loop_id, kind=WorkKind.VAE_TILE, shape_sig=sig),
        )
        return ResourceRequest(steps=per_chunk, pool_blocks={"chunk_kv": self.window_spec.max_slabs})


# --------------------------------------------------------------------------- instance + card


@dataclass
class ChunkToyInstance(ModelInstance):
    """A toy-chunk instance: its slab pool is part of admission (``block_pools``)."""

    pool: SlabKVPool | None = None

    def block_pools(self) -> dict[str, SlabKVPool]:  # type: ignore[override]
        assert self.pool is not None
        return {"chunk_kv": self.pool}


def _ops(instance: ModelInstance) -> dict[str, StepOp]:
    net: ToyChunkNet = instance.components["net"]

    def text(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        for row in inputs["ids"]:
            if FAULT_WORD in bytes(int(b) for b in row if int(b)).decode("utf-8", "replace"):
                raise RuntimeError(f"toy fault injected by a prompt containing {FAULT_WORD!r}")
        return {"context": net.encode(inputs["ids"])}

    def denoise(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return {"x0": net.denoise(inputs["x"], inputs["t"], inputs["ctx"], inputs["hk"], inputs["hv"])}

    def commit(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        k, v = net.kv(inputs["x0"], inputs["ctx"])
        return {"k": k, "v": v}

    def decode(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return {"frames": inputs["x0"].clamp(0, 1)}

    return {name: StepOp(name, fn) for name, fn in (
        ("chunk_text", text), ("chunk_denoise", denoise), ("chunk_commit", commit), ("chunk_decode", decode))}


def build_component(name: str, seed: int) -> nn.Module:
    if name != "net":
        raise InvalidRequest("component", f"toy-chunk has no component {name!r}", allowed=["net"])
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return ToyChunkNet().eval().requires_grad_(False)


def build_chunk_toy_instance(card: ModelCard, options: InstanceOptions) -> ModelInstance:
    """A toy-chunk instance with a slab pool of ``loops.rollout.config.pool_slabs`` slabs."""
    cfg = card.loops["rollout"].config
    frames = int(cfg.get("frames_per_chunk", 2))
    pool = SlabKVPool(SlabKVConfig(num_layers=1, num_heads=1, head_dim=DIM, tokens_per_slab=frames,
                                   num_slabs=int(cfg.get("pool_slabs", 8)), dtype="fp32", device=options.device))

    def load(component_id: str) -> nn.Module:
        seed = card.checkpoint.components[component_id].random_init_seed or 0
        return build_component(component_id, seed).to(options.device)

    return ChunkToyInstance(card=card, options=options, component_loader=load, ops_builder=_ops,
                            weights_version="toy-chunk-seeded", pool=pool)


def chunk_toy_card(model_id: str = "toy-chunk", *, pool_slabs: int = 8, sink: int = 1, local: int = 2,
                   steps: int = 2, frames_per_chunk: int = 2) -> ModelCard:
    """The toy causal chunk card; ``pool_slabs`` sizes its slab pool (a window is ``sink + local`` slabs)."""
    t2v = frozenset({TaskType.TEXT_TO_VIDEO})
    cost = StepCostSpec(unit="steps", fixed_seconds=1e-3, per_unit_seconds=0.0)
    config = {"pool_slabs": pool_slabs, "sink": sink, "local": local, "steps": steps, "frames_per_chunk": frames_per_chunk}
    return ModelCard(
        model_id=model_id,
        family="toy",
        summary="tiny causal chunk-rollout test card (sessions)",
        components={"net": ComponentSpec(component_id="net", kind="dit", builder=f"{_MODULE}:build_component")},
        loops={"rollout": LoopSpec(loop_id="rollout", kind="chunk_rollout", implementation=f"{_MODULE}:ToyChunkLoop",
                                   step_cost=cost, batchable=False, config=config)},
        programs={TaskType.TEXT_TO_VIDEO: ProgramSpec(loops=("rollout",), returns=frozenset({"video"}))},
        capabilities=CapabilityMatrix(
            tasks=t2v, defaults=GenerationDefaults(height=8, width=8, frames=frames_per_chunk * 2, fps=8.0, steps=steps,
                                        guidance=0.0),
            spatial_multiple=4,
        ),
        recipe=RecipeSpec(method="base"),
        parity=ParitySpec(level="C1", reference="self (serial run)"),
        precision=PrecisionContract(default="fp32", supported=frozenset({"fp32"})),
        checkpoint=CheckpointManifest(layout="embedded", components={"net": ComponentCheckpoint(required_for=t2v, random_init_seed=5)}),
        factory=f"{_MODULE}:build_chunk_toy_instance",
    )
