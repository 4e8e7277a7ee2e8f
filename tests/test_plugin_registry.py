"""The deploy-scope registry: plugin samplers, loops and attention backends are usable by name.

``fv-hello`` is the tutorial's plugin (``docs/plugins.md``), installed here as a fixture
distribution: its ``euler-shift3`` sampler and ``hello-math`` attention backend must be
usable in a card's loop spec, in ``sampler_from_state``, from ``fv generate`` and in a
deploy config, and refused when the plugin is not enabled.
"""

from __future__ import annotations

import json
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from fv_kernel.api import (
    DiffusionParams,
    Engine,
    FlowEulerSampler,
    InstanceOptions,
    LoopSpec,
    ModelCard,
    RecipeMismatch,
    Request,
    SamplerBinding,
    TaskType,
    TextPart,
    build_instance,
    hookimpl,
    resolve_request,
    sampler_from_state,
)
from fv_kernel.cli.app import app
from fv_kernel.compute.attention import SDPAAttention
from fv_kernel.config import CardDeployment, DeployConfig
from fv_kernel.errors import InvalidRequest
from fv_kernel.loop.samplers import SamplerError, use_samplers
from fv_kernel.plugins import PluginHost, PluginsConfig, PluginWarning, UnknownContributionError, UnknownDriverError
from fv_kernel.plugins.registry import kernel_registry
from fv_kernel.deploy.engine import build_engine
from fv_kernel.deploy.options import deployment_options
from fv_kernel.testing.toy import ToyDenoiseLoop, toy_card

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_env_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FV_PLUGINS", raising=False)


def host_with(site: Path, *enabled: str) -> PluginHost:
    host = PluginHost(PluginsConfig(autoload=False, enable=list(enabled)), search_path=[str(site)], environ={})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)
        host.start()
    return host


def with_denoise_sampler(binding: SamplerBinding, model_id: str = "toy-dit") -> ModelCard:
    card = toy_card("toy-dit")
    loops = dict(card.loops)
    loops["denoise"] = loops["denoise"].model_copy(update={"sampler": binding})
    return card.model_copy(update={"loops": loops, "model_id": model_id})


def video(engine: Engine, **diffusion: Any) -> torch.Tensor:
    request = Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a red ball"),),
                      diffusion=DiffusionParams(seed=3, **diffusion))
    result = engine.generate(request)
    assert result.status == "completed", result.error
    return result.artifact("video").frames  # type: ignore[union-attr]


def engine_for(card: ModelCard, registry: Any) -> Engine:
    engine = Engine()
    engine.add_instance(build_instance(card, InstanceOptions(registry=registry)))
    return engine


# --------------------------------------------------------------------------- samplers


@pytest.mark.parametrize("name", ["euler-shift3", "fv-hello/euler-shift3"])
def test_a_card_loop_spec_may_name_a_plugin_sampler(plugin_site: Path, name: str) -> None:
    registry = host_with(plugin_site, "fv-hello").registry()
    plugin = video(engine_for(with_denoise_sampler(SamplerBinding(name=name)), registry))
    # EulerShift3 is flow Euler with shift 3: the same trajectory as the kernel's euler at shift 3.
    reference = video(engine_for(with_denoise_sampler(SamplerBinding(name="euler", config={"shift": 3.0})), registry))
    unshifted = video(engine_for(with_denoise_sampler(SamplerBinding(name="euler", config={"shift": 1.0})), registry))
    assert torch.equal(plugin, reference) and not torch.equal(plugin, unshifted)


def test_a_card_naming_a_sampler_the_deployment_lacks_fails_at_build(plugin_site: Path) -> None:
    card = with_denoise_sampler(SamplerBinding(name="euler-shift3"))
    with pytest.raises(UnknownContributionError, match="no samplers contribution 'euler-shift3' is enabled in this deployment"):
        build_instance(card, InstanceOptions())  # no registry: the kernel's built-ins only
    disabled = host_with(plugin_site, "fv-toy")  # fv-hello installed, not enabled
    with pytest.raises(UnknownContributionError, match="available: fv-kernel/dmd, fv-kernel/euler, fv-kernel/unipc"):
        build_instance(card, InstanceOptions(registry=disabled.registry()))


