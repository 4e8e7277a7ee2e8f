"""The Engine's own time per request, first request included, in a fresh process; and the cold start.

    python bench/bench_first_request.py                      # wan-tiny on CPU, 5 requests one after another
    python bench/bench_first_request.py --card wan-tiny --requests 8 --device cuda
    python bench/bench_first_request.py --cold-start         # fv generate / fv serve from a fresh process
    python bench/bench_first_request.py --cold-start --cold-card wan-toy --device cuda --runs 3

One Engine, one resident instance, requests run one at a time. Per request: the scheduler's own
time (``EngineMetrics.scheduler_seconds``: admission, batch choice, hand-back), the loops' host
code (``loop_host_seconds``) and execute time, as deltas of the Engine's metrics. What only the
first request pays shows as the difference between request 0 and the rest.

``--cold-start`` times what a user waits for before the first step, in fresh processes under
``python -X importtime``: ``fv generate --model CARD`` (total wall; start to loaded, from the
spawn until the card's weights are loaded, before the first step; import time, the sum of every
module's own time; the card's load, ``ModelInstance.load_for_task``, whose own lazy imports count
in both) and ``fv serve --model CARD`` until ``GET /health`` answers (time to ready). One unmeasured
run first writes the bytecode caches, as a user's second run finds them; the figures are the
median of ``--runs`` after it, side by side, then the modules with the largest cumulative import
time in the last ``fv generate`` and ``fv serve`` runs. ``--generate-only`` leaves ``fv serve`` out
(a machine without the serve extra).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", default="wan-tiny", help="an embedded fv-wan card")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cold-start", action="store_true", help="time fv generate and fv serve's cold start instead")
    parser.add_argument("--cold-card", default="wan-toy", help="the card --cold-start generates and serves")
    parser.add_argument("--runs", type=int, default=3, help="--cold-start: measured runs (after one that warms bytecode)")
    parser.add_argument("--top", type=int, default=12, help="--cold-start: modules listed by cumulative import time")
    parser.add_argument("--cold-steps", type=int, default=None, help="--cold-start: fv generate --steps (default: the card's)")
    parser.add_argument("--generate-only", action="store_true",
                        help="--cold-start: time fv generate only (a machine without the serve extra)")
    args = parser.parse_args(argv)
    if args.cold_start:
        return cold_start(args.cold_card, args.device, args.runs, args.top, args.cold_steps, serve=not args.generate_only)
    import torch

    from fv_kernel.api import DiffusionParams, Engine, InstanceOptions, Request, TaskType, TextPart, build_instance
    from fv_kernel.runtime.engine import run_concurrently
    from fv_wan.cards import wan_cards

    cards = {c.model_id: c for c in wan_cards() if c.checkpoint.source is None}
    if args.card not in cards:
        raise SystemExit(f"--card: {args.card!r} is not an embedded card; allowed: {', '.join(sorted(cards))}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: --device cuda asked for CUDA, which this machine does not have")
        return 0
    card = cards[args.card]
    d = card.capabilities.defaults
    started = time.perf_counter()
    engine = Engine()
    engine.add_instance(build_instance(card, InstanceOptions(device=args.device)))
    print(f"{card.model_id} on {args.device}, {args.steps} steps at {d.frames}x{d.height}x{d.width}; "
          f"Engine built and instance added in {1e3 * (time.perf_counter() - started):.1f} ms")
    print("| request | scheduler ms | loops' host code ms | execute ms | scheduler / execute |")
    print("|---|---|---|---|---|")
    m = engine.metrics
    for i in range(args.requests):
        before = (m.scheduler_seconds, m.loop_host_seconds, m.execute_seconds)
        request = Request(request_id=f"r{i}", model=card.model_id, task=TaskType.TEXT_TO_VIDEO,
                          inputs=(TextPart(text="a red ball rolls"),), diffusion=DiffusionParams(steps=args.steps, seed=i))
        (result,) = run_concurrently(engine, [request])
        if result.status != "completed":
            raise SystemExit(f"request {i} {result.status}: {result.error}")
        sched, host, execute = (1e3 * (after - b) for after, b in
                                zip((m.scheduler_seconds, m.loop_host_seconds, m.execute_seconds), before))
        print(f"| {i} | {sched:.2f} | {host:.2f} | {execute:.1f} | {100 * sched / execute:.2f}% |")
    return 0


# --------------------------------------------------------------------------- cold start

#: Runs ``fv`` in the child under -X importtime; times load_for_task and reports it on stdout's last line.
_DRIVER = """
import json, sys, time
from fv_kernel.model.instance import ModelInstance
loads, loaded_at = [], []
inner = ModelInstance.load_for_task
def timed(self, *a, **k):
    t = time.perf_counter()
    try:
        return inner(self, *a, **k)
    finally:
        loads.append(time.perf_counter() - t)
        loaded_at.append(time.time())
