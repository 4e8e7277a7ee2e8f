"""Per-row LoRA (``fv_kernel.compute.lora``): the torch path and the Triton segmented GEMM against
an independent reference, merged against per-row, exact restore, typed errors, scoped hooks, autograd.

The reference is plain per-row fp64 math written here from the raw tensors the adapters are
built from (``W + Σ s·(α/r)·B·A`` per targeted linear, each row run through its own fp64 copy
of the model); it shares nothing with the code under test. The Triton kernel runs on CUDA when
there is one, else in Triton's CPU interpreter in a fresh Python (this file run as a script with
``TRITON_INTERPRET=1``, as ``test_compute_fused.py`` does); fp32 there, tiny shapes.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import fv_kernel.compute.lora as lora_module
from fv_kernel.compute.lora import (
    AdapterError,
    AdapterKeyError,
    AdapterWeights,
    AutoRowKernel,
    LowRankUpdate,
    RowAdapters,
    TritonRowKernel,
    merge_adapters,
    rows_adapted,
    select_row_kernel,
)
from fv_kernel.compute.lora_triton import lora_sgmv, rank_block
from fv_kernel.testing.triton_checks import REQUIRE_KERNELS, run_kernel_checks

CUDA = torch.cuda.is_available()
WIDTH, HIDDEN, TOKENS = 8, 12, 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = nn.Linear(WIDTH, WIDTH)
        self.ffn = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.to_q(self.norm(x))
        return x + self.ffn(x)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.proj_out = nn.Linear(WIDTH, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.proj_out(x)


def tiny_model(device: str = "cpu") -> Tiny:
    torch.manual_seed(0)
    return Tiny().to(device).requires_grad_(False)


# Raw adapter tensors as plain dicts: {path: (down, up, alpha, bias)} plus {param: delta}.
def raw_adapter(seed: int, rank: int, paths: list[str], *, alpha: float | None, bias_on: str | None = None,
                deltas: tuple[str, ...] = ()) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"to_q": (WIDTH, WIDTH), "ffn.0": (HIDDEN, WIDTH), "ffn.2": (WIDTH, HIDDEN), "proj_out": (6, WIDTH)}
    low_rank = {}
    for path in paths:
        out_f, in_f = shapes[path.split(".", 2)[-1] if path.startswith("blocks") else path]
        down = torch.randn(rank, in_f, generator=g) * 0.3
        up = torch.randn(out_f, rank, generator=g) * 0.3
        bias = torch.randn(out_f, generator=g) * 0.1 if path == bias_on else None
        low_rank[path] = (down, up, alpha, bias)
    full = {}
    for param in deltas:
        module = param.rpartition(".")[0]
        out_f, in_f = shapes[module.split(".", 2)[-1]]
        full[param] = torch.randn((out_f, in_f) if param.endswith("weight") else (out_f,), generator=g) * 0.05
    return {"low_rank": low_rank, "deltas": full}


def adapter(name: str, raw: dict[str, Any], device: str = "cpu") -> AdapterWeights:
    return AdapterWeights(
        name, "transformer",
        {p: LowRankUpdate(d.clone(), u.clone(), a, None if b is None else b.clone()) for p, (d, u, a, b) in raw["low_rank"].items()},
        {p: t.clone() for p, t in raw["deltas"].items()},
    ).to(device)


RAW = {
    "style": raw_adapter(1, 4, ["blocks.0.to_q", "blocks.0.ffn.0", "blocks.1.to_q", "blocks.1.ffn.2", "proj_out"], alpha=8.0,
                         bias_on="blocks.0.ffn.0"),
    "char": raw_adapter(2, 2, ["blocks.0.to_q", "blocks.1.ffn.0", "blocks.1.ffn.2"], alpha=None,
                        deltas=("blocks.1.to_q.weight", "blocks.0.ffn.2.bias")),
    "light": raw_adapter(3, 3, ["blocks.0.ffn.0", "blocks.0.ffn.2", "blocks.1.to_q", "proj_out"], alpha=1.5),
}
#: Mixed rows: a stack of two of different ranks, a row with none, strength 0, negative strengths.
ROW_STACKS: list[list[tuple[str, float]]] = [
    [("style", 1.0)],
    [],
    [("char", 0.5), ("light", -0.7)],
    [("light", 0.0)],
    [("style", -1.0), ("char", 1.3), ("light", 0.4)],
    [("light", 1.0)],
]


def reference(model: Tiny, x: torch.Tensor, stacks: list[list[tuple[str, float]]]) -> torch.Tensor:
    """Each row through its own fp64 copy of the model with its stack's updates added to the weights."""
    outs = []
    for row, stack in enumerate(stacks):
        twin = copy.deepcopy(model).double()
        params = dict(twin.named_parameters())
        with torch.no_grad():
            for name, s in stack:
                for path, (down, up, alpha, bias) in RAW[name]["low_rank"].items():
                    factor = s * (alpha / down.shape[0] if alpha is not None else 1.0)
                    params[f"{path}.weight"] += factor * (up.double() @ down.double())
                    if bias is not None:
                        params[f"{path}.bias"] += s * bias.double()
                for param, delta in RAW[name]["deltas"].items():
                    params[param] += s * delta.double()
            outs.append(twin(x[row : row + 1].double().cpu()))
    return torch.cat(outs)


