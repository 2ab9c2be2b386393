"""Procedural captioned images of coloured shapes: the training data of `tiny-shapes`, made by code.

Every image is 64x64 RGB: one or two shapes (circle, square, triangle, star) in one of five
saturated colours, of varied sizes and positions, on a low-saturation background (a tinted grey
with a linear gradient, dark to light). Captions come from a small grammar:

    a red circle
    a red circle above a blue square            (also: below, to the left of, to the right of)

Sample `i` of a dataset is drawn from its own generator seeded with `(seed, i)`, so the data is a
pure function of the seed and the index: no download, no files, the same bytes in any order, any
batch size and any process. Shapes are drawn at 4x resolution with PIL and box-filtered down, so
edges are anti-aliased.

Two-object scenes are split once and for all (independent of the seed) into training scenes and
held-out scenes. A scene is the unordered arrangement, e.g. "red circle over blue square", so both
of its phrasings ("... above ..." and "... below ...") are on the same side: the held-out captions
describe arrangements the model never saw, built from colours and shapes it did see.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from . import SIZE

__all__ = [
    "COLOURS", "SHAPES", "RELATIONS", "SIZE", "VOCABULARY", "ShapeObject", "Scene", "ShapesDataset",
    "caption_scene", "heldout_captions", "is_heldout", "render", "sample_scene", "training_captions",
]

SUPERSAMPLE = 4

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "yellow": (235, 205, 30),
    "green": (40, 170, 60),
    "blue": (40, 80, 225),
    "purple": (160, 50, 200),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star")
RELATIONS: dict[str, tuple[str, bool]] = {
    # phrase -> (axis, first object is the upper / left one)
    "above": ("vertical", True),
    "below": ("vertical", False),
    "to the left of": ("horizontal", True),
    "to the right of": ("horizontal", False),
}
VOCABULARY: tuple[str, ...] = tuple(
    dict.fromkeys(["a", *COLOURS, *SHAPES, *" ".join(RELATIONS).split()])
)
"""Every word the grammar uses, in a fixed order."""

TWO_OBJECT_SHARE = 0.7
HELDOUT_MODULUS = 10  # one scene in ten is held out


@dataclass(frozen=True)
class ShapeObject:
    colour: str
    shape: str
    cx: float = 0.0
    cy: float = 0.0
    radius: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"


@dataclass(frozen=True)
class Scene:
    objects: tuple[ShapeObject, ...]
    relation: str | None = None
    """For two objects: the phrase between them (a key of RELATIONS)."""

    @property
    def caption(self) -> str:
        return caption_scene(self)


def caption_scene(scene: Scene) -> str:
    words = [f"a {obj.name}" for obj in scene.objects]
    return words[0] if scene.relation is None else f"{words[0]} {scene.relation} {words[1]}"


def _scene_key(first: str, second: str, relation: str) -> str:
    """The arrangement, whichever way it is phrased: 'upper|lower|vertical' or 'left|right|horizontal'."""
    axis, first_leads = RELATIONS[relation]
    lead, other = (first, second) if first_leads else (second, first)
    return f"{lead}|{other}|{axis}"


def is_heldout(first: str, second: str, relation: str) -> bool:
    """Whether the arrangement of objects `first` and `second` (e.g. 'red circle') is held out."""
    return zlib.crc32(_scene_key(first, second, relation).encode()) % HELDOUT_MODULUS == 0


def _object_names() -> list[str]:
    return [f"{c} {s}" for c in COLOURS for s in SHAPES]


def _two_object_captions(heldout: bool) -> list[str]:
    captions = []
    for first in _object_names():
        for second in _object_names():
            if first.split()[0] == second.split()[0]:
                continue  # two objects always differ in colour
            for relation in RELATIONS:
                if is_heldout(first, second, relation) == heldout:
                    captions.append(f"a {first} {relation} a {second}")
    return captions


def heldout_captions() -> list[str]:
    """Every two-object caption whose arrangement is never shown in training, in a fixed order."""
    return _two_object_captions(heldout=True)


def training_captions() -> list[str]:
    """Every caption training can show: all single objects and the non-held-out two-object scenes."""
    return [f"a {name}" for name in _object_names()] + _two_object_captions(heldout=False)


def _parse(caption: str) -> tuple[list[tuple[str, str]], str | None]:
    words = caption.split()
    if len(words) == 3:
        return [(words[1], words[2])], None
    relation = " ".join(words[3:-3])
    return [(words[1], words[2]), (words[-2], words[-1])], relation


def sample_scene(rng: np.random.Generator, caption: str | None = None) -> Scene:
    """A random scene; with `caption`, a random layout of that caption's objects and relation."""
    if caption is None:
        if rng.random() >= TWO_OBJECT_SHARE:
            caption = f"a {rng.choice(_object_names())}"
        else:
            caption = _TRAINING_TWO[int(rng.integers(len(_TRAINING_TWO)))]
    names, relation = _parse(caption)
    if relation is None:
        radius = rng.uniform(9.0, 16.0)
        cx, cy = rng.uniform(radius + 2, SIZE - radius - 2, size=2)
        return Scene((ShapeObject(*names[0], cx=cx, cy=cy, radius=radius),))
    axis, first_leads = RELATIONS[relation]
    radii = rng.uniform(7.0, 12.0, size=2)
    # along the axis: the leading object in the first half, the other in the second half;
    # across it: within 14 px of each other, so the relation reads clearly.
    along = [rng.uniform(r + 2, SIZE / 2 - 1 - r) for r in radii]
    along = [along[0], SIZE - along[1]] if first_leads else [SIZE - along[0], along[1]]
    centre = rng.uniform(max(radii) + 2, SIZE - max(radii) - 2)
    across = [np.clip(centre + rng.uniform(-7, 7), r + 2, SIZE - r - 2) for r in radii]
    objects = []
    for (colour, shape), r, a, c in zip(names, radii, along, across):
        cx, cy = (c, a) if axis == "vertical" else (a, c)
        objects.append(ShapeObject(colour, shape, cx=float(cx), cy=float(cy), radius=float(r)))
    return Scene(tuple(objects), relation)


