"""The Model Plane's specs (design §4): one place, pydantic, strict.

A :class:`ModelCard` is a (recipe, runtime) pair: it owns its components, the loops
it can run, the recipe that produced its weights and a parity contract. It is
validated before any weights or GPU are touched, and it is the factory of a
resident :class:`~fv_kernel.model.instance.ModelInstance`.

Code is referenced by lazy ``"module:attr"`` strings, so validating a card imports
nothing heavy.
"""

from __future__ import annotations

import math
import re
from enum import Enum
from types import MappingProxyType
from typing import Any, Callable, Literal, Sequence, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fv_kernel.request.request import AdapterRef, ArtifactKind
from fv_kernel.request.types import PRECISIONS, Precision, TaskType

__all__ = [
    "AdapterRef",
    "ImportString",
    "ParityLevel",
    "BatchedVsAlone",
    "PrecisionPolicy",
    "ComponentSpec",
    "KeyMapRule",
    "ComponentCheckpoint",
    "CheckpointManifest",
    "StepCostSpec",
    "SamplerBinding",
    "LoopSpec",
    "ProgramSpec",
    "AttentionAssumption",
    "TextVocabulary",
    "TrainedEnvelope",
    "RecipeSpec",
    "QuantizedFrom",
    "ParityTolerance",
    "ParitySpec",
    "ComputeTierName",
    "TierParityContract",
    "TierComponent",
    "TIER_COMPONENTS",
    "TierParityMeasurement",
    "TierParityRecord",
    "TierParitySample",
    "TierSampleStatistics",
    "TierVerdict",
    "t_quantile_95",
    "TIER_PARITY_CONTRACTS",
    "PrecisionPath",
    "PrecisionPathChoice",
    "PRECISION_PATHS",
    "FP8_LINEAR_PATHS",
    "FP8_ATTENTION_PATHS",
    "PrecisionPathContract",
    "PrecisionPathMeasurement",
    "PrecisionPathSample",
    "IDENTICAL_CLIP_PSNR_DB",
    "PrecisionPathVerdict",
    "CacheContract",
    "ParallelismContract",
    "PrecisionContract",
    "FrameRule",
    "TokenGridRule",
    "GenerationDefaults",
    "CapabilityMatrix",
    "ModelCard",
    "PARALLEL_AXES",
]

_IMPORT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_LOOP_NAME_RE = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: What of a denoiser runs in fp8 (docs/precision.md). ``native``: nothing (the instance's precision);
#: ``fp8_weights``: the card's ``fp8_targets`` linears hold e4m3 weights (per-channel scales),
#: activations native; ``fp8_dynamic``: those linears also quantize each activation row;
#: ``fp8_attention``: attention through the ``"fp8"`` attention driver, linears native;
#: ``fp8_all``: ``fp8_dynamic`` and ``fp8_attention``.
PrecisionPath = Literal["native", "fp8_weights", "fp8_dynamic", "fp8_attention", "fp8_all"]
#: A deployment's ask: a path, or ``auto`` (the fastest listed path whose measurement passes its contract).
PrecisionPathChoice = Literal["native", "fp8_weights", "fp8_dynamic", "fp8_attention", "fp8_all", "auto"]
PRECISION_PATHS: tuple[str, ...] = get_args(PrecisionPath)
#: Paths whose target linears are ``Fp8Linear`` s, with the ``Fp8Linear`` mode they run.
FP8_LINEAR_PATHS: "MappingProxyType[str, str]" = MappingProxyType(
    {"fp8_weights": "fp8_weights", "fp8_dynamic": "fp8_dynamic", "fp8_all": "fp8_dynamic"})
#: Paths whose attention runs through the ``"fp8"`` attention driver.
FP8_ATTENTION_PATHS: frozenset[str] = frozenset({"fp8_attention", "fp8_all"})


def ImportString(value: str) -> str:  # noqa: N802 - used as a validator, reads as a type
    if not _IMPORT_RE.match(value):
        raise ValueError(f"{value!r} is not a 'package.module:attribute' reference")
    return value


class ParityLevel(str, Enum):
    """The consistency ladder (design §9.2)."""

    C0 = "C0"  # component parity
    C1 = "C1"  # loop parity (full trajectory, fixed seed)
    C2 = "C2"  # behavioural identity between train and serve forwards
    C3 = "C3"  # distribution parity
    C4 = "C4"  # artifact quality

    @property
    def rank(self) -> int:
        """Position on the ladder: C0 is 0, C4 is 4 (a higher rung is a stronger guarantee)."""
        return int(self.value[1:])


class PrecisionPolicy(_Spec):
    """How a component's weights are held: ``dtype`` except the modules kept in fp32."""

    dtype: Precision | Literal["card"] = "card"
    keep_fp32_modules: tuple[str, ...] = ()


class ComponentSpec(_Spec):
    """One component of a card: a DiT, a VAE, an encoder, a tokenizer, a reasoner tower..."""

    component_id: str
    kind: Literal[
        "dit", "vae", "text_encoder", "image_encoder", "tokenizer", "reasoner_tower", "audio_decoder", "reward_head",
        "transformer",
    ]
    #: Builds the module from (config, precision): ``"module:function"``.
    builder: str
    #: The component's config, as its builder takes it (e.g. diffusers ``config.json`` keys).
    config: dict[str, Any] = Field(default_factory=dict)
    #: How ``config`` parses: ``"module:attr"`` of a pydantic model or a function taking the dict.
    #: ``fv cards validate`` (``fv_kernel.model.buildcheck``) and the family's loaders both parse
    #: through it, so a config that validates is the config that loads. None: not checked up front.
    config_schema: str | None = None
    precision_policy: PrecisionPolicy = PrecisionPolicy()
    #: Parity tests that cover this component (test node ids).
    parity_tests: tuple[str, ...] = ()
    #: How many weight elements (parameters and buffers) the built component holds: a count, or a
    #: ``"module:function"`` taking this ComponentSpec and returning the count (e.g. the module built
    #: on the meta device). The pre-flight (``fv_kernel.model.preflight``) charges them at the
    #: component's dtype before anything is built. None: unknown (not counted); 0: no weights.
    parameters: int | str | None = None

    @field_validator("builder")
    @classmethod
    def _check_builder(cls, value: str) -> str:
        return ImportString(value)

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 0:
            raise ValueError(f"parameters must be >= 0, got {value}")
        return ImportString(value) if isinstance(value, str) else value

    @field_validator("config_schema")
    @classmethod
    def _check_config_schema(cls, value: str | None) -> str | None:
        return None if value is None else ImportString(value)


class KeyMapRule(_Spec):
    """A declared rename from a checkpoint layout's key to the module's key (regex, applied in order)."""

    pattern: str
    replacement: str

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"key map pattern {value!r} is not a valid regex: {exc}") from None
        return value


class ComponentCheckpoint(_Spec):
    """Where a component's weights live and which tasks need them."""

    #: Folder inside the checkpoint (diffusers layout: "transformer", "vae", ...).
    subfolder: str = ""
    #: Tasks that cannot run without this component.
    required_for: frozenset[TaskType] = frozenset()
    #: Tasks that use it when present.
    optional_for: frozenset[TaskType] = frozenset()
    #: Renames for non-native layouts, keyed by layout name ("original", ...).
    key_maps: dict[str, tuple[KeyMapRule, ...]] = Field(default_factory=dict)
    #: Seeded random weights instead of a file (embedded tiny cards).
    random_init_seed: int | None = None
    #: The family's loader can read this component from one ``.safetensors`` file with the card's own
    #: config: a deployment may name one (``component_sources``; ComfyUI's ``diffusion_models`` files).
    single_file: bool = False


class CheckpointManifest(_Spec):
    """Explicit components and layouts: no name-detector guessing (design §4.1)."""

    layout: Literal["diffusers", "original", "embedded"] = "diffusers"
    #: Default source: a Hugging Face repo id or a local path; None for embedded cards.
    source: str | None = None
    components: dict[str, ComponentCheckpoint]

    def components_for(self, task: TaskType) -> list[str]:
        """Components a task loads: the required ones plus the optional ones it can use."""
        return [
            name
            for name, comp in self.components.items()
            if task in comp.required_for or task in comp.optional_for
        ]


