"""An automatic checker: does an image show the coloured shapes (and the relation) its caption asks for?

A plain, inspectable detector rather than a learned one, so that its verdicts on generated images
cannot share a learned model's blind spots:

1. Colour: a pixel belongs to a shape when its chroma (max - min of R, G, B) is high; the
   backgrounds of the data are low-chroma greys at any brightness. Each such pixel takes the
   palette colour of nearest hue.
2. Objects: 4-connected components of each colour, at least `MIN_AREA` pixels.
3. Shape: the ideal circle, square, triangle and star (drawn by the data's own renderer) are each
   stretched to the object's bounding box; the one with the highest intersection over union with
   the object's pixels wins. Comparing whole silhouettes, rather than thresholds on a few
   measures, keeps a slightly soft or lopsided shape recognisable.
4. Relation: the larger displacement between the two objects' centroids (vertical or horizontal)
   and its sign.

`check(image, caption)` reports whether each requested colour+shape was found (and, separately,
each requested colour in any shape) and whether the relation holds; `summarize` turns many of
those into rates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from PIL import Image

from . import SIZE
from .data import COLOURS, RELATIONS, SHAPES, ShapeObject, _coverage

__all__ = ["Detection", "Verdict", "check", "classify_shape", "components", "detect", "shape_scores", "summarize"]

MIN_AREA = 12
"""Pixels: smaller specks of colour (e.g. blur at an edge) are not objects."""
MIN_CHROMA = 0.28
"""Max - min of RGB in [0, 1]: the palette has >= 0.6, the backgrounds <= ~0.15."""


def _hue(rgb: np.ndarray) -> np.ndarray:
    """Hue in degrees [0, 360) of (..., 3) float RGB."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    return np.degrees(np.arctan2(np.sqrt(3.0) * (g - b), 2 * r - g - b)) % 360.0


_PALETTE_HUES = {name: float(_hue(np.asarray(rgb, dtype=np.float64) / 255.0)) for name, rgb in COLOURS.items()}


@dataclass(frozen=True)
class Detection:
    colour: str
    shape: str
    area: int
    cx: float
    cy: float


@dataclass
class Verdict:
    caption: str
    wanted: list[str]
    found: list[bool]
    """Per requested object: an object of that colour and shape is there."""
    relation_ok: bool | None
    colour_found: list[bool] = field(default_factory=list)
    """Per requested object: an object of that colour (any shape) is there."""
    detections: list[Detection] = field(default_factory=list)

    @property
    def all_found(self) -> bool:
        return all(self.found)


