"""Each fast compute tier's parity contract, and the rule that a tier failing it is not selected by default.

Contracts (``TIER_PARITY_CONTRACTS``) are judged on recorded full-trajectory measurements
(``TierParityMeasurement``, written by ``bench/bench_tier_parity.py``); ``select_compute_tiers``
resolves ``fused_ops="auto"`` on CUDA to eager unless the fused tier's measurement passes, and
keeps (with a warning) a tier asked for by name. Device strings are only inspected, never used,
so the CUDA cases run on CPU.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from fv_kernel.card.spec import (
    TIER_PARITY_CONTRACTS,
    AttentionAssumption,
    ModelCard,
    TierParityContract,
    TierParityMeasurement,
    TierParityRecord,
)
from fv_kernel.compute import compile as compile_module
from fv_kernel.compute import fused as fused_module
from fv_kernel.compute.compile import ComputeOptions, ParityRecordError, load_parity_record, select_compute_tiers
from fv_kernel.config import CardDeployment
from fv_kernel.testing.toy import toy_card


@pytest.fixture
def card() -> ModelCard:
    return toy_card("toy-dit")  # defaults: 4 steps at 3x8x8, fp32


def measured(card: ModelCard, tier: str = "fused", *, psnr: float = 60.0, reference: float = 45.0,
             step: float | None = 1e-3, reference_step: float | None = 4e-3, steps: int | None = None) -> TierParityMeasurement:
    d = card.capabilities.defaults
    assert d is not None
    return TierParityMeasurement(
        tier=tier, model_id=card.model_id, precision="fp32", steps=steps or d.steps, frames=d.frames, height=d.height,
        width=d.width, psnr_db=psnr, reference_psnr_db=reference, step_rel_error=step, reference_step_rel_error=reference_step,
        source="test fixture",
    )


def verdict(card: ModelCard, m: TierParityMeasurement | None, tier: str = "fused"):
    return TIER_PARITY_CONTRACTS[tier].check(m, model_id=card.model_id, precision="fp32", defaults=card.capabilities.defaults)


# --------------------------------------------------------------------------- the contract


def test_every_fast_tier_declares_a_contract() -> None:
    assert set(TIER_PARITY_CONTRACTS) == {"fused", "graphs", "blocks", "vsa"}
    for tier, contract in TIER_PARITY_CONTRACTS.items():
        assert contract.tier == tier and contract.psnr_margin_db == 0.0 and contract.max_step_error_ratio == 1.0


def test_a_tier_no_worse_than_the_precision_itself_passes(card: ModelCard) -> None:
    result = verdict(card, measured(card))
    assert result.passed, result.reason
    identical = verdict(card, measured(card, psnr=math.inf, reference=math.inf, step=0.0, reference_step=0.0))
    assert identical.passed, identical.reason  # bitwise-equal tiers (CUDA graphs) pass against a bitwise reference


def test_a_trajectory_below_the_precision_floor_fails(card: ModelCard) -> None:
    result = verdict(card, measured(card, psnr=44.9, reference=45.0))
    assert not result.passed and "below the floor 45.00 dB" in result.reason and "test fixture" in result.reason
    # The margin is read: 0.2 dB of slack lets 44.9 through.
    lenient = TierParityContract(tier="fused", psnr_margin_db=0.2)
    assert lenient.check(measured(card, psnr=44.9), model_id=card.model_id, precision="fp32",
                         defaults=card.capabilities.defaults).passed
    # A reference of inf (eager at the precision is exact) demands an exact tier.
    assert not verdict(card, measured(card, psnr=120.0, reference=math.inf)).passed
    assert not verdict(card, measured(card, psnr=math.nan)).passed


def test_one_forward_worse_than_the_precision_fails(card: ModelCard) -> None:
    result = verdict(card, measured(card, step=5e-3, reference_step=4e-3))
    assert not result.passed and "one forward differs" in result.reason
    assert not verdict(card, measured(card, step=None)).passed  # the bound needs the figure
    no_step_promise = TierParityContract(tier="fused", max_step_error_ratio=None)
    assert no_step_promise.check(measured(card, step=None), model_id=card.model_id, precision="fp32",
                                 defaults=card.capabilities.defaults).passed


def test_only_the_cards_full_default_trajectory_counts(card: ModelCard) -> None:
    short = verdict(card, measured(card, steps=2))
    assert not short.passed and "full default trajectory (4 steps at 3x8x8)" in short.reason
    assert verdict(card, measured(card, steps=8)).passed  # more steps than the default is still full
    other_size = measured(card).model_copy(update={"height": 16})
    assert not verdict(card, other_size).passed


def test_nothing_recorded_fails_and_a_foreign_measurement_is_refused(card: ModelCard) -> None:
    missing = verdict(card, None)
    assert not missing.passed and "no trajectory measurement recorded" in missing.reason
    with pytest.raises(ValueError, match="measurement is of tier 'blocks'"):
        verdict(card, measured(card, "blocks"), tier="fused")


def test_a_record_finds_by_tier_card_and_precision_and_merges(card: ModelCard) -> None:
    old, new, blocks = measured(card, psnr=40.0), measured(card, psnr=50.0), measured(card, "blocks")
    record = TierParityRecord(measurements=(old, blocks)).merged([new])
    assert record.find("fused", card.model_id, "fp32") == new
    assert record.find("blocks", card.model_id, "fp32") == blocks
    assert record.find("fused", card.model_id, "bf16") is None and record.find("fused", "other", "fp32") is None


def test_a_record_file_round_trips_infinity_and_bad_files_name_the_field(tmp_path: Path, card: ModelCard) -> None:
    path = tmp_path / "record.json"
    record = TierParityRecord(measurements=(measured(card, psnr=math.inf),))
    path.write_text(record.model_dump_json())
    assert load_parity_record(path) == record
    with pytest.raises(ParityRecordError, match="compute.parity_record: .* does not exist"):
        load_parity_record(tmp_path / "missing.json")
    path.write_text(json.dumps({"measurements": [{"tier": "turbo"}]}))
    with pytest.raises(ParityRecordError, match="is not a TierParityRecord"):
        load_parity_record(path)
    path.write_text("{not json")
    with pytest.raises(ParityRecordError, match="is not a TierParityRecord"):
        load_parity_record(path)


# --------------------------------------------------------------------------- the selection rule


@pytest.fixture
def triton_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_module, "triton_available", lambda: True)


def record_file(tmp_path: Path, *measurements: TierParityMeasurement) -> Path:
    path = tmp_path / "tier_parity.json"
    path.write_text(TierParityRecord(measurements=measurements).model_dump_json())
    return path


def select(card: ModelCard, compute: ComputeOptions | None, device: str = "cuda", attention: str = "sdpa"):
    return select_compute_tiers(compute, card, device=device, precision="fp32", attention_backend=attention)


def test_auto_fused_is_not_selected_without_a_measurement(card: ModelCard, triton_importable: None) -> None:
    selection = select(card, ComputeOptions(fused_ops="auto"))
    assert selection.compute is not None and selection.compute.fused_ops == "off" and selection.compute.tier == "eager"
    assert selection.declined == ("fused",) and not selection.verdicts["fused"].passed


def test_auto_fused_is_selected_when_its_measurement_passes(tmp_path: Path, card: ModelCard, triton_importable: None) -> None:
    compute = ComputeOptions(fused_ops="auto", parity_record=record_file(tmp_path, measured(card)))
    selection = select(card, compute)
    assert selection.compute == compute and selection.verdicts["fused"].passed and selection.declined == ()


def test_a_failing_measurement_stops_default_selection(tmp_path: Path, card: ModelCard, triton_importable: None) -> None:
    """Negative control: the same options with a measurement below the floor run eager."""
    compute = ComputeOptions(fused_ops="auto", parity_record=record_file(tmp_path, measured(card, psnr=30.0)))
    selection = select(card, compute)
    assert selection.compute is not None and selection.compute.fused_ops == "off"
    assert selection.declined == ("fused",) and "below the floor" in selection.verdicts["fused"].reason


def test_a_measurement_at_another_precision_does_not_count(tmp_path: Path, card: ModelCard, triton_importable: None) -> None:
    bf16 = measured(card).model_copy(update={"precision": "bf16"})
    selection = select(card, ComputeOptions(fused_ops="auto", parity_record=record_file(tmp_path, bf16)))
    assert selection.compute is not None and selection.compute.fused_ops == "off"


def test_auto_off_cuda_or_without_triton_is_no_tier(card: ModelCard, monkeypatch: pytest.MonkeyPatch) -> None:
    compute = ComputeOptions(fused_ops="auto")
    assert select(card, compute, device="cpu").compute == compute  # auto picks no kernels off CUDA anyway
    monkeypatch.setattr(fused_module, "triton_available", lambda: False)
    assert select(card, compute).verdicts == {}
    assert select(card, None).compute is None
    assert select(card, ComputeOptions(fused_ops="torch")).verdicts == {}  # eager's own formulas


def test_named_tiers_run_against_their_contract_with_a_warning(card: ModelCard, caplog: pytest.LogCaptureFixture) -> None:
    compute = ComputeOptions(fused_ops="triton", compile="blocks", cuda_graphs=True)
    with caplog.at_level(logging.WARNING, logger=compile_module.__name__):
        selection = select(card, compute)
    assert selection.compute == compute  # the user's override still selects every tier
    assert selection.overridden == ("fused", "blocks", "graphs") and selection.declined == ()
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 3 and all("outside its parity contract" in m and "no trajectory measurement" in m for m in warned)
    # CUDA graphs off CUDA are not captured at all: no tier, no warning.
    assert "graphs" not in select(card, ComputeOptions(cuda_graphs=True), device="cpu").verdicts


def test_a_named_tier_that_passes_is_not_warned(tmp_path: Path, card: ModelCard, caplog: pytest.LogCaptureFixture) -> None:
    compute = ComputeOptions(compile="blocks", parity_record=record_file(tmp_path, measured(card, "blocks")))
    with caplog.at_level(logging.WARNING, logger=compile_module.__name__):
        selection = select(card, compute, device="cpu")
    assert selection.overridden == () and selection.verdicts["blocks"].passed and not caplog.records


def test_vsa_is_a_tier_unless_the_recipe_trained_under_it(card: ModelCard) -> None:
    assert not select(card, None, attention="vsa").verdicts["vsa"].passed
    assert select(card, None, attention="vsa").overridden == ("vsa",)
    recipe = card.recipe.model_copy(update={"assumes_attention": AttentionAssumption(kind="vsa", sparsity=0.8)})
    vsa_card = card.model_copy(update={"recipe": recipe})
    assert select(vsa_card, None, attention="vsa").verdicts == {}  # the card's own attention


def test_a_wrong_record_path_fails_at_selection_even_with_no_tier_on(tmp_path: Path, card: ModelCard) -> None:
    with pytest.raises(ParityRecordError, match="compute.parity_record"):
        select(card, ComputeOptions(parity_record=tmp_path / "typo.json"), device="cpu")


def test_the_deploy_config_carries_the_record_path(tmp_path: Path) -> None:
    deployment = CardDeployment.model_validate({"model": "toy-dit", "compute": {"fused_ops": "auto", "parity_record": str(tmp_path)}})
    assert deployment.compute is not None and deployment.compute.parity_record == tmp_path
