"""Batch inference for a detector (issue 44, item 7): an image or a folder of images (recursive)
→ one row per detected box (image, label, class_index, score, x1, y1, x2, y2 in the image's own
pixels, error) in CSV, JSONL or Parquet by the output's suffix, or with --output_format coco a
COCO results JSON and its images file (RowWriter and CocoWriter say what each holds);
optionally each image with its boxes drawn (--overlay true).

Each image is decoded as the model was trained (preprocess.decode_image_file: the bundle's
channels, resized to its image size), predicted a batch at a time by `run` (evaluate.py's
detection_runner: per image its boxes, scores and class indices, padding removed), and its
boxes, clipped to the model's input, scaled back to the image's own size (x by W0/W, y by H0/H;
the size after its EXIF orientation, as decode_image_file sees it). Boxes scored below
--min_score are left out. Memory stays bounded by one batch: nothing is held for the whole
folder but the list of its paths. The listing, the sizes, the EXIF handling, the error reasons,
the overlay folder, the batches and the counts are the segmenter's (ttc/tasks/segment/predict.py:
predicted_batch, write_results); the outputs are written to temporary files moved into place at
the end, the overlays atomically one by one. An
unreadable image is an error row (batch.py's conventions: counted, listed in --errors, a failed
run without --allow_errors). numpy and Pillow (pyarrow for Parquet) only: no torch here.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ttc.inputs.tables import IMAGE_EXTENSIONS
from ttc.serving.batch import RecordWriter, raise_for_error_rows, utf8_name
from ttc.tasks.detect import TASK
from ttc.tasks.detect.evaluate import DetectionRunner, Detections, rgb_picture
from ttc.tasks.detect.overlay import draw_overlay
from ttc.tasks.outputs import default_overlay_dir, images_json_path
from ttc.tasks.segment.predict import (ImageBatchOptions, ImageRun, Listed, listed_images,
                                       original_pixels, predicted_batch, predicted_batches,
                                       refuse_linked_subfolders, unreadable, write_results)
from utils import (LOG, ConfigError, DataError, ExportError, atomic_write, atomic_write_stream,
                   file_in_folder, inside, refuse_linked_folder, same_file, unwritable)

ROW_FORMATS = (".csv", ".jsonl", ".parquet")
OUTPUT_FORMATS = ("rows", "coco")
COCO_SUFFIX = ".json"
COLUMNS = ("image", "label", "class_index", "score", "x1", "y1", "x2", "y2", "error")
COORDINATE_DECIMALS = 4  # pixels of the image, to a ten-thousandth
SCORE_DECIMALS = 6


@dataclass
class DetectBatchOptions(ImageBatchOptions):
    """What a detector's --input path takes from the Config (the segmenter's and its own)."""

    output_format: str = "rows"  # rows: one row per box (--output .csv/.jsonl/.parquet); coco
    min_score: float = 0.0

    @property
    def overlay_dir(self) -> Path | None:
        """With --overlay: beside --output, OUTPUT-STEM_overlays (the segmenter's default)."""
        return default_overlay_dir(self.output) if self.overlay else None

    @property
    def images_json(self) -> Path | None:
        """With --output_format coco: the images' file (images_json_path)."""
        return images_json_path(self.output) if self.output_format == "coco" else None


@dataclass
class ImageDetections:
    """One image's detections in its own pixels, in the graph's order (best first): boxes
    (k, 4) xyxy float64, their scores (k,) and class indices (k,); or the reason it could not
    be predicted (no size, no boxes)."""

    id: str
    height: int | None = None
    width: int | None = None
    boxes: np.ndarray = field(default_factory=lambda: np.zeros((0, 4)))
    scores: np.ndarray = field(default_factory=lambda: np.zeros(0))
    classes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    error: str = ""


@dataclass
class DetectRun(ImageRun):
    """The counts of a run, for its report section (the images': ImageRun's)."""

    classes: int
    boxes: int = 0
    without_detections: int = 0
    boxes_per_class: np.ndarray | None = None

    def add(self, results: Sequence[ImageDetections]) -> None:
        if self.boxes_per_class is None:
            self.boxes_per_class = np.zeros(self.classes, np.int64)
        for result in results:
            if not self.counted(result.id, result.error):
                continue
            self.boxes += len(result.scores)
            self.without_detections += len(result.scores) == 0
            self.boxes_per_class += np.bincount(result.classes, minlength=self.classes)

    @property
    def with_detections(self) -> int:
        """The images predicted with at least one box."""
        return self.predicted - self.without_detections


# ----------------------------------------------------------------------------- checks


def check_options(options: DetectBatchOptions, labels: Sequence[str]) -> None:
    """Before anything is read or written: the output's format and suffix, the batch size,
    --min_score and the overlay folder (exit 2); a bundle without classes (exit 4); an input
    that exists (exit 3)."""
    coco = options.output_format == "coco"
    if options.output_format not in OUTPUT_FORMATS:
        raise ConfigError(f"--output_format {options.output_format!r} is not one of "
                          f"{', '.join(OUTPUT_FORMATS)}", "give rows or coco")
    if options.output.suffix.lower() not in ((COCO_SUFFIX,) if coco else ROW_FORMATS):
        raise ConfigError(f"--output {options.output} is not a "
                          f"{'.json' if coco else '.csv, .jsonl or .parquet'} file",
                          "give a path ending in .json (--output_format coco)" if coco else
                          "give a path ending in .csv, .jsonl or .parquet")
    if options.batch_size < 1:
        raise ConfigError(f"--batch_size must be at least 1, not {options.batch_size}",
                          "give a positive batch size")
    if not 0 <= options.min_score <= 1:
        raise ConfigError(f"invalid --min_score {options.min_score!r}", "use a value from 0 to 1")
    if not labels:
        raise ExportError("the bundle lists no class", "check the bundle's manifest")
    if not options.input.exists():
        raise DataError(f"input {options.input} does not exist", "check the path")
    for path in filter(None, (options.images_json, options.errors)):
        if options.input.is_file() and same_file(path, options.input):
            raise ConfigError(f"{path} is the input {options.input}", "give another --output")
    if options.images_json is not None and options.errors is not None \
            and same_file(options.images_json, options.errors):
        raise ConfigError(f"--errors {options.errors} is the COCO images file",
                          "give --errors another path")
    if options.overlay_dir is not None:
        check_overlay_dir(options)


def check_overlay_dir(options: DetectBatchOptions) -> None:
    """The overlays' folder: a folder (or one that can be made), neither holding the input nor
    inside it, and none of the outputs (exit 2)."""
    folder, source = options.overlay_dir, options.input
    refuse_linked_folder(folder, "the overlay folder", "overlays",
                         "remove the link, or give --output another name")
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"the overlay folder {folder} is a file", "move it away, or give "
                          "--output another name (the overlays go to OUTPUT-STEM_overlays)")
    outputs = filter(None, (options.output, options.errors, options.images_json))
    if any(same_file(folder, path) for path in outputs):
        raise ConfigError(f"the overlay folder {folder} is the path of an output file",
                          "give --output or --errors another name")
    if source.is_dir() and (same_file(folder, source) or inside(folder, source)
                            or inside(source, folder)):
        raise ConfigError(f"the overlay folder {folder} and the input folder {source} overlap: "
                          "the overlays would mix with the images (and be read as input next "
                          "time)", "write --output outside the input folder")
    if source.is_file() and same_file(folder / Path(source.name).with_suffix(".png"), source):
        raise ConfigError(f"the overlay folder {folder} would overwrite the input {source}",
                          "give --output another folder")
    problem = unwritable(folder / "overlay.png")
    if problem:
        raise ConfigError(f"the overlay folder {folder} cannot be written: {problem}",
                          "choose a writable --output location")