def test_sampler_from_state_resolves_only_registered_samplers(plugin_site: Path) -> None:
    registry = host_with(plugin_site, "fv-hello").registry()
    shift3 = registry.sampler("euler-shift3")
    state = shift3().init_state(4)
    assert state.sampler.startswith("euler-shift3:")
    with use_samplers(registry.samplers):
        rebuilt = sampler_from_state(state)
    assert type(rebuilt) is shift3 and rebuilt.shift == 3.0
    # States are data, never code: outside that deployment the name is refused, listing what is allowed.
    with pytest.raises(SamplerError, match=r"sampler 'euler-shift3', which is not registered here; allowed: \['dmd', 'euler', 'unipc'\]"):
        sampler_from_state(state)
    with use_samplers(host_with(plugin_site, "fv-toy").registry().samplers), pytest.raises(SamplerError, match="euler-shift3"):
        sampler_from_state(state)
    # A forged signature naming an importable class is refused just the same.
    forged = state.model_copy(update={"sampler": 'fv_hello.samplers:EulerShift3:{"shift":3.0}'})
    with use_samplers(registry.samplers), pytest.raises(SamplerError, match="not registered here"):
        sampler_from_state(forged)


def test_a_request_may_name_a_registered_sampler_for_the_default_loop(plugin_site: Path) -> None:
    registry = host_with(plugin_site, "fv-hello").registry()
    engine = engine_for(toy_card("toy-dit"), registry)
    assert torch.equal(video(engine, sampler="euler-shift3"), video(engine, sampler="euler", shift=3.0))
    assert not torch.equal(video(engine, sampler="euler-shift3"), video(engine))
    # A sampler a card loop binds selects that loop, with the loop's config (toy-dit: unipc at shift 3).
    assert torch.equal(video(engine, sampler="unipc"), video(engine_for(toy_card("toy-dit"), None), sampler="unipc"))
    with pytest.raises(InvalidRequest, match=r"sampler: .*'nope'.*allowed: dmd, euler, euler-shift3, unipc"):
        engine.validate(Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="x"),),
                                diffusion=DiffusionParams(sampler="nope")))
    without = engine_for(toy_card("toy-dit"), kernel_registry())
    with pytest.raises(InvalidRequest, match=r"'euler-shift3'.*allowed: dmd, euler, unipc$"):
        without.validate(Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="x"),),
                                 diffusion=DiffusionParams(sampler="euler-shift3")))


def test_a_recipe_that_fixes_the_loop_still_refuses_other_samplers(plugin_site: Path) -> None:
    registry = host_with(plugin_site, "fv-hello").registry()
    card = toy_card("toy-dit")
    card = card.model_copy(update={"recipe": card.recipe.model_copy(update={"method": "dmd2", "assumes_loop": "denoise"})})
    request = Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="x"),),
                      diffusion=DiffusionParams(sampler="euler-shift3"))
    with pytest.raises(RecipeMismatch, match="dmd2"):
        resolve_request(card, request, samplers=registry.sampler_names())


# --------------------------------------------------------------------------- fv generate --sampler


