"""Self-Forcing distillation (method ``self_forcing``): a causal few-step student from a bidirectional teacher.

The student generates video **chunk by chunk** exactly as a causal card serves it: per chunk,
the few-step DMD sampler from fresh noise (predict v, ``x0 = x_t - sigma v``, re-noise with fresh
noise to the next sigma), attending to the committed K/V of earlier chunks; after the chunk, one
more forward of its clean x0 at ``t = context_noise`` (0) commits the chunk's K/V (the KV
refresh). The committed K/V live in the slab chunk-KV pool serving uses, in its training mode
(:class:`RolloutKV`): each chunk attends through the served window (sink and local chunks), and
no slab is recycled mid-rollout. Training runs that same rollout (Self-Forcing, Huang et al. 2025):

- one **exit step** k is drawn per rollout (shared by all chunks); each chunk runs steps
  0..k-1 without grad and its output is the x0 of step k, the only forward with grad (and only
  for chunks inside the scored window); the KV refresh runs without grad, so no gradient flows
  through another chunk's K/V;
- **prompt switches**: with probability ``switch_prob`` the rollout first generates a random
  number of chunks under prompt A (all without grad, their K/V committed), then switches to
  prompt B (A with another direction, in ``toy-world`` mode) for the scored window, so the
  student learns to follow a prompt update at a chunk boundary;
- the scored window (the teacher's clip length) gets the **DMD loss**: noised to a random
  sigma, x0 from the frozen bidirectional teacher (the real score, with CFG) and from the
  fake-score critic, grad ``(x0_fake - x0_real) / mean|x0 - x0_real|`` and loss
  ``0.5 |x0 - sg(x0 - grad)|^2`` (:func:`fv_rl.dmd2.dmd_loss`). After a switch the window's
  first frame is the teacher's "first latent frame" (a single image in Wan's causal VAE) but
  the student's is a 4-frame chunk, so it is context only (no DMD gradient);
- the critic (initialised from the teacher, bidirectional) learns the student's windows with
  the flow loss every step; the student is updated every ``critic_updates``-th step.

The result is the student transformer exported as a card (the teacher's card with the new
weights; the causal card that serves them names its chunk-rollout loop) with provenance: the
teacher's id, card version and weights digest, the options, steps run, seed and git commit.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from fv_kernel.api import (
    AttendedChunk,
    DMDSampler,
    ParityLevel,
    RecipeError,
    RecipeSpec,
    RLMethod,
    SlabKVConfig,
    SlabKVPool,
    SlabWindowSpec,
    TrainedModel,
    TrainingRun,
    add_noise,
    torch_dtype,
)
from fv_rl.dmd2 import dmd_loss
from fv_rl.flow_matching import context_length_of

__all__ = [
    "PROVENANCE_FILE",
    "CausalSchedule",
    "RolloutKV",
    "SelfForcing",
    "SelfForcingOptions",
    "causal_forward",
    "causal_rollout",
    "causal_serving_card",
    "scored_frames",
    "switch_prompt",
    "teacher_forcing_loss",
    "world_clips",
]

TIMESTEP_SCALE = 1000.0
PROVENANCE_FILE = "provenance.json"


class TeacherForcingStage(BaseModel):
    """The warm start before the DMD stage (``prompt_source: toy-world`` only): the causal student
    regresses toy-world clips (VAE-encoded renders) chunk by chunk, each noisy chunk at one of the
    sampler's sigmas attending to the committed clean chunks before it -- CausVid's initialisation
    with the world's data in place of teacher ODE pairs. Half the clips are **bounces**: a scene
    played backwards (its objects moving the opposite way) for ``prefix_chunks`` chunks under that
    prompt, then forwards from where it reached under the scene's own prompt: a prompt switch at
    a chunk boundary with the video that follows it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(default=0, ge=0)
    batch: PositiveInt = 8
    #: World clips encoded once (half plain, half bounces).
    clips: PositiveInt = 256
    lr: float = Field(default=5e-5, gt=0)
    #: Chunks of the reversed segment before a bounce's switch.
    prefix_chunks: PositiveInt = 3
    data_seed: int = 100
    time_limit_s: float | None = Field(default=None, gt=0)


class SelfForcingOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: ``list``: train on ``prompts`` (a switch goes to another prompt of the list); ``toy-world``:
    #: sample fv-wan's toy grammar (held-out prompts never), a switch changes the first object's direction.
    prompt_source: Literal["list", "toy-world"] = "list"
    prompts: tuple[str, ...] = ("a red circle moves left quickly on a black background",)
    #: Share of rollouts with a prompt switch at a chunk boundary before the scored window.
    switch_prob: float = Field(default=0.5, ge=0.0, le=1.0)
    #: Most chunks generated under the first prompt before a switch (drawn from 1..this).
    max_prefix_chunks: PositiveInt = 3
    #: The student's sampler: the DMD sampler's timesteps, warped by ``timestep_shift`` (Self-Forcing's
    #: [1000, 750, 500, 250] with shift 5 -> [1000, 937.5, 833.3, 625]).
    denoising_timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
    timestep_shift: float = Field(default=5.0, gt=0)
    #: Latent frames per chunk.
    chunk_frames: PositiveInt = 1
    #: Timestep (fraction of 1000) of the KV refresh forward of a finished chunk (0: the clean x0).
    context_noise: float = Field(default=0.0, ge=0.0, lt=1.0)
    #: The exported causal card's attention window in chunks: the first ``sink_chunks`` and the latest
    #: ``local_chunks`` (the chunk itself included). Training rollouts attend through the same window
    #: (:class:`RolloutKV`, ``served_window``), so a rollout longer than it sees what serving would.
    sink_chunks: int = Field(default=1, ge=0)
    local_chunks: PositiveInt = 8
    steps: PositiveInt = 200
    batch: PositiveInt = 2
    lr: float = Field(default=1e-5, gt=0)
    critic_lr: float = Field(default=1e-5, gt=0)
    #: Critic updates per student update.
    critic_updates: PositiveInt = 5
    #: CFG scale of the teacher's (real) score; 1: none.
    teacher_guidance: float = Field(default=4.5, ge=1.0)
    #: Shift of the score timesteps (drawn uniformly from [0.02, 0.98], then shifted as the teacher trains).
    score_shift: float = Field(default=3.0, gt=0)
    height: PositiveInt | None = None
    width: PositiveInt | None = None
    #: Pixel frames of the scored window (the teacher's clip); None: the card's default frames.
    frames: PositiveInt | None = None
    #: Stop after this much wall-clock training time (the steps run are recorded); None: run all steps.
    time_limit_s: float | None = Field(default=None, gt=0)
    log_every: PositiveInt = 10
    #: The causal warm start on toy-world clips (None or 0 steps: none).
    teacher_forcing: TeacherForcingStage | None = None
    #: An earlier ``self_forcing`` export (its output folder or its ``checkpoint`` folder) whose student
    #: starts this run instead of the teacher's weights, so runs add up (a CPU budget per session). Its
    #: ``provenance.json`` must name the same teacher weights (sha256); both runs are in the new provenance.
    init_student: str | None = None

    @model_validator(mode="after")
    def _check(self) -> SelfForcingOptions:
        if not self.prompts and self.prompt_source == "list":
            raise ValueError("prompts must name at least one prompt (prompt_source 'list')")
        if self.teacher_forcing is not None and self.teacher_forcing.steps and self.prompt_source != "toy-world":
            raise ValueError("teacher_forcing needs prompt_source 'toy-world' (it trains on the toy world's clips)")
        self.sampler()  # the schedule must be valid
        return self

    @property
    def served_window(self) -> SlabWindowSpec:
        """The exported card's attention window, which training rollouts attend through too."""
        return SlabWindowSpec(sink_slabs=self.sink_chunks, local_slabs=self.local_chunks)

    def sampler(self) -> DMDSampler:
        return DMDSampler(
            denoising_timesteps=self.denoising_timesteps, shift=self.timestep_shift, timesteps_are_scheduler_space=False
        )


# -- the causal forward: the card's own transformer, committed chunks' K/V in front of a chunk's own


