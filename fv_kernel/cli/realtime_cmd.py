"""``fv realtime``: stream a session of a causal card to a file, with prompt updates typed on stdin.

Each chunk is appended to the output as it arrives (``.mp4``: encoded as it comes; ``.gif`` and
``.pt``: written when the session ends), and a progress line goes to stderr per chunk (chunk
index, frames, generated FPS, the chunk's latency, the prompt version). Every line read on stdin
while it runs is a prompt update (applied at the next chunk boundary); ``:stop`` ends the
session. Bad input is one line naming the field, a non-zero exit, and no file written.
"""

from __future__ import annotations

import sys
import threading
import time
from fractions import Fraction
from pathlib import Path
from typing import Any, Optional, TextIO

import torch
import typer

from fv_kernel.cli.deploy_options import ConfigOption
from fv_kernel.errors import FvError
from fv_kernel.io.media import (
    MediaError,
    check_output_path,
    frames_to_uint8,
    write_gif,
    write_tensor,
)
from fv_kernel.plugins import PluginError

__all__ = ["REALTIME_OUTPUT_SUFFIXES", "STOP_LINE", "realtime"]

#: What ``fv realtime --output`` writes, by suffix.
REALTIME_OUTPUT_SUFFIXES = (".mp4", ".gif", ".pt")
#: A line that ends the session instead of updating the prompt.
STOP_LINE = ":stop"


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


class _Mp4Stream:
    """H.264 MP4 written chunk by chunk (the settings of ``io.media.write_mp4``: yuv420p, crf 18, odd sizes padded)."""

    def __init__(self, path: Path, fps: float) -> None:
        try:
            import av
        except ImportError as exc:
            raise MediaError(f"writing MP4 needs PyAV (in your fv checkout: pip install '.[media]'): {exc}") from None
        self._av = av
        path.parent.mkdir(parents=True, exist_ok=True)
        self._container = av.open(str(path), mode="w", format="mp4")
        self._rate = Fraction(fps).limit_denominator(1001)
        self._stream: Any = None
        self.frames = 0

    def add(self, frames: torch.Tensor) -> None:
        pixels = frames_to_uint8(frames)
        _, h, w, _ = pixels.shape
        pad_h, pad_w = h % 2, w % 2
        if pad_h or pad_w:
            pixels = torch.nn.functional.pad(pixels.permute(0, 3, 1, 2), (0, pad_w, 0, pad_h), mode="replicate").permute(0, 2, 3, 1)
        if self._stream is None:
            self._stream = self._container.add_stream("libx264", rate=self._rate)
            self._stream.width, self._stream.height = w + pad_w, h + pad_h
            self._stream.pix_fmt = "yuv420p"
            self._stream.options = {"crf": "18"}
        for frame in pixels.numpy():
            for packet in self._stream.encode(self._av.VideoFrame.from_ndarray(frame, format="rgb24")):
                self._container.mux(packet)
        self.frames += pixels.shape[0]

    def close(self) -> None:
        if self._stream is not None:
            for packet in self._stream.encode():
                self._container.mux(packet)
        self._container.close()


class _HeldFrames:
    """``.gif`` / ``.pt``: the frames are kept and written when the session ends."""

    def __init__(self, path: Path, fps: float) -> None:
        self.path, self.fps = path, fps
        self.chunks: list[torch.Tensor] = []
        self.frames = 0

    def add(self, frames: torch.Tensor) -> None:
        self.chunks.append(frames.detach().float().cpu())
        self.frames += frames.shape[0]

    def close(self) -> None:
        if not self.chunks:
            return
        frames = torch.cat(self.chunks)
        if self.path.suffix.lower() == ".gif":
            write_gif(frames, self.fps, self.path)
        else:
            write_tensor(frames, self.path)


def _read_prompts(session: Any, stdin: TextIO) -> None:
    """Every stdin line is a prompt update (``:stop`` ends the session); runs on a daemon thread."""
    for raw in stdin:
        line = raw.strip()
        if not line:
            continue
        try:
            if line == STOP_LINE:
                session.stop()
                typer.echo("stopping at the next step", err=True)
                return
            version = session.update(line)
            typer.echo(f"prompt v{version} queued: {line}", err=True)
        except FvError as exc:
            typer.echo(f"error: {exc.message}", err=True)
            if getattr(exc, "error_type", "") == "session_closed":
                return


