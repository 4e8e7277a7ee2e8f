"""A toy causal chunk card whose sessions exercise the slab chunk-KV pool through the real engine.

``toy-chunk-kv`` generates video chunk by chunk, as a self-forcing causal model does, with a
model small enough for a kernel test: per chunk, ``steps`` denoise steps (``chunk_denoise``)
attend to the K/V of the window's earlier chunks, read from the instance's
:class:`~fv_kernel.cache.slab_kv.SlabKVPool` (``block_pools()["chunk_kv"]``); then a clean
forward (``chunk_commit``) writes the chunk's own K/V into its slab and decodes its frames.
The window (``sink_slabs`` + ``local_slabs`` chunks) evicts as the rollout goes on. The loop's
estimate reserves the window's slabs at admission, so any number of sessions over a pool
sized for N windows complete, at most N at a time.

Everything per session is in :class:`ToyChunkState` (the window value, the chunk latent,
the prompt); the pool's tensors are the instance's. The "model" is a few fixed random
projections: its numbers mean nothing, but each chunk's output depends on every chunk in
its window, so a wrong window, a stale slab or a foreign session's K/V changes the frames.
A prompt containing ``fail@K`` makes chunk K's commit step raise (failure injection).
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from typing import Any, Mapping

import torch

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

__all__ = ["POOL", "ChunkToyInstance", "ToyChunkLoop", "ToyChunkState", "build_chunk_instance", "chunk_card"]

_MODULE = "fv_kernel.testing.chunk_kit"
#: The name the loop reserves and reads its slabs under.
POOL = "chunk_kv"


@dataclass
class ChunkToyInstance(ModelInstance):
    """A toy-chunk-kv instance: its weights are fixed projections; its chunk K/V lives in ``pool``."""

    pool: SlabKVPool | None = None

    def block_pools(self) -> dict[str, SlabKVPool]:
        return {} if self.pool is None else {POOL: self.pool}


class ToyChunkState(ChunkRolloutState):
    window: SlabWindow
    #: The slab the current chunk's K/V is committed to.
    slab: int
    #: The current chunk's latent, ``[1, tokens, dim]``.
    x: torch.Tensor
    #: Denoise steps per chunk and how many of the current chunk's are done.
    steps: int
    sub: int = 0
    seed: int = 0
    #: Failure injection (a prompt containing ``fail@K``): chunk K's commit step raises.
    fail_at: int | None = None
    #: The window's K/V while suspended (``SlabKVPool.snapshot``); None while it is in the pool.
    kv: dict[str, torch.Tensor] | None = None


def _geometry(config: Mapping[str, Any]) -> dict[str, int]:
    return {key: int(config[key]) for key in ("layers", "heads", "head_dim", "frames_per_chunk", "height", "width")}


def _fail_at(prompt: str) -> int | None:
    match = re.search(r"fail@(\d+)", prompt)
    return int(match.group(1)) if match else None


def _prompt_vector(prompt: str, dim: int) -> torch.Tensor:
    """A deterministic embedding of the prompt text (crc32-seeded), ``[1, 1, dim]``."""
    g = torch.Generator().manual_seed(zlib.crc32(prompt.encode("utf-8")))
    return torch.randn(1, 1, dim, generator=g)


class ToyChunkLoop(ChunkRolloutLoop[ToyChunkState]):
    """``steps`` denoise steps and one commit per chunk, for ``ceil(frames / frames_per_chunk)`` chunks."""

    state_type = ToyChunkState

    @staticmethod
    def _pool(model: ResidentModel) -> SlabKVPool:
        pools = model.block_pools() if isinstance(model, ModelInstance) else {}
        pool = pools.get(POOL)
        if not isinstance(pool, SlabKVPool):
            raise TypeError(f"{model.model_id!r} has no slab pool {POOL!r} (block_pools(): {sorted(pools)})")
        return pool

    def _window_spec(self, model: ResidentModel) -> SlabWindowSpec:
        config = model.card.components["core"].config
        return SlabWindowSpec(sink_slabs=int(config["sink_slabs"]), local_slabs=int(config["local_slabs"]))

    def _plan_shape(self, model: ResidentModel, request: Request) -> tuple[int, int]:
        """(chunks, denoise steps per chunk) the request asks for, checked against the card."""
        config, defaults = model.card.components["core"].config, model.card.capabilities.defaults
        assert defaults is not None
        d = request.diffusion
        for name, want in (("height", int(config["height"])), ("width", int(config["width"]))):
            got = getattr(d, name)
            if got is not None and got != want:
                raise InvalidRequest(name, f"toy-chunk-kv generates {want} pixels, got {got}", allowed=[want])
        frames = d.frames or defaults.frames
        return math.ceil(frames / int(config["frames_per_chunk"])), d.steps or defaults.steps

    def _fresh_latent(self, state_seed: int, chunk: int, tokens: int, dim: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(state_seed * 1_000_003 + chunk)
        return torch.randn(1, tokens, dim, generator=g)

    def init(self, request: Request, model: ResidentModel, ctx: LoopContext) -> ToyChunkState:
        config = model.card.components["core"].config
        geo = _geometry(config)
        chunks, steps = self._plan_shape(model, request)
        pool = self._pool(model)
        window, slab = pool.append(pool.open(request.request_id, self._window_spec(model)), 0)
        tokens = geo["frames_per_chunk"] * geo["height"] * geo["width"]
        seed = request.diffusion.seed
        # In a session the session says how many chunks (None: until stopped); a plain request, its frames.
        session = ctx.upstream.get(SESSION_UPSTREAM)
        return ToyChunkState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id,
            prompt=request.text("prompt") or "", max_chunks=session.get("max_chunks") if session is not None else chunks,
            fps=request.diffusion.fps or 8.0,
            window=window, slab=slab, steps=steps, seed=seed, fail_at=_fail_at(request.text("prompt") or ""),
            x=self._fresh_latent(seed, 0, tokens, geo["heads"] * geo["head_dim"]),
        )

    def next(self, state: ToyChunkState) -> WorkPlan | Done:
        if self.finished(state):
            return Done()
        commit = state.sub >= state.steps
        slabs, positions = self._bound_pool.window_tensors(state.window)
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.CHUNK_STEP,
            op="chunk_commit" if commit else "chunk_denoise", batchable=False,
            inputs={
                "x": state.x, "cond": _prompt_vector(state.prompt, state.x.shape[-1]),
                "slabs": slabs[None], "positions": positions[None],
                "chunk": torch.tensor([state.chunk_index]), "slab": torch.tensor([state.slab]),
                "remaining": torch.tensor([float(state.steps - state.sub)]),
                "fail": torch.tensor([commit and state.chunk_index == state.fail_at]),
            },
            params={"sink_slabs": state.window.spec.sink_slabs, "local_slabs": state.window.spec.local_slabs},
            shape_sig=ShapeSignature.of(tokens=int(state.x.shape[1]), window=state.window.spec.max_slabs),
        )

    def advance(self, state: ToyChunkState, result: StepResult) -> ToyChunkState:
        if state.sub < state.steps:
            return state.model_copy(update={"x": result.outputs["x"], "sub": state.sub + 1, "step": state.step + 1})
        frames = result.outputs["frames"][0]
        done = ReadyChunk(chunk_index=state.chunk_index, frames=frames, prompt_version=state.prompt_version,
                          frame_start=state.frames_emitted + sum(c.num_frames for c in state.ready))
        state = self.apply_pending_prompt(state.model_copy(update={
            "ready": [*state.ready, done], "chunk_index": state.chunk_index + 1, "step": state.step + 1,
        }))
        if self.finished(state):
            return state
        # The next chunk's slab is taken here, between steps (host code), never inside a step.
        window, slab = self._bound_pool.append(state.window, state.chunk_index)
        x = self._fresh_latent(state.seed, state.chunk_index, int(state.x.shape[1]), int(state.x.shape[2]))
        return state.model_copy(update={"window": window, "slab": slab, "x": x, "sub": 0})

    def finalize(self, state: ToyChunkState) -> LoopResult:
        self._bound_pool.close(state.window)
        frames = torch.cat([c.frames for c in state.ready]) if state.ready else torch.zeros(0, 3, 1, 1)
        video = VideoArtifact(frames=frames, fps=state.fps, provenance=Provenance(
            model_id="", loop_id=self.loop_id, request_id=state.request_id, seed=state.seed))
        return LoopResult(loop_id=self.loop_id, artifacts=[video])

    def release(self, owner: str, model: ResidentModel) -> None:
        self._pool(model).close_owner(owner)

    def suspend(self, state: ToyChunkState, ctx: LoopContext) -> ToyChunkState:
        """The window's K/V copied into the state, the slabs freed: the state is self-contained."""
        kv = self._bound_pool.snapshot(state.window)
        self._bound_pool.close(state.window)
        return state.model_copy(update={"kv": kv})

    def restore(self, state: ToyChunkState, model: ResidentModel, ctx: LoopContext) -> ToyChunkState:
        if state.kv is None:
            return state
        pool = self._pool(model)
        window = pool.restore(state.request_id, state.window.spec, state.kv, state.window.positions)
        # The current chunk's slab is the window's last (append puts it there).
        return state.model_copy(update={"window": window, "slab": window.slabs[-1], "kv": None})

    def bind(self, instance: ResidentModel) -> None:
        self._bound_pool = self._pool(instance)  # the instance's pool, shared by every session, like its weights

    def estimate(self, request: Request, model: ResidentModel) -> ResourceRequest:
        chunks, steps = self._plan_shape(model, request)
        geo = _geometry(model.card.components["core"].config)
        sig = ShapeSignature.of(tokens=geo["frames_per_chunk"] * geo["height"] * geo["width"],
                                window=self._window_spec(model).max_slabs)
        return ResourceRequest(
            steps=(StepEstimate(loop_id=self.loop_id, kind=WorkKind.CHUNK_STEP, shape_sig=sig, count=chunks * (steps + 1)),),
            # The window's slabs, whole-life: a session never holds more (a full window evicts first).
            pool_blocks={POOL: self._window_spec(model).max_slabs},
        )


