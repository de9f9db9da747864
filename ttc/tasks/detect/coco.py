"""COCO's layout: `--dataset_path IMAGES_DIR --annotations instances.json`. The JSON's images
(id, file_name, optional width and height) name files inside IMAGES_DIR, never outside it (an
absolute name, `..`, or a link leading out is refused and counted); its annotations (id,
image_id, category_id, bbox [x, y, w, h] in the image's pixels, iscrowd) are its boxes; its
categories, in the order of their ids, are the classes 0..K-1, named by their names.

Splits: --val_path and --test_path, with --annotations, name other COCO instances JSON files
whose images lie in the same IMAGES_DIR (their categories are matched to the classes by name);
a split not so given is cut from --annotations' images by data.py. An image file listed twice
(in one file or two) is kept once, the first time. Crowd annotations (iscrowd 1) are left out
and counted, as ultralytics' converter does. No torch here.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Sequence

import numpy as np

from ttc.inputs.data import DataOptions
from ttc.inputs.limits import MAX_LABELS
from ttc.tasks.detect.tally import (CROWD, DUPLICATE_ANNOTATION_ID, DUPLICATE_IMAGE_ID,
                                    LISTED_TWICE, MALFORMED_ANNOTATION, MALFORMED_IMAGE,
                                    MISSING_FILE, NO_ANNOTATIONS, NO_IMAGE_RECORD, REFUSED_NAME,
                                    REFUSED_NUMBER, UNKNOWN_CATEGORY, UNSAFE_NAME, ZERO_AREA,
                                    Item, Skip, Tally, data_folder, read_bounded, refused_values,
                                    shown_name)
from utils import ConfigError, DataError, first_line, quoted, quoted_sample

MAX_ANNOTATIONS_BYTES = 1 << 30  # COCO 2017's train instances JSON is 448 MiB
COCO_HINT = ("give a COCO instances JSON: {\"images\": [{\"id\", \"file_name\", \"width\", "
             "\"height\"}], \"annotations\": [{\"id\", \"image_id\", \"category_id\", \"bbox\": "
             "[x, y, w, h]}], \"categories\": [{\"id\", \"name\"}]}")
FOLDER_HINT = "pass the folder holding the JSON's images: --dataset_path IMAGES_DIR"


def list_coco(options: DataOptions, labels: Sequence[str] | None, tally: Tally
              ) -> tuple[list[Item], set[str], list[str]]:
    """Every image with its boxes and split, the splits given (--val_path, --test_path: other
    JSON files), and the class names (the bundle's `labels`, else the categories')."""
    images_dir = data_folder(options.path, "dataset path", FOLDER_HINT)
    main = annotations_file(options.annotations, "--annotations")
    document = read_coco(main)
    names = list(labels) if labels is not None else category_names(document, main)
    seen: dict[Path, str] = {}
    items = coco_items(document, main, images_dir, names, tally, "train", seen)
    given = set()
    for split in ("val", "test"):
        extra = getattr(options, f"{split}_path", None)
        if extra:
            path = annotations_file(extra, f"--{split}_path")
            items += coco_items(read_coco(path), path, images_dir, names, tally, split, seen)
            given.add(split)
    return items, given, names


def annotations_file(path: str, flag: str) -> Path:
    """A COCO JSON the user names; ConfigError (exit 2) when it is not a file."""
    file = Path(path)
    if not file.is_file():
        said = "does not exist" if not file.exists() else "is not a file"
        raise ConfigError(f"{flag} {file} {said}", "name a COCO instances JSON (" + (
            "with --annotations, --val_path and --test_path are COCO JSON files of the same "
            "images folder)" if flag != "--annotations" else "its images in --dataset_path)"))
    return file


def read_coco(path: Path) -> dict:
    """The JSON's top level: a mapping with an `images` list (`annotations`, `categories`
    lists when present); DataError (exit 3) over MAX_ANNOTATIONS_BYTES or when unparsable."""
    text = read_bounded(path, MAX_ANNOTATIONS_BYTES, "the COCO file", COCO_HINT)
    try:
        document = parsed_json(text)
    except (ValueError, RecursionError) as err:
        raise DataError(f"cannot parse {path} as JSON: {first_line(err)}", COCO_HINT) from err
    if not isinstance(document, dict) or not isinstance(document.get("images"), list):
        raise DataError(f"{path} is not a COCO instances file: no \"images\" list", COCO_HINT)
    for key in ("annotations", "categories"):
        if not isinstance(document.get(key, []), list):
            raise DataError(f"{path}'s \"{key}\" is not a list", COCO_HINT)
    return document


def parsed_json(text: str) -> Any:
    """The JSON document; an integer too long for Python's int (over 4,300 digits) reads as
    infinity, which no id or number accepts: its record is counted and left out, not the file."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError:  # int's digit limit: parse again, the over-long integers as infinity
        return json.loads(text, parse_int=_int_or_infinity)