# ----------------------------------------------------------------------------- listing


def listed_detection_images(source: Path, overlay: bool) -> list[Listed]:
    """The segmenter's listing (listed_images: sorted, hidden files left out; each image's id
    its path relative to the folder, or the file's name), its `name` the overlay's relative
    path. Two images whose overlays would share a name are an error row only with --overlay;
    a file name that is not valid UTF-8 always is."""
    listed = listed_images(source, TASK.name)
    for item in listed:
        if item.name is None and utf8_name(item.path):  # a clash of overlay names
            item.error = item.error.replace("its mask name", "its overlay name") if overlay \
                else ""
    return listed


def checked_listing(options: DetectBatchOptions, labels: Sequence[str]) -> list[Listed]:
    """The options checked (check_options) and the input's images listed, before any image is
    read or any file written; no image at all is a DataError (exit 3)."""
    check_options(options, labels)
    listed = listed_detection_images(options.input, options.overlay)
    if not listed:
        raise DataError(f"{options.input} holds no image to detect objects in; "
                        f"{options.output} was left as it was", "give an image or a folder of "
                        f"{'/'.join(IMAGE_EXTENSIONS)} files")
    if options.overlay_dir is not None:
        refuse_linked_subfolders([options.overlay_dir], listed)
    return listed


# ----------------------------------------------------------------------------- predicting


