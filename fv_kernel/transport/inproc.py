"""The in-process reference transport: hands over tensor references, zero-copy."""

from __future__ import annotations

from typing import ClassVar, Mapping

import torch

from . import TensorMeta, TransferManifest, Transport, TransportError


class InProcessTransport(Transport):
    """Producer and consumer share one process, so a transfer is a dict of references.

    Holding the references (rather than copying) is the point: it is the reference
    semantics every faster backend must reproduce bit-for-bit.
    """

    name: ClassVar[str] = "inproc"

    def __init__(self) -> None:
        self._held: dict[str, dict[str, torch.Tensor]] = {}

    def publish(self, transfer_id: str, tensors: Mapping[str, torch.Tensor]) -> TransferManifest:
        if transfer_id in self._held:
            raise TransportError(f"transfer id {transfer_id!r} is already published")
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                raise TransportError(f"transfer {transfer_id!r}: {key!r} is {type(value).__name__}, expected a torch.Tensor")
        self._held[transfer_id] = dict(tensors)
        return TransferManifest(
            transfer_id=transfer_id,
            transport=self.name,
            tensors={key: TensorMeta.of(t) for key, t in tensors.items()},
        )

    def fetch(self, manifest: TransferManifest) -> dict[str, torch.Tensor]:
        if manifest.transport != self.name:
            raise TransportError(f"transfer {manifest.transfer_id!r} belongs to transport {manifest.transport!r}, not {self.name!r}")
        try:
            tensors = self._held[manifest.transfer_id]
        except KeyError:
            raise TransportError(f"transfer {manifest.transfer_id!r} is unknown or already released") from None
        self.check_received(manifest, tensors)
        return dict(tensors)

    def release(self, manifest: TransferManifest) -> None:
        if self._held.pop(manifest.transfer_id, None) is None:
            raise TransportError(f"transfer {manifest.transfer_id!r} is unknown or already released")

    def close(self) -> None:
        self._held.clear()

    @property
    def pending(self) -> int:
        """Transfers published and not yet released."""
        return len(self._held)
