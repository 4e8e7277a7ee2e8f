"""Compile tiers: key logic and the cache on CPU; compiled and CUDA-graph parity on a GPU."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from fv_kernel.compute.compile import (
    CompileCache,
    CompileKey,
    ComputeOptions,
    GraphedStep,
    bucket_for,
)

CUDA = torch.cuda.is_available()
BASE = CompileKey(
    model="wan2.1-t2v-1.3b", component="transformer", loop="denoise", kind="diffusion_step",
    shape_signature=(("tokens", 32760),), precision="bf16", backend="sdpa_cudnn", tier="blocks",
)

@pytest.mark.parametrize(
    "field, value",
    [("model", "wan-tiny"), ("component", "transformer_2"), ("loop", "dmd_3step"), ("kind", "vae_decode"),
     ("shape_signature", (("tokens", 1560),)), ("precision", "fp32"), ("parallel_plan", "sp2"),
     ("backend", "sdpa_flash"), ("tier", "eager")],
)
def test_every_key_field_separates_artifacts(field: str, value: object) -> None:
    other = BASE.model_copy(update={field: value})
    assert other != BASE and other.digest() != BASE.digest()
    cache = CompileCache()
    assert cache.get_or_build(BASE, lambda: "a") == "a"
    assert cache.get_or_build(other, lambda: "b") == "b"
    assert cache.stats.misses == 2 and cache.stats.hits == 0


def test_digest_is_stable_and_shapes_merge() -> None:
    again = CompileKey(**BASE.model_dump())
    assert again.digest() == BASE.digest() and len(BASE.digest()) == 16
    bucketed = BASE.with_shapes(batch_bucket=8)
    assert dict(bucketed.shape_signature) == {"tokens": 32760, "batch_bucket": 8}
    assert bucketed.with_shapes(batch_bucket=8) == bucketed


def test_cache_builds_once_evicts_lru_and_keeps_nothing_from_a_failed_build() -> None:
    cache = CompileCache(max_entries=2)
    builds = []
    keys = [BASE.with_shapes(batch_bucket=b) for b in (1, 2, 4)]
    for key in (keys[0], keys[0], keys[1], keys[0], keys[2]):
        cache.get_or_build(key, lambda k=key: builds.append(k) or len(builds))
    assert builds == [keys[0], keys[1], keys[2]]
    assert cache.stats.hits == 2 and cache.stats.evictions == 1
    assert keys[1] not in cache and keys[0] in cache  # keys[0] was used more recently than keys[1]
    assert cache.build_seconds(keys[2]) is not None

    def broken() -> None:
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        cache.get_or_build(keys[1], broken)
    assert keys[1] not in cache
    with pytest.raises(TypeError, match="CompileKey"):
        cache.get_or_build(("not", "a", "key"), lambda: 0)  # type: ignore[arg-type]


def test_buckets_and_options() -> None:
    assert [bucket_for(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    with pytest.raises(ValueError, match="batch must be >= 1"):
        bucket_for(0, (1, 2))
    with pytest.raises(ValidationError, match="strictly increasing"):
        ComputeOptions(graph_batch_buckets=(4, 2))
    assert ComputeOptions().tier == "eager"
    assert ComputeOptions(fused_ops="auto", cuda_graphs=True).tier == "fused+graphs"
    assert ComputeOptions(compile="blocks").tier == "blocks"


def test_graphed_step_runs_eagerly_off_cuda() -> None:
    calls = []

    def step(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls.append(inputs["x"].shape[0])
        return {"y": inputs["x"] * 2}

    graphed = GraphedStep(step, key_base=BASE, cache=CompileCache(), buckets=(1, 2, 4))
    x = torch.randn(3, 5)
    assert torch.equal(graphed({"x": x})["y"], x * 2)
    assert graphed.eager_calls == 1 and graphed.replays == 0 and calls == [3]
    key = graphed.key_for({"x": x}, 4)
    assert dict(key.shape_signature)["x.shape"] == "5" and dict(key.shape_signature)["batch_bucket"] == 4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
