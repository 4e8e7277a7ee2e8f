"""``/metrics``: the engine's and the API's figures through ``prometheus-client``.

Each app owns one :class:`ServingMetrics` with its own ``CollectorRegistry`` (two apps in
one process, as in the tests, never share or double-register a metric). The engine's
counters are read at scrape time by a custom collector, so the engine stays free of any
Prometheus dependency; HTTP request latency is a ``Histogram`` observed by
:class:`RequestMetricsMiddleware`; process metrics (CPU, RSS, open fds, start time) come
from ``ProcessCollector``. The exposition format follows the scraper's ``Accept`` header
(Prometheus text or OpenMetrics).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import Match

from fv_kernel.cache.slab_kv import SlabKVPool
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.pricing import pool_key
from fv_kernel.serving.middleware import ASGIApp, Message, Receive, Scope, Send

__all__ = ["ServingMetrics", "RequestMetricsMiddleware", "EngineCollector"]

#: Bounds of the HTTP request latency histogram, in seconds (a create returns in ms; a synchronous
#: image generation may take minutes).
HTTP_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class EngineCollector(Collector):
    """The engine's scheduler, admission and outcome counters, the API's refusals and the job store's counts."""

    def __init__(self, engine: Engine, http_rejections: Counter[str], jobs_by_status: Callable[[], Mapping[str, int]]) -> None:
        self.engine = engine
        self.http_rejections = http_rejections
        self.jobs_by_status = jobs_by_status

    def collect(self) -> Iterator[Metric]:
        engine, m, admission = self.engine, self.engine.metrics, self.engine.admission
        yield GaugeMetricFamily("fv_queue_depth", "Requests accepted and waiting for admission.", value=engine.queue_depth())
        yield GaugeMetricFamily(
            "fv_running_loops", "Requests whose loop driver is running (one active loop each).", value=engine.running_count(),
        )
        units = CounterMetricFamily("fv_work_units", "WorkUnits executed, by kind.", labels=["kind"])
        for kind, n in sorted(m.units_by_kind.items()):
            units.add_metric([kind], n)
        yield units
        batches = CounterMetricFamily(
            "fv_batches", "Batches executed (compatible WorkUnits scheduled together), by number of WorkUnits.",
            labels=["size"],
        )
        for size, n in sorted(m.batches_by_size.items()):
            batches.add_metric([str(size)], n)
        yield batches
        fused = CounterMetricFamily(
            "fv_fused_calls", "Ops called once on the stacked rows of several requests, by number of requests.",
            labels=["size"],
        )
        for size, n in sorted(m.fused_calls_by_size.items()):
            fused.add_metric([str(size)], n)
        yield fused
        yield CounterMetricFamily(
            "fv_overlapped_batches", "Batches started on one device lane while the other lane's ran (scheduler.overlap_kinds).",
            value=m.overlapped_batches,
        )
        fallbacks = CounterMetricFamily(
            "fv_fused_fallbacks", "Fused batches that raised and were re-run request by request, by op.", labels=["op"],
        )
        for op, n in sorted(m.fused_fallbacks.items()):
            fallbacks.add_metric([op], n)
        yield fallbacks
        # The engine counts cumulatively per bound, as Prometheus buckets are.
        buckets = [(_le(bound), count) for bound, count in zip(m.step_latency_buckets, m.step_latency_counts)]
        if buckets[-1][0] != "+Inf":
            buckets.append(("+Inf", m.step_latency_count))
        yield HistogramMetricFamily(
            "fv_step_latency_seconds", "Wall time of one executed batch of WorkUnits.",
            buckets=buckets, sum_value=m.step_latency_sum,
        )
        yield CounterMetricFamily(
            "fv_gpu_seconds_admitted", "Predicted GPU-seconds reserved by admitted requests.", value=admission.admitted_seconds,
        )
        yield CounterMetricFamily(
            "fv_gpu_seconds_refunded", "Reserved GPU-seconds returned unspent when requests ended.",
            value=admission.refunded_seconds,
        )
        yield GaugeMetricFamily("fv_admission_memory_bytes", "Memory reserved by admitted requests.", value=admission.memory_in_use())
        yield GaugeMetricFamily(
            "fv_admission_reservations", "Requests holding an admission reservation.", value=len(admission.reservations),
        )
        reasons: Counter[str] = Counter(m.rejections)
        reasons.update(self.http_rejections)
        rejections = CounterMetricFamily(
            "fv_rejections", "Refused requests by reason (queue_full, admission_<resource>, and API error types).",
            labels=["reason"],
        )
        for reason, n in sorted(reasons.items()):
            rejections.add_metric([reason], n)
        yield rejections
        finished = CounterMetricFamily("fv_requests_finished", "Engine requests that ended, by outcome.", labels=["status"])
        for status, n in (("completed", m.completed), ("failed", m.failed), ("cancelled", m.cancelled)):
            finished.add_metric([status], n)
        yield finished
        jobs = GaugeMetricFamily("fv_jobs", "Video jobs in the job store, by status.", labels=["status"])
        for status, n in sorted(self.jobs_by_status().items()):
            jobs.add_metric([status], n)
        yield jobs
        yield CounterMetricFamily("fv_scheduler_seconds", "The scheduler's own time: admission, choosing batches, "
                                  "handing results back.", value=m.scheduler_seconds)
        yield CounterMetricFamily("fv_loop_host_seconds", "Time the loops' host code ran between steps "
                                  "(advance, next, finalize) while the scheduler waited for their next plans.",
                                  value=m.loop_host_seconds)
        yield CounterMetricFamily("fv_execute_seconds", "Time spent executing batches.", value=m.execute_seconds)
        yield from self._chunk_kv()

    def _chunk_kv(self) -> Iterator[Metric]:
        """Every slab chunk-KV pool of the resident instances, labelled by its engine-wide key and model."""
        labels = ["pool", "model"]
        total = GaugeMetricFamily("fv_chunk_kv_slabs_total", "Slabs of a chunk-KV pool (one chunk's K/V each).", labels=labels)
        used = GaugeMetricFamily("fv_chunk_kv_slabs_used", "Slabs held by sessions' windows (and kept by training rollouts).",
                                 labels=labels)
        reserved = GaugeMetricFamily("fv_chunk_kv_slabs_reserved", "Slabs reserved by admitted requests and sessions.",
                                     labels=labels)
        evictions = CounterMetricFamily("fv_chunk_kv_evictions", "Slabs evicted from windows (the oldest non-sink chunk).",
                                        labels=labels)
        capacity = GaugeMetricFamily("fv_chunk_kv_capacity_bytes", "Bytes of a chunk-KV pool's storage.", labels=labels)
        in_use = GaugeMetricFamily("fv_chunk_kv_used_bytes", "Bytes of the slabs in use.", labels=labels)
        for instance in self.engine.instances.values():
            for name, pool in instance.block_pools().items():
                if not isinstance(pool, SlabKVPool):
                    continue
                key = [pool_key(instance, name), instance.model_id]
                total.add_metric(key, pool.capacity_slabs)
                used.add_metric(key, pool.used_slabs)
                reserved.add_metric(key, self.engine.admission.pool_blocks_in_use(key[0]))
                evictions.add_metric(key, pool.evictions)
                capacity.add_metric(key, pool.capacity_bytes)
                in_use.add_metric(key, pool.used_slabs * pool.config.slab_bytes)
        yield from (total, used, reserved, evictions, capacity, in_use)


