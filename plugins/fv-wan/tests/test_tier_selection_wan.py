"""fv-wan builds its instances through the kernel's tier selection (``select_compute_tiers``).

A tier named without a passing trajectory measurement is warned about; one whose recorded
measurement passes is not; and the options the selection returns are the ones the DiT and the
VAE decoder are each configured with (so ``fused_ops="auto"`` declined by its contract on one
component really runs eager there, and only there).
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
    TierParitySample,
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
        width=d.width, samples=tuple(TierParitySample(seed=i, psnr_db=80.0 + i / 10, reference_psnr_db=70.0) for i in range(3)),
        step_rel_error=1e-4, reference_step_rel_error=1e-3, source="test fixture")
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


def test_each_component_is_configured_with_its_own_fused_ops(card, monkeypatch: pytest.MonkeyPatch) -> None:
    # What a selection that keeps fused ops on the VAE only resolves to (on CPU: the torch reference stands in).
    resolved = ComputeOptions(fused_ops="off", vae_fused_ops="torch")
    monkeypatch.setattr(wan_instance, "select_compute_tiers", lambda compute, card_, **kwargs: TierSelection(
        compute=resolved, verdicts={}, tiers={"dit": "eager", "vae": "fused"}))
    instance = build_instance(card, InstanceOptions(compute=ComputeOptions(fused_ops="auto")))
    assert instance.component_loader("transformer").fused_ops is None
    assert isinstance(instance.component_loader("vae_decoder").decoder.fused_ops, TorchFusedOps)
    assert instance.compute_selection is not None and dict(instance.compute_selection.tiers) == {"dit": "eager", "vae": "fused"}
    # And the other way round.
    resolved = ComputeOptions(fused_ops="torch", vae_fused_ops="off")
    instance = build_instance(card, InstanceOptions(compute=ComputeOptions(fused_ops="auto")))
    assert isinstance(instance.component_loader("transformer").fused_ops, TorchFusedOps)
    assert instance.component_loader("vae_decoder").decoder.fused_ops is None


def test_the_instance_shows_each_components_tier(card) -> None:
    instance = build_instance(card, InstanceOptions(compute=ComputeOptions(fused_ops="auto")))
    assert instance.compute_selection is not None
    assert dict(instance.compute_selection.tiers) == {"dit": "eager", "vae": "eager"}  # CPU: no Triton kernels
