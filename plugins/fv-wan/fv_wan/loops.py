"""The Wan family's loops: text encode, image encode, denoise, decode.

Each step is one WorkPlan; the runtime decides when and with whom it runs. The
denoise loop uses the kernel's samplers and guidance policies as a library; the
step body fixes the numeric space (velocity, as the reference computes it) and
the policy fixes the algebra. Everything per request lives in the typed states
below: nothing is kept on the loop objects or the modules.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import ValidationError

from fv_kernel.api import (
    BehaviorRecord,
    BehaviorSlice,
    CacheKey,
    content_hash,
    CachePlan,
    CacheRef,
    Done,
    EmitSpec,
    Loop,
    LoopContext,
    LoopResult,
    LoopState,
    ModelCard,
    ModelInstance,
    Provenance,
    Request,
    ResourceRequest,
    Sampler,
    SamplerState,
    ShapeSignature,
    StepEstimate,
    StepResult,
    VideoArtifact,
    WorkKind,
    WorkPlan,
    builtin_guidance_policies,
    bound_sampler,
    capture_slice,
    deterministic_flags,
    sampler_from_state,
    generator_from_state,
)
from fv_wan import footprint
from fv_wan.models.encoders import clean_prompt
from fv_wan.models.transformer import TEXT_CONTEXT_LENGTH, WanTransformerConfig
from fv_wan.models.vae import HaloTiling, TilingConfig, WanVAEConfig, halo_reach

__all__ = [
    "text_context_length",
    "WanTextEncodeState",
    "WanTextEncodeLoop",
    "WanImageEncodeState",
    "WanImageEncodeLoop",
    "WanDenoiseState",
    "WanDenoiseLoop",
    "WanDecodeState",
    "WanDecodeLoop",
]


def _vae_config(model: ModelInstance) -> WanVAEConfig:
    return WanVAEConfig.from_diffusers_config(model.card.components["vae_decoder"].config)


def _transformer_config(model: ModelInstance) -> WanTransformerConfig:
    return WanTransformerConfig.from_diffusers_config(model.card.components["transformer"].config)


def _denoise_spec(model: ModelInstance, request: Request) -> Any:
    from fv_kernel.api import select_denoise_loop

    return model.card.loops[select_denoise_loop(model.card, request) or "denoise"]


def _uses_cfg(model: ModelInstance, request: Request) -> bool:
    spec = _denoise_spec(model, request)
    policy = builtin_guidance_policies()[spec.guidance or "cfg"]()
    scales = [request.diffusion.guidance or 0.0]
    if request.diffusion.guidance_2 is not None:
        scales.append(request.diffusion.guidance_2)
    return any(len(policy.branches(s)) > 1 for s in scales)


def _component_precision(model: ModelInstance, component_id: str) -> str:
    """The precision a component computes in: its precision policy, else the instance's precision."""
    policy = model.card.components[component_id].precision_policy.dtype
    return model.precision if policy == "card" else str(policy)


def _element_bytes(model: ModelInstance, component_id: str) -> int:
    return footprint.element_bytes(_component_precision(model, component_id))


