"""YOLO's layout: ROOT/images/* paired by path and stem with ROOT/labels/*.txt, one line
`class cx cy w h` per box (normalised to the image's width and height, [0, 1]); class names
from ROOT/classes.txt (one per line) or ROOT/data.yaml's `names:` (a list, or a mapping from
index to name), else 0..K-1 from the largest index in the labels.

Splits: ROOT/train, ROOT/val (or valid), ROOT/test each with images/ and labels/; or
ROOT/images/train and ROOT/labels/train (and val/valid, test: ultralytics' layout); or
--val_path/--test_path roots; else cut from ROOT by data.py. An empty label file is an image
without objects; a missing one is counted (the image kept as background-only). No torch here.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Sequence

import numpy as np

from ttc.inputs.data import DataOptions
from ttc.inputs.limits import MAX_LABELS
from ttc.inputs.preprocess import image_files
from ttc.tasks.detect.tally import (DUPLICATE_STEM, LARGE_LABELS, MALFORMED_LINE, NO_IMAGE,
                                    NO_LABEL_FILE, UNKNOWN_CLASS, UNREADABLE_LABELS, ZERO_AREA,
                                    Item, Skip, Tally, data_folder, read_bounded, size_words)
from utils import ConfigError, DataError, first_line, quoted, quoted_sample

CLASSES_FILE = "classes.txt"
YAML_FILES = ("data.yaml", "data.yml")
MAX_NAMES_FILE_BYTES = 1 << 20
MAX_LABEL_FILE_BYTES = 1 << 20  # about 30,000 boxes
SPLIT_FOLDERS = {"train": "train", "val": "val", "valid": "val", "test": "test"}
LAYOUT_HINT = ("lay it out as ROOT/images/NAME.png and ROOT/labels/NAME.txt (one line `class cx "
               "cy w h` per box, normalised), with ROOT/classes.txt or a data.yaml `names:`; or "
               "pass --dataset_path IMAGES_DIR --annotations instances.json (COCO)")
NAMES_HINT = ("write one class name per line (the first is index 0), or a data.yaml with "
              "`names: [a, b]` or `names: {0: a, 1: b}`")


def list_yolo(options: DataOptions, labels: Sequence[str] | None, tally: Tally
              ) -> tuple[list[Item], set[str], list[str] | None]:
    """Every image with its boxes and split, the splits the layout gives, and the class names
    (the bundle's `labels`, else ROOT's; None when neither names them)."""
    root = data_folder(options.path, "dataset path", LAYOUT_HINT)
    roots = yolo_roots(root, options)
    names = list(labels) if labels is not None else read_names(root)
    limit = len(names) if names is not None else MAX_LABELS
    items = [item for split, where in roots.items()
             for item in items_in(where, split, limit, tally)]
    given = set(roots) - {"train"} if len(roots) > 1 else _sub_splits(items)
    return items, given, names


def yolo_roots(root: Path, options: DataOptions) -> dict[str, Path]:
    """split → a folder holding images/ and labels/; ConfigError (exit 2) for a folder that is
    neither YOLO's layout nor split folders of it."""
    if (root / "images").is_dir():
        roots = {"train": root}
    else:
        roots = {}
        for folder, split in SPLIT_FOLDERS.items():
            if (root / folder / "images").is_dir():
                roots.setdefault(split, root / folder)
        if "train" not in roots:
            raise ConfigError(f"{root} is neither YOLO's layout (images/ and labels/, or "
                              "train/images/ and train/labels/) nor given with --annotations "
                              "(COCO)", LAYOUT_HINT)
    for split in ("val", "test"):
        extra = getattr(options, f"{split}_path", None)
        if extra:
            roots[split] = data_folder(extra, f"--{split}_path", LAYOUT_HINT)
    for where in roots.values():
        for sub in ("images", "labels"):
            if not (where / sub).is_dir():
                raise ConfigError(f"{where} has no {sub}/ folder", LAYOUT_HINT)
    return roots


