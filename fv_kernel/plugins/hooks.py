"""The typed façade through which the kernel calls plugin hooks.

This is the only module that touches ``pm.hook``; everything else calls
:class:`PluginHooks` methods with real signatures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeVar

import pluggy

from .errors import DuplicateContributionError, PluginError, UnknownContributionError
from .kinds import KINDS, KindSpec, check_satisfies, kind_spec

if TYPE_CHECKING:
    from .host import PluginHost

T = TypeVar("T")


@dataclass(frozen=True)
class Contribution:
    """One registered contribution."""

    kind: str
    plugin: str
    name: str
    obj: object

    @property
    def id(self) -> str:
        """Namespaced id, ``"<plugin>/<name>"``."""
        return f"{self.plugin}/{self.name}"


class PluginHooks:
    """Typed calls into the plugins registered with one :class:`pluggy.PluginManager`."""

    def __init__(self, pm: pluggy.PluginManager, kinds: Mapping[str, KindSpec] = KINDS) -> None:
        self._pm = pm
        self._kinds = kinds
        self._contributions: dict[str, dict[str, Contribution]] = {}

    def invalidate(self) -> None:
        """Forget collected contributions; the host calls this when plugins change."""
        self._contributions.clear()

    # ------------------------------------------------------------------ registration
    def contributions(self, kind: str) -> dict[str, Contribution]:
        """All contributions of a hook-registered ``kind``, keyed by namespaced id.

        Each plugin's registration hook is called once (results are cached until
        plugins change); every object is checked against the kind's base.
        """
        if kind not in self._contributions:
            spec = kind_spec(kind, self._kinds)
            collected = {c.id: c for c in self.registered(kind)}
            for contribution in collected.values():
                check_satisfies(spec, contribution.obj, what=f"contribution {contribution.id}")
            self._contributions[kind] = collected
        return dict(self._contributions[kind])

    def registered(self, kind: str) -> list[Contribution]:
        """Run the registration hooks of ``kind`` and return what they registered, unchecked and uncached.

        Raises :class:`DuplicateContributionError` when two plugins register one short name.
        """
        spec = kind_spec(kind, self._kinds)
        if spec.hook is None:
            raise PluginError(f"{kind} are named drivers (entry-point group {spec.entry_point_group}), not hook registrations")
        collected: list[Contribution] = []
        owners: dict[str, str] = {}
        for plugin in self._plugins_implementing(spec.hook):
            plugin_name = self._pm.get_name(plugin) or repr(plugin)
            registered: dict[str, object] = {}

            def register(name: str, obj: object, _registered: dict[str, object] = registered, _plugin: str = plugin_name) -> None:
                if not isinstance(name, str) or not name or "/" in name:
                    raise PluginError(f"plugin {_plugin!r} registered a {kind} contribution with invalid name {name!r} (non-empty, no '/')")
                if name in _registered:
                    raise DuplicateContributionError(f"plugin {_plugin!r} registered {kind} {name!r} twice")
                _registered[name] = obj

            caller = self._pm.subset_hook_caller(spec.hook, remove_plugins=[p for p in self._pm.get_plugins() if p is not plugin])
            try:
                caller(register=register)
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(f"plugin {plugin_name!r} failed in {spec.hook}: {type(exc).__name__}: {exc}") from exc
            for name, obj in registered.items():
                if name in owners:
                    raise DuplicateContributionError(
                        f"{kind} {name!r} is contributed by both {owners[name]!r} and {plugin_name!r}"
                    )
                owners[name] = plugin_name
                collected.append(Contribution(kind=kind, plugin=plugin_name, name=name, obj=obj))
        return collected

    def get(self, kind: str, name: str) -> Contribution:
        """Look up by namespaced id (``"fv-wan/wan-tiny"``) or unique short name (``"wan-tiny"``)."""
        found = self.contributions(kind)
        if name in found:
            return found[name]
        by_short = [c for c in found.values() if c.name == name]
        if len(by_short) == 1:
            return by_short[0]
        available = ", ".join(sorted(found)) or "<none>"
        raise UnknownContributionError(f"no {kind} contribution {name!r}; available: {available}")

    def model_cards(self) -> dict[str, Contribution]:
        return self.contributions("model_cards")

    def loops(self) -> dict[str, Contribution]:
        return self.contributions("loops")

    def samplers(self) -> dict[str, Contribution]:
        return self.contributions("samplers")

    def interceptors(self) -> dict[str, Contribution]:
        return self.contributions("interceptors")

    def observers(self) -> dict[str, Contribution]:
        return self.contributions("observers")

    def rl_methods(self) -> dict[str, Contribution]:
        return self.contributions("rl_methods")

    def program_compilers(self) -> dict[str, Contribution]:
        return self.contributions("program_compilers")

    # ------------------------------------------------------------------ lifecycle
    def host_started(self, host: "PluginHost") -> None:
        """Historic: plugins registered later receive the call on registration."""
        self._pm.hook.fv_host_started.call_historic(kwargs={"host": host})

    def engine_started(self, engine: Any) -> None:
        self._pm.hook.fv_engine_started(engine=engine)

    def engine_stopping(self, engine: Any) -> None:
        self._pm.hook.fv_engine_stopping(engine=engine)

    def request_finished(self, request_id: str, status: str) -> None:
        self._pm.hook.fv_request_finished(request_id=request_id, status=status)

    def step_finished(self, event: Any) -> None:
        self._pm.hook.fv_step_finished(event=event)

    # ------------------------------------------------------------------ single answer
    def resolve_model_source(self, source: str) -> str | None:
        """The first plugin's card id for ``source``, or None when no plugin claims it."""
        result = self._pm.hook.fv_resolve_model_source(source=source)
        if result is not None and not isinstance(result, str):
            raise PluginError(f"fv_resolve_model_source returned {type(result).__name__}, expected a card id string or None")
        return result  # type: ignore[no-any-return]

    def default_model(self) -> str | None:
        result = self._pm.hook.fv_default_model()
        if result is not None and not isinstance(result, str):
            raise PluginError(f"fv_default_model returned {type(result).__name__}, expected a card id string or None")
        return result  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ wrapping
    def wrap_generate(self, request: Any, generate: Callable[[Any], T]) -> T:
        """Run ``generate(request)`` inside every plugin's ``fv_wrap_generate`` wrapper."""

        def kernel_generate(request: Any) -> T:
            return generate(request)

        return self._pm.hook.fv_wrap_generate.call_extra([kernel_generate], {"request": request})  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ helpers
    def _plugins_implementing(self, hook_name: str) -> list[object]:
        caller = getattr(self._pm.hook, hook_name)
        seen: list[object] = []
        # Registration order (oldest first) makes duplicate errors deterministic.
        for impl in caller.get_hookimpls():
            if not any(impl.plugin is p for p in seen):
                seen.append(impl.plugin)
        return seen