def _clip_tokens(model: ModelInstance) -> tuple[int, int]:
    """(image size, tokens) of the CLIP image encoder: the tiny card's config, else ViT-H/14 at 224 px."""
    tiny = model.card.components["image_encoder"].config.get("tiny")
    size, patch = (int(tiny.get("image_size", 32)), int(tiny.get("patch_size", 8))) if tiny is not None else (224, 14)
    return size, (size // patch) ** 2 + 1


def _context_tokens(model: ModelInstance, text_tokens: int) -> int:
    """Tokens the DiT cross-attends to: the text, plus the CLIP image tokens of image-conditioned models."""
    if _transformer_config(model).image_dim is None or "image_encoder" not in model.card.components:
        return text_tokens
    return text_tokens + _clip_tokens(model)[1]


# --------------------------------------------------------------------------- text encode


class WanTextEncodeState(LoopState):
    texts: list[str]
    cache_keys: list[str]
    embeds: list[torch.Tensor | None]
    pending_rows: list[int]
    ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    max_len: int = TEXT_CONTEXT_LENGTH
    #: The pending rows' text-encoder adapters (``ModelInstance.adapter_inputs``); empty when adapters are off.
    adapter_inputs: dict[str, torch.Tensor] = {}


def text_context_length(card: ModelCard) -> int:
    """Prompt rows the card's ``text_encode`` loop pads to (its ``max_sequence_length``; Wan's 512 by default)."""
    loop = card.loops.get("text_encode")
    return int(loop.config.get("max_sequence_length", TEXT_CONTEXT_LENGTH)) if loop is not None else TEXT_CONTEXT_LENGTH


class WanTextEncodeLoop(Loop[WanTextEncodeState]):
    """UMT5 over the prompt (and the negative prompt when CFG runs), through the feature cache.

    The cache key holds the encoder's weights version, its adapters (name, version, strength),
    the precision and the cleaned text, so the same prompt on the same weights runs the encoder
    once, and a text-encoder LoRA never gets another stack's embeddings.
    """

    kind = "text_encode"
    state_type = WanTextEncodeState

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> WanTextEncodeState:
        prompt = ctx.upstream.get("upsampled_prompt") or request.text("prompt") or ""
        texts = [clean_prompt(prompt)]
        if _uses_cfg(model, request):
            texts.append(clean_prompt(request.text("negative_prompt") or ""))
        max_len = int(self.spec.config.get("max_sequence_length", TEXT_CONTEXT_LENGTH))
        # The precision the encoder really runs in ("card" resolves to the instance's), so two
        # instances at different precisions sharing one cache never share an entry.
        precision = _component_precision(model, "text_encoder")
        adapter_versions = model.adapter_versions(request, "text_encoder")
        keys = [
            CacheKey(
                model_id=model.model_id, component_id="text_encoder", weights_version=model.weights_version,
                adapter_versions=adapter_versions, precision=precision, input_hash=content_hash([text, max_len]),
            ).digest()
            for text in texts
        ]
        cache = ctx.services.get("feature_cache")
        embeds: list[torch.Tensor | None] = []
        for key in keys:
            hit = cache.get(key) if cache is not None else None
            embeds.append(hit["embeds"] if hit is not None else None)
        pending = [i for i, e in enumerate(embeds) if e is None]
        ids = mask = None
        adapter_inputs: dict[str, torch.Tensor] = {}
        if pending:
            tokenizer = model.component("text_encoder").tokenizer
            tokens = tokenizer(
                [texts[i] for i in pending], padding="max_length", max_length=max_len, truncation=True,
                add_special_tokens=True, return_attention_mask=True, return_tensors="pt",
            )
            ids, mask = tokens.input_ids, tokens.attention_mask
            adapter_inputs = model.adapter_inputs(request, "text_encoder", rows=len(pending))
        return WanTextEncodeState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id,
            texts=texts, cache_keys=keys, embeds=embeds, pending_rows=pending, ids=ids, mask=mask, max_len=max_len,
            adapter_inputs=adapter_inputs,
        )

    def next(self, state: WanTextEncodeState) -> WorkPlan | Done:
        if not state.pending_rows:
            return Done()
        assert state.ids is not None and state.mask is not None
        writes = tuple(
            CacheRef(cache="feature_cache", key=state.cache_keys[row], output="embeds", index=j)
            for j, row in enumerate(state.pending_rows)
        )
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.ENCODER_CHUNK, op="encode_text",
            inputs={"ids": state.ids, "mask": state.mask, **state.adapter_inputs}, params={"max_len": state.max_len},
            shape_sig=ShapeSignature.of(tokens=state.max_len), cache=CachePlan(writes=writes),
        )

    def advance(self, state: WanTextEncodeState, result: StepResult) -> WanTextEncodeState:
        embeds = list(state.embeds)
        for j, row in enumerate(state.pending_rows):
            embeds[row] = result.outputs["embeds"][j : j + 1]
        return state.model_copy(
            update={"embeds": embeds, "pending_rows": [], "ids": None, "mask": None, "adapter_inputs": {}, "step": state.step + 1}
        )

    def finalize(self, state: WanTextEncodeState) -> LoopResult:
        outputs: dict[str, Any] = {"prompt_embeds": state.embeds[0]}
        if len(state.embeds) > 1:
            outputs["negative_embeds"] = state.embeds[1]
        return LoopResult(loop_id=self.loop_id, outputs=outputs)

    def progress(self, state: WanTextEncodeState) -> tuple[int, int | None]:
        return (1, 1) if not state.pending_rows else (0, 1)

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        """One encoder step over every row (feature-cache hits are not known before it runs: refunded unused)."""
        max_len = int(self.spec.config.get("max_sequence_length", TEXT_CONTEXT_LENGTH))
        rows = 2 if _uses_cfg(model, request) else 1
        width = _transformer_config(model).text_dim  # the encoder's d_model: the DiT's text input width
        return ResourceRequest(
            steps=(StepEstimate(loop_id=self.loop_id, kind=WorkKind.ENCODER_CHUNK, shape_sig=ShapeSignature.of(tokens=max_len)),),
            resident_bytes=rows * max_len * width * 4,  # fp32 embeddings, kept until the denoise loop ends
            peak_bytes=footprint.text_encoder_peak_bytes(width, max_len, rows),
        )


# --------------------------------------------------------------------------- image encode


