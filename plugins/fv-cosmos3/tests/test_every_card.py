"""Every card of every in-repo plugin either runs at its defaults or says why not, before it allocates.

The cards come from the in-repo plugin manifests (``plugins/*/fv_*/fv-plugin.yaml``), so a
card a plugin adds is covered without editing this file. For each card:

* its defaults pass its own capability rules for every task it lists (the kernel's
  ``resolve_request``, the rules ``fv generate`` and ``fv serve`` apply);
* with no network and nothing cached, the pre-flight either passes (embedded weights) or
  refuses in one line naming the hub id or the ``--model`` flag;
* with a checkpoint folder in place and a device of 8 GiB, a card whose weights need more is
  refused in one line with both figures, and ``fv generate`` builds nothing.
Embedded cards run at their defaults end to end (cosmos3-tiny here; every task of it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

import fv_cosmos3.instance as cosmos3_instance
from fv_cosmos3.cards import cosmos3_card
import fv_kernel.model.preflight as preflight_module
from fv_kernel.api import (
    ActionPart,
    CardCatalog,
    CheckpointNotFound,
    DiffusionParams,
    Engine,
    ImagePart,
    InstanceOptions,
    InsufficientMemory,
    InvalidRequest,
    ModelCard,
    Request,
    SchedulerConfig,
    TaskType,
    TextPart,
    VideoPart,
    build_instance,
    preflight,
    resolve_request,
)
from fv_kernel.cli.app import app
from fv_kernel.plugins.host import PluginHost

REPO = Path(__file__).resolve().parents[3]
GiB = 2**30


def manifest_card_ids() -> list[str]:
    ids = []
    for manifest in sorted(REPO.glob("plugins/*/fv_*/fv-plugin.yaml")):
        cards = (yaml.safe_load(manifest.read_text()).get("contributions") or {}).get("model_cards") or []
        ids += [entry["name"] for entry in cards]
    return ids


CARD_IDS = manifest_card_ids()


@pytest.fixture(scope="module")
def cards() -> dict[str, ModelCard]:
    return {card_id: entry.card for card_id, entry in CardCatalog(PluginHost()).entries().items()}


def test_the_manifests_list_both_model_plugins() -> None:
    assert {"wan-tiny", "wan2.1-t2v-14b", "cosmos3-tiny", "cosmos3-nano", "cosmos3-super"} <= set(CARD_IDS)


def _parts(task: TaskType) -> tuple[Any, ...]:
    parts: dict[TaskType, tuple[Any, ...]] = {
        TaskType.IMAGE_TO_VIDEO: (ImagePart(image=torch.rand(3, 32, 64)),),
        TaskType.ACTION_POLICY: (ImagePart(image=torch.rand(3, 32, 64)),),
        TaskType.FORWARD_DYNAMICS: (ImagePart(image=torch.rand(3, 32, 64)), ActionPart(actions=torch.zeros(4, 3), domain=0)),
        TaskType.INVERSE_DYNAMICS: (VideoPart(frames=torch.rand(5, 3, 32, 64), fps=24.0),),
        TaskType.VIDEO_TO_VIDEO: (VideoPart(frames=torch.rand(5, 3, 32, 64), fps=24.0),),
    }
    return (TextPart(text="a red fox in the snow"), *parts.get(task, ()))


@pytest.mark.parametrize("card_id", CARD_IDS)
def test_defaults_pass_the_cards_own_rules(cards: dict[str, ModelCard], card_id: str) -> None:
    card = cards[card_id]  # KeyError: a manifest lists a card the installed plugin does not contribute
    for task in sorted(card.capabilities.tasks, key=lambda t: t.value):
        resolved = resolve_request(card, Request(model=card_id, task=task, inputs=_parts(task)))
        if task is not TaskType.TEXT_GENERATION and card.capabilities.defaults is not None:
            d = resolved.diffusion
            assert d.height % card.capabilities.spatial_multiple == 0 and d.width % card.capabilities.spatial_multiple == 0


def test_negative_control_a_default_off_the_spatial_multiple_is_caught(cards: dict[str, ModelCard]) -> None:
    """The bug this gate caught: cosmos3-nano's default height was 720 with a spatial multiple of 32."""
    card = cards["cosmos3-nano"]
    caps = card.capabilities
    broken = card.model_copy(update={"capabilities": caps.model_copy(update={
        "defaults": caps.defaults.model_copy(update={"height": 720})})})
    with pytest.raises(Exception, match=r"^height: 720 is not divisible by 32"):
        resolve_request(broken, Request(model=card.model_id, task=TaskType.TEXT_TO_VIDEO, inputs=_parts(TaskType.TEXT_TO_VIDEO)))


