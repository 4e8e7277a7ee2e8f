"""docs/examples/video_card_plugin.py (the walkthrough in docs/plugins.md) runs, registers as a
plugin, passes the card conformance kit, and does what the walkthrough says it does."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from fv_kernel.api import (
    DiffusionParams,
    Engine,
    InstanceOptions,
    LoopContext,
    ModelCard,
    OutputSpec,
    Request,
    StepResult,
    TaskType,
    TextPart,
    build_instance,
    drive,
    resolve_request,
)
from fv_kernel.model.catalog import CardCatalog
from fv_kernel.plugins import PluginHost
from fv_kernel.testing import CardConformance, InterleaveConformance

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "video_card_plugin.py"


def load_example() -> ModuleType:
    """The example under the module name its card's import strings use (as when run as a script)."""
    if "video_card_plugin" not in sys.modules:
        spec = importlib.util.spec_from_file_location("video_card_plugin", EXAMPLE)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules["video_card_plugin"] = module
        spec.loader.exec_module(module)
    return sys.modules["video_card_plugin"]


example = load_example()


def request(**diffusion: Any) -> Request:
    return Request(
        model="tinyvideo", task=TaskType.TEXT_TO_VIDEO,
        inputs=(TextPart(text="a red ball"), TextPart(text="blurry", role="negative_prompt")),
        diffusion=DiffusionParams(**diffusion), output=OutputSpec(stream_previews=True),
    )


def test_the_example_runs_as_a_script() -> None:
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == "completed 3 preview chunks video (3, 3, 8, 8)"


def test_it_registers_as_a_plugin_and_runs_through_the_engine(fv_host: PluginHost, register_plugin: Any) -> None:
    register_plugin(example, name="fv-tinyvideo")
    card = CardCatalog(fv_host).get("tinyvideo")
    assert card is example.CARD
    engine = Engine()
    engine.add_instance(build_instance(card, InstanceOptions(registry=fv_host.registry())))
    result, chunks = example.generate(engine, request(seed=1))
    video = result.raise_for_status().artifact("video")
    assert tuple(video.frames.shape) == (3, 3, 8, 8) and video.fps == 8.0
    assert float(video.frames.min()) >= 0.0 and float(video.frames.max()) <= 1.0
    # One preview chunk per decoded frame, in order, carrying exactly the frames of the artifact.
    assert [c.index for c in chunks] == [0, 1, 2] and all(c.preview and c.stream == "video" for c in chunks)
    assert torch.equal(torch.cat([c.frames for c in chunks]), video.frames)
    assert [c.pts for c in chunks] == [(0.0, 0.125), (0.125, 0.25), (0.25, 0.375)]
    # Previews cost nothing for requests that do not ask for them.
    plain, no_chunks = example.generate(engine, request(seed=1).with_updates(output=OutputSpec()))
    assert not no_chunks and torch.equal(plain.artifact("video").frames, video.frames)


def test_outputs_pass_between_loops_and_cfg_runs_two_branches() -> None:
    instance = build_instance(example.CARD)
    req = resolve_request(example.CARD, request(seed=0))
    instance.load_for_task(req.task)

    async def execute(plan: Any) -> StepResult:
        return StepResult(outputs=instance.op(plan.op).fn(plan.inputs, plan.params))

    def run(loop_id: str, upstream: dict[str, Any], r: Request = req) -> Any:
        return asyncio.run(drive(instance.loop(loop_id), instance, LoopContext(request=r, executor=execute, upstream=upstream)))

    encoded = run("encode", {})
    assert set(encoded.outputs) == {"prompt_embeds", "negative_embeds"} and not encoded.artifacts
    denoise = instance.loop("denoise")
    unguided_req = req.with_updates(diffusion=req.diffusion.model_copy(update={"guidance": 1.0}))
    for r, rows, tag in ((req, 2, "cond+uncond"), (unguided_req, 1, "cond")):
        state = denoise.init(r, instance, LoopContext(request=r, executor=execute, upstream=dict(encoded.outputs)))
        plan = denoise.next(state)
        assert plan.inputs["x"].shape[0] == rows and plan.tag == tag  # the guidance branches are the step's rows
    guided = run("denoise", dict(encoded.outputs))
    unguided = run("denoise", dict(encoded.outputs), unguided_req)
    assert not torch.equal(guided.outputs["latents"], unguided.outputs["latents"])
    decoded = run("decode", dict(guided.outputs))
    assert [a.kind for a in decoded.artifacts] == ["video"] and not decoded.outputs


def test_estimates_describe_the_steps_that_run() -> None:
    engine = Engine()
    engine.add_instance(build_instance(example.CARD))
    req = engine.validate(request(seed=2, steps=5, frames=5))
    instance = engine.instances["tinyvideo"]
    estimate = instance.program(req.task).estimate(instance, req)
    planned = {s.loop_id: s.count for s in estimate.steps}
    progress: dict[str, int] = {}

    async def go() -> None:
        async with engine.running():
            handle = engine.submit(req)
            async for event in handle.events():
                if event.type == "progress":
                    progress[event.loop_id] = progress.get(event.loop_id, 0) + 1
            (await handle.result()).raise_for_status()

    asyncio.run(go())
    assert planned == progress == {"encode": 1, "denoise": 5, "decode": 5}
    assert estimate.resident_bytes > 0 and estimate.peak_bytes > 0


class _Example:
    card_ids = ("tinyvideo",)

    def load_card(self, model_id: str) -> ModelCard:
        assert model_id == "tinyvideo"
        return example.CARD


class TestExampleCardConformance(_Example, CardConformance):
    pass


class TestExampleInterleave(_Example, InterleaveConformance):
    pass


def test_the_example_imports_only_the_public_api() -> None:
    from test_docs_imports import kernel_imports  # the docs' import rule, applied to this file too

    assert kernel_imports(EXAMPLE.read_text(), where=str(EXAMPLE)) == []


@pytest.mark.parametrize("guidance", [0.0, 4.0])
def test_the_example_card_resolves_requests(guidance: float) -> None:
    resolved = resolve_request(example.CARD, request(guidance=guidance))
    assert resolved.diffusion.steps == 4 and resolved.diffusion.frames == 3
