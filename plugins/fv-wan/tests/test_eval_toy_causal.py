"""``bench/eval_toy_causal.py``'s 95% interval: the Wilson score interval of a share, checked against the
interval's definition solved as a quadratic (the rates p whose normal test does not reject the observed
share), and a short card run that prints it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from bench_module import BENCH_DIR, load_bench

from fv_wan.toy_card import wan_toy_causal_card

BENCH = BENCH_DIR / "eval_toy_causal.py"


def _bench() -> ModuleType:
    return load_bench("eval_toy_causal")


def _by_definition(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Both roots of (share - p)^2 = z^2 p (1 - p) / trials, in p."""
    share = successes / trials
    k = z * z / trials
    a, b, c = 1 + k, -(2 * share + k), share * share
    root = math.sqrt(b * b - 4 * a * c)
    return (-b - root) / (2 * a), (-b + root) / (2 * a)


@pytest.mark.parametrize(("successes", "trials"), [(43, 50), (37, 50), (142, 200), (0, 10), (10, 10), (1, 3)])
def test_wilson_interval_solves_its_definition(successes: int, trials: int) -> None:
    low, high = _bench().wilson_interval(successes, trials)
    want_low, want_high = _by_definition(successes, trials)
    assert low == pytest.approx(max(0.0, want_low), abs=1e-12)
    assert high == pytest.approx(min(1.0, want_high), abs=1e-12)
    assert low <= successes / trials <= high


def test_wilson_interval_is_about_twelve_points_at_fifty_streams() -> None:
    low, high = _bench().wilson_interval(40, 50)
    assert 0.10 < (high - low) / 2 < 0.13  # what docs/realtime.md says of a 50-stream score


@pytest.mark.parametrize(("successes", "trials"), [(1, 0), (-1, 5), (6, 5)])
def test_wilson_interval_refuses_impossible_counts(successes: int, trials: int) -> None:
    with pytest.raises(ValueError, match="successes <= trials"):
        _bench().wilson_interval(successes, trials)


@pytest.mark.skipif(wan_toy_causal_card() is None, reason="wan-toy-causal's weights are not installed")
def test_card_run_prints_and_records_the_interval(tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    done = subprocess.run([sys.executable, str(BENCH), "--prompts", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    scores = json.loads(out.read_text())["scores"]
    turns = round(scores["turn"] * 2)
    assert scores["turn_95"] == pytest.approx(list(_bench().wilson_interval(turns, 2)))
    assert "95% interval" in done.stdout