def per_row(model: Tiny, x: torch.Tensor, stacks: list[list[tuple[str, float]]], kernel: Any, device: str = "cpu") -> torch.Tensor:
    adapters = {name: adapter(name, raw, device) for name, raw in RAW.items()}
    routing = RowAdapters.from_stacks([[(adapters[n], s) for n, s in stack] for stack in stacks], kernel=kernel)
    with torch.no_grad(), rows_adapted(model, routing):
        return model(x)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def inputs(device: str = "cpu") -> torch.Tensor:
    return torch.randn(len(ROW_STACKS), TOKENS, WIDTH, generator=torch.Generator().manual_seed(7)).to(device)


def shuffled(stacks: list[list[tuple[str, float]]]) -> list[list[tuple[str, float]]]:
    """The negative control's routing: every row gets the next row's stack."""
    return stacks[1:] + stacks[:1]


# --------------------------------------------------------------------------- torch path


def test_torch_path_matches_the_reference() -> None:
    model, x = tiny_model(), inputs()
    assert rel(per_row(model, x, ROW_STACKS, "torch"), reference(model, x, ROW_STACKS)) < 1e-6


def test_comparison_catches_a_shuffled_row_to_adapter_map() -> None:
    model, x = tiny_model(), inputs()
    got = per_row(model, x, shuffled(ROW_STACKS), "torch")
    assert rel(got, reference(model, x, ROW_STACKS)) > 1e-2


def test_comparison_catches_a_dropped_alpha(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = tiny_model(), inputs()
    monkeypatch.setattr(LowRankUpdate, "scale", property(lambda self: 1.0))
    assert rel(per_row(model, x, ROW_STACKS, "torch"), reference(model, x, ROW_STACKS)) > 1e-2


#: Rows whose stacks list adapters in another order than the batch first meets them.
REORDERED = [[("light", 0.6)], [("char", 0.5), ("light", -0.7), ("style", 0.9)], [("style", 1.0), ("char", -0.4)]]


def rows_alone_vs_batched(model: Tiny, x: torch.Tensor, kernel: Any, device: str = "cpu") -> list[bool]:
    """Whether each row of a mixed batch equals the same request run alone, bit for bit."""
    batched = per_row(model, x[: len(REORDERED)], REORDERED, kernel, device)
    return [bool(torch.equal(per_row(model, x[i : i + 1], [stack], kernel, device)[0], batched[i])) for i, stack in enumerate(REORDERED)]


def test_mixed_batch_rows_equal_each_request_alone_bit_for_bit() -> None:
    assert rows_alone_vs_batched(tiny_model(), inputs(), "torch") == [True] * len(REORDERED)


def test_rows_without_adapters_are_the_base_forward_bit_for_bit() -> None:
    model, x = tiny_model(), inputs()
    with torch.no_grad():
        base = model(x)
    got = per_row(model, x, ROW_STACKS, "torch")
    assert torch.equal(got[1], base[1]) and torch.equal(got[3], base[3])  # no adapter; strength 0
    assert not torch.equal(got[0], base[0])
    assert RowAdapters.from_stacks([[], []]) is None  # nothing to route: the forward runs untouched


def test_from_ids_routes_like_from_stacks() -> None:
    model, x = tiny_model(), inputs()
    names = list(RAW)
    adapters = [adapter(n, RAW[n]) for n in names]
    k = max(len(s) for s in ROW_STACKS)
    ids = torch.full((len(ROW_STACKS), k), -1, dtype=torch.int64)
    scales = torch.zeros(len(ROW_STACKS), k)
    for row, stack in enumerate(ROW_STACKS):
        for j, (name, s) in enumerate(stack):
            ids[row, j], scales[row, j] = names.index(name), s
    routing = RowAdapters.from_ids(ids, scales, lambda i: adapters[i], kernel="torch")
    with torch.no_grad(), rows_adapted(model, routing):
        got = model(x)
    assert rel(got, reference(model, x, ROW_STACKS)) < 1e-6


# --------------------------------------------------------------------------- merged vs per row


def test_merged_equals_per_row_and_restore_is_bit_exact() -> None:
    model, x = tiny_model(), inputs()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = per_row(model, x, ROW_STACKS, "torch")
    for row in (0, 2, 4):
        merged = merge_adapters(model, [(adapter(n, RAW[n]), s) for n, s in ROW_STACKS[row]])
        with torch.no_grad():
            alone = model(x[row : row + 1])
        merged.restore()
        assert rel(alone, rows[row : row + 1]) < 1e-6, row
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), key


