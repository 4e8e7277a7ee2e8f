"""The shipped CPU quality table (bench/records/precision_quality_cpu.json, written by
bench/bench_precision_quality.py --record): every fp8 path of wan-tiny and wan-toy at fp32 and bf16
against the native path, judged by the cards' contracts."""

from __future__ import annotations

from pathlib import Path

from fv_kernel.api import ComputeOptions, InstanceOptions, select_precision_path
from fv_kernel.compute.compile import load_parity_record

RECORD = Path(__file__).resolve().parents[3] / "bench" / "records" / "precision_quality_cpu.json"


#: The table's verdicts (docs/precision.md, Wan quality table): which (card, precision) pass which paths.
PASSING = {
    ("wan-tiny", "fp32"): {"fp8_weights", "fp8_dynamic", "fp8_attention", "fp8_all"},
    ("wan-tiny", "bf16"): {"fp8_weights", "fp8_dynamic", "fp8_attention", "fp8_all"},
    ("wan-toy", "fp32"): set(),
    ("wan-toy", "bf16"): set(),
}


def _cards(wan_card):
    from fv_wan.toy_card import wan_toy_card

    toy = wan_toy_card()
    return [wan_card("wan-tiny"), *([toy] if toy is not None else [])]


def test_the_shipped_cpu_record_holds_every_path_with_the_documented_verdicts(wan_card) -> None:
    """Every path of wan-tiny and wan-toy, at fp32 and bf16, is measured over the card's default
    trajectory, with as many samples (seeds and prompts) as the contract needs at least; the contracts'
    verdicts are the table's. No step timings: on CPU the fp8 paths run the reference kernels, so
    ``auto`` keeps ``native``."""
    record = load_parity_record(RECORD)
    for card in _cards(wan_card):
        for precision in [p for c, p in PASSING if c == card.model_id]:
            passed = set()
            for path, contract in card.precision.paths.items():
                m = record.find_path(path, card.model_id, precision)
                assert m is not None, (card.model_id, precision, path)
                assert m.step_seconds is None and m.device == "cpu"
                assert len(m.samples) == (16 if card.model_id == "wan-toy" else 3) >= contract.min_samples
                if card.model_id == "wan-toy":
                    assert set(m.judge_scores) == set(m.reference_judge_scores) == {"colour", "direction"}
                if contract.check(m, model_id=card.model_id, precision=precision, defaults=card.capabilities.defaults).passed:
                    passed.add(path)
            assert passed == PASSING[(card.model_id, precision)], (card.model_id, precision, passed)
            options = InstanceOptions(precision="bf16" if precision == "bf16" else "fp32", precision_path="auto",
                                      compute=ComputeOptions(parity_record=str(RECORD)))
            assert select_precision_path(card, options).path == "native"


def test_auto_takes_a_passing_path_only(wan_card, tmp_path) -> None:
    """With the record's measurements timed faster than native, ``auto`` takes the fastest passing
    path (wan-tiny) and never a failing one (wan-toy's fail its PSNR floor)."""
    record = load_parity_record(RECORD)
    speed = {"fp8_weights": 1.1, "fp8_dynamic": 1.3, "fp8_attention": 1.2, "fp8_all": 1.5}
    timed = record.model_copy(update={"precision_paths": tuple(
        m.model_copy(update={"step_seconds": 1.0, "reference_step_seconds": speed[m.path]}) for m in record.precision_paths)})
    file = tmp_path / "timed.json"
    file.write_text(timed.model_dump_json())
    for card in _cards(wan_card):
        options = InstanceOptions(precision="fp32", precision_path="auto", compute=ComputeOptions(parity_record=str(file)))
        passing = PASSING[(card.model_id, "fp32")]
        want = max(passing, key=speed.__getitem__) if passing else "native"
        assert select_precision_path(card, options).path == want


def test_the_judge_bound_is_two_points(wan_card) -> None:
    """Negative control: a colour score 2.5 points off native fails wan-toy's contract; 1.5 passes it."""
    from fv_wan.toy_card import wan_toy_card

    toy = wan_toy_card()
    if toy is None:
        import pytest

        pytest.skip("wan-toy's weights are not installed")
    m = load_parity_record(RECORD).find_path("fp8_weights", "wan-toy", "fp32")
    contract = toy.precision.paths["fp8_weights"]
    ref = m.reference_judge_scores
    for delta, ok in ((2.5, False), (1.5, True)):
        samples = tuple(sample.model_copy(update={"psnr_db": 99.0}) for sample in m.samples)  # past the PSNR floor
        edited = m.model_copy(update={"samples": samples, "judge_scores": {**ref, "colour": ref["colour"] - delta}})
        assert contract.check(edited, model_id="wan-toy", precision="fp32", defaults=toy.capabilities.defaults).passed is ok
