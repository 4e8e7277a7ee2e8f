"""Artifact writers. MP4 goes through PyAV (H.264, yuv420p); PNG through Pillow.

Both are optional dependencies (in the fv checkout: ``pip install '.[media]'``); a missing one is a
clear :class:`MediaError`, not an ImportError from deep inside a request.
"""

from __future__ import annotations

import io
import tempfile
import wave
from pathlib import Path
from typing import Any

import torch

from fv_kernel.errors import FvError, InvalidRequest

__all__ = [
    "VIDEO_OUTPUT_SUFFIXES", "MediaError", "read_image", "check_output_path", "frames_to_uint8", "write_mp4", "write_gif", "encode_png", "write_png_frames",
    "write_tensor", "write_wav", "write_artifact",
]


#: The one list of files a video is written as (``fv generate --output``, ``Video.save``), by suffix:
#: H.264 MP4 (a sound track, when there is one, as AAC), animated GIF, the first frame as PNG, and
#: the float32 frames (F, 3, H, W) in [0, 1] via ``torch.save``.
VIDEO_OUTPUT_SUFFIXES: tuple[str, ...] = (".mp4", ".gif", ".png", ".pt")


class MediaError(FvError):
    error_type = "media"


def read_image(path: str | Path) -> torch.Tensor:
    """An image file as a float (3, H, W) tensor in [0, 1], or a typed error naming ``image``."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise InvalidRequest("image", "reading images needs Pillow (in your fv checkout: pip install '.[media]')") from None
    import numpy as np

    try:
        with Image.open(path) as img:
            rgb = np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0
    except FileNotFoundError:
        raise InvalidRequest("image", f"{path} does not exist") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise InvalidRequest("image", f"{path} is not a readable image ({type(exc).__name__})", allowed="PNG, JPEG, WebP, ...") from None
    return torch.from_numpy(rgb).permute(2, 0, 1).contiguous()


def check_output_path(path: str | Path, suffixes: tuple[str, ...], *, param: str = "output") -> Path:
    """``path`` if a file with one of ``suffixes`` can be written there, else a :class:`MediaError` naming ``param``.

    Cheap and done before any compute: the suffix, an existing directory in the way, an
    ancestor that is a file, and a real write probe in the nearest existing directory
    (permissions, read-only mounts and pseudo file systems such as /proc all fail it).
    """
    path = Path(path).expanduser()
    suffix = path.suffix.lower()
    if suffix not in suffixes:
        raise MediaError(
            f"{param}: unsupported suffix {suffix or '(none)'!r} in {str(path)!r}; allowed: {', '.join(suffixes)}", param=param
        )
    if path.is_dir():
        raise MediaError(f"{param}: {str(path)!r} is a directory", param=param)
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise MediaError(f"{param}: cannot write {str(path)!r}: {str(ancestor)!r} is not a directory", param=param)
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as exc:
        raise MediaError(f"{param}: cannot create files in {str(ancestor)!r}: {exc.strerror or exc}", param=param) from None
    return path


def frames_to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """(F, 3, H, W) float in [0, 1] -> (F, H, W, 3) uint8."""
    if frames.ndim != 4 or frames.shape[1] != 3:
        raise MediaError(f"frames must be shaped (F, 3, H, W), got {tuple(frames.shape)}", param="frames")
    return (frames.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().cpu()


#: Sample rates AAC encodes; audio at another rate is resampled to :data:`AAC_FALLBACK_RATE` for the MP4.
AAC_SAMPLE_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)
AAC_FALLBACK_RATE = 48000


def _audio_frames(samples: torch.Tensor, sample_rate: int) -> tuple[list[Any], int, str]:
    """(channels, N) float samples in [-1, 1] as AAC-ready PyAV frames (fltp, 1024 samples each, pts in
    samples at the output rate), the output rate and the channel layout."""
    import av
    from fractions import Fraction

    if samples.ndim != 2 or samples.shape[0] not in (1, 2) or samples.shape[1] == 0:
        raise MediaError(
            f"audio to mux must be shaped (channels, N) with 1 or 2 channels and N > 0, got {tuple(samples.shape)}",
            param="audio",
        )
    if sample_rate <= 0:
        raise MediaError(f"audio sample_rate must be > 0, got {sample_rate}", param="audio")
    layout = "mono" if samples.shape[0] == 1 else "stereo"
    rate = sample_rate if sample_rate in AAC_SAMPLE_RATES else AAC_FALLBACK_RATE
    pcm = samples.detach().float().clamp(-1, 1).cpu().contiguous().numpy()
    source = av.AudioFrame.from_ndarray(pcm, format="fltp", layout=layout)
    source.sample_rate, source.pts, source.time_base = sample_rate, 0, Fraction(1, sample_rate)
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=rate, frame_size=1024)
    frames = [*resampler.resample(source), *resampler.resample(None)]
    position = 0
    for frame in frames:  # contiguous timestamps from 0, so the muxer interleaves audio with the video
        frame.pts, frame.time_base = position, Fraction(1, rate)
        position += frame.samples
    return frames, rate, layout


def write_mp4(
    frames: torch.Tensor,
    fps: float,
    path: str | Path,
    *,
    crf: int = 18,
    audio: torch.Tensor | None = None,
    sample_rate: int | None = None,
) -> Path:
    """Encode frames as H.264 MP4. Odd sizes are padded by one pixel (yuv420p needs even sizes).

    ``audio`` ((channels, N) float in [-1, 1], 1 or 2 channels, at ``sample_rate``) is muxed in
    as an AAC track starting with the first frame; a rate AAC cannot hold (e.g. a tiny card's
    150 Hz) is resampled to 48 kHz, so the track's duration stays ``N / sample_rate``.
    """
    try:
        import av
    except ImportError as exc:
        raise MediaError(f"writing MP4 needs PyAV (in your fv checkout: pip install '.[media]'): {exc}") from None
    from fractions import Fraction

    if audio is not None and sample_rate is None:
        raise MediaError("muxing audio into an MP4 needs its sample_rate", param="audio")
    sound = _audio_frames(audio, int(sample_rate)) if audio is not None and sample_rate is not None else None

    pixels = frames_to_uint8(frames)
    f, h, w, _ = pixels.shape
    pad_h, pad_w = h % 2, w % 2
    if pad_h or pad_w:
        pixels = torch.nn.functional.pad(pixels.permute(0, 3, 1, 2), (0, pad_w, 0, pad_h), mode="replicate").permute(0, 2, 3, 1)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height = w + pad_w, h + pad_h
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf)}
        audio_stream = None
        if sound is not None:  # every stream is added before the first packet is muxed (the header)
            audio_stream = container.add_stream("aac", rate=sound[1], layout=sound[2])
        for frame in pixels.numpy():
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if audio_stream is not None and sound is not None:
            for audio_frame in sound[0]:
                container.mux(audio_stream.encode(audio_frame))
            container.mux(audio_stream.encode(None))
    return path


def write_gif(frames: torch.Tensor, fps: float, path: str | Path) -> Path:
    """An animated GIF (Pillow) that loops forever. GIF stores frame durations in hundredths of a
    second, so the rate is the nearest one that format can hold (8 fps plays at 120 ms a frame)."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise MediaError(f"writing GIF needs Pillow (in your fv checkout: pip install '.[media]'): {exc}") from None
    images = [Image.fromarray(frame) for frame in frames_to_uint8(frames).numpy()]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    images[0].save(path, format="GIF", save_all=True, append_images=images[1:], duration=max(1, round(100 / fps)) * 10, loop=0)
    return path


