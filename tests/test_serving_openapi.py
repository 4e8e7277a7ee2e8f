"""``/openapi.json`` describes the API as it behaves, checked two ways.

Statically: both POSTs declare their bodies from the pydantic models that validate them,
each route lists the statuses it really returns (no FastAPI 422: validation answers 400),
``/metrics`` is text. Dynamically: schemathesis generates requests from the document (valid
and invalid ones, a bounded, derandomized number per operation) against a real server over
a tiny toy card and checks every answer against the document: no 5xx, only documented
statuses, content types and bodies, 405s that list the allowed methods.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
schemathesis = pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from fv_kernel.model.instance import build_instance  # noqa: E402
from fv_kernel.model.validate import RequestLimits  # noqa: E402
from fv_kernel.config import DeployConfig, ServerConfig  # noqa: E402
from fv_kernel.runtime.engine import Engine  # noqa: E402
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.serving import ServerThread, create_app  # noqa: E402
from fv_kernel.serving.schemas import JOB_ID_PATTERN, ImageGenerate, VideoCreate  # noqa: E402
from fv_kernel.testing.toy import toy_card  # noqa: E402

#: Examples per operation: enough to reach every field's bounds, few enough for a CPU CI run.
EXAMPLES = 15
#: Seconds one call may take: a synchronous image call can wait behind the video jobs earlier examples queued.
CALL_TIMEOUT_S = 300


def toy_app(output_dir: Path, *, max_queue: int = 256, **config: Any) -> Any:
    card = toy_card("toy-dit")
    d = card.capabilities.defaults
    assert d is not None
    # Limits at the toy's defaults keep every accepted request to a few milliseconds of compute.
    limits = RequestLimits(max_frames=d.frames, max_pixels=d.width * d.height, max_steps=d.steps)
    deploy = DeployConfig(output_dir=output_dir, limits=limits, server=ServerConfig(max_body_bytes=256 * 1024), **config)
    engine = Engine(SchedulerConfig(max_queue=max_queue), limits=deploy.limits)
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
    assert len(operations) == 13
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


# --------------------------------------------------------------------------- schemathesis run (CLI)

#: ``schemathesis run``'s settings: every check, the coverage phase (each field's boundaries and
#: the values just past them: empty strings, wrong JSON types, unlisted enum values) and the
#: stateful phase (links: a created job's id into its /content, /events, /cancel). Positive data
#: acceptance is off for the two POST bodies only: a body the card-independent document allows
#: may still break the served card's rules (its size multiple, the deployment's limits), which
#: are 400s by design, each naming the field (tests/test_serving.py). Fuzzing is
#: test_the_api_matches_its_document's part.
RUN_CONFIG = """
seed = 1
workers = 1
request-timeout = 300
[checks]
enabled = true
[generation]
max-examples = 5
[phases.examples]
enabled = false
[phases.fuzzing]
enabled = false
[[operations]]
include-method = "POST"
checks.positive_data_acceptance.enabled = false
"""


def schemathesis_run(location: str, config: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "schemathesis.toml"
    path.write_text(config)
    return subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "--config-file", str(path), "run", location, "--no-color", *args],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )


@pytest.fixture(scope="module")
def quick_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """A server whose queue holds 2 jobs: the run's POSTs past that are 429s (documented), not compute."""
    server = ServerThread(toy_app(tmp_path_factory.mktemp("openapi-run") / "out", max_queue=2)).start()
    try:
        yield server
    finally:
        server.stop()


def test_schemathesis_run_finds_no_mismatch(quick_server: ServerThread, tmp_path: Path) -> None:
    result = schemathesis_run(f"{quick_server.url}/openapi.json", RUN_CONFIG, tmp_path)
    summary = result.stdout[-6000:]
    assert result.returncode == 0, summary
    assert re.search(r"(\d+) generated, \1 passed", summary), summary
    assert "Coverage" in summary and "Stateful" in summary


