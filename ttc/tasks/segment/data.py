"""Semantic segmentation data: `ROOT/images/*` paired with `ROOT/masks/*` by file stem, split
and decoded by the image classifier's rules (ttc/inputs/data.py).

- A mask is a PNG of class indices, 8-bit gray ("L") or palette ("P", as Pascal VOC: its index
  values are read, never its colours). `ROOT/classes.txt` names the classes, one per line;
  without it they are 0..K-1, K = 1 + the largest index in the masks read. `ignore_index`
  (255) marks void pixels, kept as they are in `y`.
- Images are decoded by the classifier's decoder (`decode_image_file`: every Pillow mode, the
  channel rule, bilinear resize, [0, 1]); masks are resized with NEAREST, so no index appears
  that the mask did not hold. One training size: the most common among the training images
  (or --image_size).
- Splits: ROOT/train, ROOT/val, ROOT/test each with images/ and masks/ (given), or
  val_path/test_path roots, else cut from ROOT with the seeded val/test fractions (one class
  for assign_splits: a seeded shuffle and cut). ROOT's classes.txt names every split's classes.
- A bad pair is counted and skipped with its reason (`Dataset.skipped` holds its files,
  `Dataset.dropped` one record per reason); DataError (exit 3) when nothing is left.

No torch here.
"""
from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Collection, Sequence

import numpy as np

from ttc.inputs.data import (SPLITS, DataOptions, Dataset, Split, channel_stats, ImageItem,
                             scan_image_headers, assign_splits)
from ttc.inputs.limits import LIMITS, MIB, check_decoded_images, image_bytes, size_text
from ttc.inputs.preprocess import decode_image_file, image_files
from ttc.tasks.segment.canvases import (BUILTIN, BUILTIN_COUNT, BUILTIN_SEED, BUILTIN_SIZE,
                                        CLASS_NAMES, canvas_arrays)
from utils import (LOG, ConfigError, DataError, first_line, progress, quoted, quoted_sample,
                   with_article)

MODEL_TYPE = "image_segmenter"
KIND = "segmentation"
DEFAULT_IGNORE_INDEX = 255
MASK_MODES = ("L", "P")  # 8-bit gray, palette: both hold one 8-bit index per pixel
# Formats whose compression changes pixel values (a blend of two classes' indices at every edge:
# a phantom class), by the decoded format, whatever the file's suffix; WebP is lossy unless its
# image chunk is VP8L, TIFF where its compression is JPEG or WebP.
LOSSY_FORMATS = {"JPEG": "JPEG", "MPO": "JPEG (MPO)", "JPEG2000": "JPEG 2000", "AVIF": "AVIF",
                 "HEIF": "HEIF"}
LOSSY_TIFF_COMPRESSIONS = ("jpeg", "tiff_jpeg", "webp")
WEBP_CHUNKS_READ = 8  # a WebP file's first chunks: VP8X, ICCP, ALPH, ... then its image chunk
CLASSES_FILE = "classes.txt"
MAX_CLASSES = 256  # a mask's indices are 8-bit
MAX_CLASSES_FILE_BYTES = 1 << 20
SHOWN_FILES = 10  # files a skip record names
LAYOUT_HINT = ("lay it out as ROOT/images/NAME.png and ROOT/masks/NAME.png (a PNG of class "
               "indices with the image's file stem), with an optional ROOT/classes.txt")
FOLDER_READ = f"{MODEL_TYPE} reads a folder of images/ and masks/"

# Why a pair is skipped (the records' `reason`, counted per reason).
NO_MASK = "image without a mask"
NO_IMAGE = "mask without an image"
DUPLICATE = "second file with one stem"
UNREADABLE_IMAGE = "unreadable image"
UNREADABLE_MASK = "unreadable mask"
MASK_MODE = "mask not 8-bit gray or palette"
LOSSY_MASK = "mask in a lossy format"
SIZE_MISMATCH = "mask size differs from its image"
BEYOND_CLASSES = "class index beyond the class list"
ALL_VOID = "all-void mask"


@dataclass
class Pair:
    """One image and its mask, in one split."""

    image: Path
    mask: Path
    root: Path  # the folder holding images/ and masks/
    name: str  # the image's path under images/: the sample's id
    split: str = "train"