class StepCostSpec(_Spec):
    """Predicted GPU-seconds of one step as a function of shape and precision (design §6.1).

    ``seconds = fixed + per_unit·u + per_unit_sq·u²`` with ``u`` the shape signature's
    ``unit`` dimension (e.g. tokens), times the precision factor, per batch element.
    Calibrated online by the Profiler; admission uses ``conservative_factor`` on top.
    """

    unit: str = "tokens"
    fixed_seconds: float = Field(default=1e-4, ge=0)
    per_unit_seconds: float = Field(default=0.0, ge=0)
    per_unit_sq_seconds: float = Field(default=0.0, ge=0)
    precision_factor: dict[str, float] = Field(default_factory=lambda: {"fp32": 1.0, "bf16": 0.5, "fp16": 0.5})
    conservative_factor: float = Field(default=1.25, ge=1.0)


class SamplerBinding(_Spec):
    """The sampler a denoise loop runs, with its config."""

    name: str
    config: dict[str, Any] = Field(default_factory=dict)
    #: A fixed step count baked into the recipe (few-step distilled loops), else None.
    fixed_steps: int | None = Field(default=None, gt=0)


class LoopSpec(_Spec):
    """One loop a card can run (design §4.3)."""

    loop_id: str
    kind: Literal[
        "diffusion_denoise", "ar_decode", "text_encode", "image_encode", "vae_decode", "vae_encode",
        "audio_decode", "chunk_rollout",
    ]
    #: The Loop class: a ``"module:Class"`` import string, or the name of a loop an enabled
    #: plugin registers (``"<plugin>/<name>"`` or a unique short name), resolved through the
    #: deployment's registry when the instance is built.
    implementation: str
    #: The typed LoopState the loop keeps (documentation and conformance; the class declares it too).
    state_schema: str | None = None
    sampler: SamplerBinding | None = None
    #: Guidance policy name ("cfg", "cfg_zero_star", "none", ...).
    guidance: str | None = None
    #: Options of the loop implementation (e.g. an expert-routing boundary); the family documents them.
    config: dict[str, Any] = Field(default_factory=dict)
    step_cost: StepCostSpec = StepCostSpec()
    #: Parallel axes (names from ``PARALLEL_AXES``) this loop's math is valid under; empty =
    #: single device only. Validated against ``causal`` and the card's ``ParallelismContract``.
    valid_parallel_axes: tuple[str, ...] = ()
    #: Whether steps of this loop may batch across requests.
    batchable: bool = True
    #: Whether this loop is causal (AR / chunked): ``pp_patch`` is invalid for causal loops.
    causal: bool = False
    #: Interceptor classes this loop refuses ("step_skip", "block_cache"), e.g. few-step distilled loops.
    rejects_interceptors: frozenset[Literal["step_skip", "block_cache"]] = frozenset()

    @field_validator("implementation")
    @classmethod
    def _check_implementation(cls, value: str) -> str:
        if ":" in value:
            return ImportString(value)
        if not _LOOP_NAME_RE.match(value):
            raise ValueError(
                f"{value!r} is neither a 'package.module:Class' reference nor a registered loop name ('<plugin>/<name>' or '<name>')"
            )
        return value

    @field_validator("valid_parallel_axes")
    @classmethod
    def _known_axes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [axis for axis in value if axis not in PARALLEL_AXES]
        if unknown:
            raise ValueError(f"valid_parallel_axes names unknown axes {unknown}; allowed: {list(PARALLEL_AXES)}")
        return value

    @model_validator(mode="after")
    def _causal_axes(self) -> "LoopSpec":
        if self.causal and "pp_patch" in self.valid_parallel_axes:
            raise ValueError(
                f"loop {self.loop_id!r} is causal: valid_parallel_axes may not list 'pp_patch' "
                "(displaced-patch pipelining reads stale KV, which breaks causality)"
            )
        return self


class ProgramSpec(_Spec):
    """How a task runs on this card: an inline sequence of the card's loops, or a custom program class."""

    loops: tuple[str, ...] = ()
    implementation: str | None = None
    #: The artifact kinds the program can return for this task; a request's
    #: ``output.modalities`` must be a subset. A kind may be conditional (a rewritten
    #: prompt's text only with ``prompt_upsampling``). None: undeclared, so
    #: ``output.modalities`` still filters the artifacts but is not checked up front.
    returns: frozenset[ArtifactKind] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> "ProgramSpec":
        if bool(self.loops) == bool(self.implementation):
            raise ValueError("a program gives either 'loops' (an inline sequence) or 'implementation', not both")
        if self.implementation:
            ImportString(self.implementation)
        return self


