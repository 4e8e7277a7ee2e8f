"""The Python API a user reaches for first: one object, one call.

    import fv_kernel as fv
    gen = fv.load()                            # the plugins' default card; or what `fv generate --model` takes
    video = gen.generate("a red fox", seed=7)
    video.save("fox.mp4")

A thin façade over the :class:`~fv_kernel.runtime.engine.Engine`: :func:`load` resolves the
model exactly as ``fv generate`` does (:func:`~fv_kernel.deploy.model_resolution.resolve_model`,
the deploy config's scheduler, limits and extensions through
:func:`~fv_kernel.deploy.engine.engine_for`), keeps one resident instance, and every call
validates its keyword options through the kernel's request resolution (a typed
:class:`~fv_kernel.errors.InvalidRequest` naming the option) before any compute. A list of
prompts is submitted at once, so the one scheduler interleaves and batches their steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import re
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Literal, Mapping, Sequence, TypedDict, Union, overload

import torch
from pydantic import ValidationError

from fv_kernel.model.instance import ModelInstance, build_instance
from fv_kernel.model.preflight import preflight
from fv_kernel.card.recipe import EnvelopeWarning, check_envelope
from fv_kernel.card.spec import ModelCard
from fv_kernel.config import DeployConfig, load_deploy_config
from fv_kernel.errors import InvalidRequest, StepFailed
from fv_kernel.io.media import VIDEO_OUTPUT_SUFFIXES, check_output_path, read_image, write_artifact
from fv_kernel.plugins.host import PluginHost
from fv_kernel.request.artifacts import Artifact, AudioArtifact, Provenance, VideoArtifact
from fv_kernel.request.events import Event
from fv_kernel.request.session import SessionClosed, SessionRequest
from fv_kernel.request.request import AdapterRef, ARParams, DiffusionParams, ImagePart, OutputSpec, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.blocking import run_blocking
from fv_kernel.cache.adapters import AdapterRegistry, AdapterSettings
from fv_kernel.deploy.engine import adapter_registry, engine_for
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.records import GenerationResult
from fv_kernel.runtime.sessions import SessionHandle
from fv_kernel.deploy.model_resolution import resolve_model

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Chunk", "Finished", "GenerateOptions", "Session", "StreamEvent", "Video", "VideoGenerator", "load"]

#: What :meth:`Video.save` writes, by suffix: the same list as ``fv generate --output``.
SAVE_SUFFIXES = VIDEO_OUTPUT_SUFFIXES
_log = logging.getLogger("fv.envelope")


class GenerateOptions(TypedDict, total=False):
    """The keyword options of :meth:`VideoGenerator.generate` (and ``agenerate``/``stream``).

    They mirror ``fv generate``'s flags; ``None`` (or leaving one out) means the card's
    default. Any other keyword is an :class:`InvalidRequest` naming it.
    """

    negative_prompt: str | None
    #: A file path, a float (3, H, W) tensor in [0, 1], or a PIL image; selects image-to-video.
    image: Any
    #: Declare the task; default: ``image_to_video`` with ``image``, else ``text_to_video``.
    task: TaskType | str | None
    height: int | None
    width: int | None
    frames: int | None
    fps: float | None
    steps: int | None
    guidance: float | None
    guidance_2: float | None
    #: Two-expert cards: the step from which the second expert runs (0..steps).
    switch_step: int | None
    shift: float | None
    sampler: str | None
    seed: int
    #: Must be the precision the generator was loaded in (``fv.load(precision=...)``).
    precision: str | None
    #: Rewrite the prompt with the card's reasoner first (cards that have one).
    upsample_prompt: bool
    #: Token budget of the prompt rewrite (the card's default if omitted).
    max_tokens: int | None
    #: Bit-identical to this prompt generated alone: its rows never share a fused call with the
    #: other prompts' (by default a list is fused, within the card's ``parity.batched_vs_alone``).
    exact: bool
    #: Run outside the card's trained envelope (frames, size, fps, prompt words) instead of being
    #: refused; an :class:`~fv_kernel.card.recipe.EnvelopeWarning` says so.
    allow_outside_envelope: bool
    #: LoRA adapters, applied in order after the card's default stack: each a ``.safetensors``
    #: path (strength 1.0), a ``(path, strength)`` pair, or ``{"name": ..., "scale": ...}`` naming
    #: an adapter already registered (``generator.adapters``). Files are registered on first use.
    loras: Sequence[Any]


_OPTION_NAMES = frozenset(GenerateOptions.__annotations__)
#: Request fields whose option has another name.
_OPTION_FOR_FIELD = {"prompt_upsampling": "upsample_prompt"}


def _adapter_name(registry: AdapterRegistry, file: Path) -> str:
    """The name a file is registered under: its stem (made a valid name), kept when the same
    file (same content version) is registered again, else numbered."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", file.stem).lstrip("._-")[:120] or "lora"
    name, n = stem, 2
    while name in registry.names() and registry.get(name).path != str(file.resolve()):
        name, n = f"{stem}-{n}", n + 1
    return name


