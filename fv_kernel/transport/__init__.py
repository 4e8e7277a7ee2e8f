"""The transport driver contract: manifest-based hand-off of named tensors between roles.

A sender publishes tensors under a transfer id and gets a :class:`TransferManifest`
(names, shapes, dtypes, devices); the receiver pulls with that manifest and then
releases it. Backends (in-process, shared memory, CUDA IPC, NCCL, NIXL…) are named
drivers in the ``fv.transports`` entry-point group.
"""

from __future__ import annotations

import abc
from typing import ClassVar, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field


class TransportError(RuntimeError):
    """A transfer is unknown, already released, or does not match its manifest."""


class TensorMeta(BaseModel):
    """What a receiver needs to know about one tensor before pulling it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    shape: tuple[int, ...]
    dtype: str
    device: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        return cls(shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."), device=str(tensor.device))


class TransferManifest(BaseModel):
    """A published transfer: its id, the transport that holds it, and its tensors."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    transfer_id: str = Field(min_length=1)
    transport: str
    tensors: dict[str, TensorMeta]


class Transport(abc.ABC):
    """Moves named tensors from a producer to a consumer, described by a manifest."""

    #: The driver's registry name (its entry-point name).
    name: ClassVar[str]

    @abc.abstractmethod
    def publish(self, transfer_id: str, tensors: Mapping[str, torch.Tensor]) -> TransferManifest:
        """Make ``tensors`` available under ``transfer_id``; a taken id is a :class:`TransportError`."""

    @abc.abstractmethod
    def fetch(self, manifest: TransferManifest) -> dict[str, torch.Tensor]:
        """Return the tensors described by ``manifest``; they must match it exactly."""

    @abc.abstractmethod
    def release(self, manifest: TransferManifest) -> None:
        """Free the transfer's resources; fetching it afterwards is a :class:`TransportError`."""

    def close(self) -> None:
        """Release everything still held. The default does nothing."""

    def check_received(self, manifest: TransferManifest, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise :class:`TransportError` unless ``tensors`` match ``manifest`` name for name."""
        if set(tensors) != set(manifest.tensors):
            raise TransportError(
                f"transfer {manifest.transfer_id!r}: received tensors {sorted(tensors)}, manifest lists {sorted(manifest.tensors)}"
            )
        for key, meta in manifest.tensors.items():
            got = TensorMeta.of(tensors[key])
            if got != meta:
                raise TransportError(f"transfer {manifest.transfer_id!r}: tensor {key!r} is {got}, manifest says {meta}")


__all__ = ["TensorMeta", "TransferManifest", "Transport", "TransportError"]
