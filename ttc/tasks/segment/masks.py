"""What batch inference writes for a segmenter (issue 43, item 6): one mask PNG per image, its
pixels the class indices, in palette mode with the PASCAL VOC colour map (a viewer shows
colours, a reader gets the indices, as VOC's own masks); a coloured overlay of the mask on the
image; and each image's share of pixels per class, for the summary table. Each file is written
atomically (utils.atomic_write)."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from utils import atomic_write

PALETTE_CLASSES = 256


@functools.cache
def voc_palette(count: int = PALETTE_CLASSES) -> np.ndarray:
    """The PASCAL VOC colour map: class k's colour from the bits of k, spread over the channels
    from the high bit down ((count, 3) uint8, read-only: built once, shared by every mask and
    overlay; class 0 black, 1 dark red, 2 dark green, ...)."""
    colours = np.zeros((count, 3), np.uint8)
    for k in range(count):
        value, red, green, blue = k, 0, 0, 0
        for shift in range(7, -1, -1):
            red |= (value & 1) << shift
            green |= ((value >> 1) & 1) << shift
            blue |= ((value >> 2) & 1) << shift
            value >>= 3
        colours[k] = red, green, blue
    colours.flags.writeable = False
    return colours


def mask_image(mask: np.ndarray):
    """A (H, W) array of class indices as a palette PNG image (Pillow)."""
    from PIL import Image

    if mask.ndim != 2 or mask.size == 0:
        raise ValueError(f"a mask is one (height, width) array of class indices, not {mask.shape}")
    if mask.min() < 0 or mask.max() >= PALETTE_CLASSES:
        raise ValueError(f"class indices must lie in [0, {PALETTE_CLASSES}): found "
                         f"{mask.min()}..{mask.max()}")
    image = Image.fromarray(mask.astype(np.uint8), mode="P")
    image.putpalette(voc_palette().ravel().tolist())
    return image


def write_mask(path: Path, mask: np.ndarray) -> Path:
    """The mask as a palette PNG at `path`, atomically."""
    image = mask_image(mask)
    return atomic_write(path, lambda tmp: image.save(tmp, format="PNG"))


def overlay(image: np.ndarray, mask: np.ndarray, alpha: float = 0.5,
            background: int | None = 0) -> np.ndarray:
    """The image ((C, H, W) in [0, 1], C = 1 or 3) with the mask's class colours blended in at
    `alpha`; pixels of the `background` class (None: none) keep the image's own colour.
    (H, W, 3) uint8."""
    if image.shape[-2:] != mask.shape:
        raise ValueError(f"the image {image.shape[-2:]} and its mask {mask.shape} differ in size")
    rgb = np.repeat(image, 3, axis=0) if image.shape[0] == 1 else image[:3]
    rgb = np.clip(rgb.transpose(1, 2, 0), 0.0, 1.0) * 255.0
    colours = voc_palette()[mask].astype(np.float64)
    shaded = (1 - alpha) * rgb + alpha * colours
    if background is not None:
        shaded[mask == background] = rgb[mask == background]
    return np.round(shaded).astype(np.uint8)


def write_overlay(path: Path, image: np.ndarray, mask: np.ndarray, alpha: float = 0.5) -> Path:
    from PIL import Image

    picture = Image.fromarray(overlay(image, mask, alpha), mode="RGB")
    return atomic_write(path, lambda tmp: picture.save(tmp, format="PNG"))


def class_shares(mask: np.ndarray, num_classes: int) -> np.ndarray:
    """Each class's share of the mask's pixels ((num_classes,) float64, summing to 1)."""
    counts = np.bincount(mask.ravel().astype(np.int64), minlength=num_classes)[:num_classes]
    return counts / max(mask.size, 1)