@dataclass(frozen=True, repr=False)
class Video:
    """A generated video: ``frames`` (F, 3, H, W) float32 in [0, 1], ``fps`` and ``provenance``.

    ``artifacts`` is everything the request returned (the video among them; an audio track
    or the rewritten prompt where the card makes them); ``audio`` is the sound track, if any.
    """

    artifact: VideoArtifact
    artifacts: tuple[Artifact, ...]

    @property
    def frames(self) -> torch.Tensor:
        return self.artifact.frames

    @property
    def fps(self) -> float:
        return self.artifact.fps

    @property
    def provenance(self) -> Provenance:
        return self.artifact.provenance

    @property
    def request_id(self) -> str:
        return self.artifact.provenance.request_id

    @property
    def audio(self) -> AudioArtifact | None:
        return next((a for a in self.artifacts if isinstance(a, AudioArtifact)), None)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the video by ``path``'s suffix: ``.mp4``, ``.gif``, ``.png`` (first frame) or ``.pt``.

        An ``.mp4`` carries the sound track (AAC) when the video has one; the other formats
        hold frames only (the sound stays in :attr:`audio`). The suffix and the destination
        are checked before anything is encoded (a typed :class:`~fv_kernel.io.media.MediaError`
        naming ``path``); missing parent directories are created. Returns the path written.
        """
        target = check_output_path(path, SAVE_SUFFIXES, param="path")
        sound = self.audio if target.suffix.lower() == ".mp4" else None
        return write_artifact(self.artifact, target, audio=sound)

    def __repr__(self) -> str:
        f, _, h, w = self.frames.shape
        return f"Video({f} frames, {w}x{h}, {self.fps:g} fps, request {self.request_id!r})"


@dataclass(frozen=True)
class Finished:
    """The last event of :meth:`VideoGenerator.stream`: the request completed with ``video``."""

    request_id: str
    video: Video
    type: Literal["finished"] = "finished"


#: What :meth:`VideoGenerator.stream` yields: the engine's typed events in order (queued,
#: started, progress, preview ``media.chunk``s, ``artifact.ready``, ``request.completed``),
#: then one :class:`Finished`.
StreamEvent = Union[Event, Finished]


def load(
    model: str | None = None,
    *,
    config: str | os.PathLike[str] | DeployConfig | None = None,
    device: str | None = None,
    precision: str | None = None,
    override_recipe: bool = False,
    host: PluginHost | None = None,
    precision_path: str | None = None,
    component_sources: Mapping[str, str | os.PathLike[str]] | None = None,
) -> "VideoGenerator":
    """A generator for ``model``, its weights loaded: what ``fv generate --model`` takes.

    ``model``: a card id (``fv cards list``), a card file (.json/.yaml), a local checkpoint
    directory or a hub id; ``None``: the default card of the enabled plugins (their
    ``fv_default_model`` hook, which ``fv serve`` uses too). ``config``: a deploy config (path or
    :class:`~fv_kernel.config.DeployConfig`), as ``--config``: its plugins, scheduler, limits
    and extensions apply, and its ``cards`` entry for the model gives the instance options;
    ``device``, ``precision``, ``precision_path`` and ``override_recipe`` win over it.
    ``precision_path``: what runs in fp8 (docs/precision.md): ``native``, a path the card lists
    (``fp8_weights``, ``fp8_dynamic``, ``fp8_attention``, ``fp8_all``), or ``auto``; None: the
    card's own. The generator's instance reports the resolved path. ``component_sources``: component id
    -> one ``.safetensors`` file it loads from instead of the card's checkpoint (a component the card marks
    ``single_file``, as ComfyUI's ``diffusion_models`` files; docs/cards.md), over the config entry's. ``host``: a plugin host to
    use instead of the one the config selects. Every problem is a typed error naming its
    field, raised before weights load where it can be.
    """
    deploy = config if isinstance(config, DeployConfig) else (DeployConfig() if config is None else load_deploy_config(config))
    if host is None:
        host = PluginHost(deploy.plugins)
    host.start()
    choice = resolve_model(model, deploy, host, device=device, precision=precision, override_recipe=override_recipe,
                           precision_path=precision_path, component_sources=component_sources)
    if deploy.adapters is None:  # generate(loras=...) works without a config: adapters on, default settings
        deploy = deploy.model_copy(update={"adapters": AdapterSettings()})
    engine = engine_for(deploy, host, adapters=adapter_registry(deploy, [choice.card]))
    # Load the weights the plain call needs now, so a bad checkpoint fails here, not mid-request.
    tasks = choice.card.capabilities.tasks
    preload = next((t for t in (TaskType.TEXT_TO_VIDEO, TaskType.IMAGE_TO_VIDEO) if t in tasks), None)
    options = choice.options.model_copy(update={"preload_tasks": (preload,) if preload else ()})
    # The checkpoint source is there and the weights fit, before anything is built (as fv generate).
    preflight(choice.card, options, options.preload_tasks)
    instance = build_instance(choice.card, options)
    engine.add_instance(instance)
    return VideoGenerator(engine, instance, host)


class VideoGenerator:
    """One resident card behind one Engine; made by :func:`load`.

    ``generate`` blocks, ``agenerate`` is its coroutine, ``stream`` yields typed events.
    Concurrent calls (a list of prompts, or several ``agenerate`` on one event loop) share
    the engine's scheduler, which batches their steps. :attr:`engine` is the lower-level
    API (observers, metrics, raw :class:`~fv_kernel.request.request.Request` s).
    """

    def __init__(self, engine: Engine, instance: ModelInstance, host: PluginHost) -> None:
        self.engine = engine
        self.instance = instance
        self.host = host
        #: Calls in flight on the engine's loop (``_loop``); the engine runs while there are any.
        self._active = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Set while the last call out stops the engine; a call arriving then waits for it.
        self._stopping: asyncio.Future[None] | None = None
        self._lock = threading.Lock()  # calls may come from several threads; one loop wins

    @property
    def card(self) -> ModelCard:
        return self.instance.card

    @property
    def model_id(self) -> str:
        return self.instance.model_id

    def __repr__(self) -> str:
        return f"VideoGenerator({self.model_id!r} on {self.instance.device}, {self.instance.precision})"

    @property
    def adapters(self) -> AdapterRegistry | None:
        """The registry ``loras=`` names resolve in (None when the config turns adapters off)."""
        return self.engine.adapters

    def _adapter_refs(self, loras: Any) -> tuple[AdapterRef, ...]:
        if isinstance(loras, (str, os.PathLike, dict)) or not isinstance(loras, Sequence):
            loras = [loras]
        registry = self.engine.adapters
        if loras and registry is None:
            raise InvalidRequest("loras", "the deploy config turns adapters off (adapters.enabled: false)")
        refs = []
        for index, item in enumerate(loras):
            param = f"loras[{index}]"
            if isinstance(item, dict):
                refs.append(_typed(param, lambda item=item: AdapterRef(**item)))
                continue
            path, scale = (item if isinstance(item, tuple) and len(item) == 2 else (item, 1.0))
            if not isinstance(path, (str, os.PathLike)) or isinstance(scale, bool) or not isinstance(scale, (int, float)):
                raise InvalidRequest(
                    param, f"expected a path, (path, strength) or {{'name', 'scale'}}, got {item!r}",
                    allowed="'style.safetensors', ('style.safetensors', 0.8), {'name': 'style', 'scale': 0.8}",
                )
            file = Path(path)
            if not file.is_file():
                raise InvalidRequest(param, f"{str(file)!r}: no such file")
            assert registry is not None
            info = registry.add_file(file, name=_adapter_name(registry, file))
            refs.append(_typed(param, lambda info=info, scale=scale: AdapterRef(name=info.name, scale=float(scale))))
        return tuple(refs)

    # -- requests -------------------------------------------------------------------
    def request(self, prompt: str, *, previews: bool = False, **options: Unpack[GenerateOptions]) -> Request:
        """The validated :class:`Request` a call with these arguments runs (card defaults filled in).

        Raises :class:`InvalidRequest` naming the option for anything the card or the
        deployment does not accept; nothing is computed.
        """
        return self._validate(self._build(prompt, options, previews))

    def _build(self, prompt: Any, options: dict[str, Any], previews: bool) -> Request:
        unknown = sorted(set(options) - _OPTION_NAMES)
        if unknown:
            raise InvalidRequest(unknown[0], "is not an option of generate", allowed=sorted(_OPTION_NAMES))
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt", f"expected text (or a list of texts), got {type(prompt).__name__}")
        image = options.get("image")
        task = _task(options.get("task")) or (TaskType.IMAGE_TO_VIDEO if image is not None else TaskType.TEXT_TO_VIDEO)
        tasks = self.card.capabilities.tasks
        if task not in tasks:  # before the request's own input rules, which would ask for the wrong thing
            raise InvalidRequest("task", f"card {self.model_id!r} cannot run {task.value!r}", allowed=sorted(t.value for t in tasks))
        seed = options.get("seed", 0)
        inputs: list[Any] = [TextPart(text=prompt)]
        negative = options.get("negative_prompt")
        if negative is not None and negative != "":  # an empty one is none, as `fv generate --negative-prompt ""`
            inputs.append(_typed("negative_prompt", lambda: TextPart(text=negative, role="negative_prompt")))
        if image is not None:
            inputs.append(_typed("image", lambda: ImagePart(image=_image_tensor(image))))
        diffusion_fields = ("height", "width", "frames", "fps", "steps", "guidance", "guidance_2", "switch_step", "shift", "sampler")
        diffusion = _typed("diffusion", lambda: DiffusionParams(
            seed=seed, **{name: options[name] for name in diffusion_fields if options.get(name) is not None}
        ))
        upsample = options.get("upsample_prompt", False)
        max_tokens = options.get("max_tokens")
        ar = None
        if upsample and max_tokens is not None:
            ar = _typed("ar", lambda: ARParams(max_tokens=max_tokens, seed=seed))
        request = _typed("request", lambda: Request(
            model=self.model_id, task=task, inputs=tuple(inputs), diffusion=diffusion, ar=ar,
            precision=options.get("precision"), prompt_upsampling=upsample, exact=options.get("exact", False),
            output=OutputSpec(stream_previews=previews), allow_outside_envelope=options.get("allow_outside_envelope", False),
            adapters=self._adapter_refs(options.get("loras") or ()),
        ))
        returns = self.card.artifact_kinds(request.task)
        if returns is not None and "video" not in returns:
            makers = sorted(t.value for t in self.card.capabilities.tasks if "video" in (self.card.artifact_kinds(t) or ()))
            raise InvalidRequest("task", f"task {request.task.value!r} of {self.model_id!r} makes no video", allowed=makers)
        return request

    def _requests(self, prompt: str | Sequence[str], options: dict[str, Any], previews: bool = False) -> list[Request]:
        prompts = [prompt] if isinstance(prompt, str) else list(prompt) if isinstance(prompt, (list, tuple)) else [prompt]
        if not prompts:
            raise InvalidRequest("prompt", "the list of prompts is empty", allowed="one text, or a non-empty list of texts")
        strays = [(i, p) for i, p in enumerate(prompts) if not isinstance(p, str)]
        if strays and isinstance(prompt, (list, tuple)):
            index, stray = strays[0]
            raise InvalidRequest("prompt", f"item {index} of the list is a {type(stray).__name__}, expected text")
        # Every request is validated before any is submitted: one bad prompt starts nothing.
        return [self._validate(self._build(p, options, previews)) for p in prompts]

    def _validate(self, request: Request) -> Request:
        """The kernel's request resolution; its errors name the option, not the Request field. Unknown
        prompt words and an overridden envelope are reported as :class:`EnvelopeWarning` s."""
        try:
            resolved = self.engine.validate(request)
        except InvalidRequest as exc:
            option = _OPTION_FOR_FIELD.get(exc.param or "")
            if option is None:
                raise
            raise InvalidRequest(option, exc.message.removeprefix(f"{exc.param}: ")) from None
        for message in check_envelope(self.card, resolved):
            _log.warning("%s: %s", self.model_id, message)
            warnings.warn(f"{self.model_id}: {message}", EnvelopeWarning, stacklevel=4)
        return resolved

    # -- running --------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _running(self) -> AsyncIterator[Engine]:
        """The engine, running on the caller's loop while any call is in flight on it."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._loop is not None and self._loop is not loop:
                raise RuntimeError("this generator is busy on another event loop; use one loop (or one thread) per generator")
            self._loop = loop
            self._active += 1
        try:
            while self._stopping is not None:  # the last call out is still stopping the engine: start it afresh after
                await self._stopping
            await self.engine.start()  # a no-op while it runs
            yield self.engine
        finally:
            self._active -= 1
            if not self._active:
                self._stopping = loop.create_future()
                try:
                    await self.engine.stop()
                finally:
                    self._stopping.set_result(None)
                    self._stopping = None
                    with self._lock:
                        if not self._active:
                            self._loop = None

    async def _run(self, requests: list[Request]) -> list[GenerationResult]:
        async with self._running() as engine:
            handles = []
            try:
                for request in requests:
                    handles.append(engine.submit(request))
                return list(await asyncio.gather(*(h.result() for h in handles)))
            except BaseException:  # a refused submit, or the caller cancelled: stop what was started
                for handle in handles:
                    handle.cancel("the caller stopped waiting")
                raise

    @overload
    def generate(self, prompt: str, **options: Unpack[GenerateOptions]) -> Video: ...
    @overload
    def generate(self, prompt: Sequence[str], **options: Unpack[GenerateOptions]) -> list[Video]: ...

    def generate(self, prompt: str | Sequence[str], **options: Unpack[GenerateOptions]) -> Video | list[Video]:
        """Generate one video per prompt; a list runs concurrently and comes back in order.

        Every prompt of a list runs with the same options and seed, and its video is
        bit-identical to generating that prompt alone. Bad options raise
        :class:`InvalidRequest` naming the option before anything runs; a request that
        fails while running raises :class:`~fv_kernel.errors.StepFailed`.

        A single prompt runs inside the enabled plugins' ``fv_wrap_generate`` wrappers, as
        ``fv generate`` does. Called inside a running event loop (a notebook), the work
        runs on a private thread's loop; prefer :meth:`agenerate` there.
        """
        requests = self._requests(prompt, dict(options))
        if isinstance(prompt, str):
            (request,) = requests
            result = self.host.hooks.wrap_generate(request, lambda req: _blocking(self._run([req]))[0])
            return _video(result)
        return [_video(r) for r in _blocking(self._run(requests))]

    @overload
    async def agenerate(self, prompt: str, **options: Unpack[GenerateOptions]) -> Video: ...
    @overload
    async def agenerate(self, prompt: Sequence[str], **options: Unpack[GenerateOptions]) -> list[Video]: ...

    async def agenerate(self, prompt: str | Sequence[str], **options: Unpack[GenerateOptions]) -> Video | list[Video]:
        """:meth:`generate` as a coroutine, on the caller's event loop.

        Concurrent ``agenerate`` calls on one loop share the engine and batch like a list.
        Cancelling the awaiting task cancels its requests at the next step boundary.
        """
        requests = self._requests(prompt, dict(options))
        videos = [_video(r) for r in await self._run(requests)]
        return videos[0] if isinstance(prompt, str) else videos

    async def astream(self, prompt: str, *, previews: bool = True, **options: Unpack[GenerateOptions]) -> AsyncIterator[StreamEvent]:
        """:meth:`stream` as an async iterator on the caller's event loop.

        Close it early (``contextlib.aclosing``, or ``break`` then ``aclose()``) and the
        request is cancelled at its next step boundary.
        """
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt", f"stream takes one prompt, got {type(prompt).__name__}; use generate for a list")
        (request,) = self._requests(prompt, dict(options), previews)
        async with self._running() as engine:
            handle = engine.submit(request)
            try:
                async for event in handle.events():
                    yield event
                result = await handle.result()
            finally:
                handle.cancel("the stream was closed")  # a no-op once the request has ended
        yield Finished(request_id=request.request_id, video=_video(result))

    def stream(self, prompt: str, *, previews: bool = True, **options: Unpack[GenerateOptions]) -> Iterator[StreamEvent]:
        """Run one prompt, yielding its typed events as they happen; the last is :class:`Finished`.

        Progress events come per step of each loop; with ``previews`` the card's preview
        frames come as ``media.chunk`` events. Options are validated before the first event
        (a typed :class:`InvalidRequest`). A failed request raises after its
        ``request.failed`` event. Stop iterating (``break``) and the request is cancelled
        at its next step boundary.
        """
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt", f"stream takes one prompt, got {type(prompt).__name__}; use generate for a list")
        self._requests(prompt, dict(options), previews)  # typed errors here, in the caller's thread
        return self._stream_on_thread(prompt, previews, dict(options))

    def session(self, prompt: str, **options: Any) -> "Session":
        """A realtime session on this card (one with a ``chunk_rollout`` loop), as a context manager.

        ::

            with fv.load("wan-toy-causal").session("a red fox", max_chunks=8) as s:
                for chunk in s:            # Chunk: frames, index, pts, prompt_version, ...
                    if chunk.index == 2:
                        s.update("a blue bird")   # applies at the next chunk boundary
                    if chunk.index == 5:
                        s.stop()

        ``options`` are :class:`~fv_kernel.request.session.SessionRequest` fields: ``seed``,
        ``height``, ``width``, ``fps``, ``max_chunks`` (None: until ``stop()``),
        ``idle_timeout_s``, ``previews``. A bad one raises :class:`InvalidRequest` naming it,
        before anything runs. Reading a chunk counts as activity for the idle timeout.
        """
        fields = {"model": self.model_id, "prompt": prompt, **options}
        if "model" in options or "session_id" in options:
            name = "model" if "model" in options else "session_id"
            raise InvalidRequest(name, "is set by the generator, not an option of session",
                                 allowed=sorted(set(SessionRequest.model_fields) - {"model", "prompt", "session_id"}))
        return Session(self, SessionRequest.of(**fields))

    def _stream_on_thread(self, prompt: str, previews: bool, options: dict[str, Any]) -> Iterator[StreamEvent]:
        events: queue.Queue[tuple[str, Any]] = queue.Queue()
        stop = threading.Event()

        async def pump() -> None:
            stream = self.astream(prompt, previews=previews, **options)
            try:
                async for event in stream:
                    if stop.is_set():
                        break
                    events.put(("event", event))
            finally:
                await stream.aclose()

        def work() -> None:
            try:
                run_blocking(pump())
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer's thread
                events.put(("error", exc))
            else:
                events.put(("end", None))

        worker = threading.Thread(target=work, name="fv-stream", daemon=True)
        worker.start()
        try:
            while True:
                kind, item = events.get()
                if kind == "event":
                    yield item
                elif kind == "error":
                    raise item
                else:
                    return
        finally:
            stop.set()  # the pump cancels the request at its next event, then the engine stops
            worker.join()


