"""The cost-aware router: each request goes to the worker where it is predicted to finish first.

Built on Dynamo's direct routing (``Client.direct``). Per worker it knows:

- **the price** of this request there, in GPU-seconds and steps: the worker's quote from
  its own calibrated cost model (``fleet`` endpoint, ``op: quote``). Prices depend on the
  request's shape, not its prompt or seed, so a quote is reused per (worker, shape) for
  ``price_ttl_s`` (requests of one shape arriving together share one quote).
- **the work there**: each in-flight request's GPU-seconds and steps still to run, from the
  worker's live load (``op: load``, polled every ``poll_interval_s``, off the request path),
  plus the requests this router sent there that the report does not list yet (its own ledger,
  matched by the route id it puts in ``extra_args.fv_route_id``; progress chunks keep it
  current), so a request in transit is never forgotten nor counted twice.

The engine interleaves its running requests step by step, so the predicted finish of a new
request is its price plus, for every job there, the part of that job whose steps overlap
its own (:attr:`Quote.predicted_finish_s`). The request goes to the earliest. Fallbacks are
Dynamo's own routers: when no worker can be quoted, the request goes through
``Client.round_robin`` (or ``random``), and :attr:`CostAwareRouter.fallbacks` counts it. A
request the workers refuse (fv serve's 4xx body) is refused here, unrouted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal, Mapping

from fv_dynamo.requests import FleetRequestError

__all__ = ["CostAwareRouter", "Quote", "choose_worker", "RoutingDecision", "shape_key"]

log = logging.getLogger("fv.dynamo.router")

Kind = Literal["videos", "images"]

#: Fields that do not change a request's price (its content, not its shape).
_PRICE_FREE = frozenset({"prompt", "negative_prompt", "seed", "user", "stream"})


@dataclass(frozen=True)
class Quote:
    """One worker's numbers for one request: its price and step count there, and the work already there."""

    instance_id: int
    gpu_seconds: float
    steps: float
    #: (GPU-seconds, steps) still to run, per request in flight at the worker.
    jobs: tuple[tuple[float, float], ...] = ()

    @property
    def queued_gpu_seconds(self) -> float:
        return sum(r for r, _ in self.jobs)

    @property
    def predicted_finish_s(self) -> float:
        """When this request would be done there, in GPU-seconds from now.

        The engine interleaves running requests step by step, so each step of this request
        waits for one step of every other request still running: a job with ``r`` seconds
        over ``k`` steps left delays it by ``r * min(1, steps / k)`` (all of ``r`` when it
        outlasts this request, the share of its steps that overlap when it does not). Plain
        queued seconds would price a long video as a wall before a short image, and a
        pile of short requests as cheap.
        """
        return self.gpu_seconds + sum(r * min(1.0, self.steps / max(k, 1.0)) for r, k in self.jobs)


@dataclass(frozen=True)
class RoutingDecision:
    instance_id: int | None
    #: "cost" (chosen by quotes) or the Dynamo router used as fallback.
    how: str
    predicted_finish_s: float | None = None


def choose_worker(quotes: list[Quote], last_sent: Mapping[int, float] | None = None) -> Quote:
    """The quote with the earliest predicted finish (to the millisecond); ties go to fewer jobs, then to the
    worker sent to least recently (``last_sent``), then the lower id, so idle equal workers take turns."""
    if not quotes:
        raise ValueError("no quotes to choose from")
    last = last_sent or {}
    return min(quotes, key=lambda q: (round(q.predicted_finish_s, 3), len(q.jobs), last.get(q.instance_id, -1.0),
                                      q.instance_id))


def shape_key(kind: Kind, payload: Mapping[str, Any]) -> str:
    """What a request's price depends on: everything but its prompt, seed and stream flag."""

    def strip(fields: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in fields.items() if k not in _PRICE_FREE}

    shaped = strip(payload)
    if isinstance(payload.get("nvext"), Mapping):
        shaped["nvext"] = strip(payload["nvext"])
    extra = payload.get("extra_args")
    if isinstance(extra, Mapping) and isinstance(extra.get("media_passthrough"), Mapping):
        shaped["extra_args"] = {**extra, "media_passthrough": strip(extra["media_passthrough"])}
    return kind + ":" + json.dumps(shaped, sort_keys=True, default=str)


