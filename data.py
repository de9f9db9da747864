"""Datasets for the image classifier: built-in digits, image folders and CSV/JSON image tables.

Everything becomes float32 NCHW pixels in [0, 1] at one size and channel count; the per-channel
normalisation (mean/std of the training split) lives inside the model graph, so a deployed
.onnx needs only decode → resize → /255. No torch here: inference.py imports this module.
"""
from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from utils import LOG, DataError, progress

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
TABLE_FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".json": "json", ".jsonl": "jsonl",
                 ".ndjson": "jsonl"}
IMAGE_COLUMN_NAMES = ("image", "image_path", "path", "file", "filename", "filepath", "img")
LABEL_COLUMN_NAMES = ("label", "class", "target", "category", "y")
GRAY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F", "P;L"}
DEFAULT_MAX_SIDE = 64
SPLITS = ("train", "val", "test")


@dataclass
class DataOptions:
    """What the loader needs from the Config (or from a bundle manifest)."""

    path: str
    image_column: str | None = None
    label_column: str | None = None
    image_size: tuple[int, int] | None = None
    channels: int | None = None
    val_fraction: float = 0.15
    test_fraction: float = 0.15
    seed: int = 0
    show_progress: bool = True

    @classmethod
    def from_config(cls, config) -> "DataOptions":
        return cls(path=config.dataset_path, image_column=config.image_column,
                   label_column=config.label_column, image_size=config.image_size,
                   channels=config.channels, val_fraction=config.val_fraction,
                   test_fraction=config.test_fraction, seed=config.seed,
                   show_progress=not config.no_progress)

    @classmethod
    def from_manifest(cls, recorded: dict, path: str | None = None,
                      show_progress: bool = True) -> "DataOptions":
        """The bundle's dataset (or `path`), split exactly as at training time."""
        return cls(path=path or recorded["path"], image_column=recorded.get("image_column"),
                   label_column=recorded.get("label_column"),
                   val_fraction=recorded["val_fraction"], test_fraction=recorded["test_fraction"],
                   seed=recorded["seed"], show_progress=show_progress)

    def to_manifest(self) -> dict:
        source = self.path if self.path.startswith("builtin:") else str(Path(self.path).resolve())
        return {"path": source, "image_column": self.image_column,
                "label_column": self.label_column, "val_fraction": self.val_fraction,
                "test_fraction": self.test_fraction, "seed": self.seed}


@dataclass
class Split:
    x: np.ndarray  # float32 (N, C, H, W) in [0, 1]
    y: np.ndarray  # int64 (N,) class indices
    ids: list[str]

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class ImageDataset:
    labels: list[str]
    preprocessing: dict
    splits: dict[str, Split]
    counts: dict[str, int]
    given_splits: bool
    options: DataOptions
    skipped: list[str] = field(default_factory=list)

    @property
    def train(self) -> Split:
        return self.splits["train"]

    @property
    def val(self) -> Split:
        return self.splits["val"]

    @property
    def test(self) -> Split:
        return self.splits["test"]

    def report_section(self) -> dict:
        return {"path": self.options.to_manifest()["path"], "model_type": "image_classifier",
                "num_classes": len(self.labels), "train": self.counts["train"],
                "val": self.counts["val"], "test": self.counts["test"],
                "given_splits": self.given_splits, "skipped_images": len(self.skipped),
                "image_size": self.preprocessing["image_size"],
                "channels": self.preprocessing["channels"]}


@dataclass
class _Item:
    source: Path | int  # a file, or a row of a built-in array
    label: str
    split: str = "train"


# ----------------------------------------------------------------------------- public entry