@dataclass(frozen=True, repr=False)
class Chunk:
    """One chunk of a session's stream: ``frames`` (F, 3, H, W) float32 in [0, 1] and where they sit."""

    index: int
    frames: torch.Tensor
    #: The chunk's first frame in the stream, and its time range in seconds.
    frame_start: int
    pts: tuple[float, float]
    fps: float
    #: The prompt version the chunk was generated under (0: the opening prompt; ``update`` returns the others).
    prompt_version: int
    preview: bool = False

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    def __repr__(self) -> str:
        return (f"Chunk({self.index}, frames {self.frame_start}..{self.frame_start + self.num_frames - 1}, "
                f"prompt v{self.prompt_version})")


class Session:
    """A running realtime session (:meth:`VideoGenerator.session`): iterate it for :class:`Chunk` s.

    The engine runs on a private thread while the session is open; ``update``, ``stop``,
    ``cancel``, ``touch`` and ``suspend`` may be called from the iterating thread. Leaving the
    ``with`` block stops the session. A session that fails raises
    :class:`~fv_kernel.errors.StepFailed` from the iteration, after its last chunk.
    """

    def __init__(self, generator: VideoGenerator, request: SessionRequest) -> None:
        self.generator = generator
        self.request = request
        #: Every event but the chunks, in order (session.*, media.init, ...).
        self.events: list[Event] = []
        #: Why the session ended (``stopped``, ``completed``, ``idle_timeout``, ...); None while it runs.
        self.close_reason: str | None = None
        # One event in hand: the session runs at most max_ahead_chunks ahead of this iteration.
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: SessionHandle | None = None
        self._thread: threading.Thread | None = None
        self._opened: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._ended = threading.Event()

    @property
    def session_id(self) -> str:
        return self.request.session_id

    def __enter__(self) -> "Session":
        self._thread = threading.Thread(target=self._work, name=f"fv-session-{self.session_id}", daemon=True)
        self._thread.start()
        self._opened.result()  # a refused session (unknown model, can never fit) raises here, typed
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        assert self._thread is not None
        while self._thread.is_alive() or not self._queue.empty():  # unblock the pump: take what it still hands over
            try:
                kind, item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if kind == "event" and item.type != "media.chunk":
                self.events.append(item)
                if item.type == "session.closed":
                    self.close_reason = item.reason
        self._thread.join()

    def _work(self) -> None:
        async def pump() -> None:
            async with self.generator._running() as engine:
                try:
                    handle = engine.open_session(self.request)
                except BaseException as exc:
                    self._opened.set_exception(exc)
                    return
                self._loop, self._handle = asyncio.get_running_loop(), handle
                self._opened.set_result(None)
                loop = asyncio.get_running_loop()
                async for event in handle.events():
                    await loop.run_in_executor(None, self._queue.put, ("event", event))

        try:
            run_blocking(pump())
        except BaseException as exc:  # noqa: BLE001 - handed to the iterating thread
            if not self._opened.done():
                self._opened.set_exception(exc)
            self._queue.put(("error", exc))
        finally:
            self._ended.set()
            self._queue.put(("end", None))

    def _call(self, fn: Any) -> Any:
        """``fn(handle)`` on the engine's loop, its result or typed error here."""
        loop, handle = self._loop, self._handle
        if loop is None or handle is None or self._ended.is_set():
            raise SessionClosed(self.session_id, self.close_reason or "ended", "this operation")

        async def call() -> Any:
            return fn(handle)

        try:
            return asyncio.run_coroutine_threadsafe(call(), loop).result()
        except (RuntimeError, concurrent.futures.CancelledError) as exc:  # the loop ended between the check and the call
            raise SessionClosed(self.session_id, self.close_reason or "ended", "this operation") from exc

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            kind, item = self._queue.get()
            if kind == "error":
                raise item
            if kind == "end":
                return
            event = item
            if event.type == "media.chunk" and event.frames is not None:
                if not self._ended.is_set():
                    try:
                        self._call(lambda handle: None if handle.closed else handle.touch())
                    except SessionClosed:
                        pass
                yield Chunk(index=event.index, frames=event.frames, frame_start=event.frame_start or 0,
                            pts=event.pts, fps=event.fps or 0.0, prompt_version=event.prompt_version or 0,
                            preview=event.preview)
                continue
            self.events.append(event)
            if event.type == "session.closed":
                self.close_reason = event.reason
                if event.reason == "failed":
                    assert event.error is not None
                    raise StepFailed(f"session {self.session_id} failed: {event.error.message}")

    def update(self, prompt: str, event_id: str | None = None) -> int:
        """Queue a new prompt; returns its version (the chunks generated under it carry it)."""
        return self._call(lambda handle: handle.push_text(prompt, event_id))

    def stop(self) -> None:
        """End the session at its next step boundary; iteration ends after the chunks already made."""
        if not self._ended.is_set():
            try:
                self._call(lambda handle: None if handle.closed else handle.stop())
            except SessionClosed:
                pass

    def cancel(self, scope: str = "session") -> None:
        """``"stream"``: drop the chunk in progress and continue; ``"session"``: end it."""
        self._call(lambda handle: handle.cancel(scope))

    def touch(self) -> None:
        """Reset the idle timer (reading chunks does this too)."""
        self._call(lambda handle: handle.touch())

    def suspend(self) -> bytes:
        """Serialize the session (resume with ``engine.resume_session``) and end it."""
        loop, handle = self._loop, self._handle
        if loop is None or handle is None or self._ended.is_set():
            raise SessionClosed(self.session_id, self.close_reason or "ended", "suspend")
        return asyncio.run_coroutine_threadsafe(handle.suspend(), loop).result()


