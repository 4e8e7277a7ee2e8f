"""The tier-parity record of FastWan measured over three seeds on an H100 (``bench/records/tier_parity_h100.json``,
written by ``bench/bench_tier_parity.py --samples 3 --record`` on 2026-12-05; docs/benchmarks.md has the run).

Under the statistical rule (performance.md: the 95% lower bound of the mean PSNR difference to each
sample's floor at least -0.5 dB over at least 3 samples) it passes the Triton kernels on FastWan's DiT
(-0.22 dB mean, -0.23 dB bound) and VAE (+0.89 dB) and CUDA graphs (exact): named as a deployment's
``compute.parity_record``, ``fused_ops: auto`` runs them, where the one-sample H200 record kept them off.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tier_records import CARDS, RECORDS, select_with_record

from fv_kernel.api import load_parity_record

RECORD = RECORDS / "tier_parity_h100.json"


@pytest.fixture(autouse=True)
def triton_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule only weighs the Triton tier where Triton runs; the record is what is tested here."""
    monkeypatch.setattr("fv_kernel.compute.fused.triton_available", lambda: True)


def _select(record: Path, **compute: object):
    return select_with_record(record, "fastwan2.1-t2v-1.3b", **compute)


def test_the_record_holds_three_fastwan_trajectories_per_tier_at_its_defaults() -> None:
    record = load_parity_record(RECORD)
    d = CARDS["fastwan2.1-t2v-1.3b"].capabilities.defaults
    assert {(m.tier, m.component) for m in record.measurements} == {("fused", "dit"), ("fused", "vae"), ("graphs", "dit")}
    for measurement in record.measurements:
        assert measurement.model_id == "fastwan2.1-t2v-1.3b" and "NVIDIA H100" in measurement.source
        assert (measurement.steps, measurement.frames, measurement.height, measurement.width) == (
            d.steps, d.frames, d.height, d.width)
        assert [s.seed for s in measurement.samples] == [0, 1, 2]


def test_auto_runs_the_triton_kernels_and_graphs_on_fastwan() -> None:
    selection = _select(RECORD, fused_ops="auto", cuda_graphs=True)
    assert selection.declined == () and selection.overridden == ()
    assert dict(selection.tiers) == {"dit": "fused+graphs", "vae": "fused"}
    assert all(verdict.passed for verdict in selection.verdicts.values())


def test_a_sample_moved_under_the_bound_declines_the_dit_kernels(tmp_path: Path) -> None:
    """Negative control: the same record with one fused/dit sample 1.5 dB lower fails the 95% bound."""
    record = load_parity_record(RECORD)
    measurements = []
    for m in record.measurements:
        if (m.tier, m.component) == ("fused", "dit"):
            worse = m.samples[0].model_copy(update={"psnr_db": m.samples[0].psnr_db - 1.5})
            m = m.model_copy(update={"samples": (worse, *m.samples[1:])})
        measurements.append(m)
    broken = tmp_path / "record.json"
    broken.write_text(record.model_copy(update={"measurements": tuple(measurements)}).model_dump_json())
    selection = _select(broken, fused_ops="auto", cuda_graphs=True)
    assert "fused/dit" in selection.declined and not selection.verdicts["fused/dit"].passed
    assert dict(selection.tiers)["vae"] == "fused"
