"""``/openapi.json`` describes the API as it behaves, checked two ways.

Statically: both POSTs declare their bodies from the pydantic models that validate them,
each route lists the statuses it really returns (no FastAPI 422: validation answers 400),
``/metrics`` is text. Dynamically: schemathesis generates requests from the document (valid
and invalid ones, a bounded, derandomized number per operation) against a real server over
a tiny toy card and checks every answer against the document: no 5xx, only documented
statuses, content types and bodies, 405s that list the allowed methods.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from fv_kernel.model.instance import build_instance  # noqa: E402
from fv_kernel.model.validate import RequestLimits  # noqa: E402
from fv_kernel.config import DeployConfig, ServerConfig  # noqa: E402
from fv_kernel.runtime.engine import Engine  # noqa: E402
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.serving import ServerThread, create_app  # noqa: E402
from fv_kernel.serving.schemas import ImageGenerate, VideoCreate  # noqa: E402
from fv_kernel.testing.toy import toy_card  # noqa: E402

#: Examples per operation: enough to reach every field's bounds, few enough for a CPU CI run.
EXAMPLES = 15
#: Seconds one call may take: a synchronous image call can wait behind the video jobs earlier examples queued.
CALL_TIMEOUT_S = 300


def toy_app(output_dir: Path, **config: Any) -> Any:
    card = toy_card("toy-dit")
    d = card.capabilities.defaults
    assert d is not None
    # Limits at the toy's defaults keep every accepted request to a few milliseconds of compute.
    limits = RequestLimits(max_frames=d.frames, max_pixels=d.width * d.height, max_steps=d.steps)
    deploy = DeployConfig(output_dir=output_dir, limits=limits, server=ServerConfig(max_body_bytes=256 * 1024), **config)
    engine = Engine(SchedulerConfig(), limits=deploy.limits)
    engine.add_instance(build_instance(card))
    return create_app(engine, deploy)


def document(tmp_path: Path, **config: Any) -> dict[str, Any]:
    return toy_app(tmp_path / "out", **config).openapi()


def test_post_bodies_come_from_the_validating_models(tmp_path: Path) -> None:
    doc = document(tmp_path)
    schemas = doc["components"]["schemas"]
    videos = doc["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
    assert videos["application/json"]["schema"] == {"$ref": "#/components/schemas/VideoCreate"}
    assert schemas["VideoCreate"] == VideoCreate.model_json_schema(ref_template="#/components/schemas/{model}")
    multipart = schemas[videos["multipart/form-data"]["schema"]["$ref"].rsplit("/", 1)[1]]
    assert set(multipart["properties"]) == set(VideoCreate.model_fields)
    assert multipart["properties"]["input_reference"]["format"] == "binary"
    assert multipart["additionalProperties"] is False and multipart["required"] == ["prompt"]
    images = doc["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"]
    assert list(images) == ["application/json"]
    assert schemas["ImageGenerate"] == ImageGenerate.model_json_schema(ref_template="#/components/schemas/{model}")


def test_statuses_are_the_ones_the_api_returns(tmp_path: Path) -> None:
    doc = document(tmp_path)
    responses = {(method.upper(), path): set(op["responses"]) for path, item in doc["paths"].items() for method, op in item.items()}
    assert all("422" not in codes for codes in responses.values()), "validation errors are 400s"
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    assert responses[("POST", "/v1/videos")] == {"200", "400", "404", "413", "415", "429"}
    assert responses[("POST", "/v1/images/generations")] >= {"200", "400", "404", "413", "415", "429"}
    assert responses[("POST", "/v1/videos/{video_id}/cancel")] == {"200", "400", "404", "409"}
    assert responses[("GET", "/v1/videos/{video_id}/content")] == {"200", "400", "404", "409"}
    assert responses[("GET", "/health")] == {"200"}
    error = doc["paths"]["/v1/videos"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(doc["components"]["schemas"]["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    content = doc["paths"]["/v1/videos/{video_id}/content"]["get"]["responses"]["200"]["content"]
    assert set(content) == {"video/mp4", "image/png"}
    # With an API key every route but /health can answer 401.
    keyed = document(tmp_path / "keyed", api_key="k")
    for path, item in keyed["paths"].items():
        for op in item.values():
            assert ("401" in op["responses"]) == (path != "/health"), path


# --------------------------------------------------------------------------- schemathesis


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    server = ServerThread(toy_app(tmp_path_factory.mktemp("openapi") / "out")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served_schema(served: ServerThread) -> Any:
    return schemathesis.openapi.from_url(f"{served.url}/openapi.json")


def test_the_fuzz_catches_a_route_the_document_misdescribes(served: ServerThread) -> None:
    """Negative control: the old document said /metrics answers JSON; schemathesis must flag that."""
    import httpx
    from schemathesis import checks
    from schemathesis.core.failures import FailureGroup

    doc = httpx.get(f"{served.url}/openapi.json").json()
    doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {"application/json": {"schema": {"type": "object"}}}
    operation = next(r.ok() for r in schemathesis.openapi.from_dict(doc).get_all_operations() if r.ok().label == "GET /metrics")
    case = operation.Case()
    with pytest.raises(FailureGroup) as failure:
        case.call_and_validate(base_url=served.url, checks=[checks.content_type_conformance])
    assert "Undocumented Content-Type" in "".join(traceback.format_exception(failure.value))
    # The served document, unmodified, passes the same check.
    real = httpx.get(f"{served.url}/openapi.json").json()
    operation = next(r.ok() for r in schemathesis.openapi.from_dict(real).get_all_operations() if r.ok().label == "GET /metrics")
    operation.Case().call_and_validate(base_url=served.url, checks=[checks.content_type_conformance])


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_the_api_matches_its_document(served_schema: Any, mode: str) -> None:
    from schemathesis import GenerationMode, checks
    from schemathesis.core.failures import FailureGroup

    failures: list[str] = []
    operations = [result.ok() for result in served_schema.get_all_operations()]
    assert len(operations) == 11
    for operation in operations:
        strategy = operation.as_strategy(generation_mode=GenerationMode(mode))

        @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def check(case: Any) -> None:
            # Every check but positive_data_acceptance: a body the card-independent document allows
            # may still break the served card's rules (its tasks, size multiple, the deployment's
            # limits), which are 400s by design, each naming the field (tests/test_serving.py).
            case.call_and_validate(excluded_checks=[checks.positive_data_acceptance], timeout=CALL_TIMEOUT_S)

        try:
            check()
        except Unsatisfiable:
            # Nothing to make invalid: the operation takes no parameters and no body.
            assert mode == "negative" and not operation.body and not len(operation.query) and not len(operation.path_parameters)
        except (Exception, FailureGroup) as exc:  # noqa: BLE001 - collect every operation's failure, report them all
            failures.append(f"{operation.label}: {''.join(traceback.format_exception(exc))[-4000:]}")
    assert not failures, "\n\n".join(failures)
