"""DMD2 distillation (method ``dmd2``): a few-step student from a multi-step teacher, exported as a new card.

Three copies of the card's transformer: the frozen **teacher** (the real score: the instance
serving runs), the **student** (the generator, initialised from the teacher) and the
**fake-score critic** (initialised from the teacher, trained on the student's samples). Per step,
with the student's few-step schedule sigma_0 > ... > sigma_{N-1} (the kernel's ``DMDSampler``):

- backward simulation: from noise, the student runs k < N steps without grad (x0, then fresh
  noise to the next sigma, as the DMD loop samples), then predicts x0 at step k with grad;
- critic (every step): flow matching on the student's x0 (detached): |v_fake(x_t) - (eps - x0)|^2;
- student (every ``critic_updates``-th step): x_t = (1 - s) x0 + s eps at a random s; x0_real
  and x0_fake from the teacher (with ``teacher_guidance``) and the critic; the distribution
  matching gradient (x0_fake - x0_real) / mean|x0 - x0_real| as the target shift of
  0.5 |x0 - sg(x0 - grad)|^2.

Prompt embeddings and the latent shape come from the serving loops (one captured request per
prompt through the Engine). The result is a **new card**: the parent's card plus a
``dmd_<N>step`` loop bound to the DMD sampler with ``fixed_steps = N`` and no guidance, its
``RecipeSpec`` filled in (method ``dmd2``, parents, ``assumes_loop`` that loop, the data
contract) and its defaults N steps, guidance 1. A request for another step count or sampler is
refused with ``RecipeMismatch``.

With ``options.lora`` the student and the critic are both LoRA adapters (:mod:`fv_rl.lora`) on
the one frozen teacher: one copy of the transformer instead of three. The critic only has to
follow the student's distribution away from the teacher's, which starts equal to it, so an
adapter suffices. The new card carries the student's adapter merged in; the adapter goes beside
it as a LoRA file whose metadata says the few-step loop it assumes.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from fv_kernel.api import (
    DMDSampler,
    Engine,
    LoopSpec,
    ParityLevel,
    RecipeError,
    RecipeSpec,
    RLMethod,
    SamplerBinding,
    TrainedModel,
    TrainingRun,
    add_noise,
    merge_adapters,
    run_blocking,
)
from fv_rl.lora import LORA_FILE, AdapterSlot, LoraOptions, LoraWeights, save_lora_file, sharing_clone, target_paths
from fv_rl.online import as_input
from fv_rl.rollout import RolloutSettings, rollout_groups

__all__ = ["DMD2", "DMD2Options", "dmd_loss", "few_step_loop"]

TIMESTEP_SCALE = 1000.0


class DMD2Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts: tuple[str, ...] = ("a red circle moves left quickly on a black background",)
    #: The student's schedule (the DMD sampler's ``denoising_timesteps``): its length is the step count.
    denoising_timesteps: tuple[float, ...] = (1000.0, 757.0, 522.0)
    steps: PositiveInt = 200
    batch: PositiveInt = 2
    lr: float = Field(default=2e-5, gt=0)
    critic_lr: float = Field(default=2e-5, gt=0)
    #: Critic updates per student update (DMD2's two time-scale rule).
    critic_updates: PositiveInt = 5
    #: CFG scale of the teacher's (real) score; 1: none.
    teacher_guidance: float = Field(default=1.0, ge=1.0)
    height: PositiveInt | None = None
    width: PositiveInt | None = None
    frames: PositiveInt | None = None
    log_every: PositiveInt = 10
    #: Train the student and the critic as LoRA adapters on the frozen teacher (None: full copies).
    lora: LoraOptions | None = None

    @model_validator(mode="after")
    def _check(self) -> "DMD2Options":
        if not self.prompts:
            raise ValueError("prompts must name at least one prompt")
        DMDSampler(denoising_timesteps=self.denoising_timesteps)  # the schedule must be valid
        return self


def few_step_loop(card: Any, timesteps: tuple[float, ...]) -> LoopSpec:
    """The card's ``denoise`` loop as a ``dmd_<N>step`` loop: the DMD sampler, fixed N steps, no guidance."""
    base = card.loops["denoise"]
    shift = (base.sampler.config or {}).get("shift", 1.0) if base.sampler is not None else 1.0
    n = len(timesteps)
    return base.model_copy(update={
        "loop_id": f"dmd_{n}step", "guidance": "none",
        "sampler": SamplerBinding(name="dmd", config={"denoising_timesteps": list(timesteps), "shift": shift}, fixed_steps=n),
        "rejects_interceptors": frozenset(base.rejects_interceptors) | {"step_skip"},
    })


