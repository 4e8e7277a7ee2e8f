"""A deployment's per-component weight files (``component_sources``; fv_kernel.model.component_sources):
checked before anything is built, charged by the pre-flight from the file, and given by the deploy
config, ``fv.load`` and ``fv generate --component-source``. The family side (a Wan transformer read
from a ComfyUI file) is tested in plugins/fv-wan/tests/test_component_sources_wan.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import fv_kernel.testing.toy as toy
from fv_kernel.card.spec import ModelCard
from fv_kernel.config import DeployConfig
from fv_kernel.deploy.model_resolution import resolve_model
from fv_kernel.errors import CheckpointNotFound, InvalidRequest
from fv_kernel.model.component_sources import check_component_sources, component_sources_version
from fv_kernel.model.instance import build_instance
from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.preflight import preflight
from fv_kernel.plugins.host import PluginHost
from fv_kernel.request.types import TaskType

T2V = TaskType.TEXT_TO_VIDEO


def file_card(*single: str, **manifest: Any) -> ModelCard:
    """toy-dit with ``single`` components marked ``single_file`` (and, optionally, another manifest)."""
    card = toy.toy_card("toy-dit")
    entries = {k: c.model_copy(update={"single_file": k in single, **({"random_init_seed": None, "subfolder": k}
                                                                      if manifest else {})})
               for k, c in card.checkpoint.components.items()}
    return card.model_copy(update={"checkpoint": card.checkpoint.model_copy(update={"components": entries, **manifest})})


def weights_file(path: Path, elements: int = 100, dtype: torch.dtype = torch.float32) -> Path:
    save_file({"w": torch.zeros(elements).to(dtype)}, str(path))
    return path


def test_a_component_the_card_does_not_mark_single_file_is_refused_naming_those_that_are(tmp_path: Path) -> None:
    file = weights_file(tmp_path / "dit.safetensors")
    card = file_card("dit")
    check_component_sources(card, InstanceOptions(component_sources={"dit": file}))  # allowed
    with pytest.raises(InvalidRequest, match=r"^component_sources.decoder: card 'toy-dit' loads 'decoder' only from its "
                                             r"checkpoint.*; allowed: dit$"):
        check_component_sources(card, InstanceOptions(component_sources={"decoder": file}))
    with pytest.raises(InvalidRequest, match=r"^component_sources: card 'toy-dit' has no component 'dti'; allowed: dit$"):
        check_component_sources(card, InstanceOptions(component_sources={"dti": file}))
    with pytest.raises(InvalidRequest, match="allowed: none"):
        check_component_sources(file_card(), InstanceOptions(component_sources={"dit": file}))


def test_a_path_that_is_not_one_safetensors_file_is_refused(tmp_path: Path) -> None:
    card = file_card("dit")
    with pytest.raises(InvalidRequest, match=r"^component_sources.dit: .* is not a .safetensors file"):
        check_component_sources(card, InstanceOptions(component_sources={"dit": tmp_path}))
    with pytest.raises(CheckpointNotFound, match=r"^component_sources.dit: .*missing.safetensors' does not exist") as caught:
        check_component_sources(card, InstanceOptions(component_sources={"dit": tmp_path / "missing.safetensors"}))
    assert caught.value.param == "component_sources.dit"
    (tmp_path / "folder.safetensors").mkdir()
    with pytest.raises(CheckpointNotFound, match="is not a file"):
        check_component_sources(card, InstanceOptions(component_sources={"dit": tmp_path / "folder.safetensors"}))


def test_build_instance_and_the_preflight_refuse_before_building(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    monkeypatch.setattr(toy, "build_component", lambda name, seed: built.append(name))
    bad = InstanceOptions(component_sources={"decoder": weights_file(tmp_path / "d.safetensors")}, preload_tasks=(T2V,))
    with pytest.raises(InvalidRequest, match="component_sources.decoder"):
        build_instance(file_card("dit"), bad)
    with pytest.raises(InvalidRequest, match="component_sources.decoder"):
        preflight(file_card("dit"), bad, (T2V,))
    assert built == []


def test_a_component_with_its_own_file_needs_no_checkpoint(tmp_path: Path) -> None:
    """A card without a checkpoint source loads when every component it needs has a file of its own."""
    card = file_card("lm", "dit", "decoder", layout="diffusers", source=None)
    with pytest.raises(CheckpointNotFound, match="has no default checkpoint"):
        preflight(card, InstanceOptions(), (T2V,))
    some = {"dit": weights_file(tmp_path / "dit.safetensors")}
    with pytest.raises(CheckpointNotFound, match="has no default checkpoint"):  # lm and decoder still need it
        preflight(card, InstanceOptions(component_sources=some), (T2V,))
    every = {c: weights_file(tmp_path / f"{c}.safetensors", 10 * (i + 1)) for i, c in enumerate(("lm", "dit", "decoder"))}
    report = preflight(card, InstanceOptions(component_sources=every), (T2V,))
    assert report.source is None
    # Each component charged what its file stores (10, 20, 30 fp32 elements), not the card's undeclared count.
    assert sorted((c.component_id, c.elements, c.precision) for c in report.components) == [
        ("decoder", 30, "fp32"), ("dit", 20, "fp32"), ("lm", 10, "fp32")]
    assert report.uncounted == ()


def test_a_files_fp8_tensors_are_charged_at_one_byte(tmp_path: Path) -> None:
    card = file_card("dit")
    card = card.model_copy(update={"components": {**card.components,
                                                  "dit": card.components["dit"].model_copy(update={"parameters": 1000})}})
    file = tmp_path / "dit.safetensors"
    save_file({"w": torch.zeros(600).to(torch.float8_e4m3fn), "b": torch.zeros(100)}, str(file))
    report = preflight(card, InstanceOptions(component_sources={"dit": file}), (T2V,))
    assert sorted((c.elements, c.precision) for c in report.components if c.component_id == "dit") == [
        (100, "fp32"), (600, "fp8_e4m3")]


def test_the_version_names_each_file_and_changes_when_it_is_rewritten(tmp_path: Path) -> None:
    assert component_sources_version(InstanceOptions()) == ""
    file = weights_file(tmp_path / "a.safetensors")
    options = InstanceOptions(component_sources={"dit": file})
    first = component_sources_version(options)
    assert first.startswith("+dit=a.safetensors@") and component_sources_version(options) == first
    os.utime(file, ns=(10**9, 10**9))
    assert component_sources_version(options) != first
    (tmp_path / "b").mkdir()
    other = weights_file(tmp_path / "b" / "a.safetensors")  # the same name in another folder: another file
    assert component_sources_version(InstanceOptions(component_sources={"dit": other})) != first


def test_the_deploy_config_and_the_callers_give_them(tmp_path: Path, fv_host: PluginHost) -> None:
    card = tmp_path / "card.json"
    card.write_text(file_card("dit").model_dump_json())
    file = weights_file(tmp_path / "dit.safetensors")
    config = DeployConfig.model_validate({"cards": [{"model": str(card), "component_sources": {"dit": str(file)}}]})
    choice = resolve_model(str(card), config, fv_host)
    assert choice.options.component_sources == {"dit": file}
    other = weights_file(tmp_path / "lm.safetensors")
    merged = resolve_model(str(card), config, fv_host, component_sources={"lm": other})
    assert merged.options.component_sources == {"dit": file, "lm": other}  # the caller's add to the entry's
    replaced = resolve_model(str(card), config, fv_host, component_sources={"dit": other})
    assert replaced.options.component_sources == {"dit": other}
    with pytest.raises(Exception, match="component_sources"):
        DeployConfig.model_validate({"cards": [{"model": "toy-dit", "component_sources": ["dit"]}]})


def test_fv_generate_parses_component_equals_file() -> None:
    from fv_kernel.cli.generate_cmd import parse_component_sources

    assert parse_component_sources(["transformer=a.safetensors", "transformer_2=b/c.safetensors"]) == {
        "transformer": Path("a.safetensors"), "transformer_2": Path("b/c.safetensors")}
    for bad in (["transformer"], ["=a.safetensors"], ["transformer="]):
        with pytest.raises(InvalidRequest, match=r"^component_sources: .* is not COMPONENT=FILE"):
            parse_component_sources(bad)
    with pytest.raises(InvalidRequest, match=r"^component_sources.transformer: given twice"):
        parse_component_sources(["transformer=a.safetensors", "transformer=b.safetensors"])
