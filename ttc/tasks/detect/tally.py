"""What the detection readers (yolo.py, coco.py, data.py) share: an image and its boxes as
listed (Item), the bad input counted with its reason (Tally: Dataset.skipped and
Dataset.dropped), the reasons' words, and bounded reads of the files a user names.

Each reason says what happened to the thing it counts: an image left out (Dataset.skipped names
its file), a box left out, a box clipped or an image kept as background-only (records with
`kept` true), or a label file no image uses. No torch here.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from ttc.tasks.segment.data import Skip  # noqa: F401 - the readers' (yolo.py, coco.py), from here
from ttc.tasks.segment.data import ReasonCounts
from ttc.tasks.segment.data import data_folder as existing_folder
from utils import LOG, ConfigError, DataError, first_line, quoted, with_article

SHOWN = 10  # names a record lists
EDGE_SLACK = 1e-6  # a normalised coordinate this far outside [0, 1] is on the edge, not clipped

# An image left out (its file in Dataset.skipped).
UNREADABLE_IMAGE = "unreadable image"
DUPLICATE_STEM = "second image with one stem"
UNREADABLE_LABELS = "unreadable label file"
LARGE_LABELS = "label file over its size cap"
UNSAFE_NAME = "file_name outside the images folder"
MISSING_FILE = "image file missing"
MALFORMED_IMAGE = "malformed image record"
DUPLICATE_IMAGE_ID = "duplicate image id"
LISTED_TWICE = "image file listed twice"
SIZE_MISMATCH = "image of another size than its COCO record"
REFUSED_NAME = "file_name the file system refuses"
# A box left out.
MALFORMED_LINE = "malformed label line"
MALFORMED_ANNOTATION = "malformed annotation"
UNKNOWN_CLASS = "unknown class index"
UNKNOWN_CATEGORY = "unknown category"
ZERO_AREA = "zero-area box"
OUTSIDE = "box outside the image"
DUPLICATE_ANNOTATION_ID = "duplicate annotation id"
NO_IMAGE_RECORD = "annotation of a missing image"
CROWD = "crowd annotation"
REFUSED_NUMBER = "number out of range"
# Counted, and kept.
CLIPPED = "box clipped to the image"
NO_LABEL_FILE = "image without a label file (kept as background)"
NO_ANNOTATIONS = "image without annotations (kept as background)"
# A file no image uses.
NO_IMAGE = "label file without an image"

KEPT = frozenset({CLIPPED, NO_LABEL_FILE, NO_ANNOTATIONS})
NO_BOXES = np.zeros((0, 5), dtype=np.float32)
SHOWN_NAME_CHARACTERS = 200  # a longer name (or one with control characters) is shown quoted, cut


@dataclass
class Item:
    """One image and its boxes as listed, in one split. `boxes` (k, 5) float64 [class, x1, y1,
    x2, y2], normalised to [0, 1] (YOLO) or in the file's pixels (COCO, `normalised` False),
    not yet clipped; `sources` names each box for the tally ("labels/a.txt:3",
    "annotation 17")."""

    image: Path
    name: str  # the sample's id: the path under images/ (YOLO), the file_name (COCO)
    where: str  # the tally's file: the YOLO root, the COCO JSON
    boxes: np.ndarray
    sources: list[str]
    split: str = "train"
    normalised: bool = True
    declared: tuple[int, int] | None = None  # (height, width) a COCO record states


@dataclass
class Tally(ReasonCounts):
    """The bad input, counted: `skipped` the image files left out (Dataset.skipped), and one
    record per file and reason (Dataset.dropped), as segment's Skips (ReasonCounts: the
    summary, the records and their WARNINGs). An image that cannot be used raises Skip (the
    segmenter's) with its reason."""

    skipped: list[str] = field(default_factory=list)
    shown = SHOWN

    def add(self, where: str | Path, reason: str, name: str, detail: str = "",
            image: Path | str | None = None) -> None:
        """Count `name` under (where, reason); `image`: the image file (or record) left out."""
        self._count(where, reason, name, detail, name)
        if image is not None:
            self.skipped.append(str(image))

    def count(self, reason: str | None = None) -> int:
        return sum(len(names) for (_, why), names in self.names.items()
                   if reason is None or why == reason)

    def _warn(self, where: str, reason: str, names: list[str], first: str, detail: str) -> None:
        LOG.warning("%s: %d with %s (%s)%s", where, len(names), with_article(reason), first,
                    detail)

    def _record(self, where: str, reason: str, names: list[str], first: list[str]) -> dict:
        return {**super()._record(where, reason, names, first), "kept": reason in KEPT}


@contextlib.contextmanager
def refused_values(reason: str) -> Iterator[None]:
    """One record's processing: an OSError, ValueError or OverflowError raised by the record's
    own values (a file_name too long for the file system or holding a NUL byte, a number too
    large for a float) becomes Skip(reason), so that record is counted and left out, never the
    run."""
    try:
        yield
    except (OSError, ValueError, OverflowError) as err:
        detail = err.strerror if isinstance(err, OSError) and err.strerror else first_line(err)
        raise Skip(reason, detail[:120]) from err


def shown_name(name: str) -> str:
    """A name a record gives, as counts and WARNINGs show it: as it is, or quoted and cut when
    it is long or holds control characters (a NUL byte, a newline)."""
    if len(name) <= SHOWN_NAME_CHARACTERS and name.isprintable():
        return name
    return quoted(name, 60)


def read_bounded(path: Path, limit: int, what: str, hint: str) -> str:
    """A UTF-8 text file of at most `limit` bytes (read no further: a size the file system
    reports is not trusted); DataError (exit 3) over it or when it cannot be read."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except OSError as err:
        raise DataError(f"cannot read {what} {path}: {first_line(err)}", hint) from err
    if len(data) > limit:
        raise DataError(f"{what} {path} is over {size_words(limit)}", hint)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise DataError(f"{what} {path} is not UTF-8 text: {first_line(err)}", hint) from err


def size_words(limit: int) -> str:
    """1048576 → '1 MiB'; 1073741824 → '1 GiB'."""
    return f"{limit >> 30} GiB" if limit >= 1 << 30 else f"{limit >> 20} MiB"


def data_folder(path: str | Path, what: str, hint: str) -> Path:
    """A folder the user names: DataError (exit 3) when it does not exist, ConfigError (exit 2)
    when it is not a folder (a detector reads a folder of images)."""
    return existing_folder(path, what, "object_detector reads a folder of images", hint,
                           ConfigError)
