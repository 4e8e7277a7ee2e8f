"""The kernel's public API: the one module plugins import from.

Everything a model family, interceptor, transport or integration needs is
re-exported here; anything not here is internal and may change without notice.
The plugin API version is :data:`API_VERSION`.
"""

from __future__ import annotations

from fv_kernel import API_VERSION, __version__
from fv_kernel.cache.feature import FeatureCache
from fv_kernel.cache.keys import CacheKey, content_hash
from fv_kernel.cache.paged_kv import CacheFull, KVBlockTable, PagedKVConfig, PagedKVPool
from fv_kernel.cache.block_pool import BlockPool
from fv_kernel.cache.slab_kv import (
    AttendedChunk, SlabKVConfig, SlabKVPool, SlabWindow, SlabWindowSpec, TrainingRollout,
)
from fv_kernel.model.buildcheck import BuildProblem, InvalidCard, check_card_builds, parse_component_config
from fv_kernel.model.catalog import CardCatalog, ResolvedModel
from fv_kernel.card.checkpoint import apply_key_map, dtype_for_key, load_into, read_safetensors, resolve_source
from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.component_sources import check_component_sources, component_source, component_sources_version
from fv_kernel.model.instance import ModelInstance, build_instance
from fv_kernel.loop.plan import StepOp
from fv_kernel.card.refs import import_object
from fv_kernel.model.preflight import InsufficientMemory, PreflightReport, preflight
from fv_kernel.model.precision import (
    FP8_ATTENTION_BACKEND,
    PrecisionPathSelection,
    apply_precision_path,
    fp8_target_paths,
    select_precision_path,
    uses_fp8_attention,
    stores_fp8,
    prepare_fp8_storage,
)
from fv_kernel.card.spec import (
    AttentionAssumption,
    BatchedVsAlone,
    CacheContract,
    CapabilityMatrix,
    CheckpointManifest,
    ComponentCheckpoint,
    ComponentSpec,
    FrameRule,
    GenerationDefaults,
    KeyMapRule,
    LoopSpec,
    ModelCard,
    ParallelismContract,
    ParityLevel,
    ParitySpec,
    ParityTolerance,
    PrecisionContract,
    PrecisionPolicy,
    FP8_ATTENTION_PATHS,
    FP8_LINEAR_PATHS,
    PRECISION_PATHS,
    PrecisionPath,
    PrecisionPathChoice,
    PrecisionPathContract,
    PrecisionPathMeasurement,
    PrecisionPathSample,
    PrecisionPathVerdict,
    QuantizedFrom,
    ProgramSpec,
    RecipeSpec,
    SamplerBinding,
    StepCostSpec,
    TextVocabulary,
    TIER_PARITY_CONTRACTS,
    TierParityContract,
    TierParityMeasurement,
    TierParityRecord,
    TierParitySample,
    TierComponent,
    TierVerdict,
    TokenGridRule,
    TrainedEnvelope,
)
from fv_kernel.model.validate import RequestLimits, frames_for_seconds, resolve_for_instance, resolve_request
from fv_kernel.card.recipe import EnvelopeWarning, check_envelope, select_denoise_loop
from fv_kernel.errors import (
    CapacityError,
    CheckpointKeyError,
    CheckpointNotFound,
    FvError,
    InvalidRequest,
    NonFiniteOutput,
    QueueFull,
    RecipeMismatch,
    RequestCancelled,
    StepFailed,
    UnknownModel,
    UnknownAdapter,
    AdapterFileError,
)
from fv_kernel.compute.attention import AttentionBackend, AttentionShapeError
from fv_kernel.config import DeployConfig, DeployConfigError, load_deploy_config
from fv_kernel.compute.attention_backends import attention_callable
from fv_kernel.plugins.registry import load_attention_backend
from fv_kernel.compute.video_sparse_attention import VideoSparseAttention
from fv_kernel.compute.compile import (
    CompileCache,
    CompileKey,
    ComputeOptions,
    GraphedStep,
    ParityRecordError,
    TierSelection,
    compile_blocks,
    load_parity_record,
    select_compute_tiers,
)
from fv_kernel.compute.fused import select_fused_ops
from fv_kernel.compute.fp8 import (
    E4M3_MAX,
    Fp8Error,
    Fp8Kernel,
    Fp8Linear,
    Fp8Mode,
    QuantizedRows,
    dequantize_e4m3,
    quantize_e4m3,
    quantize_linears,
    quantize_rows_e4m3,
    takes_quantized_rows,
)
from fv_kernel.compute.lora import (
    AdapterError,
    AdapterKeyError,
    AdapterStack,
    AdapterWeights,
    LowRankUpdate,
    MergedAdapters,
    RowAdapters,
    merge_adapters,
    rows_adapted,
    stack_key,
)
from fv_kernel.cache.adapters import AdapterInfo, AdapterRegistry, AdapterSettings
from fv_kernel.card.adapters import AdapterFile, read_adapter_bytes, read_adapter_file
from fv_kernel.model.adapters import AdapterConverter, combined_stack, convert_peft, converter_for
from fv_kernel.extend.hooks import BlockHooks, RequestHooks
from fv_kernel.extend.interceptors import BlockCall, BlockInterceptor, BlockSequence, Interceptor, StepInterceptor
from fv_kernel.extend.observers import BlockObserver, NaNWatch, Observer, ParityAligner, StepRecord
from fv_kernel.runtime.cost import Profiler
from fv_kernel.extend.registry import ExtensionSet, ExtensionSettings, InterceptorRejected
from fv_kernel.io.media import encode_png, write_mp4
from fv_kernel.facade import Chunk, Finished, GenerateOptions, Session, Video, VideoGenerator, load
from fv_kernel.loop.capture import LogProbSampler, capture_slice, deterministic_flags
from fv_kernel.loop.contract import CancelToken, LoopContext, ResidentModel, StepHooks
from fv_kernel.loop.plan import (
    CachePlan,
    CacheRef,
    CancelScope,
    EmitSpec,
    ResourceRequest,
    ShapeSignature,
    StepEstimate,
    StepResult,
    WorkKind,
    WorkPlan,
)
from fv_kernel.loop.contract import Done, Loop, LoopResult, LoopState
from fv_kernel.loop.driver import LoopCancelled, drive, resume
from fv_kernel.loop.realtime import SESSION_UPSTREAM, ChunkRolloutLoop, ChunkRolloutState, ReadyChunk
from fv_kernel.loop.guidance import (
    CFGZeroStar,
    ConditionalOnly,
    EmbeddedGuidance,
    GuidancePolicy,
    GuidanceRescale,
    StandardCFG,
    builtin_guidance_policies,
)
from fv_kernel.loop.samplers import (
    DMDSampler,
    FlowEulerSampler,
    FlowUniPCSampler,
    Sampler,
    SamplerState,
    UniPCState,
    SamplerError,
    add_noise,
    shift_sigmas,
    bound_sampler,
    builtin_samplers,
    registered_samplers,
    sampler_class,
    sampler_from_state,
)
from fv_kernel.loop.sampling import apply_presence_penalty, sample_next_token
from fv_kernel.state import (
    StateFormatError,
    StateNotSerializable,
    TensorState,
    generator_from_state,
    new_generator_state,
)
from fv_kernel.parallel import (
    ParallelImplementation,
    ParallelPlan,
    ParallelPlanError,
    ParallelRuntime,
    RankFailure,
    SequenceParallelAttention,
    gather_sequence,
    halo_exchange,
    ring_attention,
    shard_sequence,
)
from fv_kernel.plugins.hookspecs import hookimpl
from fv_kernel.plugins.config import PluginsConfig
from fv_kernel.plugins.errors import PluginError
from fv_kernel.plugins.host import PluginHost
from fv_kernel.program.base import InlineProgram, Program, ProgramCompiler
from fv_kernel.program.resume import (
    CheckpointIncompatible,
    ProgramCheckpoint,
    ProgramNotResumable,
    ProgramRun,
    run_program,
)
from fv_kernel.request.artifacts import (
    Artifact,
    AudioArtifact,
    BehaviorRecord,
    BehaviorSlice,
    LatentArtifact,
    Provenance,
    TensorArtifact,
    TextArtifact,
    VideoArtifact,
)
from fv_kernel.request.events import (
    ErrorInfo,
    Event,
    MediaChunk,
    SessionClosedEvent,
    SessionError,
    SessionPromptApplied,
    SessionPromptQueued,
    SessionResumed,
    SessionStarted,
    SessionSuspended,
)
from fv_kernel.request.session import CANCEL_SCOPES, SessionClosed, SessionRequest, check_cancel_scope
from fv_kernel.request.session import CancelScope as SessionCancelScope
from fv_kernel.request.request import (
    ActionPart,
    AdapterRef,
    ARParams,
    AudioPart,
    DiffusionParams,
    ImagePart,
    LatentPart,
    OutputSpec,
    Request,
    TextPart,
    VideoPart,
)
from fv_kernel.request.types import Precision, TaskType, torch_dtype
from fv_kernel.runtime.blocking import run_blocking
from fv_kernel.runtime.cost import CostKey, CostModel
from fv_kernel.deploy.engine import build_engine
from fv_kernel.runtime.engine import Engine, run_concurrently, run_serially
from fv_kernel.runtime.records import GenerationResult, RequestHandle
from fv_kernel.runtime.sessions import SessionHandle
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.runtime.local import run_local, run_local_async
from fv_kernel.training import LossLog, NoOptions, ParityResult, Reward, RLMethod, TrainedModel, TrainingRun
from fv_kernel.training.recipe import RecipeError, TrainingRecipe
from fv_kernel.training.rewards import resolve_reward
from fv_kernel.model.catalog import read_card_file_beside
from fv_kernel.training.runner import CARD_FILE, ExportError
from fv_kernel.transport import TensorMeta, TransferManifest, Transport, TransportError
from fv_kernel.transport.inproc import InProcessTransport

