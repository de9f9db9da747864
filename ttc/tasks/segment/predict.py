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
import os
import time
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol, Sequence, TypeVar

import numpy as np

from ttc.inputs.preprocess import decode_image_file
from ttc.inputs.tables import IMAGE_EXTENSIONS
from ttc.serving.batch import (RecordWriter, fail_without_predictions, folder_images,
                               printable_name, raise_for_error_rows, utf8_name, write_errors)
from ttc.tasks.outputs import default_mask_dir, overlay_folder
from ttc.tasks.segment import TASK
from ttc.tasks.segment.masks import PALETTE_CLASSES, class_shares, write_mask, write_overlay
from utils import (LOG, ConfigError, DataError, ExportError, atomic_write_stream,
                   file_in_folder, first_line, inside, progress, raise_if_interrupted,
                   refuse_linked_folder, same_file, unwritable)

SUMMARY_FORMATS = (".csv", ".jsonl", ".parquet")
MASK_SUFFIX = ".png"
EXIF_ORIENTATION = 0x0112
TRANSPOSED_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that swap width and height
Runner = Callable[[np.ndarray], np.ndarray]
Result = TypeVar("Result")  # one image's outcome: a segmenter's SummaryRow, a detector's boxes


@dataclass
class ImageBatchOptions:
    """What an image model's --input path takes from the Config: what every one has (input and
    output, then these keyword-only), its own fields after `output` in a subclass."""

    input: Path
    output: Path
    _: KW_ONLY
    overlay: bool = False
    batch_size: int = 16
    errors: Path | None = None
    allow_errors: bool = False
    show_progress: bool = True

    def __post_init__(self) -> None:
        self.input, self.output = Path(self.input), Path(self.output)
        self.errors = None if self.errors is None else Path(self.errors)


@dataclass
class SegmentBatchOptions(ImageBatchOptions):
    """What a segmenter's --input path takes from the Config."""

    mask_dir: Path | None = None  # None: default_mask_dir(output)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mask_dir = (default_mask_dir(self.output) if self.mask_dir is None
                         else Path(self.mask_dir))

    @property
    def overlay_dir(self) -> Path | None:
        """The overlays' folder (with --overlay): the mask folder's sibling OUTPUT-STEM_overlays."""
        return overlay_folder(self.output, self.mask_dir) if self.overlay else None


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


@dataclass(kw_only=True)
class ImageRun:
    """What every image model's --input run counts (its model's own counts in a subclass):
    the images, those predicted, those that failed and their (id, reason) rows."""

    images: int = 0
    predicted: int = 0
    errors: int = 0
    error_rows: list[tuple[str, str]] = field(default_factory=list)

    def counted(self, id: str, error: str) -> bool:
        """One image counted; whether it was predicted (else its error row is kept)."""
        self.images += 1
        if error:
            self.errors += 1
            self.error_rows.append((id, error))
            return False
        self.predicted += 1
        return True

    def add(self, results: Sequence) -> None:
        raise NotImplementedError

    def counts(self, errors: Path | None) -> dict:
        """The report section's counts (`errors`: the --errors file)."""
        return {"images": self.images, "predicted": self.predicted, "errors": self.errors,
                "errors_path": None if errors is None else str(errors)}

    def rate(self, seconds: float) -> dict:
        """The report section's time and images predicted per second."""
        return {"seconds": round(seconds, 3),
                "images_per_second": round(self.predicted / seconds, 1) if seconds else None}


@dataclass
class SegmentRun(ImageRun):
    """The counts of a run, for its report section."""

    share_sums: np.ndarray | None = None

    def add(self, rows: Sequence[SummaryRow]) -> None:
        for row in rows:
            if self.counted(row.id, row.error):
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
        if name != "--mask_dir" or folder == default_mask_dir(options.output):
            refuse_linked_folder(folder, name, "outputs", "remove the link, or give --output "
                                 "another name")  # chosen beside --output: a real folder
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


def listed_images(source: Path, model_type: str = TASK.name) -> list[Listed]:
    """The images of an image file or a folder (recursive, sorted, hidden ones left out), each
    with its id (the path relative to the folder, or the file's name) and its mask's relative
    path: the image's with the suffix .png, keeping the folder structure; where two images of
    one folder share a stem (a.jpg, a.png), each whose suffix is not exactly .png keeps it
    (a.jpg.png). A name still taken, or not valid UTF-8, makes an error row."""
    files = folder_images(source, model_type)
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


