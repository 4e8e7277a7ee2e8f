"""Cosmos 3 loops: reasoner ``ar_decode``, multimodal ``diffusion_denoise``, video and sound decode.

Every per-request value lives in the loop's typed state: the reasoner's K/V block
table (its tensors live in the instance's paged pool), the prompt K/V of each
guidance branch (computed once, then reused by every denoise step), latents, sampler
histories and RNG state. Loop objects hold only their spec and the instance's
tokenizer, bound when the instance builds the loop (per instance, never per request).

The reasoner's K/V is the one thing outside a state: a state read back in another
process points at blocks that process never allocated. ``Cosmos3ARDecodeLoop.restore``
allocates fresh blocks and the loop rebuilds their contents with the very steps that
wrote them (one prefill, then one ``ar_token`` per token already generated, sampling
nothing), so the continued decode is bit-identical to an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from fv_kernel.api import (
    sampler_from_state,
    UniPCState,
    ARParams,
    Done,
    EmitSpec,
    InvalidRequest,
    KVBlockTable,
    Loop,
    LoopContext,
    LoopResult,
    LoopState,
    ModelInstance,
    Provenance,
    Request,
    ResourceRequest,
    SamplerState,
    ShapeSignature,
    StandardCFG,
    StepEstimate,
    StepResult,
    TaskType,
    TensorArtifact,
    TextArtifact,
    VideoArtifact,
    AudioArtifact,
    WorkKind,
    WorkPlan,
    apply_presence_penalty,
    bound_sampler,
    generator_from_state,
    new_generator_state,
    sample_next_token,
)
from fv_cosmos3.models.audio_vae import Cosmos3AudioDecoderConfig
from fv_cosmos3.models.config import Cosmos3Config
from fv_cosmos3.models.tokenizer import PromptSpec, build_generation_prompt
from fv_cosmos3.instance import generator_groups
from fv_wan import footprint
from fv_wan.models.vae import WanVAEConfig

__all__ = [
    "ARDecodeState",
    "Cosmos3ARDecodeLoop",
    "DenoiseState",
    "Cosmos3DenoiseLoop",
    "VideoDecodeState",
    "VideoDecodeLoop",
    "SoundDecodeState",
    "SoundDecodeLoop",
    "UPSAMPLE_SYSTEM_PROMPT",
    "upsample_params",
]

#: The rewrite instruction for prompt upsampling (ours; the reference framework's template is not public).
UPSAMPLE_SYSTEM_PROMPT = (
    "You are a helpful assistant who rewrites a short video prompt into one detailed, vivid paragraph. "
    "Answer with the rewritten prompt only."
)
PLUGIN_ID = "fv-cosmos3"


def _provenance(model: ModelInstance | None, loop_id: str, request_id: str, *, seed: int | None = None,
                partial: bool = False, model_id: str = "", weights: str = "") -> Provenance:
    return Provenance(
        model_id=model.model_id if model else model_id, loop_id=loop_id, request_id=request_id, seed=seed,
        weights_version=model.weights_version if model else weights, partial=partial,
    )


def upsample_params(request: Request, model: ModelInstance) -> ARParams:
    """The reference upsampling sampler (T 0.7, top-p 0.8, top-k 20, presence 1.5) unless the request sets ``ar``."""
    if request.ar is not None:
        return request.ar
    limit = int(model.card.components["tokenizer"].config.get("upsample_max_tokens", 512))
    return ARParams(max_tokens=limit, temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, seed=request.diffusion.seed)


# --------------------------------------------------------------------------- ar_decode


class ARDecodeState(LoopState):
    purpose: str
    prompt_ids: list[int]
    generated: list[int] = []
    #: The request's block table in the instance's paged text-KV pool (whole-life reservation).
    table: KVBlockTable
    table_ids: torch.Tensor
    prefilled: bool = False
    rng_state: torch.Tensor
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    presence_penalty: float
    stop_ids: list[int]
    finished: bool = False
    model_id: str = ""
    weights_version: str = ""
    seed: int = 0
    #: Sample in the step (graph-safe: ``fv_cosmos3.graphed_decode.sample_tokens``, one uniform per token drawn
    #: from ``rng_state``) instead of on the host; set at init from the instance, kept for the request's life.
    device_sampling: bool = False
    #: Width of the ``seen`` row a device-sampled step carries (the pool's per-sequence token limit).
    seen_width: int = 0
    #: Tokens one device-sampled step runs (a chained ``ar_token``: ``compute.decode_tokens_per_step``); set at
    #: init from the instance. The tokens are those of one-token steps at the same uniforms.
    tokens_per_step: int = 1
    #: Tokens the last step sampled that no emitted chunk carried yet: the next plan (or the ``Done``) streams them.
    unstreamed: int = 0


class Cosmos3ARDecodeLoop(Loop[ARDecodeState]):
    """The reasoner's decode loop: one prefill step, then one ``ar_token`` step per token.

    ``ctx.upstream["ar_purpose"]``: ``"upsample"`` rewrites the request's prompt with the
    upsampling instruction and the reference sampler; otherwise (``"chat"``) the prompt is
    a user turn decoded with ``request.ar``.
    """

    kind = "ar_decode"
    state_type = ARDecodeState

    def __init__(self, spec: Any) -> None:
        super().__init__(spec)
        self._tokenizer: Any = None  # the instance's tokenizer, set by bind()

    def bind(self, instance: ModelInstance) -> None:
        self._tokenizer = instance.component("tokenizer")

    def _bound_tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise RuntimeError(f"loop {self.loop_id!r} is not bound to an instance (build it with ModelInstance.loop)")
        return self._tokenizer

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> ARDecodeState:
        tokenizer = self._bound_tokenizer()
        purpose = str(ctx.upstream.get("ar_purpose", "chat"))
        # The same prompt the estimate priced, so the blocks allocated below are the blocks reserved.
        prompt_ids, params, total = _ar_sequence(request, model, purpose)
        pool = model.text_kv_pool  # type: ignore[attr-defined]
        # Whole-life reservation, the same number the admission controller priced (estimate()).
        table = pool.allocate(request.request_id, tokens=total)
        stops = {tokenizer.eos_token_id, tokenizer.token_id("<|endoftext|>"), *params.stop_token_ids}
        device_sampling = bool(getattr(model, "samples_on_device", False))
        return ARDecodeState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id, purpose=purpose,
            prompt_ids=prompt_ids, table=table, table_ids=pool.table_tensor(table).unsqueeze(0),
            rng_state=new_generator_state(params.seed), max_tokens=params.max_tokens, temperature=params.temperature,
            top_k=params.top_k, top_p=params.top_p, presence_penalty=params.presence_penalty, stop_ids=sorted(stops),
            model_id=model.model_id, weights_version=model.weights_version, seed=params.seed,
            device_sampling=device_sampling, seen_width=pool.config.max_tokens_per_sequence,
            tokens_per_step=_tokens_per_step(model) if device_sampling else 1,
        )

    def restore(self, state: ARDecodeState, model: ModelInstance, ctx: LoopContext) -> ARDecodeState:
        """Blocks in this process's pool for a state read back from bytes; the next steps refill them."""
        if state.finished:
            return state  # finalize needs the tokens only
        pool = model.text_kv_pool  # type: ignore[attr-defined]
        pool.free(state.table)  # blocks this owner still holds here (a failed attempt); foreign ones are untouched
        table = pool.allocate(state.request_id, tokens=len(state.prompt_ids) + state.max_tokens)
        # Not prefilled, length 0: next() replays the prefill and the tokens already generated.
        return state.model_copy(update={
            "table": table, "table_ids": pool.table_tensor(table).unsqueeze(0), "prefilled": False,
        })

    @staticmethod
    def _replaying(state: ARDecodeState) -> bool:
        """The pool lacks K/V of tokens already sampled (after restore): the next step rewrites it, sampling nothing."""
        if not state.prefilled:
            return bool(state.generated)
        return state.table.length < len(state.prompt_ids) + len(state.generated) - 1

    def _unstreamed_text(self, state: ARDecodeState) -> list[EmitSpec]:
        """One text chunk per token sampled since the last chunks went out (stop tokens carry no text)."""
        fresh = state.generated[len(state.generated) - state.unstreamed:] if state.unstreamed else []
        tokenizer = self._bound_tokenizer()
        return [EmitSpec(stream="text", modality="text", text=tokenizer.decode([token]))
                for token in fresh if token not in state.stop_ids]

    def next(self, state: ARDecodeState) -> WorkPlan | Done:
        if state.finished:
            return Done(emits=tuple(self._unstreamed_text(state)))
        if not state.prefilled:
            return WorkPlan(
                loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.AR_PREFILL, op="ar_prefill",
                inputs={"ids": torch.tensor([state.prompt_ids], dtype=torch.long), "table": state.table_ids},
                shape_sig=ShapeSignature.of(tokens=len(state.prompt_ids)), tag="prefill",
            )
        if self._replaying(state):
            # Exactly the ar_token step that first wrote this position: same inputs, same K/V.
            replayed = state.generated[state.table.length - len(state.prompt_ids)]
            return WorkPlan(
                loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.AR_TOKEN, op="ar_token",
                inputs={
                    "token": torch.tensor([[replayed]], dtype=torch.long), "table": state.table_ids,
                    "length": torch.tensor([state.table.length], dtype=torch.long),
                },
                shape_sig=ShapeSignature.of(tokens=1), tag="replay",
            )
        last = state.generated[-1]
        emits = self._unstreamed_text(state)
        # The context length is an input, not part of the shape signature: requests at any
        # position group into one ar_token batch.
        inputs = {
            "token": torch.tensor([[last]], dtype=torch.long), "table": state.table_ids,
            "length": torch.tensor([state.table.length], dtype=torch.long),
        }
        sig = ShapeSignature.of(tokens=1)
        if state.device_sampling:
            # Never more tokens than the request may still have: the pool holds blocks for max_tokens only.
            chain = min(state.tokens_per_step, state.max_tokens - len(state.generated))
            inputs.update(self._sampling_inputs(state, chain))
            sig = _device_sampled_sig(state.seen_width, chain)  # never fused with host sampling
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.AR_TOKEN, op="ar_token",
            inputs=inputs, shape_sig=sig, emits=emits, tag="token",
        )

    @staticmethod
    def _draws(state: ARDecodeState, count: int) -> tuple[list[float], torch.Tensor]:
        """The uniforms the next ``count`` sampled tokens are drawn at, one generator draw each in order, and the
        generator state after them (greedy: zeros, no draw)."""
        if state.temperature == 0.0:
            return [0.0] * count, state.rng_state
        generator = generator_from_state(state.rng_state)
        draws = [float(torch.rand(1, generator=generator, dtype=torch.float64)) for _ in range(count)]
        return draws, generator.get_state()

    def _sampling_inputs(self, state: ARDecodeState, chain: int = 1) -> dict[str, torch.Tensor]:
        """One row of ``fv_cosmos3.graphed_decode.SAMPLING_INPUTS``: the step samples the next token itself
        (``chain`` > 1: that many tokens, ``uniform`` (1, chain))."""
        seen = torch.full((1, state.seen_width), -1, dtype=torch.long)
        if state.presence_penalty != 0.0:
            ids = sorted(set(state.generated))
            seen[0, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        draws = self._draws(state, chain)[0]
        return {
            "temperature": torch.tensor([state.temperature], dtype=torch.float32),
            "top_k": torch.tensor([state.top_k], dtype=torch.long),
            "top_p": torch.tensor([state.top_p], dtype=torch.float32),
            "uniform": torch.tensor([draws] if chain > 1 else draws, dtype=torch.float32),
            "penalty": torch.tensor([state.presence_penalty], dtype=torch.float32),
            "seen": seen,
        }

    def advance(self, state: ARDecodeState, result: StepResult) -> ARDecodeState:
        if self._replaying(state):
            written = len(state.prompt_ids) if not state.prefilled else state.table.length + 1
            return state.model_copy(update={"prefilled": True, "table": state.table.model_copy(update={"length": written})})
        if state.device_sampling and state.prefilled:
            outputs = result.outputs
            sampled = outputs["tokens"][0].tolist() if "tokens" in outputs else [int(outputs["token"][0])]
            accepted: list[int] = []
            for token in sampled:  # up to the first stop token (what a chain sampled after it is dropped)
                accepted.append(int(token))
                if token in state.stop_ids or len(state.generated) + len(accepted) >= state.max_tokens:
                    break
            # The step sampled at the uniforms next() drew; advance the generator past the accepted ones.
            rng_state = self._draws(state, len(accepted))[1]
        else:
            logits = apply_presence_penalty(result.outputs["logits"][0], state.generated, state.presence_penalty)
            generator = generator_from_state(state.rng_state)
            accepted = [sample_next_token(logits, temperature=state.temperature, top_k=state.top_k, top_p=state.top_p,
                                          generator=generator)]
            rng_state = generator.get_state()
        # A token step wrote the K/V of each input token: the last token, then each accepted one but the newest.
        written = len(state.prompt_ids) if not state.prefilled else state.table.length + len(accepted)
        generated = [*state.generated, *accepted]
        finished = accepted[-1] in state.stop_ids or len(generated) >= state.max_tokens
        return state.model_copy(update={
            "generated": generated, "prefilled": True, "table": state.table.model_copy(update={"length": written}),
            "rng_state": rng_state, "finished": finished, "step": state.step + len(accepted),
            "unstreamed": len(accepted),
        })

    def _text(self, state: ARDecodeState) -> str:
        ids = [t for t in state.generated if t not in state.stop_ids]
        return str(self._bound_tokenizer().decode(ids)).strip()

    def finalize(self, state: ARDecodeState) -> LoopResult:
        text = self._text(state)
        name = "upsampled_prompt" if state.purpose == "upsample" else "text"
        artifact = TextArtifact(
            name=name, token_ids=list(state.generated), text=text,
            provenance=_provenance(None, self.loop_id, state.request_id, seed=state.seed, model_id=state.model_id,
                                   weights=state.weights_version),
        )
        outputs: dict[str, Any] = {"text": text, "token_ids": list(state.generated)}
        if state.purpose == "upsample":
            outputs["upsampled_prompt"] = text
        return LoopResult(loop_id=self.loop_id, outputs=outputs, artifacts=[artifact])

    def progress(self, state: ARDecodeState) -> tuple[int, int | None]:
        return state.step, state.max_tokens

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        """The prompt's exact token count (the instance's tokenizer, as init() builds it) plus ``max_tokens``:
        that many blocks of the text-KV pool, one prefill step and a token step per further token."""
        purpose = "chat" if request.task is TaskType.TEXT_GENERATION else "upsample"
        prompt_ids, params, total = _ar_sequence(request, model, purpose)
        pool = model.text_kv_pool  # type: ignore[attr-defined]
        config = Cosmos3Config(**model.card.components["transformer"].config)
        e = footprint.element_bytes(model.precision)
        # A token step gathers the sequence's K/V out of the pool into one padded tensor per layer.
        gathered = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * total * e
        prefill = len(prompt_ids) * (_token_activation_bytes(config, e) + config.vocab_size * 4)
        steps = [StepEstimate(loop_id=self.loop_id, kind=WorkKind.AR_PREFILL, shape_sig=ShapeSignature.of(tokens=len(prompt_ids)))]
        if params.max_tokens > 1:
            if getattr(model, "samples_on_device", False):
                # As next() plans them: full chains of tokens_per_step, then the rest in one shorter chain.
                per_step = _tokens_per_step(model)
                full, rest = divmod(params.max_tokens - 1, per_step)
                width = pool.config.max_tokens_per_sequence
                for chain, count in ((per_step, full), (rest, 1)):
                    if chain and count:
                        steps.append(StepEstimate(loop_id=self.loop_id, kind=WorkKind.AR_TOKEN,
                                                  shape_sig=_device_sampled_sig(width, chain), count=count))
            else:
                steps.append(StepEstimate(loop_id=self.loop_id, kind=WorkKind.AR_TOKEN,
                                          shape_sig=ShapeSignature.of(tokens=1), count=params.max_tokens - 1))
        return ResourceRequest(
            steps=tuple(steps), pool_blocks={"text_kv": pool.blocks_for(total)},
            peak_bytes=max(prefill, gathered + _token_activation_bytes(config, e)),
        )


def _tokens_per_step(model: ModelInstance) -> int:
    """Tokens a device-sampled decode step of ``model`` runs (its ``decode_tokens_per_step``; 1 without one)."""
    return max(1, int(getattr(model, "decode_tokens_per_step", 1)))


def _device_sampled_sig(seen_width: int, chain: int) -> ShapeSignature:
    """A device-sampled token step's signature; a chain of ``chain`` > 1 tokens is priced ``repeat`` times one."""
    if chain == 1:
        return ShapeSignature.of(tokens=1, sampler="device", seen=seen_width)
    return ShapeSignature.of(tokens=1, sampler="device", seen=seen_width, repeat=chain)


def _ar_sequence(request: Request, model: ModelInstance, purpose: str) -> tuple[list[int], ARParams, int]:
    """The reasoner's prompt ids, sampling parameters and whole-sequence token count for ``purpose``:
    what the decode loop's init allocates and its estimate reserves. Refuses a sequence longer
    than the reasoner's context, naming ``max_tokens``."""
    text = request.text("prompt") or ""
    if purpose == "upsample":
        messages = [{"role": "system", "content": UPSAMPLE_SYSTEM_PROMPT}, {"role": "user", "content": text}]
        params = upsample_params(request, model)
    else:
        system = request.text("system")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        params = request.ar or ARParams()
    prompt_ids = model.component("tokenizer").chat_ids(messages)
    total = len(prompt_ids) + params.max_tokens
    context = model.text_kv_pool.config.max_tokens_per_sequence  # type: ignore[attr-defined]
    if total > context:
        raise InvalidRequest(
            "max_tokens", f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"reasoner's {context}-token context",
            allowed=f"<= {context - len(prompt_ids)}",
        )
    return prompt_ids, params, total


def _token_activation_bytes(config: Cosmos3Config, element: int) -> int:
    """Transient bytes per token of one tower layer: the stream (fp32 residual copy too), its norm, q, k, v,
    the attention output and its projection, and the gated MLP's gate, up and product."""
    d, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    return element * (5 * d + heads * config.head_dim + 2 * kv * config.head_dim + 3 * config.intermediate_size) + 4 * d


# --------------------------------------------------------------------------- diffusion_denoise

Mode = str  # "t2v" | "t2i" | "i2v" | "t2v_sound" | "action_policy" | "forward_dynamics" | "inverse_dynamics"

_TASK_MODE = MappingProxyType({
    TaskType.TEXT_TO_VIDEO: "t2v", TaskType.TEXT_TO_IMAGE: "t2i", TaskType.IMAGE_TO_VIDEO: "i2v",
    TaskType.TEXT_TO_VIDEO_AUDIO: "t2v_sound", TaskType.ACTION_POLICY: "action_policy",
    TaskType.FORWARD_DYNAMICS: "forward_dynamics", TaskType.INVERSE_DYNAMICS: "inverse_dynamics",
})
_ACTION_MODES = ("action_policy", "forward_dynamics", "inverse_dynamics")


def _denoise_mode(request: Request) -> Mode:
    mode = _TASK_MODE.get(request.task)
    if mode is None:
        raise InvalidRequest("task", f"{request.task.value!r} has no denoise mode", allowed=sorted(m.value for m in _TASK_MODE))
    return mode


def _sound_latent_frames(frames: int, fps: float, config: Cosmos3AudioDecoderConfig) -> int:
    """Sound latent frames for ``frames`` video frames at ``fps``: the clip's samples over the decoder's hop, rounded up."""
    return -(-int(frames / fps * config.sampling_rate) // config.hop)


@dataclass(frozen=True)
class _DenoiseGeometry:
    """What one request's denoise generates: the one derivation ``init`` allocates and every estimate prices."""

    mode: Mode
    #: Pixel frames: the request's, or derived from the action (forward dynamics) or video (inverse dynamics) part.
    frames: int
    #: Action steps generated alongside the video (the action modes), else 0.
    action_len: int
    latent_t: int
    latent_h: int
    latent_w: int
    #: Sound latent frames (``t2v_sound``), else 0.
    sound: int


def _denoise_geometry(request: Request, model: ModelInstance) -> _DenoiseGeometry:
    """The request's denoise geometry from the card's transformer, VAE and sound decoder configs."""
    d = request.diffusion
    assert d.height and d.width and d.frames and d.fps
    mode = _denoise_mode(request)
    config = Cosmos3Config(**model.card.components["transformer"].config)
    spatial = WanVAEConfig(**model.card.components["vae"].config).spatial_compression
    frames, action_len = d.frames, 0
    if mode == "forward_dynamics":
        action_len = int(request.part("action").actions.shape[0])
        frames = action_len + 1
    elif mode == "inverse_dynamics":
        frames = int(request.part("video").frames.shape[0])
        action_len = frames - 1
    elif mode == "action_policy":
        action_len = frames - 1
    sound = 0
    if mode == "t2v_sound":
        sound = _sound_latent_frames(frames, d.fps, Cosmos3AudioDecoderConfig(**model.card.components["sound_decoder"].config))
    return _DenoiseGeometry(
        mode=mode, frames=frames, action_len=action_len, latent_t=(frames - 1) // config.vae_temporal_compression + 1,
        latent_h=d.height // spatial, latent_w=d.width // spatial, sound=sound,
    )


def _branch_prompt_ids(request: Request, model: ModelInstance, geometry: _DenoiseGeometry, branches: list[str],
                       prompt: str) -> dict[str, list[int]]:
    """The generator's prompt ids per guidance branch: ``prompt`` for ``cond``, the negative prompt for ``uncond``."""
    d = request.diffusion
    assert d.height and d.width and d.fps
    tokenizer = model.component("tokenizer")
    spec = PromptSpec(num_frames=geometry.frames, height=d.height, width=d.width, fps=d.fps)
    ids = {"cond": build_generation_prompt(prompt, tokenizer, spec)}
    if "uncond" in branches:
        ids["uncond"] = build_generation_prompt(request.text("negative_prompt") or "", tokenizer, spec, negative=True)
    return ids


class DenoiseState(LoopState):
    mode: str
    branches: list[str]
    prompt_ids: dict[str, list[int]]
    #: Per guidance branch, the prompt's per-layer K/V (L, H, T, D): computed once, reused every step.
    text_keys: dict[str, torch.Tensor] = {}
    text_values: dict[str, torch.Tensor] = {}
    #: Pixel-space conditioning (1, 3, F, H, W) in [-1, 1] still to be VAE-encoded (I2V / action modes).
    condition_pixels: torch.Tensor | None = None
    video: torch.Tensor
    video_x0: torch.Tensor | None = None
    video_clean: list[int] = []
    sound: torch.Tensor | None = None
    action: torch.Tensor | None = None
    action_x0: torch.Tensor | None = None
    action_clean: list[int] = []
    action_domain: int | None = None
    raw_action_dim: int | None = None
    video_sampler: UniPCState | SamplerState
    sound_sampler: UniPCState | SamplerState | None = None
    action_sampler: UniPCState | SamplerState | None = None
    guidance: float
    fps: float
    rng_state: torch.Tensor
    total_steps: int
    seed: int = 0


def _unpadded(config: Cosmos3Config, actions: torch.Tensor) -> torch.Tensor:
    dim = config.action_dim or actions.shape[1]
    if actions.shape[1] > dim:
        raise InvalidRequest("action", f"actions have {actions.shape[1]} dims; the model takes at most {dim}", allowed=f"<= {dim}")
    return torch.cat([actions.float(), torch.zeros(actions.shape[0], dim - actions.shape[1])], dim=1)


class Cosmos3DenoiseLoop(Loop[DenoiseState]):
    """Joint rectified-flow denoising of video (+ sound, + action) on the generator tower.

    Steps: optionally one ``vae_encode`` (conditioning frames), one ``text_kv`` per guidance
    branch, then one ``generate`` per sampler step. Guidance is applied to every stream in
    velocity space; clean (conditioning) frames get zero velocity from the model and are
    re-injected after each step.
    """

    kind = "diffusion_denoise"
    state_type = DenoiseState

    @staticmethod
    def _policy() -> StandardCFG:
        return StandardCFG(active_when="not_one")  # Cosmos 3 skips the uncond pass only at exactly 1.0

    def _branches(self, request: Request) -> tuple[float, list[str]]:
        """The request's guidance scale and the guidance branches it runs."""
        guidance = float(request.diffusion.guidance or 0.0)
        return guidance, list(self._policy().branches(guidance))

    def _total_steps(self, request: Request) -> int:
        """Sampler steps: the binding's fixed count, else the request's."""
        binding = self.spec.sampler
        assert binding is not None and request.diffusion.steps is not None
        return binding.fixed_steps or request.diffusion.steps

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> DenoiseState:
        d = request.diffusion
        assert d.height and d.width and d.frames and d.steps is not None and d.fps
        mode = _denoise_mode(request)
        config: Cosmos3Config = Cosmos3Config(**model.card.components["transformer"].config)
        t_comp = config.vae_temporal_compression
        params = request.plugin_params.get(PLUGIN_ID, {})
        if mode in _ACTION_MODES and not config.action_gen:
            raise InvalidRequest("task", f"card {model.model_id!r} was not trained with actions")
        geometry = _denoise_geometry(request, model)
        frames, height, width, action_len = geometry.frames, d.height, d.width, geometry.action_len
        actions: torch.Tensor | None = None
        condition_pixels: torch.Tensor | None = None
        video_clean: list[int] = []
        action_clean: list[int] = []
        raw_action_dim: int | None = None
        if mode in _ACTION_MODES:
            if mode == "forward_dynamics":
                part = request.part("action")
                actions = _unpadded(config, part.actions)
                raw_action_dim = int(part.actions.shape[1])
                action_clean = list(range(action_len))
            if (frames - 1) % t_comp:
                raise InvalidRequest("frames", f"action modes need 1 + {t_comp}k frames, got {frames}", allowed=f"{t_comp}k+1")
            raw_action_dim = raw_action_dim or int(params.get("raw_action_dim", config.action_dim or 0)) or None
        shape = (1, config.latent_channel, geometry.latent_t, geometry.latent_h, geometry.latent_w)

        if mode in ("i2v", "action_policy", "forward_dynamics"):
            image = request.part("image").image.float()
            if tuple(image.shape[-2:]) != (height, width):
                image = torch.nn.functional.interpolate(image[None], size=(height, width), mode="bilinear", align_corners=False)[0]
            condition_pixels = (image * 2 - 1)[None, :, None].expand(1, 3, frames, height, width).contiguous()
            video_clean = [0]
        elif mode == "inverse_dynamics":
            clip = request.part("video").frames.float()  # (F, 3, H, W)
            if tuple(clip.shape[-2:]) != (height, width):
                clip = torch.nn.functional.interpolate(clip, size=(height, width), mode="bilinear", align_corners=False)
            condition_pixels = (clip * 2 - 1).permute(1, 0, 2, 3)[None].contiguous()
            video_clean = list(range(geometry.latent_t))

        # Noise in the reference pipeline's order: video, then sound, then action, from one generator.
        generator = torch.Generator().manual_seed(d.seed)
        video = torch.randn(shape, generator=generator, dtype=torch.float32)
        sound = None
        if mode == "t2v_sound":
            sound = torch.randn((config.sound_dim or 0, geometry.sound), generator=generator, dtype=torch.float32)
        action = None
        if action_len:
            action = torch.randn((action_len, config.action_dim or 0), generator=generator, dtype=torch.float32)
            if actions is not None:
                action[action_clean] = actions[action_clean]
            if raw_action_dim is not None:
                action[:, raw_action_dim:] = 0
        action_domain = None
        if action_len:
            part = request.part("action")
            action_domain = int(part.domain) if part is not None else int(params.get("action_domain", 0))

        prompt = ctx.upstream.get("upsampled_prompt") or request.text("prompt") or ""
        guidance, branches = self._branches(request)
        prompt_ids = _branch_prompt_ids(request, model, geometry, branches, prompt)

        binding = self.spec.sampler
        assert binding is not None
        # Resolved through the deployment's registry: a request may name a plugin's sampler.
        sampler = bound_sampler(binding, requested=d.sampler, shift=d.shift)
        steps = self._total_steps(request)
        return DenoiseState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id, mode=mode,
            branches=branches, prompt_ids=prompt_ids, condition_pixels=condition_pixels, video=video,
            video_clean=video_clean, sound=sound, action=action, action_x0=actions, action_clean=action_clean,
            action_domain=action_domain, raw_action_dim=raw_action_dim,
            video_sampler=sampler.init_state(steps), sound_sampler=sampler.init_state(steps) if sound is not None else None,
            action_sampler=sampler.init_state(steps) if action is not None else None,
            guidance=guidance, fps=float(d.fps), rng_state=generator.get_state(), total_steps=steps, seed=d.seed,
        )

    def next(self, state: DenoiseState) -> WorkPlan | Done:
        base = dict(loop_id=self.loop_id, instance_id=state.instance_id)
        if state.condition_pixels is not None:
            pixels = state.condition_pixels
            return WorkPlan(**base, kind=WorkKind.ENCODER_CHUNK, op="vae_encode", inputs={"video": pixels},
                            shape_sig=ShapeSignature.of(frames=pixels.shape[2], height=pixels.shape[3], width=pixels.shape[4]),
                            batchable=False, tag="condition")
        for branch in state.branches:
            if branch not in state.text_keys:
                ids = state.prompt_ids[branch]
                return WorkPlan(**base, kind=WorkKind.ENCODER_CHUNK, op="text_kv",
                                inputs={"ids": torch.tensor([ids], dtype=torch.long)},
                                shape_sig=ShapeSignature.of(tokens=len(ids)), tag=f"text_kv:{branch}")
        sampler = sampler_from_state(state.video_sampler)
        if sampler.is_done(state.video_sampler):
            return Done()
        inputs: dict[str, torch.Tensor] = {"video": state.video, "timestep": sampler.timestep(state.video_sampler).float().reshape(1)}
        for branch in state.branches:
            inputs[f"k_{branch}"] = state.text_keys[branch].unsqueeze(0)
            inputs[f"v_{branch}"] = state.text_values[branch].unsqueeze(0)
        if state.sound is not None:
            inputs["sound"] = state.sound.unsqueeze(0)
        if state.action is not None:
            inputs["action"] = state.action.unsqueeze(0)
        frames = state.video.shape[2]
        params: dict[str, Any] = {
            "branches": tuple(state.branches), "fps": state.fps,
            "video_noisy": tuple(i for i in range(frames) if i not in state.video_clean),
        }
        if state.action is not None:
            params["action_noisy"] = tuple(i for i in range(state.action.shape[0]) if i not in state.action_clean)
            params["action_domain"] = state.action_domain
        _, _, t, h, w = state.video.shape
        sig = ShapeSignature.of(
            tokens=int(t * h * w), frames=int(t), height=int(h), width=int(w), mode=state.mode,
            text=",".join(str(len(state.prompt_ids[b])) for b in state.branches),
            sound=0 if state.sound is None else int(state.sound.shape[1]),
            action=0 if state.action is None else int(state.action.shape[0]),
        )
        return WorkPlan(**base, kind=WorkKind.DIFFUSION_STEP, op="generate", inputs=inputs, params=params,
                        shape_sig=sig, tag="+".join(state.branches))

    def _combine(self, state: DenoiseState, stacked: torch.Tensor) -> torch.Tensor:
        outputs = dict(zip(state.branches, stacked.unbind(0)))
        return self._policy().combine(outputs, state.guidance, step_index=state.step)

    def advance(self, state: DenoiseState, result: StepResult) -> DenoiseState:
        if state.condition_pixels is not None:
            x0 = result.outputs["latents"].to(state.video.device)
            mask = torch.zeros(x0.shape[2], dtype=torch.bool)
            mask[state.video_clean] = True
            video = torch.where(mask.view(1, 1, -1, 1, 1), x0, state.video)
            return state.model_copy(update={"condition_pixels": None, "video_x0": x0, "video": video, "step": state.step})
        for branch in state.branches:
            if branch not in state.text_keys:
                return state.model_copy(update={
                    "text_keys": {**state.text_keys, branch: result.outputs["keys"][0]},
                    "text_values": {**state.text_values, branch: result.outputs["values"][0]},
                })
        # The state's latents stay on the host; the step's velocities come back from the device.
        out = {name: tensor.to(state.video.device) for name, tensor in result.outputs.items()}
        sampler = sampler_from_state(state.video_sampler)
        video_sampler, video = sampler.step(state.video_sampler, self._combine(state, out["v_video"][0]).unsqueeze(0), state.video)
        if state.video_x0 is not None and state.video_clean:
            # Re-inject the clean conditioning frames (they must not drift through the solver).
            video = video.clone()
            video[:, :, state.video_clean] = state.video_x0[:, :, state.video_clean]
        update: dict[str, Any] = {"video": video, "video_sampler": video_sampler, "step": state.step + 1}
        if state.sound is not None and state.sound_sampler is not None:
            update["sound_sampler"], sound = sampler.step(
                state.sound_sampler, self._combine(state, out["v_sound"][0]).unsqueeze(0), state.sound.unsqueeze(0)
            )
            update["sound"] = sound[0]
        if state.action is not None and state.action_sampler is not None:
            if len(state.action_clean) < state.action.shape[0]:
                v_action = self._combine(state, out["v_action"][0])
                if state.raw_action_dim is not None:
                    v_action[:, state.raw_action_dim :] = 0
                update["action_sampler"], action = sampler.step(state.action_sampler, v_action.unsqueeze(0),
                                                                state.action.unsqueeze(0))
                action = action[0].clone()
                if state.action_x0 is not None and state.action_clean:
                    action[state.action_clean] = state.action_x0[state.action_clean]
                if state.raw_action_dim is not None:
                    action[:, state.raw_action_dim :] = 0
                update["action"] = action
        return state.model_copy(update=update)

    def finalize(self, state: DenoiseState) -> LoopResult:
        outputs: dict[str, Any] = {"latents": state.video, "fps": state.fps}
        artifacts: list[Any] = []
        if state.sound is not None:
            outputs["sound_latents"] = state.sound
        if state.action is not None and state.mode in ("action_policy", "inverse_dynamics"):
            action = state.action if state.raw_action_dim is None else state.action[:, : state.raw_action_dim]
            artifacts.append(TensorArtifact(
                name="action", tensor=action.clone(),
                provenance=_provenance(None, self.loop_id, state.request_id, seed=state.seed),
            ))
        return LoopResult(loop_id=self.loop_id, outputs=outputs, artifacts=artifacts)

    def progress(self, state: DenoiseState) -> tuple[int, int | None]:
        return state.step, state.total_steps

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        """The steps init() and next() will plan: the conditioning encode, one ``text_kv`` per guidance branch,
        one ``generate`` per sampler step, signed as next() signs them. With prompt upsampling the prompt is
        not known yet: its length is bounded by the template plus the upsampling budget."""
        d = request.diffusion
        assert d.height and d.width and d.frames and d.steps is not None and d.fps
        geometry = _denoise_geometry(request, model)
        mode, frames, height, width = geometry.mode, geometry.frames, d.height, d.width
        latent_t, lat_h, lat_w = geometry.latent_t, geometry.latent_h, geometry.latent_w
        sound, action_len = geometry.sound, geometry.action_len
        config = Cosmos3Config(**model.card.components["transformer"].config)
        vae = WanVAEConfig(**model.card.components["vae"].config)
        _, branches = self._branches(request)
        prompt = "" if request.prompt_upsampling else request.text("prompt") or ""
        lengths = {branch: len(ids) for branch, ids in _branch_prompt_ids(request, model, geometry, branches, prompt).items()}
        if request.prompt_upsampling:
            lengths["cond"] += upsample_params(request, model).max_tokens
        steps = self._total_steps(request)
        e = footprint.element_bytes(model.precision)

        plans: list[StepEstimate] = []
        peaks: list[int] = []
        if mode == "i2v" or mode in _ACTION_MODES:
            plans.append(StepEstimate(loop_id=self.loop_id, kind=WorkKind.ENCODER_CHUNK,
                                      shape_sig=ShapeSignature.of(frames=frames, height=height, width=width)))
            peaks.append(3 * frames * height * width * (4 + e)
                         + footprint.vae_encode_peak_bytes(vae, height, width, frames=frames, element=e))
        for branch in branches:
            plans.append(StepEstimate(loop_id=self.loop_id, kind=WorkKind.ENCODER_CHUNK,
                                      shape_sig=ShapeSignature.of(tokens=lengths[branch])))
        peaks.append(max(lengths.values()) * _token_activation_bytes(config, e))
        plans.append(StepEstimate(
            loop_id=self.loop_id, kind=WorkKind.DIFFUSION_STEP, count=steps,
            shape_sig=ShapeSignature.of(
                tokens=latent_t * lat_h * lat_w, frames=latent_t, height=lat_h, width=lat_w, mode=mode,
                text=",".join(str(lengths[b]) for b in branches), sound=sound, action=action_len),
        ))
        # The generator runs the guidance branches whose prompts have one length as one call (generator_groups)
        # over the patched video tokens (+ sound, action); an upsampled prompt's length is not known yet, so it
        # may equal the negative prompt's.
        together = len(branches) if request.prompt_upsampling else max(len(g) for g in generator_groups(tuple(branches), lengths))
        patch = config.latent_patch_size
        generated = latent_t * (lat_h // patch) * (lat_w // patch) + sound + action_len
        latent_bytes = 4 * (config.latent_channel * latent_t * lat_h * lat_w + (config.sound_dim or 0) * sound
                            + (config.action_dim or 0) * action_len)
        peaks.append(together * generated * _token_activation_bytes(config, e) + 2 * len(branches) * latent_bytes)
        # Per branch, the prompt's K/V over every layer, kept for every step; the latents and their solver history.
        text_kv = sum(2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * n * e
                      for n in lengths.values())
        return ResourceRequest(steps=tuple(plans), resident_bytes=text_kv + 5 * latent_bytes, peak_bytes=max(peaks))


# --------------------------------------------------------------------------- decoders (fan-out)


class VideoDecodeState(LoopState):
    latents: torch.Tensor
    fps: float
    frames: torch.Tensor | None = None
    model_id: str = ""
    weights_version: str = ""


class VideoDecodeLoop(Loop[VideoDecodeState]):
    """One Wan 2.2 VAE decode of the denoised latents into a video artifact."""

    kind = "vae_decode"
    state_type = VideoDecodeState

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> VideoDecodeState:
        return VideoDecodeState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id,
            latents=ctx.upstream["latents"], fps=float(ctx.upstream["fps"]), model_id=model.model_id,
            weights_version=model.weights_version,
        )

    def next(self, state: VideoDecodeState) -> WorkPlan | Done:
        if state.frames is not None:
            return Done()
        z = state.latents
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.VAE_TILE, op="vae_decode",
            inputs={"latents": z}, shape_sig=ShapeSignature.of(frames=z.shape[2], height=z.shape[3], width=z.shape[4]),
            batchable=False,
        )

    def advance(self, state: VideoDecodeState, result: StepResult) -> VideoDecodeState:
        return state.model_copy(update={"frames": result.outputs["frames"][0], "step": state.step + 1})

    def finalize(self, state: VideoDecodeState) -> LoopResult:
        assert state.frames is not None
        artifact = VideoArtifact(
            frames=state.frames, fps=state.fps,
            provenance=_provenance(None, self.loop_id, state.request_id, model_id=state.model_id, weights=state.weights_version),
        )
        return LoopResult(loop_id=self.loop_id, artifacts=[artifact])

    def progress(self, state: VideoDecodeState) -> tuple[int, int | None]:
        return state.step, 1

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        """One whole-video decode: the VAE's per-frame activations and causal history, the video it fills
        in the VAE's dtype and its fp32 [0, 1] copies; the fp32 frames stay until the artifact is made."""
        d = request.diffusion
        assert d.height and d.width and d.frames
        vae = WanVAEConfig(**model.card.components["vae"].config)
        geometry = _denoise_geometry(request, model)  # the latents the denoise loop hands over
        latent_t, h, w = geometry.latent_t, geometry.latent_h, geometry.latent_w
        e = footprint.element_bytes(model.precision)
        step = footprint.vae_decode_step(vae, h, w, element=e)
        video = 3 * (1 + vae.temporal_compression * (latent_t - 1)) * d.height * d.width
        return ResourceRequest(
            steps=(StepEstimate(loop_id=self.loop_id, kind=WorkKind.VAE_TILE,
                                shape_sig=ShapeSignature.of(frames=latent_t, height=h, width=w)),),
            resident_bytes=4 * video, peak_bytes=step.activation_bytes + step.cache_bytes + video * (e + 3 * 4),
        )