def _asking(card: ModelCard, **diffusion: Any) -> Request:
    task = _default_task(card)
    return Request(model=card.model_id, task=task, inputs=_parts(task), diffusion=DiffusionParams(**diffusion))


@pytest.mark.parametrize("card_id", CARD_IDS)
def test_every_card_refuses_steps_beyond_its_maximum_naming_it_and_bounds_fps(cards: dict[str, ModelCard], card_id: str) -> None:
    """``--steps 100000`` is one line naming the card's maximum (or the recipe's fixed count), on every listed card."""
    card = cards[card_id]
    caps = card.capabilities
    assert caps.max_steps is not None and caps.min_fps is not None and caps.max_fps is not None, f"{card_id} declares no bound"
    with pytest.raises(InvalidRequest) as steps:
        resolve_request(card, _asking(card, steps=100000))
    assert steps.value.param == "steps"
    if card.recipe.assumes_loop is None:  # a recipe that fixes its step count (DMD2) names the recipe instead
        assert steps.value.message == (
            f"steps: 100000 exceeds the maximum of card {card_id!r}; allowed: 1..{caps.max_steps}"
        )
        resolve_request(card, _asking(card, steps=caps.max_steps))
    with pytest.raises(InvalidRequest) as fps:
        resolve_request(card, _asking(card, fps=0.0001))
    assert fps.value.param == "fps" and f"allowed: {caps.min_fps:g}..{caps.max_fps:g}" in fps.value.message


def test_negative_control_a_card_without_a_step_maximum_takes_100000(cards: dict[str, ModelCard]) -> None:
    card = cards["cosmos3-nano"]
    unbounded = card.model_copy(update={"capabilities": card.capabilities.model_copy(update={"max_steps": None})})
    assert resolve_request(unbounded, _asking(unbounded, steps=100000)).diffusion.steps == 100000


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No network and an empty Hugging Face cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    monkeypatch.setattr(preflight_module, "_cached_snapshot", lambda source: None)


def _default_task(card: ModelCard) -> TaskType:
    tasks = card.capabilities.tasks
    return TaskType.TEXT_TO_VIDEO if TaskType.TEXT_TO_VIDEO in tasks else sorted(tasks, key=lambda t: t.value)[0]


@pytest.mark.parametrize("card_id", CARD_IDS)
def test_offline_every_card_passes_or_names_what_to_download(cards: dict[str, ModelCard], card_id: str, offline: None) -> None:
    card = cards[card_id]
    if card.checkpoint.layout == "embedded":
        assert preflight(card, InstanceOptions(), None).source is None
        return
    if card.checkpoint.source is not None and Path(card.checkpoint.source).is_dir():  # weights shipped on disk
        assert preflight(card, InstanceOptions(), None).source == card.checkpoint.source
        return
    with pytest.raises(CheckpointNotFound) as caught:
        preflight(card, InstanceOptions(), (_default_task(card),))
    message = caught.value.message
    assert "\n" not in message
    if card.checkpoint.source is not None:
        assert f"hf download {card.checkpoint.source} " in message and "--model DIR" in message
    else:
        assert "--model PATH" in message


def _checkpoint_dir(card: ModelCard, root: Path) -> Path:
    for component in card.checkpoint.components.values():
        if component.subfolder:
            (root / component.subfolder).mkdir(parents=True, exist_ok=True)
    return root


