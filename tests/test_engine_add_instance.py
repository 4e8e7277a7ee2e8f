"""``Engine.add_instance`` does the deploy-time work the first admission used to do inside the
scheduler: it imports the card's loop classes (lazy ``"module:Class"`` entries) and sizes what
the instance keeps resident for an ``"auto"`` memory budget. A loop that cannot be imported does
not stop the instance being added (the host keeps serving); its requests fail, typed. Weights a
request loads later are measured by the loading thread, not by the scheduler."""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import pytest

from fv_kernel.model.instance import build_instance
from fv_kernel.request.request import DiffusionParams, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime import capacity as capacity_module
from fv_kernel.runtime.engine import Engine, run_concurrently
from fv_kernel.testing.toy import toy_card


def _request() -> Request:
    return Request(request_id="r", model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a"),),
                   diffusion=DiffusionParams(steps=2, seed=0))


def _with_decode_loop(implementation: str):
    card = toy_card("toy-dit")
    loops = dict(card.loops)
    loops["decode"] = loops["decode"].model_copy(update={"implementation": implementation})
    return card.model_copy(update={"loops": loops})


def test_the_cards_loop_classes_are_imported_when_the_instance_is_added(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    module = "fv_test_lazy_decode_loop"
    (tmp_path / f"{module}.py").write_text("from fv_kernel.testing.toy import ToyDecodeLoop as Loop\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    instance = build_instance(_with_decode_loop(f"{module}:Loop"))
    assert module not in sys.modules  # building the instance imports no loop
    engine = Engine()
    engine.add_instance(instance)
    assert module in sys.modules  # before any request reaches the scheduler
    (result,) = run_concurrently(engine, [_request()])
    assert result.status == "completed"


def test_an_auto_memory_budget_is_sized_when_the_instance_is_added() -> None:
    engine = Engine()
    assert engine.admission.memory_limit("cpu") is None
    engine.add_instance(build_instance(toy_card("toy-dit")))
    assert engine.admission.memory_limit("cpu") is not None


def test_a_loop_that_cannot_be_imported_fails_its_requests_not_the_host(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine()
    with caplog.at_level(logging.WARNING):
        engine.add_instance(build_instance(_with_decode_loop("fv_no_such_module_anywhere:Loop")))
    assert any("'decode'" in r.getMessage() and "could not be resolved" in r.getMessage() for r in caplog.records)
    (result,) = run_concurrently(engine, [_request()])
    assert result.status == "failed" and "fv_no_such_module_anywhere" in str(result.error)


def test_weights_a_request_loads_are_measured_by_the_loading_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    measure = capacity_module.instance_resident_bytes
    threads: list[str] = []

    def spy(instance):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return measure(instance)

    monkeypatch.setattr(capacity_module, "instance_resident_bytes", spy)
    engine = Engine()
    instance = build_instance(toy_card("toy-dit"))
    engine.add_instance(instance)
    before = engine.admission.memory_limit("cpu")
    assert before is not None and not instance.components  # nothing loaded yet: sized at add_instance
    threads.clear()
    run_concurrently(engine, [_request()])
    second = _request().model_copy(update={"request_id": "r2"})
    (result,) = run_concurrently(engine, [second])  # its admission re-sizes for what the first one loaded
    assert result.status == "completed" and instance.components
    assert threads and threading.main_thread().name not in threads  # never in the scheduler's thread
    assert engine.admission.memory_limit("cpu") < before  # the loaded weights are counted
