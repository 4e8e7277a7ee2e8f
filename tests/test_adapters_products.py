"""Adapters from the products: ``POST/GET /v1/adapters``, ``adapters`` on ``/v1/videos``,
``fv generate --lora FILE[:SCALE]``, ``fv adapters list`` and ``fv.load(...).generate(loras=...)``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from fv_kernel.cache.adapters import AdapterSettings  # noqa: E402
from fv_kernel.cli.generate_cmd import parse_lora_option  # noqa: E402
from fv_kernel.config import DeployConfig, ServerConfig  # noqa: E402
from fv_kernel.deploy.engine import adapter_registry  # noqa: E402
from fv_kernel.errors import InvalidRequest  # noqa: E402
from fv_kernel.model.instance import build_instance  # noqa: E402
from fv_kernel.model.validate import RequestLimits  # noqa: E402
from fv_kernel.runtime.engine import Engine  # noqa: E402
from fv_kernel.runtime.scheduler import SchedulerConfig  # noqa: E402
from fv_kernel.serving import create_app  # noqa: E402
from fv_kernel.testing.adapters import peft_lora_tensors, write_peft_lora  # noqa: E402
from fv_kernel.testing.toy import toy_card  # noqa: E402

CARD = "toy-dit"
TARGETS = ("proj_in", "proj_out", "blocks.0.o")


def lora_file(path: Path, *, seed: int = 0, metadata: dict[str, str] | None = None) -> Path:
    dit = build_instance(toy_card(CARD)).component("dit")
    return write_peft_lora(path, peft_lora_tensors(dit, "dit", TARGETS, rank=2, seed=seed, std=0.5), metadata)


def app_for(tmp_path: Path, *, adapters: AdapterSettings | None) -> tuple[Any, Engine]:
    card = toy_card(CARD)
    d = card.capabilities.defaults
    assert d is not None
    limits = RequestLimits(max_frames=d.frames, max_pixels=d.width * d.height, max_steps=d.steps)
    deploy = DeployConfig(
        output_dir=tmp_path / "out", limits=limits, server=ServerConfig(max_body_bytes=64 * 1024), adapters=adapters,
    )
    engine = Engine(SchedulerConfig(), limits=limits, adapters=adapter_registry(deploy, [card]))
    engine.add_instance(build_instance(card))
    return create_app(engine, deploy), engine


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[TestClient, Engine, Path]]:
    directory = tmp_path / "loras"
    directory.mkdir()
    lora_file(directory / "style.safetensors", seed=1)
    settings = AdapterSettings(directory=directory, upload_directory=tmp_path / "uploads", max_file_bytes=256 * 1024)
    app, engine = app_for(tmp_path, adapters=settings)
    with TestClient(app) as client:
        yield client, engine, tmp_path


def _video(client: TestClient, body: dict[str, Any]) -> torch.Tensor:
    created = client.post("/v1/videos", json=body)
    assert created.status_code == 200, created.text
    job = created.json()
    deadline = time.monotonic() + 60
    while job["status"] not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, job
        time.sleep(0.02)
        job = client.get(f"/v1/videos/{job['id']}").json()
    assert job["status"] == "completed", job
    return torch.tensor(list(client.get(f"/v1/videos/{job['id']}/content", params={"variant": "thumbnail"}).content[:4096]))


def test_directory_adapters_are_listed_without_server_paths(served: tuple[TestClient, Engine, Path]) -> None:
    client, _, tmp_path = served
    listed = client.get("/v1/adapters").json()
    assert [a["name"] for a in listed["data"]] == ["style"]
    entry = listed["data"][0]
    assert entry["components"] == ["dit"] and entry["rank"] == 2 and entry["source"] == "directory"
    assert "path" not in entry and str(tmp_path) not in json.dumps(listed)


def test_an_upload_registers_and_a_request_runs_with_it(served: tuple[TestClient, Engine, Path]) -> None:
    client, engine, tmp_path = served
    data = lora_file(tmp_path / "fresh.safetensors", seed=2).read_bytes()
    answer = client.post("/v1/adapters", files={"file": ("fresh.safetensors", data)}, data={"name": "fresh"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["name"] == "fresh" and answer.json()["source"] == "upload"
    assert engine.adapters is not None and "fresh" in engine.adapters.names()
    base = {"prompt": "a red ball", "seed": 3}
    plain = _video(client, base)
    styled = _video(client, {**base, "adapters": [{"name": "fresh", "scale": 1.0}]})
    silent = _video(client, {**base, "adapters": [{"name": "fresh", "scale": 0.0}]})
    assert not torch.equal(plain, styled)  # the adapter reached the forward
    assert torch.equal(plain, silent)  # strength 0 is no adapter


@pytest.mark.parametrize("filename", ["../evil.safetensors", "sub/x.safetensors", "..\\x.safetensors", "x.bin"])
def test_an_upload_with_a_path_or_another_suffix_is_refused(served: tuple[TestClient, Engine, Path], filename: str) -> None:
    client, _, tmp_path = served
    data = lora_file(tmp_path / "ok.safetensors").read_bytes()
    answer = client.post("/v1/adapters", files={"file": (filename, data)})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "file"
    assert not (tmp_path / "evil.safetensors").exists() and not (tmp_path.parent / "evil.safetensors").exists()


def test_an_upload_over_the_file_limit_is_refused_and_json_keeps_its_own_cap(served: tuple[TestClient, Engine, Path]) -> None:
    client, _, _ = served
    # Larger than the server's 64 KiB body cap but within the adapter limit: not refused for size.
    answer = client.post("/v1/adapters", files={"file": ("junk.safetensors", b"\0" * (128 * 1024))})
    assert answer.status_code == 400 and answer.json()["error"]["type"] != "body_too_large", answer.text
    over = client.post("/v1/adapters", files={"file": ("big.safetensors", b"\0" * (300 * 1024))})
    assert over.status_code == 400 and "adapters.max_file_bytes" in over.json()["error"]["message"], over.text
    too_big = client.post("/v1/adapters", files={"file": ("big.safetensors", b"\0" * (400 * 1024))})
    assert too_big.status_code == 413, too_big.text  # past the upload route's cap: refused before it is read
    json_body = client.post("/v1/videos", content=b"{" + b" " * (100 * 1024) + b"}", headers={"content-type": "application/json"})
    assert json_body.status_code == 413  # the larger cap is the upload route's only


def test_unknown_adapter_names_the_field_with_a_suggestion(served: tuple[TestClient, Engine, Path]) -> None:
    client, _, _ = served
    answer = client.post("/v1/videos", json={"prompt": "x", "adapters": [{"name": "styel"}]})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "unknown_adapter" and error["param"].startswith("adapters")
    assert "'style'" in error["message"]
    bad = client.post("/v1/videos", json={"prompt": "x", "adapters": [{"name": "../x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("adapters.0.name")


def test_without_an_adapters_section_uploads_are_refused_and_the_list_is_empty(tmp_path: Path) -> None:
    app, _ = app_for(tmp_path, adapters=None)
    with TestClient(app) as client:
        assert client.get("/v1/adapters").json()["data"] == []
        data = lora_file(tmp_path / "a.safetensors").read_bytes()
        answer = client.post("/v1/adapters", files={"file": ("a.safetensors", data)})
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "adapters_disabled"
        refused = client.post("/v1/videos", json={"prompt": "x", "adapters": [{"name": "a"}]})
        assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("adapters")


# --------------------------------------------------------------------------- CLI and façade


def test_lora_option_parses_file_and_strength(tmp_path: Path) -> None:
    file = lora_file(tmp_path / "a:b.safetensors")
    assert parse_lora_option(str(file)) == (file, 1.0)
    assert parse_lora_option(f"{file}:0.5") == (file, 0.5)
    assert parse_lora_option(f"{file}:-1") == (file, -1.0)
    with pytest.raises(InvalidRequest, match="lora.*no such file"):
        parse_lora_option(str(tmp_path / "missing.safetensors"))
    with pytest.raises(InvalidRequest, match="lora.*safetensors"):
        parse_lora_option(str(tmp_path / "x.pt:0.5"))
    with pytest.raises(InvalidRequest, match="finite"):
        parse_lora_option(f"{file}:nan")


@pytest.fixture
def card_file(tmp_path: Path) -> str:
    """The toy card as a card file: what --model and fv.load take for a card no plugin installs."""
    path = tmp_path / "toy-dit.json"
    path.write_text(toy_card(CARD).model_dump_json())
    return str(path)


def _generate(card_file: str, args: list[str]) -> Any:
    from fv_kernel.cli.app import app

    return CliRunner().invoke(app, ["generate", "--model", card_file, "--prompt", "a red ball", "--quiet", *args])


def test_fv_generate_lora_changes_the_video_and_strength_zero_does_not(tmp_path: Path, card_file: str) -> None:
    file = lora_file(tmp_path / "style.safetensors", seed=4)
    outputs = {}
    for label, extra in {"plain": [], "lora": ["--lora", f"{file}:1.0"], "zero": ["--lora", f"{file}:0"]}.items():
        out = tmp_path / f"{label}.pt"
        result = _generate(card_file, ["--output", str(out), *extra])
        assert result.exit_code == 0, result.output
        outputs[label] = torch.load(out)
    assert not torch.equal(outputs["plain"], outputs["lora"])
    assert torch.equal(outputs["plain"], outputs["zero"])


def test_fv_generate_bad_lora_is_one_error_line(tmp_path: Path, card_file: str) -> None:
    result = _generate(card_file, ["--output", str(tmp_path / "x.pt"), "--lora", str(tmp_path / "none.safetensors")])
    assert result.exit_code == 2 and "lora" in result.output and "Traceback" not in result.output
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    result = _generate(card_file, ["--output", str(tmp_path / "x.pt"), "--lora", str(tmp_path / "junk.safetensors")])
    assert result.exit_code == 2 and "error:" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x.pt").exists()


def test_fv_adapters_list_shows_name_rank_components_and_assumptions(tmp_path: Path, card_file: str) -> None:
    from fv_kernel.cli.app import app

    loras = tmp_path / "loras"
    loras.mkdir()
    lora_file(loras / "style.safetensors")
    lora_file(loras / "fast.safetensors", seed=5, metadata={"fv.assumes_steps": "2"})
    result = CliRunner().invoke(app, ["adapters", "list", "--model", card_file, "--dir", str(loras), "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.output)}
    assert set(rows) == {"style", "fast"}
    assert rows["style"]["components"] == ["dit"] and rows["style"]["rank"] == 2
    assert rows["fast"]["assumes_steps"] == 2
    table = CliRunner().invoke(app, ["adapters", "list", "--model", card_file, "--dir", str(loras)])
    assert table.exit_code == 0 and "fast" in table.output and "2 steps" in table.output
    bad = CliRunner().invoke(app, ["adapters", "list", "--model", card_file, "--dir", str(tmp_path / "nope")])
    assert bad.exit_code == 2 and "dir" in bad.output


def test_facade_loras_accepts_paths_pairs_and_names(tmp_path: Path, card_file: str) -> None:
    import fv_kernel as fv

    file = lora_file(tmp_path / "style.safetensors", seed=6)
    generator = fv.load(card_file)
    # exact: never merged (a merge, under merge: auto, moves the result by rounding), so bit-comparable
    plain = generator.generate("a red ball", seed=1, exact=True).frames
    by_path = generator.generate("a red ball", seed=1, exact=True, loras=[str(file)]).frames
    by_pair = generator.generate("a red ball", seed=1, exact=True, loras=[(file, 1.0)]).frames
    by_name = generator.generate("a red ball", seed=1, exact=True, loras=[{"name": "style", "scale": 1.0}]).frames
    assert not torch.equal(plain, by_path)
    assert torch.equal(by_path, by_pair) and torch.equal(by_path, by_name)
    assert [a.name for a in generator.adapters.list()] == ["style"]  # the same file registered once
    with pytest.raises(InvalidRequest, match=r"loras\[0\]"):
        generator.generate("x", loras=[(file, "strong")])
    with pytest.raises(InvalidRequest, match=r"loras\[0\].*no such file"):
        generator.generate("x", loras=[tmp_path / "missing.safetensors"])