class SoundDecodeState(LoopState):
    latents: torch.Tensor
    sample_rate: int
    samples: torch.Tensor | None = None
    model_id: str = ""


class SoundDecodeLoop(Loop[SoundDecodeState]):
    """The AVAE sound decoder: denoised sound latents -> an ``AudioArtifact`` with its sample rate."""

    kind = "audio_decode"
    state_type = SoundDecodeState

    def init(self, request: Request, model: ModelInstance, ctx: LoopContext) -> SoundDecodeState:
        rate = int(model.card.components["sound_decoder"].config["sampling_rate"])
        return SoundDecodeState(
            request_id=request.request_id, loop_id=self.loop_id, instance_id=model.instance_id,
            latents=ctx.upstream["sound_latents"], sample_rate=rate, model_id=model.model_id,
        )

    def next(self, state: SoundDecodeState) -> WorkPlan | Done:
        if state.samples is not None:
            return Done()
        return WorkPlan(
            loop_id=self.loop_id, instance_id=state.instance_id, kind=WorkKind.AUDIO_CHUNK, op="sound_decode",
            inputs={"latents": state.latents.unsqueeze(0)}, shape_sig=ShapeSignature.of(frames=state.latents.shape[1]),
            batchable=False,
        )

    def advance(self, state: SoundDecodeState, result: StepResult) -> SoundDecodeState:
        return state.model_copy(update={"samples": result.outputs["samples"][0], "step": state.step + 1})

    def finalize(self, state: SoundDecodeState) -> LoopResult:
        assert state.samples is not None
        artifact = AudioArtifact(
            samples=state.samples, sample_rate=state.sample_rate,
            provenance=_provenance(None, self.loop_id, state.request_id, model_id=state.model_id),
        )
        return LoopResult(loop_id=self.loop_id, artifacts=[artifact])

    def progress(self, state: SoundDecodeState) -> tuple[int, int | None]:
        return state.step, 1

    def estimate(self, request: Request, model: ModelInstance) -> ResourceRequest:
        """One decode of the sound latents; its largest stage holds about five tensors of its channels x length."""
        d = request.diffusion
        assert d.frames and d.fps
        config = Cosmos3AudioDecoderConfig(**model.card.components["sound_decoder"].config)
        latent_frames = _sound_latent_frames(d.frames, d.fps, config)  # what the denoise loop's init draws
        e = footprint.element_bytes(model.precision)
        mults = (1, *config.dec_c_mults)
        length = latent_frames
        peak, n = 5 * config.dec_dim * mults[-1] * length, len(config.dec_strides)
        for i, stride in enumerate(reversed(config.dec_strides)):
            length *= stride
            peak = max(peak, 5 * config.dec_dim * mults[n - i - 1] * length)
        return ResourceRequest(
            steps=(StepEstimate(loop_id=self.loop_id, kind=WorkKind.AUDIO_CHUNK, shape_sig=ShapeSignature.of(frames=latent_frames)),),
            resident_bytes=4 * config.dec_out_channels * length, peak_bytes=e * peak,
        )
