"""The README's "Use it" lines run as written (every line that needs no network and no server).

Lines are taken from README.md, not copied here, so the README cannot drift from what works.
Skipped, and said so: a line whose comment says it downloads (no network in tests), ``fv serve``
(it runs until stopped; the serving tests run it), and lines naming a card of a plugin this test
environment does not install (fv-cosmos3's tests run those: see ``readme_lines``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from tiny_wan_checkpoints import tiny_transformer_config, tiny_vae_config, write_checkpoint

REPO = Path(__file__).resolve().parents[3]


def readme_lines() -> list[tuple[str, str]]:
    """(command, comment) for each line of the README's "Use it" block."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Use it\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert section, "README.md has no '## Use it' section"
    block = re.search(r"```\n(.*?)```", section.group(1), flags=re.S)
    assert block, "the 'Use it' section has no code block"
    lines = []
    for line in block.group(1).splitlines():
        command, _, comment = line.partition("  #")
        if command.strip():
            lines.append((command.strip(), comment.strip()))
    return lines


def skip_reason(command: str, comment: str) -> str | None:
    if "download" in comment:
        return "needs the network"
    if command.startswith("fv serve"):
        return "a server that runs until stopped (tests/test_serving*.py run it)"
    if command.startswith("fv worker"):
        return "a Dynamo worker that runs until stopped (plugins/fv-dynamo/tests run it)"
    if command.startswith("fv realtime-gateway"):
        return "a gateway that runs until stopped, in front of Dynamo workers (plugins/fv-dynamo/tests run it)"
    if command.startswith("fv comfy"):
        return "needs a ComfyUI workflow and its model mapping (plugins/fv-comfyui/tests run the command)"
    if "cosmos3" in command and importlib.util.find_spec("fv_cosmos3") is None:
        return "fv-cosmos3 is not installed here"
    return None


def test_the_readme_use_it_lines_run_as_written(tmp_path: Path) -> None:
    from diffusers import UniPCMultistepScheduler

    # What the lines assume exists: a Wan diffusers checkpoint and a deploy config.
    write_checkpoint(tmp_path / "my-diffusers-checkpoint", transformer=tiny_transformer_config(), vae=tiny_vae_config(),
                     scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                                               num_train_timesteps=1000))
    (tmp_path / "deploy.yaml").write_text("{}\n")
    # A LoRA for wan-toy (diffusers/PEFT layout) as style.safetensors, and a directory holding one.
    from fv_kernel.api import CardCatalog, InstanceOptions, build_instance
    from fv_kernel.plugins import PluginHost
    from fv_kernel.testing.adapters import peft_lora_tensors, write_peft_lora

    dit = build_instance(CardCatalog(PluginHost()).get("wan-toy"), InstanceOptions(device="cpu")).component("transformer")
    lora = peft_lora_tensors(dit, "transformer", ["blocks.0.attn1.to_q", "blocks.0.ffn.net.2"], rank=4, alpha=4.0)
    write_peft_lora(tmp_path / "style.safetensors", lora)
    (tmp_path / "loras").mkdir()
    write_peft_lora(tmp_path / "loras" / "ink.safetensors", lora)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    ran, skipped = [], []
    for command, comment in readme_lines():
        reason = skip_reason(command, comment)
        if reason is not None:
            skipped.append((command, reason))
            continue
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"README line failed: {command}\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr, done.stderr
        for output in re.findall(r"--output (\S+)", command):
            assert (tmp_path / output).is_file() and (tmp_path / output).stat().st_size > 0, (command, output)
            (tmp_path / output).unlink()  # the next line must write its own
        ran.append(command)
    assert any("./my-diffusers-checkpoint" in c for c in ran) and any("my-card.json" in c for c in ran)
    assert all(reason for _, reason in skipped) and len(ran) >= 8, (ran, skipped)