class RolloutKV:
    """A rollout's committed self-attention K/V (K after RoPE, V raw), detached, in the slab chunk-KV pool a
    causal card serves from (:class:`fv_kernel.api.SlabKVPool`), in its training mode.

    One window per batch row, with the served window's ``sink`` and ``local`` sizes: a chunk attends
    to exactly the chunks serving would give it, past the window too (the oldest non-sink chunk
    leaves it). Inside :meth:`SlabKVPool.training_rollout` no slab is recycled until the rollout
    ends: an evicted chunk's K/V stay where they were written, and ``attended`` records what each
    chunk attended to. The pool is private to the rollout and sized for every chunk it commits.
    Use it as a context manager; a chunk's slab is taken at its first forward, and the forward with
    ``commit`` (the KV refresh) writes it and ends the chunk. ``window`` None: one that holds every chunk.
    """

    def __init__(self, model: Any, chunk_shape: tuple[int, ...], chunks: int, window: SlabWindowSpec | None) -> None:
        config = model.config
        p_t, p_h, p_w = config.patch_size
        batch, _, frames, height, width = chunk_shape
        weights = next(model.parameters())
        dtype = next(name for name in ("fp32", "bf16", "fp16") if torch_dtype(name) == weights.dtype)
        window = window or SlabWindowSpec(sink_slabs=0, local_slabs=max(1, chunks))
        self.pool = SlabKVPool(SlabKVConfig(
            num_layers=len(model.blocks), num_heads=config.num_attention_heads, head_dim=config.attention_head_dim,
            tokens_per_slab=(frames // p_t) * (height // p_h) * (width // p_w), num_slabs=max(1, batch * chunks),
            dtype=dtype, device=str(weights.device),
        ), name="rollout_kv")
        self.owners = [f"row{row}" for row in range(batch)]
        self.windows = [self.pool.open(owner, window) for owner in self.owners]
        #: Latent frames committed so far: the next chunk's RoPE start.
        self.frames = 0
        #: The chunk the next forward belongs to.
        self.chunk = 0
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> RolloutKV:
        for owner in self.owners:
            self._stack.enter_context(self.pool.training_rollout(owner))
        return self

    def __exit__(self, *exc: object) -> None:
        for window in self.windows:
            self.pool.close(window)
        self._stack.close()

    def _take_slab(self) -> None:
        if not self.windows[0].positions or self.windows[0].positions[-1] != self.chunk:
            self.windows = [self.pool.append(window, self.chunk)[0] for window in self.windows]

    def history(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per layer, the K/V the current chunk attends to before its own, (B, tokens, heads, head_dim), or None."""
        self._take_slab()
        if len(self.windows[0].positions) == 1:
            return [None] * self.pool.config.num_layers
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for layer in range(self.pool.config.num_layers):
            rows = [self.pool.read(window, layer, upto=self.chunk) for window in self.windows]
            out.append((torch.stack([k for k, _ in rows]), torch.stack([v for _, v in rows])))
        return out

    def commit(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The current chunk's K/V (B, tokens, heads, head_dim) of ``layer`` into each row's slab."""
        for row, window in enumerate(self.windows):
            self.pool.write(window.slabs[-1], layer, key[row].detach(), value[row].detach())

    def end_chunk(self, latent_frames: int) -> None:
        self.frames += latent_frames
        self.chunk += 1

    def attended(self, row: int = 0) -> tuple[AttendedChunk, ...]:
        """What each chunk of ``row`` attended to (slab ids and chunk positions, itself included)."""
        return self.pool.attended_history(self.owners[row])


def causal_forward(
    model: Any, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, kv: RolloutKV, *, commit: bool = False
) -> torch.Tensor:
    """The flow prediction of one chunk ``x`` (B, C, F, H, W) at absolute latent frames ``kv.frames..``,
    through the causal card's own chunk forward (:func:`fv_wan.models.causal_transformer.causal_chunk_forward`,
    what serving runs); with ``commit`` the chunk's K/V go into its slab (the KV refresh) and the chunk ends."""
    from fv_wan.models.causal_transformer import causal_chunk_forward

    out = causal_chunk_forward(
        model, x, timestep, context, start_frame=kv.frames, history=kv.history(),
        kv_sink=kv.commit if commit else None, attention_fn=F.scaled_dot_product_attention,
    )
    if commit:
        kv.end_chunk(x.shape[2] // model.config.patch_size[0])
    return out


@dataclasses.dataclass(frozen=True)
class CausalSchedule:
    """The few-step sampler as sigmas (n+1, last 0) and model timesteps (n), plus the KV refresh timestep."""

    sigmas: torch.Tensor
    timesteps: torch.Tensor
    context_noise: float = 0.0

    @classmethod
    def of(cls, options: SelfForcingOptions) -> CausalSchedule:
        state = options.sampler().init_state(len(options.denoising_timesteps))
        return cls(state.sigmas.float(), state.timesteps.float(), options.context_noise)

    @property
    def steps(self) -> int:
        return len(self.timesteps)


def _with_grad(step: int, last: int, chunk: int, grad_chunks: frozenset[int]) -> bool:
    """Self-Forcing's gradient truncation: only a scored chunk's exit step runs with grad."""
    return step == last and chunk in grad_chunks


def causal_rollout(
    model: Any,
    contexts: list[torch.Tensor],
    chunk_shape: tuple[int, ...],
    schedule: CausalSchedule,
    generator: torch.Generator,
    *,
    exit_step: int | None = None,
    grad_chunks: frozenset[int] = frozenset(),
    window: SlabWindowSpec | None = None,
    attended: list[tuple[AttendedChunk, ...]] | None = None,
) -> list[torch.Tensor]:
    """Generate ``len(contexts)`` chunks (chunk i conditioned on ``contexts[i]``), each (B, C, F, H, W).

    ``exit_step`` None: every chunk runs all steps (inference). Otherwise each chunk's output is
    the x0 of step ``exit_step``; that forward alone has grad, for chunks in ``grad_chunks``.
    ``window``: the served attention window (sink and local chunks; None: every chunk, nothing
    evicted). ``attended``, when given, receives what each chunk of row 0 attended to."""
    last = schedule.steps - 1 if exit_step is None else exit_step
    batch, device = chunk_shape[0], contexts[0].device

    def noise() -> torch.Tensor:  # drawn on the CPU generator: the same rollout on every device
        return torch.randn(chunk_shape, generator=generator).to(device)

    outputs = []
    with RolloutKV(model, chunk_shape, len(contexts), window) as kv:
        for chunk, context in enumerate(contexts):
            x = noise()
            for step in range(last + 1):
                sigma = schedule.sigmas[step]
                with torch.set_grad_enabled(_with_grad(step, last, chunk, grad_chunks)):
                    v = causal_forward(model, x, schedule.timesteps[step].expand(batch), context, kv).float()
                    x0 = x - sigma * v
                if step < last:
                    x = add_noise(x0.detach(), noise(), schedule.sigmas[step + 1])
            outputs.append(x0)
            refresh = x0.detach()
            if schedule.context_noise > 0:
                refresh = add_noise(refresh, noise(), schedule.context_noise)
            with torch.no_grad():
                causal_forward(model, refresh, torch.full((batch,), schedule.context_noise * TIMESTEP_SCALE), context,
                               kv, commit=True)
        if attended is not None:
            attended.append(kv.attended())
    return outputs


def causal_serving_card(exported: Any, options: SelfForcingOptions, context_length: int, *, envelope: Any = None) -> Any:
    """The card that serves a student: the export (the teacher's card with the student's weights) made
    causal by fv-wan (its ``realtime`` chunk-rollout loop with this recipe's sampler, chunking, KV refresh
    and window, the slab chunk-KV pool, the recipe assuming that loop), sized for the trained frame. The
    teacher's trained ``envelope`` carries over at the student's size, its ``frames`` bound lifted (a stream
    has no fixed length)."""
    from fv_wan.causal import CausalRecipe, causal_card

    defaults = exported.capabilities.defaults
    height, width = options.height or defaults.height, options.width or defaults.width
    recipe = CausalRecipe(
        denoising_steps=options.denoising_timesteps, shift=options.timestep_shift, frames_per_chunk=options.chunk_frames,
        sink_chunks=options.sink_chunks, local_chunks=options.local_chunks, context_noise=options.context_noise * TIMESTEP_SCALE,
        max_sequence_length=context_length, max_height=height, max_width=width,
    )
    served_defaults = defaults.model_copy(update={
        "height": height, "width": width, "steps": len(options.denoising_timesteps), "guidance": 1.0,
        "shift": options.timestep_shift,
    })
    if envelope is not None:  # the student was trained at its window's size, for streams of any length
        envelope = envelope.model_copy(update={"frames": None, "max_frames": None, "sizes": ((width, height),)})
    return causal_card(
        exported, model_id=exported.model_id, summary=exported.summary, recipe=recipe, sessions=8,
        recipe_spec=exported.recipe.model_copy(update={"assumes_loop": "realtime", "envelope": envelope}),
        defaults=served_defaults,
    )


def scored_frames(prefix_chunks: int, chunk_frames: int) -> slice:
    """The window frames the DMD loss scores: all, or after a switch (a prefix) all but the first chunk's,
    which the teacher would take for a clip's first latent frame (a single image in Wan's causal VAE)."""
    return slice(chunk_frames if prefix_chunks else 0, None)


# -- prompts


def switch_prompt(prompt: str, generator: torch.Generator) -> str:
    """A toy-grammar prompt with its first object's direction changed to one of the other three
    (one not in the held-out split; the prompt itself when every other direction is held out)."""
    from fv_wan.toy.grammar import DIRECTIONS, is_held_out, parse_prompt

    scene = parse_prompt(prompt)
    first = scene.objects[0]
    others = [d for d in DIRECTIONS if d != first.direction]
    for index in torch.randperm(len(others), generator=generator).tolist():
        moved = dataclasses.replace(first, direction=others[index])
        candidate = dataclasses.replace(scene, objects=(moved, *scene.objects[1:])).prompt()
        if not is_held_out(candidate):
            return candidate
    return prompt


def _toy_prompts(generator: torch.Generator, count: int) -> list[str]:
    try:
        from fv_wan.toy.grammar import sample_scene
    except ImportError as error:  # pragma: no cover - fv-wan ships with fv-rl's test env
        raise RecipeError("options.prompt_source", "prompt_source 'toy-world' needs the fv-wan plugin installed") from error
    return [sample_scene(generator, held_out=False).prompt() for _ in range(count)]


# -- the teacher-forcing warm start


def _reversed_scene(scene: Any) -> Any:
    from fv_wan.toy.grammar import DIRECTION_VECTORS

    opposite = {d: next(o for o, w in DIRECTION_VECTORS.items() if w == (-v[0], -v[1])) for d, v in DIRECTION_VECTORS.items()}
    return dataclasses.replace(scene, objects=tuple(dataclasses.replace(o, direction=opposite[o.direction]) for o in scene.objects))


@torch.no_grad()
def world_clips(
    vae: Any, stage: TeacherForcingStage, *, frames: int, height: int, width: int, frames_per_latent: int,
    chunk_frames: int, report: Callable[[int, int], None] | None = None,
) -> tuple[tuple[torch.Tensor, list[str]], tuple[torch.Tensor, list[str], list[str]]]:
    """Normalised latents of toy-world clips: plain ones (N, C, T, h, w) with their prompts, and bounces
    (N, C, T', h, w) with the prompt before and after the switch (``stage.prefix_chunks`` chunks in)."""
    from fv_wan.toy.grammar import is_held_out
    from fv_wan.toy.world import ToyWorld, render_batch

    world = ToyWorld(frames=frames, height=height, width=width, seed=stage.data_seed)
    prefix = stage.prefix_chunks * chunk_frames * frames_per_latent - (frames_per_latent - 1)  # pixel frames, 4m+1
    plain, plain_prompts, bounce, before, after = [], [], [], [], []
    half = max(1, stage.clips // 2)
    per_batch, index, counts = min(64, half), 0, [0, 0]
    while min(counts) < half:
        scenes, seeds = world.scenes(index, per_batch)
        index += 1
        videos = render_batch(scenes, seeds, frames=frames, height=height, width=width)  # (N, F, 3, H, W) in [0, 1]
        kind = 0 if counts[0] <= counts[1] else 1
        if kind == 0:
            clips, plain_prompts_batch = videos, [scene.prompt() for scene in scenes]
            plain_prompts.extend(plain_prompts_batch)
            target = plain
        else:
            keep = [i for i, scene in enumerate(scenes) if not is_held_out(_reversed_scene(scene).prompt())]
            if not keep:
                continue
            videos = videos[keep]
            backwards = videos.flip(1)[:, -prefix:]  # the reversed scene, ending where the scene starts
            clips = torch.cat([backwards, videos[:, 1:]], dim=1)
            before.extend(_reversed_scene(scenes[i]).prompt() for i in keep)
            after.extend(scenes[i].prompt() for i in keep)
            target = bounce
        device = next(vae.parameters()).device
        latents = vae.encode(clips.permute(0, 2, 1, 3, 4).mul(2).sub(1).contiguous().to(device))[0]
        target.append(vae.normalize_latents(latents).float())
        counts[kind] += len(clips)
        if report is not None:
            report(min(sum(counts), 2 * half), 2 * half)
    return (torch.cat(plain), plain_prompts), (torch.cat(bounce), before, after)


def teacher_forcing_loss(
    model: Any, latents: torch.Tensor, contexts: list[torch.Tensor], chunk_frames: int, schedule: CausalSchedule,
    generator: torch.Generator, window: SlabWindowSpec | None = None,
) -> torch.Tensor:
    """Flow loss of every chunk of ``latents`` (B, C, T, h, w), noised to a random sampler sigma, attending
    to the clean chunks before it in ``window`` (committed without grad, as the KV refresh does); chunk i
    reads ``contexts[i]``."""
    batch = latents.shape[0]
    losses = []
    shape = (*latents.shape[:2], chunk_frames, *latents.shape[3:])
    with RolloutKV(model, shape, len(contexts), window) as kv:
        for chunk, context in enumerate(contexts):
            x0 = latents[:, :, chunk * chunk_frames:(chunk + 1) * chunk_frames]
            step = torch.randint(schedule.steps, (batch,), generator=generator)
            sigma = schedule.sigmas[step].to(x0.device)
            eps = torch.randn(x0.shape, generator=generator).to(x0.device)
            v = causal_forward(model, add_noise(x0, eps, sigma), schedule.timesteps[step], context, kv).float()
            losses.append(F.mse_loss(v, eps - x0))
            with torch.no_grad():
                causal_forward(model, x0, torch.full((batch,), schedule.context_noise * TIMESTEP_SCALE), context, kv,
                               commit=True)
    return torch.stack(losses).mean()


# -- provenance


def weights_digest(module: torch.nn.Module) -> str:
    """sha256 over a module's state dict (names, shapes, dtypes, bytes): which teacher weights were used."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def git_commit() -> str | None:
    """The source tree's commit (with '+dirty' when it has changes), or None outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=False)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True,
                               text=True, timeout=10, check=False)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


class SelfForcing(RLMethod):
    name: ClassVar[str] = "self_forcing"
    required_parity: ClassVar[ParityLevel] = ParityLevel.C1
    options_schema: ClassVar[type[BaseModel]] = SelfForcingOptions

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        return dmd_loss(batch["x0"], batch["x0_real"], batch["x0_fake"])

    def _geometry(self, run: TrainingRun) -> tuple[tuple[int, ...], int]:
        """(one chunk's latent shape (B, C, F, H, W), chunks in the scored window)."""
        o: SelfForcingOptions = self.options  # type: ignore[assignment]
        card = run.card
        defaults, grid = card.capabilities.defaults, card.capabilities.token_grid
        config = run.instance.component("transformer").config
        frames = o.frames or defaults.frames
        height, width = o.height or defaults.height, o.width or defaults.width
        if frames is None or height is None or width is None:
            raise RecipeError("options.frames", f"card {card.model_id!r} has no default frames/height/width; set them")
        if (frames - 1) % grid.frames_per_latent:
            raise RecipeError("options.frames", f"frames must be 1 + a multiple of {grid.frames_per_latent}, got {frames}")
        latent_frames = (frames - 1) // grid.frames_per_latent + 1
        if latent_frames % o.chunk_frames:
            raise RecipeError(
                "options.chunk_frames",
                f"the window's {latent_frames} latent frames ({frames} frames) are not a whole number of "
                f"{o.chunk_frames}-frame chunks",
            )
        scale = grid.pixels_per_token // config.patch_size[1]
        if height % grid.pixels_per_token or width % grid.pixels_per_token:
            raise RecipeError("options.height", f"height and width must be multiples of {grid.pixels_per_token}")
        return (o.batch, config.in_channels, o.chunk_frames, height // scale, width // scale), latent_frames // o.chunk_frames

    def train(self, run: TrainingRun) -> TrainedModel:
        o: SelfForcingOptions = self.options  # type: ignore[assignment]
        card = run.card
        if card.recipe.assumes_loop is not None:
            raise RecipeError("card", f"card {card.model_id!r} is already distilled (assumes loop "
                                      f"{card.recipe.assumes_loop!r}); self_forcing needs a multi-step teacher")
        chunk_shape, window = self._geometry(run)
        schedule = CausalSchedule.of(o)
        commit, began = git_commit(), time.perf_counter()  # the code that runs: read before training
        text_encoder = run.instance.component("text_encoder")
        context_length = context_length_of(card)
        device = run.device
        teacher = run.instance.component("transformer").eval().requires_grad_(False)
        teacher_digest = weights_digest(teacher)
        student = copy.deepcopy(teacher).train().requires_grad_(True)
        continued = self._init_student(run, student, teacher_digest) if o.init_student else None
        critic = copy.deepcopy(teacher).train().requires_grad_(True)
        opt_student = torch.optim.AdamW(student.parameters(), lr=o.lr, betas=(0.0, 0.999), weight_decay=0.0)
        opt_critic = torch.optim.AdamW(critic.parameters(), lr=o.critic_lr, betas=(0.0, 0.999), weight_decay=0.0)
        generator = torch.Generator().manual_seed(run.recipe.seed)
        uncond = text_encoder.encode([""], context_length).float() if o.teacher_guidance > 1 else None

        def encode(prompts: list[str]) -> torch.Tensor:
            return text_encoder.encode(prompts, context_length).float()

        tf_steps = self._teacher_forcing(run, student, encode, chunk_shape, schedule)
        batch = o.batch
        start, steps_run, g_loss = time.perf_counter(), 0, float("nan")
        for step in range(1, o.steps + 1):
            if o.time_limit_s is not None and time.perf_counter() - start > o.time_limit_s:
                break
            if o.prompt_source == "toy-world":
                first = _toy_prompts(generator, batch)
            else:
                first = [o.prompts[int(i)] for i in torch.randint(len(o.prompts), (batch,), generator=generator)]
            switched = bool(torch.rand((), generator=generator) < o.switch_prob)
            prefix = int(torch.randint(1, o.max_prefix_chunks + 1, (1,), generator=generator)) if switched else 0
            if switched and o.prompt_source == "toy-world":
                second = [switch_prompt(p, generator) for p in first]
            elif switched:
                second = [o.prompts[int(i)] for i in torch.randint(len(o.prompts), (batch,), generator=generator)]
            else:
                second = first
            ctx_a, ctx_b = encode(first), encode(second)
            contexts = [ctx_a] * prefix + [ctx_b] * window
            exit_step = int(torch.randint(schedule.steps, (1,), generator=generator))
            update_student = step % o.critic_updates == 0
            grad_chunks = frozenset(range(prefix, prefix + window)) if update_student else frozenset()
            chunks = causal_rollout(student, contexts, chunk_shape, schedule, generator, exit_step=exit_step,
                                    grad_chunks=grad_chunks, window=o.served_window)
            x0 = torch.cat(chunks[prefix:], dim=2)  # the scored window (B, C, window frames, H, W)

            # the critic learns the student's windows (flow matching)
            sigma = self._score_sigma(batch, o, generator).to(device)
            eps = torch.randn(x0.shape, generator=generator).to(device)
            x0_d = x0.detach()
            c_loss = F.mse_loss(critic(add_noise(x0_d, eps, sigma), sigma * TIMESTEP_SCALE, ctx_b).float(), eps - x0_d)
            opt_critic.zero_grad(set_to_none=True)
            c_loss.backward()
            torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
            opt_critic.step()

            if update_student:
                sigma = self._score_sigma(batch, o, generator).to(device)
                x_t = add_noise(x0.detach(), torch.randn(x0.shape, generator=generator).to(device), sigma)
                sb = sigma.view(-1, 1, 1, 1, 1)
                with torch.no_grad():
                    t = sigma * TIMESTEP_SCALE
                    v_real = teacher(x_t, t, ctx_b).float()
                    if uncond is not None:
                        v_uncond = teacher(x_t, t, uncond.expand(batch, -1, -1)).float()
                        v_real = v_uncond + o.teacher_guidance * (v_real - v_uncond)
                    v_fake = critic(x_t, t, ctx_b).float()
                keep = scored_frames(prefix, o.chunk_frames)
                loss = self.loss({
                    "x0": x0[:, :, keep], "x0_real": (x_t - sb * v_real)[:, :, keep],
                    "x0_fake": (x_t - sb * v_fake)[:, :, keep],
                })  # fmt: skip
                opt_student.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
                opt_student.step()
                g_loss = float(loss.detach())
            steps_run = step
            if step % o.log_every == 0 or step == o.steps:
                run.report("self_forcing", step, o.steps,
                           {"critic": float(c_loss.detach()), **({} if math.isnan(g_loss) else {"dmd": g_loss})})

        seconds = time.perf_counter() - began
        student.eval().requires_grad_(False)
        provenance = {
            "method": self.name,
            "teacher": {"model_id": card.model_id, "card_version": card.version, "transformer_sha256": teacher_digest,
                        "weights": card.checkpoint.source if card.checkpoint is not None else None},
            "recipe": run.recipe.model_dump(mode="json"),
            "steps": {"teacher_forcing": tf_steps, "self_forcing": steps_run, "student_updates": steps_run // o.critic_updates},
            "seconds": round(seconds, 1),
            "seed": run.recipe.seed,
            "git_commit": commit,
            "torch": torch.__version__,
            **({"continued_from": continued} if continued is not None else {}),
        }
        run.output.mkdir(parents=True, exist_ok=True)
        (run.output / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2, default=str) + "\n")
        sigmas = [round(float(s), 4) for s in schedule.sigmas[:-1]]
        recipe = RecipeSpec(
            method=self.name, parents=(card.model_id,), consistency_required=ParityLevel.C1,
            data_contract=(
                f"Self-Forcing (DMD) from teacher {card.model_id!r} (card version {card.version}, transformer sha256 "
                f"{teacher_digest[:16]}) with teacher guidance {o.teacher_guidance}; causal student: "
                f"{o.chunk_frames}-latent-frame chunks, KV refresh at t={o.context_noise:g}, "
                f"{schedule.steps}-step schedule {list(o.denoising_timesteps)} shift {o.timestep_shift:g} (sigmas {sigmas}); "
                + (f"warm start: teacher forcing on toy-world clips (seed {o.teacher_forcing.data_seed}, {o.teacher_forcing.clips} "
                   f"clips, half bounces switching after {o.teacher_forcing.prefix_chunks} chunks), {tf_steps} steps x batch "
                   f"{o.teacher_forcing.batch}, lr {o.teacher_forcing.lr}; " if tf_steps else "")
                + (f"continued from an earlier student (transformer sha256 {continued['transformer_sha256'][:16]}, "
                   f"{continued['steps']}); " if continued is not None else "")
                + f"prompts {o.prompt_source}" + (f" ({len(o.prompts)})" if o.prompt_source == "list" else "")
                + f", switches {o.switch_prob:g} after 1..{o.max_prefix_chunks} chunks; {steps_run} steps x batch "
                f"{o.batch} ({steps_run // o.critic_updates} student updates, critic {o.critic_updates}:1), lr {o.lr} / "
                f"{o.critic_lr}, seed {run.recipe.seed}, commit {provenance['git_commit'] or 'unknown'}"
            ),
        )
        return TrainedModel(
            modules={"transformer": student.cpu(), "text_encoder": text_encoder.cpu()},
            recipe=recipe, steps={"teacher_forcing": tf_steps, "self_forcing": steps_run} if tf_steps else {"self_forcing": steps_run},
            serve_as=lambda exported: causal_serving_card(exported, o, context_length, envelope=card.recipe.envelope),
        )

    def _init_student(self, run: TrainingRun, student: Any, teacher_digest: str) -> dict[str, Any]:
        """Load an earlier export's transformer into ``student`` (through the family's own loader); what
        the new provenance records of it."""
        from fv_kernel.api import InstanceOptions, build_instance, read_card_file_beside

        o: SelfForcingOptions = self.options  # type: ignore[assignment]
        folder = Path(o.init_student).expanduser()  # type: ignore[arg-type]
        checkpoint = folder / "checkpoint" if (folder / "checkpoint" / "fv-card.json").is_file() else folder
        provenance_file = next((p for p in (checkpoint / PROVENANCE_FILE, checkpoint.parent / PROVENANCE_FILE)
                                if p.is_file()), None)
        if not (checkpoint / "fv-card.json").is_file() or provenance_file is None:
            raise RecipeError("options.init_student", f"{folder} is not a self_forcing export (no fv-card.json "
                                                      f"with {PROVENANCE_FILE} beside it)")
        earlier = json.loads(provenance_file.read_text())
        if earlier.get("method") != self.name or earlier.get("teacher", {}).get("transformer_sha256") != teacher_digest:
            raise RecipeError("options.init_student", f"{folder} was not distilled by {self.name} from this teacher "
                                                      f"(transformer sha256 {teacher_digest[:16]})")
        card = read_card_file_beside(checkpoint)
        instance = build_instance(card, InstanceOptions(device="cpu", precision="fp32", source=str(checkpoint)))
        weights = instance.component("transformer").state_dict()
        student.load_state_dict(weights, strict=True)
        return {"path": str(checkpoint), "transformer_sha256": weights_digest(student), "steps": earlier.get("steps"),
                "git_commit": earlier.get("git_commit"), **({"continued_from": earlier["continued_from"]}
                                                             if "continued_from" in earlier else {})}

    def _teacher_forcing(
        self, run: TrainingRun, student: Any, encode: Callable[[list[str]], torch.Tensor], chunk_shape: tuple[int, ...],
        schedule: CausalSchedule,
    ) -> int:
        """The warm start (:class:`TeacherForcingStage`); the steps it ran."""
        o: SelfForcingOptions = self.options  # type: ignore[assignment]
        stage = o.teacher_forcing
        if stage is None or stage.steps == 0:
            return 0
        grid = run.card.capabilities.token_grid
        frames = o.frames or run.card.capabilities.defaults.frames
        height = o.height or run.card.capabilities.defaults.height
        width = o.width or run.card.capabilities.defaults.width
        vae = run.instance.component("vae").eval()
        (plain, plain_prompts), (bounce, before, after) = world_clips(
            vae, stage, frames=frames, height=height, width=width, frames_per_latent=grid.frames_per_latent,
            chunk_frames=o.chunk_frames, report=lambda done, total: run.report("encode", done, total, {}),
        )
        optimizer = torch.optim.AdamW(student.parameters(), lr=stage.lr, betas=(0.9, 0.99), weight_decay=0.0)
        generator = torch.Generator().manual_seed(run.recipe.seed + 7)
        start, done = time.perf_counter(), 0
        for step in range(1, stage.steps + 1):
            if stage.time_limit_s is not None and time.perf_counter() - start > stage.time_limit_s:
                break
            if step % 2:
                rows = torch.randint(len(plain), (stage.batch,), generator=generator)
                latents = plain[rows.to(plain.device)]
                ctx = encode([plain_prompts[int(i)] for i in rows])
                contexts = [ctx] * (latents.shape[2] // o.chunk_frames)
            else:
                rows = torch.randint(len(bounce), (stage.batch,), generator=generator)
                latents = bounce[rows.to(bounce.device)]
                ctx_a, ctx_b = encode([before[int(i)] for i in rows]), encode([after[int(i)] for i in rows])
                chunks = latents.shape[2] // o.chunk_frames
                contexts = [ctx_a] * stage.prefix_chunks + [ctx_b] * (chunks - stage.prefix_chunks)
            loss = teacher_forcing_loss(student, latents, contexts, o.chunk_frames, schedule, generator,
                                        o.served_window)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            optimizer.step()
            done = step
            if step % o.log_every == 0 or step == stage.steps:
                run.report("teacher_forcing", step, stage.steps, {"flow": float(loss.detach())})
        return done

    @staticmethod
    def _score_sigma(batch: int, o: SelfForcingOptions, generator: torch.Generator) -> torch.Tensor:
        u = torch.rand(batch, generator=generator) * 0.96 + 0.02
        return o.score_shift * u / (1 + (o.score_shift - 1) * u)