def _typed(field: str, build: Any) -> Any:
    """``build()``, with a pydantic error turned into an InvalidRequest naming the option."""
    try:
        return build()
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = [str(p) for p in error["loc"] if p not in ("diffusion", "ar")]
        name = _OPTION_FOR_FIELD.get(loc[0], loc[0]) if loc and field in ("diffusion", "ar", "request") else field
        message = str(error["msg"]).removeprefix("Value error, ")
        if "needs input part(s) ['image']" in message:
            name, message = "image", message.split(";")[0] + " (pass image=)"
        raise InvalidRequest(name, message) from None


def _task(task: Any) -> TaskType | None:
    if task is None or isinstance(task, TaskType):
        return task
    try:
        return TaskType(task)
    except ValueError:
        raise InvalidRequest("task", f"{task!r} is not a task", allowed=[t.value for t in TaskType]) from None


def _image_tensor(image: Any) -> torch.Tensor:
    """``image`` as a float (3, H, W) tensor in [0, 1]: from a file path, a tensor or a PIL image."""
    if isinstance(image, (str, os.PathLike)):
        return read_image(image)
    if isinstance(image, torch.Tensor):
        return image
    try:
        from PIL import Image
    except ImportError:  # without Pillow nothing can be a PIL image
        Image = None  # type: ignore[assignment]
    if Image is not None and isinstance(image, Image.Image):
        import numpy as np

        rgb = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
        return torch.from_numpy(rgb).permute(2, 0, 1).contiguous()
    raise InvalidRequest(
        "image", f"got {type(image).__name__}", allowed="a file path, a float (3, H, W) tensor in [0, 1], or a PIL image"
    )


def _video(result: GenerationResult) -> Video:
    result.raise_for_status()
    video = next((a for a in result.artifacts if isinstance(a, VideoArtifact)), None)
    if video is None:  # a card that does not declare what its program returns, and made no video
        kinds = sorted({a.kind for a in result.artifacts}) or "nothing"
        raise InvalidRequest("task", f"request {result.request_id} made no video (it returned {kinds})")
    return Video(artifact=video, artifacts=tuple(result.artifacts))


def _blocking(coroutine: Any) -> Any:
    """Run ``coroutine`` to completion from synchronous code, inside a running event loop or not."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run_blocking(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fv-generate") as pool:
        return pool.submit(run_blocking, coroutine).result()