def _prepare_image(request: Request, height: int, width: int) -> torch.Tensor:
    """The conditioning image at the output size, in [-1, 1], shaped (1, 3, H, W)."""
    part = request.part("image")
    image = part.image.float().unsqueeze(0)
    if image.shape[-2:] != (height, width):
        image = F.interpolate(image, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    return image.clamp(0, 1) * 2 - 1


class WanImageEncodeState(LoopState):
    mode: str
    pixel_values: torch.Tensor | None
    video: torch.Tensor
    image_embeds: torch.Tensor | None = None
    latent: torch.Tensor | None = None
    num_frames: int
    clip_done: bool = False


class WanImageEncodeLoop(Loop[WanImageEncodeState]):
    """Image conditioning: CLIP image tokens (Wan 2.1 I2V) and the VAE-encoded condition latent.

    ``i2v_mode="concat"`` (Wan 2.1): the condition is the first frame followed by zeros,
    encoded, plus a 4-channel frame mask, concatenated to the noisy latents.
    ``i2v_mode="first_frame"`` (Wan 2.2 TI2V): the first latent frame is the clean image
    latent and its tokens get timestep 0.
    """

    kind = "image_encode"
    state_type = WanImageEncodeState

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> WanImageEncodeState:
        d = request.diffusion
        assert d.height and d.width and d.frames
        mode = str(self.spec.config.get("i2v_mode", "concat"))
        image = _prepare_image(request, d.height, d.width)
        if mode == "concat":
            zeros = image.new_zeros(1, 3, d.frames - 1, d.height, d.width)
            video = torch.cat([image.unsqueeze(2), zeros], dim=2)
        else:
            video = image.unsqueeze(2)
        pixel_values = None
        if "image_encoder" in model.card.components:
            raw = request.part("image").image.float()
            pixel_values = model.component("image_encoder").pixel_values(raw)
        return WanImageEncodeState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id, mode=mode,
            pixel_values=pixel_values, video=video, num_frames=d.frames, clip_done=pixel_values is None,
        )

    def next(self, state: WanImageEncodeState) -> WorkPlan | Done:
        if not state.clip_done:
            assert state.pixel_values is not None
            return WorkPlan(
                loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.ENCODER_CHUNK, op="encode_image",
                inputs={"pixel_values": state.pixel_values}, shape_sig=ShapeSignature.of(pixels=int(state.pixel_values[0].numel())),
            )
        if state.latent is None:
            return WorkPlan(
                loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.ENCODER_CHUNK, op="vae_encode",
                inputs={"video": state.video}, shape_sig=ShapeSignature.of(video=str(tuple(state.video.shape))), batchable=False,
            )
        return Done()

    def advance(self, state: WanImageEncodeState, result: StepResult) -> WanImageEncodeState:
        if not state.clip_done:
            return state.model_copy(update={"image_embeds": result.outputs["image_embeds"], "clip_done": True, "step": state.step + 1})
        return state.model_copy(update={"latent": result.outputs["latent"], "step": state.step + 1})

    def finalize(self, state: WanImageEncodeState) -> LoopResult:
        latent = state.latent
        assert latent is not None
        outputs: dict[str, Any] = {"image_embeds": state.image_embeds}
        if state.mode == "concat":
            # diffusers' mask: 1 for the given first frame (repeated over the 4-frame group), 0 after.
            _, _, t, h, w = latent.shape
            frames = state.num_frames
            mask = torch.ones(1, 1, frames, h, w)
            mask[:, :, 1:] = 0
            first = mask[:, :, 0:1].repeat_interleave(4, dim=2)
            mask = torch.cat([first, mask[:, :, 1:]], dim=2).view(1, -1, 4, h, w).transpose(1, 2)
            outputs["condition"] = torch.cat([mask, latent], dim=1)
        else:
            outputs["condition"] = latent
        return LoopResult(loop_id=self.loop_id, outputs=outputs)

    def progress(self, state: WanImageEncodeState) -> tuple[int, int | None]:
        return state.step, 2 if state.pixel_values is not None else 1

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        d = request.diffusion
        assert d.height and d.width and d.frames
        frames = d.frames if str(self.spec.config.get("i2v_mode", "concat")) == "concat" else 1
        steps, peaks = [], []
        if "image_encoder" in model.card.components:
            size, tokens = _clip_tokens(model)
            steps.append(StepEstimate(loop_id=self.loop_id, kind=WorkKind.ENCODER_CHUNK,
                                      shape_sig=ShapeSignature.of(pixels=3 * size * size)))
            peaks.append(footprint.image_encoder_peak_bytes(_transformer_config(model).image_dim or 1280, tokens))
        steps.append(StepEstimate(loop_id=self.loop_id, kind=WorkKind.ENCODER_CHUNK,
                                  shape_sig=ShapeSignature.of(video=str((1, 3, frames, d.height, d.width)))))
        vae = _vae_config(model)
        element = _element_bytes(model, "vae_encoder")
        video_bytes = 3 * frames * d.height * d.width * element  # the pixels, moved to the device
        peaks.append(video_bytes + footprint.vae_encode_peak_bytes(vae, d.height, d.width, frames=frames, element=element))
        latent = (vae.z_dim + 4) * ((frames - 1) // vae.temporal_compression + 1) * (d.height // vae.spatial_compression) * (
            d.width // vae.spatial_compression)
        return ResourceRequest(steps=tuple(steps), resident_bytes=4 * latent, peak_bytes=max(peaks))


# --------------------------------------------------------------------------- denoise


class WanDenoiseState(LoopState):
    latents: torch.Tensor
    sampler_state: SamplerState
    rng_state: torch.Tensor
    prompt_embeds: torch.Tensor
    negative_embeds: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    condition: torch.Tensor | None = None
    first_frame_mask: torch.Tensor | None = None
    guidance: float
    guidance_2: float | None = None
    boundary_timestep: float | None = None
    #: The request's ``switch_step``: the first step of the second expert (it overrides the boundary).
    switch_step: int | None = None
    expand_timesteps: bool = False
    total_steps: int
    precision: str
    #: Transient bytes of one forward of one row (the plan's reserved peak, times its rows).
    row_peak_bytes: int = 0
    #: Behaviour capture (``OutputSpec.capture_behavior``): the slices so far, and what the record needs.
    capture: str = "off"
    behavior: list[BehaviorSlice] = []
    initial_noise: torch.Tensor | None = None
    seed: int = 0
    prompt: str = ""
    model_id: str = ""
    weights_version: str = ""
    attention_backend: str = ""
    #: Per expert, the request's adapters as one step-input row (``ModelInstance.adapter_inputs``),
    #: repeated for every guidance branch; empty when adapters are off.
    adapter_inputs: dict[str, dict[str, torch.Tensor]] = {}


class WanDenoiseLoop(Loop[WanDenoiseState]):
    """Flow-matching denoise: one WorkPlan per step, CFG branches batched in it.

    Loop config: ``boundary_ratio`` (two experts: ``transformer`` while t >= ratio*1000,
    then ``transformer_2``, one sampler state across the switch, ``guidance_2`` for the
    second; a request's ``switch_step`` puts the switch at that step instead; the sampler
    state's ``stage_starts`` names the switch step), ``expand_timesteps`` (per-token timesteps, Wan 2.2), ``i2v_mode``,
    ``cfg_dispatch`` ("sequential", the default: one forward per branch as diffusers runs them, so block
    hooks and plain runs use the same kernels; or "batched": the branches as one batch).
    """

    kind = "diffusion_denoise"
    state_type = WanDenoiseState
    captures_behavior = True

    def _sampler(self, shift: float | None, requested: str | None = None) -> Sampler:
        binding = self.spec.sampler
        assert binding is not None, f"loop {self.loop_id!r} has no sampler binding"
        # Resolved through the deployment's registry: a request may name a plugin's sampler.
        return bound_sampler(binding, requested=requested, shift=shift)

    def _policy(self) -> Any:
        return builtin_guidance_policies()[self.spec.guidance or "cfg"]()

    def _latent_shape(self, request: Request, model: ModelInstance) -> tuple[int, ...]:
        d = request.diffusion
        assert d.height and d.width and d.frames
        vae = _vae_config(model)
        s, t = vae.spatial_compression, vae.temporal_compression
        return (1, vae.z_dim, (d.frames - 1) // t + 1, d.height // s, d.width // s)

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> WanDenoiseState:
        d = request.diffusion
        shape = self._latent_shape(request, model)
        # diffusers draws the initial noise as float32 randn of the latent shape from a CPU
        # generator seeded with the user's seed; fv does the same, so seeds are portable.
        generator = torch.Generator(device="cpu").manual_seed(d.seed)
        latents = torch.randn(shape, generator=generator, dtype=torch.float32)
        sampler = self._sampler(d.shift, d.sampler)
        binding = self.spec.sampler
        steps = binding.fixed_steps if binding is not None and binding.fixed_steps else (d.steps or 1)
        config = self.spec.config
        boundary = config.get("boundary_ratio")
        sampler_state = sampler.init_state(steps)
        switch = _switch_step(sampler_state.timesteps, boundary, d.switch_step)
        if switch is not None:
            sampler_state = sampler_state.model_copy(update={"stage_starts": (switch,)})
        up = ctx.upstream
        condition = up.get("condition")
        expand = bool(config.get("expand_timesteps", False))
        first_frame_mask = None
        if expand and condition is not None:
            first_frame_mask = torch.ones(1, 1, *shape[2:])
            first_frame_mask[:, :, 0] = 0
        return WanDenoiseState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id,
            latents=latents, sampler_state=sampler_state, rng_state=generator.get_state(),
            prompt_embeds=up["prompt_embeds"], negative_embeds=up.get("negative_embeds"),
            image_embeds=up.get("image_embeds"), condition=condition, first_frame_mask=first_frame_mask,
            guidance=float(d.guidance if d.guidance is not None else 1.0), guidance_2=d.guidance_2,
            boundary_timestep=None if boundary is None else float(boundary) * 1000.0, switch_step=d.switch_step,
            expand_timesteps=expand,
            total_steps=steps, precision=model.precision, row_peak_bytes=self._row_peak_bytes(request, model),
            adapter_inputs={
                expert: model.adapter_inputs(request, expert)
                for expert in ("transformer", "transformer_2") if expert in model.card.components
            },
            **self._capture_fields(request, model, ctx, latents),
        )

    @staticmethod
    def _capture_fields(request: Request, model: ModelInstance, ctx: LoopContext, latents: torch.Tensor) -> dict[str, Any]:
        capture = request.output.capture_behavior
        if capture == "off":
            return {}
        return {
            "capture": capture, "initial_noise": latents.clone(), "seed": request.diffusion.seed,
            "prompt": ctx.upstream.get("upsampled_prompt") or request.text("prompt") or "",
            "model_id": model.model_id, "weights_version": model.weights_version,
            "attention_backend": str(model.options.attention_backend),
        }

    def _expert(self, state: WanDenoiseState, t: torch.Tensor) -> tuple[str, float]:
        if state.switch_step is not None:
            return _expert_by_step(state.sampler_state.step_index, state.switch_step, state.guidance, state.guidance_2)
        return _expert_at(float(t), state.boundary_timestep, state.guidance, state.guidance_2)

    def _rows(self, branches: int) -> int:
        """Rows one forward runs at once: "sequential" dispatch runs the branches one by one."""
        return 1 if self.spec.config.get("cfg_dispatch", "sequential") == "sequential" else branches

    def _row_peak_bytes(self, request: Request, model: ModelInstance) -> int:
        shape = self._latent_shape(request, model)
        config = _transformer_config(model)
        tokens = shape[2] * (shape[3] // config.patch_size[1]) * (shape[4] // config.patch_size[2])
        text = text_context_length(model.card)
        positions = shape[2] * shape[3] * shape[4]
        # the model input in the compute dtype, and the velocity returned in fp32
        io = positions * (config.in_channels * footprint.element_bytes(model.precision) + config.out_channels * 4)
        return io + footprint.dit_step_peak_bytes(
            config, tokens, precision=model.precision, context_tokens=_context_tokens(model, text),
            per_token_timesteps=bool(self.spec.config.get("expand_timesteps", False)),
        )

    def _model_input(self, state: WanDenoiseState) -> torch.Tensor:
        if state.condition is None:
            return state.latents
        if state.expand_timesteps:
            assert state.first_frame_mask is not None
            return (1 - state.first_frame_mask) * state.condition + state.first_frame_mask * state.latents
        return torch.cat([state.latents, state.condition], dim=1)

    def next(self, state: WanDenoiseState) -> WorkPlan | Done:
        sampler = sampler_from_state(state.sampler_state)
        if sampler.is_done(state.sampler_state):
            return Done()
        t = sampler.timestep(state.sampler_state)
        expert, scale = self._expert(state, t)
        branches = self._policy().branches(scale)
        x = self._model_input(state)
        if state.expand_timesteps:
            mask = state.first_frame_mask if state.first_frame_mask is not None else torch.ones(1, 1, *state.latents.shape[2:])
            timestep = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0)
        else:
            timestep = t.reshape(1)
        n = len(branches)
        contexts = []
        for branch in branches:
            embeds = state.prompt_embeds if branch == "cond" else state.negative_embeds
            assert embeds is not None, "CFG needs negative prompt embeddings from the text encode loop"
            contexts.append(embeds)
        inputs = {
            "x": x.expand(n, *x.shape[1:]),
            "t": timestep.expand(n, *timestep.shape[1:]),
            "context": torch.cat(contexts),
        }
        if state.image_embeds is not None:
            inputs["image_embeds"] = state.image_embeds.expand(n, *state.image_embeds.shape[1:])
        # the expert this step runs, with this request's adapters for it, on every branch row (cond and uncond alike)
        inputs.update({k: v.expand(n, *v.shape[1:]) for k, v in state.adapter_inputs.get(expert, {}).items()})
        tokens = int(x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2))
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.DIFFUSION_STEP, op=f"dit_forward:{expert}",
            inputs=inputs, params={"dispatch": self.spec.config.get("cfg_dispatch", "sequential"), "branches": n},
            shape_sig=ShapeSignature.of(tokens=tokens, branches=n, expert=expert, per_token_t=int(state.expand_timesteps)),
            precision=state.precision, tag="+".join(branches),
            resources=ResourceRequest(peak_bytes=self._rows(n) * state.row_peak_bytes),
        )

    def advance(self, state: WanDenoiseState, result: StepResult) -> WanDenoiseState:
        sampler = sampler_from_state(state.sampler_state)
        t = sampler.timestep(state.sampler_state)
        _, scale = self._expert(state, t)
        policy = self._policy()
        branches = policy.branches(scale)
        velocity = policy.combine(dict(zip(branches, result.outputs["v"].split(1))), scale, step_index=state.step)
        noise = None
        rng_state = state.rng_state
        if sampler.needs_noise(state.sampler_state):
            generator = generator_from_state(state.rng_state)
            noise = torch.randn(state.latents.shape, generator=generator, dtype=torch.float32)
            rng_state = generator.get_state()
        sampler_state, latents = sampler.step(state.sampler_state, velocity.to(state.latents.device), state.latents, noise=noise)
        update: dict[str, Any] = {"latents": latents, "sampler_state": sampler_state, "rng_state": rng_state, "step": state.step + 1}
        if state.capture != "off":
            captured = capture_slice(
                state.capture, sampler=sampler, state=state.sampler_state, sample=state.latents,  # type: ignore[arg-type]
                velocity=velocity.to(state.latents.device), next_sample=latents, noise=noise, expert=self._expert(state, t)[0],
                guidance=scale, branches=tuple(branches), batch_size=result.batch_size,
            )
            update["behavior"] = [*state.behavior, captured]
        return state.model_copy(update=update)

    def behavior_slice(self, state: WanDenoiseState) -> BehaviorSlice | None:
        return state.behavior[-1] if state.capture != "off" and state.behavior else None

    def finalize(self, state: WanDenoiseState) -> LoopResult:
        latents = state.latents
        if state.expand_timesteps and state.condition is not None and state.first_frame_mask is not None:
            latents = (1 - state.first_frame_mask) * state.condition + state.first_frame_mask * latents
        artifacts: list[Any] = []
        if state.capture != "off":
            assert state.initial_noise is not None
            artifacts.append(BehaviorRecord(
                capture=state.capture, seed=state.seed, sampler=state.sampler_state.sampler,  # type: ignore[arg-type]
                sigmas=state.sampler_state.sigmas, timesteps=state.sampler_state.timesteps,
                initial_noise=state.initial_noise, final_latents=latents, prompt=state.prompt,
                prompt_embeds=state.prompt_embeds, negative_embeds=state.negative_embeds,
                guidance=state.guidance, guidance_policy=self.spec.guidance or "cfg", precision=state.precision,
                attention_backend=state.attention_backend, weights_version=state.weights_version,
                deterministic=deterministic_flags(state.behavior), steps=list(state.behavior),
                provenance=Provenance(
                    model_id=state.model_id, loop_id=self.loop_id, request_id=state.request_id, node=state.instance_id,
                    seed=state.seed, weights_version=state.weights_version,
                ),
            ))
        return LoopResult(loop_id=self.loop_id, outputs={"latents": latents}, artifacts=artifacts)

    def progress(self, state: WanDenoiseState) -> tuple[int, int | None]:
        return state.step, state.total_steps

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        """Every step as next() will plan it (expert and branch count per timestep), and one forward's peak."""
        d = request.diffusion
        shape = self._latent_shape(request, model)
        tokens = shape[2] * (shape[3] // 2) * (shape[4] // 2)  # as next() signs its plans
        binding = self.spec.sampler
        steps = binding.fixed_steps if binding is not None and binding.fixed_steps else (d.steps or 1)
        boundary = self.spec.config.get("boundary_ratio")
        guidance = float(d.guidance if d.guidance is not None else 1.0)
        per_token = int(bool(self.spec.config.get("expand_timesteps", False)))
        counts: dict[tuple[str, int], int] = {}
        for index, t in enumerate(self._sampler(d.shift, d.sampler).init_state(steps).timesteps.tolist()):
            if d.switch_step is not None:
                expert, scale = _expert_by_step(index, d.switch_step, guidance, d.guidance_2)
            else:
                expert, scale = _expert_at(float(t), None if boundary is None else float(boundary) * 1000.0, guidance, d.guidance_2)
            key = (expert, len(self._policy().branches(scale)))
            counts[key] = counts.get(key, 0) + 1
        latent_bytes = 4 * int(torch.Size(shape).numel())
        row_peak = self._row_peak_bytes(request, model)
        return ResourceRequest(
            steps=tuple(
                StepEstimate(loop_id=self.loop_id, kind=WorkKind.DIFFUSION_STEP, precision=model.precision, count=count,
                             shape_sig=ShapeSignature.of(tokens=tokens, branches=n, expert=expert, per_token_t=per_token))
                for (expert, n), count in counts.items()
            ),
            # latents, the sampler's history (UniPC: two model outputs and the last sample), the update
            resident_bytes=latent_bytes * 5,
            peak_bytes=max(self._rows(n) for _, n in counts) * row_peak,
        )


def _expert_at(t: float, boundary_timestep: float | None, guidance: float, guidance_2: float | None) -> tuple[str, float]:
    """The expert and guidance scale at timestep ``t``: ``transformer`` until the boundary, then ``transformer_2``."""
    if boundary_timestep is None or t >= boundary_timestep:
        return "transformer", guidance
    return "transformer_2", guidance_2 if guidance_2 is not None else guidance


def _expert_by_step(index: int, switch_step: int, guidance: float, guidance_2: float | None) -> tuple[str, float]:
    """The expert and guidance scale of step ``index`` when the request names the switch step."""
    if index < switch_step:
        return "transformer", guidance
    return "transformer_2", guidance_2 if guidance_2 is not None else guidance


def _switch_step(timesteps: torch.Tensor, boundary_ratio: Any, switch_step: int | None) -> int | None:
    """The first step of the second expert: the request's, else the first timestep below the boundary."""
    if switch_step is not None:
        return switch_step
    if boundary_ratio is None:
        return None
    below = [i for i, t in enumerate(timesteps.tolist()) if float(t) < float(boundary_ratio) * 1000.0]
    return below[0] if below else int(timesteps.shape[0])


# --------------------------------------------------------------------------- decode


class WanDecodeState(LoopState):
    model_id: str
    weights_version: str
    #: The instance's ``recipe_overrides``, stamped on the video's provenance.
    recipe_overrides: tuple[str, ...] = ()
    seed: int
    latents: torch.Tensor
    frames: list[torch.Tensor] = []
    cache: dict[str, torch.Tensor] = {}
    fps: float
    tiling: dict[str, int] | None = None
    #: Loop config ``halo``: exact tiles, decoded one after another through all frames.
    halo: HaloTiling | None = None
    #: Halo mode: the decoder's whole-frame part for every latent frame (until the last tile is decoded).
    lower: torch.Tensor | None = None
    #: Halo mode: each decoded tile's video (C, F, H_tile, W_tile), in tile order.
    strips: list[torch.Tensor] = []
    #: Video pixels per latent pixel (where halo mode places each strip).
    spatial_scale: int = 8


class WanDecodeLoop(Loop[WanDecodeState]):
    """Causal VAE decode, one latent frame per WorkPlan, each streamed as a preview chunk.

    The causal conv history lives in the state (``cache``), so two requests decoding at
    once never share it and a half-decoded video resumes exactly. Loop config
    ``tiling`` (tile sizes/strides in pixels) turns on spatial tiling for large frames.
    Loop config ``halo`` (``{"rows": R, "columns": C}``, optionally ``"align"``) decodes in exact halo tiles instead
    (``WanVAE.decode(halo=...)``): one step for the decoder's whole-frame part, then one step
    per tile through all frames, so only one tile's history is alive. The video comes whole
    at the end: halo mode streams no preview chunks and keeps no partial video.
    """

    kind = "vae_decode"
    state_type = WanDecodeState

    def _halo(self) -> HaloTiling | None:
        """Loop config ``halo``, validated; it excludes ``tiling``."""
        config = self.spec.config.get("halo")
        if config is None:
            return None
        if self.spec.config.get("tiling"):
            raise ValueError(f"loop {self.loop_id!r}: config 'tiling' (blended tiles) and 'halo' (exact tiles) "
                             "exclude each other; set one")
        if not isinstance(config, dict):
            raise ValueError(f"loop {self.loop_id!r}: config 'halo' must be a mapping {{rows, columns}}, got {config!r}")
        try:
            return HaloTiling(**config)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
            raise ValueError(f"loop {self.loop_id!r}: config 'halo' is invalid ({problems}); "
                             "allowed keys: rows, columns (integers >= 1), align (1 to 256)") from None

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> WanDecodeState:
        tiling = self.spec.config.get("tiling")
        halo = self._halo()
        latents = ctx.upstream["latents"]
        if halo is not None:
            halo.owned(latents.shape[-2], latents.shape[-1])  # a grid finer than the latents is refused here
        return WanDecodeState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id,
            model_id=model.model_id, weights_version=model.weights_version, seed=request.diffusion.seed,
            recipe_overrides=model.recipe_overrides, latents=latents, fps=float(request.diffusion.fps or 16.0), tiling=tiling,
            halo=halo, spatial_scale=_vae_config(model).spatial_compression,
        )

    def _next_halo(self, state: WanDecodeState, halo: HaloTiling) -> WorkPlan | Done:
        index = len(state.strips)
        if index >= halo.count:
            return Done()
        signature = str(tuple(state.latents.shape[-2:]))
        if state.lower is None:
            return WorkPlan(
                loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.VAE_TILE, op="vae_decode_lower",
                inputs={"z": state.latents}, shape_sig=ShapeSignature.of(latent=signature, halo="lower"), batchable=False,
            )
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.VAE_TILE, op="vae_decode_halo_tile",
            inputs={"lower": state.lower}, params={"halo": halo, "tile": index},
            shape_sig=ShapeSignature.of(latent=signature, halo=f"{halo.rows}x{halo.columns}"), batchable=False,
        )

    def next(self, state: WanDecodeState) -> WorkPlan | Done:
        if state.halo is not None:
            return self._next_halo(state, state.halo)
        index = len(state.frames)
        if index >= state.latents.shape[2]:
            return Done()
        inputs = {"z": state.latents[:, :, index : index + 1]}
        inputs.update({f"cache.{k}": v for k, v in state.cache.items()})
        done_frames = sum(int(f.shape[0]) for f in state.frames)
        new_frames = 1 if index == 0 else 4
        pts = (done_frames / state.fps, (done_frames + new_frames) / state.fps)
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.VAE_TILE, op="vae_decode_frame",
            inputs=inputs,
            params={"tiling": TilingConfig(**state.tiling) if state.tiling else None,
                    "last": index == state.latents.shape[2] - 1},
            shape_sig=ShapeSignature.of(latent=str(tuple(state.latents.shape[-2:])), first=int(index == 0)),
            # A one-frame decode (images) carries no causal history in or out, so requests can
            # share one batched call; a video's frame-by-frame decode stays batch-of-1.
            batchable=state.latents.shape[2] == 1,
            emits=[EmitSpec(stream="video", modality="video", preview=True, from_output="frames", pts=pts)],
        )

    def advance(self, state: WanDecodeState, result: StepResult) -> WanDecodeState:
        if state.halo is not None:
            if "lower" in result.outputs:
                return state.model_copy(update={"lower": result.outputs["lower"], "step": state.step + 1})
            strips = [*state.strips, result.outputs["frames"][0]]
            done = len(strips) == state.halo.count
            # The whole-frame activations go with the last tile: nothing reads them after it.
            return state.model_copy(update={"strips": strips, "lower": None if done else state.lower, "step": state.step + 1})
        frames = result.outputs["frames"][0].transpose(0, 1)  # (k, 3, H, W)
        cache = {k[len("cache."):]: v for k, v in result.outputs.items() if k.startswith("cache.")}
        return state.model_copy(update={"frames": [*state.frames, frames], "cache": cache, "step": state.step + 1})

    def finalize(self, state: WanDecodeState) -> LoopResult:
        return LoopResult(loop_id=self.loop_id, artifacts=[self._artifact(state, partial=False)])

    def partial(self, state: WanDecodeState) -> LoopResult | None:
        if not state.frames:  # halo mode never has frames before its last tile
            return None
        return LoopResult(loop_id=self.loop_id, artifacts=[self._artifact(state, partial=True)])

    def _frames(self, state: WanDecodeState) -> torch.Tensor:
        """The decoded video (F, 3, H, W): the frames in order, or in halo mode the strips put in place."""
        if state.halo is None:
            return torch.cat(state.frames).float().cpu()
        h, w = state.latents.shape[-2:]
        s = state.spatial_scale
        first = state.strips[0]
        video = torch.empty((first.shape[1], first.shape[0], h * s, w * s), dtype=torch.float32)
        for (rows, columns), strip in zip(state.halo.owned(h, w), state.strips, strict=True):
            video[:, :, rows[0] * s : rows[1] * s, columns[0] * s : columns[1] * s].copy_(strip.transpose(0, 1))
        return video

    def _artifact(self, state: WanDecodeState, *, partial: bool) -> VideoArtifact:
        return VideoArtifact(
            frames=self._frames(state), fps=state.fps,
            provenance=Provenance(
                model_id=state.model_id, loop_id=self.loop_id, request_id=state.request_id, node=state.instance_id,
                seed=state.seed, weights_version=state.weights_version, partial=partial,
                recipe_overrides=state.recipe_overrides,
            ),
        )

    def progress(self, state: WanDecodeState) -> tuple[int, int | None]:
        if state.halo is not None:
            return state.step, 1 + state.halo.count
        return state.step, int(state.latents.shape[2])

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        """One step per latent frame; the decoded frames and the causal history stay for the loop's life."""
        d = request.diffusion
        assert d.height and d.width and d.frames
        vae = _vae_config(model)
        s, t = vae.spatial_compression, vae.temporal_compression
        latent_frames, h, w = (d.frames - 1) // t + 1, d.height // s, d.width // s
        element = _element_bytes(model, "vae_decoder")
        halo = self._halo()
        if halo is not None:
            return self._estimate_halo(halo, vae, latent_frames, h, w, element, model)
        height, width = h, w
        tiles = 1
        if self.spec.config.get("tiling"):
            tiling = TilingConfig(**self.spec.config["tiling"])
            if h > tiling.tile_sample_min_height // s or w > tiling.tile_sample_min_width // s:
                height, width = tiling.tile_sample_min_height // s, tiling.tile_sample_min_width // s
                tiles = len(range(0, h, tiling.tile_sample_stride_height // s)) * len(range(0, w, tiling.tile_sample_stride_width // s))
        step = footprint.vae_decode_step(vae, height, width, element=element)
        history = tiles * step.cache_bytes
        pixel_frames = 1 + t * (latent_frames - 1)
        out_frame = vae.video_channels * d.height * d.width
        signature = str((h, w))
        steps = [StepEstimate(loop_id=self.loop_id, kind=WorkKind.VAE_TILE, shape_sig=ShapeSignature.of(latent=signature, first=1))]
        if latent_frames > 1:
            steps.append(StepEstimate(loop_id=self.loop_id, kind=WorkKind.VAE_TILE, count=latent_frames - 1,
                                      shape_sig=ShapeSignature.of(latent=signature, first=0)))
        # The decoded frames (fp32) stay until the artifact is made: on the device, except on CUDA,
        # where the op copies each step's frames to pinned host memory (vae_decode_frame).
        frames_on_device = 0 if model.device.type == "cuda" else 4 * out_frame * pixel_frames
        return ResourceRequest(
            steps=tuple(steps),
            resident_bytes=frames_on_device + history,  # and every tile's causal history
            # next to the history the step reads: its activations while it writes the new history (handed
            # back as it is, not repacked), and its frames in the VAE's dtype and as fp32 in [0, 1]
            peak_bytes=step.activation_bytes + history + out_frame * t * (element + 2 * 4),
        )

    def _estimate_halo(
        self, halo: HaloTiling, vae: WanVAEConfig, latent_frames: int, h: int, w: int, element: int, model: ModelInstance
    ) -> ResourceRequest:
        """The whole-frame step, then one step per tile; a tile step holds the whole-frame activations, its
        own history and one frame step's activations at the tile's size with margins."""
        reach = halo_reach(vae)
        # The alignment widens a tile's ranges by less than ``align`` pixels at the stages it touches.
        tile_h = min(h, -(-h // halo.rows) + 2 * reach + halo.align)
        tile_w = min(w, -(-w // halo.columns) + 2 * reach + halo.align)
        step = footprint.vae_decode_step(vae, tile_h, tile_w, element=element)
        lower_bytes = latent_frames * h * w * element * (vae.decoder_base_dim or vae.base_dim) * vae.dim_mult[-1]
        pixel_frames = 1 + vae.temporal_compression * (latent_frames - 1)
        video = vae.video_channels * pixel_frames * h * w * vae.spatial_compression**2
        # The tile's video (fp32 in [0, 1] and in the VAE's dtype) is made on the device, then leaves it on CUDA.
        tile_video = -(-video // halo.count) * (element + 2 * 4)
        signature = str((h, w))
        steps = (
            StepEstimate(loop_id=self.loop_id, kind=WorkKind.VAE_TILE, shape_sig=ShapeSignature.of(latent=signature, halo="lower")),
            StepEstimate(loop_id=self.loop_id, kind=WorkKind.VAE_TILE, count=halo.count,
                         shape_sig=ShapeSignature.of(latent=signature, halo=f"{halo.rows}x{halo.columns}")),
        )
        return ResourceRequest(
            steps=steps,
            resident_bytes=lower_bytes + (0 if model.device.type == "cuda" else 4 * video),
            peak_bytes=lower_bytes + step.activation_bytes + step.cache_bytes + tile_video,
        )

