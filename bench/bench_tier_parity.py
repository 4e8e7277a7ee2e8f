"""What each fast compute tier costs in accuracy over a whole trajectory (issue 19, 2b).

    python bench/bench_tier_parity.py                      # wan-tiny on CPU, bf16, the card's 8 steps
    python bench/bench_tier_parity.py --card fastwan2.1-t2v-1.3b --device cuda --tiers fused graphs  # on its VSA
    python bench/bench_tier_parity.py --card wan2.1-t2v-1.3b --device cuda \\
        --json out/tier_parity.json --record out/tier_parity_record.json   # 480x832x81, 50 steps

``--samples N`` text-to-video requests (seeds ``--seed`` .. ``--seed``+N-1, each with its own
prompt; the card's default steps and shape unless given) run end to end through the card's
loops, on a fresh instance per configuration: eager fp32, eager at ``--precision`` (bf16) and
each tier at ``--precision``, the tier on one component at a time (the DiT, or the VAE decoder:
only the fused kernels reach the VAE; the other component runs eager). Reported per tier and
component: each sample's PSNR of its final decoded video against eager's and of eager's own
against eager fp32 (the sample's floor), the relative L2 error of the first sample's first
denoise forward against eager's, and the verdict of the tier's parity contract
(``fv_kernel.card.spec.TIER_PARITY_CONTRACTS``: the 95% lower confidence bound of the mean
per-sample difference from the floor must be within the contract's margin). ``--record`` merges
the measurements into a ``TierParityRecord`` file, which a deployment names as
``compute.parity_record``: only then can ``fused_ops: auto`` select the Triton kernels, per component.

Tiers: ``fused`` (Triton kernels; CUDA), ``graphs`` (CUDA graphs; CUDA), ``blocks``
(``torch.compile`` per block; anywhere with a C++ compiler, slow to build on CPU), ``vsa``
(the kernel's VSA attention driver; needs a card whose DiT has the VSA gates,
``to_gate_compress``; on a card whose recipe assumes VSA, FastWan's, it is the card's own
attention and every run uses it, eager included). A tier that cannot run here is reported as
skipped with the reason.
Real-size cards are built with seeded random weights (``random_weights.py``: the card's own
transformer and VAE, a one-layer random text encoder). Without CUDA, ``--device cuda``
prints why and exits 0. ``--cache-dir`` keeps each run's final video and first forward, so
a run split over several invocations (``--tiers`` a few at a time, under a wall-clock limit)
computes the eager references once. ``--budget-s`` goes further: it stops a trajectory between two
steps when the time is up and saves its checkpoint there (the request's ``ProgramCheckpoint``),
so one trajectory longer than a wall-clock limit (eager fp32 at 81 frames) spans invocations.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.instance import ModelInstance, build_instance
from fv_kernel.loop.plan import StepOp
from fv_kernel.card.spec import (
    TIER_COMPONENTS,
    TIER_PARITY_CONTRACTS,
    ModelCard,
    TierParityMeasurement,
    TierParityRecord,
    TierParitySample,
)
from fv_kernel.compute.compile import ComputeOptions, load_parity_record
from fv_kernel.compute.fused import triton_available
from fv_kernel.api import ProgramCheckpoint, ProgramRun
from fv_kernel.request.request import DiffusionParams, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.local import run_local
from random_weights import wan_card_for_device  # bench/, beside this script

TIERS = ("fused", "graphs", "blocks", "vsa")
PROMPT = "a red fox runs through fresh snow at dawn"
#: Sample i runs seed ``--seed`` + i with PROMPTS[i % len(PROMPTS)]: several scenes, not one.
PROMPTS = (
    PROMPT,
    "waves break over black rocks under a grey sky",
    "a busy city street at night, neon signs reflected in puddles",
    "a close-up of a hummingbird hovering at a red flower",
    "a slow pan across a desert canyon at sunset",
)


@dataclasses.dataclass
class Trajectory:
    """One run's final video and its first denoise forward (inputs and output)."""

    frames: torch.Tensor
    first_forward: torch.Tensor
    seconds: float