def _int_or_infinity(digits: str) -> int | float:
    try:
        return int(digits)
    except ValueError:
        return math.inf if not digits.startswith("-") else -math.inf


def category_names(document: dict, path: Path) -> list[str]:
    """The categories' names in the order of their ids; DataError for none, a malformed one,
    or a repeated id or name."""
    categories = document.get("categories") or []
    if not categories:
        raise DataError(f"{path} has no categories", COCO_HINT)
    if not all(isinstance(c, dict) and _is_id(c.get("id")) and isinstance(c.get("name"), str)
               and c["name"].strip() for c in categories):
        raise DataError(f"{path} has a category without an id or a name", COCO_HINT)
    if len(categories) > MAX_LABELS:
        raise DataError(f"{path} has {len(categories)} categories, over {MAX_LABELS}",
                        COCO_HINT)
    for key in ("id", "name"):
        repeated = [v for v, n in Counter(c[key] for c in categories).items() if n > 1]
        if repeated:
            raise DataError(f"{path} has the category {key} {quoted_sample(repeated)} more "
                            "than once", COCO_HINT)
    ordered = sorted(categories, key=lambda c: (isinstance(c["id"], str), c["id"]))
    return [c["name"].strip() for c in ordered]


def category_classes(document: dict, names: list[str]) -> dict[Any, int]:
    """category id → class index, for the categories named like a class (matched by name)."""
    index = {name: i for i, name in enumerate(names)}
    return {c["id"]: index[c["name"].strip()] for c in document.get("categories") or []
            if isinstance(c, dict) and _is_id(c.get("id")) and isinstance(c.get("name"), str)
            and c["name"].strip() in index}


def coco_items(document: dict, path: Path, images_dir: Path, names: list[str], tally: Tally,
               split: str, seen: dict[Path, str]) -> list[Item]:
    """The JSON's usable images with their boxes (pixels, not clipped); what cannot be used goes
    to `tally`. An image no annotation names is kept as background-only, and counted."""
    records, listed = image_records(document, path, images_dir, tally, seen)
    boxes, named = annotation_boxes(document, path, records, listed,
                                    category_classes(document, names), tally)
    items = []
    for image_id, (image, name, declared) in records.items():
        if image_id not in named:
            tally.add(path, NO_ANNOTATIONS, name)
        rows, sources = boxes.get(image_id, ([], []))
        items.append(Item(image=image, name=name, where=str(path),
                          boxes=np.asarray(rows, dtype=np.float64).reshape(-1, 5),
                          sources=sources, split=split, normalised=False, declared=declared))
    return items


def image_records(document: dict, path: Path, images_dir: Path, tally: Tally,
                  seen: dict[Path, str]) -> tuple[dict[Any, tuple], set]:
    """image id → (file, file_name, declared (height, width) or None) for the usable images,
    and every id the JSON lists (an annotation of a listed but unusable image follows it)."""
    records: dict[Any, tuple] = {}
    listed: set = set()
    for index, record in enumerate(document["images"]):
        name = (shown_name(record["file_name"]) if isinstance(record, dict)
                and isinstance(record.get("file_name"), str) else f"images[{index}]")
        try:
            with refused_values(REFUSED_NAME):
                image_id, image, declared = image_record(record, images_dir, listed, seen)
        except Skip as skip:
            tally.add(path, skip.reason, name, skip.detail, image=f"{path}#{name}")
            continue
        seen[image.resolve()] = f"{path.name}'s {quoted(name, 60)}"
        records[image_id] = (image, name, declared)
    return records, listed


