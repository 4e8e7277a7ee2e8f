"""The Python façade (``fv_kernel.load`` -> VideoGenerator -> Video), on the kernel's toy cards.

The cards reach ``fv.load`` as card files and through a plugin, as ``fv generate --model``
takes them; the README's example on the real embedded card runs in fv-wan's tests
(plugins/fv-wan/tests/test_facade_wan.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import fv_kernel as fv
import fv_kernel.api
from fv_kernel.api import DiffusionParams, Request, TaskType, TextPart, build_instance, hookimpl, run_local
from fv_kernel.config import DeployConfig, DeployConfigError
from fv_kernel.errors import FvError, InvalidRequest, StepFailed
from fv_kernel.io.media import MediaError, check_output_path
from fv_kernel.plugins import PluginHost
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.testing import StepRecorder
from fv_kernel.testing.toy import toy_card

PROMPTS = ["a red fox", "a blue bird", "a green frog"]
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _card_file(tmp_path: Path, model_id: str = "toy-dit") -> Path:
    path = tmp_path / f"{model_id}.json"
    path.write_text(toy_card(model_id).model_dump_json())
    return path


@pytest.fixture
def toy_file(tmp_path: Path) -> Path:
    return _card_file(tmp_path)


@pytest.fixture
def gen(toy_file: Path, fv_host: PluginHost) -> fv.VideoGenerator:
    return fv.load(str(toy_file), host=fv_host)


def alone(prompt: str, **diffusion: Any) -> torch.Tensor:
    """The lower-level reference: the toy card run directly, without the façade or the scheduler."""
    request = Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=prompt),),
                      diffusion=DiffusionParams(**diffusion))
    (video,) = run_local(request, build_instance(toy_card("toy-dit")))
    return video.frames


# --------------------------------------------------------------------------- import stays light


def _imports_torch(statement: str) -> bool:
    code = f"import sys; {statement}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.strip() == "True"


def test_importing_the_package_does_not_import_torch() -> None:
    assert not _imports_torch("import fv_kernel as fv; fv.__version__; fv.API_VERSION; dir(fv)")
    # The check sees torch when it is imported (negative control): the first use of a lazy name does.
    assert _imports_torch("import fv_kernel as fv; fv.load")


def test_lazy_names_resolve_and_unknown_ones_are_attribute_errors() -> None:
    from fv_kernel import facade

    assert fv.load is facade.load and fv.Video is facade.Video and fv.VideoGenerator is facade.VideoGenerator
    assert fv.api.load is fv.load and fv.api.Video is fv.Video  # and the public api re-exports them
    assert {"load", "Video", "VideoGenerator", "Finished"} <= set(dir(fv)) and "load" in fv.__all__
    with pytest.raises(AttributeError, match="has no attribute 'nosuch'"):
        fv.nosuch  # noqa: B018


# --------------------------------------------------------------------------- one object, one call


def test_generate_returns_a_video_equal_to_the_lower_level_api(gen: fv.VideoGenerator) -> None:
    video = gen.generate("a red fox", seed=7, steps=3)
    assert isinstance(video, fv.Video)
    assert tuple(video.frames.shape) == (3, 3, 8, 8) and video.fps == 8.0  # the card's defaults
    assert float(video.frames.min()) >= 0.0 and float(video.frames.max()) <= 1.0
    assert video.request_id == video.provenance.request_id and [a.kind for a in video.artifacts] == ["video"]
    assert torch.equal(video.frames, alone("a red fox", seed=7, steps=3))
    assert not torch.equal(video.frames, alone("a red fox", seed=8, steps=3))  # the seed reached the request
    assert repr(video) == f"Video(3 frames, 8x8, 8 fps, request {video.request_id!r})"


def test_a_list_of_prompts_batches_in_the_scheduler_and_equals_each_prompt_alone(gen: fv.VideoGenerator) -> None:
    recorder = StepRecorder()
    gen.engine.observers.append(recorder)
    videos = gen.generate(PROMPTS, seed=7)
    assert isinstance(videos, list) and len(videos) == len(PROMPTS)
    denoise = recorder.of_kind("diffusion_step")
    ids = [v.request_id for v in videos]
    # The requests were co-resident: their denoise steps ran together, several to a batch.
    assert any(len(set(r.request_ids) & set(ids)) == len(ids) for r in denoise), [r.request_ids for r in denoise]
    assert gen.engine.metrics.completed == len(PROMPTS)
    assert any(sum(r.fused) == len(ids) for r in denoise), "throughput batching (the default) fused them"
    recorder.records.clear()
    tolerance = gen.card.parity.batching_tolerance("fp32")
    assert tolerance is not None
    for prompt, video in zip(PROMPTS, videos):  # in order, each within the card's tolerance of its prompt alone
        assert (video.frames - gen.generate(prompt, seed=7).frames).abs().max() <= tolerance.max_abs
        assert (video.frames - alone(prompt, seed=7)).abs().max() <= tolerance.max_abs
    assert all(len(r.request_ids) == 1 for r in recorder.records)  # one prompt at a time never batches
    assert not torch.equal(videos[0].frames, videos[1].frames)  # distinct prompts: the order is checked
    # exact=True: batched in the scheduler, never fused, each bit-identical to its prompt alone.
    recorder.records.clear()
    exact = gen.generate(PROMPTS, seed=7, exact=True)
    assert any(len(r.request_ids) > 1 for r in recorder.of_kind("diffusion_step"))
    assert not any(any(r.fused) for r in recorder.records)
    for prompt, video in zip(PROMPTS, exact):
        assert torch.equal(video.frames, alone(prompt, seed=7))


def test_the_batching_check_fails_when_the_scheduler_runs_one_request_at_a_time(toy_file: Path, fv_host: PluginHost) -> None:
    # Negative control, and the deploy config's scheduler reaching the façade's engine:
    # scheduling "request" runs each request to completion, so no step is ever batched.
    serial = fv.load(str(toy_file), host=fv_host, config=DeployConfig(scheduler=SchedulerConfig(scheduling="request")))
    recorder = StepRecorder()
    serial.engine.observers.append(recorder)
    videos = serial.generate(PROMPTS[:2], seed=7)
    assert all(len(r.request_ids) == 1 for r in recorder.records)
    assert torch.equal(videos[1].frames, alone(PROMPTS[1], seed=7))


def test_agenerate_runs_concurrent_calls_through_one_scheduler(gen: fv.VideoGenerator) -> None:
    recorder = StepRecorder()
    gen.engine.observers.append(recorder)

    async def main() -> tuple[Any, ...]:
        return await asyncio.gather(gen.agenerate(PROMPTS[0], seed=7), gen.agenerate(PROMPTS[1], seed=7),
                                    gen.agenerate(PROMPTS[1:], seed=7))

    first, second, pair = asyncio.run(main())
    assert isinstance(first, fv.Video) and isinstance(pair, list) and len(pair) == 2
    tolerance = gen.card.parity.batching_tolerance("fp32")
    assert tolerance is not None

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:  # throughput batching (the default) fused the calls
        return bool((a - b).abs().max() <= tolerance.max_abs)

    assert close(first.frames, alone(PROMPTS[0], seed=7)) and close(second.frames, alone(PROMPTS[1], seed=7))
    assert close(pair[0].frames, second.frames) and close(pair[1].frames, alone(PROMPTS[2], seed=7))
    assert max(len(r.request_ids) for r in recorder.of_kind("diffusion_step")) == 4  # every call shared the engine
    assert gen.engine._scheduler_task is None  # the last call out stopped the engine


def test_agenerate_cancelled_by_its_caller_cancels_its_request(gen: fv.VideoGenerator) -> None:
    async def main() -> None:
        task = asyncio.create_task(gen.agenerate("a red fox", steps=50))
        while not gen.engine.running_count():
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert gen.engine.metrics.cancelled == 1 and gen.engine.metrics.completed == 0


def test_a_call_from_another_event_loop_while_one_is_in_flight_is_refused(
    gen: fv.VideoGenerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, release = threading.Event(), threading.Event()
    # Every step waits for the release: the call stays in flight however late this thread runs
    # (a 3-step toy request can otherwise finish, and free the generator, before the second call).
    (instance,) = gen.engine.instances.values()
    real_op = instance.op

    def held_op(name: str) -> Any:
        op = real_op(name)
        return dataclasses.replace(op, fn=lambda inputs, params: (release.wait(60), op.fn(inputs, params))[1])

    monkeypatch.setattr(instance, "op", held_op)

    async def hold() -> fv.Video:
        call = asyncio.create_task(gen.agenerate("a red fox", steps=3))
        while not gen.engine.running_count():
            await asyncio.sleep(0.001)
        started.set()
        await asyncio.get_running_loop().run_in_executor(None, release.wait)
        return await call

    results: list[fv.Video] = []
    other = threading.Thread(target=lambda: results.append(asyncio.run(hold())))
    other.start()
    started.wait(timeout=60)
    try:
        with pytest.raises(RuntimeError, match="busy on another event loop"):
            gen.generate("a blue bird")
    finally:
        release.set()
        other.join()
    assert torch.equal(results[0].frames, alone("a red fox", steps=3))  # the call in flight was not disturbed


def test_a_call_arriving_while_the_last_one_stops_the_engine_runs(gen: fv.VideoGenerator,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    real_stop = gen.engine.stop
    stopping, release = asyncio.Event(), asyncio.Event()

    async def slow_stop() -> None:
        stopping.set()
        await release.wait()
        await real_stop()

    monkeypatch.setattr(gen.engine, "stop", slow_stop)

    async def main() -> tuple[fv.Video, fv.Video]:
        first = asyncio.create_task(gen.agenerate("a red fox", steps=2))
        await stopping.wait()  # the first call is done and is stopping the engine
        second = asyncio.create_task(gen.agenerate("a blue bird", steps=2))
        await asyncio.sleep(0.01)
        release.set()
        return await asyncio.wait_for(asyncio.gather(first, second), timeout=60)

    first, second = asyncio.run(main())
    assert torch.equal(second.frames, alone("a blue bird", steps=2)) and torch.equal(first.frames, alone("a red fox", steps=2))
    assert gen.engine._scheduler_task is None


def test_load_loads_the_plain_tasks_weights(gen: fv.VideoGenerator) -> None:
    needed = gen.card.checkpoint.components_for(TaskType.TEXT_TO_VIDEO)
    assert needed and set(needed) <= set(gen.instance.components)
    assert not build_instance(toy_card("toy-dit")).components  # (an instance built without preloading has none)


def test_generate_works_inside_a_running_event_loop(gen: fv.VideoGenerator) -> None:
    async def notebook_cell() -> fv.Video:
        return gen.generate("a red fox", seed=7)

    assert torch.equal(asyncio.run(notebook_cell()).frames, alone("a red fox", seed=7))


# --------------------------------------------------------------------------- streaming


def test_stream_yields_typed_events_in_order_and_ends_with_the_result(gen: fv.VideoGenerator) -> None:
    events = list(gen.stream("a red fox", seed=7, steps=3))
    types = [e.type for e in events]
    assert types[:2] == ["request.queued", "request.started"]
    assert types[-3:] == ["artifact.ready", "request.completed", "finished"]
    finished = events[-1]
    assert isinstance(finished, fv.Finished) and torch.equal(finished.video.frames, alone("a red fox", seed=7, steps=3))
    assert [e.seq for e in events[:-1]] == list(range(len(events) - 1))
    progress = [(e.loop_id, e.step) for e in events if e.type == "progress"]
    assert [s for loop, s in progress if loop == "denoise"] == [1, 2, 3]
    assert progress.index(("denoise", 3)) < progress.index(("decode", 1))
    chunks = [e for e in events if e.type == "media.chunk"]
    assert chunks and all(c.preview for c in chunks)  # previews are on by default
    assert torch.equal(torch.cat([c.frames for c in chunks]), finished.video.frames)
    quiet = [e.type for e in gen.stream("a red fox", seed=7, steps=3, previews=False)]
    assert "media.chunk" not in quiet and quiet[-1] == "finished"


def test_leaving_a_stream_early_cancels_its_request(gen: fv.VideoGenerator) -> None:
    threads = threading.active_count()
    for event in gen.stream("a red fox", steps=50):
        if event.type == "progress" and event.loop_id == "denoise":
            break
    assert gen.engine.metrics.cancelled == 1 and gen.engine.metrics.completed == 0
    assert threading.active_count() == threads and gen.engine._scheduler_task is None


def test_astream_is_the_same_stream_on_the_callers_loop(gen: fv.VideoGenerator) -> None:
    async def main() -> list[Any]:
        return [e async for e in gen.astream("a red fox", seed=7, steps=3)]

    events = asyncio.run(main())
    assert [e.type for e in events] == [e.type for e in gen.stream("a red fox", seed=7, steps=3)]
    assert torch.equal(events[-1].video.frames, alone("a red fox", seed=7, steps=3))


def test_a_failed_request_raises_after_its_failed_event(gen: fv.VideoGenerator, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    op = gen.instance.op("dit_forward")  # the toy's denoiser; make it produce NaN (the engine checks outputs)

    def nan_forward(inputs: Any, params: Any) -> dict[str, torch.Tensor]:
        return {name: torch.full_like(out, float("nan")) for name, out in op.fn(inputs, params).items()}

    monkeypatch.setitem(gen.instance._ops, "dit_forward", dataclasses.replace(op, fn=nan_forward))
    seen: list[str] = []
    with pytest.raises(StepFailed, match="failed: .*NaN"):
        for event in gen.stream("a red fox"):
            seen.append(event.type)
    assert seen[-1] == "request.failed" and "finished" not in seen
    with pytest.raises(StepFailed):
        gen.generate("a red fox")


# --------------------------------------------------------------------------- bad input: one typed error


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"stesp": 3}, "stesp", "is not an option of generate; allowed: allow_outside_envelope, exact, fps, frames"),
        ({"steps": 0}, "steps", "greater than 0"),
        ({"steps": "two"}, "steps", "valid integer"),
        ({"steps": 11}, "steps", "11 exceeds this deployment's limit; allowed: <= 10"),  # the config's limit (below)
        ({"height": -8}, "height", "greater than 0"),
        ({"height": 10}, "height", "allowed: multiples of 4"),
        ({"frames": 4}, "frames", "allowed: 2k+1"),
        ({"seed": -1}, "seed", "greater than or equal to 0"),
        ({"precision": "fp64"}, "precision", "'fp32'"),
        ({"precision": "bf16"}, "precision", ""),
        ({"task": "nosuch"}, "task", "'nosuch' is not a task"),
        ({"task": "image_to_video"}, "task", "cannot run 'image_to_video'; allowed: text_to_image, text_to_video"),
        ({"image": 3}, "task", "cannot run 'image_to_video'"),
        ({"sampler": "nosuch"}, "sampler", "allowed:"),
        ({"negative_prompt": 5}, "negative_prompt", "valid string"),
        ({"upsample_prompt": True}, "upsample_prompt", "no reasoner"),
    ],
)
def test_bad_options_are_one_typed_error_naming_the_field(toy_file: Path, fv_host: PluginHost, kwargs: dict[str, Any],
                                                          field: str, fragment: str) -> None:
    from fv_kernel.model.validate import RequestLimits

    gen = fv.load(str(toy_file), host=fv_host, config=DeployConfig(limits=RequestLimits(max_steps=10)))
    recorder = StepRecorder()
    gen.engine.observers.append(recorder)
    for call in (lambda: gen.generate("a red fox", **kwargs), lambda: gen.generate(PROMPTS, **kwargs),
                 lambda: gen.stream("a red fox", **kwargs), lambda: asyncio.run(gen.agenerate("a red fox", **kwargs))):
        with pytest.raises(InvalidRequest) as info:
            call()
        assert info.value.param == field, info.value.message
        assert info.value.message.startswith(f"{field}: ") and fragment in info.value.message
        assert "\n" not in info.value.message
    assert not recorder.records and gen.engine.metrics.completed == 0  # refused before anything ran


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [("", "needs a prompt"), ("   ", "needs a prompt"), (3, "expected text"), ([], "list of prompts is empty"),
     (["a fox", ""], "needs a prompt"), (["a fox", None], "item 1 of the list is a NoneType, expected text")],
)
def test_bad_prompts_are_typed_errors_and_a_bad_one_in_a_list_starts_none(gen: fv.VideoGenerator, prompt: Any,
                                                                          fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=fragment) as info:
        gen.generate(prompt)
    assert info.value.param == "prompt" and gen.engine.metrics.completed == 0


def test_a_task_that_makes_no_video_is_refused(tmp_path: Path, fv_host: PluginHost) -> None:
    omni = fv.load(str(_card_file(tmp_path, "toy-omni")), host=fv_host)
    with pytest.raises(InvalidRequest, match="'text_generation' of 'toy-omni' makes no video; allowed: text_to_image, "
                                             "text_to_video") as info:
        omni.generate("a fox", task="text_generation")
    assert info.value.param == "task"
    # The card's other artifacts ride along: here the rewritten prompt as text.
    video = omni.generate("a fox", upsample_prompt=True, max_tokens=4, steps=2)
    assert [a.kind for a in video.artifacts] == ["text", "video"] and video.artifacts[1] is video.artifact


# --------------------------------------------------------------------------- load: what fv generate --model takes


def test_load_takes_a_plugins_card_id_and_the_plugins_default(fv_host: PluginHost, register_plugin: Any) -> None:
    with pytest.raises(InvalidRequest, match="no model given and no enabled plugin names a default card; allowed: none"):
        fv.load(host=fv_host)

    class ToyPlugin:
        @hookimpl
        def fv_register_model_cards(self, register: Any) -> None:
            register("toy-dit", toy_card("toy-dit"))

        @hookimpl
        def fv_default_model(self) -> str:
            return "toy-dit"

    register_plugin(ToyPlugin(), name="fv-toyplugin")
    by_id, by_default = fv.load("toy-dit", host=fv_host), fv.load(host=fv_host)
    assert by_id.model_id == by_default.model_id == "toy-dit"
    assert torch.equal(by_default.generate("a fox", seed=1).frames, alone("a fox", seed=1))
    with pytest.raises(InvalidRequest, match="unknown card 'nosuch'; allowed: toy-dit") as info:
        fv.load("nosuch", host=fv_host)
    assert info.value.param == "model"


@pytest.mark.parametrize("facade_preflight", [True, False])
def test_load_refuses_weights_that_do_not_fit_before_building_anything(
    tmp_path: Path, fv_host: PluginHost, monkeypatch: pytest.MonkeyPatch, facade_preflight: bool
) -> None:
    import fv_kernel.model.preflight as preflight_module
    import fv_kernel.facade
    import fv_kernel.testing.toy as toy
    from fv_kernel.model.preflight import InsufficientMemory
    from test_preflight import counted_card  # a toy card whose components declare 24,000 bytes of weights

    path = tmp_path / "counted.json"
    path.write_text(counted_card().model_dump_json())
    monkeypatch.setattr(preflight_module, "device_available_bytes", lambda device: 10_000)
    factory_calls: list[str] = []
    real_factory = toy.build_toy_instance
    monkeypatch.setattr(toy, "build_toy_instance", lambda card, options: factory_calls.append(card.model_id) or
                        real_factory(card, options))
    if not facade_preflight:  # negative control: without load's own check the card's factory runs first
        monkeypatch.setattr(fv_kernel.facade, "preflight", lambda *args, **kwargs: None)
    with pytest.raises(InsufficientMemory, match="needs 23.4 KiB for its weights .* only 9.8 KiB is available"):
        fv.load(str(path), host=fv_host)
    assert factory_calls == ([] if facade_preflight else ["toy-dit"])


def test_a_single_prompt_runs_inside_the_plugins_generate_wrappers(gen: fv.VideoGenerator, register_plugin: Any) -> None:
    wrapped: list[str] = []

    class Timer:
        @hookimpl(wrapper=True)
        def fv_wrap_generate(self, request: Request) -> Any:
            result = yield
            wrapped.append(f"{request.request_id}:{result.status}")
            return result

    register_plugin(Timer(), name="fv-timer", host=gen.host)
    video = gen.generate("a red fox")
    assert wrapped == [f"{video.request_id}:completed"]
    gen.generate(PROMPTS[:2])  # a list is not one blocking request: the wrappers do not see it
    assert wrapped == [f"{video.request_id}:completed"]


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"device": "tpu"}, "device", "'tpu' is not a torch device; allowed: cpu, cuda"),
        ({"device": "cuda:0"} if not torch.cuda.is_available() else {"device": "tpu:0"}, "device", ""),
        ({"precision": "fp64"}, "precision", "'fp64' is not a precision; allowed: fp32, bf16"),
        ({"precision": "bf16"}, "precision", "does not support 'bf16'; allowed: fp32"),
    ],
)
def test_load_errors_are_typed_and_name_the_field(toy_file: Path, fv_host: PluginHost, kwargs: dict[str, Any],
                                                  field: str, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        fv.load(str(toy_file), host=fv_host, **kwargs)
    assert info.value.param == field and fragment in info.value.message


def test_load_reads_the_deploy_config_file_and_its_card_entry(tmp_path: Path, toy_file: Path, fv_host: PluginHost) -> None:
    config = tmp_path / "deploy.yaml"
    config.write_text(f"cards: [{{model: {json.dumps(str(toy_file))}, device: tpu}}]\nlimits: {{max_steps: 2}}\n")
    with pytest.raises(InvalidRequest, match="device: 'tpu'"):  # the entry's options apply to this model...
        fv.load(str(toy_file), config=config, host=fv_host)
    gen = fv.load(str(toy_file), config=str(config), host=fv_host, device="cpu")  # ...and the caller's win
    with pytest.raises(InvalidRequest, match="steps"):
        gen.generate("a fox", steps=3)
    config.write_text("cards: []\nnosuch: 1\n")
    with pytest.raises(DeployConfigError, match="nosuch"):
        fv.load(str(toy_file), config=config, host=fv_host)


# --------------------------------------------------------------------------- saving


def test_save_writes_every_format_by_suffix(gen: fv.VideoGenerator, tmp_path: Path) -> None:
    from PIL import Image

    video = gen.generate("a red fox", seed=7)
    assert video.save(tmp_path / "nested" / "fox.pt") == tmp_path / "nested" / "fox.pt"
    assert torch.equal(torch.load(tmp_path / "nested" / "fox.pt"), video.frames)
    video.save(str(tmp_path / "fox.png"))
    with Image.open(tmp_path / "fox.png") as png:
        assert png.size == (8, 8)
    video.save(tmp_path / "fox.gif")
    with Image.open(tmp_path / "fox.gif") as gif:
        assert gif.n_frames == 3 and gif.info["duration"] == 120 and gif.info["loop"] == 0
    av = pytest.importorskip("av")
    video.save(tmp_path / "fox.mp4")
    with av.open(str(tmp_path / "fox.mp4")) as container:
        stream = container.streams.video[0]
        assert sum(1 for _ in container.decode(stream)) == 3 and float(stream.average_rate) == 8.0


def test_an_mp4_carries_the_sound_track_and_other_formats_the_frames(tmp_path: Path) -> None:
    av = pytest.importorskip("av")
    from fv_kernel.api import AudioArtifact, Provenance, VideoArtifact

    made = Provenance(model_id="toy", loop_id="decode", request_id="r1")
    frames = torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    picture = VideoArtifact(frames=frames, fps=8.0, provenance=made)
    sound = AudioArtifact(samples=torch.zeros(1, 16_000), sample_rate=16_000, provenance=made)
    video = fv.Video(artifact=picture, artifacts=(picture, sound))
    assert video.audio is sound and fv.Video(artifact=picture, artifacts=(picture,)).audio is None
    with av.open(str(video.save(tmp_path / "with-sound.mp4"))) as container:
        (track,) = container.streams.audio
        assert track.codec_context.name == "aac" and float(track.duration * track.time_base) == pytest.approx(1.0, abs=0.05)
    assert torch.equal(torch.load(video.save(tmp_path / "frames.pt")), frames)  # frames only, no refusal
    video.save(tmp_path / "frames.gif")
    with av.open(str(fv.Video(artifact=picture, artifacts=(picture,)).save(tmp_path / "silent.mp4"))) as container:
        assert not container.streams.audio


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("fox.mov", "path: unsupported suffix '.mov'"),
        ("fox", "path: unsupported suffix '(none)'"),
        ("a-file/fox.mp4", "is not a directory"),
        ("a-dir.mp4", "is a directory"),
        ("/proc/fox.mp4", "cannot create files in '/proc'"),
    ],
)
def test_save_checks_the_path_before_encoding(gen: fv.VideoGenerator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              name: str, fragment: str) -> None:
    video = gen.generate("a red fox")
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-dir.mp4").mkdir()
    encoded: list[str] = []
    monkeypatch.setattr("fv_kernel.io.media.frames_to_uint8", lambda frames: encoded.append("x"))
    with pytest.raises(MediaError, match=re.escape(fragment)) as info:
        video.save(tmp_path / name if not name.startswith("/") else name)
    assert info.value.param == "path" and not encoded


def test_the_path_check_would_catch_a_writer_that_fails_late(tmp_path: Path) -> None:
    # Negative control: without the check, writing into a file's "directory" fails inside the
    # writer with an untyped OSError, which is what the check exists to pre-empt.
    from fv_kernel.io.media import write_tensor

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(OSError):
        write_tensor(torch.zeros(1, 3, 2, 2), tmp_path / "a-file" / "x.pt")
    with pytest.raises(MediaError):
        check_output_path(tmp_path / "a-file" / "x.pt", (".pt",))
    assert check_output_path(tmp_path / "new" / "x.PT", (".pt",)) == tmp_path / "new" / "x.PT"
    assert not (tmp_path / "new").exists()  # the check creates nothing


def test_request_is_the_validated_request_a_call_runs(gen: fv.VideoGenerator) -> None:
    request = gen.request("a red fox", seed=3, negative_prompt="blurry")
    assert (request.diffusion.steps, request.diffusion.height, request.diffusion.seed) == (4, 8, 3)  # defaults filled
    assert request.text("negative_prompt") == "blurry" and request.task is TaskType.TEXT_TO_VIDEO
    assert gen.request("a red fox", negative_prompt="").text("negative_prompt") is None  # as the CLI drops ""
    assert gen.engine.metrics.completed == 0 and gen.engine._scheduler_task is None  # nothing ran


def test_errors_are_fv_errors(gen: fv.VideoGenerator) -> None:
    # Callers can catch one base class for everything the façade refuses.
    with pytest.raises(FvError):
        gen.generate("a red fox", steps=-1)
