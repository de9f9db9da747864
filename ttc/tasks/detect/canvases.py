"""A detection data set no one needs to download (issue 44's bench data): canvases of faint
seeded noise with 1 to 5 of scikit-learn's 1,797 8x8 digits (sklearn.datasets.load_digits)
pasted at random positions and sides (16-40 px on a 96-px canvas, in proportion on others), each
boxed tightly around its stroke pixels (the scaled glyph above STROKE_THRESHOLD), its class the
digit (0..9). A digit whose box would overlap a placed one by IoU over MAX_IOU is moved (up to
PLACEMENT_TRIES draws) or left out. The same seed gives the same canvases, the same bytes.

Boxes are float32 (k, 5) arrays [class, x1, y1, x2, y2] in pixels, continuous coordinates (a
digit whose strokes cover columns 3..7 has x1 = 3, x2 = 8): the detection contract's form.
write_yolo_canvases and write_coco_canvases write the same canvases in the two formats the
reader takes (ttc/tasks/detect/data.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CLASS_NAMES = tuple(str(d) for d in range(10))  # class index: the digit
STROKE_THRESHOLD = 0.5  # a digit's pixel (in [0, 1]) above this is stroke
DIGITS_PER_CANVAS = (1, 5)
SIDES_OF_96 = (16, 40)  # a digit's side, in pixels, on a 96-pixel canvas
NOISE = 0.25  # the background: uniform noise in [0, NOISE]
MAX_IOU = 0.2  # a new digit's box overlaps none placed by more than this
PLACEMENT_TRIES = 8  # positions drawn for a digit before it is left out

# --dataset_path builtin:digit_boxes: canvases made in memory, small enough to train in seconds
# (bench/detect.py writes 3,000+ of 96 pixels)
BUILTIN = "builtin:digit_boxes"
BUILTIN_COUNT, BUILTIN_SIZE, BUILTIN_SEED = 600, 64, 0


def digit_box_canvases(count: int, size: int = 96, seed: int = 0
                       ) -> tuple[np.ndarray, list[np.ndarray]]:
    """`count` canvases: (count, size, size) uint8 pixels, and per canvas its (k, 5) float32
    boxes [digit, x1, y1, x2, y2] (1 <= k <= 5)."""
    digits, targets = _digits()
    rng = np.random.default_rng(seed)
    sides = digit_sides(size)
    images = np.empty((count, size, size), dtype=np.uint8)
    boxes = []
    for index in range(count):
        images[index], found = draw_canvas(digits, targets, rng, size, sides)
        boxes.append(found)
    return images, boxes


def digit_sides(size: int) -> tuple[int, int]:
    """The smallest and largest side a digit takes on a canvas of `size` (16-40 px at 96)."""
    low = min(size, max(4, round(size * SIDES_OF_96[0] / 96)))
    high = min(size, max(low, round(size * SIDES_OF_96[1] / 96)))
    return low, high


def draw_canvas(digits: np.ndarray, targets: np.ndarray, rng: np.random.Generator, size: int,
                sides: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """One canvas: (size, size) uint8 pixels and its (k, 5) float32 boxes. A later digit's
    pixels brighten what lies under them (the maximum), so every stroke stays visible."""
    canvas = rng.uniform(0.0, NOISE, size=(size, size)).astype(np.float32)
    placed: list[list[float]] = []
    for _ in range(int(rng.integers(DIGITS_PER_CANVAS[0], DIGITS_PER_CANVAS[1] + 1))):
        pick = int(rng.integers(len(digits)))
        side = int(rng.integers(sides[0], sides[1] + 1))
        glyph = _scaled(digits[pick], side)
        tight = stroke_box(glyph)
        if tight is None:
            continue
        spot = _free_spot(rng, size, side, tight, placed)
        if spot is None:
            continue
        top, left = spot
        region = canvas[top:top + side, left:left + side]
        np.maximum(region, glyph, out=region)
        placed.append([float(targets[pick]), left + tight[0], top + tight[1], left + tight[2],
                       top + tight[3]])
    boxes = np.asarray(placed, dtype=np.float32).reshape(-1, 5)
    return np.round(canvas * 255).astype(np.uint8), boxes


def stroke_box(glyph: np.ndarray) -> tuple[int, int, int, int] | None:
    """(x1, y1, x2, y2) around the glyph's stroke pixels, exclusive ends; None without any."""
    rows = np.flatnonzero((glyph > STROKE_THRESHOLD).any(axis=1))
    cols = np.flatnonzero((glyph > STROKE_THRESHOLD).any(axis=0))
    if rows.size == 0:
        return None
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1


