"""A detector's overlays (inference.py --input with --overlay true; issue 64, item 7): each box in
its class's colour (PALETTE, by class index), its label and score in black or white (whichever
contrasts) on a filled box of that colour. A label sits above its box, inside the box where the
box touches the image's top edge, moved left where it would pass the right edge, and moved below
a label already placed where the two would overlap: every label lies inside the image, none on
another where the image has room. Boxes are drawn first, then the labels: placed in the graph's
order (best score first), drawn in reverse, so that on an image too small for all of them the
best one stays on top. Pillow only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

# Tableau 10, a qualitative palette: class k gets PALETTE[k % 10]
PALETTE: tuple[tuple[int, int, int], ...] = (
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207))
UNKNOWN_COLOUR = (255, 255, 255)  # a class index outside the labels (never from a checked graph)
DARK_TEXT, LIGHT_TEXT = (0, 0, 0), (255, 255, 255)
LIGHT_BACKGROUND = 150  # a background's luma (ITU-R 601) above this takes dark text
LINE_PER_PIXELS = 400  # box lines: 1 pixel wide per 400 of the image's longer side
FONT_PER_PIXELS = 40  # label text: 1 pixel high per 40 of the longer side, at least MIN_FONT
MIN_FONT = 10
PADDING = 2  # pixels between a label's text and the edge of its background


@dataclass(frozen=True)
class Rect:
    """A label's background in the image's pixels: left, top, and right, bottom (exclusive)."""

    left: int
    top: int
    right: int
    bottom: int

    def overlaps(self, other: Rect) -> bool:
        return (self.left < other.right and other.left < self.right
                and self.top < other.bottom and other.top < self.bottom)

    def moved_to(self, left: int, top: int) -> Rect:
        return Rect(left, top, left + self.right - self.left, top + self.bottom - self.top)


def class_colour(index: int, classes: int | None = None) -> tuple[int, int, int]:
    """Class `index`'s colour (PALETTE, cycled); UNKNOWN_COLOUR outside 0..classes-1."""
    if index < 0 or (classes is not None and index >= classes):
        return UNKNOWN_COLOUR
    return PALETTE[index % len(PALETTE)]


def text_colour(background: Sequence[int]) -> tuple[int, int, int]:
    """Black on a light background, white on a dark one."""
    red, green, blue = background[:3]
    luma = 0.299 * red + 0.587 * green + 0.114 * blue
    return DARK_TEXT if luma > LIGHT_BACKGROUND else LIGHT_TEXT


def label_font(size: tuple[int, int]):
    """Pillow's own font (no file needed) at a height that follows the image's longer side."""
    from PIL import ImageFont

    return ImageFont.load_default(max(MIN_FONT, round(max(size) / FONT_PER_PIXELS)))


def label_text(labels: Sequence[str], index: int, score: float | None) -> str:
    name = str(labels[index]) if 0 <= index < len(labels) else "?"
    return name if score is None else f"{name} {score:.2f}"


def label_place(box: Sequence[float], extent: tuple[int, int], size: tuple[int, int],
                taken: Sequence[Rect]) -> Rect:
    """Where a label of `extent` (width, height, its padding included) goes for `box` (xyxy) in
    an image of `size` (width, height): above the box, else just inside its top edge; moved
    left to end inside the image; below any label in `taken` it would overlap (above it where
    there is no room below); clamped inside the image."""
    width, height = size
    label_width, label_height = extent
    left = min(max(0, int(round(box[0]))), max(0, width - label_width))
    top = int(round(box[1])) - label_height
    if top < 0:  # the box touches the top edge: the label goes inside it
        top = max(0, int(round(box[1])))
    place = Rect(0, 0, label_width, label_height).moved_to(left, _clamped(top, label_height,
                                                                          height))
    for _ in range(len(taken)):
        hit = next((rect for rect in taken if rect.overlaps(place)), None)
        if hit is None:
            break
        below = hit.bottom if hit.bottom + label_height <= height else hit.top - label_height
        place = place.moved_to(place.left, _clamped(below, label_height, height))
    return place


def _clamped(top: int, label_height: int, height: int) -> int:
    return min(max(0, top), max(0, height - label_height))


def draw_overlay(picture, boxes: np.ndarray, classes: Sequence[int], labels: Sequence[str],
                 scores: np.ndarray | None = None):
    """`picture` (an RGB Pillow image) with the boxes (xyxy, its pixels) drawn in place in
    their classes' colours, each labelled by its class (and score); returned."""
    from PIL import ImageDraw

    pen = ImageDraw.Draw(picture)
    pen.fontmode = "1"  # crisp text: no anti-aliased fringe on the small labels
    boxes = np.asarray(boxes, np.float64).reshape(-1, 4)
    line = max(1, round(max(picture.size) / LINE_PER_PIXELS))
    colours = [class_colour(int(c), len(labels)) for c in classes]
    for (x1, y1, x2, y2), colour in zip(boxes, colours):
        pen.rectangle([x1, y1, max(x1, x2 - 1), max(y1, y2 - 1)], outline=colour, width=line)
    font = label_font(picture.size)
    texts = [label_text(labels, int(c), None if scores is None else float(scores[k]))
             for k, c in enumerate(classes)]
    corners = [pen.textbbox((0, 0), text, font=font) for text in texts]
    taken: list[Rect] = []
    for box, (left, top, right, bottom) in zip(boxes, corners):
        extent = (right - left + 2 * PADDING, bottom - top + 2 * PADDING)
        taken.append(label_place(box, extent, picture.size, taken))
    for place, text, (left, top, _, _), colour in reversed(list(zip(taken, texts, corners,
                                                                   colours))):
        pen.rectangle([place.left, place.top, place.right - 1, place.bottom - 1], fill=colour)
        pen.text((place.left + PADDING - left, place.top + PADDING - top), text,
                 fill=text_colour(colour), font=font)
    return picture
