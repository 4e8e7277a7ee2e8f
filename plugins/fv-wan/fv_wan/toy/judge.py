"""The toy world's judge: does a video show what its prompt says?

For each object the prompt names, the judge finds the object by its colour and checks

- ``colour``: a compact blob of that colour is present in at least 80% of the frames;
- ``direction``: the blob's centroid track (a least-squares line over the frames where it
  is present) moves along the prompted direction by at least 7% of that axis, at least
  twice as far as it drifts across it;
- ``speed``: the distance travelled is above (``quickly``) or below (``slowly``) 31% of
  the axis (the renderer uses 40-48% and 15-22%);
- ``shape``: the blob best matches the prompted shape's template (mean IoU over frames
  with circle / square / triangle templates of the blob's area, centred on its centroid).

and for the clip, ``stable``: every coloured object seen in any frame is present in every
frame, keeps its area (coefficient of variation at most 0.25), moves along a smooth path
(path length at most 1.5x the net displacement, plus 1% of the frame per step), and the
background outside the objects does not change between frames (mean absolute change at
most 0.04). A clip is ``correct`` when every prompted object has the right colour,
direction, speed and shape, the clip is stable, and no unprompted colour is present in
half the frames or more.

A pixel belongs to an object colour when that colour is its nearest palette colour
(object colours plus the background anchors black, grey and navy), within 0.4 in RGB,
and it is more than 0.3 from its row's median colour (the background estimate; the
backgrounds are plain or vertical gradients, and no object covers half a row) and has a
different nearest palette colour than that median.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from fv_wan.toy.grammar import COLOUR_RGB, COLOURS, DIRECTION_VECTORS, SHAPES, parse_prompt
from fv_wan.toy.world import _signed_distance

# Background anchors: colours backgrounds are made of that are not object colours.
_ANCHOR_RGB: dict[str, tuple[float, float, float]] = {
    "black": (0.0, 0.0, 0.0),
    "grey": (0.5, 0.5, 0.5),
    "navy": (0.05, 0.05, 0.3),
}
COLOUR_RADIUS = 0.4
BACKGROUND_MARGIN = 0.3
MIN_AREA = 0.004  # of side**2 (side = the shorter frame side)
MAX_AREA = 0.25  # of H * W
MAX_SPREAD = 0.17  # of side: sqrt(var_x + var_y) of a blob's pixels
PRESENT_FRACTION = 0.8
MIN_TRAVEL = 0.07  # of the motion axis
DRIFT_RATIO = 2.0
QUICK_TRAVEL = 0.31  # of the motion axis
MAX_AREA_CV = 0.25
PATH_RATIO = 1.5
PATH_SLACK = 0.01  # of side, per frame step
MAX_BACKGROUND_CHANGE = 0.04
_FILL = {"circle": torch.pi / 4, "square": 1.0, "triangle": 0.5}


@dataclass(frozen=True)
class ObjectJudgement:
    """The judge's findings for one prompted object.

    ``displacement`` is the fitted centroid travel over the clip as fractions of
    (width, height); ``detected_shape`` the best-matching template (``None`` when the
    colour was never found); ``present_fraction`` the share of frames its colour was found in.
    """

    colour_name: str
    shape_name: str
    direction_name: str
    speed_name: str
    colour: bool
    direction: bool
    speed: bool
    shape: bool
    present_fraction: float
    displacement: tuple[float, float]
    detected_shape: str | None

    @property
    def correct(self) -> bool:
        return self.colour and self.direction and self.speed and self.shape


@dataclass(frozen=True)
class Judgement:
    """The judge's verdict on one clip against its prompt."""

    prompt: str
    objects: tuple[ObjectJudgement, ...]
    stable: bool
    extra_colours: tuple[str, ...]

    @property
    def correct(self) -> bool:
        return self.stable and not self.extra_colours and all(obj.correct for obj in self.objects)


@dataclass(frozen=True)
class QualityScore:
    """Accuracies over a set of clips: per prompted object (colour, direction, speed, shape)
    and per clip (stability, all-correct)."""

    clips: int
    objects: int
    colour: float
    direction: float
    speed: float
    shape: float
    stability: float
    all_correct: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass(frozen=True)
class _Blob:
    """Per-frame measurements of one colour's mask."""

    present: torch.Tensor  # (F,) bool
    area: torch.Tensor  # (F,)
    centroid: torch.Tensor  # (F, 2) x, y in pixels
    mask: torch.Tensor  # (F, H, W) bool