def _sub_splits(items: list[Item]) -> set[str]:
    """ultralytics' ROOT/images/train/..., ROOT/images/val/...: every image under a split
    folder (train among them) takes that split; the splits so given."""
    tops = {item.name.split("/", 1)[0] if "/" in item.name else "" for item in items}
    if not tops or not tops <= SPLIT_FOLDERS.keys() or "train" not in tops:
        return set()
    for item in items:
        item.split = SPLIT_FOLDERS[item.name.split("/", 1)[0]]
    return {SPLIT_FOLDERS[top] for top in tops} - {"train"}


def items_in(root: Path, split: str, limit: int, tally: Tally) -> list[Item]:
    """The images of one folder with their boxes, sorted by path. A second image of one stem,
    a label file without an image, a missing label file (the image kept, background-only) and
    every bad line go to `tally`."""
    images = _images_by_stem(root, tally)
    labels = _labels_by_stem(root)
    for stem in sorted(labels.keys() - images.keys()):
        tally.add(root, NO_IMAGE, labels[stem].relative_to(root).as_posix())
    items = []
    for stem, image in sorted(images.items()):
        name = image.relative_to(root / "images").as_posix()
        boxes, sources = np.zeros((0, 5)), []
        if stem not in labels:
            tally.add(root, NO_LABEL_FILE, f"images/{name}")
        else:
            try:
                boxes, sources = read_label_file(labels[stem], root, limit, tally)
            except Skip as skip:
                tally.add(root, skip.reason, labels[stem].relative_to(root).as_posix(),
                          skip.detail, image=image)
                continue
        items.append(Item(image=image, name=name, where=str(root), boxes=boxes,
                          sources=sources, split=split))
    return items


def _images_by_stem(root: Path, tally: Tally) -> dict[str, Path]:
    """stem (the path under images/ without its suffix) → image file."""
    found: dict[str, Path] = {}
    for path in image_files(root / "images"):
        stem = path.relative_to(root / "images").with_suffix("").as_posix()
        if stem in found:
            tally.add(root, DUPLICATE_STEM, path.relative_to(root).as_posix(),
                      f"beside {found[stem].name}", image=path)
        else:
            found[stem] = path
    return found


def _labels_by_stem(root: Path) -> dict[str, Path]:
    """stem → label file: the .txt files under labels/ (hidden ones, and a labels/classes.txt
    as LabelImg writes, left out)."""
    folder = root / "labels"
    found = {}
    for path in sorted(folder.rglob("*.txt")):
        relative = path.relative_to(folder)
        if (path.is_file() and not any(part.startswith(".") for part in relative.parts)
                and relative.as_posix() != CLASSES_FILE):
            found[relative.with_suffix("").as_posix()] = path
    return found


