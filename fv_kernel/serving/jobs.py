"""Video jobs over the Engine: create, follow, persist, stream, cancel, delete.

A job is owned by the server, not by the HTTP request that created it: a follower
task per job consumes the engine's typed events, writes the job's state to SQLite
and its artifacts to ``<output_dir>/<job id>/``, and republishes the events for any
number of SSE subscribers. A client that disconnects loses nothing.

A finished job lives on disk, not in memory: when it ends, its row and its whole event
stream are written to SQLite in one transaction and the engine forgets its tensors; only
the encoded streams of the most recent finished jobs stay in memory, up to
``server.finished_history_bytes``. A DELETE frees the job everywhere.

A job also survives the server: its request is saved as a program checkpoint when the
job is created, and the checkpoint is rewritten every ``checkpoint_every_steps`` steps
while it runs. A server started on the same data dir resumes every job the previous
process left queued or running, from its last checkpoint; a job it cannot resume
fails with a reason (``error.type = "not_resumable"``), none is silently lost.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import shutil
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import torch
from pydantic import BaseModel, ValidationError

from fv_kernel.model.instance import ModelInstance
from fv_kernel.config import ServerConfig
from fv_kernel.model.validate import check_envelope, frames_for_seconds
from fv_kernel.errors import FvError, UnknownModel
from fv_kernel.state import StateFormatError
from fv_kernel.program.resume import ProgramCheckpoint, ProgramRun
from fv_kernel.request.artifacts import VideoArtifact
from fv_kernel.request.request import AdapterRef, DiffusionParams, ImagePart, OutputSpec, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.records import RequestHandle, held_tensor_bytes
from fv_kernel.serving.errors import ApiError, from_fv_error, from_validation_errors
from fv_kernel.serving.media import VARIANTS, preview_png, write_job_files
from fv_kernel.serving.schemas import (
    JOB_ID_PATTERN,
    ImageData,
    ImageGenerate,
    ImagesResponse,
    JobError,
    VideoCreate,
    VideoJob,
    _Generation,
    parse_size,
)
from fv_kernel.serving.store import CheckpointStore, JobRecord, JobStore

__all__ = ["JobManager", "StreamEvent", "ClientDisconnected", "SHUTDOWN_EVENT"]

log = logging.getLogger("fv.serving")

#: The deploy config's defaults (``server.*``), so the two cannot drift apart.
_DEFAULT_CHECKPOINT_EVERY_STEPS: int = ServerConfig.model_fields["checkpoint_every_steps"].default
_DEFAULT_CHECKPOINT_MAX_BYTES: int | None = ServerConfig.model_fields["checkpoint_max_bytes"].default
_DEFAULT_FINISHED_HISTORY_BYTES: int = ServerConfig.model_fields["finished_history_bytes"].default

#: How often a synchronous images call checks whether its client is still connected.
_DISCONNECT_POLL_S = 0.1

#: The event a subscriber gets when the server stops while its job is unfinished. It has no
#: ``id:`` (it is not part of the job's stream); the job resumes when a server restarts.
SHUTDOWN_EVENT = "server.shutdown"


@dataclass(frozen=True)
class StreamEvent:
    """One server-sent event of a job's stream."""

    #: The event's position in the job's stream; -1 for a notice outside it (``server.shutdown``).
    seq: int
    event: str
    data: dict[str, Any]


class ClientDisconnected(Exception):
    """The client of a synchronous call went away; its requests were cancelled."""


