"""The toy world's renderer: scenes into clips, vectorised in torch.

Each object is a flat-coloured shape (anti-aliased through a signed-distance coverage
mask, one pixel wide) moving in a straight line at constant speed over the clip, on a
plain or vertical-gradient background. A render seed picks each object's size and start
position within bounds that keep the whole path in frame; two objects are laid out on
disjoint bands, so they never overlap. The whole batch renders in one set of tensor
operations on any device.

Geometry (fractions of the frame):

- size (circle diameter, square side, triangle base and height): 0.20-0.30 of the
  shorter side for a lone object, 0.16-0.22 when there are two;
- distance travelled over the clip, along the motion axis: 0.40-0.48 of that axis for
  ``quickly``, 0.15-0.22 for ``slowly``, whatever the frame count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from fv_wan.toy.grammar import (
    BACKGROUND_SPECS,
    COLOUR_RGB,
    DIRECTION_VECTORS,
    SHAPES,
    Scene,
    sample_scene,
)

# Bump whenever what a (scene, seed, size) renders to changes: the trainer records it in
# the card's data contract.
GENERATOR_VERSION = "toy-world-1"

SIZE_RANGE_ONE = (0.20, 0.30)
SIZE_RANGE_TWO = (0.16, 0.22)
TRAVEL_RANGE: dict[str, tuple[float, float]] = {"slowly": (0.15, 0.22), "quickly": (0.40, 0.48)}
# Pixels kept clear between an object's path and the frame edge (and between two objects' bands).
_PAD = 1.0

MIN_FRAMES = 2
MIN_SIDE = 32


@dataclass(frozen=True)
class ObjectPath:
    """Where one object is drawn: its size and its centre's start and end (pixels, x right, y down).

    The centre is the centre of the shape's bounding box.
    """

    size: float
    start: tuple[float, float]
    end: tuple[float, float]


def _check_geometry(frames: int, height: int, width: int) -> None:
    for name, value, least in (("frames", frames, MIN_FRAMES), ("height", height, MIN_SIDE), ("width", width, MIN_SIDE)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an integer of at least {least}, got {value!r}")


def layout(scene: Scene, *, height: int, width: int, seed: int) -> tuple[ObjectPath, ...]:
    """Each object's size and path for ``scene`` at ``height`` x ``width``, chosen by ``seed``.

    Pure Python and deterministic (``random.Random``), so a layout is the same on every
    device. Paths stay at least one pixel inside the frame; two objects get disjoint bands
    along one axis (the cross axis when both move along the same axis, else x).
    """
    _check_geometry(MIN_FRAMES, height, width)
    rng = random.Random(f"toy-layout:{seed}")
    side = min(height, width)
    lengths = (float(width), float(height))
    size_range = SIZE_RANGE_ONE if len(scene.objects) == 1 else SIZE_RANGE_TWO
    sizes = [rng.uniform(*size_range) * side for _ in scene.objects]
    vectors = [DIRECTION_VECTORS[obj.direction] for obj in scene.objects]
    travels = [rng.uniform(*TRAVEL_RANGE[obj.speed]) * lengths[0 if v[0] else 1] for obj, v in zip(scene.objects, vectors)]

    def extent(index: int, axis: int) -> float:
        """The span an object's box sweeps along ``axis`` over the clip."""
        return sizes[index] + (travels[index] if vectors[index][axis] else 0.0)

    # low[i][axis]: the lowest coordinate object i's box reaches along axis.
    low = [[0.0, 0.0] for _ in scene.objects]
    if len(scene.objects) == 1:
        for axis in (0, 1):
            slack = lengths[axis] - 2 * _PAD - extent(0, axis)
            low[0][axis] = _PAD + rng.uniform(0.0, max(slack, 0.0))
    else:
        horizontal = [v[0] != 0 for v in vectors]
        split_axis = 1 if all(horizontal) else 0
        free_axis = 1 - split_axis
        order = [0, 1] if rng.random() < 0.5 else [1, 0]
        slack = lengths[split_axis] - 3 * _PAD - extent(0, split_axis) - extent(1, split_axis)
        cuts = sorted(rng.uniform(0.0, max(slack, 0.0)) for _ in range(2))
        first, second = order
        low[first][split_axis] = _PAD + cuts[0]
        low[second][split_axis] = low[first][split_axis] + extent(first, split_axis) + _PAD + (cuts[1] - cuts[0])
        for index in range(2):
            slack = lengths[free_axis] - 2 * _PAD - extent(index, free_axis)
            low[index][free_axis] = _PAD + rng.uniform(0.0, max(slack, 0.0))

    paths = []
    for index, (dx, dy) in enumerate(vectors):
        start = [low[index][axis] + sizes[index] / 2 for axis in (0, 1)]
        for axis, sign in ((0, dx), (1, dy)):
            if sign < 0:  # moving towards lower coordinates: start at the far end of the sweep
                start[axis] += travels[index]
        end = (start[0] + dx * travels[index], start[1] + dy * travels[index])
        paths.append(ObjectPath(sizes[index], (start[0], start[1]), end))
    return tuple(paths)