def read_label_file(path: Path, root: Path, limit: int, tally: Tally
                    ) -> tuple[np.ndarray, list[str]]:
    """A label file's boxes, (k, 5) float64 [class, x1, y1, x2, y2] normalised (not clipped),
    and each box's source ("labels/a.txt:3"); a bad line goes to `tally`, an unreadable or
    oversized file raises Skip (its image is left out: its boxes are unknown)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_LABEL_FILE_BYTES + 1)
        if len(data) > MAX_LABEL_FILE_BYTES:
            raise Skip(LARGE_LABELS, f"over {size_words(MAX_LABEL_FILE_BYTES)}")
        text = data.decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise Skip(UNREADABLE_LABELS, first_line(err)) from err
    relative = path.relative_to(root).as_posix()
    rows, sources = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        source = f"{relative}:{number}"
        try:
            cls, cx, cy, w, h = parse_label_line(line)
        except ValueError as err:
            tally.add(root, MALFORMED_LINE, source, str(err))
            continue
        if not 0 <= cls < limit:
            tally.add(root, UNKNOWN_CLASS, source, f"class {cls}, and there are {limit}")
        elif w <= 0 or h <= 0:
            tally.add(root, ZERO_AREA, source, f"width {w:g}, height {h:g}")
        else:
            rows.append([cls, cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2])
            sources.append(source)
    return np.asarray(rows, dtype=np.float64).reshape(-1, 5), sources


def parse_label_line(line: str) -> tuple[int, float, float, float, float]:
    """`class cx cy w h` → its values; ValueError saying what is wrong."""
    fields = line.split()
    if len(fields) != 5:
        raise ValueError(f"{len(fields)} fields, not 5 (class cx cy w h)")
    try:
        values = [float(field) for field in fields]
    except ValueError:
        raise ValueError(f"not numbers: {quoted(line.strip(), 40)}") from None
    if not all(math.isfinite(v) for v in values):
        raise ValueError("a value is not finite")
    if not values[0].is_integer():
        raise ValueError(f"class {fields[0]!r} is not an integer")
    return int(values[0]), values[1], values[2], values[3], values[4]


# ----------------------------------------------------------------------------- class names


def read_names(root: Path) -> list[str] | None:
    """ROOT/classes.txt's names, else ROOT/data.yaml's `names:`; None without either."""
    path = root / CLASSES_FILE
    if path.is_file():
        text = read_bounded(path, MAX_NAMES_FILE_BYTES, "the class list", NAMES_HINT)
        return checked_names([line.strip() for line in text.splitlines() if line.strip()],
                             path)
    for yaml_name in YAML_FILES:
        path = root / yaml_name
        if path.is_file():
            text = read_bounded(path, MAX_NAMES_FILE_BYTES, "the data file", NAMES_HINT)
            names = yaml_names(text, path)
            return None if names is None else checked_names(names, path)
    return None


def checked_names(names: list[str], path: Path) -> list[str]:
    """1 to MAX_LABELS distinct names; DataError (exit 3) otherwise."""
    if not names:
        raise DataError(f"{path} names no class", NAMES_HINT)
    if len(names) > MAX_LABELS:
        raise DataError(f"{path} names {len(names)} classes, over {MAX_LABELS}", NAMES_HINT)
    repeated = sorted(name for name, n in Counter(names).items() if n > 1)
    if repeated:
        raise DataError(f"{path} names {quoted_sample(repeated)} more than once", NAMES_HINT)
    return names


def yaml_names(text: str, path: Path) -> list[str] | None:
    """data.yaml's `names:` as a list (a mapping's keys must be 0..K-1); None without it."""
    try:
        import yaml
    except ImportError:  # PyYAML comes with ray and transformers; the simple forms without it
        names = _simple_yaml_names(text)
    else:
        try:
            loaded = yaml.safe_load(text)
        except (yaml.YAMLError, RecursionError) as err:
            raise DataError(f"cannot parse {path}: {first_line(err)}", NAMES_HINT) from err
        except (ValueError, OverflowError) as err:  # int's digit limit
            raise DataError(f"cannot parse {path}: a number in it is too long to read",
                            NAMES_HINT) from err
        names = loaded.get("names") if isinstance(loaded, dict) else None
    if names is None:
        return None
    if isinstance(names, dict):
        if sorted(map(str, names)) != sorted(str(i) for i in range(len(names))):
            raise DataError(f"{path}'s names are keyed {quoted_sample(list(names))}, not "
                            f"0..{len(names) - 1}", NAMES_HINT)
        names = [names.get(i, names.get(str(i))) for i in range(len(names))]
    if not isinstance(names, list) or any(isinstance(n, (dict, list)) or n is None
                                          for n in names):
        raise DataError(f"{path}'s names are not a list of names", NAMES_HINT)
    return [str(name).strip() for name in names]


_INLINE = re.compile(r"^names:\s*\[(.*)\]\s*(#.*)?$")
_ITEM = re.compile(r"^\s+-\s*(.+?)\s*$")
_PAIR = re.compile(r"^\s+(\d+)\s*:\s*(.+?)\s*$")


def _simple_yaml_names(text: str) -> list[str] | dict[int, str] | None:
    """`names: [a, b]`, a block list (`  - a`) or a block mapping (`  0: a`) under `names:`."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        inline = _INLINE.match(line)
        if inline:
            return [_unquoted(v) for v in inline.group(1).split(",") if v.strip()]
        if line.rstrip() != "names:":
            continue
        block = [row for row in lines[index + 1:] if row.strip()]
        block = block[:next((i for i, row in enumerate(block) if not row[:1].isspace()),
                            len(block))]
        if block and all(_ITEM.match(row) for row in block):
            return [_unquoted(_ITEM.match(row).group(1)) for row in block]
        if block and all(_PAIR.match(row) for row in block):
            return {int(m.group(1)): _unquoted(m.group(2)) for m in map(_PAIR.match, block)}
        return None
    return None


def _unquoted(value: str) -> str:
    value = value.strip()
    return value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value