@dataclass
class _LiveJob:
    """A job this process runs or recently finished: its engine handle (while it runs), its event
    history and subscribers."""

    record: JobRecord
    handle: RequestHandle | None
    loop_total: int
    events: list[StreamEvent] = field(default_factory=list)
    subscribers: list[asyncio.Queue[StreamEvent | None]] = field(default_factory=list)
    loop_fraction: dict[str, float] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    #: A client asked to cancel or delete it (a cancellation by a server shutdown is not final).
    cancelled_by_client: bool = False
    #: Once the job finished: its history as stored, (seq, event, JSON text), replacing ``events``
    #: (compact, and what ``history_bytes`` measures), and the bytes of that JSON.
    stored: list[tuple[int, str, str]] | None = None
    history_bytes: int = 0

    def publish(self, event: str, data: dict[str, Any]) -> None:
        item = StreamEvent(len(self.events), event, data)
        self.events.append(item)
        for queue in self.subscribers:
            queue.put_nowait(item)

    def close(self) -> None:
        self.done.set()
        for queue in self.subscribers:
            queue.put_nowait(None)

    def shutdown_notice(self) -> StreamEvent:
        return StreamEvent(-1, SHUTDOWN_EVENT, {
            "id": self.record.id, "status": self.record.status, "progress": self.record.progress,
            "message": "the server is shutting down; this job resumes when a server starts again on its data dir: "
                       "reconnect then (GET /v1/videos/{id} or its events)",
        })

    def end_streams_for_shutdown(self) -> None:
        """Send every subscriber the shutdown notice and end their streams (the job itself goes on)."""
        notice = self.shutdown_notice()
        for queue in self.subscribers:
            queue.put_nowait(notice)
            queue.put_nowait(None)

    def update_progress(self, loop_id: str, step: int, total: int | None) -> int:
        if total:
            self.loop_fraction[loop_id] = min(step / total, 1.0)
        loops = max(self.loop_total, len(self.loop_fraction), 1)
        # Never report 100 before the files are written; never go backwards.
        value = min(int(100 * sum(self.loop_fraction.values()) / loops), 99)
        self.record.progress = max(self.record.progress, value)
        return self.record.progress


class _CannotResume(Exception):
    """Why a job a previous process left unfinished cannot continue."""


def new_job_id() -> str:
    return f"video_{uuid.uuid4().hex}"


