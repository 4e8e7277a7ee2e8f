"""A failing plugin is contained: disabled with its error shown, every other plugin keeps working.

The fixture ``fv-badcard`` imports fine, but its ``fv_register_model_cards`` hook raises
(its card's ``precision.default`` is not a precision); ``fv-toy`` beside it contributes
the working ``toy-dit`` card. Explicitly enabling a failing plugin instead stops every
command with one ``error:`` line.
"""

from __future__ import annotations

import json
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fv_kernel.api import FlowEulerSampler, ModelCard, Request, TaskType, TextPart, hookimpl
from fv_kernel.model.catalog import CardCatalog
from fv_kernel.cli.app import app
from fv_kernel.plugins import DuplicateContributionError, PluginError, PluginHost, PluginLoadError, PluginsConfig, PluginWarning
from fv_kernel.testing.toy import toy_card

runner = CliRunner()

#: Installed plugins other than the fixtures' (present locally, absent in CI): left out so every run sees the same set.
OTHERS = ["fv-wan", "fv-cosmos3", "fv-cachedit", "fv-bad", "fv-broken", "fv-oldapi", "fv-good"]
BAD_CARD_CAUSE = "plugin 'fv-badcard' failed in fv_register_model_cards: ValidationError in ModelCard: precision.default"


@pytest.fixture(autouse=True)
def no_env_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FV_PLUGINS", raising=False)


def deploy_yaml(tmp_path: Path, body: str = "") -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(f"plugins:\n  disable: {json.dumps(OTHERS)}\n{body}")
    return path


def fixture_host(site: Path, config: PluginsConfig) -> PluginHost:
    host = PluginHost(config, search_path=[str(site)], environ={})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)
        host.start()
    return host


# --------------------------------------------------------------------------- the host


def test_bad_card_plugin_is_disabled_and_unregistered(plugin_site: Path) -> None:
    host = fixture_host(plugin_site, PluginsConfig(disable=OTHERS))
    record = host.record("fv-badcard")
    assert record.status.value == "error" and BAD_CARD_CAUSE in record.reason
    assert "\n" not in record.reason
    # Unregistered: none of its hooks run, none of its contributions count, not even the valid sampler.
    assert host.pm.get_plugin("fv-badcard") is None
    assert "fv-badcard/never-registered" not in host.hooks.samplers()
    assert "never-registered" not in host.registry().sampler_names()
    # Every other plugin keeps working.
    assert list(CardCatalog(host).entries()) == ["toy-dit"]
    assert "euler-shift3" in host.registry().sampler_names()


def test_registration_runs_once_at_start_in_a_deterministic_order(fv_host: PluginHost) -> None:
    calls: list[str] = []

    def plugin(name: str, card_id: str) -> types.ModuleType:
        @hookimpl
        def fv_register_model_cards(register):  # noqa: ANN001
            calls.append(name)
            register(card_id, toy_card("toy-dit").model_copy(update={"model_id": card_id}))

        module = types.ModuleType(name)
        module.fv_register_model_cards = fv_register_model_cards  # type: ignore[attr-defined]
        return module

    fv_host.register(plugin("fv-one", "one"), name="fv-one")
    fv_host.register(plugin("fv-two", "two"), name="fv-two")
    assert calls == ["fv-one", "fv-two"]
    for _ in range(3):
        CardCatalog(fv_host).entries()
    assert calls == ["fv-one", "fv-two"]  # lookups never call a plugin again