def checked_detections(found: Detections, classes: int) -> Detections:
    """One image's (boxes (k, 4), scores (k,), class indices (k,)) from the runner, as float64,
    float64 and int64; anything else (shapes, a class outside 0..classes-1, a value that is not
    finite) is an ExportError (exit 4)."""
    try:
        boxes, scores, labels = (np.asarray(part) for part in found)
        count = len(scores)
    except (TypeError, ValueError) as err:
        raise ExportError(f"the model's detections are not (boxes, scores, labels): {err}",
                          "check the bundle's graph") from err
    if boxes.shape != (count, 4) or scores.shape != (count,) or labels.shape != (count,):
        raise ExportError(f"the model's detections have the shapes {boxes.shape}, "
                          f"{scores.shape}, {labels.shape}, not (k, 4), (k,), (k,)",
                          "check the bundle's graph")
    if count and (labels.min() < 0 or labels.max() >= classes):
        raise ExportError(f"the model detected class {int(labels.max())} (or "
                          f"{int(labels.min())}), outside its {classes} classes",
                          "check the bundle's graph and labels")
    if not (np.isfinite(boxes).all() and np.isfinite(scores).all()):
        raise ExportError("the model's boxes or scores hold NaN or infinity",
                          "check the bundle's graph")
    return boxes.astype(np.float64), scores.astype(np.float64), labels.astype(np.int64)


def scaled_boxes(boxes: np.ndarray, model_size: Sequence[int], size: Sequence[int]
                 ) -> np.ndarray:
    """xyxy boxes in the model's input pixels (height H, width W), clipped to it, in the
    image's own pixels (height H0, width W0): x times W0 / W, y times H0 / H."""
    height, width = model_size
    own_height, own_width = size
    limits = np.array([width, height, width, height], np.float64)
    factors = np.array([own_width / width, own_height / height] * 2, np.float64)
    return np.clip(np.asarray(boxes, np.float64).reshape(-1, 4), 0.0, limits) * factors


def write_overlay(path: Path, pixels: np.ndarray, result: ImageDetections,
                  labels: Sequence[str]) -> None:
    """The image ((3, H0, W0) in [0, 1]) with its boxes drawn (overlay.draw_overlay), as a
    PNG at `path`, atomically."""
    picture = draw_overlay(rgb_picture(pixels), result.boxes, result.classes, labels,
                           result.scores)
    try:
        atomic_write(path, lambda tmp: picture.save(tmp, format="PNG"))
    except OSError as err:
        raise ConfigError(f"cannot write {path}: {err.strerror or err}",
                          "choose a writable --output location") from err


@dataclass
class Predicting:
    """What each batch needs: the options, the model's preprocessing, its labels and run."""

    options: DetectBatchOptions
    preprocessing: dict
    labels: Sequence[str]
    run: DetectionRunner

    def batch(self, items: Sequence[Listed]) -> list[ImageDetections]:
        """One batch: decoded, predicted in one call, each image's boxes scaled back to its
        size (and its overlay written); results in input order (the segmenter's
        predicted_batch)."""
        return predicted_batch(items, self.preprocessing,
                               lambda item, error: ImageDetections(item.id, error=error),
                               self._predicted)

    def _predicted(self, x: np.ndarray, items: list[Listed], sizes: list[tuple[int, int]]
                   ) -> list[ImageDetections]:
        return [self._result(item, found, x.shape[-2:], size)
                for item, found, size in zip(items, self._detections(x), sizes)]

    def _detections(self, x: np.ndarray) -> list[Detections]:
        found = list(self.run(x))
        if len(found) != len(x):
            raise ExportError(f"the model returned detections for {len(found)} images of a "
                              f"batch of {len(x)}", "check the bundle's graph")
        return [checked_detections(one, len(self.labels)) for one in found]

    def _result(self, item: Listed, found: Detections, model_size: Sequence[int],
                size: tuple[int, int]) -> ImageDetections:
        """One image's detections above --min_score in its own pixels (its overlay written)."""
        boxes, scores, classes = found
        keep = scores >= self.options.min_score
        result = ImageDetections(item.id, size[0], size[1],
                                 scaled_boxes(boxes[keep], model_size, size), scores[keep],
                                 classes[keep])
        if self.options.overlay_dir is not None:
            try:
                pixels = original_pixels(item.path, size, self.preprocessing)
            except Exception as err:  # noqa: BLE001 - the file changed or fails at its size
                return ImageDetections(item.id, error=unreadable(err, item.path))
            write_overlay(file_in_folder(self.options.overlay_dir, item.name), pixels, result,
                          self.labels)
        return result


