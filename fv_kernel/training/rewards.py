"""Looking up a registered reward (the ``rewards`` contribution kind) by name, with its options."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from pydantic import ValidationError

from fv_kernel.training import Reward
from fv_kernel.training.recipe import RecipeError

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.plugins.host import PluginHost

__all__ = ["resolve_reward"]


def resolve_reward(
    name: str, options: Mapping[str, Any] | None = None, *, host: "PluginHost | None" = None, field: str = "options.reward"
) -> Reward:
    """The registered reward ``name`` built with ``options``; a :class:`RecipeError` naming ``field`` otherwise.

    ``host``: the started plugin host to look in (default: a host over the installed plugins).
    """
    from fv_kernel.plugins.errors import PluginError
    from fv_kernel.plugins.hooks import find_contribution

    if host is None:
        from fv_kernel.plugins.host import PluginHost

        host = PluginHost()
    host.start()
    found = host.hooks.rewards()
    try:
        cls = find_contribution(found, "rewards", name).obj
    except PluginError:
        allowed = sorted({*found, *(c.name for c in found.values())}) or ["<none: install a plugin with rewards>"]
        raise RecipeError(field, f"no registered reward {name!r}", allowed=allowed) from None
    try:
        parsed = cls.options_schema.model_validate(dict(options or {}))
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "<options>"
        raise RecipeError(f"{field}_options.{where}", f"{err['msg']} (reward {name!r})") from None
    return cls(parsed)
