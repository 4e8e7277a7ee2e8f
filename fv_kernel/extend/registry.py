"""The deployment's extension set: which interceptors and observers run, validated up front.

Built once from the deploy config (``extensions:``); conflicting interceptors, and a
default-on interceptor that a resident card refuses, are errors at that point,
before any request. Per request, :meth:`ExtensionSet.hooks_for` validates the
request's parameters for the enabled extensions and returns its hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fv_kernel.card.spec import ModelCard
from fv_kernel.errors import FvError, InvalidRequest
from fv_kernel.extend.hooks import ActiveInterceptor, RequestHooks
from fv_kernel.extend.interceptors import BlockInterceptor, Interceptor, StepInterceptor
from fv_kernel.extend.observers import BlockObserver, Observer

__all__ = ["ExtensionSettings", "ExtensionSet", "ExtensionConfigError", "InterceptorRejected"]


class ExtensionConfigError(FvError):
    error_type = "extension_config"


class InterceptorRejected(InvalidRequest):
    """A card's loop refuses a class of interceptor (e.g. a few-step distilled loop and step skipping)."""

    error_type = "interceptor_rejected"


class ExtensionSettings(BaseModel):
    """One entry of the deploy config's ``extensions:`` map."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Run for every request (with default parameters) rather than only for requests that parameterise it.
    default_on: bool = False
    config: dict[str, Any] = Field(default_factory=dict)


@dataclass
class ExtensionSet:
    """Enabled interceptors (by plugin id) and observers of one deployment."""

    interceptors: dict[str, Interceptor] = field(default_factory=dict)
    default_on: frozenset[str] = frozenset()
    observers: list[Observer] = field(default_factory=list)

    @classmethod
    def build(
        cls, settings: Mapping[str, ExtensionSettings | Mapping[str, Any]], available: Mapping[str, type]
    ) -> "ExtensionSet":
        """Instantiate the configured extensions from the available classes (by name)."""
        interceptors: dict[str, Interceptor] = {}
        observers: list[Observer] = []
        default_on = set()
        for name, raw in settings.items():
            entry = raw if isinstance(raw, ExtensionSettings) else ExtensionSettings.model_validate(raw)
            extension_cls = available.get(name)
            if extension_cls is None:
                raise ExtensionConfigError(
                    f"extensions.{name}: no enabled plugin provides it; available: {', '.join(sorted(available)) or 'none'}",
                    param=f"extensions.{name}",
                )
            if issubclass(extension_cls, Interceptor):
                try:
                    config = extension_cls.config_model.model_validate(entry.config)
                except ValidationError as exc:
                    err = exc.errors()[0]
                    where = ".".join(str(p) for p in err["loc"])
                    raise ExtensionConfigError(f"extensions.{name}.config.{where}: {err['msg']}", param=f"extensions.{name}") from None
                instance = extension_cls(config)
                interceptors[extension_cls.plugin_id] = instance
                if entry.default_on:
                    default_on.add(extension_cls.plugin_id)
            elif issubclass(extension_cls, Observer):
                observers.append(extension_cls(**entry.config))
            else:
                raise ExtensionConfigError(f"extensions.{name}: {extension_cls!r} is neither an interceptor nor an observer")
        result = cls(interceptors=interceptors, default_on=frozenset(default_on), observers=observers)
        result.check_conflicts()
        return result

    def check_conflicts(self) -> None:
        ids = sorted(self.interceptors)
        for plugin_id, interceptor in self.interceptors.items():
            clash = sorted(set(interceptor.conflicts_with) & set(ids))
            if clash:
                raise ExtensionConfigError(f"extensions: {plugin_id!r} conflicts with {clash[0]!r}; enable one of them")
        block = [p for p, i in self.interceptors.items() if isinstance(i, BlockInterceptor)]
        if len(block) > 1:
            raise ExtensionConfigError(
                f"extensions: block interceptors {block} both wrap the block sequence; enable one of them", param="extensions"
            )

    def check_cards(self, cards: Iterable[ModelCard]) -> None:
        """A default-on interceptor must be acceptable to every resident card's loops."""
        for card in cards:
            for plugin_id in self.default_on:
                klass = self.interceptors[plugin_id].interceptor_class
                for loop in card.loops.values():
                    if klass in loop.rejects_interceptors:
                        raise ExtensionConfigError(
                            f"extensions.{plugin_id} is default_on, but card {card.model_id!r} (recipe "
                            f"{card.recipe.method!r}) refuses {klass} interceptors in loop {loop.loop_id!r}",
                            param=f"extensions.{plugin_id}",
                        )

    @property
    def block_observers(self) -> tuple[BlockObserver, ...]:
        return tuple(o for o in self.observers if isinstance(o, BlockObserver))

    def hooks_for(self, card: ModelCard, loop_ids: Iterable[str], plugin_params: Mapping[str, Any], *, exact: bool) -> RequestHooks | None:
        """Validate a request's extension parameters and return its hooks (None when nothing is active)."""
        unknown = sorted(set(plugin_params) - set(self.interceptors))
        if unknown:
            allowed = ", ".join(sorted(self.interceptors)) or "none (this deployment enables no interceptors)"
            raise InvalidRequest(f"plugin_params.{unknown[0]}", "is not an interceptor this deployment enabled", allowed=allowed)
        hooks = RequestHooks(block_observers=self.block_observers)
        loops = [card.loops[loop_id] for loop_id in loop_ids if loop_id in card.loops]
        for plugin_id, interceptor in self.interceptors.items():
            if plugin_id not in plugin_params and plugin_id not in self.default_on:
                continue
            try:
                params = interceptor.parse_params(plugin_params.get(plugin_id))
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise InvalidRequest(f"plugin_params.{plugin_id}.{where}", err["msg"]) from None
            for loop in loops:
                if interceptor.interceptor_class in loop.rejects_interceptors:
                    raise InterceptorRejected(
                        f"plugin_params.{plugin_id}",
                        f"card {card.model_id!r} (recipe {card.recipe.method!r}) refuses {interceptor.interceptor_class} "
                        f"interceptors in loop {loop.loop_id!r}",
                        allowed="omit it for this card",
                    )
            if exact and interceptor.distribution_altering(params):
                raise InvalidRequest(
                    f"plugin_params.{plugin_id}", "alters the output distribution, which an exact-mode request refuses",
                    allowed="parameters that keep the output exact, or exact=false",
                )
            active = ActiveInterceptor(interceptor, params)
            if isinstance(interceptor, StepInterceptor):
                hooks.step.append(active)
            elif isinstance(interceptor, BlockInterceptor):
                hooks.block = active
        return hooks if hooks else None
