"""Realtime sessions benchmark (issue 32, "Measured"; docs/benchmarks.md, "Realtime sessions").

Drives causal Wan sessions through ``Engine.open_session`` (the real session runtime, scheduler and
executor) and measures what a realtime client sees:

- one session: sustained FPS (generated frames / wall seconds from ``open_session``) over
  ``--seconds``, the first chunk's latency from ``open_session``, and prompt-update latency (a
  ``push_text`` every ``--update-every`` seconds until the first chunk generated under it arrives),
  also in units of the session's chunk time (the issue's target: at most one chunk's time);
- ``--sessions`` (default 2 and 4) concurrent sessions, each sustained FPS, with cross-session
  batching on (the causal card as shipped: live sessions' forwards fuse) and off (the card's loop
  made ``batchable: false``, so every forward runs alone) in the same run;
- per chunk: the DiT time (its 5 ``causal_forward`` steps: 4 denoise + the KV refresh) vs the VAE
  chunk decode, and the fused batch sizes the scheduler formed.

Default: ``wan2.1-t2v-1.3b-causal`` on seeded random weights at its real size (the text encoder made
tiny, as in the other benches: the benchmark does not time UMT5), 480x832, bf16, on CUDA. Without
CUDA it prints why and exits 0. ``--smoke`` runs ``wan-toy-causal`` on CPU at 64x64 in fp32 and says
whether one session streams faster than real time (FPS >= the card's playback FPS).

    python bench/bench_realtime.py out/realtime.json                  # H200: 60 s per scenario
    python bench/bench_realtime.py /tmp/rt.json --smoke --seconds 3
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, get_args

import torch

from random_weights import random_weight_card  # bench/, beside this script

from fv_kernel.api import ComputeOptions, Engine, InstanceOptions, Observer, SessionClosed, SessionRequest, StepRecord, TaskType, build_instance
from fv_kernel.compute.compile import FusedOpsMode

CARD_1_3B = "wan2.1-t2v-1.3b-causal"
CARD_SMOKE = "wan-toy-causal"
PROMPTS = ("a red fox runs through snow", "a sailboat on a stormy sea", "a city street at night in the rain",
           "a hot air balloon over green hills")
UPDATE = "the same scene, at sunset"
#: wan-toy-causal knows only its toy world's words (other prompts are refused as outside its envelope).
SMOKE_PROMPTS = ("a red circle moves left on black background", "a blue square moves up on grey background",
                 "a green triangle moves down on navy background", "a yellow circle moves right on dark background")
SMOKE_UPDATE = "a red circle moves right on black background"


class StepTimes(Observer):
    """Every executed batch of the causal card: op, batch size, and its device (else wall) seconds."""

    name = "bench_realtime"

    def __init__(self) -> None:
        self.records: list[tuple[str, int, float]] = []

    def on_step(self, record: StepRecord) -> None:
        seconds = record.device_seconds if record.device_seconds is not None else record.wall_seconds
        self.records.append((record.op, record.batch_size, seconds))

    def summary(self) -> dict[str, Any]:
        by_op: dict[str, list[float]] = {}
        sizes: dict[str, int] = {}
        for op, size, seconds in self.records:
            by_op.setdefault(op, []).append(seconds)
            if op == "causal_forward":
                sizes[str(size)] = sizes.get(str(size), 0) + 1
        forward = statistics.median(by_op["causal_forward"]) if "causal_forward" in by_op else None
        decode = statistics.median(by_op["vae_decode_chunk"]) if "vae_decode_chunk" in by_op else None
        return {
            "median_seconds": {op: statistics.median(v) for op, v in by_op.items()},
            "count": {op: len(v) for op, v in by_op.items()},
            # A chunk is 5 forwards (4 denoise steps + the KV refresh) and one decode.
            "dit_seconds_per_chunk": 5 * forward if forward is not None else None,
            "vae_seconds_per_chunk": decode,
            "forward_batch_sizes": sizes,
        }


def card_for(args: argparse.Namespace, *, batching: bool) -> Any:
    if args.smoke:
        from fv_wan.toy_card import wan_toy_causal_card

        card = wan_toy_causal_card()
        if card is None:
            raise SystemExit(f"--smoke: {CARD_SMOKE}'s weights are not installed (fv_wan package data)")
    else:
        from fv_wan.cards import causal_wan_cards

        card = random_weight_card(next(c for c in causal_wan_cards() if c.model_id == CARD_1_3B))
    if not batching:  # the kernel's switch: a loop that is not batchable keeps every step batch-of-1
        loops = {k: v.model_copy(update={"batchable": False}) for k, v in card.loops.items()}
        card = card.model_copy(update={"loops": loops})
    return card


def make_engine(args: argparse.Namespace, *, batching: bool) -> tuple[Engine, StepTimes, float]:
    card = card_for(args, batching=batching)
    times = StepTimes()
    engine = Engine(observers=[times])
    compute = ComputeOptions(fused_ops=args.fused_ops)
    instance = build_instance(card, InstanceOptions(device=args.device, precision=args.precision, compute=compute,
                                                    attention_backend=args.attention_backend))
    instance.load_for_task(TaskType.TEXT_TO_VIDEO)
    engine.add_instance(instance)
    return engine, times, float(card.capabilities.defaults.fps or 16.0)


async def one_session(engine: Engine, model: str, args: argparse.Namespace, index: int, seconds: float, *,
                      updates: bool = False, max_chunks: int | None = None) -> dict[str, Any]:
    """Run one session for ``seconds`` (then stop it); what its client saw."""
    prompts, update = (SMOKE_PROMPTS, SMOKE_UPDATE) if args.smoke else (PROMPTS, UPDATE)
    opened = time.perf_counter()
    handle = engine.open_session(SessionRequest(
        model=model, prompt=prompts[index % len(prompts)], seed=index, height=args.height, width=args.width,
        max_chunks=max_chunks, idle_timeout_s=max(60.0, 4 * seconds)))
    frames, chunk_times, first = 0, [], None
    pending: dict[int, float] = {}  # prompt version -> when it was pushed
    update_latency: list[tuple[float, int]] = []  # (seconds, chunks that arrived meanwhile)
    next_update = args.update_every
    closed, stopping = None, False
    async for event in handle.events():
        now = time.perf_counter() - opened
        if event.type == "media.chunk":
            first = now if first is None else first
            frames += int(event.num_frames or 0)
            chunk_times.append(now)
            for version, pushed in list(pending.items()):
                if event.prompt_version is not None and event.prompt_version >= version:
                    arrived = sum(1 for t in chunk_times if t > pushed)
                    update_latency.append((now - pushed, arrived))
                    del pending[version]
            if updates and not pending and now >= next_update and now < seconds:
                pending[handle.push_text(update if len(update_latency) % 2 == 0 else prompts[index % len(prompts)])] = time.perf_counter() - opened
                next_update = now + args.update_every
            if now >= seconds and not stopping and not handle.closed:
                stopping = True
                try:
                    handle.cancel("session")
                except SessionClosed:  # it completed (max_chunks) meanwhile
                    pass
        elif event.type == "session.closed":
            closed = str(event.reason)
    end = chunk_times[-1] if chunk_times else time.perf_counter() - opened
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    chunk_s = statistics.median(gaps) if gaps else None
    result: dict[str, Any] = {
        "frames": frames, "chunks": len(chunk_times), "wall_s": end, "fps": frames / end if end > 0 else 0.0,
        "first_chunk_latency_s": first, "chunk_interval_s": chunk_s, "closed": closed,
    }
    if updates:
        result["prompt_update_latency_s"] = [s for s, _ in update_latency]
        result["prompt_update_latency_chunks"] = [s / chunk_s for s, _ in update_latency] if chunk_s else []
        result["prompt_update_chunks_arrived_meanwhile"] = [n for _, n in update_latency]
    return result


async def scenario(args: argparse.Namespace, *, batching: bool, counts: list[int]) -> dict[str, Any]:
    engine, times, playback_fps = make_engine(args, batching=batching)
    model = CARD_SMOKE if args.smoke else CARD_1_3B
    out: dict[str, Any] = {"batching": batching, "playback_fps": playback_fps}
    async with engine.running():
        # Warm-up (kernels, allocator): one short session, not timed.
        await one_session(engine, model, args, 99, args.seconds, max_chunks=1)
        if 1 in counts:
            times.records.clear()
            out["1"] = await one_session(engine, model, args, 0, args.seconds, updates=True)
            out["1"]["steps"] = times.summary()
            print(f"[batching {'on' if batching else 'off'}] 1 session: {out['1']['fps']:.1f} FPS, first chunk "
                  f"{out['1']['first_chunk_latency_s']:.3f} s, prompt update "
                  f"{out['1']['prompt_update_latency_s']} s", file=sys.stderr)
        for n in (c for c in counts if c > 1):
            times.records.clear()
            runs = await asyncio.gather(*(one_session(engine, model, args, i, args.seconds) for i in range(n)))
            out[str(n)] = {"sessions": runs, "per_session_fps": [r["fps"] for r in runs],
                           "min_fps": min(r["fps"] for r in runs), "steps": times.summary()}
            print(f"[batching {'on' if batching else 'off'}] {n} sessions: FPS "
                  f"{[round(r['fps'], 1) for r in runs]}, forward batch sizes {out[str(n)]['steps']['forward_batch_sizes']}",
                  file=sys.stderr)
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="JSON results path")
    parser.add_argument("--seconds", type=float, default=60.0, help="wall seconds per scenario (default 60)")
    parser.add_argument("--sessions", default="2,4", help="concurrent session counts to run (comma list)")
    parser.add_argument("--update-every", type=float, default=None,
                        help="seconds between prompt updates in the one-session run (default: seconds / 4)")
    parser.add_argument("--smoke", action="store_true", help=f"{CARD_SMOKE} on CPU at 64x64, fp32")
    # Every mode but "auto", which picks by a parity record: the bench names the ops it times.
    parser.add_argument("--fused-ops", default="off", choices=[m for m in get_args(FusedOpsMode) if m != "auto"],
                        help="the instance's fused ops (DiT and VAE; default off: eager, what a card without a "
                        "parity record runs)")
    parser.add_argument("--attention-backend", default="sdpa",
                        help="the instance's attention driver (fv.attention_backends: sdpa lets PyTorch pick a kernel "
                        "per call, sdpa_cudnn pins cuDNN's; default sdpa)")
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error("--seconds must be > 0")
    try:
        counts = sorted({1, *(int(n) for n in args.sessions.split(",") if n.strip())})
    except ValueError:
        parser.error(f"--sessions must be a comma list of positive integers, got {args.sessions!r}")
    if any(n < 1 for n in counts):
        parser.error(f"--sessions must be a comma list of positive integers, got {args.sessions!r}")
    args.update_every = args.update_every or args.seconds / 4
    if args.smoke:
        args.device, args.precision, args.height, args.width = "cpu", "fp32", 64, 64
    else:
        if not torch.cuda.is_available():
            print("skipped: bench_realtime.py measures wan2.1-t2v-1.3b-causal on CUDA, which this machine does not "
                  "have (run with --smoke for the CPU toy)")
            return 0
        args.device, args.precision, args.height, args.width = "cuda", "bf16", 480, 832
    on = asyncio.run(scenario(args, batching=True, counts=counts))
    off = asyncio.run(scenario(args, batching=False, counts=[n for n in counts if n > 1]))
    one = on["1"]
    result = {
        "card": CARD_SMOKE if args.smoke else CARD_1_3B, "device": args.device, "precision": args.precision,
        "size": [args.height, args.width], "seconds": args.seconds, "torch": torch.__version__,
        "fused_ops": args.fused_ops, "attention_backend": args.attention_backend,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine(),
        "one_session": one,
        "faster_than_realtime": one["fps"] >= on["playback_fps"],
        "concurrent": {n: {"batching_on": on[str(n)], "batching_off": off[str(n)]} for n in counts if n > 1},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"one session: {one['fps']:.1f} FPS (playback {on['playback_fps']:g}: "
          f"{'faster' if result['faster_than_realtime'] else 'slower'} than real time); first chunk "
          f"{one['first_chunk_latency_s']:.3f} s; DiT {one['steps']['dit_seconds_per_chunk']} s vs VAE "
          f"{one['steps']['vae_seconds_per_chunk']} s per chunk")
    for n in result["concurrent"]:
        print(f"{n} sessions: min FPS batching on {on[str(n)]['min_fps']:.1f}, off {off[str(n)]['min_fps']:.1f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
