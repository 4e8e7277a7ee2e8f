"""The pre-flight: a card's checkpoint source and the memory its weights need are checked
before anything is built (fv_kernel.model.preflight), by build_instance / load_for_task,
fv generate and fv serve start-up. Negative controls fake a tiny device and count the
component builder's calls: refused means built nothing."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import fv_kernel.model.preflight as preflight_module
import fv_kernel.testing.toy as toy
from fv_kernel.model.buildcheck import InvalidCard
from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.instance import ModelInstance, build_instance
from fv_kernel.model.preflight import (
    InsufficientMemory,
    component_parameters,
    format_bytes,
    preflight,
    preflight_deployment,
)
from fv_kernel.card.spec import ModelCard
from fv_kernel.cli.app import app
from fv_kernel.errors import CheckpointNotFound
from fv_kernel.request.types import TaskType
from fv_kernel.compute.device import device_available_bytes, device_total_bytes

T2V = TaskType.TEXT_TO_VIDEO
ELEMENTS = {"lm": 1_000, "dit": 2_000, "decoder": 3_000}  # toy-dit's components, fp32: 24,000 bytes


def counted_card(model_id: str = "toy-dit", elements: dict[str, int] = ELEMENTS, **checkpoint: Any) -> ModelCard:
    """A toy card whose components declare ``elements`` weights (and, optionally, another checkpoint manifest)."""
    card = toy.toy_card(model_id)
    components = {k: c.model_copy(update={"parameters": elements.get(k)}) for k, c in card.components.items()}
    manifest = card.checkpoint
    if checkpoint:
        seeds = {k: c.model_copy(update={"random_init_seed": None, "subfolder": k}) for k, c in manifest.components.items()}
        manifest = manifest.model_copy(update={"components": seeds, **checkpoint})
    return card.model_copy(update={"components": components, "checkpoint": manifest})


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every toy component the loader builds, by name."""
    built: list[str] = []
    real = toy.build_component

    def counting(name: str, seed: int) -> Any:
        built.append(name)
        return real(name, seed)

    monkeypatch.setattr(toy, "build_component", counting)
    return built


def fake_memory(monkeypatch: pytest.MonkeyPatch, available: int) -> None:
    monkeypatch.setattr(preflight_module, "device_available_bytes", lambda device: available)


# --------------------------------------------------------------------------- memory


def test_the_report_counts_each_component_at_its_dtype() -> None:
    report = preflight(counted_card(), InstanceOptions(), (T2V,))
    assert sorted((c.component_id, c.elements, c.precision) for c in report.components) == [
        ("decoder", 3000, "fp32"), ("dit", 2000, "fp32"), ("lm", 1000, "fp32"),
    ]
    assert report.weights_bytes == 24_000
    assert report.available_bytes is not None and report.available_bytes > 24_000
    assert report.source is None  # embedded


def test_a_precision_policy_dtype_wins_over_the_card_precision() -> None:
    card = counted_card()
    spec = card.components["dit"]
    policy = spec.precision_policy.model_copy(update={"dtype": "bf16"})
    card = card.model_copy(update={"components": {**card.components, "dit": spec.model_copy(update={"precision_policy": policy})}})
    report = preflight(card, InstanceOptions(), (T2V,))
    assert report.weights_bytes == 4 * 1000 + 2 * 2000 + 4 * 3000


def test_weights_that_do_not_fit_are_refused_before_any_component_is_built(
    monkeypatch: pytest.MonkeyPatch, builds: list[str]
) -> None:
    fake_memory(monkeypatch, 10_000)  # the card needs 24,000 bytes
    with pytest.raises(InsufficientMemory) as caught:
        build_instance(counted_card(), InstanceOptions(preload_tasks=(T2V,)))
    message = caught.value.message
    assert "\n" not in message
    assert "needs 23.4 KiB for its weights" in message and "only 9.8 KiB is available" in message
    assert "lm 3.9 KiB fp32" in message and "on cpu" in message
    assert message.endswith("use a device with more memory, a smaller card")  # toy cards support fp32 only
    assert builds == []  # refused before the loader ran