def test_fv_generate_runs_a_plugin_sampler_by_name(plugin_site: Path, tmp_path: Path) -> None:
    config = tmp_path / "deploy.yaml"
    config.write_text("plugins: {autoload: false, enable: [fv-toy, fv-hello]}\n")

    def generate(name: str, *extra: str) -> torch.Tensor:
        out = tmp_path / f"{name}.pt"
        result = runner.invoke(app, ["generate", "-m", "toy-dit", "-p", "a red ball", "-o", str(out), "-q",
                                     "--seed", "3", "--config", str(config), *extra])
        assert result.exit_code == 0, result.output
        return torch.load(out)

    shifted = generate("plugin", "--sampler", "euler-shift3")
    assert torch.equal(shifted, generate("euler3", "--sampler", "euler", "--shift", "3"))
    assert not torch.equal(shifted, generate("default"))
    config.write_text("plugins: {autoload: false, enable: [fv-toy]}\n")  # fv-hello installed but not enabled
    refused = runner.invoke(app, ["generate", "-m", "toy-dit", "-p", "x", "-o", str(tmp_path / "no.pt"),
                                  "--sampler", "euler-shift3", "--config", str(config)])
    assert refused.exit_code == 2
    assert "error: sampler: card 'toy-dit' has no denoise loop with sampler 'euler-shift3'" in refused.output
    assert "allowed: dmd, euler, unipc" in refused.output and not (tmp_path / "no.pt").exists()


# --------------------------------------------------------------------------- loops


def loop_plugin() -> types.ModuleType:
    @hookimpl
    def fv_register_loops(register):  # noqa: ANN001
        register("toy-denoise", ToyDenoiseLoop)

    module = types.ModuleType("fv_loops_plugin")
    module.fv_register_loops = fv_register_loops  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize("implementation", ["fv-loops/toy-denoise", "toy-denoise"])
def test_a_card_loop_may_name_a_registered_loop(fv_host: PluginHost, register_plugin: Any, implementation: str) -> None:
    register_plugin(loop_plugin(), name="fv-loops")
    card = toy_card("toy-dit")
    loops = dict(card.loops)
    loops["denoise"] = loops["denoise"].model_copy(update={"implementation": implementation})
    named = card.model_copy(update={"loops": loops})
    instance = build_instance(named, InstanceOptions(registry=fv_host.registry()))
    assert instance.loop_class("denoise") is ToyDenoiseLoop
    assert torch.equal(video(engine_for(named, fv_host.registry())), video(engine_for(card, None)))
    with pytest.raises(UnknownContributionError, match=f"no loops contribution {implementation!r}.*available: <none>"):
        build_instance(named, InstanceOptions())  # a deployment without the plugin


def test_loop_spec_implementation_is_an_import_string_or_a_loop_name() -> None:
    spec = toy_card("toy-dit").loops["denoise"]
    for ok in ("fv-hello/my-loop", "my-loop", "pkg.mod:Loop"):
        assert LoopSpec.model_validate({**spec.model_dump(), "implementation": ok}).implementation == ok
    for bad in ("not a name", "a/b/c", "pkg.mod:", "/x"):
        with pytest.raises(ValueError, match="implementation"):
            LoopSpec.model_validate({**spec.model_dump(), "implementation": bad})


# --------------------------------------------------------------------------- attention backends