def _free_spot(rng: np.random.Generator, size: int, side: int, tight: tuple[int, int, int, int],
               placed: list[list[float]]) -> tuple[int, int] | None:
    """(top, left) where the digit's box overlaps no placed box by IoU over MAX_IOU; None after
    PLACEMENT_TRIES draws."""
    for _ in range(PLACEMENT_TRIES):
        top, left = (int(v) for v in rng.integers(0, size - side + 1, size=2))
        box = (left + tight[0], top + tight[1], left + tight[2], top + tight[3])
        if all(box_iou(box, other[1:]) <= MAX_IOU for other in placed):
            return top, left
    return None


def box_iou(a, b) -> float:
    """IoU of two xyxy boxes."""
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    if width <= 0 or height <= 0:
        return 0.0
    inter = width * height
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as float32 (1797, 8, 8) in [0, 1], and their digits."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.images / 16.0).astype(np.float32), bunch.target.astype(np.int64)


def _scaled(digit: np.ndarray, side: int) -> np.ndarray:
    """An 8x8 digit resized bilinearly to side x side, in [0, 1]."""
    from PIL import Image

    img = Image.fromarray(digit).resize((side, side), Image.Resampling.BILINEAR)
    return np.clip(np.asarray(img, dtype=np.float32), 0.0, 1.0)


# ----------------------------------------------------------------------------- files


def _write_images(folder: Path, images: np.ndarray) -> list[str]:
    """images/NNNNN.png (8-bit gray); their file names."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    names = [f"{index:05d}.png" for index in range(len(images))]
    for name, image in zip(names, images):
        Image.fromarray(image).save(folder / name, format="PNG")
    return names


def write_yolo_canvases(root: Path, count: int, size: int = 96, seed: int = 0) -> Path:
    """`count` canvases in YOLO's layout: root/images/NNNNN.png, root/labels/NNNNN.txt (one line
    `class cx cy w h` per box, normalised to [0, 1]) and root/classes.txt ("0".."9").
    Returns `root`."""
    root = Path(root)
    images, boxes = digit_box_canvases(count, size, seed)
    names = _write_images(root / "images", images)
    (root / "labels").mkdir(parents=True, exist_ok=True)
    for name, found in zip(names, boxes):
        lines = [f"{int(c)} {(x1 + x2) / 2 / size:.8f} {(y1 + y2) / 2 / size:.8f} "
                 f"{(x2 - x1) / size:.8f} {(y2 - y1) / size:.8f}" for c, x1, y1, x2, y2 in found]
        (root / "labels" / name).with_suffix(".txt").write_text(
            "".join(line + "\n" for line in lines), encoding="utf-8")
    (root / "classes.txt").write_text("\n".join(CLASS_NAMES) + "\n", encoding="utf-8")
    return root


def write_coco_canvases(images_dir: Path, json_path: Path, count: int, size: int = 96,
                        seed: int = 0) -> Path:
    """The same canvases as write_yolo_canvases (same `count`, `size`, `seed`):
    images_dir/NNNNN.png and a COCO instances JSON at `json_path` (image and annotation ids from
    1, bbox [x, y, w, h] in pixels, category ids 1..10 named "0".."9"). Returns `json_path`."""
    images, boxes = digit_box_canvases(count, size, seed)
    names = _write_images(Path(images_dir), images)
    records, annotations = [], []
    for image_id, (name, found) in enumerate(zip(names, boxes), start=1):
        records.append({"id": image_id, "file_name": name, "width": size, "height": size})
        for c, x1, y1, x2, y2 in found.tolist():
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": int(c) + 1, "bbox": [x1, y1, x2 - x1, y2 - y1],
                                "area": (x2 - x1) * (y2 - y1), "iscrowd": 0})
    categories = [{"id": index + 1, "name": name, "supercategory": "digit"}
                  for index, name in enumerate(CLASS_NAMES)]
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"images": records, "annotations": annotations,
                                     "categories": categories}), encoding="utf-8")
    return json_path
