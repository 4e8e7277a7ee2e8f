"""docs/plugins.md, "Migrating a plugin from API 1 to 2": every block and every row of the table is checked.

- "API 2" blocks (```python after) are verbatim parts of docs/examples/migrated_plugin.py, which is
  installed as the distribution fv-mine with the guide's API 2 manifest, loaded by a plugin host,
  checked by `fv plugins check`, run through the Engine and through the guide's conformance classes
  (the ```python tests block, run as written).
- The API 1 manifest is refused through the real paths (autoloaded, explicitly enabled, `fv plugins
  check`) with the lines the guide quotes, before the plugin's code is imported.
- "API 1" blocks (```python before) fail under the current kernel where the guide says they do, and
  run under the API 1 kernel itself (the last commit before API 2, exported from git history; skipped
  when the clone has no history), which also confirms the table's "API 1" column.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import json
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch
import yaml
from packaging.specifiers import SpecifierSet
from pydantic import ValidationError
from typer.testing import CliRunner

import fv_kernel
from fv_kernel.api import (
    API_VERSION,
    CancelScope,
    DiffusionParams,
    Engine,
    InlineProgram,
    InstanceOptions,
    Loop,
    LoopState,
    ModelCard,
    OutputSpec,
    PluginError,
    Program,
    Request,
    RLMethod,
    SamplerState,
    StateNotSerializable,
    TaskType,
    TextPart,
    WorkKind,
    WorkPlan,
    build_instance,
    builtin_samplers,
    hookimpl,
    run_local,
)
from fv_kernel.cli.app import app
from fv_kernel.plugins import PluginHost, PluginStatus
from fv_kernel.testing import InterleaveConformance, StepRecorder, assert_estimate_covers_execution

from conftest import materialise_distribution

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "plugins.md"
EXAMPLE = ROOT / "docs" / "examples" / "migrated_plugin.py"
#: The last commit of plugin API 1 (fv-kernel 0.1.0); the next commits made the API 2 changes.
API1_COMMIT = "fe2a8891436aeeae1d31072e3c22e316bba20e0e"
TITLE = "# Migrating a plugin from API 1 to 2"

_BLOCK = re.compile(r"^```(\w+) (before|after|tests)\n(.*?)^```", re.S | re.M)
_TEXT = re.compile(r"^```text\n(.*?)^```", re.S | re.M)


def migration_section(markdown: str) -> str:
    """The guide: from its title to the next top-level heading outside a code block (or the end)."""
    lines = markdown.splitlines(keepends=True)
    start = lines.index(f"{TITLE}\n")
    fenced = False
    for end in range(start + 1, len(lines)):
        fenced ^= lines[end].startswith("```")
        if not fenced and lines[end].startswith("# "):
            break
    else:
        end = len(lines)
    return "".join(lines[start:end])


SECTION = migration_section(DOC.read_text(encoding="utf-8"))


def blocks(lang: str, tag: str, section: str = SECTION) -> list[str]:
    return [body for found_lang, found_tag, body in _BLOCK.findall(section) if (found_lang, found_tag) == (lang, tag)]


def quoted(prefix: str) -> str:
    """The inline code the guide writes after ``prefix`` (a code span may wrap lines)."""
    match = re.search(re.escape(prefix) + r"\s*`([^`]+)`", SECTION)
    assert match, f"the guide no longer quotes anything after {prefix!r}"
    return " ".join(match.group(1).split())


def shown_in(block: str, source: str) -> bool:
    """``block`` is a verbatim part of ``source``, at the top level or as a method (indented once)."""
    for indent in ("", "    "):
        lines = [indent + line if line.strip() else line for line in block.splitlines()]
        if "\n".join(lines) in source:
            return True
    return False


# --------------------------------------------------------------------------- fv-mine, installed

_SITES = Path(tempfile.mkdtemp(prefix="fv-migration-"))
atexit.register(shutil.rmtree, _SITES, True)


def _install(site: Path, manifest: str, plugin_source: str) -> Path:
    """fv-mine as a discoverable distribution in ``site``: the guide's manifest, ``plugin_source`` as fv_mine/plugin.py."""
    version = yaml.safe_load(manifest)["version"]
    source = site.parent / f"{site.name}-source"
    (source / "fv_mine").mkdir(parents=True)
    (source / "fv_mine" / "__init__.py").write_text("")
    (source / "fv_mine" / "plugin.py").write_text(plugin_source)
    (source / "fv_mine" / "fv-plugin.yaml").write_text(manifest)
    (source / "pyproject.toml").write_text(
        f'[project]\nname = "fv-mine"\nversion = "{version}"\n\n'
        '[project.entry-points."fv.plugins"]\nfv-mine = "fv_mine.plugin"\n'
    )
    site.mkdir()
    materialise_distribution(source, site)
    return site