@dataclass
class _Sent:
    """A request this router sent: its price and steps there, when, and how far it got (its chunks)."""

    price: float
    steps: float
    sent_at: float
    progress: float = 0.0  # 0..1

    @property
    def job(self) -> tuple[float, float]:
        return self.price * (1.0 - self.progress), self.steps * (1.0 - self.progress)


@dataclass
class CostAwareRouter:
    """Routes fv requests across the workers of ``<namespace>.<component>`` by predicted GPU-seconds."""

    runtime: Any
    namespace: str = "fv"
    component: str = "fv"
    #: A worker that has not quoted within this is skipped for this request.
    quote_timeout_s: float = 2.0
    #: How long a worker's price for one request shape is reused (its calibration drifts slowly).
    price_ttl_s: float = 2.0
    #: How often each worker's live load is read, in the background.
    poll_interval_s: float = 0.25
    fallback: Literal["round_robin", "random"] = "round_robin"
    fallbacks: int = 0
    quotes_asked: int = 0
    decisions: list[RoutingDecision] = field(default_factory=list)
    _clients: dict[str, Any] = field(default_factory=dict)
    #: (worker, shape) -> (price, steps, when quoted)
    _prices: dict[tuple[int, str], tuple[float, float, float]] = field(default_factory=dict)
    #: worker -> (when its load was asked, its in-flight jobs, the route ids among them)
    _reported: dict[int, tuple[float, tuple[tuple[float, float], ...], frozenset[str]]] = field(default_factory=dict)
    #: This router's prefix for the route ids it gives requests (``extra_args.fv_route_id``).
    _route_prefix: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    #: worker -> when this router last sent it a request (ties go to the one idle longest).
    _last_sent: dict[int, float] = field(default_factory=dict)
    _ledger: dict[int, dict[int, _Sent]] = field(default_factory=dict)
    _next_token: int = 0
    _quoting: dict[tuple[int, str], asyncio.Future[float | None]] = field(default_factory=dict)
    _poller: asyncio.Task[None] | None = None

    async def start(self, kinds: tuple[Kind, ...] = ("videos",)) -> None:
        """Connect to the fleet endpoint and the ``kinds`` endpoints; wait for a worker of each; start polling loads."""
        for name in ("fleet", *kinds):
            client = await self.runtime.endpoint(f"{self.namespace}.{self.component}.{name}").client()
            await client.wait_for_instances()
            self._clients[name] = client
        # The first call to an instance opens its connection (~0.5 s on loopback): now, not in a request's path.
        await self._poll_once()
        self._poller = asyncio.ensure_future(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None

    # -- worker state -------------------------------------------------------------------
    async def _ask(self, instance_id: int, message: dict[str, Any]) -> dict[str, Any]:
        async def ask() -> dict[str, Any]:
            stream = await self._clients["fleet"].direct(message, instance_id)
            async for item in stream:
                return item.data()
            raise RuntimeError("empty answer")

        return await asyncio.wait_for(ask(), self.quote_timeout_s)

    def _record_load(self, instance_id: int, asked_at: float, answer: Mapping[str, Any]) -> None:
        entries = answer.get("requests", [])
        jobs = tuple((float(e[0]), float(e[1])) for e in entries)
        ids = frozenset(str(e[2]) for e in entries if len(e) > 2 and e[2] is not None)
        if asked_at >= self._reported.get(instance_id, (-1.0, (), frozenset()))[0]:
            self._reported[instance_id] = (asked_at, jobs, ids)

    async def _poll_once(self) -> None:
        ids = self._clients["fleet"].instance_ids()
        asked_at = time.monotonic()
        answers = await asyncio.gather(*(self._ask(i, {"op": "load"}) for i in ids), return_exceptions=True)
        for instance_id, answer in zip(ids, answers):
            if isinstance(answer, dict) and "requests" in answer:
                self._record_load(instance_id, asked_at, answer)
        for gone in set(self._reported) - set(ids):
            self._reported.pop(gone, None)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self._poll_once()
            except Exception as exc:  # noqa: BLE001 - a failed poll keeps the last numbers
                log.warning("load poll failed: %s", exc)

    async def _price(self, instance_id: int, kind: Kind, payload: Mapping[str, Any], key: str) -> tuple[float, float] | None:
        cached = self._prices.get((instance_id, key))
        if cached is not None and time.monotonic() - cached[2] < self.price_ttl_s:
            return cached[0], cached[1]
        pending = self._quoting.get((instance_id, key))
        if pending is None:  # requests of one shape arriving together share one quote
            pending = self._quoting[(instance_id, key)] = asyncio.ensure_future(self._quote(instance_id, kind, payload, key))
            pending.add_done_callback(lambda _: self._quoting.pop((instance_id, key), None))
        return await asyncio.shield(pending)

    async def _quote(self, instance_id: int, kind: Kind, payload: Mapping[str, Any], key: str) -> tuple[float, float] | None:
        asked_at = time.monotonic()
        self.quotes_asked += 1
        try:
            answer = await self._ask(instance_id, {"op": "quote", "kind": kind, "request": dict(payload)})
        except Exception as exc:  # noqa: BLE001 - a worker that cannot quote is skipped, not fatal
            log.warning("worker %s did not quote: %s", instance_id, exc)
            return None
        if "error" in answer:
            raise FleetRequestError(int(answer.get("status", 400)), {"error": answer["error"]})
        price, steps = float(answer["gpu_seconds"]), float(answer["steps"])
        self._prices[(instance_id, key)] = (price, steps, asked_at)
        self._record_load(instance_id, asked_at, answer)
        return price, steps

    def jobs(self, instance_id: int) -> tuple[tuple[float, float], ...]:
        """The work at a worker: its last report, plus what this router sent there that the report does not
        list (by route id: requests still in transit, or submitted after the report was computed)."""
        _, reported, ids = self._reported.get(instance_id, (-1.0, (), frozenset()))
        mine = tuple(s.job for token, s in self._ledger.get(instance_id, {}).items() if self._route_id(token) not in ids)
        return reported + mine

    def _route_id(self, token: int) -> str:
        return f"{self._route_prefix}-{token}"

    def queued(self, instance_id: int) -> float:
        """GPU-seconds queued at a worker (reported, plus sent since the report)."""
        return sum(r for r, _ in self.jobs(instance_id))

    async def decide(self, kind: Kind, payload: Mapping[str, Any]) -> tuple[RoutingDecision, tuple[float, float]]:
        """Where ``payload`` goes, and its (price, steps) there."""
        instance_ids = sorted(set(self._clients[kind].instance_ids()) & set(self._clients["fleet"].instance_ids()))
        key = shape_key(kind, payload)
        prices = await asyncio.gather(*(self._price(i, kind, payload, key) for i in instance_ids))
        quotes = [Quote(i, p[0], p[1], self.jobs(i)) for i, p in zip(instance_ids, prices) if p is not None]
        if not quotes:
            self.fallbacks += 1
            return RoutingDecision(None, self.fallback), (0.0, 0.0)
        best = choose_worker(quotes, self._last_sent)
        return RoutingDecision(best.instance_id, "cost", best.predicted_finish_s), (best.gpu_seconds, best.steps)

    async def generate(self, kind: Kind, payload: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Route one request and yield the worker's chunks (videos stream, so progress updates the
        ledger; the last chunk is the result)."""
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
        token = self._next_token
        self._next_token += 1
        self._last_sent[target] = time.monotonic()
        sent = self._ledger.setdefault(target, {})[token] = _Sent(price[0], price[1], time.monotonic())
        extra = dict(request.get("extra_args") or {})
        request["extra_args"] = {**extra, "fv_route_id": self._route_id(token)}
        try:
            stream = await client.direct(request, target)
            async for item in stream:
                chunk = item.data()
                if isinstance(chunk, dict) and isinstance(chunk.get("progress"), (int, float)):
                    sent.progress = max(sent.progress, min(float(chunk["progress"]) / 100.0, 1.0))
                yield chunk
        except Exception as exc:
            refusal = _refusal(exc)
            if refusal is not None:
                raise refusal from None
            raise
        finally:
            self._ledger[target].pop(token, None)


def _refusal(exc: BaseException) -> FleetRequestError | None:
    """fv serve's 4xx body when a worker refused the request (Dynamo's InvalidArgument carries it)."""
    try:
        body = json.loads(str(exc))
    except ValueError:
        return None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return FleetRequestError(400, body)
    return None
