"""Run compiled jobs on fv and write the files their save nodes name, as ComfyUI names them.

A job runs exactly as ``fv generate`` would: ``fv.load(card, precision_path=..., component_sources=...)``
(the path its ``UNETLoader.weight_dtype`` asks for, when it asks one; the UNETLoader's file, when
ComfyUI's diffusion_models folder is set) then ``generate(prompt, **options)`` (the
image by its path, read as ``--image`` reads it). A job's LoRA nodes are registered with the
generator's adapter registry under fv-comfyui's names (:mod:`fv_comfyui.loras`: one per file and
expert) and passed by name as ``loras``.

Files: ``<output_dir>/<filename_prefix>_<counter:05>_.<ext>``, the counter one past the highest
already there for that prefix in that folder, whatever the extension, as ComfyUI's
``get_save_image_path``; a prefix may name a subfolder, never one
outside the output folder. Frames become 8-bit as ComfyUI's savers make them
(``clip(255 * x)`` truncated). ``SaveAnimatedWEBP``: Pillow's animated WebP with ComfyUI's
``method`` numbers; ``SaveWEBM``: PyAV, ``libvpx-vp9`` or ``libsvtav1`` at the node's CRF;
``SaveVideo``: H.264 MP4.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from fv_kernel.api import DeployConfig, Video, VideoGenerator, load
from fv_comfyui.compile import ComfyJob, SaveTarget
from fv_comfyui.loras import LoraLibrary, adapter_registry

__all__ = ["OutputFileError", "SavedFile", "JobRunner", "save_outputs", "frames_uint8"]

_WEBP_METHODS = {"default": 4, "fastest": 0, "slowest": 6}
_WEBM_CODECS = {"vp9": "libvpx-vp9", "av1": "libsvtav1"}


class OutputFileError(ValueError):
    """A save node's ``filename_prefix`` points outside the output folder, or a file cannot be written."""


@dataclass(frozen=True)
class SavedFile:
    """One written file, as ComfyUI's history lists it."""

    node_id: str
    filename: str
    subfolder: str
    format: str

    def history_entry(self) -> dict[str, str]:
        return {"filename": self.filename, "subfolder": self.subfolder, "type": "output"}


def frames_uint8(frames: torch.Tensor) -> np.ndarray:
    """(F, 3, H, W) in [0, 1] → (F, H, W, 3) uint8, as ComfyUI's savers convert."""
    array = (255.0 * frames.permute(0, 2, 3, 1).cpu().numpy()).clip(0, 255)
    return array.astype(np.uint8)


def _target_path(output_dir: Path, prefix: str, ext: str) -> tuple[Path, str]:
    full = (output_dir / prefix).resolve()
    root = output_dir.resolve()
    if root not in (full, *full.parents) or full == root:
        raise OutputFileError(f"filename_prefix {prefix!r}: saving outside the output folder is not allowed")
    folder, base = full.parent, full.name
    folder.mkdir(parents=True, exist_ok=True)
    pattern = re.compile(rf"^{re.escape(base)}_(\d+)_\.[A-Za-z0-9]+$")
    taken = [int(m.group(1)) for p in folder.iterdir() if (m := pattern.match(p.name))]
    counter = max(taken, default=0) + 1
    path = folder / f"{base}_{counter:05}_.{ext}"
    return path, str(folder.relative_to(root)) if folder != root else ""


def _write_webp(frames: np.ndarray, target: SaveTarget, path: Path) -> None:
    from PIL import Image

    images = [Image.fromarray(frame) for frame in frames]
    images[0].save(
        path, save_all=True, duration=int(1000.0 / target.fps), append_images=images[1:],
        lossless=bool(target.options["lossless"]), quality=int(target.options["quality"]),
        method=_WEBP_METHODS[str(target.options["method"])], format="WEBP",
    )


def _write_webm(frames: np.ndarray, target: SaveTarget, path: Path) -> None:
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(_WEBM_CODECS[str(target.options["codec"])], rate=Fraction(round(target.fps * 1000), 1000))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.bit_rate = 0
        stream.options = {"crf": str(int(target.options["crf"]))}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def save_outputs(video: Video, targets: Iterable[SaveTarget], output_dir: Path) -> list[SavedFile]:
    """Write ``video`` once per save node; returns the files in node order."""
    from fv_kernel.api import write_mp4

    frames = frames_uint8(video.frames)
    saved: list[SavedFile] = []
    for target in targets:
        path, subfolder = _target_path(output_dir, target.filename_prefix, target.format)
        try:
            if target.format == "webp":
                _write_webp(frames, target, path)
            elif target.format == "webm":
                _write_webm(frames, target, path)
            else:
                write_mp4(torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255.0, target.fps, path)
        except OSError as exc:
            raise OutputFileError(f"{target.class_type} #{target.node_id}: cannot write {path}: {exc}") from None
        saved.append(SavedFile(target.node_id, path.name, subfolder, target.format))
    return saved


class JobRunner:
    """Runs jobs, keeping one loaded generator per card and precision path across them."""

    def __init__(self, *, config: DeployConfig | None = None, loras: LoraLibrary | None = None) -> None:
        self.config = config
        self.loras = loras or LoraLibrary(None)
        self._generators: dict[tuple[str, str | None, tuple[tuple[str, str], ...]], VideoGenerator] = {}

    def generator(self, model_id: str, precision_path: str | None = None,
                  component_sources: Mapping[str, Path] | None = None) -> VideoGenerator:
        """The loaded generator of card ``model_id`` (``fv.load``, once per runner, path and files);
        ``precision_path`` None: the deploy config's (its ``cards`` entry), else that path;
        ``component_sources``: files components load from (a UNETLoader's, from the diffusion_models folder)."""
        sources = dict(component_sources or {})
        key = (model_id, precision_path, tuple(sorted((c, str(p)) for c, p in sources.items())))
        if key not in self._generators:
            extra: dict[str, Any] = {} if precision_path is None else {"precision_path": precision_path}
            if sources:
                extra["component_sources"] = sources
            self._generators[key] = load(model_id, config=self.config, **extra)
        return self._generators[key]

    def run(self, job: ComfyJob, image_path: Path | None = None, *, on_event: Callable[[Any], None] | None = None) -> Video:
        # The card as installed (a chain's switch is a request option), at the path weight_dtype asks, with the
        # UNETLoader files the job names when the diffusion_models folder is set.
        generator = self.generator(job.card.model_id, job.precision_path, job.component_sources)
        options: dict[str, Any] = dict(job.options)
        if job.loras:  # registered under fv-comfyui's names (one per file and expert), then given by name
            refs = self.loras.register(adapter_registry(generator.instance), job.loras)
            options["loras"] = [{"name": ref.name, "scale": ref.scale} for ref in refs]
        if image_path is not None:
            options["image"] = str(image_path)
        if on_event is None:
            return generator.generate(job.prompt, **options)
        video = None
        for event in generator.stream(job.prompt, previews=False, **options):
            on_event(event)
            if getattr(event, "video", None) is not None:
                video = event.video
        assert video is not None
        return video