def test_schemathesis_run_catches_the_documents_old_mistakes(quick_server: ServerThread, tmp_path: Path) -> None:
    """Negative control: the document as it was (``after`` any string, each event a string) fails
    the same run on exactly those operations."""
    job = httpx.post(f"{quick_server.url}/v1/videos", json={"prompt": "a toy"}).json()["id"]
    doc = httpx.get(f"{quick_server.url}/openapi.json").json()
    paths = doc["paths"]
    after = next(p for p in paths["/v1/videos"]["get"]["parameters"] if p["name"] == "after")
    after["schema"] = {"anyOf": [{"type": "string"}, {"type": "null"}]}
    paths["/v1/videos/{video_id}/events"]["get"]["responses"]["200"]["content"]["text/event-stream"]["schema"] = {"type": "string"}
    (tmp_path / "old.json").write_text(json.dumps(doc))
    config = RUN_CONFIG.replace("[phases.examples]", f'[parameters]\n"path.video_id" = "{job}"\n[phases.examples]')
    config = config.replace("[phases.fuzzing]", "[phases.stateful]\nenabled = false\n[phases.fuzzing]")
    result = schemathesis_run(
        str(tmp_path / "old.json"), config, tmp_path, "--url", quick_server.url, "--max-failures", "2",
        "--include-name-regex", r"^GET /v1/videos(/\{video_id\}/events)?$",
    )
    out = result.stdout
    assert result.returncode != 0, out[-3000:]
    failures = out.split("FAILURES", 1)[-1]
    for operation in ("GET /v1/videos ", "GET /v1/videos/{video_id}/events"):
        assert operation in failures, out[-6000:]
    assert "Schema-valid request rejected" in failures and "SSE event violates schema" in failures


# --------------------------------------------------------------------------- what the run found, one by one


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    with TestClient(toy_app(tmp_path_factory.mktemp("openapi-client") / "out")) as c:
        yield c


def _error(answer: Any, status: int, param: str) -> str:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


def test_swagger_ui_is_served_and_counted_by_route(client: Any) -> None:
    page = client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "swagger-ui" in page.text.lower() and "/openapi.json" in page.text
    assert client.get("/openapi.json").status_code == 200
    client.get("/no/such/path")
    metrics = client.get("/metrics").text
    assert 'route="/openapi.json",status="200"' in metrics and 'route="/docs",status="200"' in metrics
    assert 'route="unmatched",status="404"' in metrics  # a real miss still shares the one label


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/images/generations", {"prompt": "x", "guidance": False}, "guidance"),
    ("/v1/images/generations", {"prompt": "x", "exact": 0}, "exact"),
    ("/v1/images/generations", {"prompt": "x", "steps": "4"}, "steps"),
    ("/v1/images/generations", {"prompt": "x", "n": True}, "n"),
    ("/v1/videos", {"prompt": "x", "exact": 1}, "exact"),
    ("/v1/videos", {"prompt": "x", "frames": True}, "frames"),
    ("/v1/videos", {"prompt": "x", "guidance": "3"}, "guidance"),
])
def test_json_values_have_the_documents_types(client: Any, path: str, body: dict[str, Any], param: str) -> None:
    """``false`` is no number and ``0`` no boolean, as the document says (pydantic's lax mode took both)."""
    message = _error(client.post(path, json=body), 400, param)
    assert message.startswith(f"{param}: ")


def test_the_schemas_are_strict_for_every_caller() -> None:
    """Strictness lives in the models, so a caller validating JSON itself (fv-dynamo's worker) refuses the same."""
    from pydantic import ValidationError

    for model in (VideoCreate, ImageGenerate):
        with pytest.raises(ValidationError, match="exact"):
            model.model_validate({"prompt": "x", "exact": 0})
        with pytest.raises(ValidationError, match="guidance"):
            model.model_validate({"prompt": "x", "guidance": False})
        assert model.model_validate({"prompt": "x", "steps": "4"}, strict=False).steps == 4  # form text


