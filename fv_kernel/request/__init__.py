"""Requests, artifacts and events: the typed currency that crosses the product boundary."""

from fv_kernel.request.artifacts import Artifact, AudioArtifact, TextArtifact, VideoArtifact
from fv_kernel.request.request import DiffusionParams, Request, TextPart
from fv_kernel.request.types import TaskType

__all__ = ["Artifact", "AudioArtifact", "DiffusionParams", "Request", "TaskType", "TextArtifact", "TextPart", "VideoArtifact"]
