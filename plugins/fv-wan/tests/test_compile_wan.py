"""Kernel compute tiers (fused ops, per-block compile, CUDA graphs) on the Wan DiT: each equals eager."""

from __future__ import annotations

import pytest
import torch

from fv_kernel.compute.compile import CompileCache, CompileKey, GraphedStep, compile_blocks
from fv_wan.models.transformer import WanTransformer, WanTransformerConfig, cast_for_inference

CUDA = torch.cuda.is_available()
BASE = CompileKey(
    model="wan2.1-t2v-1.3b", component="transformer", loop="denoise", kind="diffusion_step",
    shape_signature=(("tokens", 32760),), precision="bf16", backend="sdpa_cudnn", tier="blocks",
)


def _tiny(dtype: torch.dtype, device: str) -> WanTransformer:
    torch.manual_seed(0)
    model = WanTransformer(WanTransformerConfig.tiny()).to(device).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return cast_for_inference(model, dtype)


def _inputs(device: str, batch: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(batch)
    return (
        torch.randn(batch, 16, 3, 8, 6, generator=g).to(device),
        torch.rand(batch, generator=g).mul(1000).to(device),
        torch.randn(batch, 10, 32, generator=g).to(device),
    )


def test_block_compile_keeps_keys_and_results_on_cpu() -> None:
    model = _tiny(torch.float32, "cpu")
    keys = list(model.state_dict())
    inputs = _inputs("cpu", 1)
    with torch.no_grad():
        eager = model(*inputs)
        assert compile_blocks(model.blocks, backend="eager") == 2
        compiled = model(*inputs)
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_inductor_blocks_match_eager_on_gpu() -> None:
    model = _tiny(torch.bfloat16, "cuda")
    inputs = _inputs("cuda", 2)
    with torch.no_grad():
        eager = model(*inputs)
        compile_blocks(model.blocks)
        compiled = model(*inputs)
    assert _rel(compiled, eager) < 2e-2


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graph_step_matches_eager_with_bucket_padding() -> None:
    model = _tiny(torch.bfloat16, "cuda")

    def step(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"v": model(d["x"], d["t"], d["context"]).float()}

    graphed = GraphedStep(step, key_base=BASE, cache=CompileCache(), buckets=(1, 4))
    with torch.no_grad():
        for batch in (3, 1, 3):
            x, t, context = _inputs("cuda", batch)
            eager = model(x, t, context).float()
            out = graphed({"x": x, "t": t, "context": context})["v"]
            assert out.shape == eager.shape
            assert _rel(out, eager) < 2e-2
    assert graphed.replays == 3 and graphed.cache.stats.misses == 2 and graphed.cache.stats.hits == 1


def test_sequential_cfg_dispatch_runs_each_branch_through_the_graphs() -> None:
    # With cfg_dispatch "sequential" (the cards' default) every guidance branch is its own forward:
    # each must replay the captured graphs, not fall back to eager (the graphs tier then measured eager).
    from fv_wan.instance import _dit_op

    model = _tiny(torch.float32, "cpu")
    calls: list[int] = []

    def graphs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls.append(batch["x"].shape[0])
        return {"v": model(batch["x"], batch["t"], batch["context"], batch.get("image_embeds")).float()}

    x, t, context = _inputs("cpu", 4)  # two requests x (cond, uncond), request-major
    inputs = {"x": x, "t": t, "context": context}
    params = {"dispatch": "sequential", "branches": 2}
    with torch.no_grad():
        graphed = _dit_op("transformer", model, graphs).fn(inputs, params)["v"]  # type: ignore[arg-type]
        eager = _dit_op("transformer", model, None).fn(inputs, params)["v"]
    assert calls == [2, 2], "one graph replay per branch, each over both requests' rows of that branch"
    assert torch.equal(graphed, eager)