def encode_png(frame: torch.Tensor) -> bytes:
    """One (3, H, W) frame in [0, 1] as PNG bytes."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise MediaError(f"writing PNG needs Pillow (in your fv checkout: pip install '.[media]'): {exc}") from None
    pixels = frames_to_uint8(frame.unsqueeze(0))[0].numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def write_png_frames(frames: torch.Tensor, folder: str | Path) -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, frame in enumerate(frames):
        path = folder / f"frame_{index:05d}.png"
        path.write_bytes(encode_png(frame))
        paths.append(path)
    return paths


def write_tensor(frames: torch.Tensor, path: str | Path) -> Path:
    """The raw frames: float32 (F, 3, H, W) in [0, 1], via ``torch.save``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(frames.detach().float().cpu().contiguous(), path)
    return path


def write_wav(samples: torch.Tensor, sample_rate: int, path: str | Path) -> Path:
    """(channels, N) float in [-1, 1] as 16-bit PCM WAV."""
    if samples.ndim != 2:
        raise MediaError(f"audio samples must be shaped (channels, N), got {tuple(samples.shape)}", param="samples")
    pcm = (samples.detach().float().clamp(-1, 1) * 32767).round().to(torch.int16).t().contiguous().cpu().numpy()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(int(samples.shape[0]))
        wav.setsampwidth(2)
        wav.setframerate(int(sample_rate))
        wav.writeframes(pcm.tobytes())
    return path


def write_artifact(artifact: object, path: str | Path, *, audio: object | None = None) -> Path:
    """Write a video artifact by the path's suffix: .mp4, .gif, .pt, .png (first frame) or a folder for PNG frames.

    ``audio`` (an ``AudioArtifact``) is muxed into an .mp4 as its AAC track; other suffixes
    cannot hold sound and refuse it (write it with ``write_wav`` instead).
    """
    from fv_kernel.request.artifacts import AudioArtifact, VideoArtifact

    path = Path(path)
    if isinstance(artifact, AudioArtifact):
        return write_wav(artifact.samples, artifact.sample_rate, path)
    if not isinstance(artifact, VideoArtifact):
        raise MediaError(f"cannot write a {type(artifact).__name__} to {path}", param="output")
    suffix = path.suffix.lower()
    if audio is not None:
        if not isinstance(audio, AudioArtifact):
            raise MediaError(f"audio must be an AudioArtifact, got {type(audio).__name__}", param="audio")
        if suffix != ".mp4":
            raise MediaError(f"only .mp4 holds a video's sound; {suffix or 'a folder'} cannot", param="output")
        return write_mp4(artifact.frames, artifact.fps, path, audio=audio.samples, sample_rate=audio.sample_rate)
    if suffix == ".mp4":
        return write_mp4(artifact.frames, artifact.fps, path)
    if suffix == ".gif":
        return write_gif(artifact.frames, artifact.fps, path)
    if suffix == ".pt":
        return write_tensor(artifact.frames, path)
    if suffix == ".png":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_png(artifact.frames[0]))
        return path
    if suffix == "":
        write_png_frames(artifact.frames, path)
        return path
    raise MediaError(
        f"unsupported output suffix {suffix!r}; allowed: {', '.join(VIDEO_OUTPUT_SUFFIXES)}, or a folder name without suffix for PNG frames",
        param="output",
    )
