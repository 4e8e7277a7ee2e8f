"""Vocabulary shared by requests, cards and loops."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["TaskType", "Precision", "PRECISIONS", "torch_dtype", "torch_dtype_name"]


class TaskType(str, Enum):
    """What a request asks for. Declared by the caller, never inferred from its inputs."""

    TEXT_TO_VIDEO = "text_to_video"
    IMAGE_TO_VIDEO = "image_to_video"
    TEXT_TO_IMAGE = "text_to_image"
    VIDEO_TO_VIDEO = "video_to_video"
    TEXT_TO_VIDEO_AUDIO = "text_to_video_audio"
    TEXT_GENERATION = "text_generation"
    ACTION_POLICY = "action_policy"
    FORWARD_DYNAMICS = "forward_dynamics"
    INVERSE_DYNAMICS = "inverse_dynamics"


#: Numeric precisions a card or request can name.
Precision = Literal["fp32", "bf16", "fp16", "fp8_e4m3", "nvfp4"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8_e4m3", "nvfp4")

_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def torch_dtype(precision: str) -> "torch.dtype":
    """The torch dtype that holds weights of ``precision`` (a typed error for quantized formats)."""
    import torch

    return getattr(torch, torch_dtype_name(precision))


def torch_dtype_name(precision: str) -> str:
    """The torch dtype name that holds weights of ``precision`` (quantized formats have none)."""
    try:
        return _TORCH_DTYPES[precision]
    except KeyError:
        raise ValueError(
            f"precision {precision!r} has no plain torch dtype; allowed: {sorted(_TORCH_DTYPES)}"
        ) from None
