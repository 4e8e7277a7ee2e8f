"""``fv generate --model wan-toy`` imports nothing heavy that wan-toy does not use (issue 36 §4).

transformers (its UMT5; it pulls in torch._dynamo and scikit-learn), torch._dynamo, sympy and
triton (torch imports them on the first Python-decomposed op on the meta device, as a pre-flight
parameter count or a meta-built model runs), the server stack and PyAV cost seconds of a cold start.
The check runs the real command in a fresh process and lists which of them it imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("transformers", "torch._dynamo", "sympy", "triton", "torch._higher_order_ops.triton_kernel_wrap",
         "sklearn", "fastapi", "uvicorn", "starlette", "av")  # av: only when an .mp4 is written; this writes .pt

_DRIVER = """
import atexit, json, sys
heavy = json.loads(sys.argv[1])
atexit.register(lambda: print("FV_HEAVY=" + json.dumps(sorted(m for m in heavy if m in sys.modules))))
if sys.argv[2] == "regress":  # the negative control: the two eager paths this test guards against
    import torch
    import fv_wan.models.transformer as wan_transformer
    import fv_wan.models.encoders as wan_encoders
    wan_transformer._scaled_randn = lambda *shape: torch.randn(*shape) / shape[-1] ** 0.5
    wan_encoders.load_umt5 = lambda *paths: None
sys.argv = ["fv", *sys.argv[3:]]
from fv_kernel.cli.app import main
main()
"""


def _heavy_imports(tmp_path: Path, mode: str) -> list[str]:
    command = [sys.executable, "-c", _DRIVER, json.dumps(HEAVY), mode, "generate", "--model", "wan-toy",
               "--prompt", "a red cube moves", "--steps", "1", "--output", str(tmp_path / f"{mode}.pt")]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / f"{mode}.pt").is_file()
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("FV_HEAVY=")]
    return json.loads(line.removeprefix("FV_HEAVY="))


def test_fv_generate_wan_toy_imports_no_heavy_module(tmp_path: Path) -> None:
    assert _heavy_imports(tmp_path, "plain") == []


def test_the_check_sees_an_eager_import(tmp_path: Path) -> None:
    """Negative control: the meta-device randn and transformers' UMT5 back on the path are reported."""
    imported = _heavy_imports(tmp_path, "regress")
    assert {"transformers", "torch._dynamo", "sympy"} <= set(imported)


def _bytecode_switches(root: Path) -> list[str]:
    """Source files under root that turn Python's bytecode cache off (a cold start then compiles every time)."""
    needles = ("dont_write_bytecode", "PYTHONDONTWRITEBYTECODE")
    return sorted(str(p) for p in root.rglob("*.py") if any(n in p.read_text(encoding="utf-8") for n in needles))


def test_no_shipped_module_turns_the_bytecode_cache_off(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[3]
    packages = [repo / "fv_kernel", *sorted(p for p in (repo / "plugins").glob("*/fv_*") if p.is_dir())]
    assert len(packages) > 1 and all(_bytecode_switches(package) == [] for package in packages)
    (tmp_path / "bad.py").write_text("import sys\nsys.dont_write_bytecode = True\n")  # negative control
    assert _bytecode_switches(tmp_path) == [str(tmp_path / "bad.py")]