def load_image_dataset(options: DataOptions, *, preprocessing: dict | None = None,
                       labels: Sequence[str] | None = None,
                       splits: Sequence[str] = SPLITS) -> ImageDataset:
    """Find, split and decode a dataset.

    With `preprocessing` and `labels` from a bundle manifest the data is decoded exactly as at
    training time (used by export.py and inference.py); otherwise both are derived from the
    training split.
    """
    items, given, builtin_pixels = _list_items(options)
    trained = labels is not None
    labels = list(labels) if trained else _sorted_labels(i.label for i in items if i.split == "train")
    _check_labels(items, labels, options.path, trained)
    if preprocessing is None:
        preprocessing = _derive_preprocessing(items, builtin_pixels, options)
    decoded: dict[str, Split] = {}
    skipped: list[str] = []
    for split in splits:
        chosen = [i for i in items if i.split == split]
        decoded[split] = _decode_split(chosen, labels, preprocessing, builtin_pixels, skipped,
                                       options, split)
    if "train" in decoded:
        if len(decoded["train"]) == 0:
            raise DataError(f"no usable training images in {options.path}",
                            "check that the files are readable images")
        preprocessing = dict(preprocessing, **_channel_stats(decoded["train"].x))
    if "test" in decoded and len(decoded["test"]) == 0:
        raise DataError(f"the test split of {options.path} is empty",
                        "add images to test/ or raise --test_fraction")
    counts = Counter(i.split for i in items)
    for split, data in decoded.items():
        counts[split] = len(data)
    return ImageDataset(labels=labels, preprocessing=preprocessing, splits=decoded,
                        counts={s: counts.get(s, 0) for s in SPLITS}, given_splits=given,
                        options=options, skipped=skipped)