class AttentionAssumption(_Spec):
    """The attention a recipe trained its weights under (e.g. a sparse attention distilled in).

    ``kind`` is the name of the attention driver (``fv.attention_backends``) that computes it;
    ``sparsity`` and ``tile`` are that driver's settings as the recipe fixed them (a tiled
    sparse attention: the fraction of key tiles skipped, and the (t, h, w) token tile).
    """

    kind: str
    sparsity: float | None = Field(default=None, ge=0.0, lt=1.0)
    tile: tuple[int, int, int] | None = None

    @field_validator("kind")
    @classmethod
    def _check_kind(cls, value: str) -> str:
        if not _LOOP_NAME_RE.match(value):
            raise ValueError(f"kind {value!r} is not an attention driver name ('<name>' or '<plugin>/<name>')")
        return value

    @field_validator("tile")
    @classmethod
    def _check_tile(cls, value: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
        if value is not None and min(value) < 1:
            raise ValueError(f"tile must be three positive (t, h, w) sizes, got {list(value)}")
        return value

    def describe(self) -> str:
        settings = [f"sparsity {self.sparsity:g}"] if self.sparsity is not None else []
        if self.tile is not None:
            settings.append("tile " + "x".join(str(t) for t in self.tile))
        return f"attention {self.kind!r}" + (f" ({', '.join(settings)})" if settings else "")


class TextVocabulary(_Spec):
    """The words a word-level text encoder knows: any other word of a prompt reaches the model as
    ``<unk>``. A prompt's words are its whitespace-separated pieces (lower-cased with
    ``lowercase``), exactly as the tokenizer splits them."""

    words: tuple[str, ...] = Field(min_length=1)
    #: Words of ``words`` that say nothing alone (articles, connectives): a prompt whose only known
    #: words are these counts as having no known word.
    function_words: tuple[str, ...] = ()
    lowercase: bool = True

    @model_validator(mode="after")
    def _function_words_known(self) -> "TextVocabulary":
        stray = [w for w in self.function_words if w not in self.words]
        if stray:
            raise ValueError(f"vocabulary.function_words {stray} are not in vocabulary.words")
        return self

    def content_words(self, text: str) -> list[str]:
        """The words of ``text`` in the vocabulary that carry meaning (not function words)."""
        content = set(self.words) - set(self.function_words)
        return [w for w in text.split() if (w.lower() if self.lowercase else w) in content]

    def unknown_words(self, text: str) -> list[str]:
        """The words of ``text`` outside the vocabulary, in order, each once."""
        known = set(self.words)
        found: list[str] = []
        for word in text.split():
            key = word.lower() if self.lowercase else word
            if key not in known and word not in found:
                found.append(word)
        return found


class TrainedEnvelope(_Spec):
    """What the weights were trained on: outside it a card makes garbage without failing.

    Every field is optional; None means "not declared" and nothing is refused on it. A request
    outside a declared field is refused (``InvalidRequest`` naming the field and the allowed
    values) unless it overrides the envelope explicitly (``allow_outside_envelope``).
    """

    #: The frame counts trained at (exact); give this or ``max_frames``.
    frames: tuple[int, ...] | None = None
    #: The longest clip trained at: any count up to it that the card's frame rule accepts.
    max_frames: int | None = Field(default=None, gt=0)
    #: The (width, height) sizes trained at.
    sizes: tuple[tuple[int, int], ...] | None = None
    #: The frame rates the training clips were labelled with.
    fps: tuple[float, ...] | None = None
    #: A word-level text encoder's vocabulary; None for subword tokenizers (no unknown words).
    vocabulary: TextVocabulary | None = None

    @model_validator(mode="after")
    def _well_formed(self) -> "TrainedEnvelope":
        if self.frames is not None and self.max_frames is not None:
            raise ValueError("give envelope.frames (exact counts) or envelope.max_frames (a bound), not both")
        for name in ("frames", "sizes", "fps"):
            value = getattr(self, name)
            if value is not None and not value:
                raise ValueError(f"envelope.{name} is empty: leave it out (not declared) or list what was trained")
        if self.frames is not None and min(self.frames) < 1:
            raise ValueError(f"envelope.frames must be positive counts, got {list(self.frames)}")
        if self.sizes is not None and any(min(size) < 1 for size in self.sizes):
            raise ValueError(f"envelope.sizes must be positive (width, height) pairs, got {[list(s) for s in self.sizes]}")
        if self.fps is not None and min(self.fps) <= 0:
            raise ValueError(f"envelope.fps must be positive, got {list(self.fps)}")
        return self

    def accepts_frames(self, frames: int) -> bool:
        if self.frames is not None:
            return frames in self.frames
        return self.max_frames is None or frames <= self.max_frames

    def describe_frames(self) -> str:
        if self.frames is not None:
            return ", ".join(str(f) for f in self.frames)
        return f"<= {self.max_frames}"

    def accepts_fps(self, fps: float) -> bool:
        # Rates are labels (16.0 vs 16): equal within float noise, not by identity.
        return self.fps is None or any(abs(fps - f) < 1e-6 for f in self.fps)

    def describe_fps(self) -> str:
        return ", ".join(f"{f:g}" for f in self.fps or ())


class QuantizedFrom(_Spec):
    """Provenance of a card whose weights ``fv quantize`` wrote in fp8 (docs/precision.md): its
    ``components`` store their ``fp8_targets`` linears as e4m3 ``weight`` + fp32 ``weight_scale``."""

    #: The card that was quantized, and the weights version its instance loaded.
    model_id: str
    weights_version: str
    #: The precision path the weights were quantized for (the card's ``assumes_precision``).
    path: Literal["fp8_weights", "fp8_dynamic"]
    components: tuple[str, ...] = Field(min_length=1)
    #: Weight scales per output channel (True) or one per tensor.
    per_channel: bool = True
    #: What wrote it (``fv quantize``, fv's version).
    tool: str


class RecipeSpec(_Spec):
    """What produced these weights, and what they assume at serve time (design §4.2)."""

    method: str = "base"  # "base" | "dmd2" | "self_forcing" | "attn_qat_nvfp4" | "diffusion_nft" | ...
    parents: tuple[str, ...] = ()
    data_contract: str | None = None
    #: The loop id the weights require at serve time; None for base recipes.
    assumes_loop: str | None = None
    #: The precision a QAT recipe baked in; None when any supported precision is fine. An
    #: instance at another precision is a ``RecipeMismatch`` unless the deployment overrides it.
    #: A precision path (``fp8_dynamic``...) names the path a quantization-aware recipe trained
    #: under: the card then deploys on it, and another path is a ``RecipeMismatch`` unless overridden.
    assumes_precision: Precision | Literal["fp8_weights", "fp8_dynamic", "fp8_attention", "fp8_all"] | None = None

    @property
    def assumed_path(self) -> str | None:
        """The precision path the recipe assumes (``assumes_precision`` naming a path), else None."""
        return self.assumes_precision if self.assumes_precision in PRECISION_PATHS else None

    @property
    def assumed_dtype(self) -> str | None:
        """The precision (dtype) the recipe assumes (``assumes_precision`` naming one), else None."""
        return None if self.assumes_precision in PRECISION_PATHS else self.assumes_precision
    #: The attention the weights were trained under; None when any exact attention is fine. An
    #: instance with another attention driver is a ``RecipeMismatch`` unless the deployment
    #: overrides it (``build_instance``); the driver is configured with these settings.
    assumes_attention: AttentionAssumption | None = None
    #: The lowest rung of the parity ladder this recipe's outputs are valid under: the
    #: card's ``parity.level`` must reach it.
    consistency_required: ParityLevel = ParityLevel.C1
    #: The frame counts, sizes, frame rates and words the weights were trained on; None or an
    #: unset field: not declared, nothing refused (see :class:`TrainedEnvelope`).
    envelope: TrainedEnvelope | None = None
    #: The default adapter stack (registered names and strengths), applied before a request's
    #: own adapters; a request naming one of them sets its strength (0 turns it off).
    adapters: tuple[AdapterRef, ...] = ()
    #: Set on a card ``fv quantize`` wrote: which card, weights and path its fp8 weights come from.
    quantized_from: QuantizedFrom | None = None

    @field_validator("adapters")
    @classmethod
    def _distinct_adapters(cls, value: tuple[AdapterRef, ...]) -> tuple[AdapterRef, ...]:
        names = [ref.name for ref in value]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"recipe.adapters names {repeated} more than once; give each adapter once")
        if any(ref.version is not None for ref in value):
            raise ValueError("recipe.adapters entries take a name and a scale; versions are pinned per request")
        return value


class ParityTolerance(_Spec):
    name: str
    metric: Literal["max_abs", "mean_abs", "psnr_db", "ssim", "bit_identical"]
    dtype: Precision = "fp32"
    value: float
    justification: str


class BatchedVsAlone(_Spec):
    """How far throughput batching may move a request's result from the same request run alone,
    at one precision (design §9.3).

    Under ``scheduler.batching: throughput`` (the default) compatible steps of different
    requests run as one fused call: the same math on a stacked batch, whose kernels may reduce
    in another order than at batch 1. This is the card's promise about the result, and the
    runtime fuses an instance's steps only where its card makes one at the instance's precision,
    and only for the ops it covers (``ops``). The conformance kit's throughput gate
    (``InterleaveConformance``) measures it: tensor artifacts within ``max_abs``, text as ``text`` says.
    """

    precision: Precision
    #: Largest absolute difference in any returned artifact's values (decoded frames in [0, 1],
    #: latents, audio samples) between the request batched with others and run alone.
    max_abs: float = Field(ge=0)
    #: What was measured, where, and the margin: the number is a measurement, not a guess.
    justification: str = Field(min_length=1)
    #: The ops (``StepOp`` names) whose steps may fuse under this promise; empty: every op of the card.
    #: An op it does not name runs each request's rows alone, as at a precision with no promise, so a
    #: card can promise its token step without promising its video step. Ops are built by the card's
    #: factory, not declared on the card: the executor refuses a name its instance does not have
    #: (``fv_kernel.runtime.executor.check_promised_ops``).
    ops: tuple[str, ...] = ()
    #: Whether generated text (token ids and their text) equals the run alone. ``may_diverge``: a fused
    #: decode step tiles its GEMMs otherwise than at batch 1, which can flip a sampled or greedy token
    #: near a tie, and every later token with it; only tensor artifacts are then held to ``max_abs``.
    text: Literal["identical", "may_diverge"] = "identical"

    @field_validator("ops")
    @classmethod
    def _named_ops(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        blank = [name for name in value if not name.strip()]
        if blank:
            raise ValueError(f"ops names {blank}; each entry is an op's (StepOp) name, a non-empty string")
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"ops names {repeated} more than once; give each op once")
        return value

    def covers(self, op: str) -> bool:
        """Whether the promise lets steps of ``op`` fuse (``ops`` names it, or is empty)."""
        return not self.ops or op in self.ops


