"""Plugin HTTP routes (``fv_serving_routes``): mounted on ``fv serve``'s app behind the kernel's
middleware; a plugin that raises, or that would take a kernel route, loses its own routes only."""

from __future__ import annotations

import types
import warnings
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi import APIRouter, FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from fv_kernel.config import DeployConfig  # noqa: E402
from fv_kernel.plugins import PluginHost, PluginWarning, hookimpl  # noqa: E402
from fv_kernel.runtime.engine import Engine  # noqa: E402
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.serving import create_app  # noqa: E402


def _plugin(register_routes):  # a plugin object implementing fv_serving_routes with the given body
    module = types.SimpleNamespace()

    @hookimpl
    def fv_serving_routes(app: FastAPI, engine: Engine, config: DeployConfig) -> None:
        register_routes(app, engine, config)

    module.fv_serving_routes = fv_serving_routes
    return module


def _good(app: FastAPI, engine: Engine, config: DeployConfig) -> None:
    router = APIRouter()

    @router.get("/hello/{name}")
    async def hello(name: str) -> dict[str, str]:
        return {"hello": name, "engine": type(engine).__name__, "output_dir": str(config.output_dir)}

    app.include_router(router)


def _raises_halfway(app: FastAPI, engine: Engine, config: DeployConfig) -> None:
    @app.get("/half")
    async def half() -> dict[str, str]:
        return {}

    raise RuntimeError("route setup exploded")


def _takes_health(app: FastAPI, engine: Engine, config: DeployConfig) -> None:
    @app.get("/mine")
    async def mine() -> dict[str, str]:
        return {}

    @app.get("/health")
    async def fake_health() -> dict[str, str]:
        return {"status": "hijacked"}


def _app(tmp_path: Path, plugins: dict[str, object], api_key: str | None = None) -> FastAPI:
    host = PluginHost(discover=False)
    host.start()
    for name, plugin in plugins.items():
        host.register(plugin, name=name)
    engine = Engine(SchedulerConfig(), hooks=host.hooks)
    return create_app(engine, DeployConfig(output_dir=tmp_path / "out", api_key=api_key))


def test_plugin_routes_are_mounted_and_pass_through_the_kernels_middleware(tmp_path: Path) -> None:
    app = _app(tmp_path, {"fv-greeter": _plugin(_good)}, api_key="k")
    client = TestClient(app)
    assert client.get("/hello/fv").status_code == 401  # the kernel's auth covers plugin routes too
    answer = client.get("/hello/fv", headers={"Authorization": "Bearer k"})
    assert answer.status_code == 200 and answer.json()["hello"] == "fv" and answer.json()["engine"] == "Engine"
    assert app.state.plugin_routes == {"fv-greeter": "mounted 1 route(s)"}
    assert "/hello/{name}" in client.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()["paths"]


def test_a_failing_plugin_loses_its_routes_and_the_server_still_serves(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        app = _app(tmp_path, {"fv-broken-routes": _plugin(_raises_halfway), "fv-greeter": _plugin(_good)})
    client = TestClient(app)
    assert client.get("/half").status_code == 404  # the route it added before raising is gone
    assert client.get("/hello/x").status_code == 200 and client.get("/health").status_code == 200
    assert app.state.plugin_routes["fv-broken-routes"] == "refused: RuntimeError: route setup exploded"
    said = [str(w.message) for w in caught if issubclass(w.category, PluginWarning)]
    assert said == ["fv serve: plugin fv-broken-routes's routes are not mounted: RuntimeError: route setup exploded"]


def test_a_plugin_cannot_take_a_kernel_route(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)
        app = _app(tmp_path, {"fv-hijack": _plugin(_takes_health)})
    client = TestClient(app)
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/mine").status_code == 404  # all of the plugin's routes are off, not just the clash
    assert app.state.plugin_routes["fv-hijack"] == (
        "refused: PluginError: its route GET /health is already served by the kernel or an earlier plugin"
    )


def test_negative_control_without_the_containment_a_plugin_error_bricks_app_creation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fv_kernel.serving.app as serving_app

    def uncontained(app: FastAPI, engine: Engine, config: DeployConfig) -> dict[str, str]:
        for _, register in engine.hooks.serving_route_registrars():
            register(app=app, engine=engine, config=config)
        return {}

    monkeypatch.setattr(serving_app, "mount_plugin_routes", uncontained)
    with pytest.raises(RuntimeError, match="route setup exploded"):
        _app(tmp_path, {"fv-broken-routes": _plugin(_raises_halfway)})


def test_an_implementation_may_take_only_the_arguments_it_names(tmp_path: Path) -> None:
    module = types.SimpleNamespace()

    @hookimpl
    def fv_serving_routes(app: FastAPI) -> None:
        app.add_api_route("/only-app", lambda: {"ok": True})

    module.fv_serving_routes = fv_serving_routes
    app = _app(tmp_path, {"fv-minimal": module})
    assert TestClient(app).get("/only-app").json() == {"ok": True}