def _check_video(video: object) -> torch.Tensor:
    if not isinstance(video, torch.Tensor):
        raise ValueError(f"video must be a torch.Tensor of shape (F, 3, H, W), got {type(video).__name__}")
    if video.ndim != 4 or video.shape[1] != 3 or video.shape[0] < 2:
        raise ValueError(f"video must have shape (F, 3, H, W) with F >= 2, got {tuple(video.shape)}")
    if not video.is_floating_point():
        raise ValueError(f"video must be floating point in [0, 1], got dtype {video.dtype}")
    video = video.detach().to("cpu", torch.float32)
    if not torch.isfinite(video).all() or video.min() < -1e-3 or video.max() > 1 + 1e-3:
        raise ValueError("video values must be finite and in [0, 1]")
    return video.clamp(0.0, 1.0)


def _colour_masks(video: torch.Tensor) -> torch.Tensor:
    """(F, C, H, W) bool: pixels of each object colour (``COLOURS`` order)."""
    frames, _, height, width = video.shape
    palette = torch.tensor([*COLOUR_RGB.values(), *_ANCHOR_RGB.values()])  # (P, 3)

    def nearest(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Nearest palette index and its distance for (..., 3) pixels."""
        flat = pixels.reshape(-1, 3)
        squared = (flat * flat).sum(dim=1, keepdim=True) - 2 * flat @ palette.T + (palette * palette).sum(dim=1)
        value, index = squared.min(dim=1)
        return index.view(pixels.shape[:-1]), value.clamp(min=0).sqrt().view(pixels.shape[:-1])

    pixels = video.permute(0, 2, 3, 1)  # (F, H, W, 3)
    label, distance = nearest(pixels)
    background = pixels.median(dim=2, keepdim=True).values  # (F, H, 1, 3) per-row median
    background_label, _ = nearest(background)
    # A pixel whose nearest palette colour is its row background's (an anti-aliased edge
    # blending into a white background, say) is background, however far it is from it.
    off_background = (((pixels - background) ** 2).sum(dim=-1) > BACKGROUND_MARGIN**2) & (
        label != background_label
    )
    near = (distance < COLOUR_RADIUS) & off_background
    colours = torch.arange(len(COLOURS)).view(1, -1, 1, 1)
    return (label[:, None] == colours) & near[:, None]


def _measure(mask: torch.Tensor) -> _Blob:
    """Area, centroid and presence (big enough, compact) per frame of one colour's mask (F, H, W)."""
    frames, height, width = mask.shape
    side = min(height, width)
    weights = mask.float()
    area = weights.sum(dim=(1, 2))
    ys = torch.arange(height, dtype=torch.float32).view(1, height, 1) + 0.5
    xs = torch.arange(width, dtype=torch.float32).view(1, 1, width) + 0.5
    safe = area.clamp(min=1.0)
    cx = (weights * xs).sum(dim=(1, 2)) / safe
    cy = (weights * ys).sum(dim=(1, 2)) / safe
    var = (weights * ((xs - cx.view(-1, 1, 1)) ** 2 + (ys - cy.view(-1, 1, 1)) ** 2)).sum(dim=(1, 2)) / safe
    present = (area >= MIN_AREA * side * side) & (area <= MAX_AREA * height * width) & (var.sqrt() <= MAX_SPREAD * side)
    return _Blob(present=present, area=area, centroid=torch.stack([cx, cy], dim=1), mask=mask)


def _fit_displacement(blob: _Blob) -> tuple[float, float]:
    """Centroid travel over the clip (pixels) from a least-squares line through the present frames."""
    frames = blob.present.shape[0]
    t = torch.arange(frames, dtype=torch.float32)[blob.present]
    if t.numel() < 2:
        return (0.0, 0.0)
    points = blob.centroid[blob.present]
    tc = t - t.mean()
    slope = (tc[:, None] * (points - points.mean(dim=0))).sum(dim=0) / (tc * tc).sum()
    travel = slope * (frames - 1)
    return (float(travel[0]), float(travel[1]))


def _best_shape(blob: _Blob) -> str | None:
    """The template (circle, square, triangle) with the best mean IoU over the present frames."""
    index = blob.present.nonzero().flatten()
    if index.numel() == 0:
        return None
    mask = blob.mask[index]
    count, height, width = mask.shape
    area = blob.area[index]
    centroid = blob.centroid[index]
    xs = torch.arange(width, dtype=torch.float32) + 0.5
    ys = torch.arange(height, dtype=torch.float32) + 0.5
    scores = []
    for shape in SHAPES:
        size = (area / _FILL[shape]).sqrt()
        centre = centroid.clone()
        if shape == "triangle":  # the centroid sits a sixth of the height below the box centre
            centre[:, 1] -= size / 6
        px = xs.view(1, 1, 1, width) - centre[:, None, 0, None, None]
        py = ys.view(1, 1, height, 1) - centre[:, None, 1, None, None]
        template = _signed_distance(shape, px, py, (size / 2).view(-1, 1, 1, 1))[:, 0] < 0  # (N, H, W)
        intersection = (template & mask).sum(dim=(1, 2)).float()
        union = (template | mask).sum(dim=(1, 2)).float().clamp(min=1.0)
        scores.append(float((intersection / union).mean()))
    return SHAPES[max(range(len(SHAPES)), key=lambda k: scores[k])]


def _stable(video: torch.Tensor, blobs: list[_Blob]) -> bool:
    frames, _, height, width = video.shape
    side = min(height, width)
    seen = [blob for blob in blobs if bool(blob.present.any())]
    if not seen:
        return False
    for blob in seen:
        if not bool(blob.present.all()):
            return False
        area = blob.area
        if float(area.std() / area.mean()) > MAX_AREA_CV:
            return False
        steps = (blob.centroid[1:] - blob.centroid[:-1]).norm(dim=1)
        net = float((blob.centroid[-1] - blob.centroid[0]).norm())
        if float(steps.sum()) > PATH_RATIO * net + PATH_SLACK * side * (frames - 1):
            return False
    objects = torch.stack([blob.mask for blob in seen]).any(dim=0).float()  # (F, H, W)
    grown = F.max_pool2d(objects[:, None], kernel_size=5, stride=1, padding=2)[:, 0] > 0
    keep = ~(grown[1:] | grown[:-1])  # (F-1, H, W) background in both frames
    change = (video[1:] - video[:-1]).abs().mean(dim=1)  # (F-1, H, W)
    if bool(keep.any()) and float(change[keep].mean()) > MAX_BACKGROUND_CHANGE:
        return False
    return True


def judge(video: torch.Tensor, prompt: str) -> Judgement:
    """Judge one clip (F, 3, H, W) in [0, 1] against its toy-grammar prompt.

    Raises ``ValueError`` for a malformed video and :class:`~fv_wan.toy.grammar.ToyGrammarError`
    (a ``ValueError``) for a prompt outside the grammar.
    """
    scene = parse_prompt(prompt)
    video = _check_video(video)
    frames, _, height, width = video.shape
    masks = _colour_masks(video)
    blobs = [_measure(masks[:, c]) for c in range(len(COLOURS))]
    axis_lengths = (float(width), float(height))

    found = []
    for obj in scene.objects:
        blob = blobs[COLOURS.index(obj.colour)]
        present_fraction = float(blob.present.float().mean())
        colour_ok = present_fraction >= PRESENT_FRACTION
        dx, dy = _fit_displacement(blob)
        vx, vy = DIRECTION_VECTORS[obj.direction]
        axis = 0 if vx else 1
        along_px, across_px = dx * vx + dy * vy, abs(dy if axis == 0 else dx)
        along = along_px / axis_lengths[axis]  # fraction of the motion axis
        direction_ok = colour_ok and along >= MIN_TRAVEL and along_px >= DRIFT_RATIO * across_px
        speed_ok = direction_ok and (along >= QUICK_TRAVEL) == (obj.speed == "quickly")
        detected_shape = _best_shape(blob)
        found.append(
            ObjectJudgement(
                colour_name=obj.colour,
                shape_name=obj.shape,
                direction_name=obj.direction,
                speed_name=obj.speed,
                colour=colour_ok,
                direction=direction_ok,
                speed=speed_ok,
                shape=colour_ok and detected_shape == obj.shape,
                present_fraction=present_fraction,
                displacement=(dx / width, dy / height),
                detected_shape=detected_shape,
            )
        )
    prompted = {obj.colour for obj in scene.objects}
    extra = tuple(
        colour
        for colour, blob in zip(COLOURS, blobs)
        if colour not in prompted and float(blob.present.float().mean()) >= 0.5
    )
    return Judgement(prompt=prompt, objects=tuple(found), stable=_stable(video, blobs), extra_colours=extra)


def score(videos: torch.Tensor | Sequence[torch.Tensor], prompts: Sequence[str]) -> QualityScore:
    """Judge each ``videos[i]`` (F, 3, H, W) against ``prompts[i]`` and aggregate the accuracies."""
    if len(videos) != len(prompts):
        raise ValueError(f"videos and prompts differ in length: {len(videos)} != {len(prompts)}")
    if len(prompts) == 0:
        raise ValueError("score needs at least one video")
    judgements = [judge(video, prompt) for video, prompt in zip(videos, prompts)]
    return summarise(judgements)


def summarise(judgements: Sequence[Judgement]) -> QualityScore:
    """Aggregate judgements: attribute accuracies over all prompted objects, the rest over clips."""
    objects = [obj for judgement in judgements for obj in judgement.objects]

    def share(values: list[bool]) -> float:
        return sum(values) / len(values)

    return QualityScore(
        clips=len(judgements),
        objects=len(objects),
        colour=share([obj.colour for obj in objects]),
        direction=share([obj.direction for obj in objects]),
        speed=share([obj.speed for obj in objects]),
        shape=share([obj.shape for obj in objects]),
        stability=share([j.stable for j in judgements]),
        all_correct=share([j.correct for j in judgements]),
    )