class ParitySpec(_Spec):
    """The card's parity obligation: against what, to what level, within which tolerances."""

    level: ParityLevel
    reference: str  # e.g. "diffusers==0.42.1:WanPipeline"
    tolerances: tuple[ParityTolerance, ...] = ()
    tests: tuple[str, ...] = ()
    #: Throughput batching's promise, per precision. A precision with none keeps the card's steps
    #: unfused (each request's rows run alone) under ``batching: throughput`` too.
    batched_vs_alone: tuple[BatchedVsAlone, ...] = ()

    @field_validator("batched_vs_alone")
    @classmethod
    def _one_per_precision(cls, value: tuple[BatchedVsAlone, ...]) -> tuple[BatchedVsAlone, ...]:
        seen = [entry.precision for entry in value]
        repeated = sorted({p for p in seen if seen.count(p) > 1})
        if repeated:
            raise ValueError(f"one batched_vs_alone entry per precision; {', '.join(repeated)} given more than once")
        return value

    def batching_tolerance(self, precision: str) -> BatchedVsAlone | None:
        """The throughput-batching promise at ``precision``, or None (the card's steps stay unfused)."""
        return next((entry for entry in self.batched_vs_alone if entry.precision == precision), None)


#: The fast compute tiers that promise parity against eager (``ComputeOptions.tier`` parts, and the
#: kernel's ``vsa`` attention driver). ``torch`` fused ops are eager's own formulas, not a tier.
ComputeTierName = Literal["fused", "graphs", "blocks", "vsa"]
#: The components a tier is measured and selected for separately: the denoiser (every ``dit``
#: component of the card) and the VAE (every ``vae`` component; its decoder is what a tier speeds up).
TierComponent = Literal["dit", "vae"]
#: Which components each tier acts on: only the fused kernels reach the VAE.
TIER_COMPONENTS: "MappingProxyType[str, tuple[TierComponent, ...]]" = MappingProxyType({
    "fused": ("dit", "vae"), "graphs": ("dit",), "blocks": ("dit",), "vsa": ("dit",),
})

#: One-sided 95% quantiles of Student's t for 1..30 degrees of freedom (standard tables).
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
        1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)


def t_quantile_95(df: int) -> float:
    """The one-sided 95% quantile of Student's t with ``df`` degrees of freedom (a table to 30; beyond,
    the normal quantile with its first two Cornish-Fisher terms, within 1e-3 there)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.6448536269514722
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def _short_trajectory(where: str, measurement: "TierParityMeasurement | PrecisionPathMeasurement",
                      defaults: "GenerationDefaults | None") -> str | None:
    """Why ``measurement`` is not of the card's full default trajectory (None: it is, or no defaults)."""
    if defaults is None:
        return None
    wanted = (defaults.steps, defaults.frames, defaults.height, defaults.width)
    got = (measurement.steps, measurement.frames, measurement.height, measurement.width)
    if got[0] < wanted[0] or got[1:] != wanted[1:]:
        return (f"{where}: measured over {got[0]} steps at {got[1]}x{got[2]}x{got[3]}; the contract needs the "
                f"card's full default trajectory ({wanted[0]} steps at {wanted[1]}x{wanted[2]}x{wanted[3]})")
    return None


class TierParityContract(_Spec):
    """What a fast compute tier promises against eager at the card's precision, over several
    full trajectories (the card's default steps and shape; one seed and prompt each).

    Judged by :meth:`check` on a :class:`TierParityMeasurement` read from the deployment's
    ``ComputeOptions.parity_record`` (written by ``bench/bench_tier_parity.py --record``). Each
    sample's floor is eager-at-precision's own PSNR against eager fp32 on that seed, so the tier
    may lose no more accuracy than running in the card's precision at all already does. The rule
    is a one-sided non-inferiority test on the paired per-sample differences (tier PSNR minus its
    floor, dB): the tier passes when the 95% lower confidence bound of their mean is at least
    ``-psnr_margin_db``. One unlucky seed below its floor does not fail a tier whose mean is well
    above; a tier that is consistently below, or too noisy to tell, does.
    """

    tier: ComputeTierName
    #: How far (dB) the mean per-sample difference may be below 0 at 95% confidence. 0.5 dB is 12%
    #: more squared error than the precision's own loss: below what two bf16 rounding orders
    #: already differ by over a trajectory (single seeds measured 0.05-0.22 dB apart for tiers whose
    #: one forward is more accurate than eager's), and far below a visible change at 45-48 dB.
    psnr_margin_db: float = Field(default=0.5, ge=0)
    #: Fewest samples (seeds and prompts) the rule judges: a bound needs a spread, and 3 is the
    #: fewest whose t quantile (2.92) does not swamp every margin.
    min_samples: int = Field(default=3, ge=2)
    #: One denoise forward's relative L2 error against eager at the card's precision may be at
    #: most this multiple of eager's own one-forward error against eager fp32; None: no per-step promise.
    max_step_error_ratio: float | None = Field(default=None, gt=0)

    def check(self, measurement: "TierParityMeasurement | None", *, model_id: str, precision: str,
              defaults: GenerationDefaults | None, component: TierComponent = "dit") -> "TierVerdict":
        """The verdict on ``measurement`` (None: nothing recorded) for ``model_id``'s ``component`` at ``precision``."""
        where = f"tier {self.tier!r} on the {component} of card {model_id!r} at {precision}"

        def verdict(passed: bool, reason: str) -> TierVerdict:
            return TierVerdict(tier=self.tier, component=component, passed=passed, reason=reason)

        if measurement is None:
            return verdict(False, f"{where}: no trajectory measurement recorded (bench/bench_tier_parity.py --record, "
                                  "named by compute.parity_record)")
        if (measurement.tier, measurement.model_id, measurement.precision) != (self.tier, model_id, precision) or (
                measurement.component not in ("all", component)):
            raise ValueError(f"{where}: measurement is of tier {measurement.tier!r} on {measurement.component!r}, card "
                             f"{measurement.model_id!r} at {measurement.precision}")
        short = _short_trajectory(where, measurement, defaults)
        if short is not None:
            return verdict(False, short)
        n = len(measurement.samples)
        if n < self.min_samples:
            return verdict(False, (
                f"{where}: the record holds {n} sample(s) in 'samples' (a single-sample record cannot be judged); the "
                f"contract's floor is statistical and needs at least {self.min_samples} seeds "
                f"(bench/bench_tier_parity.py --samples {self.min_samples} --record); {measurement.source}"))
        stats = measurement.statistics()
        lower = stats.lower_bound_db
        if not lower >= -self.psnr_margin_db:  # NaN fails too
            # The trajectory to rerun first: the sample furthest below its floor.
            which = _worst_sample(measurement.samples, lambda sample: sample.difference_db, "+.2f")
            return verdict(False, (
                f"{where}: below the floor (eager {precision} vs eager fp32, per sample) by more than the "
                f"{self.psnr_margin_db:g} dB margin at 95% confidence: over {n} samples the tier is "
                f"{stats.mean_db:+.2f} dB from its floor on average (sd {stats.sd_db:.2f}), lower bound {lower:+.2f} dB"
                f"{which}; {measurement.source}"))
        if self.max_step_error_ratio is not None:
            if measurement.step_rel_error is None or measurement.reference_step_rel_error is None:
                return verdict(False, f"{where}: the contract bounds one forward's error, which the measurement does not record")
            bound = self.max_step_error_ratio * measurement.reference_step_rel_error
            if not measurement.step_rel_error <= bound:
                return verdict(False, (
                    f"{where}: one forward differs from eager by {measurement.step_rel_error:.3g} relative, above "
                    f"{bound:.3g} ({self.max_step_error_ratio:g} x eager {precision}'s own "
                    f"{measurement.reference_step_rel_error:.3g} against fp32); {measurement.source}"))
        return verdict(True, (
            f"{where}: over {n} samples {stats.mean_db:+.2f} dB from the floor on average, 95% lower bound "
            f"{lower:+.2f} dB >= -{self.psnr_margin_db:g} dB (worst sample {stats.worst_db:+.2f} dB); {measurement.source}"))