def components(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """4-connected components of a boolean mask: (labels, count); label 0 is background."""
    height, width = mask.shape
    labels = np.where(mask, np.arange(1, mask.size + 1).reshape(mask.shape), 0)
    big = mask.size + 1
    while True:  # every pixel takes the smallest label among itself and its masked neighbours
        padded = np.pad(np.where(mask, labels, big), 1, constant_values=big)
        smallest = np.minimum.reduce([
            padded[1:-1, 1:-1], padded[:-2, 1:-1], padded[2:, 1:-1], padded[1:-1, :-2], padded[1:-1, 2:],
        ])
        updated = np.where(mask, smallest, 0)
        # jump: follow labels to their own labels (pointer jumping) to converge in few rounds
        flat = np.concatenate([[0], updated.ravel()])
        updated = np.where(mask, flat[updated], 0)
        if np.array_equal(updated, labels):
            break
        labels = updated
    unique, relabelled = np.unique(labels, return_inverse=True)
    return relabelled.reshape(height, width), len(unique) - (1 if unique[0] == 0 else 0)


@lru_cache(maxsize=None)
def _template(shape: str) -> Image.Image:
    """The ideal shape, drawn large by the data's own renderer and cropped to its bounding box."""
    coverage = _coverage(ShapeObject("red", shape, cx=SIZE / 2, cy=SIZE / 2, radius=SIZE / 3), supersample=8)
    ys, xs = np.nonzero(coverage >= 0.5)
    crop = coverage[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    return Image.fromarray((crop * 255).astype(np.uint8))


def shape_scores(mask: np.ndarray) -> dict[str, float]:
    """Intersection over union of an object's pixels with each ideal shape stretched to its bounding box."""
    ys, xs = np.nonzero(mask)
    box = mask[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    height, width = box.shape
    scores = {}
    for shape in SHAPES:
        ideal = np.asarray(_template(shape).resize((width, height), Image.Resampling.BILINEAR)) >= 128
        scores[shape] = float((ideal & box).sum() / max((ideal | box).sum(), 1))
    return scores


def classify_shape(mask: np.ndarray) -> str:
    """circle, square, triangle or star for the pixels of one object (a boolean mask): the best fit."""
    scores = shape_scores(mask)
    return max(scores, key=scores.__getitem__)


def detect(image: np.ndarray) -> list[Detection]:
    """Coloured objects in an (H, W, 3) image (uint8, or float in [0, 1])."""
    rgb = image.astype(np.float64) / 255.0 if image.dtype == np.uint8 else image.astype(np.float64)
    chroma = rgb.max(-1) - rgb.min(-1)
    coloured = chroma >= MIN_CHROMA
    names = list(_PALETTE_HUES)
    hues = np.asarray([_PALETTE_HUES[n] for n in names])
    distance = np.abs((_hue(rgb)[..., None] - hues + 180.0) % 360.0 - 180.0)
    nearest = distance.argmin(-1)
    found = []
    for index, colour in enumerate(names):
        labels, count = components(coloured & (nearest == index))
        for label in range(1, count + 1):
            mask = labels == label
            area = int(mask.sum())
            if area < MIN_AREA:
                continue
            ys, xs = np.nonzero(mask)
            found.append(Detection(colour, classify_shape(mask), area, float(xs.mean()), float(ys.mean())))
    return sorted(found, key=lambda d: -d.area)


def _parse(caption: str) -> tuple[list[tuple[str, str]], str | None]:
    words = caption.lower().split()
    if len(words) == 3:
        return [(words[1], words[2])], None
    return [(words[1], words[2]), (words[-2], words[-1])], " ".join(words[3:-3])


def check(image: np.ndarray, caption: str) -> Verdict:
    """Whether `image` shows each colour+shape of `caption` (a grammar caption) and their relation."""
    wanted, relation = _parse(caption)
    detections = detect(image)
    matches = [[d for d in detections if (d.colour, d.shape) == pair] for pair in wanted]
    found = [bool(m) for m in matches]
    relation_ok = None
    if relation is not None:
        relation_ok = False
        if all(found):
            first, second = matches[0][0], matches[1][0]  # the largest of each
            axis, first_leads = RELATIONS[relation]
            dx, dy = second.cx - first.cx, second.cy - first.cy
            along, across = (dy, dx) if axis == "vertical" else (dx, dy)
            relation_ok = abs(along) > abs(across) and (along > 0) == first_leads
    colours = {d.colour for d in detections}
    return Verdict(caption, [" ".join(p) for p in wanted], found, relation_ok, [c in colours for c, _ in wanted], detections)


def summarize(verdicts: list[Verdict]) -> dict[str, float | int]:
    """Rates over many verdicts: objects found, captions fully found, relations right, colours found."""
    objects = [f for v in verdicts for f in v.found]
    colours = [f for v in verdicts for f in v.colour_found]
    relations = [v.relation_ok for v in verdicts if v.relation_ok is not None]
    return {
        "samples": len(verdicts),
        "all_objects_found": sum(v.all_found for v in verdicts),
        "all_objects_found_rate": sum(v.all_found for v in verdicts) / max(len(verdicts), 1),
        "objects": len(objects),
        "objects_found": sum(objects),
        "objects_found_rate": sum(objects) / max(len(objects), 1),
        "relations": len(relations),
        "relations_ok": sum(relations),
        "relation_rate": sum(relations) / max(len(relations), 1),
        "colours_found": sum(colours),
        "colours_found_rate": sum(colours) / max(len(colours), 1),
    }
