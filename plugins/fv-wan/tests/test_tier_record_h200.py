"""The tier-parity record measured on the H200 (``bench/records/tier_parity_h200.json``, written by
``bench/bench_tier_parity.py --record``; docs/benchmarks.md has the run) decides what the
selection rule does for the real cards when a deployment names it as ``compute.parity_record``:

- wan2.1-t2v-1.3b (50 steps at 81x480x832): ``fused_ops: auto`` keeps the Triton kernels (48.46 dB
  against the 45.38 dB floor) and CUDA graphs pass (bit-identical); compiled blocks fail (45.33 dB).
- fastwan2.1-t2v-1.3b (3 steps at 61x448x832, under its VSA): ``auto`` declines the Triton kernels
  (48.22 dB against the 48.44 dB floor); CUDA graphs pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fv_kernel.api import ComputeOptions, load_parity_record, select_compute_tiers
from fv_wan.cards import wan_cards

RECORD = Path(__file__).resolve().parents[3] / "bench" / "records" / "tier_parity_h200.json"
CARDS = {c.model_id: c for c in wan_cards()}


@pytest.fixture(autouse=True)
def triton_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule only weighs the Triton tier where Triton runs; the record is what is tested here."""
    monkeypatch.setattr("fv_kernel.compute.fused.triton_available", lambda: True)


def select(model_id: str, **compute: object):
    card = CARDS[model_id]
    assumed = card.recipe.assumes_attention
    return select_compute_tiers(ComputeOptions(parity_record=RECORD, **compute), card, device="cuda", precision="bf16",
                                attention_backend="sdpa" if assumed is None else assumed.kind)


def test_the_record_holds_full_trajectories_at_each_cards_defaults() -> None:
    record = load_parity_record(RECORD)
    for measurement in record.measurements:
        d = CARDS[measurement.model_id].capabilities.defaults
        assert (measurement.steps, measurement.frames, measurement.height, measurement.width) == (
            d.steps, d.frames, d.height, d.width)
        assert "NVIDIA H200" in measurement.source


def test_wan21_auto_keeps_the_fused_kernels_and_graphs_but_not_compiled_blocks() -> None:
    selection = select("wan2.1-t2v-1.3b", fused_ops="auto", cuda_graphs=True, compile="blocks")
    assert selection.compute is not None and selection.compute.fused_ops == "auto"
    assert selection.verdicts["fused"].passed and selection.verdicts["graphs"].passed
    assert not selection.verdicts["blocks"].passed and selection.overridden == ("blocks",)


def test_fastwan_auto_declines_the_fused_kernels_and_keeps_graphs() -> None:
    selection = select("fastwan2.1-t2v-1.3b", fused_ops="auto", cuda_graphs=True)
    assert selection.declined == ("fused",) and selection.compute is not None and selection.compute.fused_ops == "off"
    assert selection.verdicts["graphs"].passed and selection.overridden == ()


def test_without_the_record_auto_runs_eager() -> None:
    card = CARDS["wan2.1-t2v-1.3b"]
    selection = select_compute_tiers(ComputeOptions(fused_ops="auto"), card, device="cuda", precision="bf16",
                                     attention_backend="sdpa")
    assert selection.compute is not None and selection.compute.fused_ops == "off"