def dmd_loss(x0: torch.Tensor, x0_real: torch.Tensor, x0_fake: torch.Tensor) -> torch.Tensor:
    """DMD's distribution-matching loss: 0.5 |x0 - sg(x0 - (x0_fake - x0_real) / mean|x0 - x0_real|)|^2."""
    dims = tuple(range(1, x0.ndim))
    normalizer = (x0.detach() - x0_real).abs().mean(dim=dims, keepdim=True).clamp_min(1e-6)
    grad = (x0_fake - x0_real) / normalizer
    return 0.5 * F.mse_loss(x0.float(), (x0.detach() - grad).float())


class DMD2(RLMethod):
    name: ClassVar[str] = "dmd2"
    required_parity: ClassVar[ParityLevel] = ParityLevel.C1
    options_schema: ClassVar[type[BaseModel]] = DMD2Options

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        return dmd_loss(batch["x0"], batch["x0_real"], batch["x0_fake"])

    def _conditioning(self, run: TrainingRun) -> tuple[torch.Tensor, torch.Tensor | None, torch.Size]:
        """Prompt (and negative) embeddings and the latent shape, from one captured request per prompt."""
        o: DMD2Options = self.options  # type: ignore[assignment]
        settings = RolloutSettings(steps=1, guidance=o.teacher_guidance, height=o.height, width=o.width, frames=o.frames,
                                   capture="final", priority="batch")

        async def go() -> Any:
            engine = Engine()
            engine.add_instance(run.instance)
            async with engine.running():
                return await rollout_groups(engine, run.instance.model_id, o.prompts, [[0]] * len(o.prompts), settings)

        records = [g[0].record for g in run_blocking(go())]
        cond = torch.cat([as_input(r.prompt_embeds) for r in records]).float()
        neg = None
        if o.teacher_guidance > 1:
            neg = torch.cat([as_input(r.negative_embeds) for r in records]).float()  # type: ignore[arg-type]
        return cond, neg, records[0].initial_noise.shape

    def _views(self, teacher: torch.nn.Module, seed: int) -> tuple[torch.nn.Module, torch.nn.Module, Any, Any, AdapterSlot | None]:
        """(student, critic, student's trained parameters, critic's trained parameters, the student's slot)."""
        o: DMD2Options = self.options  # type: ignore[assignment]
        if o.lora is None:
            student = copy.deepcopy(teacher).train().requires_grad_(True)
            critic = copy.deepcopy(teacher).train().requires_grad_(True)
            return student, critic, student, critic, None
        paths = target_paths(teacher, o.lora.target_modules)
        init = torch.Generator().manual_seed(seed)
        views = []
        for name in ("student", "critic"):
            weights = LoraWeights(teacher, paths, o.lora.rank, o.lora.lora_alpha, init)
            view = sharing_clone(teacher).train()
            slot = AdapterSlot(view, paths)
            slot.set(weights.adapter(f"dmd2-{name}", "live"))
            views.append((view, weights, slot))
        (student, s_weights, s_slot), (critic, c_weights, _) = views
        return student, critic, s_weights, c_weights, s_slot

    def train(self, run: TrainingRun) -> TrainedModel:
        o: DMD2Options = self.options  # type: ignore[assignment]
        card = run.card
        if "denoise" not in card.loops or card.recipe.assumes_loop is not None:
            raise RecipeError("card", f"card {card.model_id!r} has no multi-step 'denoise' loop to distil from")
        cond, neg, shape = self._conditioning(run)
        teacher = run.instance.component("transformer").eval().requires_grad_(False)
        student, critic, student_params, critic_params, student_slot = self._views(teacher, run.recipe.seed)
        opt_student = torch.optim.AdamW(student_params.parameters(), lr=o.lr, weight_decay=0.0)
        opt_critic = torch.optim.AdamW(critic_params.parameters(), lr=o.critic_lr, weight_decay=0.0)
        loop = few_step_loop(card, o.denoising_timesteps)
        schedule = DMDSampler(**loop.sampler.config).init_state(len(o.denoising_timesteps))  # type: ignore[union-attr]
        sigmas = schedule.sigmas
        generator = torch.Generator().manual_seed(run.recipe.seed)
        n = len(o.denoising_timesteps)
        g_loss = float("nan")
        for step in range(1, o.steps + 1):
            rows = torch.randint(len(o.prompts), (o.batch,), generator=generator)
            ctx, neg_ctx = cond[rows], (neg[rows] if neg is not None else None)
            k = int(torch.randint(n, (1,), generator=generator))
            x = torch.randn((o.batch, *shape[1:]), generator=generator)
            with torch.no_grad():
                for i in range(k):
                    x0 = x - sigmas[i] * student(x, schedule.timesteps[i].expand(o.batch), ctx).float()
                    x = add_noise(x0, torch.randn(x.shape, generator=generator), sigmas[i + 1])
            x0_student = x - sigmas[k] * student(x, schedule.timesteps[k].expand(o.batch), ctx).float()

            # the critic learns the student's distribution (flow matching on its samples)
            s = torch.rand(o.batch, generator=generator) * 0.96 + 0.02
            eps = torch.randn(x.shape, generator=generator)
            x0_d = x0_student.detach()
            c_loss = F.mse_loss(critic(add_noise(x0_d, eps, s), s * TIMESTEP_SCALE, ctx).float(), eps - x0_d)
            opt_critic.zero_grad(set_to_none=True)
            c_loss.backward()
            torch.nn.utils.clip_grad_norm_(critic_params.parameters(), 1.0)
            opt_critic.step()

            if step % o.critic_updates == 0:
                s = torch.rand(o.batch, generator=generator) * 0.96 + 0.02
                x_t = add_noise(x0_student, torch.randn(x.shape, generator=generator), s).detach()
                sb = s.view(-1, *([1] * (x.ndim - 1)))
                with torch.no_grad():
                    v_real = teacher(x_t, s * TIMESTEP_SCALE, ctx).float()
                    if neg_ctx is not None:
                        v_uncond = teacher(x_t, s * TIMESTEP_SCALE, neg_ctx).float()
                        v_real = v_uncond + o.teacher_guidance * (v_real - v_uncond)
                    v_fake = critic(x_t, s * TIMESTEP_SCALE, ctx).float()
                loss = self.loss({"x0": x0_student, "x0_real": x_t - sb * v_real, "x0_fake": x_t - sb * v_fake})
                opt_student.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(student_params.parameters(), 1.0)
                opt_student.step()
                g_loss = float(loss.detach())
            if step % o.log_every == 0 or step == o.steps:
                run.report("dmd2", step, o.steps, {"critic": float(c_loss.detach()), **({"dmd": g_loss} if g_loss == g_loss else {})})

        adapter = None
        if student_slot is not None:
            # The card carries the student merged into the (no longer needed) teacher module; the adapter goes beside it.
            adapter = student_params.adapter("dmd2-student", f"dmd2-{run.recipe.seed}-{o.steps}", detach=True)
            student_slot.remove()
            merge_adapters(teacher, [(adapter, 1.0)])
            student = teacher
        student.eval().requires_grad_(False)
        geometry = {k: v for k, v in (("frames", o.frames), ("height", o.height), ("width", o.width)) if v is not None}
        recipe = RecipeSpec(
            method="dmd2", parents=(card.model_id,), assumes_loop=loop.loop_id, consistency_required=ParityLevel.C1,
            data_contract=(
                f"DMD2 from teacher {card.model_id!r} on {len(o.prompts)} prompts (teacher guidance {o.teacher_guidance}), "
                f"{n}-step schedule {list(o.denoising_timesteps)}, {o.steps} steps x batch {o.batch}, critic {o.critic_updates}:1, "
                f"lr {o.lr} / {o.critic_lr}, seed {run.recipe.seed}"
                + (f", LoRA rank {o.lora.rank} alpha {o.lora.lora_alpha:g} on {o.lora.target_modules}" if o.lora else "")
            ),
        )
        if adapter is not None:
            save_lora_file(adapter, run.output / LORA_FILE, {
                "method": "dmd2", "base_card": card.model_id, "model_id": run.recipe.output_model_id or "",
                "steps": {"dmd2": o.steps}, "seed": run.recipe.seed, "data_contract": recipe.data_contract,
                "assumes_loop": loop.loop_id, "assumes_steps": n,
            })
        return TrainedModel(
            modules={"transformer": student.cpu(), "text_encoder": run.instance.component("text_encoder").cpu()},
            recipe=recipe, steps={"dmd2": o.steps}, defaults={"steps": n, "guidance": 1.0, **geometry},
            loops={loop.loop_id: loop},
        )
