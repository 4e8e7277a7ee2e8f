"""Where the host time of Engine runs goes: cProfile around whole requests (bench_gpu's Engine setup).

    python bench/profile_engine.py out/prof            # fastwan at real size on CUDA: 8 single-frame requests, one 448x832x61
    python bench/profile_engine.py out/prof --smoke    # fastwan-tiny on the CPU (CI)

For each case it writes ``<case>.txt``: the run's Engine metrics, the kernel's and plugins' functions
by cumulative time, everything by own time, and who called the calls that wait on the device
(``synchronize``, ``item``, ``tolist``, ``cpu``). One warm-up run per case first, outside the profile.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import bench_gpu  # bench/, beside this script

#: name, DiT attention (None: bench_gpu's --attention), requests, frames, height, width
CASES = (("single8", None, 8, 1, 480, 832), ("e2e", "vsa", 1, 61, 448, 832))
SMOKE_CASES = (("single8", None, 4, 1, 64, 64), ("e2e", None, 1, 9, 64, 64))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="folder for one <case>.txt per case")
    parser.add_argument("--smoke", action="store_true", help="tiny card on the CPU")
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    settings = argparse.Namespace(
        output=args.output / "bench_gpu", smoke=args.smoke, attention="sdpa" if args.smoke else "sdpa_cudnn",
        e2e_attention="vsa", iters=1, budget_s=0.0, concurrency=[8], vae_dtype="fp32", diffusers_compile=False, skip=[],
    )
    b = bench_gpu.Bench(settings)
    for name, attention, count, frames, height, width in SMOKE_CASES if args.smoke else CASES:
        instance = bench_gpu.build_engine_instance(b, None, attention=attention)

        def requests(tag: str) -> list:
            return bench_gpu._requests(b, count, height=height, width=width, frames=frames, tag=tag)

        bench_gpu._run_engine(b, instance, requests("warm"), batched=True)
        batch = requests("profiled")
        profiler = cProfile.Profile()
        profiler.enable()
        run = bench_gpu._run_engine(b, instance, batch, batched=True)
        profiler.disable()
        report = io.StringIO()
        report.write(f"{name}: {run}\n")
        stats = pstats.Stats(profiler, stream=report)
        stats.sort_stats("cumulative").print_stats("fv_kernel|fv_wan", 60)
        stats.sort_stats("tottime").print_stats(40)
        stats.print_callers("synchronize|item|tolist|cpu")
        (args.output / f"{name}.txt").write_text(report.getvalue())
        print(f"{name}: wall {run['wall_s']} s, scheduler {run['scheduler_s']} s, loop host {run['loop_host_s']} s, "
              f"execute {run['execute_s']} s -> {args.output / (name + '.txt')}")
        del instance
        b.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