ModelInstance.load_for_task = timed
from fv_kernel.cli.app import exit_now, main
sys.argv = ["fv", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print(json.dumps({"fv_cold_start_load_s": sum(loads), "loaded_at": max(loaded_at, default=None)}))
exit_now(code)  # as the fv console script ends
"""

_IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def parse_importtime(stderr: str) -> tuple[float, list[tuple[float, int, str]], dict[str, float]]:
    """From ``-X importtime`` output: the sum of self times (s), [(cumulative s, depth, module)],
    and each top-level package's own time (the self times of all its modules, s)."""
    total, rows, packages = 0, [], {}
    for line in stderr.splitlines():
        match = _IMPORT_LINE.match(line)
        if match:
            self_us, cumulative_us, indent, name = match.groups()
            total += int(self_us)
            rows.append((int(cumulative_us) / 1e6, (len(indent) - 1) // 2, name))
            package = name.split(".")[0]
            packages[package] = packages.get(package, 0.0) + int(self_us) / 1e6
    return total / 1e6, rows, packages


def _fv_generate(card: str, device: str, out_dir: Path, steps: int | None) -> dict:
    command = [sys.executable, "-X", "importtime", "-c", _DRIVER, "generate", "--model", card, "--prompt",
               "a red cube moves", "--device", device, "--output", str(out_dir / "cold.pt")]
    command += [] if steps is None else ["--steps", str(steps)]
    started, epoch = time.perf_counter(), time.time()
    done = subprocess.run(command, check=False, capture_output=True, text=True, env=_child_env())
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"fv generate failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    imports, rows, packages = parse_importtime(done.stderr)
    return {"wall": wall, "imports": imports, "load": report["fv_cold_start_load_s"],
            "to_loaded": report["loaded_at"] - epoch, "rows": rows, "packages": packages}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _fv_serve(card: str, device: str, out_dir: Path, timeout_s: float = 300.0) -> dict:
    port = _free_port()
    config = out_dir / "deploy.yaml"
    config.write_text(json.dumps({"output_dir": str(out_dir / "serve"), "cards": [{"model": card, "device": device}]}))
    command = [sys.executable, "-X", "importtime", "-m", "fv_kernel.cli.app", "serve", "--config", str(config),
               "--port", str(port), "--log-level", "warning"]
    log = out_dir / "serve.stderr"
    started = time.perf_counter()
    with log.open("w") as stderr:
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=_child_env())
        try:
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"fv serve exited ({server.returncode}) before /health answered:\n{log.read_text()[-3000:]}")
                if time.perf_counter() - started > timeout_s:
                    raise SystemExit(f"fv serve: /health did not answer within {timeout_s:.0f} s")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
                        if reply.status == 200:
                            break
                except OSError:
                    time.sleep(0.02)
            ready = time.perf_counter() - started
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    imports, rows, packages = parse_importtime(log.read_text())
    return {"wall": ready, "imports": imports, "rows": rows, "packages": packages}


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's second run finds the bytecode caches
    return env


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def cold_start(card: str, device: str, runs: int, top: int, steps: int | None = None, *, serve: bool = True) -> int:
    if runs < 1:
        raise SystemExit(f"--runs must be >= 1, got {runs}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("skipped: --device cuda asked for CUDA, which this machine does not have")
            return 0
    with tempfile.TemporaryDirectory(prefix="fv-cold-start-") as tmp:
        out_dir = Path(tmp)
        _fv_generate(card, device, out_dir, steps)  # writes bytecode caches (a user's first run)
        generate = [_fv_generate(card, device, out_dir, steps) for _ in range(runs)]
        served: list[dict] = []
        if serve:
            _fv_serve(card, device, out_dir)
            served = [_fv_serve(card, device, out_dir) for _ in range(runs)]
    print(f"cold start of {card} on {device}, {os.cpu_count()} CPUs, median of {runs} run(s) after one that warms bytecode")
    print("| command | total wall s | start to loaded s | imports s (sum of -X importtime self) | load s (load_for_task) | target |")
    print("|---|---|---|---|---|---|")
    print(f"| fv generate --model {card} | {_median(generate, 'wall'):.2f} | {_median(generate, 'to_loaded'):.2f} | "
          f"{_median(generate, 'imports'):.2f} | {_median(generate, 'load'):.2f} | <= 2.5 s wall (CPU) |")
    if served:
        print(f"| fv serve --model {card}, until /health answers | {_median(served, 'wall'):.2f} | - | "
              f"{_median(served, 'imports'):.2f} | - | < 5 s to ready |")
    else:
        print(f"| fv serve --model {card}, until /health answers | not measured (--generate-only) | - | - | - | < 5 s to ready |")
    print(f"\nimport time by package (the own time of all its modules, s; median over the runs), top {top}")
    print("| package | fv generate | fv serve |")
    print("|---|---|---|")
    names = {name for run in generate + served for name in run["packages"]}

    def package_median(runs_of: list[dict], name: str) -> float:
        return statistics.median(run["packages"].get(name, 0.0) for run in runs_of) if runs_of else float("nan")

    by_package = {name: (package_median(generate, name), package_median(served, name)) for name in names}
    for name, (gen, srv) in sorted(by_package.items(), key=lambda item: -max(v for v in item[1] if v == v))[:top]:
        print(f"| {name} | {gen:.3f} | {'-' if not served else f'{srv:.3f}'} |")
    for name, result in (("fv generate", generate[-1]), *((("fv serve", served[-1]),) if served else ())):
        print(f"\n{name}: top {top} modules by cumulative import time, last run (s; depth 0 = imported by fv's own code)")
        print("| module | cumulative s | depth |")
        print("|---|---|---|")
        for cumulative, depth, module in sorted(result["rows"], key=lambda row: -row[0])[:top]:
            print(f"| {module} | {cumulative:.3f} | {depth} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
