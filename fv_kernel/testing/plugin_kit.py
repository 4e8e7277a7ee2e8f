"""Plugin conformance: hermetic-host fixtures and the :class:`PluginConformance` base class.

PYTEST_DONT_REWRITE: checks report through ``pytest.fail``, so the kit needs no assertion
rewriting and may be imported before pytest registers it.

A plugin's test suite gets every plugin check by subclassing::

    pytest_plugins = ["fv_kernel.testing"]

    from fv_kernel.testing import PluginConformance

    class TestMyPlugin(PluginConformance):
        distribution = "fv-my-plugin"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Sequence

import pytest

from fv_kernel.plugins.check import PluginChecker
from fv_kernel.plugins.host import PluginHost

__all__ = [
    "HookCall",
    "HookRecorder",
    "PluginConformance",
    "fv_host",
    "hook_recorder",
    "register_plugin",
]


@pytest.fixture
def fv_host() -> PluginHost:
    """A started plugin host that discovers nothing (installed plugins and ``FV_PLUGINS`` are ignored)."""
    host = PluginHost(discover=False, environ={})
    host.start()
    return host


RegisterPlugin = Callable[..., PluginHost]


@pytest.fixture
def register_plugin(fv_host: PluginHost) -> Iterator[RegisterPlugin]:
    """``register_plugin(obj, name="my-plugin", host=None) -> host``: register in-process, unregistered at teardown."""
    registered: list[tuple[PluginHost, str]] = []

    def register(plugin: object, name: str = "test-plugin", host: PluginHost | None = None) -> PluginHost:
        target = host or fv_host
        target.register(plugin, name=name)
        registered.append((target, name))
        return target

    yield register
    for host, name in reversed(registered):
        host.unregister(name)


@dataclass(frozen=True)
class HookCall:
    name: str
    kwargs: dict[str, Any]


@dataclass
class HookRecorder:
    """Every hook call made on one host, in order."""

    calls: list[HookCall] = field(default_factory=list)

    def names(self) -> list[str]:
        return [c.name for c in self.calls]

    def get(self, name: str) -> list[HookCall]:
        return [c for c in self.calls if c.name == name]


@pytest.fixture
def hook_recorder(fv_host: PluginHost) -> Iterator[HookRecorder]:
    """Records hook calls on :func:`fv_host` (historic calls made before the fixture are not seen)."""
    recorder = HookRecorder()

    def before(hook_name: str, hook_impls: Sequence[Any], kwargs: dict[str, Any]) -> None:
        recorder.calls.append(HookCall(hook_name, dict(kwargs)))

    def after(outcome: Any, hook_name: str, hook_impls: Sequence[Any], kwargs: dict[str, Any]) -> None:
        return None

    undo = fv_host.pm.add_hookcall_monitoring(before, after)
    yield recorder
    undo()


class PluginConformance:
    """Subclass in a plugin's tests and set :attr:`distribution`; every check is a test.

    ``search_path`` restricts discovery to some directories (rarely needed: the
    default is the installed environment).
    """

    distribution: ClassVar[str] = ""
    search_path: ClassVar[Sequence[str] | None] = None

    @pytest.fixture(scope="class")
    @classmethod
    def fv_plugin_checker(cls) -> PluginChecker:
        if not cls.distribution:
            pytest.fail(f"{cls.__name__} must set `distribution = \"<your distribution name>\"`", pytrace=False)
        return PluginChecker(cls.distribution, search_path=cls.search_path)

    @staticmethod
    def _require(problems: list[str], what: str) -> None:
        if problems:
            pytest.fail(f"{what}:\n" + "\n".join(f"  - {p}" for p in problems), pytrace=False)

    def test_entry_point_resolves(self, fv_plugin_checker: PluginChecker) -> None:
        self._require(fv_plugin_checker.check_entry_point(), f"{self.distribution}: fv.plugins entry point")
        self._require(fv_plugin_checker.check_import(), f"{self.distribution}: importing the plugin entry point")

    def test_manifest_validates(self, fv_plugin_checker: PluginChecker) -> None:
        self._require(fv_plugin_checker.check_manifest(), f"{self.distribution}: fv-plugin.yaml")

    def test_import_initialises_no_cuda_and_reads_no_weights(self, fv_plugin_checker: PluginChecker) -> None:
        self._require(fv_plugin_checker.check_import_side_effects(), f"{self.distribution}: import side effects")

    def test_register_twice_is_harmless(self, fv_plugin_checker: PluginChecker) -> None:
        self._require(fv_plugin_checker.check_register_twice(), f"{self.distribution}: registering twice")

    def test_contributions_exist_and_satisfy_bases(self, fv_plugin_checker: PluginChecker) -> None:
        self._require(fv_plugin_checker.check_contributions(), f"{self.distribution}: declared contributions")
