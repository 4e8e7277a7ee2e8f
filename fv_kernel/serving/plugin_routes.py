"""Plugin HTTP routes on ``fv serve``'s app (the ``fv_serving_routes`` hook), each plugin contained.

A plugin's registrar runs alone. If it raises, or a route it adds answers a path and method
that the kernel (or an earlier plugin) already serves, every route it added is taken off
again and the server starts without them: one plugin cannot brick the server nor take over a
kernel route. ``app.state.plugin_routes`` maps each plugin to what happened.
"""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI

from fv_kernel.plugins.errors import PluginError, one_line
from fv_kernel.plugins.host import PluginWarning

__all__ = ["mount_plugin_routes"]


def _endpoints(route: Any) -> set[tuple[str, str]]:
    """(path, method) pairs a route answers; a websocket route answers method ``WEBSOCKET``."""
    path = getattr(route, "path", None)
    if path is None:
        return set()
    methods = getattr(route, "methods", None) or {"WEBSOCKET"}
    return {(path, method) for method in methods}


def mount_plugin_routes(app: FastAPI, engine: Any, config: Any) -> dict[str, str]:
    """Call every enabled plugin's ``fv_serving_routes`` on ``app``; returns (and stores) each outcome."""
    outcomes: dict[str, str] = {}
    hooks = getattr(engine, "hooks", None)
    registrars = hooks.serving_route_registrars() if hooks is not None else []
    for plugin, register in registrars:
        before = list(app.router.routes)
        served = set().union(*(_endpoints(r) for r in before)) if before else set()
        try:
            register(app=app, engine=engine, config=config)
            added = [r for r in app.router.routes if not any(r is b for b in before)]
            for route in added:
                clash = sorted(_endpoints(route) & served)
                if clash:
                    path, method = clash[0]
                    raise PluginError(f"its route {method} {path} is already served by the kernel or an earlier plugin")
                served |= _endpoints(route)
        except Exception as exc:  # a plugin may raise anything; the server must still start
            app.router.routes[:] = before
            app.openapi_schema = None
            outcomes[plugin] = f"refused: {one_line(exc)}"
            warnings.warn(
                f"fv serve: plugin {plugin}'s routes are not mounted: {one_line(exc)}", PluginWarning, stacklevel=2
            )
        else:
            outcomes[plugin] = f"mounted {len(added)} route(s)"
            app.openapi_schema = None  # the schema, if built, is rebuilt with them
    app.state.plugin_routes = outcomes
    return outcomes