def _polygon(obj: ShapeObject, scale: float) -> list[tuple[float, float]] | None:
    cx, cy, r = obj.cx * scale, obj.cy * scale, obj.radius * scale
    if obj.shape == "square":
        s = 0.85 * r
        return [(cx - s, cy - s), (cx + s, cy - s), (cx + s, cy + s), (cx - s, cy + s)]
    if obj.shape == "triangle":  # pointing up, centred on its bounding box
        return [(cx, cy - r), (cx + 1.05 * r, cy + 0.85 * r), (cx - 1.05 * r, cy + 0.85 * r)]
    if obj.shape == "star":  # five points, pointing up
        angles = -np.pi / 2 + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, 1.2 * r, 0.5 * r)
        dy = 0.1 * r  # centre the star's bounding box on (cx, cy)
        return [(cx + q * np.cos(a), cy + dy + q * np.sin(a)) for q, a in zip(radii, angles)]
    return None


def _coverage(obj: ShapeObject, supersample: int = SUPERSAMPLE) -> np.ndarray:
    """(SIZE, SIZE) float coverage of one shape in [0, 1], anti-aliased by supersampling."""
    big = SIZE * supersample
    canvas = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(canvas)
    polygon = _polygon(obj, supersample)
    if polygon is None:  # circle
        cx, cy, r = obj.cx * supersample, obj.cy * supersample, obj.radius * supersample
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
    else:
        draw.polygon(polygon, fill=255)
    small = canvas.resize((SIZE, SIZE), Image.Resampling.BOX)
    return np.asarray(small, dtype=np.float32) / 255.0


def _background(rng: np.random.Generator) -> np.ndarray:
    """A tinted grey with a linear gradient: low saturation, any brightness."""
    level = rng.uniform(35, 215)
    tint = rng.uniform(-12, 12, size=3)
    angle = rng.uniform(0, 2 * np.pi)
    amount = rng.uniform(0, 30)
    grid = (np.arange(SIZE, dtype=np.float32) - (SIZE - 1) / 2) / SIZE
    ramp = np.cos(angle) * grid[None, :] + np.sin(angle) * grid[:, None]
    return (level + tint[None, None, :] + amount * ramp[..., None]).astype(np.float32)


def render(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    """The scene as a (SIZE, SIZE, 3) uint8 image on a random background from `rng`."""
    image = _background(rng)
    for obj in scene.objects:
        colour = np.asarray(COLOURS[obj.colour], dtype=np.float32) + rng.uniform(-12, 12, size=3)
        alpha = _coverage(obj)[..., None]
        image = image * (1 - alpha) + colour * alpha
    return np.clip(np.round(image), 0, 255).astype(np.uint8)


_TRAINING_TWO = _two_object_captions(heldout=False)
_HELDOUT = _two_object_captions(heldout=True)


class ShapesDataset:
    """Sample `i` is a pure function of (seed, i): `(image uint8 (SIZE, SIZE, 3), caption)`.

    split "train" draws single objects and training scenes; "heldout" draws two-object scenes
    whose arrangement training never shows.
    """

    def __init__(self, seed: int = 0, split: str = "train") -> None:
        if split not in ("train", "heldout"):
            raise ValueError(f"split {split!r} is not 'train' or 'heldout'")
        self.seed = seed
        self.split = split

    def rng(self, index: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64([self.seed, index, self.split == "heldout"]))

    def sample(self, index: int) -> tuple[Scene, np.ndarray]:
        """Sample `index`: its scene (objects, positions, caption) and its image."""
        rng = self.rng(index)
        caption = _HELDOUT[int(rng.integers(len(_HELDOUT)))] if self.split == "heldout" else None
        scene = sample_scene(rng, caption=caption)
        return scene, render(scene, rng)

    def __getitem__(self, index: int) -> tuple[np.ndarray, str]:
        scene, image = self.sample(index)
        return image, scene.caption

    def batch(self, start: int, size: int) -> tuple[np.ndarray, list[str]]:
        """Samples start .. start + size - 1 as (size, SIZE, SIZE, 3) uint8 and their captions."""
        images, captions = zip(*(self[i] for i in range(start, start + size)))
        return np.stack(images), list(captions)
