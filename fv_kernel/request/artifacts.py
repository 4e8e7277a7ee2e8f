"""Typed, named outputs with provenance (design §12).

Audio carries its sample rate and video its fps as fields of the artifact, never as
passengers in an ``extra`` dict.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Literal, Union

import torch
from pydantic import Field, field_validator

from fv_kernel.state import TensorState

__all__ = [
    "Provenance",
    "VideoArtifact",
    "AudioArtifact",
    "TextArtifact",
    "LatentArtifact",
    "TensorArtifact",
    "BehaviorSlice",
    "BehaviorRecord",
    "Artifact",
]


class Provenance(TensorState):
    """Which card, loop and request produced an artifact, and under what settings."""

    model_id: str
    loop_id: str
    request_id: str
    node: str = ""
    seed: int | None = None
    weights_version: str = ""
    partial: bool = False
    #: Recipe fields the producing instance was deployed outside of under an explicit override
    #: (``ModelInstance.recipe_overrides``, e.g. ``("attention_backend",)``); empty: within its recipe.
    recipe_overrides: tuple[str, ...] = ()


class VideoArtifact(TensorState):
    """Frames (F, 3, H, W), float32 in [0, 1], at ``fps``."""

    kind: Literal["video"] = "video"
    name: str = "video"
    frames: torch.Tensor
    fps: float = Field(gt=0)
    provenance: Provenance

    @field_validator("frames")
    @classmethod
    def _frames(cls, value: torch.Tensor) -> torch.Tensor:
        if value.ndim != 4 or value.shape[1] != 3:
            raise ValueError(f"frames must be shaped (F, 3, H, W), got {tuple(value.shape)}")
        return value


class AudioArtifact(TensorState):
    """Samples (channels, N) at ``sample_rate`` Hz."""

    kind: Literal["audio"] = "audio"
    name: str = "audio"
    samples: torch.Tensor
    sample_rate: int = Field(gt=0)
    provenance: Provenance


class TextArtifact(TensorState):
    kind: Literal["text"] = "text"
    name: str = "text"
    token_ids: list[int]
    text: str
    provenance: Provenance


class LatentArtifact(TensorState):
    kind: Literal["latent"] = "latent"
    name: str = "latent"
    latent: torch.Tensor
    provenance: Provenance


class TensorArtifact(TensorState):
    kind: Literal["tensor"] = "tensor"
    name: str
    tensor: torch.Tensor
    provenance: Provenance


class BehaviorSlice(TensorState):
    """What one denoise step did, for replay and scoring (``OutputSpec.capture_behavior``).

    Scalars always; tensors (batch dim 1, the request's row) only with ``capture_behavior="steps"``.
    """

    step: int = Field(ge=0)
    #: The model's timestep and the sigmas the sampler stepped from and to.
    timestep: float
    sigma: float
    sigma_next: float
    #: The component that ran (two-expert cards switch) and the guidance it ran under.
    expert: str
    guidance: float
    branches: tuple[str, ...]
    #: Rows of the engine's execution this step shared (1: ran alone): batched numerics may differ in the last bits.
    batch_size: int = Field(default=1, ge=1)
    #: Whether the sampler drew fresh noise for this step (an SDE step).
    stochastic: bool = False
    #: log p(next latents | latents) under the sampler's step distribution, shape (1,); None
    #: where the sampler defines no density (an ODE step).
    log_prob: torch.Tensor | None = None
    #: The step's input latents x_t, the guided model output v, and the noise it drew.
    latents: torch.Tensor | None = None
    velocity: torch.Tensor | None = None
    noise: torch.Tensor | None = None


class BehaviorRecord(TensorState):
    """A captured denoise trajectory: everything needed to replay it or score it.

    Saved with :meth:`save` (``torch.save``) or :meth:`save_safetensors`; read back with
    :meth:`load` / :meth:`load_safetensors`, bit-exactly.
    """

    kind: Literal["behavior"] = "behavior"
    name: str = "behavior"
    capture: Literal["final", "steps"]
    seed: int
    #: The sampler's full config signature (``Sampler.config_signature``): it rebuilds the sampler.
    sampler: str
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    #: The seeded starting latents and the loop's final latents (what the decode loop received).
    initial_noise: torch.Tensor
    final_latents: torch.Tensor
    prompt: str
    #: The conditioning the denoiser saw (guidance branches "cond" / "uncond").
    prompt_embeds: torch.Tensor
    negative_embeds: torch.Tensor | None = None
    guidance: float
    guidance_policy: str
    precision: str
    attention_backend: str
    weights_version: str
    #: Flags that decide whether a replay is bit-exact: torch's deterministic-algorithms mode,
    #: cuDNN determinism/benchmarking, and whether any step ran batched with other requests.
    deterministic: dict[str, bool]
    steps: list[BehaviorSlice] = Field(default_factory=list)
    provenance: Provenance

    def save_safetensors(self, path: str | os.PathLike[str]) -> None:
        """Every tensor as a safetensors entry; the other fields as JSON in the file's metadata."""
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        skeleton = _split_tensors(self.model_dump(), "", tensors)
        save_file(tensors, os.fspath(path), metadata={"fv_behavior_record": json.dumps(skeleton)})

    @classmethod
    def load_safetensors(cls, path: str | os.PathLike[str]) -> "BehaviorRecord":
        from safetensors import safe_open

        with safe_open(os.fspath(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            if "fv_behavior_record" not in metadata:
                raise ValueError(f"{path} is not a BehaviorRecord safetensors file (no fv_behavior_record metadata)")
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        return cls.model_validate(_join_tensors(json.loads(metadata["fv_behavior_record"]), tensors))


_TENSOR_REF = "__tensor__"


def _split_tensors(value: Any, path: str, out: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        out[path] = value.detach().cpu().contiguous().clone()  # safetensors refuses shared storage
        return {_TENSOR_REF: path}
    if isinstance(value, dict):
        return {k: _split_tensors(v, f"{path}.{k}" if path else str(k), out) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_split_tensors(v, f"{path}.{i}", out) for i, v in enumerate(value)]
    return value


def _join_tensors(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TENSOR_REF}:
            return tensors[value[_TENSOR_REF]]
        return {k: _join_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_join_tensors(v, tensors) for v in value]
    return value


Artifact = Annotated[
    Union[VideoArtifact, AudioArtifact, TextArtifact, LatentArtifact, TensorArtifact, BehaviorRecord],
    Field(discriminator="kind"),
]
