"""Each fast compute tier's parity contract, and the rule that a tier failing it is not selected by default.

Contracts (``TIER_PARITY_CONTRACTS``) are judged on recorded full-trajectory measurements over
several samples (``TierParityMeasurement.samples``, written by ``bench/bench_tier_parity.py``): the
95% lower confidence bound of the mean per-sample difference from the floor must be within the
margin. ``select_compute_tiers`` resolves ``fused_ops="auto"`` on CUDA per component (the DiT apart
from the VAE) to eager unless the fused tier's measurement on that component passes, and keeps
(with a warning) a tier asked for by name. Device strings are only inspected, never used, so the
CUDA cases run on CPU.
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
    TierParitySample,
    t_quantile_95,
)
from fv_kernel.compute import compile as compile_module
from fv_kernel.compute import fused as fused_module
from fv_kernel.compute.compile import ComputeOptions, ParityRecordError, load_parity_record, select_compute_tiers
from fv_kernel.config import CardDeployment
from fv_kernel.testing.toy import toy_card


@pytest.fixture
def card() -> ModelCard:
    return toy_card("toy-dit")  # defaults: 4 steps at 3x8x8, fp32


#: Per-sample offsets (dB) around a measurement's PSNR: a realistic spread over seeds (sd 0.1 dB).
SPREAD = (0.1, -0.1, 0.05, -0.05)


def measured(card: ModelCard, tier: str = "fused", *, psnr: float = 60.0, reference: float = 45.0,
             step: float | None = 1e-3, reference_step: float | None = 4e-3, steps: int | None = None,
             component: str = "all", psnrs: tuple[float, ...] | None = None) -> TierParityMeasurement:
    """A measurement over four seeds: ``psnrs`` per sample, else ``psnr`` plus SPREAD (inf and NaN as given)."""
    d = card.capabilities.defaults
    assert d is not None
    if psnrs is None:
        psnrs = tuple(psnr + o if math.isfinite(psnr) else psnr for o in SPREAD)
    samples = tuple(TierParitySample(seed=i, prompt=f"prompt {i}", psnr_db=p, reference_psnr_db=reference)
                    for i, p in enumerate(psnrs))
    return TierParityMeasurement(
        tier=tier, component=component, model_id=card.model_id, precision="fp32", steps=steps or d.steps, frames=d.frames,
        height=d.height, width=d.width, samples=samples, step_rel_error=step, reference_step_rel_error=reference_step,
        source="test fixture",
    )


def verdict(card: ModelCard, m: TierParityMeasurement | None, tier: str = "fused", component: str = "dit"):
    return TIER_PARITY_CONTRACTS[tier].check(m, model_id=card.model_id, precision="fp32", defaults=card.capabilities.defaults,
                                             component=component)


# --------------------------------------------------------------------------- the contract


def test_every_fast_tier_declares_a_contract() -> None:
    assert set(TIER_PARITY_CONTRACTS) == {"fused", "graphs", "blocks", "vsa"}
    for tier, contract in TIER_PARITY_CONTRACTS.items():
        # The stated tolerance (docs/performance.md): 0.5 dB at 95% confidence, over at least 3 samples.
        assert contract.tier == tier and contract.psnr_margin_db == 0.5 and contract.min_samples == 3
        assert contract.max_step_error_ratio == 1.0


def test_a_tier_no_worse_than_the_precision_itself_passes(card: ModelCard) -> None:
    result = verdict(card, measured(card))
    assert result.passed, result.reason
    identical = verdict(card, measured(card, psnr=math.inf, reference=math.inf, step=0.0, reference_step=0.0))
    assert identical.passed, identical.reason  # bitwise-equal tiers (CUDA graphs) pass against a bitwise reference


def test_a_trajectory_below_the_precision_floor_fails(card: ModelCard) -> None:
    result = verdict(card, measured(card, psnr=44.0, reference=45.0))
    assert not result.passed and "below the floor" in result.reason and "0.5 dB margin" in result.reason
    assert "over 4 samples" in result.reason and "-1.00 dB" in result.reason and "test fixture" in result.reason
    # Within the margin: 0.2 dB below on average, bound -0.32 dB, passes; the margin is read (0 fails it).
    assert verdict(card, measured(card, psnr=44.8, reference=45.0)).passed
    strict = TierParityContract(tier="fused", psnr_margin_db=0.0)
    assert not strict.check(measured(card, psnr=44.8), model_id=card.model_id, precision="fp32",
                            defaults=card.capabilities.defaults).passed
    # A reference of inf (eager at the precision is exact) demands an exact tier.
    assert not verdict(card, measured(card, psnr=120.0, reference=math.inf)).passed
    assert not verdict(card, measured(card, psnr=math.nan)).passed


def test_the_floor_is_a_lower_confidence_bound_over_the_samples(card: ModelCard) -> None:
    # One unlucky seed 0.6 dB below its floor does not fail a tier 3 dB above on average...
    unlucky = measured(card, psnrs=(48.0, 48.2, 47.9, 44.4), reference=45.0)
    result = verdict(card, unlucky)
    assert result.passed, result.reason
    assert "worst sample -0.60 dB" in result.reason
    # ...but a tier as far below on average, or so noisy that its bound is, fails.
    assert not verdict(card, measured(card, psnrs=(44.4, 44.5, 44.3, 44.6), reference=45.0)).passed
    noisy = measured(card, psnrs=(47.0, 43.0, 46.5, 43.5), reference=45.0)  # mean 0, sd 2: bound -2.35 dB
    assert noisy.statistics().mean_db == pytest.approx(0.0) and not verdict(card, noisy).passed
    # A failing verdict names the trajectory to rerun first: the sample furthest below its floor.
    assert "worst sample -2.00 dB at seed 1, prompt 'prompt 1'" in verdict(card, noisy).reason
    # The bound by hand: mean - t(0.95, n-1) * sd / sqrt(n).
    diffs = [3.0, 3.2, 2.9, -0.6]
    mean = sum(diffs) / 4
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 3)
    assert unlucky.statistics().lower_bound_db == pytest.approx(mean - 2.353 * sd / 2)


def test_the_single_sample_rule_would_fail_the_unlucky_tier(card: ModelCard, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: put back the rule before samples (one sample judged against its floor) and the
    unlucky tier the statistical rule passes fails."""
    unlucky = measured(card, psnrs=(44.4, 48.0, 48.2, 47.9), reference=45.0)  # the first seed is the unlucky one
    assert verdict(card, unlucky).passed
    statistics = TierParityMeasurement.statistics

    def first_sample_only(self: TierParityMeasurement):
        first = self.samples[0].difference_db
        return statistics(self).model_copy(update={"mean_db": first, "lower_bound_db": first})

    monkeypatch.setattr(TierParityMeasurement, "statistics", first_sample_only)
    assert not verdict(card, unlucky).passed