def test_the_refusal_names_smaller_precisions_the_card_supports(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_memory(monkeypatch, 10_000)
    card = counted_card()
    card = card.model_copy(update={"precision": card.precision.model_copy(update={"supported": frozenset({"fp32", "bf16", "fp16"})})})
    with pytest.raises(InsufficientMemory, match=r"a smaller card, or --precision bf16 / fp16$"):
        preflight(card, InstanceOptions(), (T2V,))


def test_lazy_loading_is_checked_too(monkeypatch: pytest.MonkeyPatch, builds: list[str]) -> None:
    instance = build_instance(counted_card())  # nothing preloaded: nothing checked or built yet
    fake_memory(monkeypatch, 10_000)
    with pytest.raises(InsufficientMemory):
        instance.load_for_task(T2V)
    with pytest.raises(InsufficientMemory):
        instance.component("decoder")  # 12,000 bytes alone
    assert builds == [] and instance.components == {}
    instance.component("lm")  # 4,000 bytes fit
    assert builds == ["lm"]


def test_negative_control_without_the_check_the_tiny_device_builds_anyway(
    monkeypatch: pytest.MonkeyPatch, builds: list[str]
) -> None:
    """The bug the check exists for: with the pre-flight gone, the same fake tiny device builds every component."""
    fake_memory(monkeypatch, 10_000)
    monkeypatch.setattr(ModelInstance, "_preflight", lambda self, component_ids: None)
    build_instance(counted_card(), InstanceOptions(preload_tasks=(T2V,)))
    assert sorted(builds) == ["decoder", "dit", "lm"]


def test_enough_memory_builds(monkeypatch: pytest.MonkeyPatch, builds: list[str]) -> None:
    fake_memory(monkeypatch, 24_000)  # exactly enough
    build_instance(counted_card(), InstanceOptions(preload_tasks=(T2V,)))
    assert sorted(builds) == ["decoder", "dit", "lm"]


def test_uncounted_components_are_not_charged() -> None:
    report = preflight(counted_card(elements={"dit": 2_000}), InstanceOptions(), (T2V,))
    assert report.weights_bytes == 8_000
    assert report.uncounted == ()  # embedded: nothing is loaded from files


def test_a_deployment_sums_the_cards_on_one_device(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_memory(monkeypatch, 40_000)
    one = counted_card()  # 24,000 bytes; two do not fit in 40,000
    assert len(preflight_deployment([(one, InstanceOptions())])) == 1
    with pytest.raises(InsufficientMemory, match=r"on top of 23\.4 KiB for the deployment's other cards"):
        preflight_deployment([(one, InstanceOptions()), (one, InstanceOptions())])


def test_parameters_may_be_a_function_of_the_spec() -> None:
    card = toy.toy_card("toy-dit")
    spec = card.components["dit"].model_copy(update={"parameters": "tests.test_preflight:count_from_config"})
    spec = spec.model_copy(update={"config": {"elements": 123}})
    assert component_parameters(spec) == 123
    broken = spec.model_copy(update={"parameters": "tests.test_preflight:no_such_function"})
    with pytest.raises(InvalidCard, match=r"components\.dit\.parameters"):
        component_parameters(broken)
    wrong = spec.model_copy(update={"parameters": "tests.test_preflight:returns_text"})
    with pytest.raises(InvalidCard, match="not a count"):
        component_parameters(wrong)


def count_from_config(spec: Any) -> int:
    return int(spec.config["elements"])


def returns_text(spec: Any) -> str:
    return "many"


def test_the_field_is_validated() -> None:
    spec = toy.toy_card("toy-dit").components["dit"]
    with pytest.raises(ValueError, match="parameters must be >= 0"):
        type(spec).model_validate({**spec.model_dump(), "parameters": -1})
    with pytest.raises(ValueError, match="module:attribute"):
        type(spec).model_validate({**spec.model_dump(), "parameters": "not an import"})


def test_available_memory_is_read_for_the_cpu() -> None:
    available = device_available_bytes("cpu")
    assert 0 < available <= device_total_bytes("cpu")


def test_format_bytes() -> None:
    assert [format_bytes(v) for v in (512, 24_000, 3 * 2**20, 28.3 * 2**30)] == ["512 B", "23.4 KiB", "3.0 MiB", "28.3 GiB"]


# --------------------------------------------------------------------------- checkpoint source


def test_a_card_with_no_source_and_no_embedded_weights_names_the_flag(builds: list[str]) -> None:
    card = counted_card(layout="diffusers", source=None)
    with pytest.raises(CheckpointNotFound) as caught:
        build_instance(card, InstanceOptions(preload_tasks=(T2V,)))
    message = caught.value.message
    assert "\n" not in message
    assert message.startswith("card 'toy-dit' has no default checkpoint and its weights are not embedded")
    assert "pass its directory as --model PATH (a diffusers-layout folder with decoder/, dit/, lm/)" in message
    assert builds == []


def test_a_local_checkpoint_missing_a_folder_names_it(tmp_path: Path, builds: list[str]) -> None:
    (tmp_path / "lm").mkdir()
    (tmp_path / "dit").mkdir()
    card = counted_card(layout="diffusers", source=str(tmp_path))
    with pytest.raises(CheckpointNotFound, match=r"has no folder 'decoder' that card 'toy-dit' loads"):
        preflight(card, InstanceOptions(), (T2V,))
    (tmp_path / "decoder").mkdir()
    assert preflight(card, InstanceOptions(), (T2V,)).source == str(tmp_path)
    with pytest.raises(CheckpointNotFound, match="neither an existing directory nor a Hugging Face repo id"):
        preflight(counted_card(layout="diffusers", source=str(tmp_path / "nope")), InstanceOptions(), (T2V,))
    assert builds == []


@pytest.fixture
def empty_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(preflight_module, "_cached_snapshot", lambda source: None)


def test_an_uncached_hub_id_offline_says_what_to_download(
    monkeypatch: pytest.MonkeyPatch, empty_hub_cache: None, builds: list[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(preflight_module, "hub_unreachable", lambda source: pytest.fail("offline runs must not probe the hub"))
    card = counted_card(layout="diffusers", source="some-org/some-model")
    with pytest.raises(CheckpointNotFound) as caught:
        build_instance(card, InstanceOptions(preload_tasks=(T2V,)))
    message = caught.value.message
    assert "\n" not in message
    assert "needs checkpoint 'some-org/some-model', which is not in the local Hugging Face cache" in message
    assert "hf download some-org/some-model --local-dir DIR) and pass --model DIR" in message
    assert "huggingface-cli" not in message  # deprecated; current huggingface_hub ships `hf`
    # The command named is one the installed huggingface_hub really provides.
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("hf", "").startswith("huggingface_hub")
    assert builds == []


def test_an_uncached_hub_id_with_no_network_says_so(
    monkeypatch: pytest.MonkeyPatch, empty_hub_cache: None, builds: list[str]
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(preflight_module, "hub_unreachable", lambda source: "ConnectionError: no route to host")
    card = counted_card(layout="diffusers", source="some-org/some-model")
    with pytest.raises(CheckpointNotFound, match=r"the hub did not answer \(ConnectionError: no route to host\)"):
        preflight(card, InstanceOptions(), (T2V,))
    # reachable: loading will download it, so the pre-flight lets it through
    monkeypatch.setattr(preflight_module, "hub_unreachable", lambda source: None)
    assert preflight(card, InstanceOptions(), (T2V,)).source == "some-org/some-model"
    assert builds == []


def test_seeded_components_need_no_source() -> None:
    card = counted_card(layout="diffusers", source=None)
    seeded = {k: c.model_copy(update={"random_init_seed": 7}) for k, c in card.checkpoint.components.items()}
    card = card.model_copy(update={"checkpoint": card.checkpoint.model_copy(update={"components": seeded})})
    assert preflight(card, InstanceOptions(), (T2V,)).source is None


# --------------------------------------------------------------------------- fv generate


def _generate(card: ModelCard, tmp_path: Path) -> Any:
    path = tmp_path / "card.json"
    path.write_text(card.model_dump_json())
    out = tmp_path / "out.mp4"
    return CliRunner().invoke(app, ["generate", "--model", str(path), "--prompt", "a toy", "--output", str(out)]), out


def test_generate_refuses_weights_that_do_not_fit_in_one_line(
    monkeypatch: pytest.MonkeyPatch, builds: list[str], tmp_path: Path
) -> None:
    fake_memory(monkeypatch, 10_000)
    result, out = _generate(counted_card(), tmp_path)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("error: card 'toy-dit' needs 23.4 KiB for its weights")
    assert "only 9.8 KiB is available" in lines[-1]
    assert "Traceback" not in result.output
    assert builds == [] and not out.exists()


def test_generate_refuses_a_card_without_a_checkpoint_in_one_line(builds: list[str], tmp_path: Path) -> None:
    result, out = _generate(counted_card(layout="diffusers", source=None), tmp_path)
    assert result.exit_code == 2, result.output
    assert "error: card 'toy-dit' has no default checkpoint" in result.output and "--model PATH" in result.output
    assert builds == [] and not out.exists()


def test_serve_start_up_runs_the_preflight_over_every_card(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from fv_kernel.cli.serve_cmd import preflight_cards
    from fv_kernel.config import DeployConfig
    from fv_kernel.plugins.host import PluginHost

    path = tmp_path / "card.json"
    path.write_text(counted_card().model_dump_json())
    deploy = DeployConfig.model_validate({"cards": [{"model": str(path)}]})
    host = PluginHost(deploy.plugins)
    fake_memory(monkeypatch, 1 << 30)
    preflight_cards(deploy, host)
    fake_memory(monkeypatch, 10_000)
    with pytest.raises(InsufficientMemory):
        preflight_cards(deploy, host)
    json.loads(path.read_text())  # the card file is untouched


# --------------------------------------------------------------------------- checkpoint headers


def _save(folder: Path, **shapes: tuple[int, ...]) -> None:
    from safetensors.torch import save_file
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: torch.zeros(shape) for name, shape in shapes.items()}, str(folder / "model.safetensors"))


def test_stored_elements_read_the_headers_only(tmp_path: Path) -> None:
    from fv_kernel.model.preflight import stored_elements

    _save(tmp_path / "dit", w=(10, 20), b=(20,))
    assert stored_elements(tmp_path / "dit") == 220
    assert stored_elements(tmp_path / "empty") is None


def test_a_local_checkpoint_is_charged_what_it_stores_when_smaller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A card describing a large release, given a checkpoint folder holding a small model: the folder's
    count is charged (min), so a small checkpoint is not refused for the release's size."""
    for name in ("lm", "dit", "decoder"):
        _save(tmp_path / name, w=(10, 10))  # 100 elements each
    big = counted_card(elements={"lm": 10**9, "dit": 10**9, "decoder": 50}, layout="diffusers", source=str(tmp_path))
    fake_memory(monkeypatch, 10_000)
    report = preflight(big, InstanceOptions(), (T2V,))
    assert sorted((c.component_id, c.elements) for c in report.components) == [("decoder", 50), ("dit", 100), ("lm", 100)]
    # negative control: without a stored count (empty folders) the declared release size is charged, and refused
    empty = tmp_path / "empty"
    for name in ("lm", "dit", "decoder"):
        (empty / name).mkdir(parents=True)
    with pytest.raises(InsufficientMemory):
        preflight(big.model_copy(update={"checkpoint": big.checkpoint.model_copy(update={"source": str(empty)})}),
                  InstanceOptions(), (T2V,))


def test_an_uncounted_component_is_charged_what_its_folder_stores(tmp_path: Path) -> None:
    for name in ("lm", "dit", "decoder"):
        _save(tmp_path / name, w=(10, 10))
    card = counted_card(elements={"dit": 7}, layout="diffusers", source=str(tmp_path))
    report = preflight(card, InstanceOptions(), (T2V,))
    assert sorted((c.component_id, c.elements) for c in report.components) == [("decoder", 100), ("dit", 7), ("lm", 100)]
    assert report.uncounted == ()


def test_fv_serve_refuses_at_start_up_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, builds: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "card.json"
    path.write_text(counted_card().model_dump_json())
    fake_memory(monkeypatch, 10_000)
    result = CliRunner().invoke(app, ["serve", "--model", str(path), "--port", "0"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "needs 23.4 KiB for its weights" in errors[0] and "only 9.8 KiB is available" in errors[0]
    assert "Traceback" not in result.output and builds == []
