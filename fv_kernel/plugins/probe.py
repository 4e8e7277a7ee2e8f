"""Import a plugin in a clean subprocess and report side effects it must not have.

Run as ``python -m fv_kernel.plugins.probe <distribution> <entry point value>``; prints
one JSON object. The plugin module is imported and its registration hooks are run
with ``open``, ``torch.load``, safetensors and CUDA initialisation instrumented, so
a plugin that initialises CUDA or reads a weight file while being discovered or
registered is caught even on a machine without a GPU.
"""

from __future__ import annotations

import builtins
import importlib
import io
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")


@dataclass
class ProbeResult:
    """What importing and registering one plugin did."""

    cuda_initialized: bool = False
    weight_files_opened: list[str] = field(default_factory=list)
    error: str | None = None

    def problems(self) -> list[str]:
        out = []
        if self.error:
            out.append(f"importing/registering the plugin failed: {self.error}")
        if self.cuda_initialized:
            out.append("importing/registering the plugin initialised CUDA; defer CUDA work to engine start")
        if self.weight_files_opened:
            out.append(
                "importing/registering the plugin read weight files "
                f"{sorted(set(self.weight_files_opened))}; load weights when an engine starts the card"
            )
        return out


def run_probe(distribution: str, entry_point_value: str, *, extra_path: Sequence[str] = (), timeout: float = 180.0) -> ProbeResult:
    """Run the probe in a subprocess (``extra_path`` is prepended to its ``PYTHONPATH``)."""
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([*extra_path, *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-m", "fv_kernel.plugins.probe", distribution, entry_point_value],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return ProbeResult(error=f"probe subprocess exited {proc.returncode}: {' | '.join(tail)}")
    return ProbeResult(**json.loads(lines[-1]))


def _instrument(result: ProbeResult) -> None:
    def note(path: Any) -> None:
        if isinstance(path, (str, bytes, os.PathLike)):
            text = os.fsdecode(path)
            if text.endswith(WEIGHT_SUFFIXES):
                result.weight_files_opened.append(text)

    real_open = builtins.open
    real_os_open = os.open

    def guarded_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        note(file)
        return real_open(file, *args, **kwargs)

    def guarded_os_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        note(path)
        return real_os_open(path, *args, **kwargs)

    builtins.open = guarded_open
    io.open = guarded_open
    os.open = guarded_os_open

    def wrap(owner: Any, attr: str, before: Callable[..., None]) -> None:
        real = getattr(owner, attr, None)
        if real is None:
            return

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            before(*args, **kwargs)
            return real(*args, **kwargs)

        setattr(owner, attr, wrapped)

    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    if torch is not None:
        wrap(torch, "load", lambda f=None, *a, **k: note(f))

        def cuda_touched(*_: Any, **__: Any) -> None:
            result.cuda_initialized = True

        wrap(torch.cuda, "_lazy_init", cuda_touched)
        wrap(torch.cuda, "init", cuda_touched)
    try:
        import safetensors
        import safetensors.torch
    except ImportError:
        return
    wrap(safetensors, "safe_open", lambda f=None, *a, **k: note(f))
    wrap(safetensors.torch, "safe_open", lambda f=None, *a, **k: note(f))
    wrap(safetensors.torch, "load_file", lambda f=None, *a, **k: note(f))


def _main(argv: Sequence[str]) -> int:
    distribution, entry_point_value = argv
    result = ProbeResult()
    _instrument(result)
    try:
        module_name, _, attr = entry_point_value.partition(":")
        plugin: Any = importlib.import_module(module_name.strip())
        for part in filter(None, attr.strip().split(".")):
            plugin = getattr(plugin, part)
        from fv_kernel.plugins.host import PluginHost
        from fv_kernel.plugins.kinds import KINDS

        host = PluginHost(discover=False, environ={})
        host.register(plugin, name=distribution)
        for spec in KINDS.values():
            if spec.hook and getattr(host.pm.hook, spec.hook).get_hookimpls():
                host.hooks.registered(spec.kind)
    except BaseException as exc:  # report, never crash: the parent reads the JSON line
        result.error = f"{type(exc).__name__}: {exc}"
    try:
        import torch

        result.cuda_initialized = result.cuda_initialized or torch.cuda.is_initialized()
    except ImportError:
        pass
    sys.stdout.write(json.dumps(asdict(result)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