def decode_image_file(path: Path, preprocessing: dict) -> np.ndarray:
    """One image file → float32 (C, H, W) in [0, 1], exactly as the model was trained."""
    from PIL import Image, ImageOps

    height, width = preprocessing["image_size"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(path) as img:
            img = ImageOps.exif_transpose(img) or img
            img = img.convert("L" if preprocessing["channels"] == 1 else "RGB")
            if img.size != (width, height):
                img = img.resize((width, height), Image.Resampling.BILINEAR)
            pixels = np.asarray(img, dtype=np.float32) / 255.0
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


# ----------------------------------------------------------------------------- listing


def _list_items(options: DataOptions) -> tuple[list[_Item], bool, np.ndarray | None]:
    """All samples with their labels and split; built-in data also returns its pixel array."""
    if options.path == "builtin:digits":
        pixels, items = _builtin_digits()
        _assign_splits(items, options.val_fraction, options.test_fraction, options.seed)
        return items, False, pixels
    root = Path(options.path)
    if not root.exists():
        raise DataError(f"dataset path {root} does not exist",
                        "check the path, or use --dataset_path builtin:digits")
    if root.is_dir():
        items, given = _list_folder(root, options)
    elif root.suffix.lower() in TABLE_FORMATS:
        items, given = _list_table(root, options), False
        _assign_splits(items, options.val_fraction, options.test_fraction, options.seed)
    else:
        raise DataError(f"cannot read {root}: expected a folder or a "
                        f"{'/'.join(sorted(TABLE_FORMATS))} file",
                        "pass an image folder ROOT/<class>/*.png or a table of image paths")
    return items, given, None


def _builtin_digits() -> tuple[np.ndarray, list[_Item]]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = (digits.images / 16.0).astype(np.float32)[:, None]  # 0..16 → [0, 1]
    items = [_Item(source=i, label=str(int(t))) for i, t in enumerate(digits.target)]
    return pixels, items


def _is_image_file(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS and not any(
        part.startswith(".") for part in path.parts[-2:])


def _class_folder_items(root: Path, split: str) -> list[_Item]:
    items = []
    for class_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for file in sorted(class_dir.rglob("*")):
            if _is_image_file(file):
                items.append(_Item(source=file, label=class_dir.name, split=split))
    return items


def _list_folder(root: Path, options: DataOptions) -> tuple[list[_Item], bool]:
    if (root / "train").is_dir():
        items = _class_folder_items(root / "train", "train")
        missing = {s: getattr(options, f"{s}_fraction") for s in ("val", "test")
                   if not (root / s).is_dir()}
        for split in ("val", "test"):
            if split not in missing:
                items += _class_folder_items(root / split, split)
        if missing:
            train_items = [i for i in items if i.split == "train"]
            _assign_splits(train_items, missing.get("val", 0.0), missing.get("test", 0.0),
                           options.seed)
        given = True
    else:
        items = _class_folder_items(root, "train")
        _assign_splits(items, options.val_fraction, options.test_fraction, options.seed)
        given = False
    if not items:
        raise DataError(f"no images found in {root}",
                        f"lay it out as {root}/<class name>/*.png (extensions: "
                        f"{', '.join(IMAGE_EXTENSIONS)})")
    return items, given


def _read_table(path: Path):
    import pandas as pd

    kind = TABLE_FORMATS[path.suffix.lower()]
    try:
        if kind in ("csv", "tsv"):
            frame = pd.read_csv(path, sep="," if kind == "csv" else "\t", encoding="utf-8-sig",
                                dtype=str, keep_default_na=True)
        else:
            frame = pd.read_json(path, lines=kind == "jsonl", dtype=False, encoding="utf-8-sig")
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise DataError(f"cannot parse {path} as {kind.upper()}: {first}",
                        "check the file's format and encoding (UTF-8)") from None
    if frame.empty:
        raise DataError(f"{path} has no rows", "add rows of image path and label")
    return frame


def _resolve_column(frame, spec: str | None, names: Sequence[str], role: str, path: Path,
                    exclude: str | None = None) -> str:
    columns = [str(c) for c in frame.columns]
    if spec is not None:
        if spec in columns:
            return spec
        if spec.isdigit() and int(spec) < len(columns):
            return columns[int(spec)]
        raise DataError(f"{path} has no column {spec!r} for the {role}; its columns are "
                        f"{columns}", f"pass --{role}_column with one of them")
    by_lower = {c.lower(): c for c in columns if c != exclude}
    for name in names:
        if name in by_lower:
            return by_lower[name]
    if role == "image":
        for column in columns:
            values = frame[column].dropna().astype(str).str.lower()
            if len(values) and values.str.endswith(IMAGE_EXTENSIONS).mean() >= 0.8:
                return column
    else:
        others = [c for c in columns if c != exclude]
        if len(others) == 1:
            return others[0]
    raise DataError(f"cannot tell which column of {path} holds the {role}; its columns are "
                    f"{columns}", f"pass --{role}_column NAME")


def _list_table(path: Path, options: DataOptions) -> list[_Item]:
    frame = _read_table(path)
    image_col = _resolve_column(frame, options.image_column, IMAGE_COLUMN_NAMES, "image", path)
    label_col = _resolve_column(frame, options.label_column, LABEL_COLUMN_NAMES, "label", path,
                                exclude=image_col)
    frame = frame[[image_col, label_col]]
    missing = frame[label_col].isna() | frame[image_col].isna()
    if missing.any():
        LOG.warning("dropped %d rows of %s with a missing image path or label", int(missing.sum()),
                    path)
    frame = frame[~missing]
    base = path.parent
    return [_Item(source=(base / str(img)).resolve() if not Path(str(img)).is_absolute()
                  else Path(str(img)), label=_label_text(lab))
            for img, lab in zip(frame[image_col], frame[label_col])]


def _label_text(value) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def _sorted_labels(values) -> list[str]:
    unique = set(values)
    if all(v.lstrip("-").isdigit() for v in unique):
        return sorted(unique, key=int)
    return sorted(unique)


def _check_labels(items: list[_Item], labels: list[str], source: str, trained: bool) -> None:
    if len(labels) < 2:
        raise DataError(f"{source} has {len(labels)} class(es) {labels} for training; a "
                        "classifier needs at least 2", "add a folder (or label) per class")
    unknown = sorted({i.label for i in items} - set(labels))
    if unknown and trained:
        raise DataError(f"{source} has labels the model was not trained on: {unknown[:5]}",
                        f"the model knows {labels}")
    if unknown:
        raise DataError(f"{source} has classes in its val/test split that the training split "
                        f"lacks: {unknown[:5]}", "add training images for them or remove them")


def _assign_splits(items: list[_Item], val_fraction: float, test_fraction: float,
                   seed: int) -> None:
    """Deterministic stratified split: within each class, shuffle with `seed` and cut."""
    rng = np.random.default_rng(seed)
    by_class: dict[str, list[_Item]] = {}
    for item in items:
        by_class.setdefault(item.label, []).append(item)
    for label in sorted(by_class):
        group = by_class[label]
        order = rng.permutation(len(group))
        n_test = _share(len(group), test_fraction)
        n_val = _share(len(group) - n_test, val_fraction / max(1e-9, 1 - test_fraction))
        for rank, index in enumerate(order):
            group[index].split = "test" if rank < n_test else "val" if rank < n_test + n_val else "train"


def _share(n: int, fraction: float) -> int:
    """round(n * fraction), at least 1 when the fraction is positive and n ≥ 3, leaving 1 to train."""
    if fraction <= 0 or n < 2:
        return 0
    return min(max(1 if n >= 3 else 0, round(n * fraction)), n - 1)


# ----------------------------------------------------------------------------- decoding


def _derive_preprocessing(items: list[_Item], builtin_pixels: np.ndarray | None,
                          options: DataOptions) -> dict:
    if builtin_pixels is not None:
        data_size, data_channels, note = tuple(builtin_pixels.shape[2:]), 1, "1/16 (builtin:digits)"
    else:
        data_size, data_channels = _scan_image_headers([i for i in items if i.split == "train"])
        note = "1/255"
    size = options.image_size or _capped(data_size)
    if options.image_size is None and size != data_size:
        LOG.info("images are %dx%d; training at %dx%d (set --image_size to change)",
                 data_size[0], data_size[1], size[0], size[1])
    channels = options.channels or data_channels
    return {"kind": "image", "image_size": [int(size[0]), int(size[1])], "channels": int(channels),
            "color_mode": "L" if channels == 1 else "RGB", "resample": "bilinear",
            "pixel_scale": note, "input_range": [0.0, 1.0], "layout": "NCHW",
            "normalization": "in_graph"}


def _scan_image_headers(items: list[_Item]) -> tuple[tuple[int, int], int]:
    """Most common (height, width), and 1 channel if every image is grayscale else 3."""
    from PIL import Image

    sizes: Counter = Counter()
    gray = True
    for item in items:
        try:
            with Image.open(item.source) as img:
                sizes[(img.height, img.width)] += 1
                gray = gray and img.mode in GRAY_MODES
        except Exception:  # noqa: BLE001 - reported once, when decoding skips it
            continue
    if not sizes:
        raise DataError(f"none of the {len(items)} training images could be read",
                        "check that the files are valid images")
    return sizes.most_common(1)[0][0], 1 if gray else 3


def _capped(size: tuple[int, int]) -> tuple[int, int]:
    height, width = size
    scale = min(1.0, DEFAULT_MAX_SIDE / max(height, width))
    return max(1, round(height * scale)), max(1, round(width * scale))


def _decode_split(items: list[_Item], labels: list[str], preprocessing: dict,
                  builtin_pixels: np.ndarray | None, skipped: list[str], options: DataOptions,
                  split: str) -> Split:
    channels = preprocessing["channels"]
    height, width = preprocessing["image_size"]
    x = np.empty((len(items), channels, height, width), dtype=np.float32)
    y = np.empty(len(items), dtype=np.int64)
    ids: list[str] = []
    index = {label: i for i, label in enumerate(labels)}
    kept = 0
    for item in progress(items, desc=f"decode {split}", enabled=options.show_progress):
        if builtin_pixels is not None:
            pixels = _fit_array(builtin_pixels[item.source], channels, height, width)
            ident = f"{options.path}#{item.source}"
        else:
            try:
                pixels = decode_image_file(item.source, preprocessing)
            except Exception as err:  # noqa: BLE001 - any decoder failure means a bad file
                reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
                LOG.warning("skipped unreadable image %s: %s", item.source, reason)
                skipped.append(str(item.source))
                continue
            ident = str(item.source)
        x[kept], y[kept] = pixels, index[item.label]
        ids.append(ident)
        kept += 1
    return Split(x=x[:kept], y=y[:kept], ids=ids)


def _fit_array(pixels: np.ndarray, channels: int, height: int, width: int) -> np.ndarray:
    """A built-in (1, h, w) array resized and channel-matched to the preprocessing."""
    if pixels.shape[1:] != (height, width):
        from PIL import Image

        img = Image.fromarray(pixels[0], mode="F").resize((width, height),
                                                          Image.Resampling.BILINEAR)
        pixels = np.clip(np.asarray(img, dtype=np.float32), 0, 1)[None]
    return np.repeat(pixels, channels, axis=0) if channels != pixels.shape[0] else pixels


def _channel_stats(x: np.ndarray) -> dict:
    mean = x.mean(axis=(0, 2, 3))
    std = x.std(axis=(0, 2, 3))
    std = np.where(std < 1e-6, 1.0, std)
    return {"mean": [float(v) for v in mean], "std": [float(v) for v in std]}