def predicted_batches(listed: Sequence[Listed], options: ImageBatchOptions, desc: str,
                      predict: Callable[[Sequence[Listed]], list[Result]]
                      ) -> Iterator[list[Result]]:
    """The listed images' results a --batch_size batch at a time (`predict`: one batch's, in
    input order) under a progress bar (`desc`), a stop asked for honoured before each batch."""
    steps = -(-len(listed) // options.batch_size)
    chunks = progress(batches(listed, options.batch_size), total=steps, desc=desc,
                      enabled=options.show_progress)
    for items in chunks:
        raise_if_interrupted()
        yield predict(items)


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


def predicted_batch(items: Sequence[Listed], preprocessing: dict,
                    failed: Callable[[Listed, str], Result],
                    predict: Callable[[np.ndarray, list[Listed], list[tuple[int, int]]],
                                      list[Result]]) -> list[Result]:
    """One batch's results in input order. Each image is decoded as the model was trained
    (decode_image_file) and its own size read (original_size); one listed with an error, or
    that does not decode, is `failed(item, reason)`. The others go to `predict` in one call:
    (their pixels stacked, float32 (n, C, H, W); their items; their sizes) → their results."""
    results: list[Result | None] = [None] * len(items)
    pixels, kept, sizes = [], [], []
    for k, item in enumerate(items):
        if item.error:
            results[k] = failed(item, item.error)
            continue
        try:
            decoded = decode_image_file(item.path, preprocessing)
            size = original_size(item.path)
        except Exception as err:  # noqa: BLE001 - any decoder failure is this row's error
            results[k] = failed(item, unreadable(err, item.path))
            continue
        pixels.append(decoded)
        sizes.append(size)
        kept.append(k)
    if kept:
        x = np.stack(pixels).astype(np.float32, copy=False)
        for k, result in zip(kept, predict(x, [items[k] for k in kept], sizes)):
            results[k] = result
    return results  # type: ignore[return-value] - every slot is filled


@dataclass
class Predicting:
    """What each batch needs: the options, the model's preprocessing, its class count and run."""

    options: SegmentBatchOptions
    preprocessing: dict
    classes: int
    run: Runner

    def batch(self, items: Sequence[Listed]) -> list[SummaryRow]:
        """One batch: decoded, predicted in one call, each mask resized back and written; rows
        in input order (predicted_batch)."""
        return predicted_batch(items, self.preprocessing,
                               lambda item, error: SummaryRow(item.id, error=error),
                               self._predicted)

    def _predicted(self, x: np.ndarray, items: list[Listed], sizes: list[tuple[int, int]]
                   ) -> list[SummaryRow]:
        return [self._written(item, resized_mask(mask, size), size)
                for item, mask, size in zip(items, self._masks(x), sizes)]

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
        mask_path = file_in_folder(options.mask_dir, item.name)
        _write(mask_path, lambda: write_mask(mask_path, mask))
        if picture is not None:
            overlay_path = file_in_folder(options.overlay_dir, item.name)
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


class SummaryWriter(RecordWriter):
    """Summary rows to CSV, JSONL or Parquet (by the output's suffix) in an open temporary file:
    id, mask (relative to the summary's folder), height, width, share_<label> per class (6
    decimals), error. An error row has no mask ("") and no size or shares (empty, null)."""

    def __init__(self, handle, fmt: str, labels: Sequence[str]) -> None:
        self.share_columns = [f"share_{label}" for label in labels]
        self.columns = ["id", "mask", "height", "width", *self.share_columns, "error"]
        super().__init__(handle, fmt, self.columns)

    def _record(self, row: SummaryRow) -> dict:
        shares = ([None] * len(self.share_columns) if row.shares is None
                  else [round(float(s), 6) for s in row.shares])
        return {"id": row.id, "mask": row.mask, "height": row.height, "width": row.width,
                **dict(zip(self.share_columns, shares)), "error": row.error}

    def write(self, rows: Sequence[SummaryRow]) -> None:
        self.write_records([self._record(row) for row in rows])

    def schema(self):
        import pyarrow as pa

        return pa.schema([("id", pa.string()), ("mask", pa.string()), ("height", pa.int64()),
                          ("width", pa.int64()),
                          *((name, pa.float64()) for name in self.share_columns),
                          ("error", pa.string())])


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
    tally, section = write_summary(
        options, labels, predicted_batches(listed, options, "segment", predicting.batch), report)
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
    refuse_linked_subfolders(filter(None, (options.mask_dir, options.overlay_dir)), listed)
    return listed


def refuse_linked_subfolders(folders: Iterable[Path], listed: Sequence[Listed]) -> None:
    """Before any file is written: no image's mask or overlay would go through a symbolic link
    to a folder inside its folder (file_in_folder, which each write checks again)."""
    parents = {item.name.parent for item in listed
               if item.name is not None and item.name.parent != Path(".")}
    for folder in folders:
        for parent in sorted(parents):
            file_in_folder(folder, parent / MASK_SUFFIX)


class ResultWriter(Protocol):
    """What write_results writes through: a segmenter's SummaryWriter, a detector's RowWriter
    or CocoWriter (on open temporary files)."""

    def write(self, results: Sequence) -> None: ...

    def close(self) -> None: ...

    def abandon(self) -> None: ...


def write_results(options: ImageBatchOptions,
                  open_writer: Callable[[contextlib.ExitStack], ResultWriter],
                  result_batches: Iterable[Sequence], tally: ImageRun, verb: str,
                  section_of: Callable[[float], dict], report: dict | None) -> dict:
    """The results, batch after batch in input order, through the writer `open_writer` makes on
    temporary files that its stack moves into place at the end (and removes after an error: an
    interrupt, or no image predicted, a DataError that leaves the previous outputs as they
    were); counted in `tally`; the error rows to --errors. Returns the run's report section
    (`section_of` the seconds it took), also stored as report["predictions"] when `report` is
    given. `verb`: what the model does to an image ("segmented")."""
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        writer = open_writer(stack)
        stack.callback(writer.abandon)  # an interrupt, an error: let go before the files go
        for results in result_batches:
            raise_if_interrupted()
            writer.write(results)
            tally.add(results)
        raise_if_interrupted()
        if tally.predicted == 0:  # raised inside the block: the previous outputs stay
            fail_without_predictions(options, tally.images, "images", verb, tally.error_rows,
                                     "check that they are images Pillow can open")
        writer.close()
    seconds = time.perf_counter() - started
    if options.errors is not None:
        write_errors(str(options.errors), tally.error_rows)
    section = section_of(seconds)
    if report is not None:
        report["predictions"] = section
    return section


def _open_writer(stack: contextlib.ExitStack, options: SegmentBatchOptions,
                 labels: Sequence[str]) -> SummaryWriter:
    """The summary's writer on a temporary file that `stack` moves into place when it closes
    without an error (and removes otherwise)."""
    fmt = options.output.suffix.lower().lstrip(".")
    handle = stack.enter_context(atomic_write_stream(options.output, binary=fmt == "parquet"))
    return SummaryWriter(handle, fmt, labels)


def write_summary(options: SegmentBatchOptions, labels: Sequence[str],
                  row_batches: Iterable[Sequence[SummaryRow]], report: dict | None
                  ) -> tuple[SegmentRun, dict]:
    """The summary rows, batch after batch in input order, to --output (a temporary file moved
    into place at the end; left as it was when no image could be predicted, a DataError) and
    the error rows to --errors; the run's counts and report section (also report["predictions"]
    when `report` is given). Whatever makes the rows (this process, Ray workers) has written
    their masks."""
    tally = SegmentRun()
    section = write_results(options, lambda stack: _open_writer(stack, options, labels),
                            row_batches, tally, "segmented",
                            lambda seconds: report_section(options, labels, tally, seconds),
                            report)
    LOG.info("segmented %d of %d images into %s (%.1f images/s)%s", tally.predicted,
             tally.images, options.mask_dir, section["images_per_second"] or 0.0,
             f", {tally.errors} failed" if tally.errors else "")
    return tally, section


def raise_for_errors(options: SegmentBatchOptions, tally: SegmentRun) -> None:
    """Error rows without --allow_errors: a DataError (exit 3) once everything is written."""
    raise_for_error_rows(options, tally.errors, tally.images, "images", "segmented",
                         f"the other masks are in {options.mask_dir}")


def report_section(options: SegmentBatchOptions, labels: Sequence[str], tally: SegmentRun,
                   seconds: float) -> dict:
    means = (tally.share_sums / tally.predicted if tally.predicted
             else np.zeros(len(labels)))
    return {"input": str(options.input), "output": str(options.output),
            "mask_dir": str(options.mask_dir),
            "overlay_dir": None if options.overlay_dir is None else str(options.overlay_dir),
            **tally.counts(options.errors), **tally.rate(seconds),
            "class_pixel_shares": {label: round(float(m), 6) for label, m in zip(labels, means)}}