class TierParitySample(_Spec):
    """One seed and prompt's full trajectory: the tier's final video against eager's, and eager's
    own against eager fp32 (the sample's floor)."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")

    #: The request's seed (None: not recorded, in a record from before samples were kept).
    seed: int | None = None
    prompt: str | None = None
    #: PSNR (dB, inf: identical) of the tier's final decoded video against eager's, both at the precision.
    psnr_db: float
    #: PSNR of eager at the precision against eager fp32, same seed and prompt: the cost of the precision itself.
    reference_psnr_db: float

    @property
    def difference_db(self) -> float:
        """The tier's PSNR minus its floor (dB). A sample the tier reproduces exactly counts as 0 (it
        lost nothing; crediting it more would rest on an infinity); one whose floor is exact but the
        tier is not counts as -inf (an exact reference demands an exact tier); NaN stays NaN."""
        tier, floor = self.psnr_db, self.reference_psnr_db
        if math.isnan(tier) or math.isnan(floor):
            return math.nan
        if tier == math.inf:
            return 0.0
        return -math.inf if floor == math.inf else tier - floor


class TierSampleStatistics(_Spec):
    """The per-sample differences' summary the contract judges (dB)."""

    n: int
    mean_db: float
    sd_db: float
    #: One-sided 95% lower confidence bound of the mean: mean - t(0.95, n-1) * sd / sqrt(n).
    lower_bound_db: float
    worst_db: float


def _worst_sample(samples: Sequence[Any], db: Callable[[Any], float], spec: str) -> str:
    """``"; worst sample X dB at seed S, prompt P"`` for the sample of lowest ``db`` (a NaN one first), where the
    record kept its seed (and prompt): the clip to reproduce first. Empty for a record without seeds."""
    worst = min(samples, key=lambda sample: (not math.isnan(db(sample)), db(sample)))
    if worst.seed is None:
        return ""
    prompt = "" if worst.prompt is None else f", prompt {worst.prompt!r}"
    return f"; worst sample {format(db(worst), spec)} dB at seed {worst.seed}{prompt}"


def _one_sided_statistics(values: list[float]) -> TierSampleStatistics:
    """Mean, sd and the one-sided 95% lower confidence bound of the mean of finite ``values`` (NaN bound for one)."""
    n, mean, worst = len(values), sum(values) / len(values), min(values)
    if n < 2:
        return TierSampleStatistics(n=n, mean_db=mean, sd_db=math.nan, lower_bound_db=math.nan, worst_db=worst)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return TierSampleStatistics(n=n, mean_db=mean, sd_db=sd, lower_bound_db=mean - t_quantile_95(n - 1) * sd / math.sqrt(n),
                                worst_db=worst)


class _TrajectoryMeasurement(_Spec):
    """What every full-trajectory measurement names: the card, and the trajectory it ran (its
    steps and shape, which a contract checks against the card's defaults), and where it was made."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")

    model_id: str
    steps: int = Field(gt=0)
    frames: int = Field(gt=0)
    height: int = Field(gt=0)
    width: int = Field(gt=0)
    #: Where it was measured: date, machine, weights, seed and command (quoted in verdicts).
    source: str


class TierParityMeasurement(_TrajectoryMeasurement):
    """A tier against eager over several full trajectories (``bench/bench_tier_parity.py``): one
    sample per seed and prompt, for one component (or, in an older record, for all at once)."""

    tier: ComputeTierName
    #: The component the tier was on (the others ran eager); ``all``: every component it acts on at
    #: once (records from before per-component selection), which stands for each component without
    #: its own measurement.
    component: Literal["all", "dit", "vae"] = "all"
    #: The precision the tier and its eager reference ran in (the card's).
    precision: Precision
    #: One per seed and prompt; the contract needs several (``TierParityContract.min_samples``).
    samples: tuple[TierParitySample, ...] = Field(min_length=1)
    #: Relative L2 error of one denoise forward (the first sample's first step) against eager at ``precision``.
    step_rel_error: float | None = Field(default=None, ge=0)
    #: The same for eager at ``precision`` against eager fp32.
    reference_step_rel_error: float | None = Field(default=None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _single_sample_record(cls, data: Any) -> Any:
        # A record written before samples were kept has one psnr_db/reference_psnr_db pair: it loads as
        # one sample, which the contract reports it cannot judge (naming 'samples') instead of refusing the file.
        if isinstance(data, dict) and ("psnr_db" in data or "reference_psnr_db" in data):
            if "samples" in data:
                raise ValueError("a measurement gives 'samples', or the single psnr_db/reference_psnr_db pair of an "
                                 "older record, not both")
            data = dict(data)
            data["samples"] = [{"psnr_db": data.pop("psnr_db", None), "reference_psnr_db": data.pop("reference_psnr_db", None)}]
        return data

    @property
    def key(self) -> tuple[str, str, str, str]:
        """What a record keeps one measurement per: (tier, component, card, precision)."""
        return (self.tier, self.component, self.model_id, self.precision)

    @property
    def psnr_db(self) -> float:
        """The tier's mean PSNR against eager over the samples (inf when every sample is identical)."""
        return sum(s.psnr_db for s in self.samples) / len(self.samples)

    @property
    def reference_psnr_db(self) -> float:
        """Eager at the precision against eager fp32, mean over the samples."""
        return sum(s.reference_psnr_db for s in self.samples) / len(self.samples)

    def statistics(self) -> TierSampleStatistics:
        """The per-sample differences (:attr:`TierParitySample.difference_db`) summarised (NaN bound for one sample)."""
        diffs = [s.difference_db for s in self.samples]
        n = len(diffs)
        worst = min(diffs)
        if any(math.isnan(d) for d in diffs) or worst == -math.inf:
            bad = math.nan if any(math.isnan(d) for d in diffs) else -math.inf
            return TierSampleStatistics(n=n, mean_db=bad, sd_db=math.nan, lower_bound_db=bad, worst_db=worst)
        return _one_sided_statistics(diffs)


#: An identical clip's PSNR (infinite) counts as this many dB in a precision path's statistics: above what fp32
#: rounding alone leaves (about 138 dB for frames in [0, 1]), so an identical clip neither fails a path nor lets one
#: infinity carry the mean.
IDENTICAL_CLIP_PSNR_DB = 150.0


class PrecisionPathSample(_Spec):
    """One seed and prompt's full trajectory: the path's final decoded video against the native path's."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")

    #: The request's seed (None: not recorded, in a record from before samples were kept).
    seed: int | None = None
    prompt: str | None = None
    #: PSNR (dB, inf: identical) of the path's final video against the native path's, same seed and prompt.
    psnr_db: float


class PrecisionPathMeasurement(_TrajectoryMeasurement):
    """Full-trajectory measurements of a precision path against the native path, one sample per seed and prompt
    (``bench/bench_precision_quality.py --record``): what a :class:`PrecisionPathContract` is judged on."""

    path: Literal["fp8_weights", "fp8_dynamic", "fp8_attention", "fp8_all"]
    #: The instance precision both runs used (the card's default unless the deployment chose another).
    precision: Precision
    #: One per seed and prompt; the contract needs several (``PrecisionPathContract.min_samples``).
    samples: tuple[PrecisionPathSample, ...] = Field(min_length=1)
    #: The path's judge scores (points, e.g. the toy judge's ``colour`` and ``direction``); empty: not judged.
    judge_scores: dict[str, float] = Field(default_factory=dict)
    #: The native path's scores on the same prompts and seeds.
    reference_judge_scores: dict[str, float] = Field(default_factory=dict)
    #: The device type measured on (``cuda``, ``cpu``): ``auto`` reads only its own device's timings.
    device: str = Field(min_length=1)
    #: One denoise step's seconds on this path and on the native path (None: not timed); ``auto``
    #: picks a path only where it is timed faster than native.
    step_seconds: float | None = Field(default=None, gt=0)
    reference_step_seconds: float | None = Field(default=None, gt=0)

    @field_validator("device")
    @classmethod
    def _device_type(cls, value: str) -> str:
        return value.split(":", 1)[0]

    @model_validator(mode="before")
    @classmethod
    def _single_sample_record(cls, data: Any) -> Any:
        # A record written before samples were kept has one pooled psnr_db: it loads as one sample, which the
        # contract reports it cannot judge (naming 'samples') instead of refusing the file.
        if isinstance(data, dict) and "psnr_db" in data:
            if "samples" in data:
                raise ValueError("a measurement gives 'samples', or the single psnr_db of an older record, not both")
            data = dict(data)
            data["samples"] = [{"psnr_db": data.pop("psnr_db")}]
        return data

    @property
    def key(self) -> tuple[str, str, str]:
        """What a record keeps one measurement per: (path, card, precision)."""
        return (self.path, self.model_id, self.precision)

    @property
    def psnr_db(self) -> float:
        """The samples' mean PSNR (an identical clip counted as ``IDENTICAL_CLIP_PSNR_DB``)."""
        return self.statistics().mean_db

    def statistics(self) -> TierSampleStatistics:
        """The samples' PSNRs summarised: mean, sd, the one-sided 95% lower bound of the mean (NaN for one sample)
        and the worst. An identical clip counts as ``IDENTICAL_CLIP_PSNR_DB``; a NaN sample makes every figure NaN."""
        values = [min(sample.psnr_db, IDENTICAL_CLIP_PSNR_DB) for sample in self.samples]
        if any(math.isnan(v) for v in values):
            return TierSampleStatistics(n=len(values), mean_db=math.nan, sd_db=math.nan, lower_bound_db=math.nan,
                                        worst_db=math.nan)
        return _one_sided_statistics(values)

    @property
    def speedup(self) -> float | None:
        """Native step seconds over the path's (> 1: the path is faster); None when not timed."""
        if self.step_seconds is None or self.reference_step_seconds is None:
            return None
        return self.reference_step_seconds / self.step_seconds