def test_json_takes_integers_for_numbers_and_forms_take_text(client: Any) -> None:
    ok = client.post("/v1/videos", json={"prompt": "x", "guidance": 3, "exact": True})
    assert ok.status_code == 200, ok.text
    # OpenAI's SDK sends seconds as text ("4"): the document allows it, and so does the server.
    seconds = client.get("/openapi.json").json()["components"]["schemas"]["VideoCreate"]["properties"]["seconds"]
    assert {"type": "string", "pattern": r"^[0-9]{1,4}(\.[0-9]{1,6})?$"} in seconds["anyOf"]
    text = client.post("/v1/videos", json={"prompt": "x", "seconds": "0.25"})
    assert text.status_code == 200, text.text
    assert "seconds: " in _error(client.post("/v1/videos", json={"prompt": "x", "seconds": "4s"}), 400, "seconds")
    form = client.post("/v1/videos", data={"prompt": "x", "guidance": "3", "exact": "true"})
    assert form.status_code == 200, form.text


@pytest.mark.parametrize("multipart", [False, True])
def test_an_empty_form_field_is_an_absent_one(client: Any, multipart: bool) -> None:
    """HTML forms send every field; an empty ``extensions`` or ``input_reference`` means none."""
    fields = {"prompt": "x", "extensions": "", "input_reference": ""}
    if multipart:
        answer = client.post("/v1/videos", files={k: (None, v) for k, v in fields.items()})
    else:
        answer = client.post("/v1/videos", data=fields)
    assert answer.status_code == 200, answer.text
    assert answer.json()["task"] == "text_to_video"


def test_list_after_and_content_variant_are_documented_as_checked(client: Any) -> None:
    from fv_kernel.serving.media import VARIANTS

    doc = client.get("/openapi.json").json()
    params = {p["name"]: p["schema"] for p in doc["paths"]["/v1/videos"]["get"]["parameters"]}
    after = next(o for o in params["after"]["anyOf"] if o.get("type") == "string")
    assert after["pattern"] == JOB_ID_PATTERN.pattern
    assert "after: " in _error(client.get("/v1/videos", params={"after": ""}), 400, "after")
    content = {p["name"]: p["schema"] for p in doc["paths"]["/v1/videos/{video_id}/content"]["get"]["parameters"]}
    assert set(content["variant"]["enum"]) == set(VARIANTS)
    job = client.post("/v1/videos", json={"prompt": "x"}).json()["id"]
    message = _error(client.get(f"/v1/videos/{job}/content", params={"variant": "spritesheet"}), 400, "variant")
    assert "'video'" in message and "'thumbnail'" in message


def test_each_event_a_job_streams_matches_the_documented_event(client: Any) -> None:
    import jsonschema

    doc = client.get("/openapi.json").json()
    schema = doc["paths"]["/v1/videos/{video_id}/events"]["get"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    # The event names are the ones docs/serving.md's table lists (a reference apart from the code).
    table = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `((?:video|server)\.[a-z_]+)`", table, re.M)) | set(
        re.findall(r"`(video\.(?:completed|failed|cancelled))`", table))
    assert set(schema["properties"]["event"]["enum"]) == documented
    job = client.post("/v1/videos", json={"prompt": "x"}).json()["id"]
    with client.stream("GET", f"/v1/videos/{job}/events") as stream:
        text = "".join(stream.iter_text())
    events = []
    for block in text.strip().split("\n\n"):
        event = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        if event:
            events.append(event)
    assert events[0]["event"] == "video.queued" and events[-1]["event"] == "video.completed"
    for event in events:
        jsonschema.validate(event, schema)
        json.loads(event["data"])
    with pytest.raises(jsonschema.ValidationError):  # the old document: every event "a string"
        jsonschema.validate(events[0], {"type": "string"})
