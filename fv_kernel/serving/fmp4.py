"""Fragmented MP4 (H.264) for streamed video: one init segment, then one media fragment per chunk.

A realtime session's chunks arrive one at a time and must play as soon as each arrives, in a
browser through Media Source Extensions (append the init segment, then each fragment) or in
any player when the bytes are concatenated. Each chunk is encoded with a fresh H.264 encoder
(its first frame a keyframe, no B-frames, no scene-cut keyframes), muxed by FFmpeg with
``frag_keyframe+empty_moov+default_base_moof`` and then re-timed: the fragment's sequence
number and decode time (``mfhd``, ``tfdt``) are rewritten to continue the stream, so nothing
waits for the next chunk (FFmpeg's fragmenter would hold a fragment until the next keyframe).
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
import torch

__all__ = ["Fragment", "FragmentedMP4Writer", "iter_boxes"]

_MOVFLAGS = "frag_keyframe+empty_moov+default_base_moof"


def iter_boxes(data: bytes, start: int = 0, end: int | None = None) -> list[tuple[bytes, int, int]]:
    """The ISO-BMFF boxes in ``data[start:end]`` as ``(type, offset, size)``, in order."""
    end = len(data) if end is None else end
    boxes: list[tuple[bytes, int, int]] = []
    offset = start
    while offset + 8 <= end:
        size, kind = struct.unpack(">I4s", data[offset:offset + 8])
        if size == 1:
            size = struct.unpack(">Q", data[offset + 8:offset + 16])[0]
        elif size == 0:
            size = end - offset
        if size < 8 or offset + size > end:
            raise ValueError(f"malformed MP4 box {kind!r} at byte {offset} (size {size})")
        boxes.append((kind, offset, size))
        offset += size
    return boxes


def _child(data: bytes, kind: bytes, offset: int, size: int, header: int = 8) -> tuple[int, int]:
    for child, child_offset, child_size in iter_boxes(data, offset + header, offset + size):
        if child == kind:
            return child_offset, child_size
    raise ValueError(f"MP4 box {kind!r} not found")


@dataclass(frozen=True)
class Fragment:
    """One chunk's media: ``data`` is ``moof`` + ``mdat``; ``init`` (``ftyp`` + ``moov``) comes with the first."""

    data: bytes
    init: bytes | None
    frame_start: int
    num_frames: int
    width: int
    height: int

    @property
    def payload(self) -> bytes:
        """What a client appends: the init segment (first fragment only) followed by the fragment."""
        return (self.init or b"") + self.data