# --------------------------------------------------------------------------- the "model"


def _weights(config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    geo = _geometry(config)
    dim = geo["heads"] * geo["head_dim"]
    g = torch.Generator().manual_seed(int(config.get("weights_seed", 0)))
    scale = 1.0 / math.sqrt(dim)
    return {name: torch.randn(geo["layers"], dim, dim, generator=g) * scale for name in ("q", "k", "v", "o")}


def _forward(pool: SlabKVPool, inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any],
             w: Mapping[str, torch.Tensor], *, commit: bool) -> torch.Tensor:
    """One causal pass over the chunk: every layer attends to the window's earlier chunks (from the pool)
    and to the chunk itself; ``commit`` writes the chunk's K/V into its slab first and reads it back."""
    c = pool.config
    spec = SlabWindowSpec(sink_slabs=int(params["sink_slabs"]), local_slabs=int(params["local_slabs"]))
    window = pool.window_from_tensors(inputs["slabs"][0], inputs["positions"][0], spec)
    chunk, slab = int(inputs["chunk"][0]), int(inputs["slab"][0])
    h = inputs["x"][0] + inputs["cond"][0]
    tokens = h.shape[0]
    for layer in range(c.num_layers):
        q = (h @ w["q"][layer]).view(tokens, c.num_heads, c.head_dim)
        k = (h @ w["k"][layer]).view(tokens, c.num_heads, c.head_dim)
        v = (h @ w["v"][layer]).view(tokens, c.num_heads, c.head_dim)
        if commit:
            pool.write(slab, layer, k, v)
            keys, values = pool.read(window, layer, upto=chunk + 1)
        else:
            past_k, past_v = pool.read(window, layer, upto=chunk)
            keys, values = torch.cat([past_k, k]), torch.cat([past_v, v])
        attn = torch.softmax(torch.einsum("thd,shd->hts", q, keys) / math.sqrt(c.head_dim), dim=-1)
        h = h + torch.einsum("hts,shd->thd", attn, values).reshape(tokens, -1) @ w["o"][layer]
    return torch.tanh(h)


