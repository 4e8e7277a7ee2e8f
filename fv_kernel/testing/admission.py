"""Conformance helpers for estimates: a loop's whole-life estimate must describe the steps it runs.

The runtime prices an estimate's :class:`~fv_kernel.loop.contract.StepEstimate` s with the
same calibrated cost keys as executed steps, so an estimate whose shapes drift from
the loop's WorkPlans would be priced without the Profiler's correction.
:func:`estimate_vs_execution` runs a request alone and compares the two.
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable

from fv_kernel.request.request import Request
from fv_kernel.runtime.engine import Engine, run_serially
from fv_kernel.runtime.records import GenerationResult
from fv_kernel.testing.batching import StepRecorder

__all__ = ["StepKey", "estimate_vs_execution", "assert_estimate_covers_execution"]

#: (loop id, work kind, shape signature, precision): the fields a step is priced by.
StepKey = tuple[str, str, Hashable, str]


def estimate_vs_execution(engine: Engine, request: Request) -> tuple[Counter[StepKey], Counter[StepKey], GenerationResult]:
    """Run ``request`` alone on ``engine`` (not running yet); return (estimated, executed) step counts and the result.

    ``engine`` must have been built with a :class:`StepRecorder` among its observers.
    """
    recorder = next((o for o in engine.observers if isinstance(o, StepRecorder)), None)
    if recorder is None:
        raise ValueError("build the engine with a StepRecorder observer")
    resolved = engine.validate(request)
    instance = engine.instances[resolved.model]
    need = instance.program(resolved.task).estimate(instance, resolved)
    estimated: Counter[StepKey] = Counter()
    for step in need.steps:
        estimated[(step.loop_id, step.kind.value, step.shape_sig, step.precision)] += step.count
    start = len(recorder.records)
    [result] = run_serially(engine, [resolved])
    executed: Counter[StepKey] = Counter()
    for record in recorder.records[start:]:
        if resolved.request_id in record.request_ids:
            executed[(record.loop_id, record.kind, record.shape_sig, record.precision)] += 1
    return estimated, executed, result


def assert_estimate_covers_execution(engine: Engine, request: Request, *, exact: bool = True) -> None:
    """Every executed step was estimated with the same key; with ``exact``, no estimated step went unexecuted.

    Loops that may stop early (EOS) pass ``exact=False``: their estimate covers the cap.
    """
    estimated, executed, result = estimate_vs_execution(engine, request)
    result.raise_for_status()
    missing = executed - estimated
    assert not missing, f"executed steps the estimate did not price (key: count): {dict(missing)}"
    if exact:
        unused = estimated - executed
        assert not unused, f"estimated steps that never ran (key: count): {dict(unused)}"