class FragmentedMP4Writer:
    """Encodes successive chunks of one stream (``[F, 3, H, W]`` floats in [0, 1]) as fMP4 fragments.

    Every chunk must have the size of the first. Odd widths/heights are padded by one edge pixel
    (4:2:0 H.264 needs even sizes). Not thread-safe: one writer per stream.
    """

    def __init__(self, fps: float, *, crf: int = 23) -> None:
        if fps <= 0:
            raise ValueError(f"fps must be > 0, got {fps}")
        self.fps = Fraction(fps).limit_denominator(1001)
        self._crf = crf
        self._size: tuple[int, int] | None = None
        self._init: bytes | None = None
        self._avcc: bytes | None = None
        self._timescale = 0
        self._sequence = 0
        self.frames_written = 0
        self.codec = ""

    @property
    def init_segment(self) -> bytes | None:
        return self._init

    @property
    def mime(self) -> str:
        """The MSE type for ``MediaSource.isTypeSupported`` / ``addSourceBuffer`` (known after the first chunk)."""
        return f'video/mp4; codecs="{self.codec}"'

    def encode(self, frames: torch.Tensor) -> Fragment:
        if frames.ndim != 4 or frames.shape[1] != 3 or frames.shape[0] == 0:
            raise ValueError(f"frames must be [F>0, 3, H, W], got {tuple(frames.shape)}")
        height, width = int(frames.shape[2]), int(frames.shape[3])
        if self._size is None:
            self._size = (height, width)
        elif self._size != (height, width):
            raise ValueError(f"chunk frames are {height}x{width}; this stream is {self._size[0]}x{self._size[1]}")
        pixels = (frames.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        pad_h, pad_w = height % 2, width % 2
        if pad_h or pad_w:
            pixels = np.pad(pixels, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
        muxed = self._mux(pixels)
        boxes = {kind: (offset, size) for kind, offset, size in iter_boxes(muxed)}
        init = None
        if self._init is None:
            init = muxed[boxes[b"ftyp"][0]:boxes[b"ftyp"][0] + boxes[b"ftyp"][1]]
            init += muxed[boxes[b"moov"][0]:boxes[b"moov"][0] + boxes[b"moov"][1]]
            self._init = init
            self._timescale = self._read_timescale(muxed, *boxes[b"moov"])
        avcc = self._read_avcc(muxed, *boxes[b"moov"])
        if self._avcc is None:
            self._avcc = avcc
            self.codec = "avc1." + avcc[1:4].hex().upper()
        elif avcc != self._avcc:  # the encoder's settings are fixed, so this means a changed stream
            raise RuntimeError("H.264 parameter sets changed between chunks; the init segment no longer fits")
        data = self._retime(muxed, self.frames_written)
        fragment = Fragment(
            data=data, init=init, frame_start=self.frames_written, num_frames=int(pixels.shape[0]),
            width=int(pixels.shape[2]), height=int(pixels.shape[1]),
        )
        self.frames_written += int(pixels.shape[0])
        return fragment

    def _mux(self, pixels: np.ndarray) -> bytes:
        buffer = io.BytesIO()
        with av.open(buffer, "w", format="mp4", options={"movflags": _MOVFLAGS}) as container:
            stream = container.add_stream(
                "libx264", rate=self.fps,
                options={"preset": "veryfast", "tune": "zerolatency", "crf": str(self._crf), "bf": "0",
                         "x264-params": "scenecut=0:keyint=100000:min-keyint=100000"},
            )
            stream.width, stream.height, stream.pix_fmt = int(pixels.shape[2]), int(pixels.shape[1]), "yuv420p"
            stream.time_base = 1 / self.fps
            for index, image in enumerate(pixels):
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
                frame.pts = index
                container.mux(stream.encode(frame))
            container.mux(stream.encode(None))
        return buffer.getvalue()

    @staticmethod
    def _read_timescale(data: bytes, moov: int, size: int) -> int:
        trak = _child(data, b"trak", moov, size)
        mdia = _child(data, b"mdia", *trak)
        offset, _ = _child(data, b"mdhd", *mdia)
        version = data[offset + 8]
        at = offset + 12 + (16 if version == 1 else 8)
        return int(struct.unpack(">I", data[at:at + 4])[0])

    @staticmethod
    def _read_avcc(data: bytes, moov: int, size: int) -> bytes:
        trak = _child(data, b"trak", moov, size)
        mdia = _child(data, b"mdia", *trak)
        minf = _child(data, b"minf", *mdia)
        stbl = _child(data, b"stbl", *minf)
        stsd_offset, stsd_size = _child(data, b"stsd", *stbl)
        # stsd: full box header (12) + entry count (4); avc1 sample entry: 8 + 78 bytes before its boxes.
        _, entry_offset, entry_size = iter_boxes(data, stsd_offset + 16, stsd_offset + stsd_size)[0]
        offset, box_size = _child(data, b"avcC", entry_offset, entry_size, header=8 + 78)
        return data[offset + 8:offset + box_size]

    def _retime(self, muxed: bytes, frame_start: int) -> bytes:
        """Every ``moof`` + ``mdat`` of ``muxed``, renumbered and moved to start at ``frame_start``."""
        base = Fraction(frame_start * self._timescale) / self.fps
        if base.denominator != 1:
            raise RuntimeError(f"frame {frame_start} does not fall on the track's timescale {self._timescale}")
        out = bytearray()
        for kind, offset, size in iter_boxes(muxed):
            if kind not in (b"moof", b"mdat"):
                continue  # ftyp/moov (the init segment) and the trailing mfra index
            box = bytearray(muxed[offset:offset + size])
            if kind == b"moof":
                self._sequence += 1
                mfhd, _ = _child(bytes(box), b"mfhd", 0, size)
                struct.pack_into(">I", box, mfhd + 12, self._sequence)
                for child, child_offset, child_size in iter_boxes(bytes(box), 8, size):
                    if child != b"traf":
                        continue
                    tfdt, _ = _child(bytes(box), b"tfdt", child_offset, child_size)
                    if box[tfdt + 8] == 1:
                        old = struct.unpack_from(">Q", box, tfdt + 12)[0]
                        struct.pack_into(">Q", box, tfdt + 12, old + int(base))
                    else:
                        old = struct.unpack_from(">I", box, tfdt + 12)[0]
                        struct.pack_into(">I", box, tfdt + 12, old + int(base))
            out += box
        return bytes(out)
