"""``run_local`` waits for the device before a loop reads host tensors an op handed back.

An op may copy results to the host non-blocking (fv-wan's decode does, into pinned memory);
reading such a tensor before the device has written it gives whatever the buffer held. The
Engine waits on each batch's end event; ``run_local`` waits in ``wait_for_host_outputs``. The
race itself needs CUDA: plugins/fv-wan/tests/test_decode_host_frames.py reproduces it there.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fv_kernel.model.instance import build_instance
from fv_kernel.request.request import DiffusionParams, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime import local
from fv_kernel.runtime.local import run_local, wait_for_host_outputs
from fv_kernel.testing.toy import toy_card


class _Stream:
    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


@pytest.fixture
def stream(monkeypatch: pytest.MonkeyPatch) -> _Stream:
    fake = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake)
    return fake


def test_a_cuda_step_that_returned_host_tensors_is_waited_for(stream: _Stream) -> None:
    wait_for_host_outputs(torch.device("cuda"), {"frames": torch.zeros(2), "cache": torch.empty(2, device="meta")})
    assert stream.waits == 1


def test_device_outputs_and_cpu_instances_are_not_waited_for(stream: _Stream) -> None:
    wait_for_host_outputs(torch.device("cuda"), {"v": torch.empty(2, device="meta")})  # stays on the device
    wait_for_host_outputs(torch.device("cpu"), {"frames": torch.zeros(2)})  # nothing asynchronous on a CPU instance
    assert stream.waits == 0


def test_run_local_waits_after_every_op_before_the_loop_reads_its_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    instance = build_instance(toy_card("toy-dit"))
    events: list[tuple[str, int]] = []
    real_op = instance.op

    def recording_op(name: str) -> Any:
        op = real_op(name)

        class Recorded:
            def fn(self, inputs: Any, params: Any) -> Any:
                out = op.fn(inputs, params)
                events.append(("op", id(out)))
                return out

        return Recorded()

    monkeypatch.setattr(instance, "op", recording_op)
    monkeypatch.setattr(local, "wait_for_host_outputs", lambda device, outputs: events.append(("wait", id(outputs))))
    request = Request(request_id="r", model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a"),),
                      diffusion=DiffusionParams(steps=3, seed=0))
    run_local(request, instance)
    ops = [e for e in events if e[0] == "op"]
    assert len(ops) >= 4  # text, three denoise steps, decode
    # Each op's own outputs are waited for, right after it returns and before anything else runs.
    assert events == [e for op in ops for e in (op, ("wait", op[1]))]
