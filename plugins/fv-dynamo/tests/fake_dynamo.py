"""A stand-in for Dynamo's endpoint client (``instance_ids`` / ``direct``) over in-process fv workers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fv_dynamo.worker import FvWorker

__all__ = ["FakeEndpointClient", "Item"]


class Item:
    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def data(self) -> dict[str, Any]:
        return self._data


class FakeEndpointClient:
    """Dynamo's Client over in-process workers: direct routing, and workers that can die."""

    def __init__(self, workers: dict[int, FvWorker]) -> None:
        self.workers = workers
        self.dead: set[int] = set()
        self.calls: list[tuple[int, str | None, str | None]] = []
        #: Seconds a session.start's stream waits before the worker sees it (a slow network to the worker).
        self.start_delay_s = 0.0

    def instance_ids(self) -> list[int]:
        return [i for i in self.workers if i not in self.dead]

    async def direct(self, payload: dict[str, Any], instance_id: int) -> AsyncIterator[Item]:
        if instance_id in self.dead:
            raise ConnectionError(f"instance {instance_id}: connection refused")
        self.calls.append((instance_id, payload.get("type"), payload.get("session_id")))
        worker = self.workers[instance_id]

        async def stream() -> AsyncIterator[Item]:
            if payload.get("type") == "session.start" and self.start_delay_s:
                await asyncio.sleep(self.start_delay_s)
            async for data in worker.realtime(payload):
                if instance_id in self.dead:
                    raise ConnectionError(f"instance {instance_id}: connection reset")
                yield Item(data)

        return stream()

    def kill(self, instance_id: int) -> None:
        self.dead.add(instance_id)
