"""``fv worker --config deploy.yaml``: an fv Engine served as a Dynamo worker.

One worker serves one card (Dynamo registers one model per endpoint; run one worker per
card, as many as the fleet needs). Its endpoints, under ``<namespace>.<component>``:

- ``videos``: registered as ``ModelType.Videos`` under the card's id; Dynamo's frontend
  serves it at ``/v1/videos``. A streaming request (``"stream": true``) gets
  ``in_progress`` chunks with the job's percentage, then the final one; a non-streaming
  request gets exactly one chunk (what Dynamo 1.6.1's frontend requires).
- ``images``: ``ModelType.Images`` (only when the card has ``text_to_image``), ``/v1/images/generations``.
- ``fleet``: not a model; ``{"op": "load"}`` (queued GPU-seconds, queue depth, running),
  ``{"op": "quote", "kind": "videos"|"images", "request": {...}}`` (that request's price
  here plus the queue) and ``{"op": "card"}`` (the DeploymentCard with live calibration).
  The cost-aware router (:mod:`fv_dynamo.router`) reads it.

A bad request is refused before any work with fv serve's body, raised as Dynamo's
``InvalidArgument`` (the frontend answers 400 and carries the body as the message).
A client that goes away cancels its fv request at the next step boundary. SIGTERM and
SIGINT deregister the worker from discovery, let running requests finish, then stop
the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Sequence

from fv_kernel.api import (
    DeployConfig,
    Engine,
    FvError,
    Request,
    RequestHandle,
    TaskType,
    VideoArtifact,
    build_engine,
    encode_png,
    load_deploy_config,
    write_mp4,
)

import fv_kernel.api as api

from fv_dynamo.card import ENGINE_SPECIFIC_KEY, DeploymentCard, SLOSchema, build_deployment_card, price_request
from fv_dynamo.requests import FleetRequestError, image_requests, video_request

__all__ = ["FvWorker", "WorkerOptions", "main", "run_worker"]

log = logging.getLogger("fv.dynamo")


@dataclass(frozen=True)
class WorkerOptions:
    """Where the worker registers; the engine itself comes from the deploy config."""

    namespace: str = "fv"
    component: str = "fv"
    slo: SLOSchema = SLOSchema()
    engine_id: str | None = None


class WorkerConfigError(Exception):
    """The deploy config cannot be served as one Dynamo worker."""


@dataclass
class _InFlight:
    """A request running here: its predicted GPU-seconds per loop and how far each loop got."""

    handle: RequestHandle
    per_loop: dict[str, float]
    steps_per_loop: dict[str, int]
    done_fraction: dict[str, float]
    #: The id a router gave the request (``extra_args.fv_route_id``), echoed in the load report.
    route_id: str | None = None
    tracker: asyncio.Task[None] | None = None

    @property
    def remaining_gpu_seconds(self) -> float:
        return sum(price * (1.0 - self.done_fraction.get(loop, 0.0)) for loop, price in self.per_loop.items())

    @property
    def remaining_steps(self) -> float:
        return sum(n * (1.0 - self.done_fraction.get(loop, 0.0)) for loop, n in self.steps_per_loop.items())

    async def track(self) -> None:
        async for event in self.handle.events():
            if event.type == "progress" and event.total:
                self.done_fraction[event.loop_id] = min(event.step / event.total, 1.0)


class FvWorker:
    """The endpoint handlers over one running Engine with one resident card."""

    def __init__(self, engine: Engine, options: WorkerOptions) -> None:
        if len(engine.instances) != 1:
            raise WorkerConfigError(
                f"cards: an fv Dynamo worker serves exactly one card (Dynamo registers one model per endpoint); "
                f"the deploy config has {len(engine.instances)}: {sorted(engine.instances) or 'none'}. "
                "Run one worker per card."
            )
        self.engine = engine
        self.options = options
        self.model_id, self.instance = next(iter(engine.instances.items()))
        self._inflight: dict[str, _InFlight] = {}
        #: Realtime sessions running here (their K/V lives in this engine): session id -> protocol state.
        self.sessions: dict[str, Any] = {}
        self.ready = False
        # fv serve's schemas import on first use (FastAPI, ~1 s): now, not in the first request's path.
        _ = (api.VideoCreate, api.ImageGenerate, api.from_fv_error)

    @property
    def fleet_endpoint(self) -> str:
        return f"{self.options.namespace}.{self.options.component}.fleet"

    @property
    def serves_images(self) -> bool:
        return TaskType.TEXT_TO_IMAGE in self.instance.card.capabilities.tasks

    @property
    def serves_realtime(self) -> bool:
        """The card streams sessions (``ModelCard.streams_sessions``: it has a ``chunk_rollout`` loop)."""
        return self.instance.card.streams_sessions

    @property
    def serves_videos(self) -> bool:
        return TaskType.TEXT_TO_VIDEO in self.instance.card.capabilities.tasks

    def card(self) -> DeploymentCard:
        return build_deployment_card(self.engine, engine_id=self.options.engine_id, fleet_endpoint=self.fleet_endpoint,
                                     slo=self.options.slo)

    # -- load -------------------------------------------------------------------------
    def queued_gpu_seconds(self) -> float:
        """Predicted GPU-seconds still to run here: each request's loops' prices times the share of each not yet done."""
        return sum(f.remaining_gpu_seconds for f in self._inflight.values())

    def load(self) -> dict[str, Any]:
        return {
            "queued_gpu_seconds": self.queued_gpu_seconds(),
            # Per in-flight request: [GPU-seconds, steps] still to run (a router models step interleaving with them).
            "requests": [[f.remaining_gpu_seconds, f.remaining_steps, f.route_id] for f in self._inflight.values()],
            "queue_depth": self.engine.queue_depth(),
            "running": self.engine.running_count(), "ready": self.ready,
        }

    def _submit(self, request: Request, route_id: str | None = None) -> RequestHandle:
        price = price_request(self.engine, request)
        try:
            handle = self.engine.submit(request)
        except FvError as exc:  # queue_full: fv serve's 429 body
            raise _invalid(FleetRequestError.from_api_error(api.from_fv_error(exc))) from None
        entry = self._inflight[request.request_id] = _InFlight(
            handle, dict(price.per_loop), dict(price.steps_per_loop), {}, route_id=route_id)
        entry.tracker = asyncio.ensure_future(entry.track())
        log.info("request %s accepted (%s, %.3f GPU-s predicted)", request.request_id, request.task.value, price.gpu_seconds)
        return handle

    def _done(self, request_id: str) -> None:
        entry = self._inflight.pop(request_id, None)
        if entry is not None:
            if entry.tracker is not None:
                entry.tracker.cancel()
            log.info("request %s ended: %s", request_id, entry.handle.status)
        self.engine.forget(request_id)

    # -- handlers -----------------------------------------------------------------------
    async def fleet(self, payload: Mapping[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        op = payload.get("op")
        if op == "load":
            yield self.load()
        elif op == "card":
            yield self.card().model_dump(mode="json")
        elif op == "quote":
            kind = payload.get("kind", "videos")
            try:
                build = video_request if kind == "videos" else image_requests
                built = build(self.engine, payload.get("request") or {})
                requests = built if isinstance(built, list) else [built]
                points = [price_request(self.engine, r) for r in requests]
            except FleetRequestError as exc:
                yield {"error": exc.body["error"], "status": exc.status}
                return
            yield {**self.load(), "gpu_seconds": sum(p.gpu_seconds for p in points),
                   "steps": max(sum(p.steps_per_loop.values()) for p in points)}
        else:
            yield {"error": {"message": f"op: unknown {op!r}; allowed: load, quote, card", "type": "invalid_request",
                             "param": "op", "code": "invalid_request"}, "status": 400}

    async def videos(self, payload: Mapping[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        request = self._accept(lambda: video_request(self.engine, payload))
        handle = self._submit(request, _route_id(payload))
        stream = bool(payload.get("stream"))
        watcher = _watch_cancellation(context, [handle])
        created = int(time.time())
        base = {"id": request.request_id, "object": "video", "model": self.model_id, "created": created}
        started = time.monotonic()
        try:
            if stream:
                # A first chunk at once: the caller (a router) knows the request is counted in this worker's load.
                yield {**base, "status": "queued", "progress": 0, "data": []}
                async for percent in _progress(handle, self.instance.card.programs.get(request.task)):
                    yield {**base, "status": "in_progress", "progress": percent, "data": []}
            result = await handle.result()
            yield await self._final_video(base, result, started)
        finally:
            watcher.cancel()
            self._done(request.request_id)

    async def realtime(self, payload: Mapping[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """The ``realtime`` endpoint: vLLM-Omni's realtime video messages (docs/realtime.md) as JSON.

        ``session.start`` streams the session's messages (each chunk one ``video.chunk`` with its
        fMP4 in base64) until ``session.done``; ``session.interaction`` / ``session.stop`` /
        ``session.ping`` carry ``session_id`` and get one answer. Mistakes are ``error`` messages
        (the session lives on). Sessions stay on this worker: the router keeps them here.
        """
        kind = payload.get("type")
        if kind == "session.start":
            fields = {k: v for k, v in payload.items() if k != "type"}
            try:
                session = api.open_realtime_session(self.engine.open_session, fields, default_model=self.model_id,
                                                    limits=api.RealtimeLimits())
            except api.ProtocolError as exc:
                yield exc.event()
                return
            sid = session.request_id
            self.sessions[sid] = session
            watcher = asyncio.ensure_future(_stopped(context))
            watcher.add_done_callback(lambda task: None if task.cancelled() else session.disconnect())
            try:
                async for message, binary in session.messages():
                    if binary is not None:
                        message = api.chunk_as_json(message, binary)
                        session.ping()  # a stream being read keeps the session from idling out
                    yield message
            finally:
                watcher.cancel()
                if not session.done:
                    session.disconnect()
                self.sessions.pop(sid, None)
            return
        sid = payload.get("session_id")
        session = self.sessions.get(sid) if isinstance(sid, str) else None
        if kind not in ("session.interaction", "session.stop", "session.ping"):
            yield api.ProtocolError("unknown_message_type", f"type: unknown message type {kind!r}; allowed: "
                                    "session.start, session.interaction, session.stop, session.ping", "type").event(sid)
            return
        if session is None:
            yield api.ProtocolError("not_found", f"session_id: no realtime session {sid!r} on this worker",
                                    "session_id").event(sid)
            return
        try:
            session.ping()
            if kind == "session.interaction":
                interaction = api.parse_interaction({k: v for k, v in payload.items() if k not in ("type", "session_id")})
                event_id, version = session.interact(interaction)
                yield {"type": "session.interaction.queued", "request_id": sid, "event_id": event_id, "version": version}
            elif kind == "session.stop":
                session.stop()
                yield {"type": "session.stopping", "request_id": sid}
            else:
                yield {"type": "session.pong", "request_id": sid}
        except api.ProtocolError as exc:
            yield exc.event(sid)

    async def images(self, payload: Mapping[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        requests = self._accept(lambda: image_requests(self.engine, payload))
        handles: list[RequestHandle] = []
        try:
            for request in requests:
                handles.append(self._submit(request, _route_id(payload)))
        except BaseException:
            for handle in handles:
                handle.cancel("a sibling image of the same call was refused")
                self._done(handle.request_id)
            raise
        watcher = _watch_cancellation(context, handles)
        try:
            results = await asyncio.gather(*(h.result() for h in handles))
            data = []
            for result in results:
                if result.status != "completed":
                    raise RuntimeError(_failure_message(result))
                video = next(a for a in result.artifacts if isinstance(a, VideoArtifact))
                png = await asyncio.to_thread(encode_png, video.frames[0])
                data.append({"b64_json": base64.b64encode(png).decode()})
            yield {"created": int(time.time()), "data": data, "output_format": "png"}
        finally:
            watcher.cancel()
            for handle in handles:
                if handle.status in ("queued", "in_progress"):
                    handle.cancel("the call ended")
                self._done(handle.request_id)

    def _accept(self, build: Any) -> Any:
        if not self.ready:
            raise _invalid(FleetRequestError(503, {"error": {
                "message": "the worker is shutting down", "type": "shutting_down", "param": None, "code": "shutting_down"}}))
        try:
            return build()
        except FleetRequestError as exc:
            raise _invalid(exc) from None

    async def _final_video(self, base: dict[str, Any], result: Any, started: float) -> dict[str, Any]:
        elapsed = time.monotonic() - started
        if result.status != "completed":
            return {**base, "status": result.status, "progress": 0, "data": [], "error": _failure_message(result),
                    "inference_time_s": elapsed}
        video = next((a for a in result.artifacts if isinstance(a, VideoArtifact) and not a.provenance.partial), None)
        if video is None:
            return {**base, "status": "failed", "progress": 0, "data": [], "error": "the program produced no video",
                    "inference_time_s": elapsed}
        mp4 = await asyncio.to_thread(_mp4_bytes, video)
        return {**base, "status": "completed", "progress": 100, "inference_time_s": elapsed,
                "data": [{"output_format": "mp4", "b64_json": base64.b64encode(mp4).decode(), "fps": round(video.fps)}]}


def _route_id(payload: Mapping[str, Any]) -> str | None:
    value = (payload.get("extra_args") or {}).get("fv_route_id")
    return str(value) if value is not None else None


def _invalid(exc: FleetRequestError) -> Exception:
    """fv serve's refusal as the exception Dynamo's frontend turns into a 400 carrying the body."""
    from dynamo.llm.exceptions import InvalidArgument

    return InvalidArgument(json.dumps(exc.body))


def _failure_message(result: Any) -> str:
    error = result.error
    if error is None:
        return f"the request was {result.status}"
    return json.dumps({"error": {"message": error.message, "type": error.type, "param": getattr(error, "param", None),
                                 "code": error.type}})


def _mp4_bytes(video: VideoArtifact) -> bytes:
    with tempfile.TemporaryDirectory(prefix="fv-dynamo-") as folder:
        path = Path(folder) / "video.mp4"
        write_mp4(video.frames, video.fps, path)
        return path.read_bytes()


async def _progress(handle: RequestHandle, program_spec: Any) -> AsyncIterator[int]:
    """The request's percentage as fv serve's job stream reports it: loops weighted equally, never 100 early."""
    loops = len(program_spec.loops) if program_spec else 1
    fraction: dict[str, float] = {}
    last = -1
    async for event in handle.events():
        if event.type != "progress" or not event.total:
            continue
        fraction[event.loop_id] = min(event.step / event.total, 1.0)
        percent = min(int(100 * sum(fraction.values()) / max(loops, len(fraction), 1)), 99)
        if percent > last:
            last = percent
            yield percent


async def _stopped(context: Any) -> None:
    """Returns once Dynamo stops or kills the stream (never without a context)."""
    if context is None:
        await asyncio.Event().wait()
    await context.async_killed_or_stopped()


def _watch_cancellation(context: Any, handles: Sequence[RequestHandle]) -> asyncio.Task[None]:
    """Cancel the fv requests at their next step boundary once Dynamo stops or kills the stream.

    A watcher task, not a check in the generator: when the client goes away Dynamo stops
    pulling the generator, so code after its current ``yield`` may never run.
    """

    async def watch() -> None:
        if context is None:
            await asyncio.Event().wait()
        await context.async_killed_or_stopped()
        for handle in handles:
            if handle.status in ("queued", "in_progress"):
                log.info("request %s: the frontend stopped the stream; cancelling", handle.request_id)
                handle.cancel("cancelled by the client (Dynamo stopped the stream)")

    return asyncio.ensure_future(watch())


async def run_worker(runtime: Any, config: DeployConfig, options: WorkerOptions) -> None:
    """Build the engine, serve and register its endpoints, and run until the runtime shuts down."""
    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

    engine = build_engine(config)
    worker = FvWorker(engine, options)
    # Load every component of every task before registering: the first request routed here must
    # not pay a cold load, and loads of two tasks never race each other (one at a time, here).
    for task in worker.instance.card.capabilities.tasks:
        if task in (TaskType.TEXT_TO_VIDEO, TaskType.TEXT_TO_IMAGE):
            await asyncio.to_thread(worker.instance.load_for_task, task)
    await engine.start()
    loop = asyncio.get_running_loop()

    def shutdown() -> None:
        log.info("fv worker: stop requested; deregistering, then finishing running requests")
        worker.ready = False
        runtime.shutdown()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown)
    card = worker.card()
    card_json = card.model_dump(mode="json")
    runtime_config = ModelRuntimeConfig()
    runtime_config.set_engine_specific(ENGINE_SPECIFIC_KEY, json.dumps(card_json))
    prefix = f"{options.namespace}.{options.component}"
    fleet_ep = runtime.endpoint(f"{prefix}.fleet")
    serving: list[Any] = [fleet_ep.serve_endpoint(worker.fleet)]
    if worker.serves_realtime:  # not a model type Dynamo's frontend knows: reached through fv_dynamo.sessions
        serving.append(runtime.endpoint(f"{prefix}.realtime").serve_endpoint(worker.realtime))
    registrations: list[Any] = []
    for kind, model_type, handler, served in (
        ("videos", ModelType.Videos, worker.videos, worker.serves_videos),
        ("images", ModelType.Images, worker.images, worker.serves_images),
    ):
        if not served:
            continue
        endpoint = runtime.endpoint(f"{prefix}.{kind}")
        serving.append(endpoint.serve_endpoint(handler))
        registrations.append(register_model(
            ModelInput.Text, model_type, endpoint, worker.model_id, worker.model_id,
            worker_type=WorkerType.Aggregated, needs=[], runtime_config=runtime_config,
            user_data={ENGINE_SPECIFIC_KEY: card_json},
        ))
    worker.ready = True
    served = [asyncio.ensure_future(s) for s in serving]
    await asyncio.gather(*registrations)
    log.info("fv worker ready: %s at %s (%s)", worker.model_id, prefix,
             ", ".join(k for k, s in (("videos", worker.serves_videos), ("images", worker.serves_images)) if s))
    print(f"fv worker ready: {worker.model_id} at {prefix}", flush=True)
    try:
        await asyncio.gather(*served)
    finally:
        await engine.stop()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fv worker", description="Serve an fv engine as an NVIDIA Dynamo worker.")
    parser.add_argument("--config", required=True, help="the deploy config (exactly one card)")
    parser.add_argument("--namespace", default=os.environ.get("DYN_NAMESPACE", "fv"),
                        help="Dynamo namespace (default: $DYN_NAMESPACE or fv)")
    parser.add_argument("--component", default="fv", help="Dynamo component name (default: fv)")
    parser.add_argument("--engine-id", default=None, help="the DeploymentCard's engine_id (default: <host>/fv)")
    parser.add_argument("--slo-p95-video-s", type=float, default=None, help="SLO: p95 latency of a video request")
    parser.add_argument("--slo-p95-image-s", type=float, default=None, help="SLO: p95 latency of an image request")
    parser.add_argument("--slo-max-queued-gpu-s", type=float, default=None,
                        help="SLO: queued GPU-seconds beyond which this worker counts as saturated")
    return parser.parse_args(argv)


def options_from_values(*, namespace: str, component: str, engine_id: str | None, slo_p95_video_s: float | None,
                        slo_p95_image_s: float | None, slo_max_queued_gpu_s: float | None) -> WorkerOptions:
    p95 = {k: v for k, v in (("video", slo_p95_video_s), ("image", slo_p95_image_s)) if v is not None}
    return WorkerOptions(namespace=namespace, component=component, engine_id=engine_id,
                         slo=SLOSchema(p95_latency_s=p95, max_queued_gpu_seconds=slo_max_queued_gpu_s))


def options_from_args(args: argparse.Namespace) -> WorkerOptions:
    return options_from_values(namespace=args.namespace, component=args.component, engine_id=args.engine_id,
                               slo_p95_video_s=args.slo_p95_video_s, slo_p95_image_s=args.slo_p95_image_s,
                               slo_max_queued_gpu_s=args.slo_max_queued_gpu_s)


def serve(config_path: str, options: WorkerOptions) -> int:
    """Load the deploy config and run the worker until SIGTERM/SIGINT; the process exit code."""
    try:
        config = load_deploy_config(config_path)
    except FvError as exc:
        print(f"fv worker: {exc.message}", file=sys.stderr)
        return 2
    try:
        from dynamo.runtime import dynamo_worker
    except ImportError:
        print("fv worker: NVIDIA Dynamo is not installed (see plugins/fv-dynamo/README.md: Install)", file=sys.stderr)
        return 2

    @dynamo_worker()
    async def entry(runtime: Any) -> None:
        await run_worker(runtime, config, options)

    try:
        asyncio.run(entry())
    except WorkerConfigError as exc:
        print(f"fv worker: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("FV_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = _parse_args(argv)
    return serve(args.config, options_from_args(args))


if __name__ == "__main__":
    sys.exit(main())