class ServingMetrics:
    """One app's metrics registry: the engine collector, HTTP latency and process metrics."""

    def __init__(self, engine: Engine, http_rejections: Counter[str], jobs_by_status: Callable[[], Mapping[str, int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(engine, http_rejections, jobs_by_status))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.http_latency = Histogram(
            "fv_http_request_duration_seconds",
            "Time from a request's arrival to the end of its response, by method, route template and status.",
            ["method", "route", "status"], buckets=HTTP_LATENCY_BUCKETS, registry=self.registry,
        )

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition body and its content type, in the format the ``Accept`` header asks for."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


def _plain_route(scope: Scope) -> Any:
    """The route a request matched when the router did not record it: FastAPI records its own
    routes in the scope, Starlette's plain routes (``/openapi.json``, ``/docs``) are not."""
    app = scope.get("app")
    for route in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route
    return None


class RequestMetricsMiddleware:
    """Observe every HTTP request's latency under its route template (``/v1/videos/{video_id}``), never its raw path."""

    def __init__(self, app: ASGIApp, *, metrics: ServingMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route: Any = scope.get("route") or _plain_route(scope)
            # Unmatched paths share one label, so a scanner cannot grow the series without bound.
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.http_latency.labels(scope.get("method", ""), template, str(status)).observe(
                time.perf_counter() - started
            )
