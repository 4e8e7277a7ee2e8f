"""wan-tiny with ``scheduler.overlap_kinds: [vae_tile]``: the VAE decode on its own device lane.

Requests of different lengths at once: the short ones' decodes run on the overlap lane while the
long ones' denoise steps run on the main lane. Every video is bit for bit the request run alone
on one lane (exact batching: no fused rows on either side). On CUDA each lane runs on its own
stream, which waits for the default stream's work and is synchronized at the end of each batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fv_kernel.api import (
    ComputeOptions,
    DiffusionParams,
    Engine,
    InstanceOptions,
    Request,
    SchedulerConfig,
    TaskType,
    TextPart,
    WorkKind,
    build_instance,
    run_concurrently,
)
from fv_kernel.testing import StepRecorder, assert_artifacts_identical


def _request(index: int, steps: int) -> Request:
    return Request(
        request_id=f"ov{index}", model="wan-tiny", task=TaskType.TEXT_TO_VIDEO,
        inputs=(TextPart(text=f"a fox in the snow, take {index}"),),
        diffusion=DiffusionParams(seed=index, steps=steps, height=32, width=32, frames=9),
    )


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="a lane's own stream is CUDA's")


@pytest.mark.parametrize(("device", "graphs"), [
    ("cpu", False),
    pytest.param("cuda", False, marks=CUDA),
    # The denoise forwards captured as CUDA graphs while the other lane decodes (a thread_local capture).
    pytest.param("cuda", True, marks=CUDA),
])
def test_wan_decodes_on_the_overlap_lane_and_each_video_is_its_own(wan_card: Any, device: str, graphs: bool) -> None:
    options = InstanceOptions(device=device, precision="fp32", compute=ComputeOptions(cuda_graphs=True) if graphs else None)
    instance = build_instance(wan_card("wan-tiny"), options)
    requests = [_request(0, 2), _request(1, 12), _request(2, 4)]
    recorder = StepRecorder()
    engine = Engine(SchedulerConfig(batching="exact", overlap_kinds=(WorkKind.VAE_TILE,)), observers=[recorder])
    engine.add_instance(instance)
    together = run_concurrently(engine, requests)
    assert engine.metrics.overlapped_batches > 0
    assert recorder.of_kind("vae_tile"), "no decode step recorded"
    for request, result in zip(requests, together):
        alone_engine = Engine(SchedulerConfig(batching="exact"))
        alone_engine.add_instance(instance)
        alone = run_concurrently(alone_engine, [request])
        assert_artifacts_identical(result.raise_for_status().artifacts, alone[0].raise_for_status().artifacts,
                                   what=request.request_id)