def build_chunk_instance(card: ModelCard, options: InstanceOptions) -> ChunkToyInstance:
    config = card.components["core"].config
    geo = _geometry(config)
    pool = SlabKVPool(SlabKVConfig(
        num_layers=geo["layers"], num_heads=geo["heads"], head_dim=geo["head_dim"],
        tokens_per_slab=geo["frames_per_chunk"] * geo["height"] * geo["width"], num_slabs=int(config["num_slabs"]),
    ), name=POOL)
    weights = _weights(config)

    def denoise(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        x0 = _forward(pool, inputs, params, weights, commit=False)
        x = inputs["x"][0]
        # Straight toward the prediction, arriving at it on the chunk's last step.
        return {"x": (x + (x0 - x) / inputs["remaining"][0])[None]}

    def commit(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        if bool(inputs["fail"].any()):
            raise RuntimeError("injected failure")
        clean = _forward(pool, inputs, params, weights, commit=True)
        # "Decode": one grey level per token, the chunk's tokens laid out as its frames.
        pixels = torch.sigmoid(clean.mean(-1)).view(geo["frames_per_chunk"], 1, geo["height"], geo["width"])
        return {"frames": pixels.expand(-1, 3, -1, -1).contiguous()[None]}

    ops = {"chunk_denoise": StepOp("chunk_denoise", denoise), "chunk_commit": StepOp("chunk_commit", commit)}
    return ChunkToyInstance(
        card=card, options=options, component_loader=lambda cid: object(), ops_builder=lambda inst: dict(ops),
        weights_version="toy-chunk-kv", pool=pool,
    )


def chunk_card(
    model_id: str = "toy-chunk-kv",
    *,
    num_slabs: int = 6,
    sink_slabs: int = 1,
    local_slabs: int = 2,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 4,
    frames_per_chunk: int = 2,
    height: int = 2,
    width: int = 2,
    frames: int = 8,
    steps: int = 2,
    step_seconds: float = 0.001,
) -> ModelCard:
    """The toy chunk card; ``num_slabs`` sizes the instance's slab pool (a window takes ``sink + local``)."""
    task = TaskType.TEXT_TO_VIDEO
    loop = LoopSpec(
        loop_id="rollout", kind="chunk_rollout", batchable=False, implementation=f"{_MODULE}:ToyChunkLoop",
        step_cost=StepCostSpec(unit="tokens", fixed_seconds=step_seconds, conservative_factor=1.0),
    )
    config = {"num_slabs": num_slabs, "sink_slabs": sink_slabs, "local_slabs": local_slabs, "layers": layers,
              "heads": heads, "head_dim": head_dim, "frames_per_chunk": frames_per_chunk, "height": height,
              "width": width}
    return ModelCard(
        model_id=model_id, family="toy-chunk-kv",
        components={"core": ComponentSpec(component_id="core", kind="dit", builder=f"{_MODULE}:build_chunk_instance",
                                          config=config)},
        loops={"rollout": loop},
        programs={task: ProgramSpec(loops=("rollout",))},
        capabilities=CapabilityMatrix(
            tasks=frozenset({task}),
            defaults=GenerationDefaults(height=height, width=width, frames=frames, fps=8.0, steps=steps, guidance=1.0),
        ),
        recipe=RecipeSpec(), parity=ParitySpec(level="C1", reference="none"),
        precision=PrecisionContract(default="fp32", supported=frozenset({"fp32"})),
        checkpoint=CheckpointManifest(layout="embedded", components={"core": ComponentCheckpoint(required_for=frozenset({task}))}),
        factory=f"{_MODULE}:build_chunk_instance",
    )