def tier_setup(tier: str, card: ModelCard, device: torch.device,
               component: str = "dit") -> tuple[dict[str, Any] | None, str | None]:
    """The InstanceOptions fields that turn ``tier`` on for ``component`` (the others eager), or None and why it cannot run here."""
    if component not in TIER_COMPONENTS.get(tier, ()):
        return None, f"tier {tier!r} does not act on the {component}"
    if not any(spec.kind == component for spec in card.components.values()):
        return None, f"card {card.model_id!r} has no {component} component"
    if tier == "fused":
        if device.type != "cuda":
            return None, "the Triton kernels need CUDA; off CUDA only the torch reference runs, which is eager's own formulas"
        if not triton_available():
            return None, "triton is not importable"
        other = "vae" if component == "dit" else "dit"
        return {"compute": ComputeOptions(fused_ops="triton", **{f"{other}_fused_ops": "off"})}, None
    if tier == "graphs":
        if device.type != "cuda":
            return None, "CUDA graphs need a CUDA device; off CUDA the step runs eagerly"
        return {"compute": ComputeOptions(cuda_graphs=True)}, None
    if tier == "blocks":
        return {"compute": ComputeOptions(compile="blocks")}, None
    if tier == "vsa":
        if card.recipe.assumes_attention is not None and card.recipe.assumes_attention.kind == "vsa":
            return None, (f"VSA is card {card.model_id!r}'s own attention (its recipe assumes it), not a tier: every run "
                          "here, the eager references included, uses it")
        if not card.components["transformer"].config.get("has_gate_compress"):
            return None, (f"card {card.model_id!r} has no VSA gates (to_gate_compress); VSA runs on a card trained for "
                          "it: --card fastwan2.1-t2v-1.3b --device cuda")
        return {"attention_backend": "vsa"}, None
    raise ValueError(f"unknown tier {tier!r}; allowed: {list(TIERS)}")


#: Makes a denoise op's replacement function from (op name, its function, the instance).
ForwardWrapper = Callable[[str, Callable[..., Mapping[str, torch.Tensor]], ModelInstance], Callable[..., Any]]


def wrap_dit_forwards(instance: ModelInstance, wrap: ForwardWrapper) -> None:
    """Replace the function of each denoise op (``dit_forward:*``) the instance builds by ``wrap``'s."""
    build = instance.ops_builder

    def wrapped_builder(inst: ModelInstance) -> dict[str, StepOp]:
        ops = build(inst)
        for name, op in ops.items():
            if name.startswith("dit_forward:"):
                ops[name] = dataclasses.replace(op, fn=wrap(name, op.fn, inst))
        return ops

    instance.ops_builder = wrapped_builder


def capture_first_forward(instance: ModelInstance, sink: dict[str, torch.Tensor]) -> None:
    """Keep the output of the instance's first denoise forward (``dit_forward:*``) in ``sink``."""
    wrap_dit_forwards(instance, lambda name, fn, inst: _first_call(fn, sink))


