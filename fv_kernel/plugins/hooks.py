"""The typed façade through which the kernel calls plugin hooks.

This is the only module that touches ``pm.hook``; everything else calls
:class:`PluginHooks` methods with real signatures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

import pluggy

from .errors import DuplicateContributionError, PluginError, UnknownContributionError, one_line
from .kinds import KINDS, KindSpec, check_registered_name, check_satisfies, kind_spec

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


def find_contribution(found: Mapping[str, Contribution], kind: str, name: str, *, scope: str = "") -> Contribution:
    """``name`` as a namespaced id (``"<plugin>/<name>"``) or a unique short name; otherwise
    :class:`UnknownContributionError` listing what is available (``scope`` says where we looked)."""
    if name in found:
        return found[name]
    by_short = [c for c in found.values() if c.name == name]
    if len(by_short) == 1:
        return by_short[0]
    available = ", ".join(sorted(found)) or "<none>"
    raise UnknownContributionError(f"no {kind} contribution {name!r}{scope}; available: {available}")


class PluginHooks:
    """Typed calls into the plugins registered with one :class:`pluggy.PluginManager`.

    Registration hooks run once per plugin, when the host registers it (:meth:`collect`);
    what they register is checked, then kept per plugin (:meth:`accept`) until the plugin
    is unregistered (:meth:`forget`). Lookups never call a plugin.
    """

    def __init__(self, pm: pluggy.PluginManager, kinds: Mapping[str, KindSpec] = KINDS) -> None:
        self._pm = pm
        self._kinds = kinds
        self._accepted: dict[str, dict[str, list[Contribution]]] = {}
        """plugin name -> kind -> its checked contributions, in registration order."""

    # ------------------------------------------------------------------ registration
    def collect(self, plugin: object, plugin_name: str) -> dict[str, list[Contribution]]:
        """Run every registration hook ``plugin`` implements and check each contribution.

        Raises :class:`PluginError` at the first problem, naming the plugin: a hook raised
        (e.g. a card that fails validation), a name is invalid or registered twice, an object
        does not satisfy its kind's base, or its own name (``model_id``, ``name``) differs
        from the name it is registered under.
        """
        found: dict[str, list[Contribution]] = {}
        for spec in self._kinds.values():
            if spec.hook is None or not self._implements(plugin, spec.hook):
                continue
            contributions = self._call_registration(plugin, plugin_name, spec)
            for contribution in contributions:
                what = f"contribution {contribution.id}"
                check_satisfies(spec, contribution.obj, what=what)
                check_registered_name(spec, contribution.obj, contribution.name, what=what)
            found[spec.kind] = contributions
        return found

    def accept(self, plugin_name: str, found: Mapping[str, list[Contribution]]) -> None:
        """Keep ``found`` as ``plugin_name``'s contributions.

        A short name is unique per kind across the deployment (lookups by short name, card
        ids and sampler states rely on it): a name another plugin already contributes raises
        :class:`DuplicateContributionError` naming both, and nothing of ``plugin_name`` is kept.
        """
        for kind, contributions in found.items():
            owners = {c.name: c.plugin for other, by_kind in self._accepted.items() if other != plugin_name for c in by_kind.get(kind, ())}
            for contribution in contributions:
                if contribution.name in owners:
                    raise DuplicateContributionError(
                        f"{kind} {contribution.name!r} is contributed by both {owners[contribution.name]!r} and {plugin_name!r}"
                    )
        self._accepted[plugin_name] = {kind: list(items) for kind, items in found.items()}

    def forget(self, plugin_name: str) -> None:
        """Drop ``plugin_name``'s contributions (the host unregistered it)."""
        self._accepted.pop(plugin_name, None)

    def contributions(self, kind: str) -> dict[str, Contribution]:
        """The accepted contributions of a hook-registered ``kind``, keyed by namespaced id."""
        spec = kind_spec(kind, self._kinds)
        if spec.hook is None:
            raise PluginError(f"{kind} are named drivers (entry-point group {spec.entry_point_group}), not hook registrations")
        return {c.id: c for by_kind in self._accepted.values() for c in by_kind.get(kind, ())}

    def registered(self, kind: str) -> list[Contribution]:
        """Run the registration hooks of ``kind`` for every registered plugin, unchecked and unkept.

        For checkers (``fv plugins check``) that compare what a plugin registers with its manifest.
        """
        spec = kind_spec(kind, self._kinds)
        if spec.hook is None:
            raise PluginError(f"{kind} are named drivers (entry-point group {spec.entry_point_group}), not hook registrations")
        collected: list[Contribution] = []
        for plugin in self._plugins_implementing(spec.hook):
            collected.extend(self._call_registration(plugin, self._pm.get_name(plugin) or repr(plugin), spec))
        return collected

    def _call_registration(self, plugin: object, plugin_name: str, spec: KindSpec) -> list[Contribution]:
        kind = spec.kind
        registered: dict[str, object] = {}

        def register(name: str, obj: object) -> None:
            if not isinstance(name, str) or not name or "/" in name:
                raise PluginError(f"plugin {plugin_name!r} registered a {kind} contribution with invalid name {name!r} (non-empty, no '/')")
            if name in registered:
                raise DuplicateContributionError(f"plugin {plugin_name!r} registered {kind} {name!r} twice")
            registered[name] = obj

        assert spec.hook is not None
        caller = self._pm.subset_hook_caller(spec.hook, remove_plugins=[p for p in self._pm.get_plugins() if p is not plugin])
        try:
            caller(register=register)
        except PluginError:
            raise
        except Exception as exc:  # a plugin's hook may raise anything
            raise PluginError(f"plugin {plugin_name!r} failed in {spec.hook}: {one_line(exc)}") from exc
        return [Contribution(kind=kind, plugin=plugin_name, name=name, obj=obj) for name, obj in registered.items()]

    def _implements(self, plugin: object, hook_name: str) -> bool:
        return any(impl.plugin is plugin for impl in getattr(self._pm.hook, hook_name).get_hookimpls())

    def get(self, kind: str, name: str) -> Contribution:
        """Look up by namespaced id (``"fv-wan/wan-tiny"``) or unique short name (``"wan-tiny"``)."""
        return find_contribution(self.contributions(kind), kind, name)

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

    def rewards(self) -> dict[str, Contribution]:
        return self.contributions("rewards")

    def program_compilers(self) -> dict[str, Contribution]:
        return self.contributions("program_compilers")

    # ------------------------------------------------------------------ lifecycle
    def host_started(self, host: Any) -> None:
        """``host``: the :class:`~fv_kernel.plugins.host.PluginHost` (which calls this). Historic:
        plugins registered later receive the call on registration."""
        self._pm.hook.fv_host_started.call_historic(kwargs={"host": host})

    def engine_started(self, engine: Any) -> None:
        self._pm.hook.fv_engine_started(engine=engine)

    def engine_stopping(self, engine: Any) -> None:
        self._pm.hook.fv_engine_stopping(engine=engine)

    def request_finished(self, request_id: str, status: str) -> None:
        self._pm.hook.fv_request_finished(request_id=request_id, status=status)

    def step_finished(self, event: Any) -> None:
        self._pm.hook.fv_step_finished(event=event)

    def serving_route_registrars(self) -> list[tuple[str, Callable[..., None]]]:
        """Each plugin's ``fv_serving_routes`` implementation, with its plugin's name, in registration order.

        Returned rather than broadcast: the server calls them one by one, so one plugin's failure
        removes its own routes alone (``fv_kernel.serving.plugin_routes``).
        """

        def call(impl: Any) -> Callable[..., None]:
            # as pluggy does: an implementation receives only the arguments it names
            return lambda **kwargs: impl.function(**{name: kwargs[name] for name in impl.argnames})

        return [
            (self._pm.get_name(impl.plugin) or repr(impl.plugin), call(impl))
            for impl in self._pm.hook.fv_serving_routes.get_hookimpls()
        ]

    # ------------------------------------------------------------------ single answer
    def resolve_model_source(self, source: str) -> Any:
        """The first plugin's answer for ``source``: a card id, a ``ModelCard`` it derived, or None.

        A plugin that recognises ``source`` but cannot serve it raises a typed ``FvError``
        (passed through); any other exception is a ``PluginError`` naming the hook.
        """
        from fv_kernel.card.spec import ModelCard
        from fv_kernel.errors import FvError

        try:
            result = self._pm.hook.fv_resolve_model_source(source=source)
        except FvError:
            raise
        except Exception as exc:  # a plugin's hook may raise anything
            raise PluginError(f"fv_resolve_model_source failed for {source!r}: {type(exc).__name__}: {exc}") from exc
        if result is not None and not isinstance(result, (str, ModelCard)):
            raise PluginError(
                f"fv_resolve_model_source returned {type(result).__name__}, expected a card id string, a ModelCard or None"
            )
        return result

    def default_model(self) -> str | None:
        result = self._pm.hook.fv_default_model()
        if result is not None and not isinstance(result, str):
            raise PluginError(f"fv_default_model returned {type(result).__name__}, expected a card id string or None")
        return result  # type: ignore[no-any-return]

    def export_checkpoint(self, card: Any, modules: Any, directory: Any) -> Any:
        """The first plugin's export of ``card`` to ``directory``: the card serving it, or None (no plugin's family)."""
        return self._pm.hook.fv_export_checkpoint(card=card, modules=modules, directory=directory)

    def check_parity(self, card: Any, directory: Any) -> Any:
        """The first plugin's parity result for ``card``'s checkpoint at ``directory``, or None."""
        return self._pm.hook.fv_check_parity(card=card, directory=directory)

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