#: fv-mine 0.2.0: the migrated module with the guide's API 2 manifest.
AFTER_SITE = _install(_SITES / "after", blocks("yaml", "after")[0], EXAMPLE.read_text(encoding="utf-8"))
#: fv-mine 0.1.0 with the guide's API 1 manifest; importing its code would raise, so a refusal that
#: names the kernel API proves the code was never imported.
BEFORE_SITE = _install(_SITES / "before", blocks("yaml", "before")[0], "raise RuntimeError('fv_mine was imported')\n")


def _forget_fv_mine() -> None:
    for name in [n for n in sys.modules if n.split(".")[0] == "fv_mine"]:
        del sys.modules[name]


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``on_path(site)`` puts one fv-mine on ``sys.path`` for this test (never both)."""

    def put(site: Path) -> None:
        monkeypatch.syspath_prepend(str(site))
        importlib.invalidate_caches()

    _forget_fv_mine()
    yield put
    _forget_fv_mine()


def after_host() -> PluginHost:
    host = PluginHost(search_path=[str(AFTER_SITE)], environ={})
    host.start()
    return host


@pytest.fixture
def fv_mine(on_path: Any) -> Iterator[tuple[Any, PluginHost]]:
    """The migrated plugin module, loaded by a plugin host that sees only the kernel and fv-mine 0.2.0."""
    on_path(AFTER_SITE)
    host = after_host()
    yield sys.modules["fv_mine.plugin"], host


def request(**diffusion: Any) -> Request:
    return Request(model="mine-tiny", task=TaskType.TEXT_TO_IMAGE, inputs=(TextPart(text="a red fox"),),
                   diffusion=DiffusionParams(**diffusion))


def engine_for(host: PluginHost, card: ModelCard, *observers: Any) -> Engine:
    engine = Engine()
    engine.observers.extend(observers)
    engine.add_instance(build_instance(card, InstanceOptions(registry=host.registry())))
    return engine


# --------------------------------------------------------------------------- the guide's blocks


def test_the_guide_has_its_blocks() -> None:
    # The extraction reads what it thinks it reads (one manifest each side, the code on both sides).
    assert len(blocks("yaml", "before")) == len(blocks("yaml", "after")) == 1
    assert len(blocks("python", "before")) == 5 and len(blocks("python", "after")) == 5
    assert len(blocks("python", "tests")) == 1 and len(blocks("toml", "after")) == 1


def test_the_section_ends_at_the_next_heading_outside_a_code_block() -> None:
    doc = f"# Before\n{TITLE}\n```bash\n# a comment, not a heading\n```\nkept\n# After\ndropped\n"
    assert migration_section(doc) == f"{TITLE}\n```bash\n# a comment, not a heading\n```\nkept\n"
    assert SECTION.startswith(TITLE) and "Check your plugin" in SECTION


def test_every_api2_block_is_part_of_the_migrated_module() -> None:
    source = EXAMPLE.read_text(encoding="utf-8")
    missing = [block.splitlines()[0] for block in blocks("python", "after") if not shown_in(block, source)]
    assert not missing, f"API 2 blocks not found verbatim in {EXAMPLE.name}: {missing}"


def test_the_verbatim_check_catches_a_drifted_block() -> None:
    # Negative control: one changed name in a shown block, and a method shown at the wrong depth.
    source = EXAMPLE.read_text(encoding="utf-8")
    denoise = next(b for b in blocks("python", "after") if b.startswith("DENOISE"))
    assert not shown_in(denoise.replace("euler-shift5", "euler-shift3"), source)
    bind = next(b for b in blocks("python", "after") if b.startswith("def bind"))
    assert not shown_in(textwrap.indent(bind, "        "), source)


def test_the_packaging_line_admits_this_kernel_and_the_old_one_does_not() -> None:
    after = re.search(r'"fv-kernel([^"]+)"', blocks("toml", "after")[0])
    assert after and fv_kernel.__version__ in SpecifierSet(after.group(1))
    assert '`dependencies = ["fv-kernel>=0.1,<0.2"]`' in SECTION
    assert fv_kernel.__version__ not in SpecifierSet(">=0.1,<0.2")


# --------------------------------------------------------------------------- API 1 refused, API 2 loaded


def test_an_autoloaded_api1_plugin_is_skipped_with_the_quoted_line(on_path: Any) -> None:
    warning, _ = _TEXT.findall(SECTION)[0].splitlines()
    on_path(BEFORE_SITE)
    result = CliRunner().invoke(app, ["plugins", "list", "--json"], env={"FV_PLUGINS": None})
    assert result.exit_code == 0, result.output
    assert warning in result.stderr.splitlines()
    row = next(r for r in json.loads(result.stdout) if r["name"] == "fv-mine")
    assert row["status"] == "error" and "fv_mine was imported" not in result.output


def test_an_explicitly_enabled_api1_plugin_stops_the_command_with_the_quoted_line(on_path: Any) -> None:
    _, error = _TEXT.findall(SECTION)[0].splitlines()
    on_path(BEFORE_SITE)
    result = CliRunner().invoke(app, ["plugins", "list"], env={"FV_PLUGINS": "fv-mine"})
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [error]
    assert f"provides API version '{API_VERSION}'" in error


def test_fv_plugins_check_fails_the_api1_manifest_as_quoted(on_path: Any) -> None:
    on_path(BEFORE_SITE)
    result = CliRunner().invoke(app, ["plugins", "check", "fv-mine", "--no-side-effects"])
    assert result.exit_code == 1
    assert _TEXT.findall(SECTION)[1] in result.stdout


def test_the_api2_plugin_loads_and_passes_fv_plugins_check(on_path: Any) -> None:
    on_path(AFTER_SITE)
    host = after_host()
    record = host.record("fv-mine")
    assert record.status is PluginStatus.ENABLED, record.reason
    for kind, ids in {"samplers": ["fv-mine/euler-shift5"], "model_cards": ["fv-mine/mine-tiny"]}.items():
        assert [i for i in host.hooks.contributions(kind) if i.startswith("fv-mine/")] == ids
    result = CliRunner().invoke(app, ["plugins", "check", "fv-mine", "--no-side-effects"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith("fv-mine: all checks passed")


# --------------------------------------------------------------------------- the migrated plugin runs


def test_the_card_runs_its_plugin_sampler_and_a_requested_one(fv_mine: tuple[Any, PluginHost]) -> None:
    plugin, host = fv_mine
    engine = engine_for(host, plugin.CARD)
    default = engine.generate(request(seed=3)).raise_for_status().artifacts[0].latent
    euler = engine.generate(request(seed=3, sampler="euler")).raise_for_status().artifacts[0].latent
    # euler-shift5 by default, the kernel's euler when the request names it: same noise, different schedules.
    assert default.shape == euler.shape == (1, 4) and not torch.equal(default, euler)
    again = engine.generate(request(seed=3)).raise_for_status().artifacts[0].latent
    assert torch.equal(default, again)


def test_the_estimate_describes_exactly_the_steps_that_run(fv_mine: tuple[Any, PluginHost]) -> None:
    plugin, host = fv_mine
    for steps in (1, 4):
        assert_estimate_covers_execution(engine_for(host, plugin.CARD, StepRecorder()), request(seed=0, steps=steps))


def test_bind_runs_once_per_instance_before_any_request(fv_mine: tuple[Any, PluginHost]) -> None:
    plugin, host = fv_mine
    instance = build_instance(plugin.CARD, InstanceOptions(registry=host.registry()))
    loop = instance.loop("denoise")
    assert loop.channels == 4 and instance.loop("denoise") is loop


class _FvMine:
    """The guide's conformance classes, run against fv-mine 0.2.0 alone (not whatever else is installed)."""

    @pytest.fixture(autouse=True)
    def _fv_mine_on_path(self, on_path: Any) -> None:
        on_path(AFTER_SITE)

    def plugin_host(self) -> PluginHost:
        if str(AFTER_SITE) not in sys.path:  # the resume kit's fresh process imports this class
            sys.path.insert(0, str(AFTER_SITE))
        host = self.__dict__.get("_fv_mine_host")
        if host is None:
            host = self.__dict__["_fv_mine_host"] = after_host()
        return host