# ----------------------------------------------------------------------------- the outputs


def _rounded(value: float, decimals: int) -> float:
    return round(float(value), decimals)


class RowWriter(RecordWriter):
    """--output_format rows: one row per box to CSV, JSONL or Parquet (by the output's suffix)
    in an open temporary file: image, label, class_index, score (6 decimals), x1, y1, x2, y2
    (the image's own pixels, 4 decimals), error (""). An image that could not be predicted is
    one row with its reason in `error` and the other cells empty (CSV) or null."""

    def __init__(self, handle, fmt: str, labels: Sequence[str]) -> None:
        super().__init__(handle, fmt, COLUMNS)
        self.labels = list(labels)

    def _records(self, result: ImageDetections) -> list[dict]:
        if result.error:
            return [{**dict.fromkeys(COLUMNS), "image": result.id, "error": result.error}]
        return [{"image": result.id, "label": self.labels[c], "class_index": int(c),
                 "score": _rounded(s, SCORE_DECIMALS),
                 **{name: _rounded(v, COORDINATE_DECIMALS)
                    for name, v in zip(("x1", "y1", "x2", "y2"), box)}, "error": ""}
                for box, s, c in zip(result.boxes, result.scores, result.classes)]

    def write(self, results: Sequence[ImageDetections]) -> None:
        self.write_records([record for result in results for record in self._records(result)])

    def schema(self):
        import pyarrow as pa

        return pa.schema([("image", pa.string()), ("label", pa.string()),
                          ("class_index", pa.int64()), ("score", pa.float64()),
                          *((name, pa.float64()) for name in ("x1", "y1", "x2", "y2")),
                          ("error", pa.string())])


class CocoWriter:
    """--output_format coco, to two open temporary files. `handle`: COCO's results format, one
    JSON list of {"image_id", "category_id", "bbox": [x, y, width, height], "score"} (the
    image's own pixels, x, y its top-left corner), what pycocotools' COCO.loadRes and COCO's
    evaluation servers read. `images`: {"categories": [{"id", "name"}], "images": [{"id",
    "file_name", "height", "width"}]}, the images' part of a COCO dataset file: "id" is the
    image's index in the sorted listing (0, 1, ...; the results' image_id), "file_name" its id
    in the rows format (its path relative to --input); an image that could not be predicted
    has "error" (its reason) in place of its size. category_id is class_index + 1: COCO's
    ids start at 1, and the categories list names each. `entries`: the images written so far
    (the next one's id)."""

    def __init__(self, handle, images, labels: Sequence[str]) -> None:
        self.handle, self.images = handle, images
        self.results = self.entries = 0
        categories = [{"id": k + 1, "name": label} for k, label in enumerate(labels)]
        handle.write("[")
        images.write('{"categories": ' + json.dumps(categories, ensure_ascii=False)
                     + ',\n "images": [')

    def write(self, results: Sequence[ImageDetections]) -> None:
        entries, found = [], []
        for image_id, result in enumerate(results, start=self.entries):
            entry = {"id": image_id, "file_name": result.id}
            entry.update({"error": result.error} if result.error
                         else {"height": result.height, "width": result.width})
            entries.append(entry)
            found += [{"image_id": image_id, "category_id": int(c) + 1,
                       "bbox": [_rounded(v, COORDINATE_DECIMALS)
                                for v in (x1, y1, x2 - x1, y2 - y1)],
                       "score": _rounded(s, SCORE_DECIMALS)}
                      for (x1, y1, x2, y2), s, c in
                      zip(result.boxes, result.scores, result.classes)]
        self.entries = _append_items(self.images, entries, self.entries)
        self.results = _append_items(self.handle, found, self.results)

    def close(self) -> None:
        self.handle.write("\n]\n" if self.results else "]\n")
        self.images.write("\n]}\n" if self.entries else "]}\n")

    def abandon(self) -> None:
        """Nothing to let go of: the temporary files are removed with their streams."""


