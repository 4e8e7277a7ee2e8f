"""Flow matching: fv-rl's first training method (``flow-matching``).

It trains a Wan-architecture card's own components -- the instance's ``vae`` (both
halves), ``transformer`` and ``text_encoder``, the modules serving runs -- in two stages:

1. **VAE**: reconstruct toy-world clips (L1 + L2 in [-1, 1], object pixels weighted up) from
   the posterior mean (or a sample), with a small KL term towards N(0, 1). Then the VAE is frozen.
2. **DiT**: encode a fixed set of clips to posterior-mean latents, measure their
   per-channel mean and std (stored in the VAE config as ``latents_mean``/``latents_std``,
   as Wan does), and train the transformer (and, by default, the text encoder) with the
   rectified-flow objective on the normalised latents:

   ``x_t = (1 - sigma) x0 + sigma eps``, target ``v = eps - x0`` (the kernel samplers'
   convention: ``x0 = x_t - sigma v``), ``sigma = shift(sigmoid(N(mu, s)))`` with the
   card's sampler shift, timestep ``1000 sigma``. Prompts are dropped to the empty prompt
   with probability ``cfg_dropout`` so classifier-free guidance works at serve time.

The data is any class with ``ToyWorld``'s interface (``Cls(frames=, height=, width=, seed=)``
and ``.batch(index, size, device) -> (videos (B, F, 3, H, W) in [0, 1], prompts)``), named
by import string; its module's ``GENERATOR_VERSION`` goes into the card's data contract.
On CUDA the forward runs under bf16 autocast (fp32 master weights) and the transformer
is ``torch.compile``d; on the CPU everything is fp32 eager.
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
import time
from typing import Any, Callable, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from fv_kernel.api import (
    ParityLevel,
    RecipeError,
    RecipeSpec,
    RLMethod,
    TrainedModel,
    TrainingRun,
    add_noise,
    import_object,
    shift_sigmas,
)

__all__ = ["FlowMatching", "FlowMatchingOptions", "VAEStage", "DiTStage", "flow_target", "sample_sigmas",
           "context_length_of", "continued_recipe", "reconstruction_weight"]

TIMESTEP_SCALE = 1000.0  # the samplers' num_train_timesteps: the DiT sees t = 1000 sigma
#: WanPipeline's default max_sequence_length (rows past a prompt's tokens are zeros); a card's
#: ``text_encode`` loop may declare a shorter one (``max_sequence_length``), which serving uses too.
CONTEXT_LENGTH = 512


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VAEStage(_Options):
    steps: int = Field(default=1500, ge=0)
    batch: PositiveInt = 16
    #: Clip length for VAE training (1 + 4k): the causal VAE is frame-count agnostic.
    frames: PositiveInt = 9
    lr: float = Field(default=4e-4, gt=0)
    kl_weight: float = Field(default=1e-6, ge=0)
    l2_weight: float = Field(default=1.0, ge=0)
    #: Extra weight of pixels far from their frame's mean colour (the objects: a few percent of the
    #: area, which a plain mean loss lets the VAE blur away): weight = 1 + object_weight * |x - mean|.
    object_weight: float = Field(default=10.0, ge=0)
    #: Extra weight of frame 0. Wan's causal VAE encodes it alone into its own latent frame, where
    #: every later latent frame stands for 4 frames: at weight 1 it gets 1/17 of a 17-frame clip's loss.
    first_frame_weight: float = Field(default=1.0, gt=0)
    warmup: int = Field(default=50, ge=0)
    #: Decode a posterior sample (a VAE proper) or the posterior mean (what serving's encode uses).
    sample_posterior: bool = False
    #: Wall-clock budget of this stage, as the DiT stage's: the lr schedule runs on
    #: max(step / steps, elapsed / budget) and the stage stops at the budget.
    time_limit_s: float | None = Field(default=None, gt=0)


class DiTStage(_Options):
    steps: int = Field(default=4000, ge=1)
    batch: PositiveInt = 64
    lr: float = Field(default=3e-4, gt=0)
    warmup: int = Field(default=200, ge=0)
    #: Clips encoded once into the latent training set.
    clips: PositiveInt = 16384
    #: ``train``: the UMT5 encoder learns jointly with the DiT; ``frozen``: it stays as initialised.
    text_encoder: Literal["train", "frozen"] = "train"
    cfg_dropout: float = Field(default=0.1, ge=0, lt=1)
    logit_mean: float = 0.0
    logit_std: float = Field(default=1.0, gt=0)
    #: Flow shift of the training sigmas; None: the card's default shift (what its sampler uses).
    shift: float | None = Field(default=None, gt=0)
    #: EMA decay of the exported transformer and text encoder weights (0: export the raw weights). It
    #: warms up as min(ema, (1 + step) / (10 + step)), so a short stage does not export mostly its
    #: initial weights (at 0.999 from the start, 1,500 steps leave 22% of them in the average).
    ema: float = Field(default=0.999, ge=0, lt=1)
    #: Wall-clock budget of this stage: the lr schedule runs on max(step / steps, elapsed / budget) and
    #: the stage stops at the budget; the steps actually run are what the card's recipe records.
    time_limit_s: float | None = Field(default=None, gt=0)


class FlowMatchingOptions(_Options):
    #: Import string of the data class (ToyWorld's interface).
    data: str = "fv_wan.toy.world:ToyWorld"
    data_seed: int = Field(default=0, ge=0)
    #: Clip geometry; None: the card's defaults.
    frames: PositiveInt | None = None
    height: PositiveInt | None = None
    width: PositiveInt | None = None
    vae: VAEStage = VAEStage()
    dit: DiTStage = DiTStage()
    #: ``auto``: bf16 autocast on CUDA, fp32 on the CPU.
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    #: ``auto``: compile the transformer on CUDA only.
    compile: Literal["auto", "on", "off"] = "auto"
    #: Report losses every this many steps (the curves' resolution).
    log_every: PositiveInt = 10
    #: Generation defaults of the exported card (``GenerationDefaults`` fields, e.g. ``steps``); the
    #: training geometry (frames, height, width) is always written there.
    card_defaults: dict[str, float | int] = Field(default_factory=dict)


def flow_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity the model learns: ``eps - x0`` (so ``x0 = x_t - sigma v``, as fv's samplers and diffusers' flow schedulers step)."""
    return noise - x0