_KIT: dict[str, Any] = {"__name__": __name__}
exec(compile(blocks("python", "tests")[0], f"{DOC.name} (tests block)", "exec"), _KIT)


class TestGuidePluginConformance(_FvMine, _KIT["TestPlugin"]):
    search_path = [str(AFTER_SITE)]


class TestGuideCardConformance(_FvMine, _KIT["TestCard"]):
    pass


class TestGuideInterleave(_FvMine, _KIT["TestGate"]):
    pass


class TestGuideResume(_FvMine, _KIT["TestResume"]):
    pass


# --------------------------------------------------------------------------- API 1 code under API 2


def _before(defines: str) -> str:
    return next(b for b in blocks("python", "before") if re.search(rf"^(class|def) {defines}\b|^{defines} =", b, re.M))


def _run_block(block: str, **names: Any) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "api1_block", **names}
    exec(compile(block, "api1 block", "exec"), namespace)
    return namespace


def test_the_api1_registration_disables_the_plugin_with_the_quoted_message() -> None:
    plugin = _run_block(_before("fv_register_samplers"))
    host = PluginHost(discover=False, environ={})
    host.start()
    with pytest.raises(PluginError) as info:
        host.register(type("Api1Plugin", (), {"fv_register_samplers": staticmethod(plugin["fv_register_samplers"])}),
                      name="fv-mine")
    assert str(info.value) == quoted("API 2 disables that plugin:")
    assert host.record("fv-mine").status is PluginStatus.ERROR


