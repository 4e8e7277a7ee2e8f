"""Prometheus text exposition (format 0.0.4) of the engine's and the API's counters."""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable

from fv_kernel.runtime.engine import Engine

__all__ = ["render_metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: str) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples: Iterable[tuple[str, dict[str, str], float]]) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for suffix, labels, value in samples:
            self.lines.append(f"{name}{suffix}{_labels(**labels)} {_number(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render_metrics(engine: Engine, http_rejections: Counter[str], jobs_by_status: dict[str, int]) -> str:
    """Everything an operator needs to see whether the server keeps up, in Prometheus text format."""
    m = engine.metrics
    admission = engine.admission
    w = _Writer()
    w.family("fv_queue_depth", "gauge", "Requests accepted and waiting for admission.", [("", {}, engine.queue_depth())])
    w.family("fv_running_loops", "gauge", "Requests whose loop driver is running (one active loop each).",
             [("", {}, engine.running_count())])
    w.family("fv_work_units_total", "counter", "WorkUnits executed, by kind.",
             [("", {"kind": kind}, n) for kind, n in sorted(m.units_by_kind.items())])
    w.family("fv_batches_total", "counter", "Batches executed, by number of WorkUnits fused.",
             [("", {"size": str(size)}, n) for size, n in sorted(m.batches_by_size.items())])
    buckets = [("_bucket", {"le": _number(bound) if math.isinf(bound) else repr(bound)}, count)
               for bound, count in zip(m.step_latency_buckets, m.step_latency_counts)]
    if not math.isinf(m.step_latency_buckets[-1]):
        buckets.append(("_bucket", {"le": "+Inf"}, m.step_latency_count))
    w.family("fv_fused_fallbacks_total", "counter",
             "Fused batches that raised and were re-run request by request, by op.",
             [("", {"op": op}, n) for op, n in sorted(m.fused_fallbacks.items())])
    w.family("fv_step_latency_seconds", "histogram", "Wall time of one executed batch of WorkUnits.",
             [*buckets, ("_sum", {}, m.step_latency_sum), ("_count", {}, m.step_latency_count)])
    w.family("fv_gpu_seconds_admitted_total", "counter", "Predicted GPU-seconds reserved by admitted requests.",
             [("", {}, admission.admitted_seconds)])
    w.family("fv_gpu_seconds_refunded_total", "counter", "Reserved GPU-seconds returned unspent when requests ended.",
             [("", {}, admission.refunded_seconds)])
    w.family("fv_admission_memory_bytes", "gauge", "Memory reserved by admitted requests.",
             [("", {}, admission.memory_in_use())])
    w.family("fv_admission_reservations", "gauge", "Requests holding an admission reservation.",
             [("", {}, len(admission.reservations))])
    rejections: Counter[str] = Counter(m.rejections)
    rejections.update(http_rejections)
    w.family("fv_rejections_total", "counter",
             "Refused requests by reason (queue_full, admission_<resource>, and API error types).",
             [("", {"reason": reason}, n) for reason, n in sorted(rejections.items())])
    w.family("fv_requests_finished_total", "counter", "Engine requests that ended, by outcome.",
             [("", {"status": s}, n) for s, n in (("completed", m.completed), ("failed", m.failed), ("cancelled", m.cancelled))])
    w.family("fv_jobs", "gauge", "Video jobs in the job store, by status.",
             [("", {"status": s}, n) for s, n in sorted(jobs_by_status.items())])
    w.family("fv_scheduler_seconds_total", "counter", "Time spent choosing batches.", [("", {}, m.scheduler_seconds)])
    w.family("fv_execute_seconds_total", "counter", "Time spent executing batches.", [("", {}, m.execute_seconds)])
    return w.text()
