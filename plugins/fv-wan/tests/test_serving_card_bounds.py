"""``fv serve`` over wan-tiny refuses, at submit, what the card cannot compute: the same rules as
``fv generate`` (``resolve_request``), as a 400 naming the field before anything is queued."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
from fastapi.testclient import TestClient  # noqa: E402

from fv_kernel.api import Engine, SchedulerConfig, build_instance  # noqa: E402
from fv_kernel.config import DeployConfig  # noqa: E402
from fv_kernel.serving import create_app  # noqa: E402


def test_wan_tiny_refuses_a_token_grid_beyond_its_rope_table_and_fps_out_of_range(
    wan_card: Callable[..., Any], tmp_path: Path
) -> None:
    card = wan_card("wan-tiny")
    caps = card.capabilities
    rule = caps.token_grid
    grid = rule.grid(caps.defaults.frames, 512, 528)
    axis = ("frames", "height", "width")[max(range(3), key=lambda i: grid[i])]
    assert max(grid) > rule.max_per_axis, "528x512 is beyond the RoPE table (the issue's case)"
    deploy = DeployConfig(output_dir=tmp_path / "out")
    engine = Engine(SchedulerConfig(), limits=deploy.limits)
    engine.add_instance(build_instance(card))
    with TestClient(create_app(engine, deploy)) as client:
        for path in ("/v1/videos", "/v1/images/generations"):
            response = client.post(path, json={"prompt": "a fox", "size": "528x512"})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert (error["type"], error["code"], error["param"]) == ("invalid_request", "invalid_request", axis), error
            assert "token grid" in error["message"]
        response = client.post("/v1/videos", json={"prompt": "a fox", "fps": 0.0001})
        assert response.status_code == 400 and response.json()["error"]["param"] == "fps", response.text
        assert f"{caps.min_fps:g}..{caps.max_fps:g}" in response.json()["error"]["message"]
        assert client.get("/v1/videos").json()["data"] == [], "nothing refused was queued"