class JobManager:
    """The serving layer's view of the engine: typed API bodies in, jobs out."""

    def __init__(
        self,
        engine: Engine,
        store: JobStore,
        output_dir: Path,
        *,
        enabled_extensions: Mapping[str, Mapping[str, Any]],
        extension_schemas: Mapping[str, type[BaseModel]],
        rejections: Counter[str],
        checkpoints: CheckpointStore | None = None,
        checkpoint_every_steps: int = _DEFAULT_CHECKPOINT_EVERY_STEPS,
        checkpoint_max_bytes: int | None = _DEFAULT_CHECKPOINT_MAX_BYTES,
        finished_history_bytes: int = _DEFAULT_FINISHED_HISTORY_BYTES,
    ) -> None:
        self.engine = engine
        self.store = store
        self.output_dir = output_dir
        #: Each unfinished video job's program checkpoint (its request from the start).
        self.checkpoints = checkpoints if checkpoints is not None else CheckpointStore(output_dir / "checkpoints")
        self.checkpoint_every_steps = checkpoint_every_steps
        self.checkpoint_max_bytes = checkpoint_max_bytes
        #: Mid-loop checkpoints not written because they were over ``checkpoint_max_bytes``.
        self.checkpoints_skipped = 0
        #: The latest ProgramRun of each running job that checkpoints (for a last checkpoint at shutdown).
        self._runs: dict[str, ProgramRun] = {}
        self._stopping = False
        self._stopped = False
        #: Finished jobs' histories kept in memory (encoded bytes) before late subscribers read them from disk.
        self.finished_history_bytes = finished_history_bytes
        self.enabled_extensions = dict(enabled_extensions)
        self.extension_schemas = dict(extension_schemas)
        self.rejections = rejections
        self._live: OrderedDict[str, _LiveJob] = OrderedDict()

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> list[str]:
        """Start the engine and resume the jobs a previous process left unfinished. Returns the resumed ids.

        Each resumes from its last checkpoint (a job that never checkpointed mid-run starts
        over from its saved request); one that cannot resume is marked failed with the reason.
        """
        await self.engine.start()
        resumed: list[str] = []
        for record in self.store.unfinished():
            try:
                self._resume(record)
            except _CannotResume as exc:
                log.warning("job %s cannot resume: %s", record.id, exc)
                error = {"type": "not_resumable", "message": f"the server restarted and could not resume this job: {exc}",
                         "param": None}
                self.store.finish(record.id, "failed", at=time.time(), progress=record.progress, error=error)
                self.checkpoints.delete(record.id)
            else:
                resumed.append(record.id)
        unfinished = set(resumed)
        for job_id in self.checkpoints.job_ids():  # a job killed between its checkpoint and its row
            if job_id not in unfinished:
                self.checkpoints.delete(job_id)
        if resumed:
            log.warning("resumed %d job(s) a previous process left unfinished", len(resumed))
        return resumed

    def _resume(self, record: JobRecord) -> None:
        instance = self.engine.instances.get(record.model)
        if instance is None:
            served = ", ".join(sorted(self.engine.instances)) or "none"
            raise _CannotResume(f"card {record.model!r} is no longer served (served: {served})")
        try:
            checkpoint = self.checkpoints.read(record.id)
        except FileNotFoundError:
            raise _CannotResume("it has no checkpoint (it was created by a server that did not save one)") from None
        except StateFormatError as exc:
            raise _CannotResume(f"its checkpoint is unreadable ({exc.message})") from None
        try:
            program = instance.program(checkpoint.request.task)
            if record.status == "in_progress" and not program.resumable:
                raise _CannotResume(
                    f"it had started and the {checkpoint.request.task.value!r} program of {record.model!r} "
                    f"({type(program).__qualname__}) cannot resume"
                )
            handle = self.engine.submit(
                checkpoint.request, resume_from=checkpoint if checkpoint.started else None,
                on_step=self._checkpointer(record.id, program.resumable),
            )
        except FvError as exc:
            raise _CannotResume(f"{exc.error_type}: {exc.message}") from None
        if checkpoint.started:
            log.info("job %s resumes at %s", record.id, checkpoint.position())
        # Queued again in this process's engine; its stream starts over (progress continues from the checkpoint).
        self._track(record, handle, instance, checkpoint.request.task)

    def _track(self, record: JobRecord, handle: RequestHandle, instance: ModelInstance, task: TaskType) -> None:
        """Follow a submitted job in this process: its live state, its ``video.queued`` event and its follower task."""
        program_spec = instance.card.programs.get(task)
        live = _LiveJob(record=record, handle=handle, loop_total=len(program_spec.loops) if program_spec else 0)
        self._live[record.id] = live
        live.publish("video.queued", self.view(record).model_dump(mode="json"))
        live.task = asyncio.create_task(self._follow(live), name=f"fv-serve-{record.id}")

    def _checkpointer(self, job_id: str, resumable: bool) -> Callable[[ProgramRun], None] | None:
        """Write the job's checkpoint every ``checkpoint_every_steps`` steps (None: never)."""
        every = self.checkpoint_every_steps
        if every <= 0 or not resumable:
            return None

        def on_step(run: ProgramRun) -> None:
            self._runs[job_id] = run
            if run.steps % every:
                return
            checkpoint = run.checkpoint()
            cap = self.checkpoint_max_bytes
            if cap is not None and held_tensor_bytes(checkpoint) > cap:
                self.checkpoints_skipped += 1
                return
            # Serializing is part of the step: a state that cannot be written fails the job, naming loop and field.
            data = checkpoint.to_bytes()
            try:
                self.checkpoints.write(job_id, data)
            except OSError as exc:  # the previous checkpoint is intact; the job keeps running
                log.warning("could not write the checkpoint of job %s: %s", job_id, exc)

        return on_step

    async def drain(self) -> None:
        """The start of a graceful stop: end every attached event stream of an unfinished job with a
        ``server.shutdown`` notice at once, then :meth:`stop` (which sync image calls then see)."""
        self._stopping = True
        for live in self._live.values():
            if not live.done.is_set():
                live.end_streams_for_shutdown()
        await self.stop()

    async def stop(self) -> None:
        """Stop the engine and suspend what runs: unfinished jobs keep their rows and get a last
        checkpoint, so the next server on this data dir resumes them. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping = True
        await self.engine.stop()
        tasks = [job.task for job in self._live.values() if job.task is not None and not job.task.done()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for job_id, live in self._live.items():
            run = self._runs.pop(job_id, None)
            if live.record.terminal or run is None:
                continue
            try:
                self.checkpoints.write(job_id, run.checkpoint().to_bytes())
            except (OSError, FvError) as exc:  # the previous checkpoint stays
                log.warning("could not write the last checkpoint of job %s: %s", job_id, exc)

    # -- request building -------------------------------------------------------------
    def reject(self, error: ApiError) -> ApiError:
        self.rejections[error.error_type] += 1
        return error

    def _instance(self, model: str | None) -> ModelInstance:
        instances = self.engine.instances
        if model is None:
            if len(instances) == 1:
                return next(iter(instances.values()))
            raise self.reject(ApiError(
                400, "invalid_request", f"model: required when several cards are served; allowed: {', '.join(sorted(instances))}",
                param="model",
            ))
        instance = instances.get(model)
        if instance is None:
            unknown = UnknownModel(model, instances)  # its message names the closest served ids
            raise self.reject(ApiError(404, "unknown_model", unknown.message, param="model"))
        return instance

    def _plugin_params(self, extensions: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        """Validate per-request plugin parameters: only plugins this deployment enabled, only through their schema."""
        params: dict[str, dict[str, Any]] = {}
        for name, values in extensions.items():
            where = f"extensions.{name}"
            if name not in self.enabled_extensions:
                allowed = ", ".join(sorted(self.enabled_extensions)) or "none (the deployment enables no extensions)"
                raise self.reject(ApiError(
                    400, "extension_not_enabled", f"{where}: this deployment does not enable {name!r}; allowed: {allowed}",
                    param=where,
                ))
            schema = self.extension_schemas.get(name)
            if schema is None:
                if values:
                    raise self.reject(ApiError(
                        400, "unknown_field", f"{where}: {name!r} takes no per-request parameters", param=where,
                    ))
                params[name] = {}
                continue
            try:
                params[name] = schema.model_validate(dict(values)).model_dump(mode="json")
            except ValidationError as exc:
                raise self.reject(from_validation_errors(exc.errors(), prefix=where)) from None
        return params

    def _build_request(
        self,
        body: _Generation,
        *,
        request_id: str,
        task: TaskType,
        image: torch.Tensor | None = None,
        frames: int | None = None,
        fps: float | None = None,
        seed: int,
        stream_previews: bool = False,
    ) -> tuple[ModelInstance, Request]:
        instance = self._instance(body.model)
        width = height = None
        if body.size is not None:
            try:
                width, height = parse_size(body.size)
            except ValueError as exc:
                raise self.reject(ApiError(400, "invalid_request", f"size: {exc}", param="size")) from None
        inputs: list[Any] = [TextPart(text=body.prompt)]
        if body.negative_prompt:
            inputs.append(TextPart(text=body.negative_prompt, role="negative_prompt"))
        if image is not None:
            inputs.append(ImagePart(image=image))
        try:
            request = Request(
                request_id=request_id, model=instance.model_id, task=task, inputs=tuple(inputs),
                diffusion=DiffusionParams(
                    width=width, height=height, frames=frames, fps=fps, steps=body.steps, guidance=body.guidance, seed=seed,
                ),
                plugin_params=self._plugin_params(body.extensions), exact=body.exact, priority=body.priority,
                adapters=tuple(AdapterRef(name=a.name, scale=a.scale) for a in body.adapters),
                output=OutputSpec(stream_previews=stream_previews), allow_outside_envelope=body.allow_outside_envelope,
            )
        except ValidationError as exc:
            raise self.reject(from_validation_errors(exc.errors())) from None
        try:
            resolved = self.engine.validate(request)
        except FvError as exc:
            raise self.reject(from_fv_error(exc)) from None
        for warning in check_envelope(instance.card, resolved):  # unknown words; an overridden envelope
            log.warning("request %s on %r: %s", request_id, instance.model_id, warning)
        return instance, resolved

    def _submit(self, request: Request, *, on_step: Callable[[ProgramRun], None] | None = None) -> RequestHandle:
        if self._stopping:
            raise self.reject(ApiError(503, "shutting_down", "the server is shutting down; retry against the restarted server"))
        try:
            return self.engine.submit(request, on_step=on_step)
        except FvError as exc:
            error = from_fv_error(exc)
            if error.status != 429:  # queue_full is counted by the engine itself
                self.rejections[error.error_type] += 1
            raise error from None

    # -- videos -----------------------------------------------------------------------
    def create_video(self, body: VideoCreate, image: torch.Tensor | None) -> VideoJob:
        if body.seconds is not None and body.frames is not None:
            raise self.reject(ApiError(400, "invalid_request", "seconds: give seconds or frames, not both", param="seconds"))
        instance = self._instance(body.model)
        frames, fps = body.frames, body.fps
        if body.seconds is not None:
            try:
                frames, fps = frames_for_seconds(
                    instance.card, body.seconds, body.fps, allow_outside_envelope=body.allow_outside_envelope
                )
            except FvError as exc:
                raise self.reject(from_fv_error(exc)) from None
        seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
        job_id = new_job_id()
        task = TaskType.IMAGE_TO_VIDEO if image is not None else TaskType.TEXT_TO_VIDEO
        instance, request = self._build_request(
            body, request_id=job_id, task=task, image=image, frames=frames, fps=fps, seed=seed,
            stream_previews=True,  # the job's SSE stream carries video.preview frames
        )
        program = instance.program(task)
        try:
            # Saved before the job exists anywhere else: a restarted server finds every job's request.
            self.checkpoints.write(job_id, ProgramCheckpoint.for_request(program, instance, request).to_bytes())
        except OSError as exc:
            raise ApiError(500, "storage", f"the server could not save the job: {exc}") from None
        try:
            handle = self._submit(request, on_step=self._checkpointer(job_id, program.resumable))
        except ApiError:
            self.checkpoints.delete(job_id)
            raise
        d = request.diffusion
        record = JobRecord(
            id=job_id, model=instance.model_id, status="queued", created_at=time.time(),
            params={
                "prompt": body.prompt, "task": task.value, "width": d.width, "height": d.height, "frames": d.frames,
                "fps": d.fps, "steps": d.steps, "guidance": d.guidance, "seed": d.seed,
            },
        )
        # No await between submit and insert: the engine cannot advance the job before its row exists.
        try:
            self.store.insert(record)
        except Exception:
            handle.cancel("the job store refused the job")
            self.checkpoints.delete(job_id)
            raise
        self._track(record, handle, instance, task)
        return self.view(record)

    async def _follow(self, live: _LiveJob) -> None:
        record = live.record
        videos: list[VideoArtifact] = []
        try:
            async for event in live.handle.events():
                kind = event.type
                if kind == "request.started":
                    # A resumed job keeps the start of its first attempt.
                    record.status, record.started_at = "in_progress", record.started_at or event.ts
                    self.store.mark_started(record.id, event.ts)
                    live.publish("video.started", {"id": record.id, "status": record.status})
                elif kind == "progress":
                    value = live.update_progress(event.loop_id, event.step, event.total)
                    live.publish("video.progress", {
                        "id": record.id, "progress": value, "loop_id": event.loop_id, "step": event.step, "total": event.total,
                    })
                elif kind == "media.chunk" and event.preview and event.frames is not None:
                    png = await asyncio.to_thread(preview_png, event.frames)  # off the event loop
                    if png is not None:
                        live.publish("video.preview", {
                            "id": record.id, "stream": event.stream, "index": event.index, "pts": list(event.pts),
                            "image": {"media_type": "image/png", "b64": base64.b64encode(png).decode()},
                        })
                elif kind == "artifact.ready" and isinstance(event.artifact, VideoArtifact):
                    videos.append(event.artifact)
                elif kind == "request.completed":
                    await self._complete(live, videos)
                elif kind == "request.failed":
                    self._finish(live, "failed", error=event.error.model_dump())
                elif kind == "request.cancelled":
                    if self._stopping and not live.cancelled_by_client:
                        # Suspended by the shutdown, not cancelled: the next server resumes it.
                        live.end_streams_for_shutdown()
                        return
                    self._finish(live, "cancelled", error={"type": "cancelled", "message": event.reason, "param": None})
        except Exception as exc:  # noqa: BLE001 - a broken follower must still leave the job terminal
            log.exception("following job %s failed", record.id)
            if not record.terminal:
                self._finish(live, "failed", error={"type": "internal_error", "message": f"{type(exc).__name__}: {exc}", "param": None})
        finally:
            live.close()
            self._retire_finished()

    async def _complete(self, live: _LiveJob, videos: list[VideoArtifact]) -> None:
        record = live.record
        final = next((v for v in videos if not v.provenance.partial), None)
        if final is None:
            self._finish(live, "failed", error={"type": "no_artifact", "message": "the program produced no video", "param": None})
            return
        try:
            variants = await asyncio.to_thread(write_job_files, final, self.output_dir / record.id)
        except Exception as exc:  # noqa: BLE001 - encoding failures end this job only
            log.exception("writing the files of job %s failed", record.id)
            self._finish(live, "failed", error={"type": "media", "message": f"{type(exc).__name__}: {exc}", "param": None})
            return
        record.variants = variants
        frames = final.frames
        live.publish("video.artifact", {
            "id": record.id,
            "content": {v: f"/v1/videos/{record.id}/content" + ("" if v == "video" else f"?variant={v}") for v in variants},
            "frames": int(frames.shape[0]), "width": int(frames.shape[-1]), "height": int(frames.shape[-2]), "fps": final.fps,
        })
        self._finish(live, "completed")

    def _finish(self, live: _LiveJob, status: str, *, error: dict[str, Any] | None = None) -> None:
        record = live.record
        record.status, record.completed_at, record.error = status, time.time(), error
        if status == "completed":
            record.progress = 100
        live.publish(f"video.{status}", self.view(record).model_dump(mode="json"))
        encoded = [(e.seq, e.event, json.dumps(e.data, separators=(",", ":"))) for e in live.events]
        live.history_bytes = sum(len(text) for _, _, text in encoded)
        # The row and the whole stream in one transaction: the job now lives on disk.
        self.store.finish(
            record.id, status, at=record.completed_at, progress=record.progress, error=error, variants=record.variants,
            events=encoded,
        )
        self.checkpoints.delete(record.id)  # a finished job never resumes
        self._runs.pop(record.id, None)
        # The engine's record holds the request's tensors (input image, frames, previews): persisted, so drop them.
        self.engine.forget(record.id)
        live.handle = None
        # Subscribers attached now have their own snapshot and queue; later ones read ``stored``.
        live.stored, live.events = encoded, []

    def _retire_finished(self) -> None:
        """Keep the newest finished histories in memory up to ``finished_history_bytes``; the rest replay from disk.

        A job with subscribers still attached stays until they leave.
        """
        budget = self.finished_history_bytes
        for job_id, job in reversed(list(self._live.items())):
            if not job.done.is_set() or job.subscribers:
                continue
            if job.history_bytes <= budget:
                budget -= job.history_bytes
            else:
                del self._live[job_id]
                budget = 0

    def retained(self) -> tuple[int, int]:
        """Finished jobs whose history is held in memory, and its encoded bytes."""
        held = [job for job in self._live.values() if job.done.is_set()]
        return len(held), sum(job.history_bytes for job in held)

    # -- reads --------------------------------------------------------------------------
    @staticmethod
    def check_id(job_id: str) -> str:
        if not JOB_ID_PATTERN.match(job_id):
            raise ApiError(400, "invalid_request", "video_id: not a video id (video_ followed by 32 hex digits)", param="video_id")
        return job_id

    def record(self, job_id: str) -> JobRecord:
        self.check_id(job_id)
        live = self._live.get(job_id)
        if live is not None:
            return live.record
        found = self.store.get(job_id)
        if found is None:
            raise ApiError(404, "not_found", f"video_id: no video job {job_id!r}", param="video_id")
        return found

    @staticmethod
    def view(record: JobRecord) -> VideoJob:
        p = record.params
        return VideoJob(
            id=record.id, model=record.model, status=record.status, progress=record.progress,  # type: ignore[arg-type]
            created_at=int(record.created_at),
            started_at=int(record.started_at) if record.started_at else None,
            completed_at=int(record.completed_at) if record.completed_at else None,
            error=JobError(**record.error) if record.error else None,
            prompt=p["prompt"], task=p["task"], size=f"{p['width']}x{p['height']}",
            seconds=f"{p['frames'] / p['fps']:.2f}", frames=p["frames"], fps=p["fps"], steps=p.get("steps"),
            guidance=p.get("guidance"), seed=p["seed"],
        )

    def content_path(self, job_id: str, variant: str) -> tuple[Path, str]:
        if variant not in VARIANTS:
            raise ApiError(400, "invalid_request", f"variant: unknown {variant!r}; allowed: {', '.join(VARIANTS)}", param="variant")
        record = self.record(job_id)
        if record.status != "completed" or variant not in record.variants:
            raise ApiError(
                409 if not record.terminal else 404, "content_unavailable",
                f"video {job_id} has no {variant} content (status {record.status})", param="video_id",
            )
        name, media_type = VARIANTS[variant]
        path = self.output_dir / record.id / name
        if not path.is_file():
            raise ApiError(404, "content_unavailable", f"the {variant} of video {job_id} is no longer on disk", param="video_id")
        return path, media_type

    # -- cancel / delete ------------------------------------------------------------------
    def cancel(self, job_id: str) -> VideoJob:
        record = self.record(job_id)
        if record.status == "cancelled":
            return self.view(record)
        if record.terminal:
            raise ApiError(409, "invalid_state", f"video {job_id} already {record.status}", param="video_id")
        live = self._live.get(job_id)
        if live is not None:
            live.cancelled_by_client = True
        if not self.engine.cancel(job_id, "cancelled by client"):
            raise ApiError(409, "invalid_state", f"video {job_id} is finishing and can no longer be cancelled", param="video_id")
        return self.view(record)

    async def delete(self, job_id: str) -> None:
        record = self.record(job_id)
        live = self._live.get(job_id)
        if live is not None and not live.done.is_set():
            live.cancelled_by_client = True
            self.engine.cancel(job_id, "deleted by client")
            await live.done.wait()
        self.store.delete(record.id)  # its row and its stored events
        self.checkpoints.delete(record.id)
        self._live.pop(record.id, None)
        self._runs.pop(record.id, None)
        self.engine.forget(record.id)
        # The folder name is the validated, server-generated id.
        shutil.rmtree(self.output_dir / record.id, ignore_errors=True)

    # -- events ---------------------------------------------------------------------------
    async def stream(self, job_id: str, *, after: int = -1, heartbeat_s: float = 15.0) -> AsyncIterator[StreamEvent | None]:
        """The job's events in order (those with seq > ``after``); ``None`` marks a keep-alive."""
        record = self.record(job_id)
        live = self._live.get(job_id)
        if live is None:
            stored = self.store.events(job_id, after=after)
            if stored or record.terminal and self.store.events(job_id, after=-1):
                for seq, name, data in stored:
                    yield StreamEvent(seq, name, data)
                return
            for item in self._replay_stored(record):  # finished by a server that stored no stream
                if item.seq > after:
                    yield item
            return
        if live.stored is not None:  # finished: its history, as stored
            for seq, name, text in live.stored:
                if seq > after:
                    yield StreamEvent(seq, name, json.loads(text))
            return
        queue: asyncio.Queue[StreamEvent | None] = asyncio.Queue()
        history = list(live.events)
        closed = live.done.is_set()
        live.subscribers.append(queue)
        try:
            for item in history:
                if item.seq > after:
                    yield item
            if self._stopping and not record.terminal:  # suspended (or being suspended) by a stop
                yield live.shutdown_notice()
                return
            if closed:
                return
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=heartbeat_s)
                except asyncio.TimeoutError:
                    yield None
                    continue
                if item is None:
                    return
                if item.seq < 0 or item.seq >= len(history) and item.seq > after:
                    yield item
        finally:
            live.subscribers.remove(queue)
            if live.done.is_set():
                self._retire_finished()

    def _replay_stored(self, record: JobRecord) -> list[StreamEvent]:
        """A job with no stored stream (finished by an older server, or failed at a restart): its final
        state as the tail of a stream."""
        events: list[StreamEvent] = []
        if record.status == "completed" and record.variants:
            events.append(StreamEvent(0, "video.artifact", {
                "id": record.id,
                "content": {v: f"/v1/videos/{record.id}/content" + ("" if v == "video" else f"?variant={v}") for v in record.variants},
                "frames": record.params["frames"], "width": record.params["width"], "height": record.params["height"],
                "fps": record.params["fps"],
            }))
        name = f"video.{record.status}" if record.terminal else "video.queued"
        events.append(StreamEvent(len(events), name, self.view(record).model_dump(mode="json")))
        return events

    # -- images -----------------------------------------------------------------------------
    async def generate_images(
        self,
        body: ImageGenerate,
        *,
        disconnected: Callable[[], Awaitable[bool]] | None = None,
        poll_s: float = _DISCONNECT_POLL_S,
    ) -> ImagesResponse:
        """Generate ``body.n`` images and wait for them. ``disconnected()`` is polled every ``poll_s``
        while they run: once it says the client is gone, they are cancelled at their next step
        boundary (releasing their reservations) and :class:`ClientDisconnected` is raised."""
        seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
        requests = [
            self._build_request(body, request_id=f"image_{uuid.uuid4().hex}", task=TaskType.TEXT_TO_IMAGE, seed=seed + i)[1]
            for i in range(body.n)
        ]
        handles: list[RequestHandle] = []
        try:
            for request in requests:
                handles.append(self._submit(request))
        except ApiError:
            for handle in handles:
                handle.cancel("a sibling image of the same call was refused")
            raise
        try:
            gathered = asyncio.gather(*(h.result() for h in handles))
            while True:
                done, _ = await asyncio.wait({gathered}, timeout=poll_s if disconnected is not None else None)
                if done:
                    break
                if disconnected is not None and await disconnected():
                    for handle in handles:
                        handle.cancel("the client disconnected")
                    await gathered  # each stops at its next step boundary; the engine releases its reservation
                    raise ClientDisconnected(f"{len(handles)} image request(s) cancelled: the client disconnected")
            results = gathered.result()
            data = []
            for result in results:
                if result.status != "completed":
                    error = result.error
                    if result.status == "cancelled":
                        raise ApiError(503, "cancelled", "the server stopped before the image was generated")
                    raise ApiError(500, error.type if error else "internal_error", error.message if error else "generation failed")
                video = result.artifact("video")
                if not isinstance(video, VideoArtifact):
                    raise ApiError(500, "no_artifact", "the program produced no image")
                png = await asyncio.to_thread(_encode_first_frame, video)
                data.append(ImageData(b64_json=base64.b64encode(png).decode()))
            return ImagesResponse(created=int(time.time()), data=data)
        finally:
            for handle in handles:
                if handle.status in ("queued", "in_progress"):  # the call itself was cancelled: stop its work too
                    handle.cancel("the call ended")
                # The response carries the images: the engine keeps no tensors of them.
                self.engine.forget(handle.request_id)


def _encode_first_frame(video: VideoArtifact) -> bytes:
    from fv_kernel.io.media import encode_png

    return encode_png(video.frames[0])
