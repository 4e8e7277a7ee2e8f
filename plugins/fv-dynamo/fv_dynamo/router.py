"""The cost-aware router: each request goes to the worker with the least predicted GPU-seconds queued.

Built on Dynamo's direct routing (``Client.direct``). For every request it asks each
worker's ``fleet`` endpoint for a quote: that worker's price for this request (its own
calibrated cost model, so a slower or differently configured worker quotes more) and the
GPU-seconds already queued there (its live queue, each in-flight request's price times
the share not yet done). It picks the least ``queued + in transit + price``, where *in
transit* is what this router has sent to the worker that the worker has not yet
acknowledged (the worker's first chunk), so two requests routed back to back do not both
land on the worker that looked idle.

Fallbacks are Dynamo's own routers: when no worker answers a quote in time, the request
goes through ``Client.round_robin`` (or ``random``), and :attr:`CostAwareRouter.fallbacks`
counts it. A request the workers refuse (fv serve's 4xx body) is refused here, unrouted.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal, Mapping

from fv_dynamo.requests import FleetRequestError

__all__ = ["CostAwareRouter", "Quote", "choose_worker", "RoutingDecision"]

log = logging.getLogger("fv.dynamo.router")

Kind = Literal["videos", "images"]


@dataclass(frozen=True)
class Quote:
    """One worker's answer for one request."""

    instance_id: int
    gpu_seconds: float
    queued_gpu_seconds: float
    running: int = 0


@dataclass(frozen=True)
class RoutingDecision:
    instance_id: int | None
    #: "cost" (chosen by quotes) or the Dynamo router used as fallback.
    how: str
    predicted_finish_s: float | None = None


def choose_worker(quotes: list[Quote], in_transit: Mapping[int, float]) -> Quote:
    """The quote with the least predicted GPU-seconds until this request is done there.

    Ties (equal predictions) go to the worker with fewer running requests, then the lower id,
    so the choice is deterministic for a given state.
    """
    if not quotes:
        raise ValueError("no quotes to choose from")
    return min(quotes, key=lambda q: (q.queued_gpu_seconds + in_transit.get(q.instance_id, 0.0) + q.gpu_seconds,
                                      q.running, q.instance_id))


@dataclass
class CostAwareRouter:
    """Routes fv requests across the workers of ``<namespace>.<component>`` by predicted GPU-seconds."""

    runtime: Any
    namespace: str = "fv"
    component: str = "fv"
    #: A worker that has not quoted within this is skipped for this request.
    quote_timeout_s: float = 2.0
    fallback: Literal["round_robin", "random"] = "round_robin"
    fallbacks: int = 0
    decisions: list[RoutingDecision] = field(default_factory=list)
    _clients: dict[str, Any] = field(default_factory=dict)
    _in_transit: dict[int, float] = field(default_factory=dict)
    _ids: Any = field(default_factory=itertools.count)

    async def start(self, kinds: tuple[Kind, ...] = ("videos",)) -> None:
        """Connect to the fleet endpoint and the ``kinds`` endpoints; wait for at least one worker of each."""
        for name in ("fleet", *kinds):
            client = await self.runtime.endpoint(f"{self.namespace}.{self.component}.{name}").client()
            await client.wait_for_instances()
            self._clients[name] = client
        # One load query per worker now: the first call to an instance opens its connection
        # (~0.5 s on loopback), which must not count against the first request's quote timeout.
        await asyncio.gather(*(self._load(i) for i in self._clients["fleet"].instance_ids()), return_exceptions=True)

    async def _load(self, instance_id: int) -> dict[str, Any]:
        stream = await self._clients["fleet"].direct({"op": "load"}, instance_id)
        async for item in stream:
            return item.data()
        raise RuntimeError("empty load answer")

    async def _quote(self, instance_id: int, kind: Kind, payload: Mapping[str, Any]) -> Quote | None:
        async def ask() -> dict[str, Any]:
            stream = await self._clients["fleet"].direct({"op": "quote", "kind": kind, "request": dict(payload)}, instance_id)
            async for item in stream:
                return item.data()
            raise RuntimeError("empty quote")

        try:
            answer = await asyncio.wait_for(ask(), self.quote_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a worker that cannot quote is skipped, not fatal
            log.warning("worker %s did not quote: %s", instance_id, exc)
            return None
        if "error" in answer:
            raise FleetRequestError(int(answer.get("status", 400)), {"error": answer["error"]})
        return Quote(instance_id, float(answer["gpu_seconds"]), float(answer["queued_gpu_seconds"]),
                     int(answer.get("running", 0)))

    async def decide(self, kind: Kind, payload: Mapping[str, Any]) -> tuple[RoutingDecision, float]:
        """Where ``payload`` goes, and the price charged to that worker's in-transit ledger."""
        instance_ids = sorted(set(self._clients[kind].instance_ids()) & set(self._clients["fleet"].instance_ids()))
        quotes = [q for q in await asyncio.gather(*(self._quote(i, kind, payload) for i in instance_ids)) if q is not None]
        if not quotes:
            self.fallbacks += 1
            return RoutingDecision(None, self.fallback), 0.0
        best = choose_worker(quotes, self._in_transit)
        finish = best.queued_gpu_seconds + self._in_transit.get(best.instance_id, 0.0) + best.gpu_seconds
        return RoutingDecision(best.instance_id, "cost", finish), best.gpu_seconds

    async def generate(self, kind: Kind, payload: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Route one request and yield the worker's chunks (a streaming request to the worker, so the
        first chunk acknowledges it; the caller gets every chunk, the last one is the result)."""
        decision, price = await self.decide(kind, payload)
        self.decisions.append(decision)
        client = self._clients[kind]
        request = {**payload, "stream": True} if kind == "videos" else dict(payload)
        if decision.instance_id is None:
            stream = await getattr(client, self.fallback)(request)
            async for item in stream:
                yield item.data()
            return
        target = decision.instance_id
        self._in_transit[target] = self._in_transit.get(target, 0.0) + price
        acknowledged = False
        try:
            stream = await client.direct(request, target)
            async for item in stream:
                if not acknowledged:
                    acknowledged = True
                    self._in_transit[target] -= price
                yield item.data()
        except Exception as exc:
            refusal = _refusal(exc)
            if refusal is not None:
                raise refusal from None
            raise
        finally:
            if not acknowledged:
                self._in_transit[target] -= price


def _refusal(exc: BaseException) -> FleetRequestError | None:
    """fv serve's 4xx body when a worker refused the request (Dynamo's InvalidArgument carries it)."""
    try:
        body = json.loads(str(exc))
    except ValueError:
        return None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return FleetRequestError(400, body)
    return None
