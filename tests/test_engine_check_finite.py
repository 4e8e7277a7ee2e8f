"""The Engine's NaN/Inf check of a batch's outputs: same verdicts, one host read per device.

A step can return dozens of tensors (a causal VAE decode returns its 35-tensor cache with the
frames); checked one by one, each check waited on the device. Now the whole batch's flags are
gathered on the device and read once.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fv_kernel.errors import NonFiniteOutput
from fv_kernel.loop.plan import StepResult
from fv_kernel.runtime.executor import check_finite


def _unit(op: str, step: int) -> Any:
    return SimpleNamespace(plan=SimpleNamespace(op=op, loop_id="denoise", step_index=step))


def _outcomes() -> tuple[list[Any], list[Any]]:
    healthy = StepResult(outputs={"v": torch.ones(4), "ids": torch.tensor([1, 2]), "cache.a": torch.zeros(2, 2)})
    nan_second = StepResult(outputs={"v": torch.ones(4), "cache.a": torch.tensor([1.0, float("nan")]),
                                     "cache.b": torch.tensor([float("inf")])})
    failed = RuntimeError("the step raised")
    inf_int_ok = StepResult(outputs={"ids": torch.tensor([3]), "v": torch.tensor([-float("inf")])})
    return [healthy, nan_second, failed, inf_int_ok], [_unit("a", 0), _unit("b", 1), _unit("c", 2), _unit("d", 3)]


def test_each_unit_is_judged_on_its_own_outputs_and_names_the_first_bad_one() -> None:
    outcomes, batch = _outcomes()
    checked = check_finite(outcomes, batch)
    assert checked[0] is outcomes[0]
    assert isinstance(checked[1], NonFiniteOutput)
    assert "'cache.a'" in checked[1].message and "step 'b'" in checked[1].message and "at step 1" in checked[1].message
    assert checked[2] is outcomes[2]  # an exception passes through untouched
    assert isinstance(checked[3], NonFiniteOutput) and "'v'" in checked[3].message


def test_the_batch_is_read_from_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = {"tolist": 0, "bool": 0}
    real_tolist, real_bool = torch.Tensor.tolist, torch.Tensor.__bool__

    def tolist(self: torch.Tensor) -> Any:
        reads["tolist"] += 1
        return real_tolist(self)

    def to_bool(self: torch.Tensor) -> bool:
        reads["bool"] += 1
        return real_bool(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(torch.Tensor, "__bool__", to_bool)
    outcomes, batch = _outcomes()
    check_finite(outcomes, batch)
    assert reads == {"tolist": 1, "bool": 0}  # one read for the whole batch (all on one device), no per-tensor sync


def test_a_batch_with_nothing_to_check_reads_nothing() -> None:
    outcomes = [RuntimeError("x"), StepResult(outputs={"ids": torch.tensor([1])})]
    assert check_finite(outcomes, [_unit("a", 0), _unit("b", 1)]) == outcomes


def test_nan_and_inf_are_found_in_every_float_dtype_and_layout() -> None:
    bad = [torch.tensor([1.0, float("nan")]).to(torch.bfloat16), torch.tensor([-float("inf"), 0.0]).half(),
           torch.tensor([[1.0, 2.0], [3.0, float("inf")]], dtype=torch.float64).t(),  # not contiguous
           torch.full((3, 5), float("nan"))[:, ::2]]
    good = [torch.ones(2, dtype=torch.bfloat16), torch.empty(0), torch.zeros(3, 5)[:, ::2]]
    outcomes = [StepResult(outputs={"x": t}) for t in bad + good]
    checked = check_finite(outcomes, [_unit("a", i) for i in range(len(outcomes))])
    assert all(isinstance(c, NonFiniteOutput) for c in checked[: len(bad)])
    assert checked[len(bad):] == outcomes[len(bad):]


def test_the_check_builds_no_mask_the_size_of_an_output(monkeypatch: pytest.MonkeyPatch) -> None:
    # A decode step's cache is GBs on the device: a tensor-sized bool mask doubled what it read.
    sizes: list[int] = []
    real_isfinite = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: sizes.append(t.numel()) or real_isfinite(t))
    big = torch.zeros(64, 64)
    checked = check_finite([StepResult(outputs={"cache.a": big})], [_unit("a", 0)])
    assert not isinstance(checked[0], NonFiniteOutput)
    assert sizes and max(sizes) <= 2, sizes



def _aten_ops(fn: Any) -> list[str]:
    """Every aten op ``fn`` runs, those called inside other ops' kernels included."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        fn()
    return [event.name for event in profiler.events()]


def test_a_dense_tensor_in_another_layout_is_checked_without_a_copy() -> None:
    # The decode op hands back its channels-last history as it is; min/max over the whole tensor
    # packed each slot into a contiguous copy first (10 ms a step at 448x832 on the H200).
    history = torch.zeros(1, 8, 2, 6, 10).contiguous(memory_format=torch.channels_last_3d)
    transposed = torch.zeros(6, 10).t()
    for tensor in (history, transposed):
        checked: list[Any] = []
        ops = _aten_ops(lambda: checked.extend(check_finite([StepResult(outputs={"cache.a": tensor})], [_unit("a", 0)])))
        assert "aten::aminmax" in ops and not isinstance(checked[0], NonFiniteOutput)
        packed = [op for op in ops if op in ("aten::contiguous", "aten::clone")]  # what the old check ran first
        assert not packed, ops
    poisoned = history.clone()
    poisoned[0, 5, 1, 4, 9] = float("nan")
    assert not poisoned.is_contiguous() and poisoned.is_contiguous(memory_format=torch.channels_last_3d)
    checked = check_finite([StepResult(outputs={"cache.a": poisoned})], [_unit("a", 0)])
    assert isinstance(checked[0], NonFiniteOutput)
