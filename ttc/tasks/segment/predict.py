"""Batch inference for a segmenter (issue 43, item 6): an image or a folder of images (recursive)
→ one mask PNG per image at the image's own size (masks.py: palette PNGs of class indices in
the VOC colours), optionally a coloured overlay per image, and a summary table with one row per
image (its id, its mask's path, its size, each class's share of its pixels, and the reason it
failed, if it did) in CSV, JSONL or Parquet by the output's suffix, as the classifiers' --output.

Each image is decoded as the model was trained (preprocess.decode_image_file: the bundle's
channels, resized to its image size), predicted a batch at a time by `run` (the graph's "mask"
output), and its mask resized back to the image's size with nearest-neighbour sampling. Memory
stays bounded by one batch: nothing is held for the whole folder but the list of its paths.
Masks and overlays are written atomically one by one, the summary to a temporary file moved
into place at the end. An unreadable image is an error row (batch.py's conventions: counted,
listed in --errors, a failed run without --allow_errors). numpy and Pillow (pyarrow for
Parquet) only: inference's path imports no torch.
"""
from __future__ import annotations

import contextlib
import csv
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from ttc.inputs.preprocess import decode_image_file
from ttc.inputs.tables import IMAGE_EXTENSIONS
from ttc.serving.batch import (abandon_parquet, folder_images, neutralised, printable_name,
                               utf8_name, write_errors)
from ttc.tasks.segment.masks import PALETTE_CLASSES, class_shares, write_mask, write_overlay
from utils import (LOG, ConfigError, DataError, ExportError, atomic_write_stream, first_line,
                   inside, progress, raise_if_interrupted, same_file, unwritable)

SUMMARY_FORMATS = (".csv", ".jsonl", ".parquet")
MASK_SUFFIX = ".png"
EXIF_ORIENTATION = 0x0112
TRANSPOSED_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that swap width and height
Runner = Callable[[np.ndarray], np.ndarray]


def default_mask_dir(output: Path) -> Path:
    """Where the masks go unless --mask_dir says: OUTPUT's folder / OUTPUT-STEM_masks."""
    output = Path(output)
    return output.parent / f"{output.stem}_masks"


def default_overlay_dir(output: Path) -> Path:
    """Where the overlays go with the default mask folder: OUTPUT's folder /
    OUTPUT-STEM_overlays (in general the mask folder's sibling of that name)."""
    output = Path(output)
    return output.parent / f"{output.stem}_overlays"


@dataclass
class SegmentBatchOptions:
    """What a segmenter's --input path takes from the Config."""

    input: Path
    output: Path
    mask_dir: Path | None = None  # None: default_mask_dir(output)
    overlay: bool = False
    batch_size: int = 16
    errors: Path | None = None
    allow_errors: bool = False
    show_progress: bool = True

    def __post_init__(self) -> None:
        self.input, self.output = Path(self.input), Path(self.output)
        self.mask_dir = (default_mask_dir(self.output) if self.mask_dir is None
                         else Path(self.mask_dir))
        self.errors = None if self.errors is None else Path(self.errors)

    @property
    def overlay_dir(self) -> Path | None:
        """The overlays' folder (with --overlay): the mask folder's sibling OUTPUT-STEM_overlays."""
        if not self.overlay:
            return None
        return self.mask_dir.parent / f"{self.output.stem}_overlays"


@dataclass
class Listed:
    """One image of the input: its id, its file, the relative path its mask (and overlay) takes
    under their folders, or the reason it cannot be predicted ("" none)."""

    id: str
    path: Path
    name: Path | None
    error: str = ""


@dataclass
class SummaryRow:
    id: str
    mask: str = ""
    height: int | None = None
    width: int | None = None
    shares: np.ndarray | None = None  # (classes,), None for an error row
    error: str = ""


@dataclass
class SegmentRun:
    """The counts of a run, for its report section."""

    images: int = 0
    predicted: int = 0
    errors: int = 0
    share_sums: np.ndarray | None = None
    error_rows: list[tuple[str, str]] = field(default_factory=list)

    def add(self, rows: Sequence[SummaryRow]) -> None:
        for row in rows:
            self.images += 1
            if row.error:
                self.errors += 1
                self.error_rows.append((row.id, row.error))
                continue
            self.predicted += 1
            self.share_sums = row.shares.copy() if self.share_sums is None \
                else self.share_sums + row.shares


