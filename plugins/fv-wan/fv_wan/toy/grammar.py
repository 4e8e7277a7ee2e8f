"""The toy world's prompt grammar: words, scenes, parsing, sampling and the held-out split.

A prompt describes one or two objects and a background::

    a red circle moves left slowly on a black background
    a red circle moves left quickly and a green square moves up slowly on a dark gradient background

Every object names a colour, a shape, a direction and a speed. The two objects of a
scene have different colours (the judge finds each object by its colour), and no object
has a colour close to any colour of its background (:func:`colour_fits_background`).
Sampled scenes list their objects in ``COLOURS`` order, so each set of objects has one
prompt; :func:`parse_prompt` accepts either order.

The prompt space is split by a stable hash of the prompt text: about 10% of prompts are
held out (:func:`is_held_out`); ``sample_scene(held_out=False)`` never yields one, and
``sample_scene(held_out=True)`` yields only those.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the sampler takes a torch.Generator; parsing needs no torch
    import torch

RGB = tuple[float, float, float]

# Object colours sit on corners of the RGB cube: every pair is at least 1.0 apart, so a
# half-and-half blend of two of them (an anti-aliased edge) is 0.5 from both and the
# judge's 0.4 colour radius never assigns it to a third colour.
COLOUR_RGB: dict[str, RGB] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "cyan": (0.0, 1.0, 1.0),
    "magenta": (1.0, 0.0, 1.0),
    "white": (1.0, 1.0, 1.0),
}
COLOURS: tuple[str, ...] = tuple(COLOUR_RGB)

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
SPEEDS: tuple[str, ...] = ("slowly", "quickly")

# Unit motion per direction in image coordinates (x right, y down).
DIRECTION_VECTORS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


@dataclass(frozen=True)
class BackgroundSpec:
    """A background: a plain colour (``top == bottom``) or a vertical gradient from ``top`` to ``bottom``."""

    top: RGB
    bottom: RGB

    @property
    def is_gradient(self) -> bool:
        return self.top != self.bottom


BACKGROUND_SPECS: dict[str, BackgroundSpec] = {
    "black": BackgroundSpec((0.0, 0.0, 0.0), (0.0, 0.0, 0.0)),
    "grey": BackgroundSpec((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "white": BackgroundSpec((1.0, 1.0, 1.0), (1.0, 1.0, 1.0)),
    "navy": BackgroundSpec((0.05, 0.05, 0.3), (0.05, 0.05, 0.3)),
    "dark gradient": BackgroundSpec((0.0, 0.0, 0.0), (0.05, 0.05, 0.3)),
    "light gradient": BackgroundSpec((1.0, 1.0, 1.0), (0.5, 0.5, 0.5)),
}
BACKGROUNDS: tuple[str, ...] = tuple(BACKGROUND_SPECS)

# The closest an object colour may come to any colour of its background (RGB distance).
MIN_BACKGROUND_DISTANCE = 0.6

# Fraction of the prompt space held out from training.
HELD_OUT_PERCENT = 10

_FUNCTION_WORDS: tuple[str, ...] = ("a", "moves", "and", "on", "background")


def _vocabulary() -> tuple[str, ...]:
    words: list[str] = []
    for group in (_FUNCTION_WORDS, COLOURS, SHAPES, DIRECTIONS, SPEEDS, *(name.split() for name in BACKGROUNDS)):
        for word in group:
            if word not in words:
                words.append(word)
    return tuple(words)


# Every word any prompt can contain, in a fixed order (for a word-level tokenizer).
VOCABULARY: tuple[str, ...] = _vocabulary()


class ToyGrammarError(ValueError):
    """A prompt or scene outside the toy grammar.

    ``field`` names the slot (``colour``, ``shape``, ``direction``, ``speed``,
    ``background``, ``word``, ``objects``), ``word`` the offending word (or ``None``)
    and ``allowed`` the words or values that would have been accepted.
    """

    def __init__(self, message: str, *, field: str, word: str | None, allowed: tuple[str, ...]) -> None:
        super().__init__(message)
        self.field = field
        self.word = word
        self.allowed = allowed


def _distance(a: RGB, b: RGB) -> float:
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))


def colour_fits_background(colour: str, background: str) -> bool:
    """Whether an object of ``colour`` stays clearly distinguishable everywhere on ``background``.

    A vertical gradient is linear in RGB, so its closest point to a colour is found on the
    segment from ``top`` to ``bottom``.
    """
    rgb = COLOUR_RGB[colour]
    spec = BACKGROUND_SPECS[background]
    top, bottom = spec.top, spec.bottom
    span = [b - t for t, b in zip(top, bottom)]
    length2 = sum(s * s for s in span)
    t = 0.0 if length2 == 0 else max(0.0, min(1.0, sum((c - a) * s for c, a, s in zip(rgb, top, span)) / length2))
    closest = tuple(a + t * s for a, s in zip(top, span))
    return _distance(rgb, closest) >= MIN_BACKGROUND_DISTANCE  # type: ignore[arg-type]


# Per background, the object colours allowed on it (computed once: sampling reads it per scene).
COLOURS_ON: dict[str, tuple[str, ...]] = {
    background: tuple(c for c in COLOURS if colour_fits_background(c, background)) for background in BACKGROUNDS
}


def _check_word(field: str, word: str, allowed: tuple[str, ...]) -> None:
    if word not in allowed:
        raise ToyGrammarError(
            f"unknown {field} {word!r}; allowed: {', '.join(allowed)}", field=field, word=word, allowed=allowed
        )


@dataclass(frozen=True)
class ToyObject:
    """One moving object: ``a <colour> <shape> moves <direction> <speed>``."""

    colour: str
    shape: str
    direction: str
    speed: str

    def __post_init__(self) -> None:
        _check_word("colour", self.colour, COLOURS)
        _check_word("shape", self.shape, SHAPES)
        _check_word("direction", self.direction, DIRECTIONS)
        _check_word("speed", self.speed, SPEEDS)

    def phrase(self) -> str:
        return f"a {self.colour} {self.shape} moves {self.direction} {self.speed}"


@dataclass(frozen=True)
class Scene:
    """One or two objects (of different colours) on a background."""

    objects: tuple[ToyObject, ...]
    background: str

    def __post_init__(self) -> None:
        if not isinstance(self.objects, tuple) or not 1 <= len(self.objects) <= 2:
            raise ToyGrammarError(
                f"a scene has 1 or 2 objects (a tuple), got {self.objects!r}", field="objects", word=None, allowed=("1", "2")
            )
        _check_word("background", self.background, BACKGROUNDS)
        colours = [obj.colour for obj in self.objects]
        if len(set(colours)) != len(colours):
            raise ToyGrammarError(
                f"the objects of a scene have different colours, got {colours[0]!r} twice",
                field="colour",
                word=colours[0],
                allowed=tuple(c for c in COLOURS if c != colours[0]),
            )
        for obj in self.objects:
            allowed = COLOURS_ON[self.background]
            if obj.colour not in allowed:
                raise ToyGrammarError(
                    f"a {obj.colour} object is too close in colour to the {self.background} background; "
                    f"colours allowed on it: {', '.join(allowed)}",
                    field="colour",
                    word=obj.colour,
                    allowed=allowed,
                )

    def prompt(self) -> str:
        return f"{' and '.join(obj.phrase() for obj in self.objects)} on a {self.background} background"


def parse_prompt(text: str) -> Scene:
    """Parse a prompt of the toy grammar into a :class:`Scene` (case and extra spaces are ignored).

    Raises :class:`ToyGrammarError` (a ``ValueError``) naming the first word that does not
    fit and the words allowed in its place.
    """
    words = text.lower().replace(".", " ").split()
    position = 0

    def expect(field: str, allowed: tuple[str, ...]) -> str:
        nonlocal position
        if position >= len(words):
            raise ToyGrammarError(
                f"prompt {text!r} ends where a {field} was expected; allowed: {', '.join(allowed)}",
                field=field,
                word=None,
                allowed=allowed,
            )
        word = words[position]
        if word not in allowed:
            raise ToyGrammarError(
                f"unknown {field} {word!r} at word {position + 1} of {text!r}; allowed: {', '.join(allowed)}",
                field=field,
                word=word,
                allowed=allowed,
            )
        position += 1
        return word

    objects: list[ToyObject] = []
    while True:
        expect("word", ("a",))
        colour = expect("colour", COLOURS)
        shape = expect("shape", SHAPES)
        expect("word", ("moves",))
        direction = expect("direction", DIRECTIONS)
        speed = expect("speed", SPEEDS)
        objects.append(ToyObject(colour, shape, direction, speed))
        if len(objects) == 2:
            expect("word", ("on",))
            break
        if expect("word", ("and", "on")) == "on":
            break
    expect("word", ("a",))
    background_words = words[position:-1] if words and words[-1] == "background" else words[position:]
    background = " ".join(background_words)
    if background not in BACKGROUNDS:
        raise ToyGrammarError(
            f"unknown background {background!r} in {text!r}; allowed: {', '.join(BACKGROUNDS)}",
            field="background",
            word=background,
            allowed=BACKGROUNDS,
        )
    if not words or words[-1] != "background":
        raise ToyGrammarError(
            f"prompt {text!r} must end with the word 'background'", field="word", word=None, allowed=("background",)
        )
    return Scene(tuple(objects), background)


def is_held_out(prompt: str) -> bool:
    """Whether a prompt belongs to the held-out split (a stable hash of its text, ~10%)."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELD_OUT_PERCENT


