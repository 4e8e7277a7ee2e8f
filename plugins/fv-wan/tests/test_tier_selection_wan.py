"""fv-wan builds its instances through the kernel's tier selection (``select_compute_tiers``).

A tier named without a passing trajectory measurement is warned about; one whose recorded
measurement passes is not; and the options the selection returns are the ones the DiT is
configured with (so ``fused_ops="auto"`` declined by its contract really runs eager).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import fv_wan.instance as wan_instance
from fv_kernel.api import (
    ComputeOptions,
    InstanceOptions,
    TierParityMeasurement,
    TierParityRecord,
    TierSelection,
    build_instance,
)
from fv_kernel.compute.fused import TorchFusedOps
from fv_wan.cards import wan_cards

COMPILE_LOGGER = "fv_kernel.compute.compile"


@pytest.fixture
def card():
    return next(c for c in wan_cards() if c.model_id == "wan-tiny")


def test_a_named_tier_without_a_measurement_is_built_and_warned(card, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=COMPILE_LOGGER):
        build_instance(card, InstanceOptions(compute=ComputeOptions(compile="blocks")))
    assert any("'blocks'" in r.getMessage() and "no trajectory measurement" in r.getMessage() for r in caplog.records)


def test_a_passing_record_silences_the_warning(card, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = card.capabilities.defaults
    passing = TierParityMeasurement(
        tier="blocks", model_id=card.model_id, precision="fp32", steps=d.steps, frames=d.frames, height=d.height,
        width=d.width, psnr_db=80.0, reference_psnr_db=70.0, step_rel_error=1e-4, reference_step_rel_error=1e-3,
        source="test fixture")
    record = tmp_path / "record.json"
    record.write_text(TierParityRecord(measurements=(passing,)).model_dump_json())
    with caplog.at_level(logging.WARNING, logger=COMPILE_LOGGER):
        build_instance(card, InstanceOptions(compute=ComputeOptions(compile="blocks", parity_record=record)))
    assert not [r for r in caplog.records if "parity contract" in r.getMessage()]


def test_the_dit_is_configured_with_the_selected_options(card, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def selected(compute, card_, **kwargs):
        seen["asked"] = compute
        return TierSelection(compute=ComputeOptions(fused_ops="torch"), verdicts={})

    monkeypatch.setattr(wan_instance, "select_compute_tiers", selected)
    instance = build_instance(card, InstanceOptions())
    assert seen["asked"] is None  # nothing was asked for; the selection's answer is what loads
    model = instance.component_loader("transformer")
    assert isinstance(model.fused_ops, TorchFusedOps)