__all__ = [name for name in dir() if not name.startswith("_") and name != "annotations"]

#: fv serve's request schemas and error mapping (its structured 4xx), for integrations that
#: serve the same API through another frontend. Imported on first use: importing
#: fv_kernel.serving imports FastAPI (the ``serve`` extra), which the rest of the API never needs.
_SERVING_EXPORTS = {
    "ApiError": "fv_kernel.serving.errors",
    "error_body": "fv_kernel.serving.errors",
    "from_fv_error": "fv_kernel.serving.errors",
    "from_validation_errors": "fv_kernel.serving.errors",
    "VideoCreate": "fv_kernel.serving.schemas",
    "ImageGenerate": "fv_kernel.serving.schemas",
    "parse_size": "fv_kernel.serving.schemas",
    # Realtime sessions' protocol, for workers that carry it over another transport (fv-dynamo).
    "ProtocolError": "fv_kernel.serving.realtime",
    "RealtimeConnection": "fv_kernel.serving.realtime",
    "RealtimeLimits": "fv_kernel.serving.realtime",
    "RealtimeSession": "fv_kernel.serving.realtime",
    "WS_PATH": "fv_kernel.serving.realtime",
    "chunk_as_json": "fv_kernel.serving.realtime",
    "chunk_from_json": "fv_kernel.serving.realtime",
    "open_realtime_session": "fv_kernel.serving.realtime",
    "parse_client_message": "fv_kernel.serving.realtime",
    "parse_interaction": "fv_kernel.serving.realtime",
    "realtime_authorized": "fv_kernel.serving.realtime",
}
__all__ += list(_SERVING_EXPORTS)


def __getattr__(name: str) -> object:
    module = _SERVING_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fv_kernel.api' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
