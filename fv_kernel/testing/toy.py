"""Tiny pure-torch cards that prove the loop contract fits more than one kind of loop.

- ``toy-dit``: a few-layer DiT-like model run by a ``diffusion_denoise`` loop with CFG,
  a text-encode loop and a frame-by-frame decode loop (text-to-video, text-to-image).
- ``toy-lm``: a few-layer decoder with a KV cache run by an ``ar_decode`` loop with a
  prefill step, token steps, seeded sampling and EOS (text generation).
- ``toy-omni``: both on **one** instance sharing weights: the decoder's hidden states
  are the diffusion loop's text conditioning, and a request may first rewrite its
  prompt with the decoder (``prompt_upsampling``), then generate.

They run on CPU in milliseconds and are fixtures of the conformance kit. They use
the kernel's samplers and guidance policies as a library, the way a family does.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fv_kernel.card.checkpoint import load_into, read_safetensors, resolve_source
from fv_kernel.compute.lora import rows_adapted
from fv_kernel.errors import CheckpointNotFound
from fv_kernel.model.precision import apply_precision_path, prepare_fp8_storage
from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.instance import ModelInstance
from fv_kernel.loop.plan import StepOp
from fv_kernel.card.spec import (
    PrecisionPathContract,
    BatchedVsAlone,
    CapabilityMatrix,
    CheckpointManifest,
    ComponentCheckpoint,
    ComponentSpec,
    FrameRule,
    GenerationDefaults,
    LoopSpec,
    ModelCard,
    ParitySpec,
    ParityTolerance,
    PrecisionContract,
    ProgramSpec,
    RecipeSpec,
    SamplerBinding,
    StepCostSpec,
)
from fv_kernel.loop.contract import LoopContext
from fv_kernel.loop.contract import Done, Loop, LoopResult, LoopState
from fv_kernel.loop.plan import EmitSpec, ResourceRequest, ShapeSignature, StepEstimate, StepResult, WorkKind, WorkPlan
from fv_kernel.loop.guidance import builtin_guidance_policies
from fv_kernel.loop.samplers import SamplerState, bound_sampler, sampler_from_state
from fv_kernel.loop.sampling import apply_presence_penalty, sample_next_token
from fv_kernel.state import generator_from_state, new_generator_state
from fv_kernel.program.base import Program
from fv_kernel.request.artifacts import Provenance, TextArtifact, VideoArtifact
from fv_kernel.request.request import Request
from fv_kernel.request.types import TaskType

__all__ = [
    "ToyConfig",
    "ToyLM",
    "ToyDiT",
    "ToyDecoder",
    "toy_cards",
    "toy_card",
    "build_toy_instance",
    "ByteCodec",
    "TextEncodeLoop",
    "ToyDenoiseLoop",
    "ToyDecodeLoop",
    "ToyARDecodeLoop",
]

_MODULE = "fv_kernel.testing.toy"
_FP32 = 4


# --------------------------------------------------------------------------- tokenizer


class ByteCodec:
    """UTF-8 bytes as tokens: 0 = pad, 1 = eos, 2 = bos, bytes at 3..258."""

    pad_id, eos_id, bos_id, vocab_size = 0, 1, 2, 259

    def encode(self, text: str, max_length: int) -> list[int]:
        ids = [self.bos_id] + [b + 3 for b in text.encode("utf-8")]
        return ids[:max_length]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- modules


class ToyConfig:
    dim = 32
    heads = 2
    layers = 2
    latent_channels = 4
    text_len = 16
    vae_scale = 2


def _toy_activation_bytes(rows: int, tokens: int, attended: int | None = None) -> int:
    """Transient fp32 bytes of one toy block over ``rows`` x ``tokens``.

    About eight hidden-widths per token are alive at once (input, q/k/v, attention
    output, the 2x-wide MLP hidden), plus the attention score matrix (heads x tokens x
    the tokens attended, self or cross).
    """
    c = ToyConfig
    return _FP32 * rows * tokens * (8 * c.dim + c.heads * max(tokens, attended or 0))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class ToyLM(nn.Module):
    """A causal decoder whose layers also serve as the diffusion model's text encoder."""

    def __init__(self, cfg: type[ToyConfig] = ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.embed = nn.Embedding(ByteCodec.vocab_size, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(cfg.layers))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(cfg.layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, ByteCodec.vocab_size)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.cfg.heads, -1).transpose(1, 2)

    def forward_with_cache(
        self, ids: torch.Tensor, past: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of ``ids`` after ``past`` (layers, 2, B, heads, T, hd), and the grown cache."""
        x = self.embed(ids)
        new_kv = []
        for i in range(self.cfg.layers):
            q, k, v = self.qkv[i](x).chunk(3, dim=-1)
            q, k, v = self._split(q), self._split(k), self._split(v)
            if past is not None:
                k = torch.cat([past[i, 0], k], dim=2)
                v = torch.cat([past[i, 1], v], dim=2)
            new_kv.append(torch.stack([k, v]))
            t_new, t_all = q.shape[2], k.shape[2]
            mask = torch.ones(t_new, t_all, dtype=torch.bool).tril(diagonal=t_all - t_new)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + self.out[i](a.transpose(1, 2).reshape(x.shape))
            x = x + self.mlp[i](x)
        return self.norm(x), torch.stack(new_kv)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


class ToyDiT(nn.Module):
    """Tokens = latent pixels; blocks of self-attention, cross-attention to text and a modulated MLP."""

    def __init__(self, cfg: type[ToyConfig] = ToyConfig) -> None:
        super().__init__()
        d, c = cfg.dim, cfg.latent_channels
        self.cfg = cfg
        self.proj_in = nn.Linear(c, d)
        self.time = nn.Sequential(nn.Linear(64, d), nn.SiLU(), nn.Linear(d, 2 * d))
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {"qkv": nn.Linear(d, 3 * d), "o": nn.Linear(d, d), "q2": nn.Linear(d, d), "kv2": nn.Linear(d, 2 * d),
                 "o2": nn.Linear(d, d), "mlp": nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))}
            )
            for _ in range(cfg.layers)
        )
        self.proj_out = nn.Linear(d, c)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.cfg.heads, -1).transpose(1, 2)

    def prepare(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> dict[str, Any]:
        """Tokens and conditioning for the block loop (the block sequence hooks can wrap)."""
        half = 32
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        args = t.float().view(-1, 1) * freqs.view(1, -1)
        scale, shift = self.time(torch.cat([torch.cos(args), torch.sin(args)], dim=-1)).unsqueeze(1).chunk(2, dim=-1)
        tokens = self.proj_in(x.flatten(2).transpose(1, 2))
        return {"tokens": tokens, "context": context, "scale": scale, "shift": shift, "shape": tuple(x.shape)}

    def run_block(self, index: int, tokens: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        blk = self.blocks[index]
        q, k, v = blk["qkv"](tokens).chunk(3, dim=-1)
        a = _attention(self._heads(q), self._heads(k), self._heads(v))
        tokens = tokens + blk["o"](a.transpose(1, 2).reshape(tokens.shape))
        k2, v2 = blk["kv2"](inputs["context"]).chunk(2, dim=-1)
        a2 = _attention(self._heads(blk["q2"](tokens)), self._heads(k2), self._heads(v2))
        tokens = tokens + blk["o2"](a2.transpose(1, 2).reshape(tokens.shape))
        return tokens + blk["mlp"](tokens * (1 + inputs["scale"]) + inputs["shift"])

    def finish(self, tokens: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        b, c, f, h, w = inputs["shape"]
        return self.proj_out(tokens).transpose(1, 2).reshape(b, c, f, h, w)

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        inputs = self.prepare(x, t, context)
        tokens = inputs["tokens"]
        for index in range(len(self.blocks)):
            tokens = self.run_block(index, tokens, inputs)
        return self.finish(tokens, inputs)


class ToyBlocks:
    """The toy DiT's block stack of one prepared forward, as block hooks see it."""

    def __init__(self, model: ToyDiT, inputs: dict[str, Any]) -> None:
        self._model, self._inputs = model, inputs

    @property
    def num_blocks(self) -> int:
        return len(self._model.blocks)

    def run(self, start: int, stop: int, hidden: torch.Tensor) -> torch.Tensor:
        for index in range(start, stop):
            hidden = self._model.run_block(index, hidden, self._inputs)
        return hidden


class ToyDecoder(nn.Module):
    """Latent frame -> RGB frame, upsampled; decoded one latent frame at a time."""

    def __init__(self, cfg: type[ToyConfig] = ToyConfig) -> None:
        super().__init__()
        self.scale = cfg.vae_scale
        self.conv = nn.Conv2d(cfg.latent_channels, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # (B, C, h, w) -> (B, 3, H, W) in [0, 1]
        up = F.interpolate(z, scale_factor=self.scale, mode="nearest")
        return (torch.tanh(self.conv(up)) + 1) / 2


# --------------------------------------------------------------------------- loops


class TextEncodeState(LoopState):
    ids: torch.Tensor
    embeds: torch.Tensor | None = None
    #: The request's adapters on the text encoder (``ModelInstance.adapter_inputs``; empty when off).
    adapters: dict[str, torch.Tensor] = Field(default_factory=dict)


class TextEncodeLoop(Loop[TextEncodeState]):
    """One encoder step for the prompt and negative prompt; hidden states of the shared LM."""

    kind = "text_encode"
    state_type = TextEncodeState

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> TextEncodeState:
        codec = ByteCodec()
        prompt = ctx.upstream.get("upsampled_prompt") or request.text("prompt") or ""
        texts = [prompt, request.text("negative_prompt") or ""]
        rows = []
        for text in texts:
            ids = codec.encode(text, ToyConfig.text_len)
            rows.append(ids + [codec.pad_id] * (ToyConfig.text_len - len(ids)))
        return TextEncodeState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id,
            ids=torch.tensor(rows, dtype=torch.long), adapters=model.adapter_inputs(request, "lm", rows=len(rows)),
        )

    def next(self, state: TextEncodeState) -> WorkPlan | Done:
        if state.embeds is not None:
            return Done()
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.ENCODER_CHUNK, op="encode_text",
            inputs={"ids": state.ids, **state.adapters}, shape_sig=ShapeSignature.of(tokens=int(state.ids.shape[1])),
        )

    def advance(self, state: TextEncodeState, result: StepResult) -> TextEncodeState:
        return state.model_copy(update={"embeds": result.outputs["hidden"], "step": state.step + 1})

    def finalize(self, state: TextEncodeState) -> LoopResult:
        assert state.embeds is not None
        return LoopResult(loop_id=self.loop_id, outputs={"prompt_embeds": state.embeds[:1], "negative_embeds": state.embeds[1:]})

    def progress(self, state: TextEncodeState) -> tuple[int, int | None]:
        return state.step, 1

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        rows, tokens = 2, ToyConfig.text_len  # prompt and negative prompt, padded
        return ResourceRequest(
            steps=(StepEstimate(loop_id=self.loop_id, kind=WorkKind.ENCODER_CHUNK,
                                shape_sig=ShapeSignature.of(tokens=tokens)),),
            resident_bytes=_FP32 * rows * tokens * ToyConfig.dim,  # the embeddings the denoise loop conditions on
            peak_bytes=_toy_activation_bytes(rows, tokens),
        )