def _first_call(fn: Callable[..., Mapping[str, torch.Tensor]], sink: dict[str, torch.Tensor]) -> Callable[..., Any]:
    def call(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> Mapping[str, torch.Tensor]:
        out = fn(inputs, params)
        if "v" not in sink:
            sink["v"] = out["v"].detach().float().cpu()
        return out

    return call


class Paused(Exception):
    """A trajectory stopped between two steps; ``partial`` is where it was saved (``--budget-s``)."""

    def __init__(self, partial: Path, steps: int, seconds: float) -> None:
        super().__init__(f"paused after {steps} steps in {seconds:.1f} s here; its checkpoint is {partial}")
        self.partial = partial


#: Decides, after each step, whether to stop there: (steps run in this process, seconds elapsed in it).
PauseRule = Callable[[int, float], bool]


def run_trajectory(card: ModelCard, request: Request, device: torch.device, precision: str, *,
                   partial: Path | None = None, pause: PauseRule | None = None, **fields: Any) -> Trajectory:
    """One request end to end on a fresh instance. With ``partial`` and ``pause``: continues the
    checkpoint at ``partial`` if there is one, and when ``pause`` says so after a step, saves the
    request's :class:`ProgramCheckpoint` (with the first forward and the seconds so far) there
    and raises :class:`Paused`. A resumed trajectory is the uninterrupted one (the loops' state
    is the whole state of a request)."""
    # allow_recipe_mismatch: the eager references of a VSA-trained card run dense attention and fp32.
    instance = build_instance(card, InstanceOptions(device=str(device), precision=precision, allow_recipe_mismatch=True,
                                                    **fields))
    sink: dict[str, torch.Tensor] = {}
    resume_from, earlier = None, 0.0
    if partial is not None and partial.exists():
        saved = torch.load(partial, weights_only=True)
        resume_from = ProgramCheckpoint.from_bytes(saved["checkpoint"])
        earlier = float(saved["seconds"])
        if saved["first_forward"] is not None:  # None: paused before the first denoise forward
            sink["v"] = saved["first_forward"]
    capture_first_forward(instance, sink)
    started = time.perf_counter()
    steps = 0

    def on_step(run: ProgramRun) -> None:
        nonlocal steps
        steps += 1
        if partial is None or pause is None or not pause(steps, time.perf_counter() - started):
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        partial.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"checkpoint": run.checkpoint().to_bytes(), "first_forward": sink.get("v"),
                    "seconds": earlier + time.perf_counter() - started}, partial)
        raise Paused(partial, steps, time.perf_counter() - started)

    artifacts = run_local(request, instance, resume_from=resume_from, on_step=on_step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = earlier + time.perf_counter() - started
    if partial is not None and partial.exists():
        partial.unlink()
    frames = artifacts[0].frames.detach().float().cpu()
    del instance, artifacts
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if "v" not in sink:
        raise RuntimeError(f"card {card.model_id!r} ran no dit_forward op: nothing to compare one forward on")
    return Trajectory(frames=frames, first_forward=sink["v"], seconds=seconds)


def psnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    """PSNR in dB of two videos with values in [0, 1] (inf when identical)."""
    if reference.shape != test.shape:
        raise ValueError(f"video shapes differ: {tuple(reference.shape)} vs {tuple(test.shape)}")
    mse = torch.mean((reference.double() - test.double()) ** 2).item()
    return math.inf if mse == 0.0 else 10.0 * math.log10(1.0 / mse)


def rel_error(test: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative L2 error of ``test`` against ``reference`` (0 when equal)."""
    diff = (test.double() - reference.double()).norm()
    return 0.0 if diff == 0 else float(diff / reference.double().norm().clamp_min(1e-30))


def measure_tier_parity(
    card: ModelCard, *, device: torch.device, precision: str, tiers: tuple[str, ...], steps: int, frames: int,
    height: int, width: int, seed: int, source: str, log: Callable[[str], None] = print, cache_dir: Path | None = None,
    pause: PauseRule | None = None, samples: int = 3, components: tuple[str, ...] = ("dit", "vae"),
) -> dict[str, Any]:
    """Eager fp32, eager at ``precision`` and each tier on each of ``components`` over ``samples``
    trajectories (seeds ``seed``.. with PROMPTS in turn); per-sample PSNRs, errors, verdicts.

    Returns ``{"reference": {...}, "tiers": {"tier/component": {...}}, "record": TierParityRecord}``; a
    tier that cannot run here (or does not act on a component) has ``status: skipped`` and a reason,
    and no measurement. With ``cache_dir``, ``pause`` (see :func:`run_trajectory`) may stop a run
    between steps: :class:`Paused` is raised and the next call with the same ``cache_dir`` continues it.
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    # Every run uses the attention the card's recipe assumes (FastWan: VSA), so eager is the card as trained
    # and a tier is judged on top of it.
    assumed = card.recipe.assumes_attention
    recipe_fields = {} if assumed is None else {"attention_backend": assumed.kind}
    attention = "" if assumed is None else f"_{assumed.kind}"
    plan: list[tuple[str, str, dict[str, Any]]] = []  # (tier, component, fields) that run here
    results: dict[str, Any] = {}
    for tier in tiers:
        for component in TIER_COMPONENTS[tier]:
            if component not in components:
                continue
            fields, why_not = tier_setup(tier, card, device, component)
            if fields is None:
                log(f"{tier}/{component}: skipped ({why_not})")
                results[f"{tier}/{component}"] = {"status": "skipped", "reason": why_not}
            else:
                plan.append((tier, component, fields))

    def run(request: Request, tag: str, label: str, run_precision: str, **fields: Any) -> Trajectory:
        fields = {**recipe_fields, **fields}
        if cache_dir is None:
            return run_trajectory(card, request, device, run_precision, **fields)
        path = cache_dir / f"{card.model_id}_{label}{attention}_{run_precision}_{steps}x{frames}x{height}x{width}_{tag}.pt"
        if path.exists():
            log(f"  (reusing {path})")
            return Trajectory(**torch.load(path))
        got = run_trajectory(card, request, device, run_precision, partial=path.with_suffix(".partial"), pause=pause, **fields)
        cache_dir.mkdir(parents=True, exist_ok=True)
        torch.save(dataclasses.asdict(got), path)
        return got

    reference_rows: list[dict[str, Any]] = []
    per_tier: dict[str, list[TierParitySample]] = {f"{t}/{c}": [] for t, c, _ in plan}
    first_forward: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for index in range(samples):
        sample_seed, prompt = seed + index, PROMPTS[index % len(PROMPTS)]
        request = Request(request_id="tier-parity", model=card.model_id, task=TaskType.TEXT_TO_VIDEO,
                          inputs=(TextPart(text=prompt),),
                          diffusion=DiffusionParams(seed=sample_seed, steps=steps, height=height, width=width, frames=frames))
        tag = f"seed{sample_seed}_p{index % len(PROMPTS)}"

        log(f"sample {index + 1}/{samples} (seed {sample_seed}): eager fp32, {steps} steps at {frames}x{height}x{width} on {device}")
        fp32 = run(request, tag, "eager", "fp32")
        if precision == "fp32":
            eager = fp32
        else:
            log(f"  eager {precision}")
            eager = run(request, tag, "eager", precision)
        floor = psnr(fp32.frames, eager.frames)
        reference_rows.append({"seed": sample_seed, "prompt": prompt, "psnr_db": floor,
                               "fp32_seconds": round(fp32.seconds, 3), "eager_seconds": round(eager.seconds, 3)})
        if index == 0:
            first_forward["reference"] = rel_error(eager.first_forward, fp32.first_forward)
        for tier, component, fields in plan:
            key = f"{tier}/{component}"
            log(f"  {key} {precision}")
            label = tier if component == "dit" else f"{tier}-{component}"
            got = run(request, tag, label, precision, **fields)
            per_tier[key].append(TierParitySample(seed=sample_seed, prompt=prompt, psnr_db=psnr(eager.frames, got.frames),
                                                  reference_psnr_db=floor))
            seconds[key] = seconds.get(key, 0.0) + got.seconds
            if index == 0:
                first_forward[key] = rel_error(got.first_forward, eager.first_forward)
        del fp32, eager
    reference = {"psnr_db": sum(r["psnr_db"] for r in reference_rows) / samples, "samples": reference_rows,
                 "step_rel_error": first_forward["reference"],
                 "fp32_seconds": round(sum(r["fp32_seconds"] for r in reference_rows), 3),
                 "eager_seconds": round(sum(r["eager_seconds"] for r in reference_rows), 3)}
    measurements: list[TierParityMeasurement] = []
    for tier, component, _ in plan:
        key = f"{tier}/{component}"
        measurement = TierParityMeasurement(
            tier=tier, component=component, model_id=card.model_id, precision=precision, steps=steps, frames=frames,
            height=height, width=width, samples=tuple(per_tier[key]), step_rel_error=first_forward[key],
            reference_step_rel_error=first_forward["reference"], source=source,
        )
        verdict = TIER_PARITY_CONTRACTS[tier].check(measurement, model_id=card.model_id, precision=precision,
                                                    defaults=card.capabilities.defaults, component=component)  # type: ignore[arg-type]
        stats = measurement.statistics()
        measurements.append(measurement)
        results[key] = {"status": "measured", "psnr_db": measurement.psnr_db,
                        "samples": [s.model_dump(mode="json") for s in measurement.samples],
                        "mean_difference_db": stats.mean_db, "lower_bound_db": stats.lower_bound_db,
                        "step_rel_error": measurement.step_rel_error, "seconds": round(seconds[key], 3),
                        "passed": verdict.passed, "verdict": verdict.reason}
    return {"reference": reference, "tiers": results, "record": TierParityRecord(measurements=tuple(measurements))}


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"CPU {platform.machine()} ({torch.get_num_threads()} threads), torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", default="wan-tiny", help="an fv-wan card id (real sizes get seeded random weights)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"),
                        help="the precision eager and the tiers run in (the card's serving precision)")
    parser.add_argument("--tiers", nargs="*", default=list(TIERS), choices=TIERS,
                        help="tiers to measure (none: only the eager references, e.g. to fill --cache-dir)")
    parser.add_argument("--steps", type=int, help="default: the card's (a shorter run cannot pass a contract)")
    parser.add_argument("--height", type=int), parser.add_argument("--width", type=int), parser.add_argument("--frames", type=int)
    parser.add_argument("--seed", type=int, default=0, help="the first sample's seed (sample i runs seed + i)")
    parser.add_argument("--samples", type=int, default=3,
                        help="trajectories per configuration, each its own seed and prompt (the contract needs >= 3)")
    parser.add_argument("--components", nargs="+", default=["dit", "vae"], choices=("dit", "vae"),
                        help="components to measure each tier on, one at a time (the fused kernels act on both)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--record", type=Path, help="merge the measurements into this TierParityRecord file")
    parser.add_argument("--cache-dir", type=Path, help="keep (and reuse) each run's final video and first forward here")
    parser.add_argument("--budget-s", type=float, help="stop this invocation between two steps once this many seconds "
                        "have passed, saving the trajectory in flight to --cache-dir; the same command continues it")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    card = wan_card_for_device(args.card, device)
    if card is None:
        return 0
    if args.precision not in card.precision.supported:
        raise SystemExit(f"--precision: card {card.model_id!r} supports {sorted(card.precision.supported)}, not {args.precision!r}")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    d = card.capabilities.defaults
    assert d is not None
    steps, frames = args.steps or d.steps, args.frames or d.frames
    height, width = args.height or d.height, args.width or d.width
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    weights = "seeded random weights"  # every card here (wan_card_for_device; the embedded cards have no others)
    command = "python bench/bench_tier_parity.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.samples < 1:
        raise SystemExit(f"--samples must be >= 1, got {args.samples}")
    seeds = f"seeds {args.seed}..{args.seed + args.samples - 1}" if args.samples > 1 else f"seed {args.seed}"
    source = f"{date}, {machine(device)}, {weights}, {seeds}: {command}"

    if args.budget_s is not None and args.cache_dir is None:
        raise SystemExit("--budget-s needs --cache-dir: a paused trajectory is continued from there")
    deadline = None if args.budget_s is None else time.perf_counter() + args.budget_s

    def out_of_time(steps_run: int, seconds: float) -> bool:
        return deadline is not None and time.perf_counter() > deadline

    try:
        report = measure_tier_parity(card, device=device, precision=args.precision, tiers=tuple(args.tiers), steps=steps,
                                     frames=frames, height=height, width=width, seed=args.seed, source=source,
                                     cache_dir=args.cache_dir, pause=out_of_time, samples=args.samples,
                                     components=tuple(args.components))
    except Paused as paused:
        print(f"\n--budget-s reached: {paused}. Run the same command again to continue (nothing is recorded yet).")
        return 0
    ref = report["reference"]
    print(f"\n{card.model_id}, {steps} steps at {frames}x{height}x{width}, {seeds}, {args.precision}; {source}\n")
    floors = ", ".join(f"{r['psnr_db']:.2f}" for r in ref["samples"])
    print(f"eager {args.precision} vs eager fp32 (each sample's floor): {floors} dB; first forward "
          f"{ref['step_rel_error']:.3g} relative\n")
    print(f"| tier/component | PSNR vs eager {args.precision} per sample (dB) | mean vs floor | 95% lower bound | "
          "first forward rel. error | contract |")
    print("|---|---|---|---|---|---|")
    for key, row in report["tiers"].items():
        if row["status"] == "skipped":
            print(f"| {key} | skipped | | | | {row['reason']} |")
        else:
            per_sample = ", ".join(f"{s['psnr_db']:.2f}" for s in row["samples"])
            print(f"| {key} | {per_sample} | {row['mean_difference_db']:+.2f} | {row['lower_bound_db']:+.2f} | "
                  f"{row['step_rel_error']:.3g} | {'pass' if row['passed'] else 'FAIL'} |")
    record: TierParityRecord = report["record"]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"card": card.model_id, "device": str(device), "machine": machine(device), "precision": args.precision,
                "steps": steps, "frames": frames, "height": height, "width": width, "seed": args.seed,
                "samples": args.samples, "weights": weights,
                "date": date, "command": command}
        payload = {"meta": meta, "reference": ref, "tiers": report["tiers"], "record": record.model_dump(mode="json")}
        args.json.write_text(json.dumps(payload, indent=2))  # inf stays Infinity, as TierParityRecord files hold it
    if args.record:
        previous = load_parity_record(args.record) if args.record.exists() else TierParityRecord()
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(previous.merged(record.measurements).model_dump_json(indent=2))
        print(f"\nrecorded {len(record.measurements)} measurement(s) in {args.record} (name it as compute.parity_record)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