@pytest.mark.parametrize("card_id", CARD_IDS)
def test_on_an_8_gib_device_every_card_fits_or_says_how_much(
    cards: dict[str, ModelCard], card_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(preflight_module, "device_available_bytes", lambda device: 8 * GiB)
    card = cards[card_id]
    options = InstanceOptions(source=None if card.checkpoint.layout == "embedded" else str(_checkpoint_dir(card, tmp_path)))
    task = _default_task(card)
    from fv_kernel.model.preflight import weights_needed

    counted, uncounted = weights_needed(card, card.checkpoint.components_for(task), card.precision.default)
    assert uncounted == [], f"{card_id}: components without a weight count: {uncounted}"
    needed = sum(c.bytes for c in counted)
    if needed <= 8 * GiB:
        assert preflight(card, options, (task,)).weights_bytes == needed
        return
    with pytest.raises(InsufficientMemory) as caught:
        preflight(card, options, (task,))
    assert "\n" not in caught.value.message
    assert f"needs {preflight_module.format_bytes(needed)} for its weights" in caught.value.message
    assert "only 8.0 GiB is available" in caught.value.message


def test_nano_weights_are_counted_as_the_model_builds_them(cards: dict[str, ModelCard]) -> None:
    """The count the pre-flight charges is the module's (meta device), 28.3 GiB of bf16 for Nano's MoT."""
    from fv_kernel.model.preflight import component_parameters

    from fv_cosmos3.models import Cosmos3Config, Cosmos3MoT

    spec = cards["cosmos3-nano"].components["transformer"]
    with torch.device("meta"):
        module = Cosmos3MoT(Cosmos3Config(**spec.config))
    assert component_parameters(spec) == sum(p.numel() for p in module.parameters()) + sum(b.numel() for b in module.buffers())
    assert preflight_module.format_bytes(component_parameters(spec) * 2) == "28.3 GiB"


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = cosmos3_instance._load_component

    def counting(card: Any, options: Any, component_id: str) -> Any:
        calls.append(component_id)
        return real(card, options, component_id)

    monkeypatch.setattr(cosmos3_instance, "_load_component", counting)
    return calls


def _generate(*args: str) -> Any:
    return CliRunner().invoke(app, ["generate", "--prompt", "a red fox", *args])


@pytest.mark.parametrize("card_id", ["cosmos3-nano", "cosmos3-super"])
def test_generate_nano_or_super_at_defaults_without_a_checkpoint_is_one_line_and_builds_nothing(
    offline: None, loads: list[str], tmp_path: Path, card_id: str
) -> None:
    out = tmp_path / "out.mp4"
    result = _generate("--model", card_id, "--output", str(out))
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [result.output.strip()], result.output  # one line
    assert result.output.startswith(f"error: card {card_id!r} has no default checkpoint")
    assert "--model PATH" in result.output and "Traceback" not in result.output
    assert loads == [] and not out.exists()


def test_generate_nano_on_a_small_device_says_how_much_and_builds_nothing(
    monkeypatch: pytest.MonkeyPatch, loads: list[str], tmp_path: Path, cards: dict[str, ModelCard]
) -> None:
    """The issue's run: a valid size, a (here empty) Nano checkpoint folder, a machine too small: refused, not OOM-killed."""
    monkeypatch.setattr(preflight_module, "device_available_bytes", lambda device: 20 * GiB)
    checkpoint = _checkpoint_dir(cards["cosmos3-nano"], tmp_path / "nano")
    (checkpoint / "transformer" / "config.json").write_text('{"_class_name": "Cosmos3OmniTransformer", "hidden_size": 4096}')
    out = tmp_path / "out.mp4"
    result = _generate("--model", str(checkpoint), "--output", str(out), "--height", "704", "--width", "1280")
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    # text-to-video loads the MoT and the VAE (not the sound decoder); bf16 is already the smallest precision
    assert last == (
        "error: card 'cosmos3-nano' needs 29.6 GiB for its weights (transformer 28.3 GiB bf16, vae 1.3 GiB bf16) on cpu, "
        "but only 20.0 GiB is available; use a device with more memory, a smaller card"
    )
    assert loads == [] and not out.exists()


@pytest.fixture(scope="module")
def tiny_engine(cards: dict[str, ModelCard]) -> Engine:
    engine = Engine(SchedulerConfig(device_thread=False))
    engine.add_instance(build_instance(cards["cosmos3-tiny"]))
    return engine


@pytest.mark.parametrize("task", sorted(cosmos3_card("cosmos3-tiny").capabilities.tasks, key=lambda t: t.value))
def test_cosmos3_tiny_runs_every_task_at_its_defaults(tiny_engine: Engine, task: TaskType) -> None:
    result = tiny_engine.generate(Request(model="cosmos3-tiny", task=task, inputs=_parts(task)))
    assert result.status == "completed", result.error


@pytest.mark.parametrize(
    ("card_id", "task", "figure"),
    [("cosmos3-nano", TaskType.TEXT_TO_VIDEO, "29.6 GiB"), ("cosmos3-nano", TaskType.TEXT_TO_VIDEO_AUDIO, "30.5 GiB"),
     ("cosmos3-super", TaskType.TEXT_TO_VIDEO, "120.6 GiB")],
)
def test_the_weights_docs_models_cosmos3_md_quotes(cards: dict[str, ModelCard], card_id: str, task: TaskType, figure: str) -> None:
    from fv_kernel.model.preflight import weights_needed

    counted, _ = weights_needed(cards[card_id], cards[card_id].checkpoint.components_for(task), "bf16")
    assert preflight_module.format_bytes(sum(c.bytes for c in counted)) == figure
    assert figure in (REPO / "docs" / "models" / "cosmos3.md").read_text()
