"""On CUDA the decode op hands each step's frames back in pinned host memory, copied non-blocking;
the Engine waits for a batch's device work before any output is read, and so does ``run_local``,
so the video either returns is the one the device decoded (the same request on the CPU, within
float tolerance). Needs CUDA."""

from __future__ import annotations

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
    """Half a second of device work is queued between each decode's kernels and its frames' copy
    to pinned host memory (the VAE's ``decode_step`` sleeps on the device before returning), so a
    loop that reads the frames as soon as the op returns reads a buffer not yet written.

    Queuing the work before the op instead did not show the race on the H200 (2026-12-02): some
    step inside the op waited for the device. A first request of the same shapes with another
    prompt and seed leaves its frames in torch's pinned-memory cache, so a recycled block holds
    other frames, not these."""

    def request(prompt: str, seed: int) -> Request:
        return Request(request_id=f"r{seed}", model="wan-tiny", task=TaskType.TEXT_TO_VIDEO,
                       inputs=(TextPart(text=prompt),),
                       diffusion=DiffusionParams(height=64, width=64, frames=9, steps=2, seed=seed))

    def video(req: Request, slow: bool) -> torch.Tensor:
        instance = build_instance(TINY, InstanceOptions(device="cuda", precision="fp32"))
        if slow:
            vae = instance.component("vae_decoder")
            decode_step = vae.decode_step

            def slow_decode_step(*args, **kwargs):  # type: ignore[no-untyped-def]
                out = decode_step(*args, **kwargs)
                torch.cuda._sleep(1_000_000_000)  # ~0.5 s of device time before the op's copy to the host
                return out

            vae.decode_step = slow_decode_step
        (artifact,) = [a for a in run_local(req, instance) if a.kind == "video"]
        return artifact.frames

    video(request("a red ball rolls", 3), slow=False)
    target = request("a green kite over a windy beach", 7)
    got = video(target, slow=True)
    torch.testing.assert_close(got, video(target, slow=False), atol=1e-4, rtol=0)