@dataclass
class ReasonCounts:
    """Bad input counted by reason: the names counted per (file or folder, reason), and the
    first detail said of each; one record per key (Dataset.dropped, in the shape of the
    classifier's dropped rows), each with one WARNING (_warn) naming the first `shown`. The
    segmenter's Skips and the detector's Tally (ttc/tasks/detect/tally.py)."""

    names: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    details: dict[tuple[str, str], str] = field(default_factory=dict)
    shown: ClassVar[int] = SHOWN_FILES

    def _count(self, where: str | Path, reason: str, name: str, detail: str,
               said: str) -> None:
        """Count `name` under (where, reason); `detail`, said of `said`, if it is the first."""
        key = (str(where), reason)
        self.names.setdefault(key, []).append(name)
        if detail:
            self.details.setdefault(key, f"{said}: {detail}")

    def summary(self) -> str:
        """'3 with an all-void mask, 1 with an unreadable image' (every file together)."""
        totals: Counter = Counter()
        for (_, reason), names in self.names.items():
            totals[reason] += len(names)
        return ", ".join(f"{n} with {with_article(reason)}" for reason, n in
                         totals.most_common())

    def records(self) -> list[dict]:
        """One record per file and reason, each with one WARNING naming the first few."""
        out = []
        for (where, reason), names in self.names.items():
            first = names[:self.shown]
            more = f" and {len(names) - len(first)} more" if len(names) > len(first) else ""
            said = self.details.get((where, reason))
            self._warn(where, reason, names, ", ".join(first) + more,
                       f" (first: {said})" if said else "")
            out.append(self._record(where, reason, names, first))
        return out

    def _warn(self, where: str, reason: str, names: list[str], first: str, detail: str) -> None:
        raise NotImplementedError

    def _record(self, where: str, reason: str, names: list[str], first: list[str]) -> dict:
        return {"file": where, "reason": reason, "count": len(names), "first_rows": first}


@dataclass
class Skips(ReasonCounts):
    """The pairs left out, with their reasons: `paths` (Dataset.skipped) and one record per
    folder and reason (Dataset.dropped)."""

    paths: list[str] = field(default_factory=list)

    def add(self, root: Path, reason: str, path: Path, detail: str = "") -> None:
        self.paths.append(str(path))
        self._count(root, reason, path.relative_to(root).as_posix(), detail, path.name)

    def count(self) -> int:
        return len(self.paths)

    def _warn(self, where: str, reason: str, names: list[str], first: str, detail: str) -> None:
        LOG.warning("skipped %d image/mask pairs of %s with %s (%s)%s", len(names), where,
                    with_article(reason), first, detail)