def test_an_exact_tier_passes_and_nan_or_an_exact_floor_missed_fail(card: ModelCard) -> None:
    exact = measured(card, psnrs=(math.inf,) * 4, reference=45.0)
    assert exact.statistics().lower_bound_db == 0.0 and verdict(card, exact).passed
    assert not verdict(card, measured(card, psnrs=(50.0, 50.0, math.nan, 50.0))).passed
    assert not verdict(card, measured(card, psnrs=(90.0,) * 4, reference=math.inf)).passed


def test_a_single_sample_record_loads_but_cannot_be_judged(tmp_path: Path, card: ModelCard) -> None:
    # A record written before samples were kept: one psnr_db/reference_psnr_db pair, no component.
    d = card.capabilities.defaults
    legacy = {"tier": "fused", "model_id": card.model_id, "precision": "fp32", "steps": d.steps, "frames": d.frames,
              "height": d.height, "width": d.width, "psnr_db": 60.0, "reference_psnr_db": 45.0, "step_rel_error": 1e-3,
              "reference_step_rel_error": 4e-3, "source": "old bench"}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"measurements": [legacy]}))
    record = load_parity_record(path)
    (m,) = record.measurements
    assert m.component == "all" and len(m.samples) == 1 and m.samples[0].seed is None and m.psnr_db == 60.0
    result = verdict(card, m)
    assert not result.passed and "1 sample(s) in 'samples'" in result.reason and "--samples 3" in result.reason
    with pytest.raises(ValueError, match="not both"):
        TierParityMeasurement.model_validate({**legacy, "samples": [{"psnr_db": 1.0, "reference_psnr_db": 1.0}]})


