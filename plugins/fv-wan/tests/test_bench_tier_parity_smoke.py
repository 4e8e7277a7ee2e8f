"""``bench/bench_tier_parity.py`` on CPU at wan-tiny size: the report, the skips, the record and the verdicts,
over several samples (seeds and prompts) and per component.

The GPU-only tiers (Triton fused kernels, CUDA graphs) and VSA (no tiny card has its gates)
are reported as skipped with a reason, never measured. ``blocks`` does run on CPU, but its
compile takes most of a minute there, so the in-process cases stand a cheap configuration in
for it (the torch fused ops: eager's own formulas, so the video is bitwise eager's) to check
the measurement, the record and the verdict end to end.
"""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fv_kernel.api import ComputeOptions, load_parity_record, select_compute_tiers
from fv_wan.cards import wan_cards

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"


def test_the_bench_reports_cpu_skips_and_the_precision_floor(tmp_path: Path) -> None:
    out, record = tmp_path / "tier_parity.json", tmp_path / "record.json"
    done = subprocess.run(
        [sys.executable, str(BENCH_DIR / "bench_tier_parity.py"), "--tiers", "fused", "graphs", "vsa", "--steps", "2",
         "--samples", "2", "--json", str(out), "--record", str(record)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["meta"]["card"] == "wan-tiny" and report["meta"]["precision"] == "bf16" and report["meta"]["steps"] == 2
    assert 20 < report["reference"]["psnr_db"] < math.inf  # bf16 really differs from fp32
    assert 0 < report["reference"]["step_rel_error"] < 0.1
    # One floor per sample: its own seed and prompt.
    floors = report["reference"]["samples"]
    assert [r["seed"] for r in floors] == [0, 1] and floors[0]["prompt"] != floors[1]["prompt"]
    assert floors[0]["psnr_db"] != floors[1]["psnr_db"] and report["meta"]["samples"] == 2
    # The fused kernels act on the DiT and the VAE, each measured apart; the others on the DiT only.
    assert {key: row["status"] for key, row in report["tiers"].items()} == dict.fromkeys(
        ("fused/dit", "fused/vae", "graphs/dit", "vsa/dit"), "skipped")
    assert "CUDA" in report["tiers"]["fused/vae"]["reason"] and "to_gate_compress" in report["tiers"]["vsa/dit"]["reason"]
    assert report["record"] == {"measurements": [], "precision_paths": []} and load_parity_record(record).measurements == ()


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    module = importlib.import_module("bench_tier_parity")
    # "blocks" stands for a configuration that is bitwise eager (see the module docstring).
    monkeypatch.setattr(module, "tier_setup", lambda tier, card, device, component="dit": (
        {"compute": ComputeOptions(fused_ops="torch")}, None))
    return module


def run_bench(bench, tmp_path: Path, *extra: str) -> tuple[dict, Path]:
    out, record = tmp_path / "report.json", tmp_path / "record.json"
    args = ["--tiers", "blocks", "--frames", "5", "--samples", "3", "--json", str(out), "--record", str(record),
            "--threads", str(torch.get_num_threads()), *extra]
    assert bench.main(args) == 0
    return json.loads(out.read_text()), record


def test_a_measured_tier_is_recorded_and_its_verdict_drives_selection(bench, tmp_path: Path) -> None:
    report, record = run_bench(bench, tmp_path)
    row = report["tiers"]["blocks/dit"]
    assert row["status"] == "measured" and row["psnr_db"] == math.inf and row["step_rel_error"] == 0.0
    assert [s["seed"] for s in row["samples"]] == [0, 1, 2] and all(s["psnr_db"] == math.inf for s in row["samples"])
    # wan-tiny's default trajectory is 9 frames: 5 frames is not the contract's trajectory.
    assert not row["passed"] and "full default trajectory" in row["verdict"]
    measurement = load_parity_record(record).find("blocks", "wan-tiny", "bf16")
    assert measurement is not None and measurement.frames == 5 and "bench_tier_parity.py" in measurement.source
    assert measurement.component == "dit" and len(measurement.samples) == 3 and "seeds 0..2" in measurement.source
    # Each sample's floor is that seed's own eager bf16 against eager fp32.
    assert [s.reference_psnr_db for s in measurement.samples] == [r["psnr_db"] for r in report["reference"]["samples"]]


def test_the_full_default_trajectory_passes_and_a_deployment_reads_it(bench, tmp_path: Path) -> None:
    report, record = run_bench(bench, tmp_path, "--frames", "9")
    assert report["tiers"]["blocks/dit"]["passed"], report["tiers"]["blocks/dit"]["verdict"]
    card = next(c for c in wan_cards() if c.model_id == "wan-tiny")
    selection = select_compute_tiers(ComputeOptions(compile="blocks", parity_record=record), card, device="cpu",
                                     precision="bf16", attention_backend="sdpa")
    assert selection.verdicts["blocks/dit"].passed and selection.overridden == ()


def test_a_split_run_reuses_the_eager_references(bench, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cache = tmp_path / "runs"
    first, _ = run_bench(bench, tmp_path, "--tiers", "--samples", "2", "--cache-dir", str(cache))  # the references only
    assert first["tiers"] == {} and len(list(cache.glob("wan-tiny_eager_*.pt"))) == 4  # fp32 and bf16 per sample
    capsys.readouterr()
    second, _ = run_bench(bench, tmp_path, "--tiers", "blocks", "--samples", "2", "--cache-dir", str(cache))
    assert capsys.readouterr().out.count("reusing") == 4
    assert second["reference"]["psnr_db"] == first["reference"]["psnr_db"]
    assert second["tiers"]["blocks/dit"]["status"] == "measured"


def test_a_paused_trajectory_continues_across_invocations_to_the_uninterrupted_video(tmp_path: Path, monkeypatch) -> None:
    # --budget-s: a trajectory longer than one invocation's wall-clock limit is stopped between two steps,
    # saved, and continued by the next invocation (the fp32 reference at 81 frames needs this on the H200).
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    module = importlib.import_module("bench_tier_parity")
    card = next(c for c in wan_cards() if c.model_id == "wan-tiny")
    request = module.Request(request_id="p", model="wan-tiny", task=module.TaskType.TEXT_TO_VIDEO,
                             inputs=(module.TextPart(text=module.PROMPT),),
                             diffusion=module.DiffusionParams(seed=0, steps=4, height=32, width=32, frames=5))
    cpu = torch.device("cpu")
    whole_steps: list[int] = []
    whole = module.run_trajectory(card, request, cpu, "fp32", partial=tmp_path / "unused.partial",
                                  pause=lambda n, s: whole_steps.append(n) or False)
    partial = tmp_path / "run.partial"
    hops: list[int] = []
    for _ in range(10):  # every invocation runs 2 steps, then pauses
        ran: list[int] = []
        try:
            got = module.run_trajectory(card, request, cpu, "fp32", partial=partial,
                                        pause=lambda n, s: ran.append(n) or n >= 2)
        except module.Paused as paused:
            assert paused.partial == partial and partial.exists()
            hops.append(len(ran))
            continue
        hops.append(len(ran))
        break
    # Each invocation continued where the last stopped (a fresh start would run every step again)...
    assert len(hops) > 2 and sum(hops) == len(whole_steps) and max(hops) <= 2
    # ...and the resumed trajectory is the uninterrupted one, bit for bit, with the first forward carried over.
    assert torch.equal(got.frames, whole.frames) and torch.equal(got.first_forward, whole.first_forward)
    assert not partial.exists()  # spent once finished


def test_the_fused_kernels_are_set_up_on_one_component_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    bench = importlib.import_module("bench_tier_parity")
    monkeypatch.setattr(bench, "triton_available", lambda: True)
    card = next(c for c in wan_cards() if c.model_id == "wan-tiny")
    cuda = torch.device("cuda")
    (dit, _), (vae, _) = bench.tier_setup("fused", card, cuda, "dit"), bench.tier_setup("fused", card, cuda, "vae")
    assert (dit["compute"].fused_ops_for("dit"), dit["compute"].fused_ops_for("vae")) == ("triton", "off")
    assert (vae["compute"].fused_ops_for("dit"), vae["compute"].fused_ops_for("vae")) == ("off", "triton")
    fields, why = bench.tier_setup("graphs", card, cuda, "vae")
    assert fields is None and "does not act on the vae" in why


def test_budget_needs_a_cache_dir() -> None:
    done = subprocess.run([sys.executable, str(BENCH_DIR / "bench_tier_parity.py"), "--budget-s", "5"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--budget-s needs --cache-dir" in done.stderr


def test_a_vsa_trained_card_runs_every_trajectory_under_its_own_attention(tmp_path: Path, monkeypatch) -> None:
    # FastWan's recipe assumes VSA: its eager references are the card as trained (VSA), a tier is judged on top of
    # them, and "vsa" is no tier of it. A tiny stand-in: fastwan-tiny with the gates and FastWan's recipe attention.
    from fv_wan.cards import FASTWAN_VSA

    tiny = next(c for c in wan_cards() if c.model_id == "fastwan-tiny")
    components = dict(tiny.components)
    components["transformer"] = components["transformer"].model_copy(
        update={"config": {**components["transformer"].config, "has_gate_compress": True}})
    card = tiny.model_copy(update={"components": components,
                                   "recipe": tiny.recipe.model_copy(update={"assumes_attention": FASTWAN_VSA})})
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    bench = importlib.import_module("bench_tier_parity")
    real_setup = bench.tier_setup
    # "blocks" stands for a cheap configuration (see the module docstring); "vsa" goes through the real setup.
    monkeypatch.setattr(bench, "tier_setup", lambda tier, card_, device, component="dit": (
        ({"compute": ComputeOptions(fused_ops="torch")}, None) if tier == "blocks" else real_setup(tier, card_, device, component)))
    attentions: list[tuple[str, str]] = []
    real_build = bench.build_instance

    def build(card_, options):
        attentions.append((options.precision, options.attention_backend))
        return real_build(card_, options)

    monkeypatch.setattr(bench, "build_instance", build)
    report = bench.measure_tier_parity(card, device=torch.device("cpu"), precision="bf16", tiers=("vsa", "blocks"),
                                       steps=3, frames=5, height=32, width=32, seed=0, source="test", log=lambda _: None,
                                       samples=1)
    assert report["tiers"]["vsa/dit"]["status"] == "skipped" and "own attention" in report["tiers"]["vsa/dit"]["reason"]
    assert report["tiers"]["blocks/dit"]["status"] == "measured"
    assert attentions == [("fp32", "vsa"), ("bf16", "vsa"), ("bf16", "vsa")]  # eager fp32, eager bf16, the tier