def test_registration_hooks_run_when_the_host_starts() -> None:
    calls: list[str] = []

    class Counting:
        @staticmethod
        @hookimpl
        def fv_register_samplers(register: Any) -> None:
            calls.append("samplers")

    host = PluginHost(discover=False, environ={})
    host.start()
    host.register(Counting, name="fv-counting")
    assert calls == ["samplers"]  # before anything asked for samplers (API 1 called it on first use)
    host.hooks.contributions("samplers")
    assert calls == ["samplers"]


def test_the_api1_card_is_refused_naming_graph_capture() -> None:
    with pytest.raises(ValidationError) as info:
        _run_block(_before("DENOISE"))
    [error] = info.value.errors()
    assert error["loc"] == ("graph_capture",)
    assert f"{error['loc'][0]}: {error['msg']}" == quoted("API 2 refuses it (")


def test_a_plugin_with_the_api1_card_is_disabled_naming_the_field(on_path: Any) -> None:
    # The migrated module with the API 1 LoopSpec put back: the whole plugin is refused, the field named.
    after = next(b for b in blocks("python", "after") if b.startswith("DENOISE"))
    source = EXAMPLE.read_text(encoding="utf-8")
    assert after in source
    site = _install(Path(tempfile.mkdtemp(dir=_SITES)) / "api1-card", blocks("yaml", "after")[0],
                    source.replace(after, _before("DENOISE")))
    on_path(site)
    result = CliRunner().invoke(app, ["plugins", "list", "--json"], env={"FV_PLUGINS": None})
    assert result.exit_code == 0, result.output
    row = next(r for r in json.loads(result.stdout) if r["name"] == "fv-mine")
    assert row["status"] == "error" and "graph_capture: Extra inputs are not permitted" in row["reason"], row