class DenoiseState(LoopState):
    latents: torch.Tensor
    sampler_state: SamplerState
    rng_state: torch.Tensor
    prompt_embeds: torch.Tensor
    negative_embeds: torch.Tensor
    guidance: float
    total_steps: int
    #: The request's adapters on the DiT, one row (``ModelInstance.adapter_inputs``; empty when off).
    adapters: dict[str, torch.Tensor] = Field(default_factory=dict)


class ToyDenoiseLoop(Loop[DenoiseState]):
    """A diffusion_denoise loop written with the kernel's samplers and guidance as a library."""

    kind = "diffusion_denoise"
    state_type = DenoiseState

    def _sampler(self, request_shift: float | None = None, requested: str | None = None) -> Any:
        binding = self.spec.sampler
        assert binding is not None
        # Names resolve through the deployment's registry (plugin samplers too); see bound_sampler.
        return bound_sampler(binding, requested=requested, shift=request_shift)

    def _guidance(self) -> Any:
        return builtin_guidance_policies()[self.spec.guidance or "cfg"]()

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> DenoiseState:
        d = request.diffusion
        assert d.height and d.width and d.frames and d.steps is not None
        s = ToyConfig.vae_scale
        shape = (1, ToyConfig.latent_channels, d.frames, d.height // s, d.width // s)
        generator = torch.Generator().manual_seed(d.seed)
        latents = torch.randn(shape, generator=generator, dtype=torch.float32)
        sampler = self._sampler(d.shift, d.sampler)
        steps = self.spec.sampler.fixed_steps if self.spec.sampler and self.spec.sampler.fixed_steps else d.steps
        return DenoiseState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id,
            latents=latents, sampler_state=sampler.init_state(steps), rng_state=generator.get_state(),
            prompt_embeds=ctx.upstream["prompt_embeds"], negative_embeds=ctx.upstream["negative_embeds"],
            guidance=float(d.guidance or 0.0), total_steps=steps, adapters=model.adapter_inputs(request, "dit"),
        )

    def next(self, state: DenoiseState) -> WorkPlan | Done:
        sampler = sampler_from_state(state.sampler_state)
        if sampler.is_done(state.sampler_state):
            return Done()
        branches = self._guidance().branches(state.guidance)
        context = torch.cat([state.prompt_embeds if b == "cond" else state.negative_embeds for b in branches])
        n = len(branches)
        t = sampler.timestep(state.sampler_state).reshape(1).expand(n).float()
        tokens = int(state.latents[0, 0].numel())
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.DIFFUSION_STEP, op="dit_forward",
            inputs={"x": state.latents.expand(n, *state.latents.shape[1:]), "t": t, "context": context,
                    **{name: rows.expand(n, -1) for name, rows in state.adapters.items()}},
            params={"branches": n, "dispatch": self.spec.config.get("cfg_dispatch", "batched")},
            shape_sig=ShapeSignature.of(tokens=tokens, branches=n),
            emits=[], tag="+".join(branches),
        )

    def advance(self, state: DenoiseState, result: StepResult) -> DenoiseState:
        sampler = sampler_from_state(state.sampler_state)
        policy = self._guidance()
        branches = policy.branches(state.guidance)
        out = result.outputs["v"]
        velocity = policy.combine(dict(zip(branches, out.split(1))), state.guidance, step_index=state.step)
        noise = None
        rng_state = state.rng_state
        if sampler.needs_noise(state.sampler_state):
            generator = generator_from_state(state.rng_state)
            noise = torch.randn(state.latents.shape, generator=generator, dtype=torch.float32)
            rng_state = generator.get_state()
        new_sampler_state, latents = sampler.step(state.sampler_state, velocity, state.latents, noise=noise)
        return state.model_copy(
            update={"latents": latents, "sampler_state": new_sampler_state, "rng_state": rng_state, "step": state.step + 1}
        )

    def finalize(self, state: DenoiseState) -> LoopResult:
        return LoopResult(loop_id=self.loop_id, outputs={"latents": state.latents})

    def progress(self, state: DenoiseState) -> tuple[int, int | None]:
        return state.step, state.total_steps

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        d = request.diffusion
        assert d.height and d.width and d.frames and d.steps is not None
        s = ToyConfig.vae_scale
        tokens = d.frames * (d.height // s) * (d.width // s)  # what next() puts in the shape signature
        branches = len(self._guidance().branches(float(d.guidance or 0.0)))
        binding = self.spec.sampler
        steps = binding.fixed_steps if binding is not None and binding.fixed_steps else d.steps
        latent_bytes = _FP32 * ToyConfig.latent_channels * tokens
        # "sequential" dispatch runs one branch row at a time; "batched" runs them together.
        rows = 1 if self.spec.config.get("cfg_dispatch", "batched") == "sequential" else branches
        return ResourceRequest(
            steps=(StepEstimate(loop_id=self.loop_id, kind=WorkKind.DIFFUSION_STEP,
                                shape_sig=ShapeSignature.of(tokens=tokens, branches=branches), count=steps),),
            # latents, the sampler's history (UniPC keeps up to three), the branch outputs
            resident_bytes=latent_bytes * (4 + branches),
            peak_bytes=_toy_activation_bytes(rows, tokens, ToyConfig.text_len) + latent_bytes * branches,
        )


class DecodeState(LoopState):
    latents: torch.Tensor
    frames: list[torch.Tensor] = []
    fps: float


class ToyDecodeLoop(Loop[DecodeState]):
    """One WorkPlan per latent frame, streamed as a preview chunk as it finishes."""

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
        t0 = index / state.fps
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.VAE_TILE, op="decode_frame",
            inputs={"z": z}, shape_sig=ShapeSignature.of(tokens=int(z[0, 0].numel())),
            emits=[EmitSpec(stream="video", modality="video", preview=True, from_output="frame", pts=(t0, t0 + 1 / state.fps))],
        )

    def advance(self, state: DecodeState, result: StepResult) -> DecodeState:
        return state.model_copy(update={"frames": [*state.frames, result.outputs["frame"]], "step": state.step + 1})

    def finalize(self, state: DecodeState) -> LoopResult:
        return LoopResult(loop_id=self.loop_id, artifacts=[self._artifact(state, partial=False)])

    def partial(self, state: DecodeState) -> LoopResult | None:
        if not state.frames:
            return None
        return LoopResult(loop_id=self.loop_id, artifacts=[self._artifact(state, partial=True)])

    def _artifact(self, state: DecodeState, partial: bool) -> VideoArtifact:
        frames = torch.cat(state.frames, dim=0)  # (F, 3, H, W)
        return VideoArtifact(
            frames=frames, fps=state.fps,
            provenance=Provenance(model_id="", loop_id=self.loop_id, request_id=state.request_id, partial=partial),
        )

    def progress(self, state: DecodeState) -> tuple[int, int | None]:
        return state.step, int(state.latents.shape[2])

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        d = request.diffusion
        assert d.height and d.width and d.frames
        s = ToyConfig.vae_scale
        latent_pixels = (d.height // s) * (d.width // s)
        frame_bytes = _FP32 * 3 * d.height * d.width
        return ResourceRequest(
            steps=(StepEstimate(loop_id=self.loop_id, kind=WorkKind.VAE_TILE,
                                shape_sig=ShapeSignature.of(tokens=latent_pixels), count=d.frames),),
            resident_bytes=frame_bytes * d.frames,  # every decoded frame, until the artifact is made
            # the upsampled latent frame, the conv output and its tanh
            peak_bytes=_FP32 * ToyConfig.latent_channels * d.height * d.width + 2 * frame_bytes,
        )


class ARState(LoopState):
    prompt_ids: list[int]
    generated: list[int] = []
    kv: torch.Tensor | None = None
    last_logits: torch.Tensor | None = None
    rng_state: torch.Tensor
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    presence_penalty: float
    stop_ids: list[int]
    finished: bool = False
    #: The request's adapters on the LM (``ModelInstance.adapter_inputs``; empty when off).
    adapters: dict[str, torch.Tensor] = Field(default_factory=dict)


class ToyARDecodeLoop(Loop[ARState]):
    """Prefill, then one token per step against the KV cache in the state; seeded sampling; EOS."""

    kind = "ar_decode"
    state_type = ARState

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> ARState:
        ar = request.ar
        assert ar is not None
        codec = ByteCodec()
        return ARState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id,
            prompt_ids=codec.encode(request.text("prompt") or "", 64), rng_state=new_generator_state(ar.seed),
            max_tokens=ar.max_tokens, temperature=ar.temperature, top_k=ar.top_k, top_p=ar.top_p,
            presence_penalty=ar.presence_penalty, stop_ids=[codec.eos_id, *ar.stop_token_ids],
            adapters=model.adapter_inputs(request, "lm"),
        )

    def next(self, state: ARState) -> WorkPlan | Done:
        if state.finished:
            # The last token's text: each plan streams the token before it, and no plan follows this one.
            text = ByteCodec().decode([state.generated[-1]]) if state.generated else ""
            return Done(emits=(EmitSpec(stream="text", modality="text", text=text),) if text else ())
        if state.kv is None:
            ids = torch.tensor([state.prompt_ids], dtype=torch.long)
            return WorkPlan(
                loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.AR_PREFILL, op="lm_prefill",
                inputs={"ids": ids, **state.adapters}, shape_sig=ShapeSignature.of(tokens=len(state.prompt_ids)),
            )
        last = state.generated[-1]
        context = int(state.kv.shape[-2])
        text = ByteCodec().decode([last])
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.AR_TOKEN, op="lm_decode",
            inputs={"ids": torch.tensor([[last]], dtype=torch.long), "kv": state.kv.transpose(0, 2), **state.adapters},
            shape_sig=ShapeSignature.of(tokens=1, context=context),
            emits=[EmitSpec(stream="text", modality="text", text=text)] if text else [],
        )

    def advance(self, state: ARState, result: StepResult) -> ARState:
        logits = result.outputs["logits"][0, -1]
        kv = result.outputs["kv"].transpose(0, 2)
        logits = apply_presence_penalty(logits, state.generated, state.presence_penalty)
        generator = generator_from_state(state.rng_state)
        token = sample_next_token(logits, temperature=state.temperature, top_k=state.top_k, top_p=state.top_p, generator=generator)
        generated = [*state.generated, token]
        finished = token in state.stop_ids or len(generated) >= state.max_tokens
        return state.model_copy(
            update={"generated": generated, "kv": kv, "rng_state": generator.get_state(), "finished": finished,
                    "step": state.step + 1}
        )

    def finalize(self, state: ARState) -> LoopResult:
        ids = [t for t in state.generated if t not in state.stop_ids]
        text = ByteCodec().decode(ids)
        artifact = TextArtifact(
            token_ids=state.generated, text=text,
            provenance=Provenance(model_id="", loop_id=self.loop_id, request_id=state.request_id),
        )
        return LoopResult(loop_id=self.loop_id, outputs={"text": text, "upsampled_prompt": text}, artifacts=[artifact])

    def progress(self, state: ARState) -> tuple[int, int | None]:
        return state.step, state.max_tokens + 1

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        max_tokens = request.ar.max_tokens if request.ar else 64
        prompt = len(ByteCodec().encode(request.text("prompt") or "", 64))  # what init() tokenizes
        # One prefill, then a token step per further token, each at its own context length (next()).
        steps = [StepEstimate(loop_id=self.loop_id, kind=WorkKind.AR_PREFILL, shape_sig=ShapeSignature.of(tokens=prompt))]
        steps += [
            StepEstimate(loop_id=self.loop_id, kind=WorkKind.AR_TOKEN,
                         shape_sig=ShapeSignature.of(tokens=1, context=prompt + i))
            for i in range(max_tokens - 1)
        ]
        kv_bytes = _FP32 * 2 * ToyConfig.layers * ToyConfig.dim * (prompt + max_tokens)
        return ResourceRequest(
            steps=tuple(steps),
            resident_bytes=kv_bytes,
            # a token step returns the grown cache as a new tensor next to the old one
            peak_bytes=kv_bytes + _toy_activation_bytes(1, prompt),
        )