def _signed_distance(shape: str, px: torch.Tensor, py: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """Signed distance (pixels, negative inside) to one kind of shape.

    ``px`` (N, F, 1, W) and ``py`` (N, F, H, 1) are pixel offsets from each box centre,
    ``half`` (N, 1, 1, 1) half the size; returns (N, F, H, W).
    """
    if shape == "circle":
        return torch.sqrt(px * px + py * py) - half
    if shape == "square":
        qx, qy = px.abs() - half, py.abs() - half
        return torch.sqrt(qx.clamp(min=0) ** 2 + qy.clamp(min=0) ** 2) + torch.maximum(qx, qy).clamp(max=0)
    # Isosceles triangle, apex up, base = height = size: the largest of its three edge
    # half-plane distances (exact inside and along the edges, which is what 1px AA needs).
    base = py - half  # positive below the base line
    slant = (2 * px.abs() - py - half) / (5**0.5)  # slanted edges, outward unit normals (+-2, -1)/sqrt(5)
    return torch.maximum(base, slant)


def _coverage(
    shape_ids: torch.Tensor, sizes: torch.Tensor, centres: torch.Tensor, height: int, width: int
) -> torch.Tensor:
    """Anti-aliased coverage in [0, 1] of shapes on a pixel grid.

    ``shape_ids`` and ``sizes`` are (N,), ``centres`` (N, F, 2) box centres in pixels;
    returns (N, F, H, W). Coverage is ``clamp(0.5 - sdf, 0, 1)``: one pixel of blend at
    the edge. Each object's distance is computed for its own shape only.
    """
    device = centres.device
    count, frames = centres.shape[:2]
    ys = torch.arange(height, device=device, dtype=torch.float32) + 0.5
    xs = torch.arange(width, device=device, dtype=torch.float32) + 0.5
    coverage = torch.zeros(count, frames, height, width, device=device)
    for shape_id, shape in enumerate(SHAPES):
        index = (shape_ids == shape_id).nonzero().flatten()
        if index.numel() == 0:
            continue
        own = centres[index]
        px = xs.view(1, 1, 1, width) - own[..., 0, None, None]
        py = ys.view(1, 1, height, 1) - own[..., 1, None, None]
        sdf = _signed_distance(shape, px, py, (sizes[index] / 2).view(-1, 1, 1, 1))
        coverage[index] = (0.5 - sdf).clamp(0.0, 1.0)
    return coverage


def render_batch(
    scenes: list[Scene] | tuple[Scene, ...],
    seeds: list[int] | tuple[int, ...],
    *,
    frames: int,
    height: int,
    width: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Render each ``scenes[i]`` with layout seed ``seeds[i]``: (N, F, 3, H, W) float32 in [0, 1].

    Clip ``i`` equals ``render(scenes[i], seed=seeds[i], ...)`` on the same device.
    """
    _check_geometry(frames, height, width)
    if len(scenes) != len(seeds):
        raise ValueError(f"scenes and seeds differ in length: {len(scenes)} != {len(seeds)}")
    if not scenes:
        raise ValueError("render_batch needs at least one scene")
    device = torch.device(device) if device is not None else torch.device("cpu")
    count = len(scenes)

    # Objects flattened over the batch; a lone object's second slot is absent (shape id -1,
    # which no shape matches, so its coverage stays 0).
    slots = 2
    # Built as Python lists and converted once: per-element tensor writes cost more than the render.
    shape_rows: list[list[int]] = []
    size_rows: list[list[float]] = []
    start_rows: list[list[tuple[float, float]]] = []
    end_rows: list[list[tuple[float, float]]] = []
    colour_rows: list[list[tuple[float, float, float]]] = []
    background_rows: list[tuple[tuple[float, float, float], tuple[float, float, float]]] = []
    for scene, seed in zip(scenes, seeds):
        spec = BACKGROUND_SPECS[scene.background]
        background_rows.append((spec.top, spec.bottom))
        paths = layout(scene, height=height, width=width, seed=seed)
        missing = slots - len(paths)
        shape_rows.append([SHAPES.index(obj.shape) for obj in scene.objects] + [-1] * missing)
        size_rows.append([path.size for path in paths] + [1.0] * missing)
        start_rows.append([path.start for path in paths] + [(0.0, 0.0)] * missing)
        end_rows.append([path.end for path in paths] + [(0.0, 0.0)] * missing)
        colour_rows.append([COLOUR_RGB[obj.colour] for obj in scene.objects] + [(0.0, 0.0, 0.0)] * missing)

    shape_ids = torch.tensor(shape_rows, dtype=torch.long, device=device)
    sizes, starts, ends, colours, backgrounds = (
        torch.tensor(rows, dtype=torch.float32, device=device)
        for rows in (size_rows, start_rows, end_rows, colour_rows, background_rows)
    )
    tops, bottoms = backgrounds[:, 0], backgrounds[:, 1]
    times = torch.linspace(0.0, 1.0, frames, device=device).view(1, 1, frames, 1)
    centres = starts[:, :, None, :] + (ends - starts)[:, :, None, :] * times  # (N, K, F, 2)
    alpha = _coverage(shape_ids.flatten(), sizes.flatten(), centres.flatten(0, 1), height, width)
    alpha = alpha.view(count, slots, frames, 1, height, width)

    rows = torch.linspace(0.0, 1.0, height, device=device).view(1, 1, height, 1)
    background = tops.view(count, 3, 1, 1) + (bottoms - tops).view(count, 3, 1, 1) * rows  # (N, 3, H, 1)
    video = background.view(count, 1, 3, height, 1).expand(count, frames, 3, height, width)
    for j in range(slots):  # "over" compositing, slot 0 first
        video = torch.lerp(video, colours[:, j].view(count, 1, 3, 1, 1), alpha[:, j])
    return video.clamp_(0.0, 1.0)


def render(
    scene: Scene,
    *,
    frames: int,
    height: int,
    width: int,
    seed: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """One clip of ``scene``: (F, 3, H, W) float32 in [0, 1], deterministic by ``seed``."""
    return render_batch([scene], [seed], frames=frames, height=height, width=width, device=device)[0]


def _clip_seed(seed: int, index: int, position: int) -> int:
    # A stable mix of the three (no Python hash(): it is salted per process for strings).
    value = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) % (1 << 63)
    return value


class ToyWorld:
    """A deterministic stream of toy-world training batches.

    ``batch(index, size)`` is a function of (``seed``, ``index``, ``size``): clip ``j`` of
    it is a function of (``seed``, ``index``, ``j``) alone, so a smaller batch at the same
    index is a prefix of a larger one. Prompts come from the train split, or only from
    the held-out split when ``held_out=True``.
    """

    def __init__(self, *, frames: int, height: int, width: int, seed: int, held_out: bool = False) -> None:
        _check_geometry(frames, height, width)
        self.frames = frames
        self.height = height
        self.width = width
        self.seed = seed
        self.held_out = held_out

    def scenes(self, index: int, size: int) -> tuple[list[Scene], list[int]]:
        """The scenes and layout seeds of ``batch(index, size)``, without rendering."""
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        scenes: list[Scene] = []
        seeds: list[int] = []
        generator = torch.Generator()
        for position in range(size):
            generator.manual_seed(_clip_seed(self.seed, index, position))
            scenes.append(sample_scene(generator, held_out=self.held_out))
            seeds.append(int(torch.randint(0, 1 << 31, (1,), generator=generator)))
        return scenes, seeds

    def batch(self, index: int, size: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, list[str]]:
        """Videos (size, F, 3, H, W) in [0, 1] on ``device`` and their prompts."""
        scenes, seeds = self.scenes(index, size)
        videos = render_batch(scenes, seeds, frames=self.frames, height=self.height, width=self.width, device=device)
        return videos, [scene.prompt() for scene in scenes]
