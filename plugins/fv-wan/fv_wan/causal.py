"""Causal (block-causal, chunk-wise) Wan: the Self-Forcing recipe and its streaming loop.

A causal card generates video chunk after chunk of ``frames_per_chunk`` latent frames.
Per chunk (Self-Forcing's ``pipeline/causal_inference.py``):

1. (when the prompt changed) the text encode step; the new embeddings replace the
   cross-attention context from this chunk on;
2. the few-step DMD sampler: each step predicts the flow of the noisy chunk, takes
   ``x0 = x_t - sigma_t * flow`` and, before the next step, re-noises ``x0`` with FRESH
   Gaussian noise to the next (warped) timestep; the chunk's queries attend to the
   committed K/V of the window (sink + local chunks) and to their own K/V;
3. the chunk decode: the VAE decodes the chunk's latent frames continuing its causal
   feature cache (held in the state), giving a :class:`ReadyChunk`;
4. the KV refresh: one more forward of the clean ``x0`` at ``t = context_noise`` (0) whose
   K/V (K after RoPE, V raw) are written into the chunk's slab of the instance's slab
   chunk-KV pool: the chunk is committed. The refresh reads nothing the decode writes, so it
   runs after it: the chunk's frames go out one forward earlier than Self-Forcing's order
   gives, and a stream's last chunk skips it (no later chunk reads its K/V).

Everything per session lives in :class:`CausalWanState` (serializable): the window of slab
ids, the noise generator's state, the text context, the VAE cache. ``suspend`` copies the
window's K/V into the state; ``restore`` re-acquires slabs and copies them back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fv_kernel.api import (
    BatchedVsAlone,
    BuildProblem,
    ChunkRolloutLoop,
    ChunkRolloutState,
    Done,
    InstanceOptions,
    InvalidCard,
    InvalidRequest,
    LoopContext,
    LoopResult,
    ModelCard,
    ModelInstance,
    Provenance,
    ReadyChunk,
    RecipeMismatch,
    Request,
    ResourceRequest,
    SESSION_UPSTREAM,
    ShapeSignature,
    SlabKVConfig,
    SlabKVPool,
    SlabWindow,
    SlabWindowSpec,
    StepEstimate,
    StepOp,
    StepResult,
    VideoArtifact,
    WorkKind,
    WorkPlan,
    generator_from_state,
)
from fv_wan.models.causal_transformer import LayerHistory, causal_batch_forward
from fv_wan.models.encoders import clean_prompt
from fv_wan.models.transformer import TEXT_CONTEXT_LENGTH, WanTransformerConfig
from fv_wan.models.vae import CausalCache, WanVAEConfig

__all__ = [
    "SELF_FORCING_SAMPLER",
    "CausalRecipe",
    "CausalWanState",
    "CausalWanRolloutLoop",
    "CausalWanInstance",
    "build_causal_wan_instance",
    "build_causal_toy_instance",
    "causal_card",
    "check_scheduler_config",
    "causal_ops",
    "chunk_kv_config",
    "warp_timesteps",
]

#: The sampler name a causal card binds (requests naming another sampler are a RecipeMismatch).
SELF_FORCING_SAMPLER = "self_forcing_dmd"
#: The pool name a causal instance exposes in ``block_pools()`` (admission reserves windows of it).
CHUNK_KV = "chunk_kv"


def warp_timesteps(steps: Sequence[float], shift: float, num_train_timesteps: int = 1000) -> tuple[float, ...]:
    """Self-Forcing's ``warp_denoising_step``: each step ``s`` maps to the shifted schedule's timestep.

    SF's scheduler (``FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True)``,
    ``set_timesteps(1000, training=True)``) has sigmas ``linspace(1, 0, 1001)[:-1]``, shifted
    as ``s * sigma / (1 + (s - 1) * sigma)``, timesteps ``1000 * sigma``; ``s`` then picks
    ``cat(timesteps, [0])[1000 - s]``. [1000, 750, 500, 250] at shift 5 -> [1000, 937.5, 833.3, 625].
    """
    sigmas = torch.linspace(1.0, 0.0, num_train_timesteps + 1, dtype=torch.float64)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    table = torch.cat([sigmas * num_train_timesteps, torch.zeros(1, dtype=torch.float64)])
    out = []
    for step in steps:
        index = num_train_timesteps - int(round(step))
        if not 0 <= index <= num_train_timesteps:
            raise ValueError(f"denoising step {step} is outside [0, {num_train_timesteps}]")
        out.append(float(table[index]))
    return tuple(out)


class CausalRecipe(BaseModel):
    """A causal card's rollout recipe: the loop's ``config`` (``LoopSpec.config``), validated.

    Window sizes are in chunks: a chunk attends to the first ``sink_chunks`` chunks, the latest
    ``local_chunks - 1`` committed ones and itself (SF's ``sink_size`` / ``local_attn_size`` in
    chunks; ``local_chunks = 7`` at 3 frames per chunk is SF's shipped 21-frame cache).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    denoising_steps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
    shift: float = Field(default=5.0, gt=0)
    warp_denoising_step: bool = True
    frames_per_chunk: int = Field(default=3, ge=1)
    sink_chunks: int = Field(default=0, ge=0)
    local_chunks: int = Field(default=7, ge=1)
    #: Noise level of the KV refresh forward (SF ``context_noise``), a timestep in [0, 1000).
    context_noise: float = Field(default=0.0, ge=0, lt=1000)
    #: Text tokens the prompt is padded to (the text encode loop's ``max_sequence_length``).
    max_sequence_length: int = Field(default=TEXT_CONTEXT_LENGTH, gt=0)
    #: The largest frame (pixels) a session may ask for: it sizes the pool's slabs.
    max_height: int = Field(gt=0)
    max_width: int = Field(gt=0)
    #: A prompt update that arrives while a chunk is part-way through its denoise steps: ``restart``
    #: that chunk under the new prompt from fresh noise (the first chunk that follows the update comes
    #: about one chunk's time after it), or finish it under the old prompt and apply the update at the
    #: next ``boundary`` (up to two chunks' time; no forward is thrown away).
    prompt_update: Literal["restart", "boundary"] = "restart"

    @model_validator(mode="after")
    def _check(self) -> "CausalRecipe":
        if not self.denoising_steps or any(not 0 < s <= 1000 for s in self.denoising_steps):
            raise ValueError(f"denoising_steps must be a non-empty list in (0, 1000], got {list(self.denoising_steps)}")
        if list(self.denoising_steps) != sorted(self.denoising_steps, reverse=True):
            raise ValueError(f"denoising_steps must decrease, got {list(self.denoising_steps)}")
        return self

    @property
    def timesteps(self) -> tuple[float, ...]:
        """The timesteps the sampler runs (warped with ``shift`` when ``warp_denoising_step``)."""
        if self.warp_denoising_step:
            return warp_timesteps(self.denoising_steps, self.shift)
        return tuple(float(s) for s in self.denoising_steps)

    @property
    def window(self) -> SlabWindowSpec:
        return SlabWindowSpec(sink_slabs=self.sink_chunks, local_slabs=self.local_chunks)


def _recipe(card: ModelCard, loop_id: str) -> CausalRecipe:
    return CausalRecipe(**card.loops[loop_id].config)


def _transformer_config(card: ModelCard) -> WanTransformerConfig:
    return WanTransformerConfig.from_diffusers_config(card.components["transformer"].config)


def _vae_config(card: ModelCard) -> WanVAEConfig:
    return WanVAEConfig.from_diffusers_config(card.components["vae_decoder"].config)


def _tokens_per_chunk(card: ModelCard, recipe: CausalRecipe, height: int, width: int) -> int:
    config, vae = _transformer_config(card), _vae_config(card)
    _, p_h, p_w = config.patch_size
    s = vae.spatial_compression
    return recipe.frames_per_chunk * (height // s // p_h) * (width // s // p_w)


def chunk_kv_config(card: ModelCard, options: InstanceOptions, loop_id: str = "realtime") -> SlabKVConfig:
    """The slab pool of a causal card: one slab = one chunk at the recipe's largest frame, every layer;
    as many as the card's ``caches["chunk_kv"]`` budget holds."""
    config = _transformer_config(card)
    recipe = _recipe(card, loop_id)
    precision = options.precision or card.precision.default
    geometry: dict[str, Any] = dict(
        num_layers=config.num_layers, num_heads=config.num_attention_heads, head_dim=config.attention_head_dim,
        tokens_per_slab=_tokens_per_chunk(card, recipe, recipe.max_height, recipe.max_width),
        dtype=precision, device=options.device,
    )
    contract = card.caches.get(CHUNK_KV)
    if contract is None:
        raise InvalidCard([BuildProblem(f"caches.{CHUNK_KV}", "a causal card declares the slab pool's budget")],
                          card_id=card.model_id)
    return SlabKVConfig.from_budget(contract.budget_bytes, **geometry)


# --------------------------------------------------------------------------- instance and ops


@dataclass
class CausalWanInstance(ModelInstance):
    """A causal Wan card made resident, plus the slab chunk-KV pool its sessions' windows live in."""

    chunk_kv_pool: SlabKVPool | None = None

    def block_pools(self) -> dict[str, SlabKVPool]:  # type: ignore[override]
        return {CHUNK_KV: self.chunk_kv_pool} if self.chunk_kv_pool is not None else {}


class _PoolHistory(Sequence):
    """A window's committed K/V per layer, read out of the pool when the layer asks (one layer at a time)."""

    def __init__(self, pool: SlabKVPool, window: SlabWindow, upto: int) -> None:
        self.pool, self.window, self.upto = pool, window, upto

    def __len__(self) -> int:
        return self.pool.config.num_layers

    def __getitem__(self, layer: int) -> "_PooledLayer":  # type: ignore[override]
        return _PooledLayer(self.pool, self.window, layer, self.upto)


class _PooledLayer(LayerHistory):
    """One layer of a window's committed K/V, read from the pool with room for the chunk's own K/V after it
    (``SlabKVPool.read(room=...)``, kernel API 2.9): the attention's keys in one copy, no concatenation."""

    def __init__(self, pool: SlabKVPool, window: SlabWindow, layer: int, upto: int) -> None:
        self.pool, self.window, self.layer, self.upto = pool, window, layer, upto

    def with_chunk(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = key.shape[1]
        k, v = self.pool.read(self.window, self.layer, upto=self.upto, room=tokens)
        if k.dtype != key.dtype or k.device != key.device:  # a pool in another dtype: the history converted, then joined
            history = k.shape[0] - tokens
            return (torch.cat([k[None, :history].to(key), key], dim=1), torch.cat([v[None, :history].to(value), value], dim=1))
        k[k.shape[0] - tokens :], v[v.shape[0] - tokens :] = key[0], value[0]
        return k.unsqueeze(0), v.unsqueeze(0)


def _slab_sink(pool: SlabKVPool, slab: int) -> Any:
    """A row's KV sink: its chunk's K/V (1, tokens, heads, head_dim) per layer into ``slab``."""

    def commit(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pool.write(slab, layer, k[0], v[0])

    return commit


def causal_ops(instance: CausalWanInstance) -> dict[str, StepOp]:
    """``causal_forward`` (one chunk forward over its window; ``commit`` writes the chunk's K/V into its
    slab) and ``vae_decode_chunk`` (a chunk's frames, continuing the stream's causal cache)."""
    comps = instance.components
    ops: dict[str, StepOp] = {}
    pool = instance.chunk_kv_pool
    if "transformer" in comps and pool is not None:
        model = comps["transformer"]

        def causal_forward(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            # Every per-session value is a row of ``inputs`` (plans of different sessions batch): the
            # window (slab ids and positions, padded with -1), chunk index, RoPE start frame, commit flag.
            spec = SlabWindowSpec(sink_slabs=int(params["sink_slabs"]), local_slabs=int(params["local_slabs"]))
            ref = next(model.parameters())
            rows = inputs["latents"].shape[0]
            histories: list[_PoolHistory] = []
            sinks: list[Any] = []
            for row in range(rows):
                window = pool.window_from_tensors(inputs["window_slabs"][row], inputs["window_positions"][row], spec)
                chunk = int(inputs["chunk_index"][row])
                if window.positions[-1] != chunk:
                    raise ValueError(f"row {row}: the window's last slab must hold chunk {chunk}, "
                                     f"got positions {window.positions}")
                histories.append(_PoolHistory(pool, window, chunk))
                sinks.append(_slab_sink(pool, window.slabs[-1]) if bool(inputs["commit"][row]) else None)
            with torch.no_grad():
                flow = causal_batch_forward(
                    model, inputs["latents"].to(device=ref.device, dtype=ref.dtype), inputs["timestep"].to(ref.device),
                    inputs["context"].to(device=ref.device, dtype=ref.dtype),
                    start_frames=[int(f) for f in inputs["start_frame"].tolist()], histories=histories, kv_sinks=sinks,
                )
            return {"flow": flow.float()}

        ops["causal_forward"] = StepOp("causal_forward", causal_forward)
    if "vae_decoder" in comps:
        vae = comps["vae_decoder"]

        def vae_decode_chunk(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            tensors = {k[len("cache."):]: v for k, v in inputs.items() if k.startswith("cache.")}
            cache = CausalCache.from_tensors(tensors) if tensors else vae.new_decode_cache()
            ref = next(vae.parameters())
            with torch.no_grad():
                z = vae.denormalize_latents(inputs["z"].to(device=ref.device, dtype=torch.float32)).to(ref.dtype)
                frames, cache = vae.decode_chunk(z, cache)
            out = {"frames": (frames.float() / 2 + 0.5).clamp(0, 1).cpu()}
            # In the activations' own layout (as fv-wan's vae_decode_frame): repacking costs more than it saves.
            out.update({f"cache.{k}": v for k, v in cache.to_tensors(contiguous=False).items()})
            return out

        ops["vae_decode_chunk"] = StepOp("vae_decode_chunk", vae_decode_chunk)
    return ops


def build_causal_wan_instance(card: ModelCard, options: InstanceOptions, compute: Any = None) -> CausalWanInstance:
    """The causal card's factory: fv-wan's instance with the slab chunk-KV pool and the causal ops added."""
    from fv_wan.instance import build_wan_instance

    return _causal_instance(build_wan_instance(card, options, compute), card, options)


def build_causal_toy_instance(card: ModelCard, options: InstanceOptions, compute: Any = None) -> CausalWanInstance:
    """:func:`build_causal_wan_instance` over wan-toy's instance (its word-level text encoder)."""
    from fv_wan.toy_card import build_toy_instance

    return _causal_instance(build_toy_instance(card, options, compute), card, options)


def check_scheduler_config(card: ModelCard, directory: Path) -> None:
    """A Self-Forcing checkpoint's ``scheduler/scheduler_config.json`` must agree with the card's recipe (its
    ``shift``); the sampler itself is the recipe's, so a checkpoint distilled at another shift is refused."""
    path = directory / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    recipe = _recipe(card, "realtime")
    shift = config.get("shift")
    if shift is not None and abs(float(shift) - recipe.shift) > 1e-9:
        raise InvalidCard([BuildProblem(
            "checkpoint.source", f"{path}: shift {shift} differs from the recipe's shift {recipe.shift} "
            f"(class {config.get('_class_name')!r}); the causal recipe would run the wrong timesteps",
        )], card_id=card.model_id)


def _causal_instance(base: ModelInstance, card: ModelCard, options: InstanceOptions) -> CausalWanInstance:
    source = options.source or card.checkpoint.source
    if source is not None and Path(source).is_dir():
        check_scheduler_config(card, Path(source))
    base_ops = base.ops_builder

    def ops_builder(instance: ModelInstance) -> dict[str, StepOp]:
        return {**base_ops(instance), **causal_ops(instance)}  # type: ignore[arg-type]

    return CausalWanInstance(
        card=card, options=options, component_loader=base.component_loader, ops_builder=ops_builder,
        weights_version=base.weights_version, chunk_kv_pool=SlabKVPool(chunk_kv_config(card, options), name=CHUNK_KV),
    )


# --------------------------------------------------------------------------- the loop

Phase = Literal["text", "denoise", "preview", "commit", "decode"]


class CausalWanState(ChunkRolloutState):
    """One causal Wan session: where it is in its chunk, and everything it needs to continue."""

    model_id: str
    weights_version: str = ""
    seed: int = 0
    #: The noise generator's state: every chunk's initial noise and each re-noise draw from it.
    rng_state: torch.Tensor
    height: int
    width: int
    #: Latent shape of one chunk: (channels, frames_per_chunk, h, w).
    latent_shape: tuple[int, int, int, int]
    phase: Phase
    #: Denoise step within the current chunk.
    chunk_step: int = 0
    latents: torch.Tensor
    x0: torch.Tensor | None = None
    #: Prompt embeddings (1, L, text_dim) the chunks cross-attend to, and the prompt version they encode.
    context: torch.Tensor | None = None
    context_version: int = -1
    text_ids: torch.Tensor | None = None
    text_mask: torch.Tensor | None = None
    #: The session's slabs in the instance's pool (ids, chunk positions, window spec).
    window: SlabWindow
    #: The window's K/V while suspended (``SlabKVPool.snapshot``); None while the slabs hold them.
    kv_snapshot: dict[str, torch.Tensor] | None = None
    #: The VAE decoder's causal feature cache (``CausalCache.to_tensors``); empty before the first chunk.
    vae_cache: dict[str, torch.Tensor] = Field(default_factory=dict)
    #: Pixel frames decoded so far (the next chunk's first frame).
    frames_decoded: int = 0
    #: Outside a session: the frames the request asked for (the video is trimmed to them).
    requested_frames: int | None = None
    #: The session asked for previews: each chunk's first denoise step's x0 estimate is decoded too
    #: (``preview_x0`` while it waits for that decode), before the chunk's remaining steps.
    previews: bool = False
    preview_x0: torch.Tensor | None = None
    recipe_overrides: tuple[str, ...] = ()
    #: The current chunk's decode has run (its frames are in ``ready`` or emitted) / its KV refresh has run. A chunk
    #: decodes, then refreshes; a state suspended by an fv-wan before 2026-12-06 refreshed first, and still resumes.
    chunk_decoded: bool = False
    kv_refreshed: bool = False


def _decoded_frames(result: StepResult) -> torch.Tensor:
    """A ``vae_decode_chunk`` result's frames as (F, 3, H, W)."""
    return result.outputs["frames"][0].transpose(0, 1).contiguous()


class CausalWanRolloutLoop(ChunkRolloutLoop[CausalWanState]):
    """The Self-Forcing chunk rollout of a causal Wan card (kind ``chunk_rollout``).

    Steps: ``encode_text`` (when the prompt changed), ``causal_forward`` x steps (denoise),
    ``causal_forward`` with ``commit`` (the KV refresh at ``context_noise``), ``vae_decode_chunk``.
    The instance must expose a slab pool as ``block_pools()["chunk_kv"]``
    (:class:`CausalWanInstance`); the loop binds it and the text tokenizer.
    """

    state_type = CausalWanState

    def bind(self, instance: Any) -> None:
        pools = instance.block_pools()
        if CHUNK_KV not in pools or not isinstance(pools[CHUNK_KV], SlabKVPool):
            raise InvalidCard([BuildProblem(
                "factory", f"loop {self.loop_id!r} needs a slab chunk-KV pool as block_pools()[{CHUNK_KV!r}] "
                "(build the card with fv_wan.causal:build_causal_wan_instance)",
            )], card_id=instance.card.model_id)
        self._pool: SlabKVPool = pools[CHUNK_KV]
        self._instance = instance
        self._recipe = CausalRecipe(**self.spec.config)
        self._timesteps = self._recipe.timesteps
        # RoPE holds rope_max_seq_len latent-frame positions: the stream ends where they run out.
        self._rope_chunks = _transformer_config(instance.card).rope_max_seq_len // self._recipe.frames_per_chunk

    @property
    def recipe(self) -> CausalRecipe:
        return CausalRecipe(**self.spec.config)

    # -- helpers -----------------------------------------------------------------------
    def check_request(self, request: Request, model: ModelInstance) -> None:
        """The recipe's sampler, steps and no-CFG, and a frame size the chunk-KV slabs hold: refused at validation."""
        d = request.diffusion
        recipe = self._recipe
        assumes = (f"loop {self.loop_id!r} (sampler {SELF_FORCING_SAMPLER!r}, {len(recipe.denoising_steps)} steps "
                   f"{list(recipe.denoising_steps)} warped at shift {recipe.shift})")
        method = model.card.recipe.method
        if d.sampler is not None and d.sampler.rsplit("/", 1)[-1] != SELF_FORCING_SAMPLER:
            raise RecipeMismatch("sampler", model_id=model.model_id, method=method, assumes=assumes,
                                 asked=f"sampler {d.sampler!r}")
        if d.steps is not None and d.steps != len(recipe.denoising_steps):
            raise RecipeMismatch("steps", model_id=model.model_id, method=method, assumes=assumes,
                                 asked=f"{d.steps} steps")
        if d.guidance is not None and d.guidance > 1.0:
            raise RecipeMismatch("guidance", model_id=model.model_id, method=method, assumes=f"{assumes}, no CFG",
                                 asked=f"guidance {d.guidance}")
        if not d.height or not d.width:
            raise InvalidRequest("height", "a causal rollout needs the frame size (resolve the request against its card)")
        multiple = _vae_config(model.card).spatial_compression * _transformer_config(model.card).patch_size[1]
        for name, value, limit in (("height", d.height, recipe.max_height), ("width", d.width, recipe.max_width)):
            if value % multiple or value > limit:
                raise InvalidRequest(name, f"{name} {value} must be a multiple of {multiple} and at most {limit} "
                                     f"(the chunk-KV slabs of {model.model_id!r} are sized for {recipe.max_height}x{recipe.max_width})")

    def _tokenize(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        tokenizer = self._instance.component("text_encoder").tokenizer
        tokens = tokenizer(
            [clean_prompt(prompt)], padding="max_length", max_length=self._recipe.max_sequence_length, truncation=True,
            add_special_tokens=True, return_attention_mask=True, return_tensors="pt",
        )
        return tokens.input_ids, tokens.attention_mask

    @staticmethod
    def _draw(state_rng: torch.Tensor, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        generator = generator_from_state(state_rng)
        noise = torch.randn(tuple(shape), generator=generator, dtype=torch.float32)
        return noise, generator.get_state()

    # -- the loop contract ---------------------------------------------------------------
    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> CausalWanState:
        self.check_request(request, model)
        d = request.diffusion
        recipe = self._recipe
        vae = _vae_config(model.card)
        config = _transformer_config(model.card)
        fields = self.session_fields(request, ctx)
        in_session = ctx.upstream.get(SESSION_UPSTREAM) is not None
        requested = None
        if not in_session and fields["max_chunks"] is None and d.frames:
            # A plain generate request: enough chunks for its frames (the video is trimmed to them).
            latent_frames = (d.frames - 1) // vae.temporal_compression + 1
            fields["max_chunks"] = math.ceil(latent_frames / recipe.frames_per_chunk)
            requested = d.frames
        rope_limit = self._rope_chunks
        if fields["max_chunks"] is not None and fields["max_chunks"] > rope_limit:
            raise InvalidRequest("max_chunks", f"at most {rope_limit} chunks fit the RoPE table "
                                 f"({config.rope_max_seq_len} latent frames), got {fields['max_chunks']}")
        shape = (config.in_channels, recipe.frames_per_chunk, d.height // vae.spatial_compression, d.width // vae.spatial_compression)
        generator = torch.Generator(device="cpu").manual_seed(d.seed)
        latents = torch.randn((1, *shape), generator=generator, dtype=torch.float32)
        window, _ = self._pool.append(self._pool.open(request.request_id, recipe.window), 0)
        ids, mask = self._tokenize(fields["prompt"])
        return CausalWanState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id, **fields,
            model_id=model.model_id, weights_version=model.weights_version, seed=d.seed, rng_state=generator.get_state(),
            height=d.height, width=d.width, latent_shape=shape, phase="text", latents=latents, window=window,
            text_ids=ids, text_mask=mask, requested_frames=requested,
            previews=in_session and request.output.stream_previews and len(self._timesteps) > 1,
            recipe_overrides=getattr(model, "recipe_overrides", ()),
        )

    def _forward_plan(self, state: CausalWanState, latents: torch.Tensor, timestep: float, *, commit: bool) -> WorkPlan:
        """One chunk forward. Everything that differs between sessions is an input row, so forwards of
        sessions at different chunks, steps, prompts and window fills share one batched call."""
        assert state.context is not None
        slabs, positions = self._pool.window_tensors(state.window)
        window = self._recipe.window
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.DIFFUSION_STEP, op="causal_forward",
            inputs={"latents": latents, "timestep": torch.tensor([timestep], dtype=torch.float32), "context": state.context,
                    "window_slabs": slabs[None], "window_positions": positions[None],
                    "chunk_index": torch.tensor([state.chunk_index]),
                    "start_frame": torch.tensor([state.chunk_index * self._recipe.frames_per_chunk]),
                    "commit": torch.tensor([commit])},
            params={"sink_slabs": window.sink_slabs, "local_slabs": window.local_slabs},
            # Priced at a full window (the estimate's): the fill is per row, not part of the batch key.
            shape_sig=ShapeSignature.of(latent=str(state.latent_shape), window=window.max_slabs),
            tag="commit" if commit else f"step{state.chunk_step}",
        )

    def commit_inputs(self, state: CausalWanState) -> tuple[torch.Tensor, float]:
        """The KV refresh's input: the chunk's clean ``x0`` at ``context_noise`` (noised to it when above 0)."""
        assert state.x0 is not None
        t = self._recipe.context_noise
        if t == 0:
            return state.x0, 0.0
        noise, _ = self._draw(state.rng_state, state.x0.shape)
        sigma = t / 1000.0
        return (1 - sigma) * state.x0 + sigma * noise, t

    def next(self, state: CausalWanState) -> WorkPlan | Done:
        if self.finished(state):
            return Done()
        if state.chunk_index >= self._rope_chunks:
            return Done(reason="rope_positions_exhausted")
        if state.phase == "text":
            assert state.text_ids is not None and state.text_mask is not None
            return WorkPlan(
                loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.ENCODER_CHUNK, op="encode_text",
                inputs={"ids": state.text_ids, "mask": state.text_mask},
                params={"max_len": self._recipe.max_sequence_length},
                shape_sig=ShapeSignature.of(tokens=self._recipe.max_sequence_length), tag="text",
            )
        if state.phase == "denoise":
            return self._forward_plan(state, state.latents, self._timesteps[state.chunk_step], commit=False)
        if state.phase == "commit":
            latents, t = self.commit_inputs(state)
            return self._forward_plan(state, latents, t, commit=True)
        preview = state.phase == "preview"
        z = state.preview_x0 if preview else state.x0
        assert z is not None
        # A preview decodes from the stream's VAE cache too, but its updated cache is dropped (advance).
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.VAE_TILE, op="vae_decode_chunk",
            inputs={"z": z, **{f"cache.{k}": v for k, v in state.vae_cache.items()}},
            shape_sig=ShapeSignature.of(latent=str(state.latent_shape), first=int(state.chunk_index == 0)),
            batchable=False, tag="preview" if preview else "decode",
        )

    def advance(self, state: CausalWanState, result: StepResult) -> CausalWanState:
        step = state.step + 1
        if state.phase == "text":
            return state.model_copy(update={
                "context": result.outputs["embeds"][0:1].float(), "context_version": state.prompt_version,
                "text_ids": None, "text_mask": None, "phase": "denoise", "step": step,
            })
        if state.phase == "denoise":
            t = self._timesteps[state.chunk_step]
            x0 = state.latents - (t / 1000.0) * result.outputs["flow"].float().to(state.latents.device)
            if state.chunk_step + 1 < len(self._timesteps):
                sigma = self._timesteps[state.chunk_step + 1] / 1000.0
                noise, rng = self._draw(state.rng_state, x0.shape)  # fresh noise: a re-noise, not an ODE step
                update: dict[str, Any] = {
                    "latents": (1 - sigma) * x0 + sigma * noise, "rng_state": rng, "chunk_step": state.chunk_step + 1,
                    "step": step,
                }
                if state.previews and state.chunk_step == 0:
                    update.update({"phase": "preview", "preview_x0": x0})
                return state.model_copy(update=update)
            return state.model_copy(update={"x0": x0, "phase": "decode", "step": step})
        if state.phase == "preview":
            ready = ReadyChunk(chunk_index=state.chunk_index, frames=_decoded_frames(result), frame_start=state.frames_decoded,
                               prompt_version=state.prompt_version, preview=True)
            return state.model_copy(update={"ready": [*state.ready, ready], "phase": "denoise", "preview_x0": None,
                                            "step": step})
        if state.phase == "commit":
            rng = state.rng_state
            if self._recipe.context_noise > 0:  # the refresh drew its noise: advance the generator past it
                _, rng = self._draw(state.rng_state, state.latent_shape)
            state = state.model_copy(update={"rng_state": rng, "step": step, "kv_refreshed": True})
            return self._next_chunk(state) if state.chunk_decoded else state.model_copy(update={"phase": "decode"})
        frames = _decoded_frames(result)
        cache = {k[len("cache."):]: v for k, v in result.outputs.items() if k.startswith("cache.")}
        ready = ReadyChunk(chunk_index=state.chunk_index, frames=frames, frame_start=state.frames_decoded,
                           prompt_version=state.prompt_version)
        state = state.model_copy(update={
            "ready": [*state.ready, ready], "vae_cache": cache, "frames_decoded": state.frames_decoded + frames.shape[0],
            "step": step, "chunk_decoded": True,
        })
        if state.kv_refreshed or self._last_chunk(state):
            return self._next_chunk(state)  # refreshed already (an older state's order), or no chunk reads its K/V
        return state.model_copy(update={"phase": "commit"})

    def _last_chunk(self, state: CausalWanState) -> bool:
        """Whether no chunk follows the current one (``max_chunks`` or the RoPE table's end)."""
        following = state.chunk_index + 1
        return (state.max_chunks is not None and following >= state.max_chunks) or following >= self._rope_chunks

    def _next_chunk(self, state: CausalWanState) -> CausalWanState:
        """The current chunk is decoded and committed: on to the next one (a queued prompt takes effect here)."""
        state = state.model_copy(update={
            "chunk_index": state.chunk_index + 1, "chunk_step": 0, "x0": None, "chunk_decoded": False,
            "kv_refreshed": False,
        })
        state = self.apply_pending_prompt(state)  # a queued prompt takes effect from this boundary
        if self.finished(state) or state.chunk_index >= self._rope_chunks:
            return state
        latents, rng = self._draw(state.rng_state, (1, *state.latent_shape))
        window, _ = self._pool.append(state.window, state.chunk_index)
        update: dict[str, Any] = {"latents": latents, "rng_state": rng, "window": window, "phase": "denoise"}
        if state.prompt_version != state.context_version:
            ids, mask = self._tokenize(state.prompt)
            update.update({"phase": "text", "text_ids": ids, "text_mask": mask})
        return state.model_copy(update=update)

    def finalize(self, state: CausalWanState) -> LoopResult:
        return LoopResult(loop_id=self.loop_id, artifacts=[self._artifact(state, partial=False)] if self._finals(state) else [])

    def partial(self, state: CausalWanState) -> LoopResult | None:
        return LoopResult(loop_id=self.loop_id, artifacts=[self._artifact(state, partial=True)]) if self._finals(state) else None

    @staticmethod
    def _finals(state: CausalWanState) -> list[ReadyChunk]:
        return [chunk for chunk in state.ready if not chunk.preview]

    def _artifact(self, state: CausalWanState, *, partial: bool) -> VideoArtifact:
        frames = torch.cat([chunk.frames for chunk in self._finals(state)]).float().cpu()
        if state.requested_frames is not None:
            frames = frames[: state.requested_frames]
        return VideoArtifact(frames=frames, fps=state.fps, provenance=Provenance(
            model_id=state.model_id, loop_id=self.loop_id, request_id=state.request_id, node=state.instance_id,
            seed=state.seed, weights_version=state.weights_version, partial=partial,
            recipe_overrides=state.recipe_overrides,
        ))

    # -- the session runtime's hooks -----------------------------------------------------------
    def cancel_stream(self, state: CausalWanState) -> CausalWanState:
        """Drop undelivered chunks and restart the current chunk from fresh noise (its slab is rewritten). A chunk
        already decoded is not restarted (its frames were taken, and the VAE's cache has moved past them): its KV
        refresh finishes it, and the stream goes on with the next chunk (its frames, if not yet taken, stay ready:
        dropping them would leave a gap)."""
        keep = [c for c in state.ready if state.chunk_decoded and c.chunk_index == state.chunk_index and not c.preview]
        state = state.model_copy(update={"ready": keep})
        if state.phase in ("denoise", "preview", "commit", "decode") and not state.chunk_decoded and not self.finished(state):
            latents, rng = self._draw(state.rng_state, (1, *state.latent_shape))
            state = state.model_copy(update={"latents": latents, "rng_state": rng, "chunk_step": 0, "x0": None,
                                             "preview_x0": None, "phase": "denoise", "kv_refreshed": False})
        return state

    def update_prompt(self, state: CausalWanState, prompt: str, version: int) -> CausalWanState:
        """Queue the prompt. When no step of the current chunk has run yet (the runtime calls this between a
        chunk's decode and its first forward), that is the boundary: the chunk is generated under it. A chunk
        part-way through its denoise steps restarts under it from fresh noise (recipe ``prompt_update:
        restart``; its slab is written only at the KV refresh, so nothing else changes) or keeps the old
        prompt (``boundary``); a chunk at its KV refresh or decode is finished, and the update waits for
        the next chunk."""
        state = super().update_prompt(state, prompt, version)
        denoising = state.phase in ("denoise", "preview")  # a preview waits between the chunk's first two steps
        in_progress = denoising and state.chunk_step > 0
        if state.phase == "text" or (denoising and (
                state.chunk_step == 0 or self._recipe.prompt_update == "restart")):
            state = self.apply_pending_prompt(state)
            ids, mask = self._tokenize(state.prompt)
            update: dict[str, Any] = {"phase": "text", "text_ids": ids, "text_mask": mask}
            if in_progress:
                latents, rng = self._draw(state.rng_state, (1, *state.latent_shape))
                update.update({"latents": latents, "rng_state": rng, "chunk_step": 0, "preview_x0": None})
            state = state.model_copy(update=update)
        return state

    def suspend(self, state: CausalWanState, ctx: LoopContext) -> CausalWanState:
        """The state with its window's K/V copied in (``SlabKVPool.snapshot``): self-contained bytes."""
        if state.kv_snapshot is not None:
            return state
        return state.model_copy(update={"kv_snapshot": self._pool.snapshot(state.window)})

    def restore(self, state: CausalWanState, model: Any, ctx: LoopContext) -> CausalWanState:
        """Re-acquire the window's slabs in this process's pool and copy the suspended K/V back."""
        window = state.window
        held = set(self._pool.owned(window.owner))
        if state.kv_snapshot is None:
            if set(window.slabs) <= held:
                return state  # same process, slabs still ours
            raise InvalidRequest("state", f"the state of {window.owner!r} holds no K/V snapshot and its slabs are not "
                                 "in this pool: resume a state made by suspend()")
        if held:
            self._pool.close_owner(window.owner)  # a failed attempt's slabs in this process
        restored = self._pool.restore(window.owner, window.spec, state.kv_snapshot, window.positions)
        return state.model_copy(update={"window": restored, "kv_snapshot": None})

    def release(self, owner: str, model: Any) -> None:
        """Free the session's slabs (its window's owner is the session's request id)."""
        self._pool.close_owner(owner)

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        """The session's window of slabs (reserved at admission) and, per chunk, its steps."""
        recipe = CausalRecipe(**self.spec.config)
        d = request.diffusion
        height, width = d.height or recipe.max_height, d.width or recipe.max_width
        vae = _vae_config(model.card)
        latent = str((_transformer_config(model.card).in_channels, recipe.frames_per_chunk,
                      height // vae.spatial_compression, width // vae.spatial_compression))
        steps = (
            StepEstimate(loop_id=self.loop_id, kind=WorkKind.ENCODER_CHUNK,
                         shape_sig=ShapeSignature.of(tokens=recipe.max_sequence_length)),
            StepEstimate(loop_id=self.loop_id, kind=WorkKind.DIFFUSION_STEP, count=len(recipe.denoising_steps) + 1,
                         shape_sig=ShapeSignature.of(latent=latent, window=recipe.window.max_slabs)),
            # With previews, each chunk decodes twice (its first step's x0 estimate, then the chunk).
            StepEstimate(loop_id=self.loop_id, kind=WorkKind.VAE_TILE, shape_sig=ShapeSignature.of(latent=latent, first=0),
                         count=2 if request.output.stream_previews and len(recipe.denoising_steps) > 1 else 1),
        )
        return ResourceRequest(steps=steps, pool_blocks={CHUNK_KV: recipe.window.max_slabs})


# --------------------------------------------------------------------------- cards


#: Live sessions' chunk forwards fused into one ``causal_forward`` (docs/realtime.md, "Batching sessions").
_BATCHED_CAUSAL_FP32 = BatchedVsAlone(
    precision="fp32", max_abs=1e-5,
    justification=(
        "decoded frames in [0, 1], fp32 on CPU: three sessions of the tiny causal card started one after another "
        "(rows at different chunks, steps, prompts and window fills fused) vs each session alone, measured "
        "<= 8.4e-7 (plugins/fv-wan/tests/test_causal_batch.py), 1e-5 leaves ~12x; only the GEMMs' batch size changes (the attention "
        "runs per row, as alone). A row reading another row's timestep or window moves its output by > 1e-3"
    ),
)


def _causal_batching(base: ModelCard) -> tuple[BatchedVsAlone, ...]:
    """fp32: measured on the causal forward itself. Other precisions: the base card's measured promise, which
    covers the same per-row GEMMs and norms (the causal op adds only per-row attention calls, each the call the
    row makes alone); a base that declares none leaves the causal card's steps unfused at that precision."""
    inherited = tuple(
        entry.model_copy(update={"justification": f"as the bidirectional base card {base.model_id!r} "
                                 f"(the same per-row GEMMs; attention per row as alone): {entry.justification}"})
        for entry in base.parity.batched_vs_alone if entry.precision != "fp32"
    )
    return (_BATCHED_CAUSAL_FP32, *inherited)


def causal_card(
    base: ModelCard, *, model_id: str, summary: str, recipe: CausalRecipe, sessions: int, recipe_spec: Any,
    source: str | None = None, defaults: Any = None,
) -> ModelCard:
    """A causal card from a bidirectional Wan card of the same architecture (plain Wan weights).

    Its only loop is the chunk rollout (``realtime``, also the recipe's ``assumes_loop``); its
    text-to-video program runs it for the request's frames. ``sessions`` full windows fit the
    ``chunk_kv`` budget.
    """
    from fv_kernel.api import (
        CacheContract, LoopSpec, ParallelismContract, ParityLevel, ParitySpec, ParityTolerance, ProgramSpec,
        StepCostSpec, TaskType,
    )

    loop = LoopSpec(
        loop_id="realtime", kind="chunk_rollout", implementation=f"{__name__}:CausalWanRolloutLoop",
        state_schema=f"{__name__}:CausalWanState", config=recipe.model_dump(mode="json"),
        step_cost=base.loops["denoise"].step_cost if "denoise" in base.loops else StepCostSpec(fixed_seconds=0.02),
    )
    config = WanTransformerConfig.from_diffusers_config(base.components["transformer"].config)
    vae = WanVAEConfig.from_diffusers_config(base.components["vae_decoder"].config)
    tokens = recipe.frames_per_chunk * (recipe.max_height // vae.spatial_compression // config.patch_size[1]) * (
        recipe.max_width // vae.spatial_compression // config.patch_size[2])
    precision_bytes = 2 if base.precision.default in ("bf16", "fp16") else 4
    slab_bytes = 2 * config.num_layers * tokens * config.inner_dim * precision_bytes
    t2v = TaskType.TEXT_TO_VIDEO
    capabilities = base.capabilities.model_copy(update={
        "tasks": frozenset({t2v}), "uses_guidance": False,
        **({"defaults": defaults} if defaults is not None else {}),
    })
    parity = ParitySpec(
        level=ParityLevel.C1, reference="the same weights run as one sequence under a block-causal attention mask",
        tolerances=(ParityTolerance(
            name="chunked_kv_vs_block_causal_mask", metric="max_abs", dtype="fp32", value=1e-5,
            justification=("chunk-by-chunk generation with the slab KV cache vs a from-scratch full-sequence forward "
                           "under an explicit block-causal mask, tiny config, fp32 CPU: the residue is reduction order"),
        ),),
        tests=("plugins/fv-wan/tests/test_causal_parity.py", "plugins/fv-wan/tests/test_causal_vae.py",
               "plugins/fv-wan/tests/test_causal_batch.py"),
        batched_vs_alone=_causal_batching(base),
    )
    data = base.model_copy(update={
        "model_id": model_id, "summary": summary, "loops": {"realtime": loop},
        "programs": {t2v: ProgramSpec(loops=("realtime",), returns=frozenset({"video"}))},
        "capabilities": capabilities, "recipe": recipe_spec, "parity": parity,
        "caches": {CHUNK_KV: CacheContract(cache_class="slab_kv", budget_bytes=sessions * recipe.window.max_slabs * slab_bytes,
                                           block_bytes=slab_bytes)},
        "parallelism": ParallelismContract(),
        "factory": f"{__name__}:build_causal_toy_instance" if base.factory.endswith(":build_toy_instance")
        else f"{__name__}:build_causal_wan_instance",
        "checkpoint": base.checkpoint.model_copy(update={"source": source if source is not None else base.checkpoint.source}),
    }).model_dump()
    return ModelCard.model_validate(data)