def test_t_quantiles_match_the_t_distribution() -> None:
    # Reference: integrate Student's t density numerically (Simpson) up to the quantile; the CDF there is 0.95.
    def cdf(q: float, df: int) -> float:
        c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
        n = 2000
        h = q / n
        total = sum((1 if i in (0, n) else 4 if i % 2 else 2) * c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2)
                    for i in range(n + 1))
        return 0.5 + total * h / 3

    for df in (1, 2, 3, 4, 9, 29, 30, 31, 60, 200):
        assert cdf(t_quantile_95(df), df) == pytest.approx(0.95, abs=2e-4), df
    with pytest.raises(ValueError):
        t_quantile_95(0)


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
    assert selection.declined == ("fused/dit", "fused/vae") and not selection.verdicts["fused/dit"].passed
    assert dict(selection.tiers) == {"dit": "eager", "vae": "eager"}


def test_auto_fused_is_selected_when_its_measurement_passes(tmp_path: Path, card: ModelCard, triton_importable: None) -> None:
    compute = ComputeOptions(fused_ops="auto", parity_record=record_file(tmp_path, measured(card)))
    selection = select(card, compute)
    assert selection.compute == compute and selection.verdicts["fused/dit"].passed and selection.declined == ()
    # A measurement of the tier on all components at once (component "all") stands for each of them.
    assert selection.verdicts["fused/vae"].passed and dict(selection.tiers) == {"dit": "fused", "vae": "fused"}


def test_a_failing_measurement_stops_default_selection(tmp_path: Path, card: ModelCard, triton_importable: None) -> None:
    """Negative control: the same options with a measurement below the floor run eager."""
    compute = ComputeOptions(fused_ops="auto", parity_record=record_file(tmp_path, measured(card, psnr=30.0)))
    selection = select(card, compute)
    assert selection.compute is not None and selection.compute.fused_ops == "off"
    assert selection.declined == ("fused/dit", "fused/vae") and "below the floor" in selection.verdicts["fused/dit"].reason


def test_a_measurement_at_another_precision_does_not_count(tmp_path: Path, card: ModelCard, triton_importable: None) -> None:
    bf16 = measured(card).model_copy(update={"precision": "bf16"})
    selection = select(card, ComputeOptions(fused_ops="auto", parity_record=record_file(tmp_path, bf16)))
    assert selection.compute is not None and selection.compute.fused_ops == "off"