def test_the_api1_kit_override_fails_the_gate_with_the_quoted_type_error(fv_mine: tuple[Any, PluginHost]) -> None:
    plugin, _ = fv_mine
    kit = _run_block(_before("TestGate"))["TestGate"]
    assert issubclass(kit, InterleaveConformance)
    with pytest.raises(TypeError) as info:
        kit().gate_requests([plugin.CARD], "gate-")  # how the gate asks for its requests
    assert "got an unexpected keyword argument 'vary_size'" in str(info.value)
    assert quoted("fails in API 2 with").endswith("got an unexpected keyword argument 'vary_size'")
    assert hasattr(InterleaveConformance, "test_interleaved_equals_each_alone")
    assert not hasattr(InterleaveConformance, "test_interleaved_equals_serial")
    assert "vary_size" in inspect.signature(InterleaveConformance.requests_for).parameters


def test_the_api1_program_runs_but_is_not_resumable(
    fv_mine: tuple[Any, PluginHost], monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin, host = fv_mine
    api1 = _run_block(_before("Generate"))["Generate"]
    assert Program.resumable is False and api1.resumable is False and plugin.Generate.resumable is True
    assert InlineProgram.resumable is True  # a card's ProgramSpec(loops=...) needs nothing
    instance = build_instance(plugin.CARD, InstanceOptions(registry=host.registry()))
    expected = run_local(request(seed=1), instance)
    monkeypatch.setattr(plugin, "Generate", api1)  # the card's "fv_mine.plugin:Generate" now names the API 1 program
    assert type(instance.program(TaskType.TEXT_TO_IMAGE)) is api1
    assert torch.equal(run_local(request(seed=1), instance)[0].latent, expected[0].latent)
    with pytest.raises(AssertionError, match="is not resumable"):
        TestGuideResume().check_cards(["mine-tiny"])


def test_an_api1_estimate_in_seconds_is_reserved_as_given(
    fv_mine: tuple[Any, PluginHost], monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin, host = fv_mine
    api1 = _run_block(_before("DenoiseLoop"))["DenoiseLoop"]
    monkeypatch.setattr(plugin.DenoiseLoop, "estimate", api1.estimate)
    engine = engine_for(host, plugin.CARD)
    req = engine.validate(request(seed=0, steps=5))
    cost = plugin.CARD.loops["denoise"].step_cost
    given = cost.fixed_seconds * 5 * cost.conservative_factor
    assert engine.reservation_for(req).gpu_seconds == given
    engine.generate(req).raise_for_status()
    assert engine.reservation_for(req).gpu_seconds == given  # the Profiler's calibration does not touch it


def test_the_api1_sampler_table_knows_the_kernel_samplers_only(fv_mine: tuple[Any, PluginHost]) -> None:
    plugin, host = fv_mine
    assert "euler-shift5" in host.registry().samplers and "euler-shift5" not in builtin_samplers()
    api1 = _run_block(_before("DenoiseLoop"))["DenoiseLoop"]
    with pytest.raises(KeyError):
        api1.sampler(SimpleNamespace(spec=plugin.DENOISE))  # the card binds euler-shift5


# --------------------------------------------------------------------------- the table's other rows


def _card(plugin: Any, **changes: Any) -> dict[str, Any]:
    data = plugin.CARD.model_dump()
    for path, value in changes.items():
        *parents, last = path.split("__")
        target = data
        for part in parents:
            target = target[part]
        target[last] = value
    return data


def test_card_rules_of_api2(fv_mine: tuple[Any, PluginHost]) -> None:
    plugin, _ = fv_mine
    cases = {
        "names unknown axes ['seq']": _card(plugin, loops__denoise__valid_parallel_axes=("seq",)),
        "is causal: valid_parallel_axes may not list 'pp_patch'": _card(
            plugin, loops__denoise__causal=True, loops__denoise__valid_parallel_axes=("pp_patch",)),
        "but no loop lists 'sp' in valid_parallel_axes": _card(plugin, parallelism__max_degree={"sp": 2}),
        "but parallelism.implementation is not set": _card(
            plugin, parallelism__max_degree={"sp": 2}, loops__denoise__valid_parallel_axes=("sp",)),
        "contradicts recipe.assumes_precision": _card(
            plugin, precision__supported=frozenset({"fp32", "bf16"}), recipe__assumes_precision="bf16"),
        "parity.level C0 is below recipe.consistency_required C1": _card(plugin, parity__level="C0"),
    }
    for needle, data in cases.items():
        with pytest.raises(ValidationError, match=re.escape(needle)):
            ModelCard.model_validate(data)
    ModelCard.model_validate(_card(plugin))  # the control: unchanged, it validates


def test_output_spec_and_cancel_scope_of_api2() -> None:
    with pytest.raises(ValidationError, match="capture_behavior"):
        OutputSpec(capture_behavior=True)
    with pytest.raises(ValidationError, match="modalities"):
        OutputSpec(modalities=frozenset({"image"}))
    assert OutputSpec().modalities is None and OutputSpec(capture_behavior="final").capture_behavior == "final"
    assert {s.name for s in CancelScope} == {"REQUEST", "NONE"}
    with pytest.raises(AttributeError):
        CancelScope.LOOP  # noqa: B018


def test_loop_hooks_default_to_nothing() -> None:
    state = LoopState(request_id="r", loop_id="denoise", instance_id="i")
    assert Loop.bind(object(), object()) is None  # type: ignore[arg-type]
    assert Loop.restore(object(), state, object(), object()) is state  # type: ignore[arg-type]


def test_the_step_index_is_outside_the_batch_key_and_params_are_in_it() -> None:
    def plan(**fields: Any) -> WorkPlan:
        return WorkPlan(loop_id="denoise", instance_id="i", kind=WorkKind.DIFFUSION_STEP, op="velocity", **fields)

    assert plan(step_index=1).batch_key() == plan(step_index=7).batch_key()
    assert plan(params={"step_index": 1}).batch_key() != plan(params={"step_index": 7}).batch_key()


def test_an_unserializable_state_is_refused_when_written() -> None:
    class WithGenerator(LoopState):
        rng: Any = None

    state = WithGenerator(request_id="r", loop_id="denoise", instance_id="i", rng=torch.Generator())
    with pytest.raises(StateNotSerializable) as info:
        state.to_bytes()
    assert info.value.param == "rng" and "loop 'denoise'" in str(info.value)


def test_an_rl_method_without_train_cannot_be_instantiated() -> None:
    class LossOnly(RLMethod):
        name = "loss-only"

        def loss(self, batch: dict[str, Any]) -> torch.Tensor:
            return torch.zeros(())

    assert "train" in RLMethod.__abstractmethods__
    with pytest.raises(TypeError, match="train"):
        LossOnly()


def test_sampler_states_resolve_only_in_a_deployment_that_registers_them(fv_mine: tuple[Any, PluginHost]) -> None:
    from fv_kernel.api import SamplerError, sampler_from_state

    plugin, _ = fv_mine
    state = plugin.EulerShift5().init_state(3)
    assert isinstance(state, SamplerState) and state.sampler.startswith("euler-shift5:")
    with pytest.raises(SamplerError, match="not registered here"):
        sampler_from_state(state)  # outside a loop run by the driver: the kernel's built-ins only


# --------------------------------------------------------------------------- API 1 blocks under the API 1 kernel

_API1_CHECKS = r'''
import json, sys, warnings
payload = json.load(sys.stdin)
out = {}
import fv_kernel
from fv_kernel.api import (CancelScope, LoopSpec, LoopState, ModelCard, OutputSpec, Request, ResourceRequest, TaskType,
                           TextPart, WorkPlan, SamplerState, sampler_from_state, Loop, Program)
from fv_kernel.loop.samplers import SamplerError  # fv_kernel.api did not export it yet
from fv_kernel.plugins import PluginHost
from fv_kernel.plugins.manifest import parse_manifest
from fv_kernel.training import RLMethod
from fv_kernel.testing import InterleaveConformance
import inspect, torch, yaml
from typing import Any

out["version"] = [fv_kernel.__version__, fv_kernel.API_VERSION]
m = parse_manifest(yaml.safe_load(payload["before_manifest"]), source="before"); m.check_kernel_api(fv_kernel.API_VERSION)
try:
    parse_manifest(yaml.safe_load(payload["after_manifest"]), source="after").check_kernel_api(fv_kernel.API_VERSION)
    out["after_manifest"] = "accepted"
except Exception as exc:
    out["after_manifest"] = type(exc).__name__
ran = []
for block in payload["before"]:
    ns = {"__name__": "api1_block"}
    exec(compile(block, "api1 block", "exec"), ns)
    ran.append(sorted(k for k in ns if not k.startswith("__")))
    if "fv_register_samplers" in ns:
        calls = []
        def hook(register, _impl=ns["fv_register_samplers"]):
            calls.append(1)
            _impl(register)
        from fv_kernel.api import hookimpl
        host = PluginHost(discover=False, environ={}); host.start()
        host.register(type("P", (), {"fv_register_samplers": staticmethod(hookimpl(hook))}), name="fv-mine")
        out["calls_after_register"] = len(calls)
        out["registered"] = sorted(host.hooks.contributions("samplers"))
        out["calls_after_lookup"] = len(calls)
    if "DENOISE" in ns:
        out["graph_capture"] = ns["DENOISE"].graph_capture
    if "DenoiseLoop" in ns:
        from types import SimpleNamespace
        loop = SimpleNamespace(spec=LoopSpec(loop_id="denoise", kind="diffusion_denoise", implementation="m:C",
                                             sampler={"name": "euler", "config": {"shift": 5.0}}))
        out["sampler"] = type(ns["DenoiseLoop"].sampler(loop, shift=3.0)).__name__
        req = Request(model="x", task=TaskType.TEXT_TO_IMAGE, inputs=(TextPart(text="x"),), diffusion={"steps": 5})
        out["estimate_seconds"] = ns["DenoiseLoop"].estimate(loop, req, None).gpu_seconds
    if "TestGate" in ns:
        out["kit_override"] = list(inspect.signature(ns["TestGate"].requests_for).parameters)
out["ran"] = ran
out["kit"] = [hasattr(InterleaveConformance, "test_interleaved_equals_serial"),
              list(inspect.signature(InterleaveConformance.requests_for).parameters)]
out["cancel_scopes"] = [s.name for s in CancelScope]
LoopSpec(loop_id="d", kind="diffusion_denoise", implementation="m:C", valid_parallel_axes=("seq",))
LoopSpec(loop_id="d", kind="diffusion_denoise", implementation="m:C", causal=True, valid_parallel_axes=("pp_patch",))
for changes in payload["card_changes"]:
    card = json.loads(payload["card"])
    for path, value in changes.items():
        *parents, last = path.split("__"); target = card
        for part in parents: target = target.setdefault(part, {})
        target[last] = value
    ModelCard.model_validate(card)
out["cards_accepted"] = len(payload["card_changes"])
out["output_spec"] = repr(OutputSpec(capture_behavior=True, modalities=frozenset({"image"})))
out["default_modalities"] = sorted(OutputSpec().modalities)
class WithGenerator(LoopState):
    rng: Any = None
data = WithGenerator(request_id="r", loop_id="denoise", instance_id="i", rng=torch.Generator()).to_bytes()
try:
    WithGenerator.from_bytes(data); out["state_read"] = "read"
except Exception as exc:
    out["state_read"] = type(exc).__name__
state = SamplerState(sampler='euler-shift5:{"shift": 5.0}', sigmas=torch.ones(2), timesteps=torch.ones(1))
try:
    sampler_from_state(state); out["plugin_state"] = "rebuilt"
except SamplerError as exc:
    out["plugin_state"] = "SamplerError"
out["rl_abstract"] = sorted(RLMethod.__abstractmethods__)
out["loop_hooks"] = [hasattr(Loop, "bind"), hasattr(Loop, "restore"), "step_index" in WorkPlan.model_fields]
out["program"] = [hasattr(Program, "run_loop"), hasattr(Program, "resumable")]
out["resource_request_steps"] = "steps" in ResourceRequest.model_fields
print(json.dumps(out))
'''

#: Card changes API 2 refuses (test_card_rules_of_api2) that the API 1 kernel accepted, on a card API 1 can read.
_API1_CARD_CHANGES = [
    {"loops__denoise__graph_capture": "eager_first"},
    {"parallelism__max_degree": {"sp": 2}},
    {"precision__supported": ["fp32", "bf16"], "recipe__assumes_precision": "bf16"},
    {"parity__level": "C0"},
]


@pytest.fixture(scope="module")
def api1_kernel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The API 1 kernel's source tree, exported from git history (skipped in a clone without it)."""
    where = tmp_path_factory.mktemp("api1")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", API1_COMMIT, "fv_kernel"], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"git history without {API1_COMMIT[:7]} (the API 1 kernel): {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    return where


def _api1_card() -> str:
    """An API 1 card: the example card's fields that API 1 had (no program ``returns``, no ``parameters``...)."""
    return json.dumps({
        "model_id": "mine-tiny", "family": "mine",
        "components": {"net": {"component_id": "net", "kind": "dit", "builder": "fv_mine.plugin:VelocityNet"}},
        "loops": {"denoise": {"loop_id": "denoise", "kind": "diffusion_denoise",
                              "implementation": "fv_mine.plugin:DenoiseLoop", "sampler": {"name": "euler"}}},
        "programs": {"text_to_image": {"implementation": "fv_mine.plugin:Generate"}},
        "capabilities": {"tasks": ["text_to_image"]},
        "recipe": {"method": "base"}, "parity": {"level": "C1", "reference": "none"},
        "precision": {"default": "fp32", "supported": ["fp32"]},
        "checkpoint": {"layout": "embedded", "components": {"net": {"required_for": ["text_to_image"]}}},
        "factory": "fv_mine.plugin:build",
    })


def test_the_api1_column_is_what_the_api1_kernel_did(api1_kernel: Path) -> None:
    payload = {
        "before": blocks("python", "before"), "before_manifest": blocks("yaml", "before")[0],
        "after_manifest": blocks("yaml", "after")[0], "card": _api1_card(), "card_changes": _API1_CARD_CHANGES,
    }
    env = {"PYTHONPATH": str(api1_kernel), "PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"}
    done = subprocess.run([sys.executable, "-c", _API1_CHECKS], input=json.dumps(payload), capture_output=True,
                          text=True, env=env, cwd=api1_kernel, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["version"] == ["0.1.0", "1.0"] and out["after_manifest"] == "KernelAPIMismatchError"
    assert len(out["ran"]) == 5  # every API 1 block runs under the API 1 kernel
    assert (out["calls_after_register"], out["calls_after_lookup"]) == (0, 1)  # hooks ran on first use
    assert out["registered"] == ["fv-mine/shift5"]  # any name
    assert out["graph_capture"] == "eager_first" and out["cards_accepted"] == len(_API1_CARD_CHANGES)
    assert out["sampler"] == "FlowEulerSampler" and out["estimate_seconds"] > 0
    assert out["kit_override"] == ["self", "card", "seeds", "prefix"]
    assert out["kit"] == [True, ["self", "card", "seeds", "prefix"]]
    assert out["cancel_scopes"] == ["REQUEST", "LOOP", "STREAM", "NONE"]
    assert "capture_behavior=True" in out["output_spec"] and out["default_modalities"] == ["video"]
    assert out["state_read"] == "StateFormatError" and out["plugin_state"] == "SamplerError"
    assert out["rl_abstract"] == ["loss"]
    assert out["loop_hooks"] == [False, False, False] and out["program"] == [False, False]
    assert out["resource_request_steps"] is False