class Skip(Exception):
    """An image (a pair) that cannot be used, and why."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason, self.detail = reason, detail


# ----------------------------------------------------------------------------- public entry


def load_segmentation_dataset(options: DataOptions, *, preprocessing: dict | None = None,
                              labels: Sequence[str] | None = None,
                              splits: Sequence[str] = SPLITS) -> Dataset:
    """Find, split and decode a segmentation data set (Parts.reader's contract). With a
    bundle's `preprocessing` and `labels` its image size, channels, ignore index and classes
    are used; otherwise they are derived (the size and channels from the training images)."""
    if options.path == BUILTIN:
        return builtin_canvases(options, preprocessing, labels, splits)
    skips = Skips()
    pairs, given, root = list_pairs(options, skips)
    names = list(labels) if labels is not None else read_classes(root)
    derived = preprocessing is None
    if derived:
        preprocessing = derive_preprocessing(pairs, options)
        require_memory_for(preprocessing, sum(p.split in splits for p in pairs), options)
    else:
        check_bundle_size(preprocessing, sum(p.split in splits for p in pairs), splits)
    decoded = {split: decode_split([p for p in pairs if p.split == split], preprocessing,
                                   None if names is None else len(names), skips, options, split)
               for split in splits}
    _require_pairs_left(decoded, skips, options)
    if names is None:
        names = index_names(decoded, preprocessing["ignore_index"], options.path)
    if derived and "train" in decoded:
        preprocessing = dict(preprocessing, **channel_stats(decoded["train"].x))
    return Dataset(model_type=MODEL_TYPE, labels=names, preprocessing=preprocessing,
                   splits=decoded, counts=split_counts(pairs, decoded), given_splits=given,
                   options=options, skipped=skips.paths, dropped=skips.records())


def check_bundle_size(preprocessing: dict, kept: int, splits: Sequence[str]) -> None:
    """The bundle's image size, whatever it claims, times the user's `kept` images of `splits`:
    refused (exit 3) over --max_image_memory_mb (limits.check_decoded_images)."""
    check_decoded_images(preprocessing, kept, f"the {' and '.join(splits)} split"
                         + ("s" if len(splits) > 1 else ""))


def split_counts(listed: Sequence, decoded: dict[str, Split]) -> dict[str, int]:
    """Dataset.counts: the images of each split, as decoded where it was (else as listed:
    each listed item's `split`)."""
    counts = Counter(item.split for item in listed)
    for split, data in decoded.items():
        counts[split] = len(data)
    return {s: counts.get(s, 0) for s in SPLITS}


def builtin_canvases(options: DataOptions, preprocessing: dict | None,
                     labels: Sequence[str] | None, splits: Sequence[str]) -> Dataset:
    """builtin:digit_canvases: BUILTIN_COUNT canvases of BUILTIN_SIZE pixels (canvases.py, made
    in memory, the same every time), split by --seed and the fractions as a folder is."""
    size = [BUILTIN_SIZE, BUILTIN_SIZE]
    check_builtin_options(options, BUILTIN, BUILTIN_SIZE,
                          "ttc.tasks.segment.canvases.write_digit_canvases")
    images, masks = canvas_arrays(BUILTIN_COUNT, BUILTIN_SIZE, BUILTIN_SEED)
    cut = builtin_splits(options, len(images))
    decoded = {split: Split(x=(images[cut == split][:, None] / 255.0).astype(np.float32),
                            y=masks[cut == split].astype(np.int64),
                            ids=[f"{BUILTIN}#{i}" for i in np.flatnonzero(cut == split)])
               for split in splits}
    if preprocessing is None:
        preprocessing = {"kind": KIND, "image_size": size, "channels": 1, "color_mode": "L",
                         "resample": "bilinear", "mask_resample": "nearest",
                         "resize": "bilinear/nearest", "ignore_index": ignore_index_of(options),
                         "pixel_scale": "8-bit /255", "input_range": [0.0, 1.0],
                         "layout": "NCHW", "normalization": "in_graph",
                         **channel_stats(decoded["train"].x)}
    return Dataset(model_type=MODEL_TYPE, labels=list(labels or CLASS_NAMES),
                   preprocessing=preprocessing, splits=decoded,
                   counts={s: int((cut == s).sum()) for s in SPLITS}, given_splits=False,
                   options=options)


def check_builtin_options(options: DataOptions, builtin: str, side: int, writer: str) -> None:
    """A builtin data set is `side`x`side` grayscale: --image_size or --channels asking for
    another is a ConfigError (exit 2); `writer` makes canvases of another size."""
    if options.image_size and list(options.image_size) != [side, side] or options.channels \
            not in (None, 1):
        raise ConfigError(f"{builtin} is {side}x{side} grayscale",
                          "drop --image_size and --channels (or write canvases of another size "
                          f"with {writer})")


def builtin_splits(options: DataOptions, count: int) -> np.ndarray:
    """The split of each of a builtin set's `count` canvases: by --seed and the fractions, as a
    folder's (assign_splits, one class)."""
    return np.array(assign_splits([""] * count, options.val_fraction, options.test_fraction,
                                  options.seed))


def ignore_index_of(options: DataOptions) -> int:
    """--ignore_index where DataOptions carries it, else 255."""
    value = getattr(options, "ignore_index", None)
    return DEFAULT_IGNORE_INDEX if value is None else int(value)


# ----------------------------------------------------------------------------- listing


def list_pairs(options: DataOptions, skips: Skips) -> tuple[list[Pair], bool, Path]:
    """Every image/mask pair with its split, whether splits were given, and the main root.
    Unpaired files go to `skips`."""
    root = data_folder(options.path, "dataset path", FOLDER_READ, LAYOUT_HINT)
    roots = {"train": root}
    if (root / "train").is_dir() and not (root / "images").is_dir():
        roots = {s: root / s for s in SPLITS if (root / s).is_dir()}
    for split in ("val", "test"):
        extra = getattr(options, f"{split}_path", None)
        if extra:
            roots[split] = data_folder(extra, f"--{split}_path", FOLDER_READ, LAYOUT_HINT)
    pairs = [pair for split, where in roots.items() for pair in pairs_in(where, split, skips)]
    if not pairs:
        raise DataError(f"no image/mask pairs in {root}"
                        + (f": {skips.summary()}" if skips.count() else ": no image files"),
                        "a mask has its image's file stem; " + LAYOUT_HINT)
    cut_missing_splits([p for p in pairs if p.split == "train"], roots, options)
    return pairs, len(roots) > 1, root


def cut_missing_splits(main: Sequence, given: Collection[str], options: DataOptions) -> None:
    """The splits not `given` (val, test) cut from the training items `main` with the seeded
    fractions (assign_splits, one class): each item's `split` set."""
    missing = {s: getattr(options, f"{s}_fraction") for s in ("val", "test") if s not in given}
    cut = assign_splits([""] * len(main), missing.get("val", 0.0), missing.get("test", 0.0),
                        options.seed)
    for item, split in zip(main, cut):
        item.split = split


def data_folder(path: str | Path, what: str, reads: str, hint: str,
                error: type[DataError] | type[ConfigError] = DataError) -> Path:
    """A folder the user names: DataError (exit 3) when it does not exist, `error` when it is
    not a folder (`reads`: what the model type reads)."""
    folder = Path(path)
    if not folder.exists():
        raise DataError(f"{what} {folder} does not exist", "check the path")
    if not folder.is_dir():
        raise error(f"{what} {folder} is not a folder; {reads}", hint)
    return folder


def pairs_in(root: Path, split: str, skips: Skips) -> list[Pair]:
    """The pairs of one folder, sorted by stem; files of a stem with no partner, and second
    files of one stem (a.png beside a.jpg), go to `skips`."""
    for sub in ("images", "masks"):
        if not (root / sub).is_dir():
            raise DataError(f"{root} has no {sub}/ folder", LAYOUT_HINT)
    images, masks = _files_by_stem(root / "images", root, skips), _files_by_stem(
        root / "masks", root, skips)
    for stem in sorted(images.keys() - masks.keys()):
        skips.add(root, NO_MASK, images[stem])
    for stem in sorted(masks.keys() - images.keys()):
        skips.add(root, NO_IMAGE, masks[stem])
    return [Pair(images[s], masks[s], root, images[s].relative_to(root / "images").as_posix(),
                 split) for s in sorted(images.keys() & masks.keys())]


def _files_by_stem(folder: Path, root: Path, skips: Skips) -> dict[str, Path]:
    """stem (the path under `folder` without its suffix) → file (image_files' extensions)."""
    found: dict[str, Path] = {}
    for path in image_files(folder):
        stem = path.relative_to(folder).with_suffix("").as_posix()
        if stem in found:
            skips.add(root, DUPLICATE, path, f"beside {found[stem].name}")
        else:
            found[stem] = path
    return found


def read_classes(root: Path) -> list[str] | None:
    """ROOT/classes.txt's names, one per line (blank lines ignored); None without the file."""
    path = root / CLASSES_FILE
    if not path.is_file():
        return None
    hint = "write one class name per line (the first is index 0), UTF-8"
    if path.stat().st_size > MAX_CLASSES_FILE_BYTES:
        raise DataError(f"{path} is over {MAX_CLASSES_FILE_BYTES >> 20} MiB; a mask's 8-bit "
                        f"indices name at most {MAX_CLASSES} classes", hint)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"cannot read {path}: {first_line(err)}", hint) from err
    names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        raise DataError(f"{path} names no class", hint + ", or delete it to name the classes "
                        "by their index")
    if len(names) < 2 or len(names) > MAX_CLASSES:
        raise DataError(f"{path} names {len(names)} classes; a segmenter needs 2 to "
                        f"{MAX_CLASSES} (a mask's indices are 8-bit)", hint)
    repeated = [name for name, n in Counter(names).items() if n > 1]
    if repeated:
        raise DataError(f"{path} names {quoted_sample(repeated)} more than once", hint)
    return names


def index_names(decoded: dict[str, Split], ignore_index: int, source: str) -> list[str]:
    """Classes named by their index, 0..K-1, K = 1 + the largest index in the masks read."""
    largest = max((int(y[y != ignore_index].max(initial=-1)) for y in
                   (split.y for split in decoded.values())), default=-1)
    if largest < 1:
        raise DataError(f"the masks of {source} hold only class 0 (besides void pixels); a "
                        "segmenter needs at least 2 classes",
                        "check the masks' values, and --ignore_index")
    return [str(i) for i in range(largest + 1)]


# ----------------------------------------------------------------------------- decoding


def require_memory_for(preprocessing: dict, count: int, options: DataOptions) -> None:
    """Refuse (exit 3) a data set whose images and masks, decoded at the training size (float32
    images, int64 masks), would take more than --max_image_memory_mb: the size comes from the
    data (the classifier caps its own; a segmenter's masks are worth their full size), so a
    folder of large photographs is refused before any decoding, with the size to set."""
    height, width = preprocessing["image_size"]
    need = count * (image_bytes(preprocessing) + height * width * np.dtype(np.int64).itemsize)
    refuse_over_memory(need, f"{count} image/mask pairs", preprocessing, options)


def refuse_over_memory(need: int, what: str, preprocessing: dict, options: DataOptions) -> None:
    """`need` bytes for `what` ("12 image/mask pairs") decoded at the training size: over
    --max_image_memory_mb a DataError (exit 3), with the size to set."""
    height, width = preprocessing["image_size"]
    if need > LIMITS.max_image_memory_mb * MIB:
        raise DataError(
            f"the {what} of {options.path} at {height}x{width} would take "
            f"{size_text(need)} decoded, over --max_image_memory_mb "
            f"{LIMITS.max_image_memory_mb}",
            "train at a smaller size (--image_size HEIGHT WIDTH) or raise "
            "--max_image_memory_mb")


def derive_preprocessing(pairs: list[Pair], options: DataOptions) -> dict:
    """The training size and channels, by the classifier's rules: the most common size of the
    training images (or --image_size); 1 channel when every one is grayscale, else 3 (or
    --channels)."""
    train = [ImageItem(source=p.image, label="") for p in pairs if p.split == "train"]
    if not train:
        raise DataError(f"the training split of {options.path} has no image/mask pairs",
                        LAYOUT_HINT)
    height, width, channels = training_size(train, options)
    return {"kind": KIND, "image_size": [height, width], "channels": channels,
            "color_mode": "L" if channels == 1 else "RGB", "resample": "bilinear",
            "mask_resample": "nearest", "resize": "bilinear/nearest",
            "ignore_index": ignore_index_of(options),
            "pixel_scale": "by image mode: 8-bit /255, 16-bit /65535 (docs/data.md)",
            "input_range": [0.0, 1.0], "layout": "NCHW", "normalization": "in_graph"}


def training_size(train: list[ImageItem], options: DataOptions) -> tuple[int, int, int]:
    """(height, width, channels) by the classifier's rules: the most common size of the
    training images (or --image_size); 1 channel when every one is grayscale, else 3 (or
    --channels)."""
    data_size, data_channels = scan_image_headers(train)
    height, width = options.image_size or data_size
    channels = options.channels or data_channels
    if (height, width) != tuple(data_size):
        LOG.info("training at %dx%d (the most common image size is %dx%d)", height, width,
                 data_size[0], data_size[1])
    return int(height), int(width), int(channels)


def decode_split(pairs: list[Pair], preprocessing: dict, num_classes: int | None, skips: Skips,
                 options: DataOptions, split: str) -> Split:
    """x float32 (N, C, H, W) in [0, 1], y int64 (N, H, W) class indices (void kept), ids the
    images' names; a pair that cannot be used goes to `skips` with its reason."""
    channels = preprocessing["channels"]
    height, width = preprocessing["image_size"]
    x = np.empty((len(pairs), channels, height, width), dtype=np.float32)
    y = np.empty((len(pairs), height, width), dtype=np.int64)
    ids: list[str] = []
    for pair in progress(pairs, desc=f"decode {split}", enabled=options.show_progress):
        try:
            x[len(ids)], y[len(ids)] = decode_pair(pair, preprocessing, num_classes)
        except Skip as skip:
            skips.add(pair.root, skip.reason, pair.image, skip.detail)
            continue
        ids.append(pair.name)
    return Split(x=x[:len(ids)], y=y[:len(ids)], ids=ids)


def decode_pair(pair: Pair, preprocessing: dict,
                num_classes: int | None) -> tuple[np.ndarray, np.ndarray]:
    """One pair → ((C, H, W) float32 pixels, (H, W) uint8 indices) at the training size;
    raises Skip with the reason it cannot be used."""
    ignore = preprocessing["ignore_index"]
    height, width = preprocessing["image_size"]
    size = decoded_image_size(pair.image)
    mask = read_mask(pair.mask)
    if mask.shape != size:
        raise Skip(SIZE_MISMATCH, f"mask {mask.shape[1]}x{mask.shape[0]}, image "
                    f"{size[1]}x{size[0]}")
    if num_classes is not None:
        beyond = (mask >= num_classes) & (mask != ignore)
        if beyond.any():
            raise Skip(BEYOND_CLASSES, f"index {int(mask[beyond].max())} of {num_classes} "
                        "classes")
    mask = resize_mask(mask, height, width)
    if (mask == ignore).all():
        raise Skip(ALL_VOID)
    try:
        pixels = decode_image_file(pair.image, preprocessing)
    except Exception as err:  # noqa: BLE001 - any decoder failure means a bad file
        raise Skip(UNREADABLE_IMAGE, first_line(err)) from err
    return pixels, mask


def decoded_image_size(path: Path) -> tuple[int, int]:
    """(height, width) as the decoder sees the image (after its EXIF orientation); Skip
    (UNREADABLE_IMAGE) when Pillow cannot read it."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                width, height = img.size
                turned = img.getexif().get(0x0112) in (5, 6, 7, 8)  # Orientation: a quarter turn
    except Exception as err:  # noqa: BLE001 - any decoder failure means a bad file
        raise Skip(UNREADABLE_IMAGE, first_line(err)) from err
    return (width, height) if turned else (height, width)


def read_mask(path: Path) -> np.ndarray:
    """A mask's class indices, (H, W) uint8: an "L" image's values, a "P" image's palette
    indices (never its colours)."""
    from PIL import Image, ImageOps

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                lossy = lossy_encoding(img, path)
                if lossy:
                    raise Skip(LOSSY_MASK, f"{lossy}: its compression changes class indices; "
                               "save masks as PNG")
                if img.mode not in MASK_MODES:
                    raise Skip(MASK_MODE, f"mode {quoted(img.mode)}")
                img = ImageOps.exif_transpose(img) or img
                return np.asarray(img, dtype=np.uint8).copy()
    except Skip:
        raise
    except Exception as err:  # noqa: BLE001 - any decoder failure means a bad file
        raise Skip(UNREADABLE_MASK, first_line(err)) from err


def lossy_encoding(img, path: Path) -> str | None:
    """What makes an opened mask's file lossy ("JPEG", "lossy WebP", "JPEG-compressed TIFF"),
    by its decoded format; None for a lossless one (PNG, BMP, GIF, lossless WebP and TIFF)."""
    if img.format in LOSSY_FORMATS:
        return LOSSY_FORMATS[img.format]
    if img.format == "TIFF" and img.info.get("compression") in LOSSY_TIFF_COMPRESSIONS:
        return f"{img.info['compression'].removeprefix('tiff_').upper()}-compressed TIFF"
    if img.format == "WEBP" and not _lossless_webp(path):
        return "lossy WebP"
    return None


def _lossless_webp(path: Path) -> bool:
    """Is a WebP file's image chunk VP8L (lossless), not VP8 (lossy)? Its RIFF chunks are walked
    from the start, a few at most."""
    with open(path, "rb") as handle:
        handle.seek(12)  # "RIFF", the size, "WEBP"
        for _ in range(WEBP_CHUNKS_READ):
            header = handle.read(8)
            if len(header) < 8:
                return False
            fourcc, size = header[:4], int.from_bytes(header[4:], "little")
            if fourcc in (b"VP8 ", b"VP8L"):
                return fourcc == b"VP8L"
            handle.seek(size + (size & 1), 1)  # chunks are padded to an even size
    return False


def resize_mask(mask: np.ndarray, height: int, width: int) -> np.ndarray:
    """Class indices at (height, width) by NEAREST: never a blend of two classes."""
    if mask.shape == (height, width):
        return mask
    from PIL import Image

    img = Image.fromarray(mask).resize((width, height), Image.Resampling.NEAREST)
    return np.asarray(img, dtype=np.uint8)


def _require_pairs_left(decoded: dict[str, Split], skips: Skips, options: DataOptions) -> None:
    """Exit 3 when no training pair (or no test pair) is left."""
    reasons = f" ({skips.count()} skipped: {skips.summary()})" if skips.count() else ""
    if "train" in decoded and len(decoded["train"]) == 0:
        raise DataError(f"no usable image/mask pairs in the training split of "
                        f"{options.path}{reasons}",
                        "check that images and masks share file stems and sizes and that "
                        "masks hold class indices")
    if "test" in decoded and len(decoded["test"]) == 0:
        raise DataError(f"the test split of {options.path} is empty{reasons}",
                        "add pairs to test/ (or --test_path) or raise --test_fraction")
