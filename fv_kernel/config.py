"""The deploy config: one YAML file, validated by pydantic, unknown keys rejected.

It is the only place that chooses which plugins run, which cards are resident, the
scheduler's budgets and the request limits. Requests can only parameterise what it
enabled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fv_kernel.cache.adapters import AdapterSettings
from fv_kernel.card.spec import PrecisionPathChoice
from fv_kernel.model.validate import RequestLimits
from fv_kernel.compute.compile import ComputeOptions
from fv_kernel.errors import FvError
from fv_kernel.extend.registry import ExtensionSettings
from fv_kernel.parallel.plan import ParallelPlan
from fv_kernel.plugins.config import PluginsConfig
from fv_kernel.request.types import Precision
from fv_kernel.runtime.admission import parse_bytes
from fv_kernel.runtime.scheduler import SchedulerConfig

__all__ = ["CardDeployment", "DeployConfig", "DeployConfigError", "ServerConfig", "load_deploy_config"]


class DeployConfigError(FvError):
    error_type = "deploy_config"


class CardDeployment(BaseModel):
    """One resident card."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="card id, local checkpoint directory or hub id")
    device: str = "cpu"
    precision: Precision | None = None
    #: What runs in fp8 (docs/precision.md): a path the card lists, ``native``, or ``auto`` (the
    #: fastest listed path whose recorded measurement passes its contract); None: the card's own.
    precision_path: PrecisionPathChoice | None = None
    attention_backend: str = "sdpa"
    compute: ComputeOptions | None = None
    local_files_only: bool = False
    #: Component id -> one ``.safetensors`` file that component loads from instead of the card's checkpoint
    #: (docs/cards.md, "Component sources"): ``{transformer: models/diffusion_models/wan2.1_t2v_1.3B_fp8_scaled.safetensors}``.
    component_sources: dict[str, Path] = Field(default_factory=dict)
    #: Deploy in a ``precision`` or ``precision_path`` the card's recipe excludes (``recipe.assumes_precision``)
    #: instead of refusing with ``recipe_mismatch``; logged when the card is loaded.
    override_recipe: bool = False


class ServerConfig(BaseModel):
    """The ``server:`` section: how ``fv serve`` listens and where it keeps job metadata."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    #: Larger request bodies are refused with 413 before they are parsed.
    max_body_bytes: int = Field(default=32 * 2**20, gt=0)
    #: JSON (a body, or a multipart ``extensions`` field) nested deeper is refused with 400
    #: before it is parsed. At most 500: Python's JSON parser recurses once per level.
    max_json_depth: int = Field(default=32, ge=2, le=500)
    #: A JSON number token longer than this many characters is refused with 400 before parsing
    #: (a 64-bit seed has 19 digits; Python refuses to convert ints of more than 4300).
    max_json_number_chars: int = Field(default=64, ge=24, le=4300)
    #: An input image whose header declares more pixels (width x height) is refused with 413
    #: before a pixel is decoded (a 4096x4096 RGB image decodes to 200 MiB as float32).
    max_image_pixels: int = Field(default=4096 * 4096, gt=0)
    #: SQLite file of job metadata; None: ``<output_dir>/jobs.sqlite3``.
    db_path: Path | None = None
    #: Seconds between SSE keep-alive comments on an idle event stream.
    sse_heartbeat_s: float = Field(default=15.0, gt=0)
    #: Write a running video job's program checkpoint (``<output_dir>/checkpoints/<job id>.pt``)
    #: every this many steps, so a restarted server resumes it from there; 0: never (an
    #: interrupted job then restarts from its first step).
    checkpoint_every_steps: int = Field(default=5, ge=0)
    #: A checkpoint whose in-flight loop states hold more tensor bytes than this is not written at
    #: that step (the previous one stays, and a resume redoes the steps since): serializing a VAE
    #: decode's causal history (GBs) on the server's event loop stalls every job for seconds, for
    #: less than the decode it would save. None: no cap.
    checkpoint_max_bytes: int | None = Field(default=256 * 2**20, ge=0)
    #: Bytes of finished jobs' event streams kept in memory for late SSE subscribers (their
    #: encoded JSON); beyond it the oldest are served from the database. 0: always from disk.
    finished_history_bytes: int = Field(default=16 * 2**20, ge=0)
    #: Seconds a graceful stop (SIGTERM/SIGINT) waits for running steps to reach a step
    #: boundary and for open connections to close, before it cancels what is left.
    shutdown_timeout_s: float = Field(default=10.0, gt=0)


class DeployConfig(BaseModel):
    """The whole deployment, as an operator writes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    plugins: PluginsConfig = PluginsConfig()
    cards: list[CardDeployment] = Field(default_factory=list)
    scheduler: SchedulerConfig = SchedulerConfig()
    limits: RequestLimits = RequestLimits()
    #: Interceptors/observers to enable, by contribution name: ``{default_on, config}``.
    extensions: dict[str, ExtensionSettings] = Field(default_factory=dict)
    output_dir: Path = Path("fv-output")
    api_key: str | None = None
    server: ServerConfig = ServerConfig()
    #: The pool's parallel plan (``docs/parallelism.md``); None: one process, one device.
    #: Checked against every card before any process group or weight exists.
    parallel: ParallelPlan | None = None
    #: LoRA adapters (docs/adapters.md): where they come from, their memory tiers, the stack size
    #: and the merge policy. None (the default): adapters are off and a request naming one is refused.
    adapters: AdapterSettings | None = None

    @field_validator("adapters", mode="before")
    @classmethod
    def _adapter_sizes(cls, value: Any) -> Any:
        # Byte sizes may be written as in scheduler.budgets ("512MiB", "2GiB").
        if isinstance(value, dict):
            value = dict(value)
            for key in ("max_file_bytes", "cpu_budget_bytes", "device_budget_bytes"):
                if isinstance(value.get(key), str):
                    try:
                        value[key] = parse_bytes(value[key])
                    except ValueError as exc:
                        raise ValueError(f"{key}: {exc}") from None
        return value

    @field_validator("cards", mode="before")
    @classmethod
    def _card_shorthand(cls, value: Any) -> Any:
        # `cards: [wan-tiny]` is shorthand for `cards: [{model: wan-tiny}]`.
        if isinstance(value, list):
            return [{"model": v} if isinstance(v, str) else v for v in value]
        return value


def load_deploy_config(path: str | Path) -> DeployConfig:
    """Read and validate a deploy config; errors name the offending key."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise DeployConfigError(f"cannot read deploy config {path}: {exc}", param="config") from None
    except yaml.YAMLError as exc:
        raise DeployConfigError(f"deploy config {path} is not valid YAML: {exc}", param="config") from None
    if not isinstance(data, dict):
        raise DeployConfigError(f"deploy config {path} must be a mapping at the top level", param="config")
    try:
        return DeployConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise DeployConfigError(f"deploy config {path}: {where}: {first['msg']}", param=where) from None
