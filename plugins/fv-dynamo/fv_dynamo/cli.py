"""``fv worker`` and ``fv realtime-gateway``: the commands fv-dynamo's manifest declares (the kernel's CLI runs
them, importing this only then)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from fv_dynamo.worker import options_from_values, serve

__all__ = ["realtime_gateway", "worker"]


def worker(
    config: Annotated[Path, typer.Option("--config", help="Deploy config with exactly one card.")],
    namespace: Annotated[str, typer.Option(help="Dynamo namespace.", envvar="DYN_NAMESPACE")] = "fv",
    component: Annotated[str, typer.Option(help="Dynamo component name.")] = "fv",
    engine_id: Annotated[Optional[str], typer.Option(help="The DeploymentCard's engine_id (default <host>/fv).")] = None,
    slo_p95_video_s: Annotated[Optional[float], typer.Option(help="SLO: p95 latency of a video request, seconds.")] = None,
    slo_p95_image_s: Annotated[Optional[float], typer.Option(help="SLO: p95 latency of an image request, seconds.")] = None,
    slo_max_queued_gpu_s: Annotated[Optional[float], typer.Option(
        help="SLO: queued GPU-seconds beyond which this worker counts as saturated.")] = None,
) -> None:
    """Serve the deploy config's card as an NVIDIA Dynamo worker (/v1/videos, /v1/images via Dynamo's frontend)."""
    logging.basicConfig(level=os.environ.get("FV_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    options = options_from_values(namespace=namespace, component=component, engine_id=engine_id,
                                  slo_p95_video_s=slo_p95_video_s, slo_p95_image_s=slo_p95_image_s,
                                  slo_max_queued_gpu_s=slo_max_queued_gpu_s)
    code = serve(str(config), options)
    if code:
        raise typer.Exit(code)


def realtime_gateway(
    namespace: Annotated[str, typer.Option(help="Dynamo namespace of the workers.", envvar="DYN_NAMESPACE")] = "fv",
    component: Annotated[str, typer.Option(help="Dynamo component name of the workers.")] = "fv",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.", min=1, max=65535)] = 8100,
    api_key: Annotated[Optional[str], typer.Option(help="Require this key on the WebSocket (Bearer or ?api_key=).",
                                                   envvar="FV_API_KEY")] = None,
) -> None:
    """Serve WS /v1/realtime/video in front of the fleet's workers, each session kept on the worker that holds it."""
    from fv_dynamo.gateway import serve_gateway

    logging.basicConfig(level=os.environ.get("FV_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    code = serve_gateway(namespace, component, host, port, api_key)
    if code:
        raise typer.Exit(code)
