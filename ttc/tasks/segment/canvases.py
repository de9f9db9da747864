"""A segmentation data set no one needs to download: canvases of scikit-learn's 1,797 8x8
digits (sklearn.datasets.load_digits), 2 to 4 per canvas at random positions and scales, each
mask holding the digit's class (digit + 1) on its stroke pixels and 0 (background) elsewhere;
where digits overlap, the later one wins. The same seed writes the same bytes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

CLASS_NAMES = ("background", *(str(d) for d in range(10)))  # mask index: digit + 1
STROKE_THRESHOLD = 0.5  # a digit's pixel (in [0, 1]) above this is stroke
DIGITS_PER_CANVAS = (2, 4)
SCALE_OF_64 = (12, 28)  # a digit's side, in pixels, on a 64-pixel canvas


# --dataset_path builtin:digit_canvases: canvases made in memory (the bench's are larger:
# bench/segment.py writes 2,000 of 64 pixels)
BUILTIN = "builtin:digit_canvases"
BUILTIN_COUNT, BUILTIN_SIZE, BUILTIN_SEED = 1000, 32, 0


def digit_canvases(count: int, size: int = 64, seed: int = 0
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`count` canvases of size x size, one at a time: (uint8 pixels, uint8 class indices)."""
    digits, targets = _digits()
    rng = np.random.default_rng(seed)
    sides = digit_sides(size)
    for _ in range(count):
        yield draw_canvas(digits, targets, rng, size, sides)


def canvas_arrays(count: int, size: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The canvases write_digit_canvases writes, as arrays: (count, size, size) uint8 pixels
    and class indices."""
    pairs = list(digit_canvases(count, size, seed))
    return np.stack([p for p, _ in pairs]), np.stack([m for _, m in pairs])


def write_digit_canvases(root: Path, count: int, size: int = 64, seed: int = 0) -> Path:
    """`count` canvases of size x size: root/images/NNNNN.png (8-bit gray),
    root/masks/NNNNN.png (8-bit class indices) and root/classes.txt (background, 0..9).
    Returns `root`."""
    from PIL import Image

    root = Path(root)
    for sub in ("images", "masks"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for index, (image, mask) in enumerate(digit_canvases(count, size, seed)):
        name = f"{index:05d}.png"
        Image.fromarray(image).save(root / "images" / name, format="PNG")
        Image.fromarray(mask).save(root / "masks" / name, format="PNG")
    (root / "classes.txt").write_text("\n".join(CLASS_NAMES) + "\n", encoding="utf-8")
    return root


def digit_sides(size: int) -> tuple[int, int]:
    """The smallest and largest side a digit takes on a canvas of `size` (12-28 px at 64)."""
    low = min(size, max(4, round(size * SCALE_OF_64[0] / 64)))
    high = min(size, max(low, round(size * SCALE_OF_64[1] / 64)))
    return low, high


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as float32 (1797, 8, 8) in [0, 1], and their digits."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.images / 16.0).astype(np.float32), bunch.target.astype(np.int64)


def draw_canvas(digits: np.ndarray, targets: np.ndarray, rng: np.random.Generator, size: int,
                sides: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """One canvas: (size, size) uint8 pixels and uint8 class indices. A later digit's stroke
    covers what lies under it (pixels and mask); its faint edge only brightens the pixels."""
    canvas = np.zeros((size, size), dtype=np.float32)
    mask = np.zeros((size, size), dtype=np.uint8)
    for _ in range(int(rng.integers(DIGITS_PER_CANVAS[0], DIGITS_PER_CANVAS[1] + 1))):
        pick = int(rng.integers(len(digits)))
        side = int(rng.integers(sides[0], sides[1] + 1))
        top, left = (int(v) for v in rng.integers(0, size - side + 1, size=2))
        glyph = _scaled(digits[pick], side)
        stroke = glyph > STROKE_THRESHOLD
        region = canvas[top:top + side, left:left + side]
        np.maximum(region, glyph, out=region)
        region[stroke] = glyph[stroke]
        mask[top:top + side, left:left + side][stroke] = targets[pick] + 1
    return np.round(canvas * 255).astype(np.uint8), mask


def _scaled(digit: np.ndarray, side: int) -> np.ndarray:
    """An 8x8 digit resized bilinearly to side x side, in [0, 1]."""
    from PIL import Image

    img = Image.fromarray(digit).resize((side, side), Image.Resampling.BILINEAR)
    return np.clip(np.asarray(img, dtype=np.float32), 0.0, 1.0)