def test_auto_selects_the_fused_tier_per_component(tmp_path: Path, card: ModelCard, triton_importable: None,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The fused DiT passes and the fused VAE fails: the DiT runs the Triton kernels, the VAE eager."""
    dit = measured(card, psnr=48.0, component="dit")
    vae = measured(card, psnr=42.0, component="vae")
    compute = ComputeOptions(fused_ops="auto", cuda_graphs=True, parity_record=record_file(tmp_path, dit, vae))
    with caplog.at_level(logging.INFO, logger=compile_module.__name__):
        selection = select(card, compute)
    assert selection.verdicts["fused/dit"].passed and not selection.verdicts["fused/vae"].passed
    assert selection.declined == ("fused/vae",) and "on the vae" in selection.verdicts["fused/vae"].reason
    assert selection.compute is not None
    assert selection.compute.fused_ops_for("dit") == "auto" and selection.compute.fused_ops_for("vae") == "off"
    assert (selection.compute.dit_fused_ops, selection.compute.vae_fused_ops) == (None, "off")
    assert selection.compute.tier == "fused+graphs"
    assert dict(selection.tiers) == {"dit": "fused+graphs", "vae": "eager"}
    # Visible in the load log: each component's tier, and why the VAE's was declined.
    assert any("compute tiers: dit fused+graphs, vae eager; declined: tier 'fused' on the vae" in r.getMessage()
               for r in caplog.records)
    # Swapped: the VAE takes the kernels, the DiT stays eager (graphs alone).
    swapped = (measured(card, psnr=42.0, component="dit"), measured(card, psnr=48.0, component="vae"))
    other = select(card, compute.model_copy(update={"parity_record": record_file(tmp_path, *swapped)}))
    assert dict(other.tiers) == {"dit": "graphs", "vae": "fused"} and other.declined == ("fused/dit",)
    assert other.compute is not None and (other.compute.dit_fused_ops, other.compute.vae_fused_ops) == ("off", None)


def test_a_components_own_measurement_overrides_one_of_all_components(tmp_path: Path, card: ModelCard,
                                                                      triton_importable: None) -> None:
    both = measured(card, psnr=48.0)  # component "all", e.g. an older record's
    vae = measured(card, psnr=42.0, component="vae")
    selection = select(card, ComputeOptions(fused_ops="auto", parity_record=record_file(tmp_path, both, vae)))
    assert dict(selection.tiers) == {"dit": "fused", "vae": "eager"}
    record = TierParityRecord(measurements=(both, vae))
    assert record.find("fused", card.model_id, "fp32", "vae") == vae and record.find("fused", card.model_id, "fp32") == both


def test_a_tier_forced_per_component_or_globally(tmp_path: Path, card: ModelCard, triton_importable: None) -> None:
    dit = measured(card, psnr=48.0, component="dit")
    vae = measured(card, psnr=42.0, component="vae")
    record = record_file(tmp_path, dit, vae)
    # Forced on the VAE by name: it runs (warned, overridden), the DiT is still left to auto.
    forced = select(card, ComputeOptions(fused_ops="auto", vae_fused_ops="triton", parity_record=record))
    assert forced.overridden == ("fused/vae",) and forced.declined == () and dict(forced.tiers) == {"dit": "fused", "vae": "fused"}
    # Off on the DiT by name, globally forced elsewhere.
    mixed = select(card, ComputeOptions(fused_ops="triton", dit_fused_ops="off", parity_record=record))
    assert dict(mixed.tiers) == {"dit": "eager", "vae": "fused"} and mixed.overridden == ("fused/vae",)
    assert dict(select(card, ComputeOptions(fused_ops="triton", parity_record=record)).tiers) == {"dit": "fused", "vae": "fused"}


def test_bad_per_component_settings_name_the_field_and_the_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"vae_fused_ops\n  Input should be 'off', 'auto', 'torch' or 'triton'"):
        ComputeOptions(vae_fused_ops="fast")
    with pytest.raises(ValueError, match=r"text_encoder_fused_ops\n  Extra inputs are not permitted"):
        ComputeOptions(text_encoder_fused_ops="off")
    with pytest.raises(ValueError, match=r"component must be one of \['dit', 'vae'\]"):
        ComputeOptions().fused_ops_for("reasoner")
    deployment = CardDeployment.model_validate({"model": "toy-dit", "compute": {"fused_ops": "auto",
                                                                                "vae_fused_ops": "off"}})
    assert deployment.compute is not None and deployment.compute.fused_ops_for("vae") == "off"
    assert deployment.compute.fused_ops_for("dit") == "auto"
    hash(deployment.compute)  # options stay hashable (frozen, no dict field)


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
    assert selection.overridden == ("fused/dit", "fused/vae", "blocks/dit", "graphs/dit") and selection.declined == ()
    assert dict(selection.tiers) == {"dit": "blocks+graphs", "vae": "fused"}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 4 and all("outside its parity contract" in m and "no trajectory measurement" in m for m in warned)
    # CUDA graphs off CUDA are not captured at all: no tier, no warning.
    assert "graphs/dit" not in select(card, ComputeOptions(cuda_graphs=True), device="cpu").verdicts


def test_a_named_tier_that_passes_is_not_warned(tmp_path: Path, card: ModelCard, caplog: pytest.LogCaptureFixture) -> None:
    compute = ComputeOptions(compile="blocks", parity_record=record_file(tmp_path, measured(card, "blocks")))
    with caplog.at_level(logging.WARNING, logger=compile_module.__name__):
        selection = select(card, compute, device="cpu")
    assert selection.overridden == () and selection.verdicts["blocks/dit"].passed and not caplog.records


def test_vsa_is_a_tier_unless_the_recipe_trained_under_it(card: ModelCard) -> None:
    assert not select(card, None, attention="vsa").verdicts["vsa/dit"].passed
    assert select(card, None, attention="vsa").overridden == ("vsa/dit",)
    recipe = card.recipe.model_copy(update={"assumes_attention": AttentionAssumption(kind="vsa", sparsity=0.8)})
    vsa_card = card.model_copy(update={"recipe": recipe})
    assert select(vsa_card, None, attention="vsa").verdicts == {}  # the card's own attention


def test_a_wrong_record_path_fails_at_selection_even_with_no_tier_on(tmp_path: Path, card: ModelCard) -> None:
    with pytest.raises(ParityRecordError, match="compute.parity_record"):
        select(card, ComputeOptions(parity_record=tmp_path / "typo.json"), device="cpu")


def test_the_deploy_config_carries_the_record_path(tmp_path: Path) -> None:
    deployment = CardDeployment.model_validate({"model": "toy-dit", "compute": {"fused_ops": "auto", "parity_record": str(tmp_path)}})
    assert deployment.compute is not None and deployment.compute.parity_record == tmp_path