def sample_sigmas(n: int, stage: DiTStage, shift: float, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Logit-normal sigmas in (0, 1), then the flow shift ``s sigma / (1 + (s - 1) sigma)``."""
    u = torch.randn(n, generator=generator, device=device) * stage.logit_std + stage.logit_mean
    return shift_sigmas(torch.sigmoid(u), shift).clamp(1e-4, 1.0)


def reconstruction_weight(video: torch.Tensor, stage: VAEStage) -> torch.Tensor:
    """Per-pixel weight (B, 1, F, H, W) of the VAE's reconstruction loss for clips (B, 3, F, H, W) in [-1, 1]:
    ``1 + object_weight * |x - frame mean|`` (objects over background), frame 0 times ``first_frame_weight``."""
    weight = 1 + stage.object_weight * (video - video.mean(dim=(3, 4), keepdim=True)).abs().mean(dim=1, keepdim=True)
    weight[:, :, :1] *= stage.first_frame_weight
    return weight


def continued_recipe(start: Any, output_model_id: str, stage: RecipeSpec) -> RecipeSpec:
    """The recipe of weights trained from ``start`` by ``stage``.

    A run that continues a card of the same id with the same method (a long recipe run in stages,
    each from the last one's export) makes the same model, further trained: its parents are the
    start's, and its data contract is the start's followed by this stage's, so the exported card
    records every stage. Otherwise the start is the parent and the contract is this stage's.
    """
    earlier = start.recipe
    if start.model_id != output_model_id or earlier.method != stage.method:
        return stage
    history = f"{earlier.data_contract}; then " if earlier.data_contract else ""
    return stage.model_copy(update={"parents": earlier.parents, "data_contract": history + (stage.data_contract or "")})


def context_length_of(card: Any) -> int:
    """The prompt context the card's serving loop builds (the ``max_sequence_length`` of its ``text_encode``
    loop, else of the loop that encodes its own prompts, as a causal card's ``realtime`` loop does): training
    and evaluation must see the same zero-padded rows, which Wan's cross-attention attends to, unmasked."""
    loop = card.loops.get("text_encode")
    if loop is not None:
        return int(loop.config.get("max_sequence_length", CONTEXT_LENGTH))
    lengths = {int(spec.config["max_sequence_length"]) for spec in card.loops.values() if "max_sequence_length" in spec.config}
    if len(lengths) > 1:
        raise ValueError(f"card {card.model_id!r}: its loops encode prompts at different lengths {sorted(lengths)}")
    return lengths.pop() if lengths else CONTEXT_LENGTH


def _embed_with_grad(text_encoder: Any) -> Callable[..., torch.Tensor]:
    # WanTextEncoder.embed_ids (serving's prompt post-processing: cut each row at its length,
    # zero-pad to the context length) is no_grad; training runs the same function with grad.
    return inspect.unwrap(type(text_encoder).embed_ids)


def _budget_progress(step: int, steps: int, start: float, time_limit_s: float | None) -> float:
    """A stage's schedule position: step / steps, or the share of its wall-clock budget spent if larger."""
    progress = step / steps
    if time_limit_s is not None:
        progress = max(progress, (time.perf_counter() - start) / time_limit_s)
    return progress


class _EMA:
    def __init__(self, modules: list[torch.nn.Module], decay: float) -> None:
        self.decay = decay
        self.updates = 0
        self.shadow = [copy.deepcopy(m).requires_grad_(False) for m in modules]

    @torch.no_grad()
    def update(self, modules: list[torch.nn.Module]) -> None:
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for shadow, module in zip(self.shadow, modules):
            for s, p in zip(shadow.parameters(), module.parameters()):
                s.lerp_(p.detach(), 1 - decay)


class FlowMatching(RLMethod):
    """Rectified-flow training of a Wan-architecture card's VAE, then DiT (+ text encoder)."""

    name: ClassVar[str] = "flow-matching"
    # Supervised pre-training, not an RL update: the exported card's C1 parity against diffusers is what serving needs.
    required_parity: ClassVar[ParityLevel] = ParityLevel.C1
    options_schema: ClassVar[type[BaseModel]] = FlowMatchingOptions

    # ------------------------------------------------------------------ the objective

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        """Flow-matching MSE of one batch: ``model`` (x_t, t, context) -> v, ``x0``, ``noise``, ``sigma`` (B,), ``context``."""
        x0, noise, sigma = batch["x0"], batch["noise"], batch["sigma"]
        x_t = add_noise(x0, noise, sigma)
        prediction = batch["model"](x_t, sigma * TIMESTEP_SCALE, batch["context"])
        return F.mse_loss(prediction.float(), flow_target(x0, noise).float())

    # ------------------------------------------------------------------ training

    def train(self, run: TrainingRun) -> TrainedModel:
        o: FlowMatchingOptions = self.options  # type: ignore[assignment]
        card, device = run.card, run.device
        d = card.capabilities.defaults
        frames, height, width = o.frames or d.frames, o.height or d.height, o.width or d.width  # type: ignore[union-attr]
        self._check_geometry(card, frames, height, width, o.vae.frames)
        shift = o.dit.shift or float(d.shift or 1.0)  # type: ignore[union-attr]
        cuda = device.type == "cuda"
        autocast = torch.bfloat16 if (o.precision == "bf16" or (o.precision == "auto" and cuda)) else None
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        world_cls = import_object(o.data)
        version = getattr(sys.modules[world_cls.__module__], "GENERATOR_VERSION", "unversioned")

        vae = run.instance.component("vae").to(device)
        transformer = run.instance.component("transformer").to(device)
        text_encoder = run.instance.component("text_encoder").to(device)

        vae_world = world_cls(frames=o.vae.frames, height=height, width=width, seed=o.data_seed)
        vae_steps = self._train_vae(run, vae, vae_world, o.vae, autocast)
        vae.eval().requires_grad_(False)

        world = world_cls(frames=frames, height=height, width=width, seed=o.data_seed + 1)
        latents, prompts = self._encode_dataset(run, vae, world, o.dit.clips)
        mean = latents.mean(dim=(0, 2, 3, 4))
        std = latents.std(dim=(0, 2, 3, 4)).clamp_min(1e-4)  # a channel the VAE leaves constant must not divide by 0
        vae.config = vae.config.model_copy(update={"latents_mean": tuple(mean.tolist()), "latents_std": tuple(std.tolist())})
        latents = vae.normalize_latents(latents)

        modules = self._train_dit(run, transformer, text_encoder, latents, prompts, o, shift, autocast)
        transformer_out, text_out = modules
        dit_steps = self.dit_steps_run
        for m in (vae, transformer_out, text_out):
            m.eval().requires_grad_(False)
        vae_part = (f"VAE {vae_steps} steps x {o.vae.batch} clips of {o.vae.frames} frames" if vae_steps
                    else "VAE kept from the start (not trained)")
        recipe = continued_recipe(card, run.recipe.output_model_id, RecipeSpec(
            method=self.name, parents=(card.model_id,), consistency_required=ParityLevel.C1,
            data_contract=(
                f"{o.data} {version}, seed {o.data_seed} (VAE) / {o.data_seed + 1} (DiT), {frames}x{height}x{width}; "
                f"{vae_part}; DiT {dit_steps} steps x "
                f"{o.dit.batch} from {o.dit.clips} clips, shift {shift}, cfg dropout {o.dit.cfg_dropout}, "
                f"text encoder {o.dit.text_encoder}, EMA {o.dit.ema}"
            ),
        ))  # fmt: skip
        return TrainedModel(
            modules={"vae": vae.cpu(), "transformer": transformer_out.cpu(), "text_encoder": text_out.cpu()},
            recipe=recipe, steps={"vae": vae_steps, "dit": dit_steps},
            defaults={**o.card_defaults, "frames": frames, "height": height, "width": width},
        )

    @staticmethod
    def _check_geometry(card: Any, frames: int, height: int, width: int, vae_frames: int) -> None:
        rule = card.capabilities.frame_rule
        for field, value in (("options.frames", frames), ("options.vae.frames", vae_frames)):
            if rule is not None and value % rule.modulus != rule.remainder:
                raise RecipeError(field, f"{value} is not {rule.modulus}k+{rule.remainder} (card {card.model_id!r})")
        multiple = card.capabilities.spatial_multiple
        for field, value in (("options.height", height), ("options.width", width)):
            if value % multiple:
                raise RecipeError(field, f"{value} is not a multiple of {multiple} (card {card.model_id!r})")

    @staticmethod
    def _clips(world: Any, index: int, size: int, device: torch.device) -> tuple[torch.Tensor, list[str]]:
        videos, prompts = world.batch(index, size, device=device)
        return videos.permute(0, 2, 1, 3, 4).mul(2).sub(1).contiguous(), prompts  # (B, 3, F, H, W) in [-1, 1]

    def _train_vae(self, run: TrainingRun, vae: Any, world: Any, stage: VAEStage, autocast: torch.dtype | None) -> int:
        """Train the VAE; the steps it ran (fewer than ``stage.steps`` when its wall-clock budget ran out)."""
        if stage.steps == 0:
            return 0
        vae.train().requires_grad_(True)
        optimizer = torch.optim.AdamW(vae.parameters(), lr=stage.lr, weight_decay=0.0, betas=(0.9, 0.99))
        generator = torch.Generator(device=run.device).manual_seed(run.recipe.seed)
        log_every = self.options.log_every  # type: ignore[attr-defined]
        start, done = time.perf_counter(), 0
        for step in range(1, stage.steps + 1):
            progress = _budget_progress(step, stage.steps, start, stage.time_limit_s)
            if progress >= 1.0 and step < stage.steps:
                break
            video, _ = self._clips(world, step, stage.batch, run.device)
            lr = stage.lr * min(1.0, step / max(1, stage.warmup)) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
            for group in optimizer.param_groups:
                group["lr"] = lr
            with torch.autocast(run.device.type, dtype=autocast, enabled=autocast is not None):
                mean, logvar = vae.encode(video)
                z = mean
                if stage.sample_posterior:
                    z = mean + torch.randn(mean.shape, generator=generator, device=run.device) * (0.5 * logvar).exp()
                recon = vae.decode(z).float()
            weight = reconstruction_weight(video, stage)
            error = recon - video
            l1 = (error.abs() * weight).mean() / weight.mean()
            l2 = (error.pow(2) * weight).mean() / weight.mean()
            kl = 0.5 * (mean.float().pow(2) + logvar.float().exp() - 1 - logvar.float()).mean()
            loss = l1 + stage.l2_weight * l2 + stage.kl_weight * kl
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
            optimizer.step()
            done = step
            if step % log_every == 0 or step == stage.steps:
                run.report("vae", step, stage.steps, {"l1": l1.item(), "l2": l2.item(), "kl": kl.item()})
        return done

    @torch.no_grad()
    def _encode_dataset(self, run: TrainingRun, vae: Any, world: Any, clips: int) -> tuple[torch.Tensor, list[str]]:
        chunk = 256 if run.device.type == "cuda" else 8
        latents, prompts = [], []
        for index in range(math.ceil(clips / chunk)):
            size = min(chunk, clips - index * chunk)
            video, text = self._clips(world, index, size, run.device)
            latents.append(vae.encode(video)[0].float())
            prompts.extend(text)
            run.report("encode", min(clips, (index + 1) * chunk), clips, {})
        return torch.cat(latents), prompts

    def _train_dit(
        self, run: TrainingRun, transformer: Any, text_encoder: Any, latents: torch.Tensor, prompts: list[str],
        o: FlowMatchingOptions, shift: float, autocast: torch.dtype | None,
    ) -> tuple[Any, Any]:
        stage, device = o.dit, run.device
        train_text = stage.text_encoder == "train"
        context_length = context_length_of(run.card)
        tokens = text_encoder.tokenizer(prompts, padding="longest", truncation=True, max_length=context_length, return_tensors="pt")
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        empty = text_encoder.tokenizer([""], padding="max_length", max_length=ids.shape[1], return_tensors="pt")
        empty_ids, empty_mask = empty.input_ids.to(device), empty.attention_mask.to(device)
        embed = _embed_with_grad(text_encoder)

        transformer.train().requires_grad_(True)
        text_encoder.train().requires_grad_(train_text)
        params = list(transformer.parameters()) + (list(text_encoder.parameters()) if train_text else [])
        optimizer = torch.optim.AdamW(params, lr=stage.lr, weight_decay=0.01, betas=(0.9, 0.99))
        ema_modules = [transformer, text_encoder]
        ema = _EMA(ema_modules, stage.ema) if stage.ema > 0 else None
        compile_on = o.compile == "on" or (o.compile == "auto" and device.type == "cuda")
        forward = torch.compile(transformer) if compile_on else transformer
        generator = torch.Generator(device=device).manual_seed(run.recipe.seed + 1)
        n = latents.shape[0]
        start, done = time.perf_counter(), 0
        for step in range(1, stage.steps + 1):
            progress = _budget_progress(step, stage.steps, start, stage.time_limit_s)
            if progress >= 1.0 and step < stage.steps:
                break
            lr = stage.lr * min(1.0, step / max(1, stage.warmup))
            if step > stage.warmup:
                warm = stage.warmup / stage.steps
                lr *= 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warm) / max(1e-9, 1 - warm))))
            for group in optimizer.param_groups:
                group["lr"] = lr
            index = torch.randint(0, n, (stage.batch,), generator=generator, device=device)
            x0 = latents[index]
            drop = torch.rand(stage.batch, generator=generator, device=device) < stage.cfg_dropout
            batch_ids = torch.where(drop[:, None], empty_ids, ids[index])
            batch_mask = torch.where(drop[:, None], empty_mask, mask[index])
            with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                with torch.set_grad_enabled(train_text):
                    context = embed(text_encoder, batch_ids, batch_mask, context_length, dtype=torch.float32)
                loss = self.loss({
                    "model": forward, "x0": x0, "context": context,
                    "noise": torch.randn(x0.shape, generator=generator, device=device),
                    "sigma": sample_sigmas(stage.batch, stage, shift, generator, device),
                })  # fmt: skip
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            if ema is not None:
                ema.update(ema_modules)
            done = step
            if step % o.log_every == 0 or step == stage.steps:
                run.report("dit", step, stage.steps, {"flow_mse": loss.item()})
        self.dit_steps_run = done
        if ema is None:
            return transformer, text_encoder
        return ema.shadow[0], ema.shadow[1]
