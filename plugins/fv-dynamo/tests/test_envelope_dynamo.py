"""Through Dynamo, the trained envelope refuses and its override runs, as through fv serve (issue 35)."""

from __future__ import annotations

import pytest

from fv_kernel.api import CardCatalog, Engine, PluginHost, build_instance
from fv_dynamo.requests import FleetRequestError, video_request


@pytest.fixture(scope="module")
def toy_engine() -> Engine:
    engine = Engine()
    engine.add_instance(build_instance(CardCatalog(PluginHost()).get("wan-toy")))  # lazy: no weights load to validate
    return engine


def test_seconds_outside_the_envelope_are_refused_and_the_override_passes_through(toy_engine: Engine) -> None:
    payload = {"model": "wan-toy", "prompt": "a red circle moves left quickly on a navy background", "seconds": "4"}
    with pytest.raises(FleetRequestError) as refused:
        video_request(toy_engine, payload)
    assert refused.value.status == 400 and refused.value.body["error"]["param"] == "seconds"
    forced = video_request(toy_engine, {**payload, "extra_args": {"media_passthrough": {"allow_outside_envelope": True}}})
    assert forced.allow_outside_envelope and forced.diffusion.frames == 33