class PrecisionPathVerdict(_Spec):
    path: PrecisionPath
    passed: bool
    reason: str


class PrecisionPathContract(_Spec):
    """Where a card allows a precision path: the quality the path must keep against the card's
    native path over full trajectories (C1: fixed seeds, the card's default steps and shape).

    Judged by :meth:`check` on a :class:`PrecisionPathMeasurement` read from the deployment's
    ``compute.parity_record``. ``precision_path: auto`` selects only a path that passes. The floor
    is statistical, as the compute tiers' is: over the samples (one per seed and prompt), the path
    passes when every sample is at or above ``min_psnr_db``, or else when the one-sided 95% lower
    confidence bound of their mean PSNR is. One unlucky seed below the floor does not fail a path
    whose mean is well above it; a path that holds the floor only on average, with samples spread
    too wide to tell, fails.
    """

    path: Literal["fp8_weights", "fp8_dynamic", "fp8_attention", "fp8_all"]
    #: Floor (dB) on the 95% lower confidence bound of the final videos' mean PSNR against the native path's.
    min_psnr_db: float = Field(gt=0)
    #: Fewest samples (seeds and prompts) the rule judges: a bound needs a spread (as ``TierParityContract``'s).
    min_samples: int = Field(default=3, ge=2)
    #: Each judge score may differ from the native path's by at most this many points; None: no
    #: judge (the measurement's scores are not read).
    max_judge_delta: float | None = Field(default=None, ge=0)
    #: Why these numbers (what was measured, the margin): shown by ``fv cards show``.
    justification: str = ""

    def check(self, measurement: PrecisionPathMeasurement | None, *, model_id: str, precision: str,
              defaults: "GenerationDefaults | None") -> PrecisionPathVerdict:
        """The verdict on ``measurement`` (None: nothing recorded) for ``model_id`` at ``precision``."""
        where = f"precision path {self.path!r} of card {model_id!r} at {precision}"

        def fail(reason: str) -> PrecisionPathVerdict:
            return PrecisionPathVerdict(path=self.path, passed=False, reason=reason)

        if measurement is None:
            return fail(f"{where}: no trajectory measurement recorded (bench/bench_precision_quality.py --record, named by "
                        "compute.parity_record)")
        if measurement.key != (self.path, model_id, precision):
            raise ValueError(f"{where}: measurement is of path {measurement.path!r}, card {measurement.model_id!r} "
                             f"at {measurement.precision}")
        short = _short_trajectory(where, measurement, defaults)
        if short is not None:
            return fail(short)
        n = len(measurement.samples)
        if n < self.min_samples:
            return fail(f"{where}: the record holds {n} sample(s) in 'samples' (a single-sample record cannot be "
                        f"judged); the contract's floor is statistical and needs at least {self.min_samples} seeds "
                        f"and prompts; {measurement.source}")
        stats = measurement.statistics()
        # Every sample at or above the floor passes however spread they are; below it, the mean must be held at 95%.
        if not (stats.worst_db >= self.min_psnr_db or stats.lower_bound_db >= self.min_psnr_db):  # NaN fails too
            # The clip to look at first: the worst sample.
            which = _worst_sample(measurement.samples, lambda sample: sample.psnr_db, ".2f")
            return fail(f"{where}: final videos {stats.mean_db:.2f} dB PSNR against the native path on average over "
                        f"{n} samples (sd {stats.sd_db:.2f}), 95% lower bound {stats.lower_bound_db:.2f} dB, below the "
                        f"contract's {self.min_psnr_db:g} dB{which}; {measurement.source}")
        if self.max_judge_delta is not None:
            if not measurement.reference_judge_scores:
                return fail(f"{where}: the contract bounds the judge's scores, which the measurement does not record")
            for name, native in sorted(measurement.reference_judge_scores.items()):
                score = measurement.judge_scores.get(name)
                if score is None:
                    return fail(f"{where}: judge score {name!r} recorded for the native path only")
                if not abs(score - native) <= self.max_judge_delta:
                    return fail(f"{where}: judge score {name!r} {score:.2f} against the native path's {native:.2f}, "
                                f"more than {self.max_judge_delta:g} points apart; {measurement.source}")
        return PrecisionPathVerdict(path=self.path, passed=True, reason=(
            f"{where}: over {n} samples {stats.mean_db:.2f} dB against the native path on average, "
            + (f"every sample >= {self.min_psnr_db:g} dB (worst {stats.worst_db:.2f} dB)" if stats.worst_db >= self.min_psnr_db
               else f"95% lower bound {stats.lower_bound_db:.2f} dB >= {self.min_psnr_db:g} dB (worst sample "
                    f"{stats.worst_db:.2f} dB)")
            + ("" if self.max_judge_delta is None else f", judge scores within {self.max_judge_delta:g} points")
            + f"; {measurement.source}"))