@pytest.mark.parametrize(
    ("registrations", "needle"),
    [
        ({"fv_register_model_cards": lambda register: register("other-name", toy_card("toy-dit"))},
         "registered as 'other-name' but its model_id is 'toy-dit'"),
        ({"fv_register_samplers": lambda register: register("euler-shift9", FlowEulerSampler)},
         "registered as 'euler-shift9' but its name is 'euler'"),
        ({"fv_register_samplers": lambda register: register("not-a-sampler", dict)},
         "must be a subclass of fv_kernel.loop.samplers:Sampler, got dict"),
        ({"fv_register_model_cards": lambda register: register("toy-dit", {"model_id": "toy-dit"})},
         "must be an instance of fv_kernel.card:ModelCard, got dict instance"),
        ({"fv_register_loops": lambda register: (_ for _ in ()).throw(RuntimeError("boom"))},
         "failed in fv_register_loops: RuntimeError: boom"),
    ],
)
def test_invalid_contributions_disable_only_their_plugin(
    fv_host: PluginHost, register_plugin: Any, registrations: dict[str, Any], needle: str
) -> None:
    register_plugin(_module("good", fv_register_model_cards=_card_hook("good-card")), name="fv-good-one")
    bad = _module("bad", **{hook: hookimpl(_named(hook, body)) for hook, body in registrations.items()})
    with pytest.raises(PluginError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        fv_host.register(bad, name="fv-bad-one")
    assert fv_host.record("fv-bad-one").status.value == "error" and fv_host.pm.get_plugin("fv-bad-one") is None
    assert list(CardCatalog(fv_host).entries()) == ["good-card"]


def _module(name: str, **hooks: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    for hook, impl in hooks.items():
        setattr(module, hook, impl)
    return module


def _named(hook: str, body: Any) -> Any:
    def impl(register):  # noqa: ANN001
        body(register)

    impl.__name__ = hook
    return impl


def _card_hook(card_id: str) -> Any:
    @hookimpl
    def fv_register_model_cards(register):  # noqa: ANN001
        register(card_id, toy_card("toy-dit").model_copy(update={"model_id": card_id}))

    return fv_register_model_cards


def test_a_short_name_the_kernel_owns_refuses_the_plugin_not_the_kernel(fv_host: PluginHost) -> None:
    class Impostor(FlowEulerSampler):
        name = "euler"

    plugin = _module("impostor", fv_register_samplers=hookimpl(_named("fv_register_samplers", lambda r: r("euler", Impostor))))
    # "fv-aaa" sorts before "fv-kernel", yet the kernel's built-ins load first and keep their names.
    with pytest.raises(DuplicateContributionError, match="samplers 'euler' is contributed by both 'fv-kernel' and 'fv-aaa'"):
        fv_host.register(plugin, name="fv-aaa")
    assert fv_host.registry().sampler("euler") is FlowEulerSampler


def test_explicitly_enabled_plugin_failing_in_registration_is_fatal(plugin_site: Path) -> None:
    host = PluginHost(PluginsConfig(autoload=False, enable=["fv-badcard", "fv-toy"]), search_path=[str(plugin_site)], environ={})
    with pytest.raises(PluginLoadError) as info:
        host.start()
    assert info.value.distribution == "fv-badcard" and BAD_CARD_CAUSE in str(info.value)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- every command, autoloaded bad plugin


def test_cards_commands_keep_working_beside_a_bad_plugin(plugin_site: Path, tmp_path: Path) -> None:
    config = str(deploy_yaml(tmp_path))
    listed = runner.invoke(app, ["cards", "list", "--json", "--config", config])
    assert listed.exit_code == 0, listed.output
    assert [row["model_id"] for row in json.loads(listed.stdout)] == ["toy-dit"]
    assert f"warning: fv: skipped plugin fv-badcard 0.1.0: {BAD_CARD_CAUSE}" in listed.stderr
    shown = runner.invoke(app, ["cards", "show", "toy-dit", "--config", config])
    assert shown.exit_code == 0, shown.output
    assert ModelCard.model_validate_json(shown.stdout).model_id == "toy-dit"
    # The samplers --sampler accepts: the card's own plus every registered one (the tutorial's included).
    # (Other installed plugins may add theirs: check the kernel's and the tutorial's are there.)
    listed_samplers = next(line for line in shown.stderr.splitlines() if line.startswith("samplers (--sampler): "))
    assert {"dmd", "euler", "euler-shift3", "unipc"} <= set(listed_samplers.split(": ", 1)[1].split(", "))
    validated = runner.invoke(app, ["cards", "validate", "toy-dit", "--config", config])
    assert validated.exit_code == 0, validated.output
    assert "ok: toy-dit" in validated.stdout
    missing = runner.invoke(app, ["cards", "show", "bad-dit", "--config", config])
    assert missing.exit_code == 2 and "error: model: unknown card 'bad-dit'" in missing.stderr


def test_plugins_list_shows_the_registration_error(plugin_site: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["plugins", "list", "--config", str(deploy_yaml(tmp_path))])
    assert result.exit_code == 0, result.output
    assert f"fv-badcard 0.1.0  [error]  {BAD_CARD_CAUSE}" in result.stdout
    assert "fv-toy 0.2.0  [enabled]  autoload" in result.stdout


def test_generate_keeps_working_beside_a_bad_plugin(plugin_site: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    result = runner.invoke(
        app, ["generate", "-m", "toy-dit", "-p", "a red ball", "-o", str(out), "-q", "--config", str(deploy_yaml(tmp_path))]
    )
    assert result.exit_code == 0, result.output
    assert out.is_file() and "wrote" in result.stdout


def test_serve_keeps_working_beside_a_bad_plugin(plugin_site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fv_kernel.serving as serving

    served: dict[str, Any] = {}
    real_create_app = serving.create_app

    def create_app(engine: Any, deploy: Any, **kwargs: Any) -> Any:
        served["engine"] = engine
        return real_create_app(engine, deploy, **kwargs)

    monkeypatch.setattr(serving, "create_app", create_app)
    monkeypatch.setattr(serving, "serve_forever", lambda app, **kw: served.update(kw))
    config = deploy_yaml(tmp_path, f"output_dir: {json.dumps(str(tmp_path / 'served'))}\n")
    result = runner.invoke(app, ["serve", "-m", "toy-dit", "--port", "0", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert "fv serve: toy-dit on http://127.0.0.1:0" in result.stderr and "skipped plugin fv-badcard" in result.stderr
    engine = served["engine"]
    request = Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="x"),))
    assert engine.generate(request).status == "completed"


# --------------------------------------------------------------------------- every command, explicitly enabled bad plugin

COMMANDS = {
    "plugins list": ["plugins", "list"],
    "cards list": ["cards", "list"],
    "cards show": ["cards", "show", "toy-dit"],
    "cards validate": ["cards", "validate", "toy-dit"],
    "generate": ["generate", "-m", "toy-dit", "-p", "x", "-o", "OUT"],
    "serve": ["serve", "-m", "toy-dit"],
}


def _only_error_line(result: Any, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize(
    ("selection", "plugin", "cause"),
    [
        ("env", "fv-badcard", BAD_CARD_CAUSE),
        ("config", "fv-badcard", BAD_CARD_CAUSE),
        ("env", "fv-broken", "importing fv_broken.plugin raised RuntimeError: fv_broken exploded at import"),
        ("config", "fv-broken", "importing fv_broken.plugin raised RuntimeError: fv_broken exploded at import"),
    ],
)
def test_explicit_failure_stops_every_command_with_one_line(
    plugin_site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, selection: str, plugin: str, cause: str
) -> None:
    args = [a.replace("OUT", str(tmp_path / "out.pt")) for a in COMMANDS[command]]
    if selection == "env":
        monkeypatch.setenv("FV_PLUGINS", f"fv-toy,{plugin}")
    else:
        config = tmp_path / "deploy.yaml"
        config.write_text(f"plugins: {{autoload: false, enable: [fv-toy, {plugin}]}}\n")
        args += ["--config", str(config)]
    result = runner.invoke(app, args)
    _only_error_line(result, f"plugin {plugin} ", cause)
    assert not (tmp_path / "out.pt").exists()


# --------------------------------------------------------------------------- one --config, strict everywhere


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("plugins: {autoload: true}\nengine: {gpus: 1}\n", "engine: Extra inputs are not permitted"),
        ("plugins: {autolaod: true}\n", "plugins.autolaod: Extra inputs are not permitted"),
        ("cards: [{model: toy-dit, compute: {bogus: 1}}]\n", "cards.0.compute.bogus: Extra inputs are not permitted"),
    ],
)
def test_every_command_rejects_unknown_config_keys(tmp_path: Path, command: str, body: str, needle: str) -> None:
    config = tmp_path / "deploy.yaml"
    config.write_text(body)
    args = [a.replace("OUT", str(tmp_path / "out.pt")) for a in COMMANDS[command]] + ["--config", str(config)]
    _only_error_line(runner.invoke(app, args), str(config), needle)


def test_plugins_load_kernel_first_then_by_name(plugin_site: Path) -> None:
    # The order decides which of two plugins contributing one short name is refused: it must not depend on sys.path.
    host = PluginHost(PluginsConfig(), search_path=[str(plugin_site)], environ={})
    order = [p.distribution for p in host._loadable().plugins]
    assert order == ["fv-kernel", "fv-bad", "fv-badcard", "fv-broken", "fv-good", "fv-hello", "fv-oldapi", "fv-toy"]