def realtime(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="A causal card (one with a chunk_rollout loop): a card id, a card file, a checkpoint directory or a hub id (default: the installed plugins' default card)."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="The opening prompt; lines typed on stdin while it runs update it (':stop' ends the session)."),
    output: Path = typer.Option(..., "--output", "-o", help="Output file: .mp4 (H.264, written as chunks arrive), .gif or .pt (float32 (F,3,H,W) in [0,1]; both written when the session ends)."),
    chunks: Optional[int] = typer.Option(None, "--chunks", "-n", min=1, help="Stop after this many chunks (default: until ':stop', end of stdin is not a stop, or Ctrl-C)."),
    seed: int = typer.Option(0, "--seed"),
    height: Optional[int] = typer.Option(None, "--height"),
    width: Optional[int] = typer.Option(None, "--width"),
    fps: Optional[float] = typer.Option(None, "--fps", help="Playback rate of the stream (the card's default if omitted)."),
    idle_timeout: float = typer.Option(60.0, "--idle-timeout", help="End the session when no chunk is read for this many seconds."),
    device: Optional[str] = typer.Option(None, "--device", help="torch device, e.g. cpu or cuda (default: the config's entry for --model, else cpu)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
    config: Optional[Path] = ConfigOption,
) -> None:
    """Stream a realtime session of a causal card to --output, with prompt updates typed on stdin."""
    try:  # before any compute: the suffix, and that a file can be created there
        check_output_path(output, REALTIME_OUTPUT_SUFFIXES)
    except MediaError as exc:
        _fail(exc.message)
    from fv_kernel.facade import load

    options: dict[str, Any] = {"seed": seed, "max_chunks": chunks, "idle_timeout_s": idle_timeout}
    options.update({k: v for k, v in (("height", height), ("width", width), ("fps", fps)) if v is not None})
    try:
        generator = load(model, config=config, device=device)
        if not generator.card.streams_sessions:
            from fv_kernel.model.catalog import CardCatalog

            # The installed cards that can, from the plugin host the generator already started.
            causal = sorted(m for m, e in CardCatalog(generator.host).entries().items() if e.card.streams_sessions)
            _fail(f"model: card {generator.card.model_id!r} has no chunk_rollout loop, so it cannot stream a session; "
                  f"allowed: {', '.join(causal) if causal else 'none installed (a causal card, e.g. fv-wan wan-toy-causal)'}")
        session = generator.session(prompt, **options)
        session.__enter__()
    except (FvError, PluginError) as exc:
        _fail(getattr(exc, "message", str(exc)))
    writer: _Mp4Stream | _HeldFrames | None = None
    started = last = time.perf_counter()
    applied_seen = 0
    threading.Thread(target=_read_prompts, args=(session, sys.stdin), name="fv-realtime-stdin", daemon=True).start()
    try:
        try:
            for chunk in session:
                now = time.perf_counter()
                if writer is None:
                    writer = (_Mp4Stream if output.suffix.lower() == ".mp4" else _HeldFrames)(output, chunk.fps)
                writer.add(chunk.frames)
                if not quiet:
                    generated = writer.frames / max(now - started, 1e-9)
                    typer.echo(
                        f"chunk {chunk.index}  frames {chunk.frame_start}-{chunk.frame_start + chunk.num_frames - 1}  "
                        f"{generated:.1f} FPS  latency {1000 * (now - last):.0f} ms  prompt v{chunk.prompt_version}",
                        err=True,
                    )
                    applied = [e for e in session.events if e.type == "session.prompt_applied"]
                    for event in applied[applied_seen:]:
                        typer.echo(f"prompt v{event.version} applied from chunk {event.chunk_index}", err=True)
                    applied_seen = len(applied)
                last = now
        except KeyboardInterrupt:
            typer.echo("fv: interrupted; stopping the session and closing the file", err=True)
            session.stop()
            for chunk in session:  # what was generated before the stop still goes to the file
                if writer is not None:
                    writer.add(chunk.frames)
    except FvError as exc:
        _close(writer, session)
        _fail(exc.message)
    _close(writer, session)
    if writer is None:
        _fail(f"the session ended ({session.close_reason}) before its first chunk; nothing written")
    assert writer is not None
    typer.echo(f"wrote {output} ({writer.frames} frames, session {session.close_reason})", err=True)


def _close(writer: _Mp4Stream | _HeldFrames | None, session: Any) -> None:
    session.__exit__(None, None, None)
    if writer is not None:
        writer.close()