class TierParityRecord(_Spec):
    """The recorded measurements a deployment's tier and precision-path selection read (a JSON file)."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")

    measurements: tuple[TierParityMeasurement, ...] = ()
    #: Precision paths against the native path (``bench/bench_precision_quality.py --record``).
    precision_paths: tuple[PrecisionPathMeasurement, ...] = ()

    def find_path(self, path: str, model_id: str, precision: str) -> PrecisionPathMeasurement | None:
        """The last measurement of precision path ``path`` for ``model_id`` at ``precision``, if any."""
        return _last_with_key(self.precision_paths, (path, model_id, precision))

    def merged_paths(self, new: "tuple[PrecisionPathMeasurement, ...] | list[PrecisionPathMeasurement]") -> "TierParityRecord":
        """This record with ``new`` replacing the path measurements of the same (path, card, precision)."""
        return self.model_copy(update={"precision_paths": _replaced_by_key(self.precision_paths, new)})

    def find(self, tier: str, model_id: str, precision: str, component: str = "dit") -> TierParityMeasurement | None:
        """The last measurement of ``tier`` on ``component`` for ``model_id`` at ``precision``; else the
        last of the tier on all components at once (``component: all``), if any."""
        found = _last_with_key(self.measurements, (tier, component, model_id, precision))
        return found if found is not None else _last_with_key(self.measurements, (tier, "all", model_id, precision))

    def merged(self, new: "tuple[TierParityMeasurement, ...] | list[TierParityMeasurement]") -> "TierParityRecord":
        """This record with ``new`` replacing the measurements of the same (tier, component, card, precision)."""
        return self.model_copy(update={"measurements": _replaced_by_key(self.measurements, new)})


def _last_with_key(measurements: Sequence[Any], key: tuple[str, ...]) -> Any:
    """The last of ``measurements`` whose ``key`` is ``key`` (a record keeps the newest last), or None."""
    found = [m for m in measurements if m.key == key]
    return found[-1] if found else None


def _replaced_by_key(measurements: Sequence[Any], new: Sequence[Any]) -> tuple[Any, ...]:
    """``measurements`` without those ``new`` measures again, then ``new``."""
    keys = {m.key for m in new}
    return (*[m for m in measurements if m.key not in keys], *new)


class TierVerdict(_Spec):
    tier: ComputeTierName
    #: The component the verdict is for (a tier is selected per component).
    component: TierComponent = "dit"
    passed: bool
    reason: str


#: Each fast tier's contract: no more accuracy lost over several trajectories (within the stated
#: margin, at 95% confidence), nor in one forward, than the card's precision itself loses against
#: fp32 (issue 19, 2b; issue 36, 2). Read-only.
TIER_PARITY_CONTRACTS: "MappingProxyType[str, TierParityContract]" = MappingProxyType({
    tier: TierParityContract(tier=tier, max_step_error_ratio=1.0) for tier in get_args(ComputeTierName)
})


class CacheContract(_Spec):
    cache_class: Literal["feature", "paged_kv", "slab_kv", "residual", "weight"]
    #: Key fields beyond the always-present (model, component, weights version, adapters, precision).
    key_fields: tuple[str, ...] = ()
    budget_bytes: int = Field(default=256 * 2**20, ge=0)
    block_bytes: int | None = Field(default=None, gt=0)


#: Named parallel axes (design §8).
PARALLEL_AXES = ("dp", "tp", "sp", "cp", "cfgp", "pp_patch", "vae", "ep", "fsdp")


class ParallelismContract(_Spec):
    """Which named axes a card supports and up to what degree; validated up front.

    A deployment's ``ParallelPlan`` is checked against it at deploy time
    (``fv_kernel.parallel.check_plan_against_card``). A degree above 1 needs an
    ``implementation``: the family's ``"module:object"`` with ``check_plan(card, plan)``
    and ``build_ops(instance, runtime)`` (``fv_kernel.parallel.ParallelImplementation``).
    """

    max_degree: dict[str, int] = Field(default_factory=dict)
    implementation: str | None = None

    @field_validator("implementation")
    @classmethod
    def _implementation(cls, value: str | None) -> str | None:
        return None if value is None else ImportString(value)

    @field_validator("max_degree")
    @classmethod
    def _axes(cls, value: dict[str, int]) -> dict[str, int]:
        for axis, degree in value.items():
            if axis not in PARALLEL_AXES:
                raise ValueError(f"unknown parallel axis {axis!r}; allowed: {list(PARALLEL_AXES)}")
            if degree < 1:
                raise ValueError(f"parallel axis {axis!r} needs a degree >= 1, got {degree}")
        if value.get("cfgp", 1) > 2:
            raise ValueError("parallel axis 'cfgp' has at most 2 branches")
        return value


class PrecisionContract(_Spec):
    default: Precision = "bf16"
    supported: frozenset[Precision] = frozenset({"fp32", "bf16"})
    #: The precision paths this card may be served on beyond ``native``, each with its quality
    #: contract; a path not listed is refused (``precision_path``). ``native`` is always allowed.
    paths: dict[Literal["fp8_weights", "fp8_dynamic", "fp8_attention", "fp8_all"], PrecisionPathContract] = Field(
        default_factory=dict)
    #: Which linears the fp8 linear paths quantize: per component, ``fnmatch`` globs over the module's
    #: linear paths (``blocks.*.attn1.to_q``); every glob must match at least one linear at load.
    fp8_targets: dict[str, tuple[str, ...]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _default_supported(self) -> "PrecisionContract":
        if self.default not in self.supported:
            raise ValueError(f"default precision {self.default!r} is not in supported {sorted(self.supported)}")
        for path, contract in self.paths.items():
            if contract.path != path:
                raise ValueError(f"precision.paths[{path!r}].path is {contract.path!r}; it must equal its key")
        linear_paths = sorted(p for p in self.paths if p in FP8_LINEAR_PATHS)
        if linear_paths and not any(self.fp8_targets.values()):
            raise ValueError(f"precision.paths lists {linear_paths}, which quantize linears, but precision.fp8_targets "
                             "names none; allowed: globs of each component's linears to run in fp8")
        for component, globs in self.fp8_targets.items():
            if len(set(globs)) != len(globs):
                raise ValueError(f"precision.fp8_targets[{component!r}] repeats a glob: {list(globs)}")
        return self

    @property
    def allowed_paths(self) -> tuple[str, ...]:
        """The paths this card serves: ``native`` and the listed ones, in :data:`PRECISION_PATHS` order."""
        return tuple(p for p in PRECISION_PATHS if p == "native" or p in self.paths)


class FrameRule(_Spec):
    """Valid frame counts are ``modulus·k + remainder`` (e.g. 4k+1)."""

    modulus: int = Field(default=1, ge=1)
    remainder: int = Field(default=0, ge=0)

    def accepts(self, frames: int) -> bool:
        return frames >= self.remainder and (frames - self.remainder) % self.modulus == 0

    def describe(self) -> str:
        if self.modulus == 1:
            return "any positive integer"
        return f"{self.modulus}k+{self.remainder} (e.g. {self.remainder + self.modulus}, {self.remainder + 4 * self.modulus})"


class TokenGridRule(_Spec):
    """The model's positional table bounds its token grid (Wan: a RoPE table of
    ``rope_max_seq_len`` positions per axis): at most ``max_per_axis`` tokens along time,
    height and width.

    A request of ``frames x height x width`` makes a grid of
    ``(((frames - 1) // frames_per_latent + 1) // latent_frames_per_token,
    height // pixels_per_token, width // pixels_per_token)``.
    """

    max_per_axis: int = Field(gt=0)
    #: The VAE's temporal compression (Wan: 4, so 4k+1 frames are k+1 latent frames).
    frames_per_latent: int = Field(default=1, ge=1)
    #: The transformer's temporal patch size.
    latent_frames_per_token: int = Field(default=1, ge=1)
    #: The VAE's spatial compression times the transformer's spatial patch size.
    pixels_per_token: int = Field(ge=1)

    def grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The (time, height, width) token grid of a request."""
        latent_frames = (frames - 1) // self.frames_per_latent + 1
        return (latent_frames // self.latent_frames_per_token, height // self.pixels_per_token,
                width // self.pixels_per_token)

    @property
    def max_frames(self) -> int:
        """The most frames whose time axis fits the table."""
        return (self.max_per_axis * self.latent_frames_per_token - 1) * self.frames_per_latent + 1

    @property
    def max_side(self) -> int:
        """The largest height (or width) that is a whole number of tokens and fits the table."""
        return self.max_per_axis * self.pixels_per_token


class GenerationDefaults(_Spec):
    height: int = Field(gt=0)
    width: int = Field(gt=0)
    frames: int = Field(gt=0)
    fps: float = Field(gt=0)
    steps: int = Field(gt=0)
    guidance: float = Field(ge=0)
    guidance_2: float | None = None
    shift: float | None = None


class CapabilityMatrix(_Spec):
    """What the card can do, and the shapes it accepts."""

    tasks: frozenset[TaskType]
    defaults: GenerationDefaults | None = None
    #: Height and width must be multiples of this (VAE factor × patch size).
    spatial_multiple: int = Field(default=1, ge=1)
    frame_rule: FrameRule = FrameRule()
    max_frames: int | None = None
    max_pixels: int | None = None
    #: The most denoise steps a request may ask for (the sampler's schedule length, or what
    #: the card's owner will let one request run); None: no card bound.
    max_steps: int | None = Field(default=None, gt=0)
    #: The frame rates the card's output may be labelled with, inclusive; None: no bound.
    min_fps: float | None = Field(default=None, gt=0)
    max_fps: float | None = Field(default=None, gt=0)
    #: The token grid the model can position (None: unbounded).
    token_grid: TokenGridRule | None = None
    #: Whether the card's loops use classifier-free guidance at all.
    uses_guidance: bool = True

    @model_validator(mode="after")
    def _defaults_within_bounds(self) -> "CapabilityMatrix":
        if self.min_fps is not None and self.max_fps is not None and self.min_fps > self.max_fps:
            raise ValueError(f"min_fps {self.min_fps:g} is above max_fps {self.max_fps:g}")
        d = self.defaults
        if d is None:
            return self
        if self.max_steps is not None and d.steps > self.max_steps:
            raise ValueError(f"defaults.steps {d.steps} is above max_steps {self.max_steps}")
        if (self.min_fps is not None and d.fps < self.min_fps) or (self.max_fps is not None and d.fps > self.max_fps):
            raise ValueError(f"defaults.fps {d.fps:g} is outside [min_fps, max_fps] = [{self.min_fps}, {self.max_fps}]")
        if self.token_grid is not None and max(self.token_grid.grid(d.frames, d.height, d.width)) > self.token_grid.max_per_axis:
            raise ValueError(
                f"defaults ({d.frames} frames, {d.width}x{d.height}) make a token grid of "
                f"{self.token_grid.grid(d.frames, d.height, d.width)}, beyond token_grid.max_per_axis "
                f"{self.token_grid.max_per_axis}"
            )
        return self


class ModelCard(_Spec):
    """A deployable model: a (recipe, runtime) pair with a parity obligation (design §4.1)."""

    model_id: str
    family: str
    summary: str = ""
    version: str = "1"
    components: dict[str, ComponentSpec]
    loops: dict[str, LoopSpec]
    programs: dict[TaskType, ProgramSpec]
    capabilities: CapabilityMatrix
    recipe: RecipeSpec
    parity: ParitySpec
    caches: dict[str, CacheContract] = Field(default_factory=dict)
    parallelism: ParallelismContract = ParallelismContract()
    precision: PrecisionContract = PrecisionContract()
    checkpoint: CheckpointManifest
    #: Builds the resident instance: ``"module:function"`` taking (card, InstanceOptions).
    factory: str
    #: How an adapter (LoRA) file's tensors map onto this card's components: ``"module:function"``
    #: of a converter ``convert(state_dict, *, name, metadata) -> {component_id: AdapterWeights}``.
    #: None: the kernel's diffusers/PEFT converter (``fv_kernel.model.adapters:convert_peft``).
    adapter_format: str | None = None

    @field_validator("factory")
    @classmethod
    def _check_factory(cls, value: str) -> str:
        return ImportString(value)

    @field_validator("adapter_format")
    @classmethod
    def _check_adapter_format(cls, value: str | None) -> str | None:
        return None if value is None else ImportString(value)

    @field_validator("model_id")
    @classmethod
    def _model_id(cls, value: str) -> str:
        if not _ID_RE.match(value):
            raise ValueError(f"model_id {value!r} must be lowercase letters, digits, '.', '_' or '-'")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "ModelCard":
        for key, comp in self.components.items():
            if comp.component_id != key:
                raise ValueError(f"components[{key!r}].component_id is {comp.component_id!r}; it must equal its key")
        for key, loop in self.loops.items():
            if loop.loop_id != key:
                raise ValueError(f"loops[{key!r}].loop_id is {loop.loop_id!r}; it must equal its key")
        unknown_ckpt = sorted(set(self.checkpoint.components) - set(self.components))
        if unknown_ckpt:
            raise ValueError(f"checkpoint.components names unknown components {unknown_ckpt}; known: {sorted(self.components)}")
        for task, program in self.programs.items():
            if task not in self.capabilities.tasks:
                raise ValueError(f"programs has task {task.value!r} that capabilities.tasks does not list")
            missing = [loop_id for loop_id in program.loops if loop_id not in self.loops]
            if missing:
                raise ValueError(f"programs[{task.value!r}] names unknown loops {missing}; known: {sorted(self.loops)}")
        missing_programs = sorted(t.value for t in self.capabilities.tasks if t not in self.programs)
        if missing_programs:
            raise ValueError(f"capabilities.tasks {missing_programs} have no entry in programs")
        if self.recipe.assumes_loop is not None and self.recipe.assumes_loop not in self.loops:
            raise ValueError(
                f"recipe.assumes_loop {self.recipe.assumes_loop!r} is not one of the card's loops {sorted(self.loops)}"
            )
        unknown_targets = sorted(set(self.precision.fp8_targets) - set(self.components))
        if unknown_targets:
            raise ValueError(f"precision.fp8_targets names unknown components {unknown_targets}; known: "
                             f"{sorted(self.components)}")
        quantized = self.recipe.quantized_from
        if quantized is not None:
            unquantized = sorted(set(quantized.components) - set(self.precision.fp8_targets))
            if unquantized:
                raise ValueError(f"recipe.quantized_from.components {unquantized} have no precision.fp8_targets")
            if self.recipe.assumes_precision != quantized.path:
                raise ValueError(f"recipe.assumes_precision must be {quantized.path!r}, the path recipe.quantized_from "
                                 f"quantized the weights for; got {self.recipe.assumes_precision!r}")
        assumed_path = self.recipe.assumed_path
        if assumed_path is not None and assumed_path not in self.precision.paths:
            raise ValueError(
                f"recipe.assumes_precision {assumed_path!r} is a precision path that precision.paths does not list "
                f"(listed: {sorted(self.precision.paths)}); list it with its contract"
            )
        assumed_dtype = self.recipe.assumed_dtype
        if assumed_dtype is not None and assumed_dtype not in self.precision.supported:
            raise ValueError(
                f"recipe.assumes_precision {self.recipe.assumes_precision!r} is not in precision.supported "
                f"{sorted(self.precision.supported)}"
            )
        if assumed_dtype is not None and assumed_dtype != self.precision.default:
            raise ValueError(
                f"precision.default {self.precision.default!r} contradicts recipe.assumes_precision "
                f"{self.recipe.assumes_precision!r}: a default deployment would run outside its recipe"
            )
        if self.parity.level.rank < self.recipe.consistency_required.rank:
            raise ValueError(
                f"parity.level {self.parity.level.value} is below recipe.consistency_required "
                f"{self.recipe.consistency_required.value}: the recipe's outputs are valid only at "
                f"{self.recipe.consistency_required.value} or above (ladder C0 < C1 < C2 < C3 < C4)"
            )
        self._check_parallelism()
        for task in self.capabilities.tasks:
            if not any(task in c.required_for or task in c.optional_for for c in self.checkpoint.components.values()):
                raise ValueError(f"no checkpoint component is required_for or optional_for task {task.value!r}")
        return self

    def _check_parallelism(self) -> None:
        for axis, degree in self.parallelism.max_degree.items():
            if degree <= 1:
                continue
            if not any(axis in loop.valid_parallel_axes for loop in self.loops.values()):
                raise ValueError(
                    f"parallelism.max_degree[{axis!r}] is {degree} but no loop lists {axis!r} in "
                    f"valid_parallel_axes; allowed: 1, or list the axis on the loops it is valid for"
                )
            if self.parallelism.implementation is None:
                raise ValueError(
                    f"parallelism.max_degree[{axis!r}] is {degree} but parallelism.implementation is not set: nothing "
                    f"would run the axis; allowed: 1, or name the family's parallel implementation ('module:object')"
                )

    def artifact_kinds(self, task: TaskType) -> frozenset[str] | None:
        """The artifact kinds the card's program for ``task`` can return (None: undeclared)."""
        program = self.programs.get(task)
        return None if program is None else program.returns

    @property
    def streams_sessions(self) -> bool:
        """It has a ``chunk_rollout`` loop (a causal card): it can stream realtime sessions."""
        return any(spec.kind == "chunk_rollout" for spec in self.loops.values())

    @property
    def random_weight_components(self) -> tuple[str, ...]:
        """The components whose weights are seeded random numbers (``random_init_seed``), not trained."""
        return tuple(sorted(k for k, c in self.checkpoint.components.items() if c.random_init_seed is not None))

    @property
    def random_weights(self) -> bool:
        """Whether any component is untrained: the card's outputs (text included) mean nothing."""
        return bool(self.random_weight_components)

    def denoise_loops(self) -> dict[str, LoopSpec]:
        return {k: v for k, v in self.loops.items() if v.kind == "diffusion_denoise"}

    @property
    def precisions(self) -> tuple[str, ...]:
        return tuple(p for p in PRECISIONS if p in self.precision.supported)
