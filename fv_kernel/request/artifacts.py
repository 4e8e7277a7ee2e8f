"""Typed, named outputs with provenance (design §12).

Audio carries its sample rate and video its fps as fields of the artifact, never as
passengers in an ``extra`` dict.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import torch
from pydantic import Field, field_validator

from fv_kernel.loop.state import TensorState

__all__ = [
    "Provenance",
    "VideoArtifact",
    "AudioArtifact",
    "TextArtifact",
    "LatentArtifact",
    "TensorArtifact",
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


Artifact = Annotated[
    Union[VideoArtifact, AudioArtifact, TextArtifact, LatentArtifact, TensorArtifact], Field(discriminator="kind")
]
