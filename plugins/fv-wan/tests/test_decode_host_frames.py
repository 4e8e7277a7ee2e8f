"""On CUDA the decode op hands each step's frames back in pinned host memory, copied non-blocking;
the Engine waits for a batch's device work before any output is read, and so does ``run_local``,
so the video either returns is the one the device decoded (the same request on the CPU, within
float tolerance). Needs CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fv_kernel.api import DiffusionParams, Engine, InstanceOptions, Request, TaskType, TextPart, build_instance
from fv_kernel.runtime.engine import run_concurrently
from fv_kernel.runtime.local import run_local
from fv_wan.cards import wan_cards

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned host copy is CUDA's")

TINY = next(card for card in wan_cards() if card.model_id == "wan-tiny")


def _video(device: str) -> torch.Tensor:
    instance = build_instance(TINY, InstanceOptions(device=device, precision="fp32"))
    engine = Engine()
    engine.add_instance(instance)
    requests = [Request(request_id=f"r{i}", model="wan-tiny", task=TaskType.TEXT_TO_VIDEO,
                        inputs=(TextPart(text="a red ball rolls"),),
                        diffusion=DiffusionParams(height=64, width=64, frames=9, steps=2, seed=i)) for i in range(3)]
    results = run_concurrently(engine, requests)
    assert all(r.status == "completed" for r in results), [r.error for r in results]
    return torch.stack([next(a for a in r.artifacts if a.kind == "video").frames for r in results])


def test_cuda_decode_returns_the_decoded_frames_on_the_host() -> None:
    instance = build_instance(TINY, InstanceOptions(device="cuda", precision="fp32"))
    instance.component("vae_decoder")  # ops are built as components load
    op = instance.op("vae_decode_frame")
    out = op.fn({"z": torch.randn(1, 16, 1, 8, 8, device="cuda")}, {"last": True})
    assert out["frames"].device.type == "cpu" and out["frames"].is_pinned()
    cuda, cpu = _video("cuda"), _video("cpu")
    assert cuda.device.type == "cpu" and cuda.shape == cpu.shape
    torch.testing.assert_close(cuda, cpu, atol=2e-3, rtol=0)


def test_run_local_reads_the_frames_after_the_device_wrote_them() -> None:
    """Each decode is queued behind half a second of device work, after its inputs are on the
    device (a pageable host-to-device copy would wait for the stream and hide the race): a loop
    that reads the pinned frames as soon as the op returns reads a buffer not yet written.
    Its own prompt and seed, so a recycled pinned block cannot hold the right frames by chance."""
    request = Request(request_id="r", model="wan-tiny", task=TaskType.TEXT_TO_VIDEO,
                      inputs=(TextPart(text="a green kite over a windy beach"),),
                      diffusion=DiffusionParams(height=64, width=64, frames=9, steps=2, seed=7))

    def video(slow: bool) -> torch.Tensor:
        instance = build_instance(TINY, InstanceOptions(device="cuda", precision="fp32"))
        build = instance.ops_builder

        def with_slow_decode(inst):  # type: ignore[no-untyped-def]
            ops = build(inst)
            decode = ops["vae_decode_frame"]

            def fn(inputs, params):  # type: ignore[no-untyped-def]
                on_device = {name: tensor.to("cuda") for name, tensor in inputs.items()}
                torch.cuda._sleep(1_000_000_000)  # ~0.5 s of device time ahead of the decode's kernels
                return decode.fn(on_device, params)

            return {**ops, "vae_decode_frame": dataclasses.replace(decode, fn=fn)} if slow else ops

        instance.ops_builder = with_slow_decode
        (artifact,) = [a for a in run_local(request, instance) if a.kind == "video"]
        return artifact.frames

    torch.testing.assert_close(video(slow=True), video(slow=False), atol=1e-4, rtol=0)