def test_hello_math_matches_softmax_attention() -> None:
    import importlib.util
    import sys

    path = Path(__file__).parent / "fixtures" / "plugins" / "fv-hello" / "fv_hello" / "attention.py"
    spec = importlib.util.spec_from_file_location("hello_attention_under_test", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.pop("hello_attention_under_test", None)
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.rand(2, 1, 5, 5) > 0.3
    mask[..., 0] = True
    ours, sdpa = module.MathAttention(), SDPAAttention()
    torch.testing.assert_close(ours.attend(q, k, v), sdpa.attend(q, k, v), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.attend(q, k, v, attn_mask=mask), sdpa.attend(q, k, v, attn_mask=mask), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.attend(q, k, v, is_causal=True), sdpa.attend(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5)


def test_a_deployment_may_use_an_enabled_plugins_attention_backend(plugin_site: Path) -> None:
    host = host_with(plugin_site, "fv-hello", "fv-toy")
    options = deployment_options(CardDeployment(model="toy-dit", attention_backend="hello-math"), host.registry())
    assert options.registry is host.registry() and options.attention_backend == "hello-math"
    backend = options.registry.attention_backend("hello-math")
    assert type(backend).__module__ == "fv_hello.attention" and backend.name == "hello-math"
    engine = build_engine(DeployConfig(cards=[CardDeployment(model="toy-dit", attention_backend="hello-math")]), host=host)
    instance = engine.instances["toy-dit"]
    assert instance.options.attention_backend == "hello-math" and instance.registry is host.registry()


def test_a_disabled_plugins_attention_backend_is_refused(plugin_site: Path) -> None:
    host = host_with(plugin_site, "fv-toy")  # fv-hello installed, not enabled
    config = DeployConfig(cards=[CardDeployment(model="toy-dit", attention_backend="hello-math")])
    with pytest.raises(UnknownDriverError, match=r"no attention_backends driver named 'hello-math'.*'fv-hello' is not an enabled fv plugin"):
        build_engine(config, host=host)
    # Code given no registry never reaches installed-but-disabled plugins either.
    with pytest.raises(UnknownDriverError, match=r"no attention_backends driver named 'hello-math'.*available: flash_attn2, "):
        kernel_registry().attention_backend("hello-math")
    assert isinstance(kernel_registry().attention_backend("sdpa"), SDPAAttention)


def test_fv_serve_refuses_a_disabled_plugins_backend_in_one_line(plugin_site: Path, tmp_path: Path) -> None:
    config = tmp_path / "deploy.yaml"
    config.write_text("plugins: {autoload: false, enable: [fv-toy]}\ncards: [{model: toy-dit, attention_backend: hello-math}]\n")
    result = runner.invoke(app, ["serve", "--config", str(config)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "error: no attention_backends driver named 'hello-math'" in result.output
    assert "'fv-hello' is not an enabled fv plugin" in result.output


def test_plugins_json_lists_usable_names(plugin_site: Path, tmp_path: Path) -> None:
    config = tmp_path / "deploy.yaml"
    config.write_text("plugins: {autoload: false, enable: [fv-hello]}\n")
    rows = {r["name"]: r for r in json.loads(runner.invoke(app, ["plugins", "list", "--json", "--config", str(config)]).stdout)}
    assert rows["fv-hello"]["registered"]["samplers"] == ["fv-hello/euler-shift3"]
    assert "fv-kernel/euler" in rows["fv-kernel"]["registered"]["samplers"]
    assert FlowEulerSampler.name == "euler"


def test_fv_generate_takes_the_configs_card_entry_and_limits(plugin_site: Path, tmp_path: Path) -> None:
    config = tmp_path / "deploy.yaml"
    out = tmp_path / "out.pt"
    args = ["generate", "-m", "toy-dit", "-p", "x", "-o", str(out), "-q", "--config", str(config)]
    entry = "cards: [{model: toy-dit, attention_backend: hello-math}]\n"
    config.write_text("plugins: {autoload: false, enable: [fv-toy, fv-hello]}\n" + entry)
    assert runner.invoke(app, args).exit_code == 0 and out.is_file()
    out.unlink()
    # The card entry's backend is checked against this deployment's enabled plugins before anything loads.
    config.write_text("plugins: {autoload: false, enable: [fv-toy]}\n" + entry)
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2 and "'fv-hello' is not an enabled fv plugin" in refused.output and not out.exists()
    # The config's limits apply to fv generate as they do to fv serve.
    config.write_text("plugins: {autoload: false, enable: [fv-toy]}\nlimits: {max_steps: 2}\n")
    limited = runner.invoke(app, [*args, "--steps", "5"])
    assert limited.exit_code == 2 and "error: steps: 5 exceeds this deployment's limit; allowed: <= 2" in limited.output


def test_card_files_resolve_their_names_in_the_deployment(plugin_site: Path, tmp_path: Path) -> None:
    path = tmp_path / "shift3.json"
    path.write_text(with_denoise_sampler(SamplerBinding(name="euler-shift3"), model_id="toy-shift3").model_dump_json())
    config = tmp_path / "deploy.yaml"
    config.write_text("plugins: {autoload: false, enable: [fv-hello]}\n")
    ok = runner.invoke(app, ["cards", "validate", str(path), "--config", str(config)])
    assert ok.exit_code == 0 and "ok: toy-shift3" in ok.stdout, ok.output
    out = tmp_path / "out.pt"
    made = runner.invoke(app, ["generate", "-m", str(path), "-p", "x", "-o", str(out), "-q", "--config", str(config)])
    assert made.exit_code == 0 and out.is_file(), made.output
    config.write_text("plugins: {autoload: false}\n")
    refused = runner.invoke(app, ["cards", "validate", str(path), "--config", str(config)])
    assert refused.exit_code == 1
    assert "loops.denoise.sampler.name: no samplers contribution 'euler-shift3' is enabled in this deployment" in refused.output


def test_build_check_resolves_registered_loops(fv_host: PluginHost, register_plugin: Any) -> None:
    from fv_kernel.model.buildcheck import check_card_builds

    card = toy_card("toy-dit")
    loops = dict(card.loops)
    loops["denoise"] = loops["denoise"].model_copy(update={"implementation": "fv-loops/toy-denoise"})
    named = card.model_copy(update={"loops": loops})
    problems = check_card_builds(named, registry=fv_host.registry())
    assert [str(p) for p in problems] == [
        "loops.denoise.implementation: no loops contribution 'fv-loops/toy-denoise' is enabled in this deployment; available: <none>"
    ]
    register_plugin(loop_plugin(), name="fv-loops")
    assert check_card_builds(named, registry=fv_host.registry()) == []


def test_fv_generate_applies_the_configs_scheduler_and_extensions(
    plugin_site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fv_kernel.deploy.engine as deploy

    engines: list[Engine] = []

    class RecordingEngine(Engine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(deploy, "Engine", RecordingEngine)  # fv generate builds its engine through deploy.engine_for
    config = tmp_path / "deploy.yaml"
    out = tmp_path / "out.pt"
    args = ["generate", "-m", "toy-dit", "-p", "x", "-o", str(out), "-q", "--config", str(config)]
    config.write_text("plugins: {autoload: false, enable: [fv-toy]}\nscheduler: {max_queue: 7}\nextensions: {nanwatch: {default_on: true}}\n")
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert engines[-1].config.max_queue == 7
    assert [type(o).__name__ for o in engines[-1].extensions.observers] == ["NaNWatch"]
    config.write_text("plugins: {autoload: false, enable: [fv-toy]}\nextensions: {nope: {}}\n")
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2 and "error: extensions.nope: no enabled plugin provides it; available: nanwatch" in refused.output


# --------------------------------------------------------------------------- the conformance kit


def test_the_card_kit_checks_a_card_naming_its_plugins_sampler_and_loop(plugin_site: Path) -> None:
    """A third-party card may bind its plugin's sampler and name a registered loop: the kit builds
    instances with the deployment's registry, so its checks run on such a card."""
    from fv_kernel.testing import CardConformance, InterleaveConformance

    card = with_denoise_sampler(SamplerBinding(name="euler-shift3"), model_id="toy-shift3")
    hello = host_with(plugin_site, "fv-hello")

    class Kit:
        card_ids = ("toy-shift3",)
        steps = 2

        def load_card(self, model_id: str) -> ModelCard:
            return card

        def registry(self) -> Any:
            return hello.registry()

    class Cards(Kit, CardConformance):
        pass

    class Gate(Kit, InterleaveConformance):
        pass

    Cards().test_loops_implement_the_contract()
    Cards().test_loop_state_roundtrip_is_bit_identical()
    Gate().test_interleaved_equals_each_alone()

    class WithoutThePlugin(Cards):
        def registry(self) -> Any:
            return kernel_registry()

    # Negative control: built with the kernel's built-ins only, the same card cannot run.
    with pytest.raises(UnknownContributionError, match="euler-shift3"):
        WithoutThePlugin().test_loop_state_roundtrip_is_bit_identical()
