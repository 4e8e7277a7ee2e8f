"""Dynamo payloads become fv Requests; bad ones get exactly fv serve's status and body."""

from __future__ import annotations


import pytest
from fastapi.testclient import TestClient

from fv_kernel.api import DeployConfig, TaskType
from fv_kernel.serving import create_app
from fv_dynamo.requests import FleetRequestError, image_requests, video_request

BAD_VIDEO_FIELDS = [
    {"steps": 0},
    {"steps": "many"},
    {"size": "100x64"},
    {"size": "wide"},
    {"frames": 8},
    {"frames": 9, "seconds": 1},
    {"guidance": -1},
    {"bogus": 1},
    {"extensions": {"dbcache": {}}},
    {"model": "no-such-card"},
]


def _dynamo_payload(fields: dict) -> dict:
    """What Dynamo's frontend sends the worker: OpenAI fields on top, the rest under the passthrough."""
    top = {k: fields[k] for k in ("model", "size", "seconds") if k in fields}
    rest = {k: v for k, v in fields.items() if k not in top}
    return {"model": "wan-tiny", "prompt": "a fox", **top, "extra_args": {"media_passthrough": rest}}


@pytest.fixture(scope="module")
def serve_client(engine, tmp_path_factory):
    config = DeployConfig.model_validate({"cards": ["wan-tiny"], "output_dir": str(tmp_path_factory.mktemp("serve"))})
    with TestClient(create_app(engine, config)) as client:
        yield client


@pytest.mark.parametrize("fields", BAD_VIDEO_FIELDS, ids=lambda f: ",".join(f))
def test_bad_video_fields_are_refused_as_fv_serve_refuses_them(engine, serve_client, fields: dict) -> None:
    served = serve_client.post("/v1/videos", json={"model": "wan-tiny", "prompt": "a fox", **fields})
    assert served.status_code in (400, 404), served.text
    with pytest.raises(FleetRequestError) as refused:
        video_request(engine, _dynamo_payload(fields))
    assert (refused.value.status, refused.value.body) == (served.status_code, served.json())


def test_fv_fields_arrive_through_passthrough_and_nvext(engine) -> None:
    request = video_request(engine, _dynamo_payload({"steps": 3, "seed": 11, "frames": 13, "size": "96x64"}))
    d = request.diffusion
    assert (request.task, d.steps, d.seed, d.frames, d.width, d.height) == (TaskType.TEXT_TO_VIDEO, 3, 11, 13, 96, 64)
    via_nvext = video_request(engine, {"model": "wan-tiny", "prompt": "a fox",
                                       "nvext": {"num_inference_steps": 4, "seed": 5, "num_frames": 9}})
    assert (via_nvext.diffusion.steps, via_nvext.diffusion.seed, via_nvext.diffusion.frames) == (4, 5, 9)
    # seconds -> frames by the card's frame rule, as fv serve does (8 fps x 1 s = 8 -> 9, Wan's 4k+1).
    assert video_request(engine, {"model": "wan-tiny", "prompt": "a fox", "seconds": 1}).diffusion.frames == 9
    with pytest.raises(FleetRequestError) as twice:
        video_request(engine, {**_dynamo_payload({"steps": 3}), "nvext": {"num_inference_steps": 4}})
    assert twice.value.body["error"]["param"] == "steps"
    with pytest.raises(FleetRequestError) as top_level:
        video_request(engine, {"model": "wan-tiny", "prompt": "a fox", "steps": 3})  # not where the frontend puts it
    assert top_level.value.body["error"]["type"] == "unknown_field"


def test_images_become_n_requests_with_consecutive_seeds(engine) -> None:
    requests = image_requests(engine, {"model": "wan-tiny", "prompt": "a fox", "n": 3,
                                       "extra_args": {"media_passthrough": {"seed": 40}}})
    assert [r.task for r in requests] == [TaskType.TEXT_TO_IMAGE] * 3
    assert [r.diffusion.seed for r in requests] == [40, 41, 42]
    with pytest.raises(FleetRequestError) as refused:
        image_requests(engine, {"model": "wan-tiny", "prompt": "a fox", "n": 9})
    assert refused.value.body["error"]["param"] == "n"
