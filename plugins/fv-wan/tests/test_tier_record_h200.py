"""The tier-parity record measured on the H200 (``bench/records/tier_parity_h200.json``, written by
``bench/bench_tier_parity.py --record`` on 2026-12-02; docs/benchmarks.md has the run) holds one
sample per tier and card, from before the contract became statistical (issue 36, 2). It still
loads, and a deployment naming it still deploys, but no verdict is drawn from one sample: each says
so, naming the record's ``samples`` field and the command that measures enough of them.

- ``fused_ops: auto`` keeps the Triton kernels off on both components of both cards (under the old
  single-sample rule it kept them on wan2.1-t2v-1.3b, 48.46 dB against its 45.38 dB floor, and
  declined them on fastwan2.1-t2v-1.3b, 48.22 dB against 48.44 dB).
- Tiers named by the deployment (CUDA graphs, compiled blocks) still run, warned.
"""

from __future__ import annotations


import pytest

from tier_records import CARDS, RECORDS, select_with_record

from fv_kernel.api import ComputeOptions, load_parity_record, select_compute_tiers

RECORD = RECORDS / "tier_parity_h200.json"


@pytest.fixture(autouse=True)
def triton_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule only weighs the Triton tier where Triton runs; the record is what is tested here."""
    monkeypatch.setattr("fv_kernel.compute.fused.triton_available", lambda: True)


def select(model_id: str, **compute: object):
    return select_with_record(RECORD, model_id, **compute)


def test_the_record_holds_full_trajectories_at_each_cards_defaults() -> None:
    record = load_parity_record(RECORD)
    for measurement in record.measurements:
        d = CARDS[measurement.model_id].capabilities.defaults
        assert (measurement.steps, measurement.frames, measurement.height, measurement.width) == (
            d.steps, d.frames, d.height, d.width)
        assert "NVIDIA H200" in measurement.source


@pytest.mark.parametrize("model_id", ["wan2.1-t2v-1.3b", "fastwan2.1-t2v-1.3b"])
def test_a_single_sample_record_is_loaded_but_not_judged(model_id: str) -> None:
    selection = select(model_id, fused_ops="auto", cuda_graphs=True)
    assert selection.declined == ("fused/dit", "fused/vae") and selection.overridden == ("graphs/dit",)
    assert selection.compute is not None and selection.compute.fused_ops == "off"
    assert dict(selection.tiers) == {"dit": "graphs", "vae": "eager"}
    for verdict in selection.verdicts.values():
        assert not verdict.passed and "1 sample(s) in 'samples'" in verdict.reason and "--samples 3" in verdict.reason
        assert "NVIDIA H200" in verdict.reason  # the measurement's source is quoted


def test_without_the_record_auto_runs_eager() -> None:
    card = CARDS["wan2.1-t2v-1.3b"]
    selection = select_compute_tiers(ComputeOptions(fused_ops="auto"), card, device="cuda", precision="bf16",
                                     attention_backend="sdpa")
    assert selection.compute is not None and selection.compute.fused_ops == "off"
