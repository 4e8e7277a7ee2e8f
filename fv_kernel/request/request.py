"""The typed request: the only currency that crosses the product boundary (design §12).

A request declares its task; it carries typed modal inputs, loop parameters and an
:class:`OutputSpec`. Combinations that make no sense (an image-to-video request
without an image, a negative size) cannot be constructed.
"""

from __future__ import annotations

import math
import re
import uuid
from typing import Annotated, Any, Literal, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fv_kernel.request.types import Precision, TaskType

__all__ = [
    "TextPart",
    "ImagePart",
    "VideoPart",
    "AudioPart",
    "LatentPart",
    "ActionPart",
    "ModalPart",
    "DiffusionParams",
    "ARParams",
    "ArtifactKind",
    "OutputSpec",
    "AdapterRef",
    "MAX_ADAPTER_SCALE",
    "Request",
]


class _Part(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", frozen=True)


class TextPart(_Part):
    kind: Literal["text"] = "text"
    text: str
    role: Literal["prompt", "negative_prompt", "system"] = "prompt"


def _check_tensor(value: Any, name: str, ndim: int, layout: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor shaped {layout}")
    if value.ndim != ndim:
        raise ValueError(f"{name} must be shaped {layout}, got shape {tuple(value.shape)}")
    if not value.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor with values in [0, 1], got {value.dtype}")
    return value


class ImagePart(_Part):
    """One image as a float tensor (3, H, W) with values in [0, 1]."""

    kind: Literal["image"] = "image"
    image: torch.Tensor
    role: Literal["first_frame", "last_frame", "reference"] = "first_frame"

    @field_validator("image")
    @classmethod
    def _image(cls, value: Any) -> torch.Tensor:
        value = _check_tensor(value, "image", 3, "(3, H, W)")
        if value.shape[0] != 3:
            raise ValueError(f"image must have 3 channels first, got shape {tuple(value.shape)}")
        return value


class VideoPart(_Part):
    """Frames as a float tensor (F, 3, H, W) with values in [0, 1]."""

    kind: Literal["video"] = "video"
    frames: torch.Tensor
    fps: float = Field(gt=0)

    @field_validator("frames")
    @classmethod
    def _frames(cls, value: Any) -> torch.Tensor:
        return _check_tensor(value, "frames", 4, "(F, 3, H, W)")


class AudioPart(_Part):
    kind: Literal["audio"] = "audio"
    samples: torch.Tensor  # (channels, num_samples)
    sample_rate: int = Field(gt=0)


class LatentPart(_Part):
    kind: Literal["latent"] = "latent"
    latent: torch.Tensor
    role: Literal["initial_noise", "init_latent", "condition"] = "init_latent"


class ActionPart(_Part):
    kind: Literal["action"] = "action"
    actions: torch.Tensor  # (T, action_dim)
    domain: int = Field(ge=0)


ModalPart = Annotated[
    Union[TextPart, ImagePart, VideoPart, AudioPart, LatentPart, ActionPart], Field(discriminator="kind")
]


class DiffusionParams(BaseModel):
    """Parameters of a denoise loop. ``None`` means "the card's default"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    height: int | None = Field(default=None, gt=0)
    width: int | None = Field(default=None, gt=0)
    frames: int | None = Field(default=None, gt=0)
    fps: float | None = Field(default=None, gt=0)
    steps: int | None = Field(default=None, gt=0)
    guidance: float | None = Field(default=None, ge=0)
    #: Guidance of a second expert (two-expert cards); ``None`` = the card's default.
    guidance_2: float | None = Field(default=None, ge=0)
    #: The step from which a two-expert card runs its second expert (0..steps: steps ``< switch_step``
    #: run the first); ``None`` = the card's own boundary. Samplers that model each expert's steps
    #: as a separate sampler call restart there (``SamplerState.stage_starts``).
    switch_step: int | None = Field(default=None, ge=0)
    shift: float | None = Field(default=None, gt=0)
    sampler: str | None = None
    seed: int = Field(default=0, ge=0, lt=2**63)


class ARParams(BaseModel):
    """Parameters of an autoregressive decode loop."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(default=128, gt=0)
    temperature: float = Field(default=0.0, ge=0)
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    presence_penalty: float = 0.0
    seed: int = Field(default=0, ge=0, lt=2**63)
    stop_token_ids: tuple[int, ...] = ()


#: The kinds of artifact a program can return (``Artifact.kind``). An image is a one-frame video.
ArtifactKind = Literal["video", "audio", "text", "latent", "tensor"]


class OutputSpec(BaseModel):
    """What the caller wants back and how."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: The artifact kinds to return. None (the default): every artifact the program makes.
    #: A set must be kinds the card's program can return for the task (checked at
    #: validation when the card declares them); artifacts of other kinds are not returned.
    modalities: frozenset[ArtifactKind] | None = None
    #: Emit preview ``media.chunk`` events (e.g. frames as they decode). Off: no preview is
    #: copied or sent. Non-preview chunks (streamed text tokens) are always emitted.
    stream_previews: bool = False
    #: Behaviour capture for training (design §10): ``"off"``; ``"final"`` -- every denoise step
    #: emits a ``behavior.slice`` event (timestep, sigmas, guidance, log-prob where the sampler
    #: defines one) and the loop returns a :class:`~fv_kernel.request.artifacts.BehaviorRecord`
    #: with the seed, the schedule, the initial noise, the final latents and the conditioning;
    #: ``"steps"`` -- as ``"final"``, plus every step's input latents, model output and noise.
    #: Capture only records: the sample is bit-identical to the same request without it.
    capture_behavior: Literal["off", "final", "steps"] = "off"

    @field_validator("modalities")
    @classmethod
    def _not_empty(cls, value: frozenset[str] | None) -> frozenset[str] | None:
        if value is not None and not value:
            raise ValueError("modalities must name at least one artifact kind, or be omitted for all of them")
        return value

    def keep(self, artifacts: list[Any]) -> list[Any]:
        """The artifacts this spec asks for, in order."""
        if self.modalities is None:
            return list(artifacts)
        # A behaviour record exists only because capture_behavior asked for it.
        return [a for a in artifacts if a.kind in self.modalities or a.kind == "behavior"]


#: The largest strength magnitude an adapter may be given (ComfyUI's LoRA loaders allow -100..100).
MAX_ADAPTER_SCALE = 100.0

_ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class AdapterRef(BaseModel):
    """One adapter (a LoRA) of a stack, by its registered name, at a strength.

    ``version`` pins a content version (the registry's ``AdapterInfo.version``); validation
    fills it, so a request keeps the weights it was admitted with when a file of the same name
    is replaced while it runs. Leave it out to take the registered version.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    scale: float = 1.0
    version: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _ADAPTER_NAME_RE.match(value):
            raise ValueError(
                f"adapter name {value!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return value

    @field_validator("scale")
    @classmethod
    def _scale(cls, value: float) -> float:
        if not math.isfinite(value) or abs(value) > MAX_ADAPTER_SCALE:
            raise ValueError(f"adapter scale {value!r} is outside -{MAX_ADAPTER_SCALE:g}..{MAX_ADAPTER_SCALE:g}")
        return float(value)


_REQUIRED_PARTS: dict[TaskType, tuple[str, ...]] = {
    TaskType.TEXT_TO_VIDEO: ("text",),
    TaskType.TEXT_TO_IMAGE: ("text",),
    TaskType.TEXT_TO_VIDEO_AUDIO: ("text",),
    TaskType.TEXT_GENERATION: ("text",),
    TaskType.IMAGE_TO_VIDEO: ("image",),
    TaskType.VIDEO_TO_VIDEO: ("video",),
    TaskType.ACTION_POLICY: ("image",),
    TaskType.FORWARD_DYNAMICS: ("image", "action"),
    TaskType.INVERSE_DYNAMICS: ("video",),
}


class Request(BaseModel):
    """One generation job for one card."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", frozen=True)

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    model: str = Field(min_length=1)
    task: TaskType
    inputs: tuple[ModalPart, ...] = ()
    diffusion: DiffusionParams = DiffusionParams()
    ar: ARParams | None = None
    precision: Precision | None = None
    output: OutputSpec = OutputSpec()
    #: Rewrite the prompt with the card's reasoner before generating (cards that have one).
    prompt_upsampling: bool = False
    #: Run outside the card's trained envelope (``RecipeSpec.envelope``: frames, sizes, fps, words)
    #: instead of being refused; the departure is reported as a warning.
    allow_outside_envelope: bool = False
    #: Parameters for plugins the deployment enabled, keyed by plugin id. A request
    #: can never choose which plugins run; it can only parameterise enabled ones.
    plugin_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    #: Exact mode: the result is bit-identical to the request run alone. Its rows never share a fused
    #: call (under ``batching: throughput`` too), and any plugin parameter that alters the output
    #: distribution is refused.
    exact: bool = False
    #: Scheduling class: latency-class work is preferred over batch-class at equal age.
    priority: Literal["interactive", "batch"] = "interactive"
    #: Adapters (LoRAs) to apply, by registered name, after the card's default stack
    #: (``RecipeSpec.adapters``); naming an adapter of the default stack sets its strength
    #: (0 turns it off). Validation checks the names and pins their versions.
    adapters: tuple[AdapterRef, ...] = ()

    @model_validator(mode="after")
    def _inputs_match_task(self) -> "Request":
        kinds = {part.kind for part in self.inputs if not (isinstance(part, TextPart) and part.role != "prompt")}
        missing = [kind for kind in _REQUIRED_PARTS[self.task] if kind not in kinds]
        if missing:
            raise ValueError(f"task {self.task.value!r} needs input part(s) {missing}; got {sorted(kinds) or 'none'}")
        prompts = [p for p in self.inputs if isinstance(p, TextPart) and p.role == "prompt"]
        if len(prompts) > 1:
            raise ValueError("a request takes at most one prompt TextPart")
        seen: dict[str, int] = {}
        for index, ref in enumerate(self.adapters):
            if ref.name in seen:
                raise ValueError(
                    f"adapters[{index}].name {ref.name!r} repeats adapters[{seen[ref.name]}]; give each adapter once "
                    "(its strengths add up: use one entry with their sum)"
                )
            seen[ref.name] = index
        if self.task is TaskType.TEXT_GENERATION and self.ar is None:
            object.__setattr__(self, "ar", ARParams())
        return self

    # Convenience accessors used by loops.
    def text(self, role: str = "prompt") -> str | None:
        for part in self.inputs:
            if isinstance(part, TextPart) and part.role == role:
                return part.text
        return None

    def part(self, kind: str) -> Any | None:
        for part in self.inputs:
            if part.kind == kind:
                return part
        return None

    def with_updates(self, **changes: Any) -> "Request":
        """A validated copy with ``changes`` applied (requests are immutable)."""
        data = {name: getattr(self, name) for name in type(self).model_fields}
        data.update(changes)
        return type(self)(**data)
