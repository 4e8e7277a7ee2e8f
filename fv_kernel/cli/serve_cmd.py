"""``fv serve``: the OpenAI-style video API over a deployment (FastAPI under uvicorn).

FastAPI and uvicorn are imported only when the command runs, so ``fv --help`` stays
fast and works without the ``serve`` extra.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from fv_kernel.cli.deploy_options import ConfigOption

if TYPE_CHECKING:  # the config imports the engine (torch); the CLI root must stay light
    from fv_kernel.config import DeployConfig

__all__ = ["serve", "resolve_serve_config", "preflight_cards"]


def resolve_serve_config(
    config_path: Optional[Path],
    models: list[str],
    host: Optional[str],
    port: Optional[int],
    api_key: Optional[str],
) -> "DeployConfig":
    """The deploy config with the command line's overrides applied (``--model`` replaces ``cards:``).

    Read by the one strict loader every ``--config`` uses; raises ``DeployConfigError`` naming the key.
    """
    from fv_kernel.config import DeployConfig, load_deploy_config

    config = load_deploy_config(config_path) if config_path is not None else DeployConfig()
    updates: dict[str, Any] = {}
    if models:
        updates["cards"] = [{"model": m} for m in models]
    server: dict[str, Any] = {}
    if host is not None:
        server["host"] = host
    if port is not None:
        server["port"] = port
    if server:
        updates["server"] = config.server.model_copy(update=server).model_dump()
    if api_key:
        updates["api_key"] = api_key
    if not updates:
        return config
    # Re-validate, so a bad override is reported exactly like a bad config key.
    return DeployConfig.model_validate({**config.model_dump(), **updates})


def preflight_cards(deploy: "DeployConfig", plugin_host: Any) -> None:
    """Before any card is built: every configured card's checkpoint source is there and all their
    weights fit their devices together (``fv_kernel.model.preflight``); one typed error otherwise."""
    from fv_kernel.model.catalog import CardCatalog
    from fv_kernel.model.preflight import preflight_deployment
    from fv_kernel.deploy.options import deployment_options

    catalog = CardCatalog(plugin_host)
    plans = []
    for deployment in deploy.cards:
        resolved = catalog.resolve(deployment.model)
        plans.append((resolved.card, deployment_options(deployment, plugin_host.registry(), source=resolved.source)))
    preflight_deployment(plans)


def serve(
    config: Optional[Path] = ConfigOption,
    model: list[str] = typer.Option([], "--model", "-m", help="Card to serve (repeatable); replaces the config's cards."),
    host: Optional[str] = typer.Option(None, "--host", help="Interface to bind (default 127.0.0.1)."),
    port: Optional[int] = typer.Option(None, "--port", help="Port to listen on (default 8000)."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", help="Require 'Authorization: Bearer KEY' (default: $FV_API_KEY or the config's api_key)."
    ),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
) -> None:
    """Serve the OpenAI-style video API (POST /v1/videos, SSE events, /metrics) over the deployment."""
    from fv_kernel.cli.deploy_options import fail, start_host
    from fv_kernel.config import DeployConfig, DeployConfigError
    from fv_kernel.errors import FvError

    try:
        deploy = resolve_serve_config(config, model, host, port, api_key or os.environ.get("FV_API_KEY"))
    except DeployConfigError as exc:
        fail(exc.message)
    # A multi-rank ``parallel:`` plan: under torchrun every rank runs this command and ranks
    # other than 0 serve rank 0's decisions; run plainly, fv starts the other ranks itself.
    workers = None
    if deploy.parallel is not None and deploy.parallel.world_size > 1:
        if not deploy.cards:
            fail("a parallel plan needs its cards listed (cards: or --model): every rank must build the same ones")
        from fv_kernel.deploy.parallel import check_deploy_plan

        try:  # a bad plan is one line here, before any rank starts
            check_deploy_plan(deploy, start_host(deploy))
        except FvError as exc:
            fail(str(exc))
        if int(os.environ.get("RANK", "0")) != 0:
            from fv_kernel.deploy.workers import serve_as_worker

            try:
                serve_as_worker(deploy.model_dump_json())
            except FvError as exc:
                fail(str(exc))
            return
        if "RANK" not in os.environ:
            from fv_kernel.deploy.workers import LocalWorkers

            workers = LocalWorkers(deploy.parallel.world_size, deploy.model_dump_json())
    try:
        from fv_kernel.serving import create_app, serve_forever
    except ImportError as exc:
        typer.echo(f"error: fv serve needs the serve extra (in your fv checkout: pip install '.[serve]'): {exc}", err=True)
        raise typer.Exit(2) from None
    from fv_kernel.plugins import PluginError
    from fv_kernel.deploy.engine import build_engine
    from fv_kernel.serving.store import DataDirInUse, DataDirLock

    # Before any model loads: a second server on this data dir would rewrite the first's live jobs.
    try:
        data_dir_lock = DataDirLock(deploy.output_dir).acquire()
    except DataDirInUse as exc:
        fail(str(exc), code=1)
    plugin_host = start_host(deploy)
    try:
        if not deploy.cards:
            default = plugin_host.hooks.default_model()
            if default is None:
                typer.echo("error: no card to serve: pass --model CARD or list cards in the config", err=True)
                raise typer.Exit(2)
            deploy = deploy.model_copy(update={"cards": [{"model": default}]})
            deploy = DeployConfig.model_validate(deploy.model_dump())
        preflight_cards(deploy, plugin_host)
        engine = build_engine(deploy, host=plugin_host, launcher=workers)
    except (FvError, PluginError) as exc:
        fail(str(exc))
    app = create_app(engine, deploy, data_dir_lock=data_dir_lock)
    typer.echo(
        f"fv serve: {', '.join(sorted(engine.instances))} on http://{deploy.server.host}:{deploy.server.port}"
        + (" (API key required)" if deploy.api_key else ""),
        err=True,
    )
    try:
        serve_forever(
            app, host=deploy.server.host, port=deploy.server.port, log_level=log_level,
            shutdown_timeout_s=deploy.server.shutdown_timeout_s,
        )
    finally:
        leader = getattr(engine, "leader", None)
        if leader is not None:  # release the other ranks of a parallel pool
            leader.shutdown()
        if workers is not None:
            workers.join()