def test_restore_check_catches_a_restore_that_subtracts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for the bit-exact check: undoing a merge by subtracting the delta leaves rounding."""
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stack = [(adapter("style", RAW["style"]), 0.8), (adapter("light", RAW["light"]), -1.3)]

    def subtract(self: Any) -> None:
        params = dict(self.root.named_parameters())
        with torch.no_grad():
            for name, s in (("style", 0.8), ("light", -1.3)):
                for path, (down, up, alpha, bias) in RAW[name]["low_rank"].items():
                    params[f"{path}.weight"] -= s * (alpha / down.shape[0] if alpha else 1.0) * (up @ down)
                    if bias is not None:
                        params[f"{path}.bias"] -= s * bias

    monkeypatch.setattr(lora_module.MergedAdapters, "restore", subtract)
    merge_adapters(model, stack).restore()
    assert any(not torch.equal(value, before[key]) for key, value in model.state_dict().items())


# --------------------------------------------------------------------------- errors, hooks, autograd


def test_unknown_module_is_an_adapter_key_error_naming_it() -> None:
    model = tiny_model()
    bad = AdapterWeights("typo", "transformer", {"blocks.0.to_qq": LowRankUpdate(torch.zeros(2, WIDTH), torch.zeros(WIDTH, 2))})
    with pytest.raises(AdapterKeyError, match=r"'blocks\.0\.to_qq' \(did you mean 'blocks\.0\.to_q'\?\)"):
        with rows_adapted(model, RowAdapters.from_stacks([[(bad, 1.0)]])):
            pass
    with pytest.raises(AdapterKeyError, match="typo"):
        merge_adapters(model, [(bad, 1.0)])


def test_an_adapter_is_checked_once_per_component(monkeypatch: pytest.MonkeyPatch) -> None:
    model, other = tiny_model(), tiny_model()
    style = adapter("style", RAW["style"])
    style.check(model)
    monkeypatch.setattr(model, "named_modules", lambda *a, **k: pytest.fail("walked the modules again"))
    style.check(model)  # remembered
    monkeypatch.setattr(other, "named_modules", lambda *a, **k: iter(()))
    with pytest.raises(AdapterKeyError):  # another component is checked anew (here: one without linears)
        style.check(other)


def test_swapped_up_and_down_are_named() -> None:
    model = tiny_model()
    down, up = torch.randn(3, WIDTH), torch.randn(WIDTH, 3)
    swapped = AdapterWeights("swap", "transformer", {"blocks.0.to_q": LowRankUpdate(up, down)})  # [8,3] then [3,8]
    with pytest.raises(AdapterError, match="are up and down swapped"):
        merge_adapters(model, [(swapped, 1.0)])
    with pytest.raises(AdapterError, match="does not follow down"):
        LowRankUpdate(torch.randn(3, WIDTH), torch.randn(HIDDEN, 4))


def test_bad_kernel_name_lists_the_choices() -> None:
    with pytest.raises(AdapterError, match="kernel must be one of 'auto', 'torch', 'triton'") as info:
        select_row_kernel("fast")
    assert info.value.param == "kernel"


def test_triton_asked_for_without_triton_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from fv_kernel.compute.lora_triton import RowKernelUnavailable

    monkeypatch.setattr("fv_kernel.compute.fused.triton_available", lambda: False)
    with pytest.raises(RowKernelUnavailable, match="kernel='triton' needs the triton package"):
        RowAdapters.from_stacks([[(adapter("style", RAW["style"]), 1.0)]], kernel="triton")


def test_routing_for_another_batch_size_is_refused() -> None:
    model = tiny_model()
    routing = RowAdapters.from_stacks([[(adapter("style", RAW["style"]), 1.0)], []], kernel="torch")
    with pytest.raises(AdapterError, match="the forward has 6 rows, the adapter routing 2"):
        with torch.no_grad(), rows_adapted(model, routing):
            model(inputs())


def test_merge_only_delta_cannot_share_a_forward() -> None:
    model = tiny_model()
    norm_delta = AdapterWeights("norm", "transformer", deltas={"blocks.0.norm.weight": torch.ones(WIDTH)})
    with pytest.raises(AdapterError, match="applied merged only"):
        with rows_adapted(model, RowAdapters.from_stacks([[(norm_delta, 1.0)]])):
            pass


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def test_hooks_are_removed_after_the_with_even_when_the_forward_raises() -> None:
    model, x = tiny_model(), inputs()
    adapters = {n: adapter(n, raw) for n, raw in RAW.items()}
    routing = RowAdapters.from_stacks([[(adapters[n], s) for n, s in stack] for stack in ROW_STACKS], kernel="torch")
    with pytest.raises(RuntimeError, match="boom"):
        with rows_adapted(model, routing):
            assert _hook_count(model) == len(routing.paths(model)) > 0
            model(x)
            raise RuntimeError("boom")
    assert _hook_count(model) == 0
    with torch.no_grad():
        assert torch.equal(model(x), tiny_model()(x))  # nothing of the request stayed on the module


def test_autograd_reaches_the_adapters_not_the_frozen_base() -> None:
    model, x = tiny_model(), inputs()
    trainable = {n: adapter(n, raw) for n, raw in RAW.items()}
    leaves = []
    for a in trainable.values():
        for u in a.low_rank.values():
            u.down.requires_grad_(True)
            u.up.requires_grad_(True)
            leaves += [u.down, u.up]
    routing = RowAdapters.from_stacks([[(trainable[n], s) for n, s in stack] for stack in ROW_STACKS])  # auto
    with rows_adapted(model, routing):
        loss = model(x).square().mean()
    loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(leaf.grad is not None and leaf.grad.abs().sum() > 0 for leaf in leaves)
    # Against finite differences of the reference's weights: the gradient of one A entry.
    down = trainable["style"].low_rank["proj_out"].down
    eps, (i, j) = 1e-3, (1, 2)
    base = RAW["style"]["low_rank"]["proj_out"][0]
    plus, minus = base.clone(), base.clone()
    plus[i, j] += eps
    minus[i, j] -= eps
    losses = []
    for value in (plus, minus):
        RAW["style"]["low_rank"]["proj_out"] = (value, *RAW["style"]["low_rank"]["proj_out"][1:])
        losses.append(reference(model, x, ROW_STACKS).square().mean().item())
    RAW["style"]["low_rank"]["proj_out"] = (base, *RAW["style"]["low_rank"]["proj_out"][1:])
    assert down.grad[i, j].item() == pytest.approx((losses[0] - losses[1]) / (2 * eps), rel=1e-3)


def test_auto_picks_triton_only_for_cuda_without_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fv_kernel.compute.fused.triton_available", lambda: True)
    monkeypatch.setattr(TritonRowKernel, "__init__", lambda self, **kw: None)
    auto = AutoRowKernel()
    seg = RowAdapters.from_stacks([[(adapter("style", RAW["style"]), 1.0)]]).segments  # type: ignore[union-attr]
    cuda_x = SimpleNamespace(device=torch.device("cuda"), requires_grad=False)
    cpu_x = SimpleNamespace(device=torch.device("cpu"), requires_grad=False)
    with torch.no_grad():
        assert isinstance(auto.pick(cuda_x, seg, "proj_out"), TritonRowKernel)  # type: ignore[arg-type]
        assert auto.pick(cpu_x, seg, "proj_out") is lora_module._torch_row_kernel  # type: ignore[arg-type]
    with torch.enable_grad():
        assert isinstance(auto.pick(cuda_x, seg, "proj_out"), TritonRowKernel)  # type: ignore[arg-type]
        grad_x = SimpleNamespace(device=torch.device("cuda"), requires_grad=True)
        assert auto.pick(grad_x, seg, "proj_out") is lora_module._torch_row_kernel  # type: ignore[arg-type]
    monkeypatch.setattr("fv_kernel.compute.fused.triton_available", lambda: False)
    assert AutoRowKernel().pick(cuda_x, seg, "proj_out") is lora_module._torch_row_kernel  # type: ignore[arg-type]


def test_default_kernel_is_auto_and_runs_the_torch_path_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> None:
        raise AssertionError("Triton picked for CPU tensors")

    monkeypatch.setattr(TritonRowKernel, "__call__", refuse)
    model, x = tiny_model(), inputs()
    routing = RowAdapters.from_stacks([[(adapter("style", RAW["style"]), 1.0)]] * len(ROW_STACKS))
    assert isinstance(routing.kernel, AutoRowKernel)  # type: ignore[union-attr]
    with torch.no_grad(), rows_adapted(model, routing):
        model(x)


def test_triton_kernel_refuses_cpu_tensors_outside_the_interpreter() -> None:
    from fv_kernel.compute.fused import triton_available

    if not triton_available():
        pytest.skip("needs triton")
    from fv_kernel.compute.lora_triton import RowKernelUnavailable, triton_interpreted

    if triton_interpreted():
        pytest.skip("this process runs Triton's interpreter")
    with pytest.raises(RowKernelUnavailable, match="kernel='torch'"):
        per_row(tiny_model(), inputs(), ROW_STACKS, "triton")


# --------------------------------------------------------------------------- Triton kernel


def _sgmv_reference(x: torch.Tensor, out: torch.Tensor, entries: list[tuple[int, torch.Tensor, torch.Tensor, float]]) -> torch.Tensor:
    ref = out.double().cpu().clone()
    for row, down, up, factor in entries:
        ref[row] += factor * (x[row].double().cpu() @ down.double().T) @ up.double().T
    return ref


def sgmv_tiles(device: str) -> float:
    """The raw kernel on shapes that need several token, input and output tiles and mixed ranks."""
    g = torch.Generator().manual_seed(11)
    rows, tokens, width_in, width_out = 3, 70, 80, 130
    x = torch.randn(rows, tokens, width_in, generator=g)
    out = torch.randn(rows, tokens, width_out, generator=g)
    ranks, alphas = (5, 17), (2.0, 40.0)
    block = rank_block(max(ranks))
    downs, ups = torch.zeros(2, block, width_in), torch.zeros(2, width_out, block)
    raw = []
    for slot, r in enumerate(ranks):
        down, up = torch.randn(r, width_in, generator=g) * 0.2, torch.randn(width_out, r, generator=g) * 0.2
        downs[slot, :r], ups[slot, :, :r] = down, up
        raw.append((down, up))
    # row 0: slot 1 at 0.5; row 1: none; row 2: slot 0 at -1 then slot 1 at 2
    plan = [(0, 1, 0.5), (2, 0, -1.0), (2, 1, 2.0)]
    entries = [(row, *raw[slot], s * alphas[slot] / ranks[slot]) for row, slot, s in plan]
    want = _sgmv_reference(x, out, entries)
    on = {"device": device}
    got = out.to(device)
    lora_sgmv(
        x.to(device), got, downs.to(device), ups.to(device),
        torch.tensor([a / r for a, r in zip(alphas, ranks)], **on),
        torch.tensor([0, 2, 2], dtype=torch.int32, **on), torch.tensor([1, 0, 1], dtype=torch.int32, **on),
        torch.tensor([0.5, -1.0, 2.0], **on), torch.tensor([0, 2], dtype=torch.int32, **on),
        torch.tensor([0, 1, 3], dtype=torch.int32, **on),
    )  # fmt: skip
    assert torch.equal(got[1].cpu(), out[1]), "a row without entries was written"
    return rel(got, want)


def kernel_checks(device: str) -> dict[str, Any]:
    """The Triton path against the reference, and its negative controls, as ``{check: relative error}``."""
    from fv_kernel.compute.lora_triton import triton_interpreted

    model, x = tiny_model(device), inputs(device)
    want = reference(model, x, ROW_STACKS)
    results: dict[str, Any] = {"interpreted": triton_interpreted()}
    results["sgmv_tiles"] = sgmv_tiles(device)
    results["triton"] = rel(per_row(model, x, ROW_STACKS, "triton", device), want)
    results["shuffled_routing"] = rel(per_row(model, x, shuffled(ROW_STACKS), "triton", device), want)
    # 2-D inputs, as a time embedding's linear gets them: [rows, features].
    results["rows_2d"] = rel(per_row(model, x[:, 0], ROW_STACKS, "triton", device), reference(model, x[:, 0:1], ROW_STACKS)[:, 0])
    scale = LowRankUpdate.scale
    LowRankUpdate.scale = property(lambda self: 1.0)  # type: ignore[method-assign,assignment]
    try:
        results["dropped_alpha"] = rel(per_row(model, x, ROW_STACKS, "triton", device), want)
    finally:
        LowRankUpdate.scale = scale  # type: ignore[method-assign]
    results["alone_vs_batched"] = rows_alone_vs_batched(model, x, "triton", device)
    results["no_tokens"] = list(per_row(model, x[:, :0], ROW_STACKS, "triton", device).shape)
    kernel = TritonRowKernel()
    twice = [per_row(model, x, ROW_STACKS, kernel, device) for _ in range(2)]  # the second from the kept stacks
    results["kept_stacks_equal"] = bool(torch.equal(twice[0], twice[1]))
    results["kept_stacks"] = len(kernel._stacks)
    tight = TritonRowKernel(max_stack_bytes=1)  # every new stack evicts the one before
    results["tight_budget"] = rel(per_row(model, x, ROW_STACKS, tight, device), want)
    results["tight_budget_stacks"] = len(tight._stacks)
    return results


@pytest.fixture(scope="module")
def kernels() -> dict[str, Any]:
    """:func:`kernel_checks` on CUDA, else in a fresh Python under Triton's interpreter."""
    results = run_kernel_checks(__file__, lambda: kernel_checks("cuda"), what="the Triton LoRA kernel")
    assert CUDA or results["interpreted"], "TRITON_INTERPRET=1 was set but Triton compiled the kernel for a GPU"
    return results