# ----------------------------------------------------------------------------- checks


def check_options(options: SegmentBatchOptions, labels: Sequence[str]) -> None:
    """Before anything is read or written: the output's format, the batch size, the classes a
    mask PNG can hold, and folders for the masks and overlays that are folders (or can be made)
    and mix neither with the input nor with each other (exit 2); an input that exists (exit 3)."""
    if options.output.suffix.lower() not in SUMMARY_FORMATS:
        raise ConfigError(f"--output {options.output} is not a .csv, .jsonl or .parquet file",
                          "give a path ending in .csv, .jsonl or .parquet")
    if options.batch_size < 1:
        raise ConfigError(f"--batch_size must be at least 1, not {options.batch_size}",
                          "give a positive batch size")
    if not 1 <= len(labels) <= PALETTE_CLASSES:
        raise ConfigError(f"a mask PNG holds 1 to {PALETTE_CLASSES} classes, and this model "
                          f"has {len(labels)}", "segment with at most 256 classes")
    if not options.input.exists():
        raise DataError(f"input {options.input} does not exist", "check the path")
    folders = {"--mask_dir": options.mask_dir}
    if options.overlay_dir is not None:
        folders["the overlay folder"] = options.overlay_dir
    for name, folder in folders.items():
        _check_folder(name, folder, options)
    if options.overlay_dir is not None:
        mask_dir, overlay_dir = options.mask_dir, options.overlay_dir
        if same_file(mask_dir, overlay_dir) or inside(mask_dir, overlay_dir) or \
                inside(overlay_dir, mask_dir):
            raise ConfigError(f"--mask_dir {mask_dir} and the overlay folder {overlay_dir} "
                              "overlap: overlays would replace masks",
                              "give --mask_dir a folder of its own")


def _check_folder(name: str, folder: Path, options: SegmentBatchOptions) -> None:
    source = options.input
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{name} {folder} is a file, not a folder", "give a folder")
    if same_file(folder, options.output) or (options.errors is not None
                                             and same_file(folder, options.errors)):
        raise ConfigError(f"{name} {folder} is the same path as the summary or --errors file",
                          "give the masks and overlays folders of their own")
    if source.is_dir() and (same_file(folder, source) or inside(folder, source)):
        raise ConfigError(f"{name} {folder} is the input folder {source} or inside it: the masks "
                          "would mix with the images (and be read as input next time)",
                          "give a folder outside the input")
    if source.is_dir() and inside(source, folder):
        raise ConfigError(f"{name} {folder} holds the input folder {source}: the masks would "
                          "mix with the images", "give a folder outside the input")
    if source.is_file() and same_file(folder / Path(source.name).with_suffix(MASK_SUFFIX),
                                      source):
        raise ConfigError(f"{name} {folder} would overwrite the input {source} with its mask",
                          "give another folder")
    problem = unwritable(folder / "mask.png")
    if problem:
        raise ConfigError(f"{name} {folder} cannot be written: {problem}",
                          "choose a writable location")


# ----------------------------------------------------------------------------- listing


def listed_images(source: Path) -> list[Listed]:
    """The images of an image file or a folder (recursive, sorted, hidden ones left out), each
    with its id (the path relative to the folder, or the file's name) and its mask's relative
    path: the image's with the suffix .png, keeping the folder structure; where two images of
    one folder share a stem (a.jpg, a.png), each whose suffix is not exactly .png keeps it
    (a.jpg.png). A name still taken, or not valid UTF-8, makes an error row."""
    files = folder_images(source)
    relative = [p.relative_to(source) if source.is_dir() else Path(p.name) for p in files]
    plain = [r.with_suffix(MASK_SUFFIX) for r in relative]
    counts: dict[Path, int] = {}
    for name in plain:
        counts[name] = counts.get(name, 0) + 1
    taken: set[Path] = set()
    listed = []
    for path, rel, name in zip(files, relative, plain):
        if not utf8_name(path):
            listed.append(Listed(printable_name(rel), path, None,
                                 "the file name is not valid UTF-8; rename the file"))
            continue
        if counts[name] > 1 and rel.suffix != MASK_SUFFIX:
            name = rel.with_name(rel.name + MASK_SUFFIX)
        if name in taken:
            listed.append(Listed(rel.as_posix(), path, None,
                                 f"its mask name {name.as_posix()} is another image's; rename "
                                 "the file"))
            continue
        taken.add(name)
        listed.append(Listed(rel.as_posix(), path, name))
    return listed