def image_record(record: Any, images_dir: Path, listed: set, seen: dict[Path, str]
                 ) -> tuple[Any, Path, tuple[int, int] | None]:
    """One image record → (id, file, declared size); Skip with the reason it is unusable."""
    if not isinstance(record, dict) or not _is_id(record.get("id")):
        raise Skip(MALFORMED_IMAGE, "no id (an integer or a string)")
    name = record.get("file_name")
    if not isinstance(name, str) or not name.strip():
        raise Skip(MALFORMED_IMAGE, "no file_name")
    sides = [record.get(key) for key in ("height", "width")]
    if any(s is not None for s in sides) and not all(_is_count(s) for s in sides):
        raise Skip(MALFORMED_IMAGE, "width and height are not positive integers")
    if record["id"] in listed:
        raise Skip(DUPLICATE_IMAGE_ID, f"id {quoted(record['id'])}")
    listed.add(record["id"])
    image = inside(images_dir, name)
    if not image.is_file():
        raise Skip(MISSING_FILE, f"no file {image}")
    if image.resolve() in seen:
        raise Skip(LISTED_TWICE, f"already {seen[image.resolve()]}")
    declared = (int(sides[0]), int(sides[1])) if sides[0] is not None else None
    return record["id"], image, declared


def inside(images_dir: Path, name: str) -> Path:
    """IMAGES_DIR/name; Skip when the name is absolute, holds `..`, or resolves outside."""
    if (PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute()
            or PureWindowsPath(name).drive or ".." in PureWindowsPath(name).parts):
        raise Skip(UNSAFE_NAME, "an absolute path or one with ..: names are relative to "
                   "--dataset_path")
    image = images_dir / name
    if not image.resolve().is_relative_to(images_dir.resolve()):
        raise Skip(UNSAFE_NAME, "a link leading outside --dataset_path")
    return image


def annotation_boxes(document: dict, path: Path, records: dict, listed: set,
                     classes: dict[Any, int], tally: Tally
                     ) -> tuple[dict[Any, tuple[list, list]], set]:
    """image id → (rows [class, x1, y1, x2, y2] in pixels, sources), and the ids of the images
    any annotation names; a bad annotation goes to `tally`."""
    boxes: dict[Any, tuple[list, list]] = {}
    named: set = set()
    ids: set = set()
    for index, annotation in enumerate(document.get("annotations") or []):
        known = isinstance(annotation, dict) and _is_id(annotation.get("id"))
        source = (shown_name(f"annotation {annotation['id']}") if known
                  else f"annotations[{index}]")
        try:
            with refused_values(REFUSED_NUMBER):
                image_id, row = parse_annotation(annotation, ids, listed, named, classes)
        except Skip as skip:
            tally.add(path, skip.reason, source, skip.detail)
            continue
        if image_id in records:  # else its image is left out, and counted
            rows, sources = boxes.setdefault(image_id, ([], []))
            rows.append(row)
            sources.append(source)
    return boxes, named


def parse_annotation(annotation: Any, ids: set, listed: set, named: set,
                     classes: dict[Any, int]) -> tuple[Any, list[float]]:
    """One annotation → (its image id, [class, x1, y1, x2, y2]); Skip with the reason it is
    left out. Adds its id to `ids` and its image's to `named`."""
    if not isinstance(annotation, dict) or not _is_id(annotation.get("id")):
        raise Skip(MALFORMED_ANNOTATION, "no id (an integer or a string)")
    if annotation["id"] in ids:
        raise Skip(DUPLICATE_ANNOTATION_ID)
    ids.add(annotation["id"])
    image_id = annotation.get("image_id")
    if not _is_id(image_id) or image_id not in listed:
        raise Skip(NO_IMAGE_RECORD, f"image_id {quoted(image_id)}")
    named.add(image_id)
    if annotation.get("iscrowd"):
        raise Skip(CROWD, "iscrowd 1")
    category = annotation.get("category_id")
    if not _is_id(category) or category not in classes:
        raise Skip(UNKNOWN_CATEGORY, f"category_id {quoted(category)}")
    bbox = annotation.get("bbox")
    if not (isinstance(bbox, list) and len(bbox) == 4 and all(_is_number(v) for v in bbox)):
        raise Skip(MALFORMED_ANNOTATION, "bbox is not [x, y, width, height]")
    x, y, width, height = (float(v) for v in bbox)  # an int past a float: OverflowError
    if not all(math.isfinite(v) for v in (x, y, x + width, y + height)):
        raise Skip(REFUSED_NUMBER, "a bbox value is not a finite float")
    if width <= 0 or height <= 0:
        raise Skip(ZERO_AREA, f"width {width:g}, height {height:g}")
    return image_id, [float(classes[category]), x, y, x + width, y + height]


def _is_id(value: Any) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
