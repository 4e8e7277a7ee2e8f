"""A pinned attention driver keeps its kernel under ``torch.compile`` (issue 19: compiled blocks' peak).

Traced as a plain SDPA call, the kernel is re-chosen when the graph is compiled, not by the
``sdpa_kernel`` context the eager path pins it with. Under inference the pinned drivers hand
the compiler one opaque op, ``fv::pinned_sdpa``, that runs the pinned kernel.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._functorch.aot_autograd import aot_module_simplified

from fv_kernel.compute.attention_backends import SDPAMathAttention, pinned_sdpa


def _compiled_graphs(fn: Any, *args: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """Run ``fn`` under torch.compile with a backend that keeps each forward graph's code."""
    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        def forward_compiler(graph: torch.fx.GraphModule, _: Any) -> torch.fx.GraphModule:
            graphs.append(graph.code)
            return graph

        return aot_module_simplified(gm, example, fw_compiler=forward_compiler)

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)(*args), graphs


def test_inference_under_compile_runs_the_pinned_op() -> None:
    driver = SDPAMathAttention()
    q, k, v = (torch.randn(1, 2, 24, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with torch.no_grad():
        compiled, graphs = _compiled_graphs(lambda q, k, v: driver.attend(q, k, v) * 2, q, k, v)
        eager = driver.attend(q, k, v) * 2
    assert len(graphs) == 1
    assert "torch.ops.fv.pinned_sdpa.default" in graphs[0] and "'MATH'" in graphs[0]
    assert "scaled_dot_product" not in graphs[0]  # the compiler did not get a plain SDPA to re-choose
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_training_under_compile_keeps_a_differentiable_path() -> None:
    # The opaque op registers no backward; with grad enabled the plain (pinned) SDPA is traced instead.
    driver = SDPAMathAttention()
    q = torch.randn(1, 2, 24, 16, requires_grad=True)
    out, graphs = _compiled_graphs(lambda q: driver.attend(q, q, q).sum(), q)
    out.backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert graphs and all("fv.pinned_sdpa" not in g for g in graphs)


def test_pinned_op_matches_the_eager_driver_and_checks_its_backend_name() -> None:
    q = torch.randn(2, 3, 10, 8)
    mask = torch.rand(10, 10) > 0.3
    mask.fill_diagonal_(True)
    eager = SDPAMathAttention().attend(q, q, q, attn_mask=mask, scale=0.5)
    torch.testing.assert_close(pinned_sdpa(q, q, q, mask, False, 0.5, "MATH"), eager, rtol=0, atol=0)
    with pytest.raises(AttributeError):
        pinned_sdpa(q, q, q, None, False, None, "NO_SUCH_BACKEND")