def batches(items: Sequence[Listed], size: int) -> Iterator[Sequence[Listed]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


# ----------------------------------------------------------------------------- images


def original_size(path: Path) -> tuple[int, int]:
    """(height, width) of an image as decode_image_file sees it (after its EXIF orientation)."""
    from PIL import Image

    with Image.open(path) as img:
        width, height = img.size
        orientation = img.getexif().get(EXIF_ORIENTATION)
    return (width, height) if orientation in TRANSPOSED_ORIENTATIONS else (height, width)


def resized_mask(mask: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """A (h, w) mask of class indices (< 256) at (height, width), nearest-neighbour (Pillow)."""
    from PIL import Image

    height, width = size
    small = np.ascontiguousarray(mask, dtype=np.uint8)
    if small.shape == (height, width):
        return small
    return np.asarray(Image.fromarray(small).resize((width, height), Image.Resampling.NEAREST))


def original_pixels(path: Path, size: tuple[int, int], preprocessing: dict) -> np.ndarray:
    """The image at its own size in colour ((3, H, W) in [0, 1]; a gray image repeated), decoded
    by the model's rules: what an overlay is drawn on."""
    return decode_image_file(path, {**preprocessing, "image_size": list(size), "channels": 3})


def unreadable(err: BaseException, path: Path) -> str:
    """batch.py's reason for an image that does not decode, without the full path."""
    return "unreadable image: " + first_line(err).replace(f" {str(path)!r}", "").replace(
        f" {path!r}", "")


# ----------------------------------------------------------------------------- predicting


@dataclass
class Predicting:
    """What each batch needs: the options, the model's preprocessing, its class count and run."""

    options: SegmentBatchOptions
    preprocessing: dict
    classes: int
    run: Runner

    def batch(self, items: Sequence[Listed]) -> list[SummaryRow]:
        """One batch: decoded, predicted in one call, each mask resized back and written; rows
        in input order."""
        rows: list[SummaryRow | None] = [None] * len(items)
        pixels, kept, sizes = [], [], []
        for k, item in enumerate(items):
            if item.error:
                rows[k] = SummaryRow(item.id, error=item.error)
                continue
            try:
                decoded = decode_image_file(item.path, self.preprocessing)
                size = original_size(item.path)
            except Exception as err:  # noqa: BLE001 - any decoder failure is this row's error
                rows[k] = SummaryRow(item.id, error=unreadable(err, item.path))
                continue
            pixels.append(decoded)
            sizes.append(size)
            kept.append(k)
        if kept:
            masks = self._masks(np.stack(pixels).astype(np.float32, copy=False))
            for k, mask, size in zip(kept, masks, sizes):
                rows[k] = self._written(items[k], resized_mask(mask, size), size)
        return rows  # type: ignore[return-value] - every slot is filled

    def batches(self, chunks: Iterable[Sequence[Listed]]) -> Iterator[list[SummaryRow]]:
        """Each chunk's rows (Predicting.batch), a stop asked for honoured before each."""
        for items in chunks:
            raise_if_interrupted()
            yield self.batch(items)

    def _masks(self, x: np.ndarray) -> np.ndarray:
        masks = np.asarray(self.run(x))
        expected = (x.shape[0], *x.shape[2:])
        if masks.shape != expected:
            raise ExportError(f"the model's mask has the shape {masks.shape} for a batch of "
                              f"{x.shape}, not {expected}", "check the bundle's graph")
        if masks.size and (masks.min() < 0 or masks.max() >= self.classes):
            raise ExportError(f"the model's mask holds class {int(masks.max())} (or "
                              f"{int(masks.min())}), outside its {self.classes} classes",
                              "check the bundle's graph and labels")
        return masks

    def _written(self, item: Listed, mask: np.ndarray, size: tuple[int, int]) -> SummaryRow:
        """The mask (and overlay) of one image written; its summary row."""
        options = self.options
        picture = None
        if options.overlay_dir is not None:
            try:
                picture = original_pixels(item.path, size, self.preprocessing)
            except Exception as err:  # noqa: BLE001 - the file changed or fails at its size
                return SummaryRow(item.id, error=unreadable(err, item.path))
        mask_path = options.mask_dir / item.name
        _write(mask_path, lambda: write_mask(mask_path, mask))
        if picture is not None:
            overlay_path = options.overlay_dir / item.name
            _write(overlay_path, lambda: write_overlay(overlay_path, picture, mask))
        shown = Path(os.path.relpath(mask_path.absolute(), options.output.absolute().parent))
        return SummaryRow(item.id, shown.as_posix(), size[0], size[1],
                          class_shares(mask, self.classes))


def _write(path: Path, write: Callable[[], object]) -> None:
    try:
        write()
    except OSError as err:
        raise ConfigError(f"cannot write {path}: {err.strerror or err}",
                          "choose a writable --mask_dir") from err


# ----------------------------------------------------------------------------- the summary


class SummaryWriter:
    """Summary rows to CSV, JSONL or Parquet (by the output's suffix) in an open temporary file:
    id, mask (relative to the summary's folder), height, width, share_<label> per class (6
    decimals), error. An error row has no mask ("") and no size or shares (empty, null)."""

    PARQUET_GROUP_ROWS = 65536

    def __init__(self, handle, fmt: str, labels: Sequence[str]) -> None:
        self.handle, self.fmt = handle, fmt
        self.share_columns = [f"share_{label}" for label in labels]
        self.columns = ["id", "mask", "height", "width", *self.share_columns, "error"]
        self.parquet = None
        self.pending: list[dict] = []
        if fmt == "csv":
            csv.writer(handle).writerow(self.columns)

    def _record(self, row: SummaryRow) -> dict:
        shares = ([None] * len(self.share_columns) if row.shares is None
                  else [round(float(s), 6) for s in row.shares])
        return {"id": row.id, "mask": row.mask, "height": row.height, "width": row.width,
                **dict(zip(self.share_columns, shares)), "error": row.error}

    def write(self, rows: Sequence[SummaryRow]) -> None:
        records = [self._record(row) for row in rows]
        if self.fmt == "csv":
            csv.writer(self.handle).writerows(
                [neutralised(v) if isinstance(v, str) else ("" if v is None else v)
                 for v in record.values()] for record in records)
        elif self.fmt == "jsonl":
            self.handle.write("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                      for r in records))
        else:
            self.pending += records
            if len(self.pending) >= self.PARQUET_GROUP_ROWS:
                self._flush()

    def _schema(self):
        import pyarrow as pa

        return pa.schema([("id", pa.string()), ("mask", pa.string()), ("height", pa.int64()),
                          ("width", pa.int64()),
                          *((name, pa.float64()) for name in self.share_columns),
                          ("error", pa.string())])

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = self._schema()
        if self.parquet is None:
            self.parquet = pq.ParquetWriter(self.handle, schema)
        if self.pending:
            self.parquet.write_table(pa.Table.from_pylist(self.pending, schema=schema))
            self.pending = []

    def close(self) -> None:
        if self.fmt == "parquet":
            self._flush()
            self.parquet.close()

    def abandon(self) -> None:
        abandon_parquet(self.parquet)


# ----------------------------------------------------------------------------- the run


def predict_images(options: SegmentBatchOptions, preprocessing: dict, labels: list[str],
                   run: Runner, report: dict | None = None) -> dict:
    """--input → a mask PNG per image under --mask_dir (and an overlay each with --overlay),
    and the summary table at --output; returns the run's report section (also stored as
    report["predictions"] when `report` is given, before a failure for error rows is raised).
    `run` maps a float32 batch (N, C, H, W) at the training size to masks (N, H, W) of class
    indices. Raises DataError (exit 3) when the input holds no image or none could be
    predicted (the previous summary left as it was), or when some could not without
    --allow_errors (the summary and masks written)."""
    listed = checked_listing(options, labels)
    predicting = Predicting(options, preprocessing, len(labels), run)
    steps = -(-len(listed) // options.batch_size)
    chunks = progress(batches(listed, options.batch_size), total=steps, desc="segment",
                      enabled=options.show_progress)
    tally, section = write_summary(options, labels, predicting.batches(chunks), report)
    raise_for_errors(options, tally)
    return section


def checked_listing(options: SegmentBatchOptions, labels: Sequence[str]) -> list[Listed]:
    """The options checked (check_options) and the input's images listed, before any image is
    read or any file written; no image at all is a DataError (exit 3)."""
    check_options(options, labels)
    listed = listed_images(options.input)
    if not listed:
        raise DataError(f"{options.input} holds no image to segment; {options.output} was "
                        "left as it was", "give an image or a folder of "
                        f"{'/'.join(IMAGE_EXTENSIONS)} files")
    return listed


def write_summary(options: SegmentBatchOptions, labels: Sequence[str],
                  row_batches: Iterable[Sequence[SummaryRow]], report: dict | None
                  ) -> tuple[SegmentRun, dict]:
    """The summary rows, batch after batch in input order, to --output (a temporary file moved
    into place at the end; left as it was when no image could be predicted, a DataError) and
    the error rows to --errors; the run's counts and report section (also report["predictions"]
    when `report` is given). Whatever makes the rows (this process, Ray workers) has written
    their masks."""
    fmt = options.output.suffix.lower().lstrip(".")
    tally = SegmentRun()
    started = time.perf_counter()
    with atomic_write_stream(options.output, binary=fmt == "parquet") as handle, \
            contextlib.ExitStack() as before_closing:
        writer = SummaryWriter(handle, fmt, labels)
        before_closing.callback(writer.abandon)
        for rows in row_batches:
            raise_if_interrupted()
            writer.write(rows)
            tally.add(rows)
        raise_if_interrupted()
        if tally.predicted == 0:  # raised inside the block: the previous summary stays
            _fail_without_predictions(tally, options)
        writer.close()
    seconds = time.perf_counter() - started
    if options.errors is not None:
        write_errors(str(options.errors), tally.error_rows)
    section = report_section(options, labels, tally, seconds)
    if report is not None:
        report["predictions"] = section
    LOG.info("segmented %d of %d images into %s (%.1f images/s)%s", tally.predicted,
             tally.images, options.mask_dir, section["images_per_second"] or 0.0,
             f", {tally.errors} failed" if tally.errors else "")
    return tally, section


def raise_for_errors(options: SegmentBatchOptions, tally: SegmentRun) -> None:
    """Error rows without --allow_errors: a DataError (exit 3) once everything is written."""
    if tally.errors and not options.allow_errors:
        where = (f"listed in {options.errors}" if options.errors
                 else "add --errors PATH to list them")
        raise DataError(f"{tally.errors} of {tally.images} images could not be segmented "
                        f"({where}); the other masks are in {options.mask_dir}",
                        "fix those images, or pass --allow_errors true")


def _fail_without_predictions(tally: SegmentRun, options: SegmentBatchOptions) -> None:
    if options.errors is not None:
        write_errors(str(options.errors), tally.error_rows)
    where = f"listed in {options.errors}" if options.errors else "add --errors PATH to list them"
    raise DataError(f"none of the {tally.images} images of {options.input} could be segmented "
                    f"({where}); {options.output} was left as it was",
                    "check that they are images Pillow can open")


def report_section(options: SegmentBatchOptions, labels: Sequence[str], tally: SegmentRun,
                   seconds: float) -> dict:
    means = (tally.share_sums / tally.predicted if tally.predicted
             else np.zeros(len(labels)))
    return {"input": str(options.input), "output": str(options.output),
            "mask_dir": str(options.mask_dir),
            "overlay_dir": None if options.overlay_dir is None else str(options.overlay_dir),
            "images": tally.images, "predicted": tally.predicted, "errors": tally.errors,
            "errors_path": None if options.errors is None else str(options.errors),
            "seconds": round(seconds, 3),
            "images_per_second": round(tally.predicted / seconds, 1) if seconds else None,
            "class_pixel_shares": {label: round(float(m), 6) for label, m in zip(labels, means)}}
