"""What the detection readers (yolo.py, coco.py, data.py) share: an image and its boxes as
listed (Item), the bad input counted with its reason (Tally: Dataset.skipped and
Dataset.dropped), the reasons' words, and bounded reads of the files a user names.

Each reason says what happened to the thing it counts: an image left out (Dataset.skipped names
its file), a box left out, a box clipped or an image kept as background-only (records with
`kept` true), or a label file no image uses. No torch here.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from utils import LOG, ConfigError, DataError, first_line

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
# Counted, and kept.
CLIPPED = "box clipped to the image"
NO_LABEL_FILE = "image without a label file (kept as background)"
NO_ANNOTATIONS = "image without annotations (kept as background)"
# A file no image uses.
NO_IMAGE = "label file without an image"

KEPT = frozenset({CLIPPED, NO_LABEL_FILE, NO_ANNOTATIONS})
NO_BOXES = np.zeros((0, 5), dtype=np.float32)


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
class Tally:
    """The bad input, counted: `skipped` the image files left out (Dataset.skipped), and one
    record per file and reason (Dataset.dropped), as segment's Skips."""

    skipped: list[str] = field(default_factory=list)
    names: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    details: dict[tuple[str, str], str] = field(default_factory=dict)

    def add(self, where: str | Path, reason: str, name: str, detail: str = "",
            image: Path | str | None = None) -> None:
        """Count `name` under (where, reason); `image`: the image file (or record) left out."""
        key = (str(where), reason)
        self.names.setdefault(key, []).append(name)
        if image is not None:
            self.skipped.append(str(image))
        if detail:
            self.details.setdefault(key, f"{name}: {detail}")

    def count(self, reason: str | None = None) -> int:
        return sum(len(names) for (_, why), names in self.names.items()
                   if reason is None or why == reason)

    def summary(self) -> str:
        """'3 with an unreadable image, 1 with a zero-area box' (every file together)."""
        totals: Counter = Counter()
        for (_, reason), names in self.names.items():
            totals[reason] += len(names)
        return ", ".join(f"{n} with {_a(reason)}" for reason, n in totals.most_common())

    def records(self) -> list[dict]:
        """One record per file and reason, each with one WARNING naming the first few."""
        out = []
        for (where, reason), names in self.names.items():
            first = names[:SHOWN]
            more = f" and {len(names) - len(first)} more" if len(names) > len(first) else ""
            said = self.details.get((where, reason))
            detail = f" (first: {said})" if said else ""
            LOG.warning("%s: %d with %s (%s%s)%s", where, len(names), _a(reason),
                        ", ".join(first), more, detail)
            out.append({"file": where, "reason": reason, "count": len(names),
                        "first_rows": first, "kept": reason in KEPT})
        return out


class Skip(Exception):
    """An image that cannot be used, and why."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


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
    folder = Path(path)
    if not folder.exists():
        raise DataError(f"{what} {folder} does not exist", "check the path")
    if not folder.is_dir():
        raise ConfigError(f"{what} {folder} is not a folder; object_detector reads a folder of "
                          "images", hint)
    return folder