def test_triton_kernel_matches_the_reference(kernels: dict[str, Any]) -> None:
    assert kernels["sgmv_tiles"] < 1e-6
    assert kernels["triton"] < 1e-6
    assert kernels["rows_2d"] < 1e-6
    assert kernels["alone_vs_batched"] == [True] * len(REORDERED)  # bit for bit
    assert kernels["no_tokens"] == [len(ROW_STACKS), 0, 6]  # an empty sequence launches nothing


def test_triton_comparison_catches_a_shuffled_row_map_and_a_dropped_alpha(kernels: dict[str, Any]) -> None:
    assert kernels["shuffled_routing"] > 1e-2
    assert kernels["dropped_alpha"] > 1e-2


def test_triton_kernel_keeps_its_stacks_across_forwards(kernels: dict[str, Any]) -> None:
    assert kernels["kept_stacks_equal"]
    assert kernels["kept_stacks"] == 7  # one per linear with a low-rank update, built once


def test_triton_kernel_stacks_stay_within_their_byte_budget(kernels: dict[str, Any]) -> None:
    assert kernels["tight_budget_stacks"] == 1
    assert kernels["tight_budget"] < 1e-6


# --------------------------------------------------------------------------- the kernels built for an H200


def sm90_facts(kernel: str, width: int) -> dict[str, int]:
    """Both kernels compiled for sm_90 on the CPU (no GPU) at Wan 1.3B's bf16 shapes: a single-frame
    480x832 row (1,560 tokens), rank 32, ``width`` the linear's input (shrink) or output (expand)."""
    import re

    from fv_kernel.compute.fused import triton_available
    from fv_kernel.compute.lora_triton import _kernels
    from fv_kernel.testing.triton_checks import compile_for_sm90

    if not triton_available():
        if REQUIRE_KERNELS:
            pytest.fail("FV_REQUIRE_TRITON_KERNELS=1 but triton is not importable")
        pytest.skip("needs triton")
    shrink, expand = _kernels()
    pointers = {"entry_slot_ptr": "*i32"}
    if kernel == "shrink":
        build = compile_for_sm90(
            shrink, {**pointers, "x_ptr": "*bf16", "a_ptr": "*bf16", "t_ptr": "*fp32", "entry_row_ptr": "*i32",
                     "tokens": 1560, "width_in": width},
            {"BLOCK_M": 64, "BLOCK_K": 64, "BLOCK_R": 32, "PRECISION": "tf32"},
        )  # fmt: skip
    else:
        build = compile_for_sm90(
            expand, {**pointers, "t_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "active_row_ptr": "*i32",
                     "row_start_ptr": "*i32", "entry_scale_ptr": "*fp32", "slot_scale_ptr": "*fp32",
                     "tokens": 1560, "width_out": width},
            {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_R": 32, "PRECISION": "tf32"},
        )  # fmt: skip
    return {
        "wgmma": build.ptx.count("wgmma.mma_async"),
        "wide_loads": len(re.findall(r"ld\.global(?:\.[a-z]+)*\.v4\.b32|cp\.async\.cg\.shared\.global.*0x10", build.ptx)),
        "narrow_loads": len(re.findall(r"ld\.global(?:\.[a-z]+)*\.b16|cp\.async\.ca\.shared\.global.*0x2,", build.ptx)),
        "spill_bytes": build.spill_bytes,
    }


@pytest.mark.parametrize(("kernel", "width"), [("shrink", 1536), ("expand", 8960)])
def test_kernels_compile_for_sm90_with_tensor_cores_wide_loads_and_no_spills(kernel: str, width: int) -> None:
    facts = sm90_facts(kernel, width)
    assert facts["wgmma"] > 0 and facts["wide_loads"] > 0 and facts["narrow_loads"] == 0, facts
    assert facts["spill_bytes"] == 0, facts


def test_sm90_check_catches_rows_not_16_byte_aligned() -> None:
    """Negative control: an input width that is no multiple of 8 elements gathers x 2 bytes at a time."""
    facts = sm90_facts("shrink", 1530)
    assert facts["narrow_loads"] > 0 and facts["wide_loads"] == 0, facts


if __name__ == "__main__":  # the fixture's fresh-process run (TRITON_INTERPRET=1 set by the caller)
    print(json.dumps(kernel_checks("cpu")))


def test_an_adapter_pickles_after_it_was_checked() -> None:
    """Ray ships adapters to rollout actors by pickle: the weak check cache must not travel."""
    import pickle

    torch.manual_seed(0)
    root = nn.Sequential(nn.Linear(6, 4))
    adapter = AdapterWeights("a", "c", {"0": LowRankUpdate(torch.randn(2, 6), torch.randn(4, 2), 2.0)})
    adapter.check(root)  # fills the cache of checked components
    back = pickle.loads(pickle.dumps(adapter))
    assert back.version == adapter.version and back.name == "a" and back.component == "c"
    assert torch.equal(back.low_rank["0"].down, adapter.low_rank["0"].down) and back.low_rank["0"].alpha == 2.0


def test_a_compiled_block_runs_its_adapters_not_the_graph_compiled_without_them() -> None:
    """A block compiled (``compute.compile: blocks``) on a forward without adapters still runs rows_adapted's
    hooks on a later forward: the LoRA reaches the compiled blocks, not only the linears outside them.
    (torch.compile skips guards on module hooks by default; with torch 2.13 a hook added after the
    compile still runs. This holds it.)"""
    from fv_kernel.compute.compile import compile_blocks

    torch.manual_seed(0)
    root = nn.Module()
    root.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))])
    gen = torch.Generator().manual_seed(5)
    low_rank = {f"blocks.0.{i}": LowRankUpdate(down=torch.randn(4, 16, generator=gen), up=torch.randn(16, 4, generator=gen),
                                               alpha=4.0) for i in (0, 2)}
    adapted = AdapterWeights(name="a", component="c", low_rank=low_rank)
    routing = RowAdapters.from_stacks([((adapted, 1.0),), ()])
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        with rows_adapted(root, routing):
            want = root.blocks[0](x)  # eager, with the adapters
        compile_blocks(root.blocks, backend="eager")
        base = root.blocks[0](x)  # compiled here, without adapters
        with rows_adapted(root, routing):
            got = root.blocks[0](x)
        again = root.blocks[0](x)
    assert not torch.equal(want[0], base[0])  # the adapter moves row 0
    assert torch.equal(got, want) and torch.equal(again, base)
    assert root.blocks[0]._compiled_call_impl is not None  # the block stays compiled for forwards without adapters
