"""A mistyped model id is answered with the closest ids ("did you mean"), the same way by the
CLI, the Python facade, the engine and the server: all raise or word ``UnknownModel``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import fv_kernel as fv
from fv_kernel.cli.app import app
from fv_kernel.errors import UnknownModel
from fv_kernel.model.catalog import CardCatalog, CardEntry
from fv_kernel.testing.toy import toy_cards

#: Ids where a typo has one clear target and unrelated neighbours.
CARD_IDS = ("toy-dit", "toy-lm", "toy-omni")


def test_the_message_offers_the_closest_ids_first() -> None:
    error = UnknownModel("toy-ditt", CARD_IDS)
    assert error.suggestions[0] == "toy-dit"
    assert error.message.startswith("model: unknown card 'toy-ditt' (did you mean 'toy-dit'")
    assert error.message.endswith("; allowed: toy-dit, toy-lm, toy-omni")  # the full list stays
    several = UnknownModel("toy", ("toy-dit", "toy-lm", "zzz-other"))
    assert set(several.suggestions) == {"toy-dit", "toy-lm"}
    assert f"(did you mean '{several.suggestions[0]}' or '{several.suggestions[1]}'?)" in several.message
    # Nothing close: no guess, just the list.
    far = UnknownModel("completely-else", CARD_IDS)
    assert far.suggestions == [] and "did you mean" not in far.message


@pytest.fixture
def toy_catalog(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = {card.model_id: CardEntry(card=card, plugin="test") for card in toy_cards()}
    monkeypatch.setattr(CardCatalog, "entries", lambda self: dict(entries))


def test_the_cli_suggests(toy_catalog: None, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["generate", "--model", "toy-ditt", "--prompt", "x", "--output", str(tmp_path / "o.mp4")])
    assert result.exit_code == 2, result.output
    assert "unknown card 'toy-ditt' (did you mean 'toy-dit'" in result.output


def test_the_facade_suggests(toy_catalog: None) -> None:
    with pytest.raises(UnknownModel, match=r"did you mean 'toy-dit'"):
        fv.load("toy-ditt")


def test_the_server_suggests(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from fv_kernel.config import DeployConfig
    from fv_kernel.model.instance import build_instance
    from fv_kernel.runtime.engine import Engine
    from fv_kernel.serving import create_app

    engine = Engine()
    for card in toy_cards()[:1]:
        engine.add_instance(build_instance(card))
    with TestClient(create_app(engine, DeployConfig(output_dir=tmp_path))) as client:
        answer: Any = client.post("/v1/videos", json={"model": "toy-ditt", "prompt": "x"})
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["type"] == "unknown_model" and error["param"] == "model"
    assert "unknown card 'toy-ditt' (did you mean 'toy-dit'?); allowed: toy-dit" in error["message"]
