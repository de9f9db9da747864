"""Object detection data, in the two formats users have, split and decoded by the image
classifier's rules (ttc/inputs/data.py), as the segmenter's reader does:

- YOLO (yolo.py): ROOT/images/* and ROOT/labels/*.txt (`class cx cy w h`, normalised), class
  names from ROOT/classes.txt or ROOT/data.yaml's `names:`. Splits: ROOT/train|val|test (each
  with images/ and labels/), ROOT/images/train|val|test, --val_path/--test_path roots, else cut.
- COCO (coco.py): `--dataset_path IMAGES_DIR --annotations instances.json`; --val_path and
  --test_path name other COCO JSON files of the same IMAGES_DIR, else splits are cut.

A split not given is cut from the training images with the seeded val/test fractions
(assign_splits, one class: a seeded shuffle and cut). Every image is decoded by the classifier's
decoder (`decode_image_file`: the channel rule, EXIF orientation, bilinear resize, [0, 1]) at
one training size, the most common among the training images (or --image_size), and its boxes
are scaled with it: a Split's y holds per image a float32 (k, 5) array [class, x1, y1, x2, y2]
in the resized image's pixels (docs: the detection contract). Boxes are read against the image
as the decoder sees it (after its EXIF orientation).

Bad input is counted with its reason (tally.py: Dataset.skipped, Dataset.dropped), never
silently: a box partly outside its image is clipped, a box left with no area is dropped, an image
without labels is kept as background-only. DataError (exit 3) when no training image is left;
ConfigError (exit 2) for a layout that is neither format. No torch here.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ttc.inputs.data import SPLITS, DataOptions, Dataset, ImageItem, Split, channel_stats
from ttc.inputs.limits import image_bytes
from ttc.inputs.preprocess import decode_image_file
from ttc.tasks.detect.canvases import (BUILTIN, BUILTIN_COUNT, BUILTIN_SEED, BUILTIN_SIZE,
                                       CLASS_NAMES, digit_box_canvases)
from ttc.tasks.detect.coco import list_coco
from ttc.tasks.detect.tally import (CLIPPED, EDGE_SLACK, OUTSIDE, SIZE_MISMATCH,
                                    UNREADABLE_IMAGE, Item, Skip, Tally, refused_values)
from ttc.tasks.detect.yolo import LAYOUT_HINT, list_yolo
from ttc.tasks.segment.data import (builtin_splits, check_builtin_options, check_bundle_size,
                                    cut_missing_splits, decoded_image_size, refuse_over_memory,
                                    split_counts, training_size)
from utils import LOG, DataError, first_line, progress

MODEL_TYPE = "object_detector"
KIND = "detection"


def load_detection_dataset(options: DataOptions, *, preprocessing: dict | None = None,
                           labels: Sequence[str] | None = None,
                           splits: Sequence[str] = SPLITS) -> Dataset:
    """Find, split and decode a detection data set (Parts.reader's contract). With a bundle's
    `preprocessing` and `labels` its image size, channels and classes are used; otherwise they
    are derived (the size and channels from the training images, the classes from the data)."""
    if options.path == BUILTIN:
        return builtin_boxes(options, preprocessing, labels, splits)
    tally = Tally()
    items, names, given = list_items(options, labels, tally)
    derived = preprocessing is None
    kept = sum(item.split in splits for item in items)
    if derived:
        preprocessing = derive_preprocessing(items, options)
        require_memory_for(preprocessing, kept, options)
    else:
        check_bundle_size(preprocessing, kept, splits)
    decoded = {split: decode_split([i for i in items if i.split == split], preprocessing,
                                   tally, options, split) for split in splits}
    _require_images_left(decoded, tally, options)
    if derived and "train" in decoded:
        preprocessing = dict(preprocessing, **channel_stats(decoded["train"].x))
    return Dataset(model_type=MODEL_TYPE, labels=names, preprocessing=preprocessing,
                   splits=decoded, counts=split_counts(items, decoded),
                   given_splits=bool(given), options=options,
                   skipped=tally.skipped, dropped=tally.records())


def list_items(options: DataOptions, labels: Sequence[str] | None, tally: Tally
               ) -> tuple[list[Item], list[str], set[str]]:
    """Every image with its boxes and split (the splits not given cut from the training
    images), the class names, and the splits the data gave. COCO with --annotations, else
    YOLO's layout."""
    annotations = getattr(options, "annotations", None)
    if annotations:
        items, given, names = list_coco(options, labels, tally)
    else:
        items, given, names = list_yolo(options, labels, tally)
    if not items:
        raise DataError(f"no usable images in {options.path}"
                        + (f": {tally.summary()}" if tally.count() else ": no image files"),
                        "check --annotations' file_names" if annotations else LAYOUT_HINT)
    cut_missing_splits([item for item in items if item.split == "train"], given, options)
    return items, names if names is not None else index_names(items, options.path), given


def index_names(items: list[Item], source: str) -> list[str]:
    """Classes named by their index, 0..K-1, K = 1 + the largest class in the labels read."""
    largest = max((int(item.boxes[:, 0].max()) for item in items if len(item.boxes)),
                  default=-1)
    if largest < 0:
        raise DataError(f"the labels of {source} hold no box, and nothing names the classes",
                        "add boxes to the label files, and ROOT/classes.txt to name the classes")
    LOG.info("no classes.txt or data.yaml names in %s: the classes are named 0..%d", source,
             largest)
    return [str(i) for i in range(largest + 1)]


# ----------------------------------------------------------------------------- decoding


def derive_preprocessing(items: list[Item], options: DataOptions) -> dict:
    """The training size and channels, by the classifier's rules: the most common size of the
    training images (or --image_size); 1 channel when every one is grayscale, else 3 (or
    --channels)."""
    train = [ImageItem(source=item.image, label="") for item in items if item.split == "train"]
    if not train:
        raise DataError(f"the training split of {options.path} has no image", LAYOUT_HINT)
    height, width, channels = training_size(train, options)
    return preprocessing_record([height, width], channels,
                                "by image mode: 8-bit /255, 16-bit /65535 (docs/data.md)")


def preprocessing_record(size: list[int], channels: int, pixel_scale: str) -> dict:
    """What a bundle records of a detector's input (channel_stats' mean and std come after)."""
    return {"kind": KIND, "image_size": list(size), "channels": channels,
            "color_mode": "L" if channels == 1 else "RGB", "resample": "bilinear",
            "pixel_scale": pixel_scale, "input_range": [0.0, 1.0], "layout": "NCHW",
            "normalization": "in_graph"}


def require_memory_for(preprocessing: dict, count: int, options: DataOptions) -> None:
    """Refuse (exit 3) images that, decoded at the training size, would take more than
    --max_image_memory_mb: the size comes from the data, so a folder of large photographs is
    refused before any decoding, with the size to set."""
    refuse_over_memory(count * image_bytes(preprocessing), f"{count} images", preprocessing,
                       options)


def decode_split(items: list[Item], preprocessing: dict, tally: Tally, options: DataOptions,
                 split: str) -> Split:
    """x float32 (N, C, H, W) in [0, 1]; y an object array of N float32 (k, 5) box arrays in
    the resized images' pixels; ids the images' names. An image that cannot be used goes to
    `tally` with its reason."""
    channels = preprocessing["channels"]
    height, width = preprocessing["image_size"]
    x = np.empty((len(items), channels, height, width), dtype=np.float32)
    y = np.empty(len(items), dtype=object)
    ids: list[str] = []
    for item in progress(items, desc=f"decode {split}", enabled=options.show_progress):
        try:
            with refused_values(UNREADABLE_IMAGE):
                x[len(ids)], boxes = decode_item(item, preprocessing, tally)
        except Skip as skip:
            tally.add(item.where, skip.reason, item.name, skip.detail, image=item.image)
            continue
        y[len(ids)] = boxes
        ids.append(item.name)
    return Split(x=x[:len(ids)], y=y[:len(ids)].copy(), ids=ids)


def decode_item(item: Item, preprocessing: dict, tally: Tally) -> tuple[np.ndarray, np.ndarray]:
    """One image → ((C, H, W) float32 pixels, (k, 5) float32 boxes) at the training size;
    raises Skip with the reason it cannot be used. Clipped and vanished boxes are counted."""
    size = decoded_image_size(item.image)
    if item.declared is not None and item.declared != size:
        raise Skip(SIZE_MISMATCH, f"the file is {size[1]}x{size[0]}, the record says "
                   f"{item.declared[1]}x{item.declared[0]}")
    try:
        pixels = decode_image_file(item.image, preprocessing)
    except Exception as err:  # noqa: BLE001 - any decoder failure means a bad file
        raise Skip(UNREADABLE_IMAGE, first_line(err)) from err
    return pixels, place_boxes(item, size, preprocessing["image_size"], tally)


def place_boxes(item: Item, size: tuple[int, int], target: Sequence[int],
                tally: Tally) -> np.ndarray:
    """An item's boxes clipped to its image (of `size`, (height, width)) and scaled to `target`
    (height, width): float32 (k, 5). A box reaching outside is clipped (counted); one left with
    no area is dropped (counted)."""
    boxes = np.array(item.boxes, dtype=np.float64).reshape(-1, 5)
    if not item.normalised:
        boxes[:, 1:] /= [size[1], size[0], size[1], size[0]]
    corners = np.clip(boxes[:, 1:], 0.0, 1.0)
    clipped = (np.abs(corners - boxes[:, 1:]) > EDGE_SLACK).any(axis=1)
    empty = (corners[:, 2] <= corners[:, 0]) | (corners[:, 3] <= corners[:, 1])
    for index in np.flatnonzero(empty):
        tally.add(item.where, OUTSIDE, item.sources[index])
    for index in np.flatnonzero(clipped & ~empty):
        tally.add(item.where, CLIPPED, item.sources[index])
    height, width = target
    corners = corners * [width, height, width, height]
    return np.concatenate([boxes[:, :1], corners], axis=1)[~empty].astype(np.float32)


def _require_images_left(decoded: dict[str, Split], tally: Tally, options: DataOptions) -> None:
    """Exit 3 when no training image (or no test image) is left, or no training box."""
    reasons = f" ({tally.count()} counted: {tally.summary()})" if tally.count() else ""
    if "train" in decoded and len(decoded["train"]) == 0:
        raise DataError(f"no usable images in the training split of {options.path}{reasons}",
                        "check that the images are readable and labelled")
    if "train" in decoded and not any(len(boxes) for boxes in decoded["train"].y):
        raise DataError(f"the training images of {options.path} hold no box{reasons}",
                        "check the labels (YOLO: ROOT/labels/NAME.txt beside "
                        "ROOT/images/NAME.png; COCO: --annotations)")
    if "test" in decoded and len(decoded["test"]) == 0:
        raise DataError(f"the test split of {options.path} is empty{reasons}",
                        "add images to test/ (or --test_path) or raise --test_fraction")


# ----------------------------------------------------------------------------- builtin


def builtin_boxes(options: DataOptions, preprocessing: dict | None,
                  labels: Sequence[str] | None, splits: Sequence[str]) -> Dataset:
    """builtin:digit_boxes: BUILTIN_COUNT canvases of BUILTIN_SIZE pixels (canvases.py, made in
    memory, the same every time), split by --seed and the fractions as a folder is."""
    size = [BUILTIN_SIZE, BUILTIN_SIZE]
    check_builtin_options(options, BUILTIN, BUILTIN_SIZE,
                          "ttc.tasks.detect.canvases.write_yolo_canvases")
    images, boxes = digit_box_canvases(BUILTIN_COUNT, BUILTIN_SIZE, BUILTIN_SEED)
    cut = builtin_splits(options, len(images))
    decoded = {}
    for split in splits:
        chosen = np.flatnonzero(cut == split)
        y = np.empty(len(chosen), dtype=object)
        for position, index in enumerate(chosen):
            y[position] = boxes[index]
        decoded[split] = Split(x=(images[chosen][:, None] / 255.0).astype(np.float32), y=y,
                               ids=[f"{BUILTIN}#{i}" for i in chosen])
    if preprocessing is None:
        preprocessing = dict(preprocessing_record(size, 1, "8-bit /255"),
                             **channel_stats(decoded["train"].x))
    return Dataset(model_type=MODEL_TYPE, labels=list(labels or CLASS_NAMES),
                   preprocessing=preprocessing, splits=decoded,
                   counts={s: int((cut == s).sum()) for s in SPLITS}, given_splits=False,
                   options=options)