def _append_items(handle, items: Sequence[dict], written: int) -> int:
    """`items` appended to a JSON list being written (`written` items so far); the new count."""
    if items:
        handle.write(("," if written else "") + ",".join(
            "\n" + json.dumps(item, ensure_ascii=False) for item in items))
    return written + len(items)


# ----------------------------------------------------------------------------- the run


def predict_detections_input(options: DetectBatchOptions, preprocessing: dict,
                             labels: list[str], run: DetectionRunner, report: dict) -> None:
    """--input → the detections at --output (one row per box, or a COCO results JSON and its
    images file: RowWriter, CocoWriter) and, with --overlay, each image with its boxes drawn
    under OUTPUT-STEM_overlays (its path under --input, suffix .png); the run's section in
    report["predictions"] (report_section), stored before a failure for error rows is raised.
    `run` maps a float32 batch (N, C, H, W) at the training size to N (boxes (M, 4) xyxy in
    its pixels, scores (M,), class indices (M,)) (evaluate.detection_runner). Raises DataError
    (exit 3) when the input holds no image or none could be predicted (the previous output
    left as it was), or when some could not without --allow_errors (the output written)."""
    listed = checked_listing(options, labels)
    predicting = Predicting(options, preprocessing, list(labels), run)
    tally = write_detections(
        options, labels, predicted_batches(listed, options, "detect", predicting.batch), report)
    raise_for_errors(options, tally)


def _open_writer(stack: contextlib.ExitStack, options: DetectBatchOptions,
                 labels: Sequence[str]) -> RowWriter | CocoWriter:
    """The output's writer on temporary files that `stack` moves into place when it closes
    without an error (and removes otherwise)."""
    fmt = options.output.suffix.lower().lstrip(".")
    handle = stack.enter_context(atomic_write_stream(options.output, binary=fmt == "parquet"))
    if options.images_json is not None:
        images = stack.enter_context(atomic_write_stream(options.images_json))
        return CocoWriter(handle, images, labels)
    return RowWriter(handle, fmt, labels)


def write_detections(options: DetectBatchOptions, labels: Sequence[str],
                     result_batches: Iterable[Sequence[ImageDetections]],
                     report: dict | None) -> DetectRun:
    """The results, batch after batch in input order (the images numbered in that order from
    0), to --output (and the COCO images file), temporary files moved into place at the end
    (left as they were when no image could be predicted, a DataError), and the error rows to
    --errors; the run's counts (its section in report["predictions"] when `report` is given).
    Whatever makes the results (this process, Ray workers) has written their overlays."""
    tally = DetectRun(len(labels))
    section = write_results(options, lambda stack: _open_writer(stack, options, labels),
                            result_batches, tally, "predicted",
                            lambda seconds: report_section(options, labels, tally, seconds),
                            report)
    LOG.info("found %d boxes in %d of %d images into %s (%.1f images/s)%s", tally.boxes,
             tally.with_detections, tally.images, options.output,
             section["images_per_second"] or 0.0,
             f", {tally.errors} failed" if tally.errors else "")
    return tally


def raise_for_errors(options: DetectBatchOptions, tally: DetectRun) -> None:
    """Error rows without --allow_errors: a DataError (exit 3) once everything is written."""
    raise_for_error_rows(options, tally.errors, tally.images, "images", "predicted",
                         f"the other detections are in {options.output}")


def report_section(options: DetectBatchOptions, labels: Sequence[str], tally: DetectRun,
                   seconds: float) -> dict:
    """The report's `predictions` for a detector's --input."""
    per_class = (tally.boxes_per_class if tally.boxes_per_class is not None
                 else np.zeros(len(labels), np.int64))
    return {"input": str(options.input), "output": str(options.output),
            "output_format": options.output_format,
            "images_json": None if options.images_json is None else str(options.images_json),
            "overlay_dir": None if options.overlay_dir is None else str(options.overlay_dir),
            "min_score": options.min_score, **tally.counts(options.errors),
            "boxes": tally.boxes, "images_with_detections": tally.with_detections,
            "images_without_detections": tally.without_detections,
            "boxes_per_class": {label: int(n) for label, n in zip(labels, per_class)},
            **tally.rate(seconds)}