class UpsampleThenGenerate(Program):
    """toy-omni's text-to-video program: optionally rewrite the prompt with the LM, then generate.

    Both loops run on the same resident instance and the same LM weights. Every loop
    runs through ``run_loop``, so a checkpoint of the request resumes anywhere.
    """

    resumable = True

    def loop_ids(self, request: Request) -> list[str]:
        base = ["text_encode", "denoise", "decode"]
        return (["upsample"] if request.prompt_upsampling else []) + base

    async def run(self, model: ModelInstance, ctx: LoopContext) -> list[Any]:
        upstream: dict[str, Any] = {}
        artifacts: list[Any] = []
        for loop_id in self.loop_ids(ctx.request):
            result = await self.run_loop(loop_id, model, ctx.child(upstream))
            upstream.update(result.outputs)
            artifacts.extend(result.artifacts)
        return artifacts


# --------------------------------------------------------------------------- ops + factory


def _ops(instance: ModelInstance) -> dict[str, StepOp]:
    comps = instance.components
    ops: dict[str, StepOp] = {}
    if "lm" in comps:
        lm: ToyLM = comps["lm"]

        def encode_text(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            with rows_adapted(lm, instance.row_adapters(inputs, "lm")):
                hidden, _ = lm.forward_with_cache(inputs["ids"], None)
            return {"hidden": hidden}

        def lm_prefill(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            with rows_adapted(lm, instance.row_adapters(inputs, "lm")):
                hidden, kv = lm.forward_with_cache(inputs["ids"], None)
                return {"logits": lm.logits(hidden[:, -1:]), "kv": kv.transpose(0, 2)}

        def lm_decode(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            with rows_adapted(lm, instance.row_adapters(inputs, "lm")):
                hidden, kv = lm.forward_with_cache(inputs["ids"], inputs["kv"].transpose(0, 2))
                return {"logits": lm.logits(hidden), "kv": kv.transpose(0, 2)}

        ops["encode_text"] = StepOp("encode_text", encode_text)
        ops["lm_prefill"] = StepOp("lm_prefill", lm_prefill)
        ops["lm_decode"] = StepOp("lm_decode", lm_decode)
    if "dit" in comps:
        dit: ToyDiT = comps["dit"]

        def dit_forward(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            hooks = params.get("block_hooks")

            def row(i: int) -> dict[str, torch.Tensor]:
                return {name: tensor[i : i + 1] for name, tensor in inputs.items()}

            if hooks is None and params.get("dispatch") == "sequential":
                rows = []
                for i in range(inputs["x"].shape[0]):
                    with rows_adapted(dit, instance.row_adapters(row(i), "dit")):
                        rows.append(dit(inputs["x"][i : i + 1], inputs["t"][i : i + 1], inputs["context"][i : i + 1]))
                return {"v": torch.cat(rows)}
            if hooks is None:
                with rows_adapted(dit, instance.row_adapters(inputs, "dit")):
                    return {"v": dit(inputs["x"], inputs["t"], inputs["context"])}
            rows = []
            for i in range(inputs["x"].shape[0]):
                with rows_adapted(dit, instance.row_adapters(row(i), "dit")):
                    prepared = dit.prepare(inputs["x"][i : i + 1], inputs["t"][i : i + 1], inputs["context"][i : i + 1])
                    hidden = hooks.run(i, ToyBlocks(dit, prepared), prepared["tokens"])
                    rows.append(dit.finish(hidden, prepared))
            return {"v": torch.cat(rows)}

        ops["dit_forward"] = StepOp("dit_forward", dit_forward, supports_block_hooks=True)
    if "decoder" in comps:
        decoder: ToyDecoder = comps["decoder"]

        def decode_frame(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            return {"frame": decoder(inputs["z"])}

        ops["decode_frame"] = StepOp("decode_frame", decode_frame)
    return ops


_BUILDERS = MappingProxyType({"lm": ToyLM, "dit": ToyDiT, "decoder": ToyDecoder})


def build_component(name: str, seed: int) -> nn.Module:
    """A toy component with seeded random weights (equal seeds give equal weights)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module = _BUILDERS[name]()
    return module.eval().requires_grad_(False)


def build_toy_instance(card: ModelCard, options: InstanceOptions) -> ModelInstance:
    """A toy instance: seeded components, or (a card ``fv quantize`` wrote) components read from
    ``checkpoint.source``; each then on the instance's precision path (fp8 targets quantized)."""

    def load(component_id: str) -> nn.Module:
        spec = card.checkpoint.components[component_id]
        module = build_component(component_id, spec.random_init_seed if spec.random_init_seed is not None else 0)
        path = instance.precision_path
        if spec.random_init_seed is None:
            if card.checkpoint.source is None:
                raise CheckpointNotFound(f"card {card.model_id!r}: component {component_id!r} has no seed and no "
                                         "checkpoint.source", param="model")
            folder = resolve_source(card.checkpoint.source, subfolder=spec.subfolder or component_id)
            prepare_fp8_storage(card, component_id, module, path)
            # Own, freshly allocated copies: tensors read from a file may sit at any alignment in its buffer,
            # and CPU matmuls round differently on unaligned data (1e-7 against the quantized-at-load run).
            state = {key: tensor.clone() for key, tensor in read_safetensors(folder).items()}
            load_into(module, state, component=component_id)
        apply_precision_path(card, component_id, module, path)
        return module.to(options.device)

    seeded = all(c.random_init_seed is not None for c in card.checkpoint.components.values())
    instance = ModelInstance(card=card, options=options, component_loader=load, ops_builder=_ops,
                             weights_version="toy-seeded" if seeded else f"toy-files:{card.checkpoint.source}")
    return instance


_T2V = frozenset({TaskType.TEXT_TO_VIDEO, TaskType.TEXT_TO_IMAGE})


#: Measured on CPU: 1.2e-7 on toy-dit and toy-omni, 4 requests concurrent and staggered (bench/bench_batched_vs_alone.py).
_TOY_BATCHED_VS_ALONE = BatchedVsAlone(
    precision="fp32", max_abs=1e-6,
    justification=("decoded frames in [0, 1], fp32 on CPU; fused forwards reduce in another order than batch 1 "
                   "(measured 1.2e-7 on toy-dit and toy-omni, bench/bench_batched_vs_alone.py); 1e-6 leaves 8x"),
)


#: toy-dit's fp8 linears: every block's attention projections and MLP; proj_in, the time embedding
#: and proj_out stay native (as fp8 serving recipes keep embedders and the output projection).
TOY_FP8_TARGETS = ("blocks.*.qkv", "blocks.*.o", "blocks.*.q2", "blocks.*.kv2", "blocks.*.o2", "blocks.*.mlp.0",
                   "blocks.*.mlp.2")
_TOY_DIT_PRECISION = PrecisionContract(
    default="fp32", supported=frozenset({"fp32"}), fp8_targets={"dit": TOY_FP8_TARGETS},
    paths={
        # Measured on CPU (fp32, default trajectory, 4 prompts and seeds): 53.4-60.2 dB and 47.5-50.5 dB against
        # native; the floors leave about 8 dB.
        "fp8_weights": PrecisionPathContract(path="fp8_weights", min_psnr_db=45.0, justification=(
            "measured 53.4-60.2 dB against native on CPU, 4 prompts and seeds; floor 8 dB below")),
        "fp8_dynamic": PrecisionPathContract(path="fp8_dynamic", min_psnr_db=40.0, justification=(
            "measured 47.5-50.5 dB against native on CPU, 4 prompts and seeds; floor 7.5 dB below")),
    },
)


def toy_card(model_id: str) -> ModelCard:
    """One of ``toy-dit``, ``toy-lm``, ``toy-omni``."""
    has_dit = model_id in ("toy-dit", "toy-omni")
    has_lm_task = model_id in ("toy-lm", "toy-omni")
    tasks: set[TaskType] = set()
    components: dict[str, ComponentSpec] = {
        "lm": ComponentSpec(component_id="lm", kind="reasoner_tower", builder=f"{_MODULE}:build_component"),
    }
    ckpt: dict[str, ComponentCheckpoint] = {}
    loops: dict[str, LoopSpec] = {}
    programs: dict[TaskType, ProgramSpec] = {}
    lm_tasks: set[TaskType] = set()
    cost = StepCostSpec(unit="tokens", fixed_seconds=1e-3, per_unit_seconds=1e-6)
    if has_dit:
        tasks |= _T2V
        lm_tasks |= _T2V
        components["dit"] = ComponentSpec(component_id="dit", kind="dit", builder=f"{_MODULE}:build_component")
        components["decoder"] = ComponentSpec(component_id="decoder", kind="vae", builder=f"{_MODULE}:build_component")
        ckpt["dit"] = ComponentCheckpoint(required_for=_T2V, random_init_seed=1)
        ckpt["decoder"] = ComponentCheckpoint(required_for=_T2V, random_init_seed=2)
        loops["text_encode"] = LoopSpec(loop_id="text_encode", kind="text_encode", implementation=f"{_MODULE}:TextEncodeLoop", step_cost=cost)
        loops["denoise"] = LoopSpec(
            loop_id="denoise", kind="diffusion_denoise", implementation=f"{_MODULE}:ToyDenoiseLoop",
            sampler=SamplerBinding(name="euler", config={"shift": 1.0}), guidance="cfg", step_cost=cost,
            # Two forwards per step, as diffusers runs CFG: the rows then run the same kernels
            # with or without block hooks, so a no-op interceptor is bit-identical to none.
            config={"cfg_dispatch": "sequential"},
        )
        loops["denoise_unipc"] = LoopSpec(
            loop_id="denoise_unipc", kind="diffusion_denoise", implementation=f"{_MODULE}:ToyDenoiseLoop",
            sampler=SamplerBinding(name="unipc", config={"shift": 3.0}), guidance="cfg", step_cost=cost,
        )
        loops["decode"] = LoopSpec(loop_id="decode", kind="vae_decode", implementation=f"{_MODULE}:ToyDecodeLoop", step_cost=cost)
        program = (
            # The rewritten prompt comes back as text when the request asks for prompt_upsampling.
            ProgramSpec(implementation=f"{_MODULE}:UpsampleThenGenerate", returns=frozenset({"video", "text"}))
            if model_id == "toy-omni"
            else ProgramSpec(loops=("text_encode", "denoise", "decode"), returns=frozenset({"video"}))
        )
        programs = {t: program for t in _T2V}
    if has_lm_task:
        tasks.add(TaskType.TEXT_GENERATION)
        lm_tasks.add(TaskType.TEXT_GENERATION)
        loops["upsample" if model_id == "toy-omni" else "decode_text"] = LoopSpec(
            loop_id="upsample" if model_id == "toy-omni" else "decode_text", kind="ar_decode",
            implementation=f"{_MODULE}:ToyARDecodeLoop", causal=True, step_cost=cost,
        )
        programs[TaskType.TEXT_GENERATION] = ProgramSpec(
            loops=("upsample" if model_id == "toy-omni" else "decode_text",), returns=frozenset({"text"}),
        )
    ckpt["lm"] = ComponentCheckpoint(required_for=frozenset(lm_tasks), random_init_seed=0)
    return ModelCard(
        model_id=model_id,
        family="toy",
        summary="tiny pure-torch test card",
        components=components,
        loops=loops,
        programs=programs,
        capabilities=CapabilityMatrix(
            tasks=frozenset(tasks),
            defaults=GenerationDefaults(height=8, width=8, frames=3, fps=8.0, steps=4, guidance=3.0) if has_dit else None,
            spatial_multiple=ToyConfig.vae_scale * 2,
            frame_rule=FrameRule(modulus=2, remainder=1) if has_dit else FrameRule(),
        ),
        recipe=RecipeSpec(method="base"),
        parity=ParitySpec(
            level="C1", reference="self (serial run)",
            tolerances=(ParityTolerance(name="interleaved_vs_serial", metric="bit_identical", value=0.0,
                                        justification="exact batching runs non-invariant ops per sample"),),
            # Text alone is not declared: a token that flips on a last-bit difference is no small difference.
            batched_vs_alone=(_TOY_BATCHED_VS_ALONE,) if has_dit else (),
        ),
        precision=_TOY_DIT_PRECISION if model_id == "toy-dit" else PrecisionContract(default="fp32", supported=frozenset({"fp32"})),
        checkpoint=CheckpointManifest(layout="embedded", components=ckpt),
        factory=f"{_MODULE}:build_toy_instance",
    )


def toy_cards() -> list[ModelCard]:
    return [toy_card(m) for m in ("toy-dit", "toy-lm", "toy-omni")]