_DRAW_RANGE = 1 << 30


def sample_scene(generator: torch.Generator, *, held_out: bool = False) -> Scene:
    """A random scene (one or two objects, equally likely) from the train or held-out split.

    Deterministic given the generator's state. Scenes are drawn uniformly per slot and
    redrawn until their prompt falls in the requested split.
    """
    import torch

    while True:
        draws = torch.randint(0, _DRAW_RANGE, (10,), generator=generator).tolist()
        background = BACKGROUNDS[draws[0] % len(BACKGROUNDS)]
        count = 1 + draws[1] % 2
        colours = list(COLOURS_ON[background])
        objects: list[ToyObject] = []
        for index in range(count):
            base = 2 + 4 * index
            colour = colours.pop(draws[base] % len(colours))
            objects.append(
                ToyObject(
                    colour,
                    SHAPES[draws[base + 1] % len(SHAPES)],
                    DIRECTIONS[draws[base + 2] % len(DIRECTIONS)],
                    SPEEDS[draws[base + 3] % len(SPEEDS)],
                )
            )
        objects.sort(key=lambda obj: COLOURS.index(obj.colour))
        scene = Scene(tuple(objects), background)
        if is_held_out(scene.prompt()) == held_out:
            return scene


def held_out_prompts(n: int = 100, seed: int = 0) -> list[str]:
    """``n`` distinct held-out prompts, deterministic by ``seed`` (the quality benchmark's set)."""
    import torch

    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    generator = torch.Generator().manual_seed(seed)
    prompts: list[str] = []
    seen: set[str] = set()
    while len(prompts) < n:
        prompt = sample_scene(generator, held_out=True).prompt()
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    return prompts
