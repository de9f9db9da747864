"""Datasets for every model type, split deterministically and encoded for the model.

- image_classifier: builtin:digits, image folders, tables of image paths. Everything becomes
  float32 NCHW pixels in [0, 1] at one size and channel count; the per-channel normalisation
  lives inside the model graph, so a deployed .onnx needs only decode → resize → scale (/255
  for 8-bit images; preprocess.decode_image_file scales every Pillow mode by its range).
- text_classifier: a table with text column(s) and a label; texts become int64 token ids.
- tabular_classifier: builtin:iris/wine/breast_cancer or a table of features and a label;
  rows become float32 features (NaN where missing; imputed and standardised inside the graph).

No torch here: inference.py imports this module.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from ttc.inputs.limits import check_decoded_images
from ttc.inputs.preprocess import (GRAY_MODES, TabularEncoder, Tokenizer, decode_image_file, hf_source,
                        image_files, text_tokenizer)
from ttc.inputs.tables import (IMAGE_EXTENSIONS, TABLE_FORMATS, Columns, Reader, detect_columns,
                    is_number, joined_texts, label_texts, read_table, split_columns, split_spec)
from ttc.tasks.registry import builtin_datasets, find_task, model_types, task_for, task_of_kind
from utils import (LOG, ConfigError, DataError, first_line, progress, quoted, quoted_sample,
                   with_article)

BUILTIN_TABLES = {"builtin:iris": "load_iris", "builtin:wine": "load_wine",
                  "builtin:breast_cancer": "load_breast_cancer"}
DEFAULT_MAX_SIDE = 64
SPLITS = ("train", "val", "test")
# The selection-free slice: carved out of the training split before training (--calibration_fraction),
# never trained on and never used to pick a candidate or an epoch; the temperature is fitted on it
# (docs/calibration.md), and test-time methods may choose on it.
CALIBRATION = "calibration"
ALL_SPLITS = (*SPLITS, CALIBRATION)


@dataclass
class DataOptions:
    """What the loader needs from the Config (or from a bundle manifest)."""

    path: str
    model_type: str = "image_classifier"
    image_column: str | None = None
    text_column: str | None = None
    feature_columns: str | None = None
    label_column: str | None = None
    dataset_format: str | None = None
    has_header: str = "auto"
    val_path: str | None = None
    test_path: str | None = None
    image_size: tuple[int, int] | None = None
    channels: int | None = None
    max_vocab: int = 20000
    max_length: int = 256
    arch: str | None = None  # an hf:NAME_OR_PATH text arch brings its own tokenizer
    val_fraction: float = 0.15
    test_fraction: float = 0.15
    calibration_fraction: float = 0.0  # of the training split; 0: no calibration slice
    seed: int = 0
    ignore_index: int | None = None  # a segmenter's void pixels (None: 255)
    annotations: str | None = None  # a detector's COCO JSON (not recorded: a location)
    show_progress: bool = True

    # What a bundle records so that export.py and inference.py find and split the data again.
    RECORDED = ("model_type", "image_column", "text_column", "feature_columns", "label_column",
                "dataset_format", "has_header", "val_path", "test_path", "val_fraction",
                "test_fraction", "calibration_fraction", "seed")

    @classmethod
    def from_config(cls, flags: Any) -> "DataOptions":
        """From the parsed flags: the data flags (ttc/options/data.py) and --no_progress, of
        a Config or a stage's options."""
        names = [f for f in cls.__dataclass_fields__ if f not in ("path", "show_progress")]
        options = cls(path=flags.dataset_path, show_progress=not flags.no_progress,
                      **{name: getattr(flags, name) for name in names})
        task = find_task(options.model_type)
        if task is not None and task.uncalibrated and not task.calibration_slice:
            options.calibration_fraction = 0.0  # no temperature to fit: train on every row
        return options

    @classmethod
    def from_manifest(cls, recorded: dict, path: str | None = None, show_progress: bool = True,
                      split_paths: dict[str, str | None] | None = None,
                      alternative: str = "") -> "DataOptions":
        """The data the user named (`path`; `split_paths` holds --val_path and --test_path),
        read with the options the bundle recorded and split exactly as at training time.

        A path a bundle records is information about where its training data was, never an
        instruction to read: only a built-in data set's name is taken from it. Raises
        ConfigError (exit 2), before anything is read, when the user must name the data;
        `alternative` ends its hint (e.g. inference.py's --input)."""
        split_paths = split_paths or {}
        kept = {k: recorded[k] for k in cls.RECORDED
                if recorded.get(k) is not None and k not in ("val_path", "test_path")}
        path = path or _recorded_builtin(recorded, alternative)
        _require_builtin_of_its_kind(path, recorded.get("model_type"))
        for split in ("val", "test"):
            _require_split_path(recorded, split, split_paths.get(split))
        _require_annotations(recorded, split_paths.get("annotations"))
        task = find_task(recorded.get("model_type"))
        if task is not None and not task.split_paths and any(split_paths.values()):
            raise ConfigError("--val_path and --test_path are for text and tabular tables; "
                              "images take their splits from folders",
                              "drop them: an image folder's val/ and test/ subfolders are used")
        return cls(path=path, show_progress=show_progress, **kept,
                   val_path=split_paths.get("val"), test_path=split_paths.get("test"),
                   annotations=split_paths.get("annotations"))

    def to_manifest(self) -> dict:
        return {"path": _absolute(self.path), **{k: getattr(self, k) for k in self.RECORDED},
                "val_path": _absolute(self.val_path), "test_path": _absolute(self.test_path),
                **({"annotations": _absolute(self.annotations)} if self.annotations else {})}


BUILTIN_NAMES = tuple(builtin_datasets())  # every builtin: data set (ttc/tasks)


def table_reader(model_type: str, bundle: bool = False) -> Reader:
    """A training run (or a bundle) of `model_type` as the reader of a table, with the model
    type its error suggests for each kind of input (the first in --model_type's order)."""
    by_role: dict[str, str] = {}
    for name in model_types():
        by_role.setdefault(task_for(name).input_role, name)
    return Reader(model_type, bundle, by_role)


def _recorded_builtin(recorded: dict, alternative: str) -> str:
    """The built-in data set a bundle was trained on; for any other recorded path, the
    ConfigError that asks the user to name the data."""
    where = recorded.get("path")
    if where in BUILTIN_NAMES:
        return where
    said = (f"records that it was trained on {quoted(where, 80)}" if isinstance(where, str)
            and where else "records no built-in data set it was trained on")
    raise ConfigError(f"the bundle {said}, and this tool does not read a path a bundle names "
                      "on its own", "pass --dataset_path PATH to name the data (split as at "
                      f"training){alternative}")


def _require_builtin_of_its_kind(path: str, model_type: str | None) -> None:
    kind = builtin_datasets().get(path)  # the model type it is data for
    if kind and model_type and kind != model_type:
        raise ConfigError(f"{path} is data for {kind}, and this bundle is a {model_type}",
                          "pass the data it was trained on with --dataset_path")


def _require_split_path(recorded: dict, split: str, given: str | None) -> None:
    """A bundle trained with a separate --val_path / --test_path file: the user names it again
    (the recorded path is never read; cutting that split from the main file instead would
    evaluate on rows the model was trained on)."""
    where = recorded.get(f"{split}_path")
    if where and not given:
        raise ConfigError(f"the bundle was trained with a separate {split} file "
                          f"{quoted(where, 80)} (--{split}_path), and this tool does not read a "
                          "path a bundle names on its own",
                          f"pass --{split}_path PATH (with --dataset_path) to name it")


def _require_annotations(recorded: dict, given: str | None) -> None:
    """A detector trained on COCO annotations (--annotations): the user names the JSON again,
    as a separate split file (the recorded path is never read)."""
    where = recorded.get("annotations")
    if where and not given:
        raise ConfigError(f"the bundle was trained on the COCO annotations {quoted(where, 80)} "
                          "(--annotations), and this tool does not read a path a bundle names "
                          "on its own", "pass --annotations PATH (with --dataset_path) to name "
                          "them")


def _absolute(path: str | None) -> str | None:
    if path is None or path.startswith("builtin:"):
        return path
    return str(Path(path).resolve())


@dataclass
class Split:
    x: np.ndarray  # float32 (N, C, H, W) in [0, 1]
    y: np.ndarray  # int64 (N,) class indices
    ids: list[str]
    raw: list[str] | None = None  # the texts, for text models (the DSPy program's input)

    def __len__(self) -> int:
        return len(self.y)

    def shuffled(self, rng: np.random.Generator) -> "Split":
        """The same samples in a seeded random order. Files and tables often come grouped by
        class, and whatever works on batches needs them mixed: BatchNorm adaptation on a
        class-sorted MNIST test split fell from 0.985 to 0.48 accuracy."""
        order = rng.permutation(len(self.y))
        return Split(x=self.x[order], y=self.y[order], ids=[self.ids[i] for i in order],
                     raw=None if self.raw is None else [self.raw[i] for i in order])


@dataclass
class Dataset:
    model_type: str
    labels: list[str]
    preprocessing: dict
    splits: dict[str, Split]
    counts: dict[str, int]
    given_splits: bool
    options: DataOptions
    skipped: list[str] = field(default_factory=list)
    dropped: list[dict] = field(default_factory=list)  # dropped_rows() records
    columns: Columns | None = None  # a table's label and input columns, as resolved

    @property
    def train(self) -> Split:
        return self.splits["train"]

    @property
    def val(self) -> Split:
        return self.splits["val"]

    @property
    def test(self) -> Split:
        return self.splits["test"]

    @property
    def calibration(self) -> Split:
        """The calibration slice (CALIBRATION): empty with --calibration_fraction 0."""
        return self.splits["calibration"]

    def report_section(self) -> dict:
        section = {"path": _absolute(self.options.path), "model_type": self.model_type,
                   "num_classes": len(self.labels), "train": self.counts["train"],
                   "val": self.counts["val"], "test": self.counts["test"],
                   "calibration": self.counts.get(CALIBRATION, 0),
                   "calibration_fraction": self.options.calibration_fraction,
                   "given_splits": self.given_splits,
                   "skipped_images": len(self.skipped) if task_for(self.model_type).image_files
                   else None,
                   # a detector's clipped boxes and background images are counted, and kept
                   "dropped_rows": sum(d["count"] for d in self.dropped if not d.get("kept")),
                   "dropped_reasons": self.dropped}
        section.update(task_of_kind(self.preprocessing["kind"]).report_sizes(self.preprocessing))
        if self.columns is not None and self.options.path not in BUILTIN_TABLES:
            section["columns"] = self.columns.to_report()  # a user's table: what was guessed
        return section


@dataclass
class ImageItem:
    source: Path | int  # a file, or a row of a built-in array
    label: str
    split: str = "train"


# ----------------------------------------------------------------------------- public entry


def load_dataset(options: DataOptions, *, preprocessing: dict | None = None,
                 labels: Sequence[str] | None = None,
                 splits: Sequence[str] = ALL_SPLITS) -> Dataset:
    """Find, split and encode a dataset for `options.model_type`.

    With `preprocessing` and `labels` from a bundle manifest the data is encoded exactly as at
    training time (used by export.py and inference.py); otherwise both are derived from the
    training split. The calibration slice (`CALIBRATION`, asked for in `splits`) is the same rows
    every time for the same data, --seed and --calibration_fraction (calibration_cut).
    """
    reader = task_for(options.model_type).part("reader")
    if getattr(reader, "carves_calibration", False):
        dataset = reader(options, preprocessing=preprocessing, labels=labels, splits=splits)
    else:
        dataset = _carved_after_reading(reader, options, preprocessing, labels, splits)
    for name, split in dataset.splits.items():
        rng = np.random.default_rng([options.seed, ALL_SPLITS.index(name)])
        dataset.splits[name] = split.shuffled(rng)
    return dataset


def calibration_cut(strata: Sequence, fraction: float, seed: int) -> np.ndarray:
    """Which rows of the training split go to the calibration slice: within each stratum (a
    class; one stratum where rows have no class), `fraction` of them, at least 1 of a class of 3
    or more and never the last (assign_splits' rule), picked by a generator seeded by `seed`
    alone (not by the rows' order in another split), so a bundle's data gives the same slice."""
    chosen = np.zeros(len(strata), dtype=bool)
    if fraction <= 0:
        return chosen
    rng = np.random.default_rng([seed, ALL_SPLITS.index(CALIBRATION)])
    by_stratum: dict[Any, list[int]] = {}
    for index, stratum in enumerate(strata):
        by_stratum.setdefault(stratum, []).append(index)
    for stratum in sorted(by_stratum, key=str):
        group = by_stratum[stratum]
        picked = rng.permutation(len(group))[:_share(len(group), fraction)]
        chosen[[group[i] for i in picked]] = True
    return chosen


def _carve_items(items: Sequence[ImageItem], fraction: float, seed: int) -> None:
    """The training items of which calibration_cut picks the slice: their `split` becomes
    CALIBRATION."""
    train = [item for item in items if item.split == "train"]
    for item, chosen in zip(train, calibration_cut([i.label for i in train], fraction, seed)):
        if chosen:
            item.split = CALIBRATION


def _split_rows(split: Split, rows: np.ndarray) -> Split:
    return Split(x=split.x[rows], y=split.y[rows], ids=[split.ids[i] for i in np.flatnonzero(rows)],
                 raw=None if split.raw is None else [split.raw[i] for i in np.flatnonzero(rows)])


def _carved_after_reading(reader, options: DataOptions, preprocessing: dict | None,
                          labels: Sequence[str] | None, splits: Sequence[str]) -> Dataset:
    """A model type's own reader, which knows train, val and test: the training split read whole,
    then the slice cut from it (stratified by class where a row has one class, an int label).
    Its preprocessing, derived from the whole training split, saw the slice's pixels (channel
    statistics), never its labels."""
    wanted = [s for s in splits if s != CALIBRATION]
    carving = options.calibration_fraction > 0 and bool({"train", CALIBRATION} & set(splits))
    read = wanted + (["train"] if carving and "train" not in wanted else [])
    dataset = reader(options, preprocessing=preprocessing, labels=labels, splits=read)
    counts = dict(dataset.counts)
    if carving:
        train = dataset.splits["train"]
        one_class = train.y.ndim == 1 and train.y.dtype.kind in "iu"
        rows = calibration_cut(list(train.y) if one_class else [0] * len(train),
                               options.calibration_fraction, options.seed)
        dataset.splits["train"] = _split_rows(train, ~rows)
        dataset.splits[CALIBRATION] = _split_rows(train, rows)
        counts.update(train=int((~rows).sum()), calibration=int(rows.sum()))
    elif CALIBRATION in splits:
        dataset.splits[CALIBRATION] = _empty_like(dataset.splits[next(iter(dataset.splits))])
    counts.setdefault(CALIBRATION, 0)
    dataset.counts = counts
    dataset.splits = {s: dataset.splits[s] for s in splits if s in dataset.splits}
    return dataset


def _empty_like(split: Split) -> Split:
    return Split(x=split.x[:0], y=split.y[:0], ids=[], raw=None if split.raw is None else [])


class BundleRecord(Protocol):
    """What a bundle's manifest (serving.manifest.Manifest, which this package does not import)
    tells the loader: the data's recorded reading options, its preprocessing and labels."""

    dataset: Any  # DatasetRecord: .fields, the recorded JSON object
    preprocessing: Any  # Preprocessing: .spec, the JSON object the encoders read
    labels: Sequence[str]


def bundle_data_options(manifest: BundleRecord, path: str | None, show_progress: bool = True,
                        split_paths: dict[str, str | None] | None = None,
                        alternative: str = "") -> DataOptions:
    """The data the user named for a bundle (`path`: --dataset_path; `split_paths`: --val_path
    and --test_path), with the bundle's recorded reading options; ConfigError (exit 2) when
    the user must name it (DataOptions.from_manifest). Scripts call it before any work: it
    reads nothing."""
    return DataOptions.from_manifest(manifest.dataset.fields, path, show_progress, split_paths,
                                     alternative)


def split_paths_of(flags: Any) -> dict[str, str | None]:
    """--val_path, --test_path (and a detector's --annotations) as bundle_data_options takes
    them, from the parsed flags (a Config or a stage's options)."""
    return {"val": flags.val_path, "test": flags.test_path,
            "annotations": getattr(flags, "annotations", None)}


def load_bundle_dataset(manifest: BundleRecord, path: str | None, splits: Sequence[str],
                        show_progress: bool = True,
                        split_paths: dict[str, str | None] | None = None,
                        alternative: str = "") -> Dataset:
    """The data the user named (bundle_data_options), split and encoded exactly as at training
    time."""
    options = bundle_data_options(manifest, path, show_progress, split_paths, alternative)
    return load_dataset(options, preprocessing=manifest.preprocessing.spec,
                        labels=list(manifest.labels), splits=splits)


def load_image_dataset(options: DataOptions, *, preprocessing: dict | None = None,
                       labels: Sequence[str] | None = None,
                       splits: Sequence[str] = ALL_SPLITS) -> Dataset:
    listing = _list_items(options)
    items, builtin_pixels = listing.items, listing.builtin_pixels
    _carve_items(items, options.calibration_fraction, options.seed)
    trained = labels is not None
    labels = list(labels) if trained else _sorted_labels(i.label for i in items if i.split == "train")
    _check_labels({i.label for i in items}, labels, options.path, trained)
    derived = preprocessing is None
    if derived:
        preprocessing = _derive_preprocessing(items, builtin_pixels, options)
    else:  # the bundle's image size, whatever it claims, times the user's images
        kept = [i for i in items if i.split in splits]
        check_decoded_images(preprocessing, len(kept), f"the {' and '.join(splits)} split"
                             + ("s" if len(splits) > 1 else ""))
    decoded: dict[str, Split] = {}
    skipped: list[str] = []
    for split in splits:
        chosen = [i for i in items if i.split == split]
        decoded[split] = _decode_split(chosen, labels, preprocessing, builtin_pixels, skipped,
                                       options, split)
    if "train" in decoded and len(decoded["train"]) == 0:
        raise DataError(f"no usable training images in {options.path}",
                        "check that the files are readable images")
    if derived:
        preprocessing = dict(preprocessing, **channel_stats(decoded["train"].x))
    if "test" in decoded and len(decoded["test"]) == 0:
        raise DataError(f"the test split of {options.path} is empty",
                        "add images to test/ or raise --test_fraction")
    counts = Counter(i.split for i in items)
    for split, data in decoded.items():
        counts[split] = len(data)
    return Dataset(model_type=options.model_type, labels=labels, preprocessing=preprocessing,
                   splits=decoded,
                   counts={s: counts.get(s, 0) for s in ALL_SPLITS},
                   given_splits=listing.given_splits, options=options, skipped=skipped,
                   dropped=listing.dropped, columns=listing.columns)


# ----------------------------------------------------------------------------- listing


@dataclass
class _Listing:
    """All samples with their labels and splits, before decoding."""

    items: list[ImageItem]
    given_splits: bool = False
    builtin_pixels: np.ndarray | None = None  # builtin:digits' pixel array
    columns: Columns | None = None  # a table of image paths
    dropped: list[dict] = field(default_factory=list)


def _list_items(options: DataOptions) -> _Listing:
    if options.path == "builtin:digits":
        pixels, items = _builtin_digits()
        _assign_splits(items, options.val_fraction, options.test_fraction, options.seed)
        return _Listing(items, builtin_pixels=pixels)
    root = Path(options.path)
    if not root.exists():
        raise DataError(f"dataset path {root} does not exist",
                        "check the path, or use --dataset_path builtin:digits")
    if root.is_dir():
        return _Listing(*_list_folder(root, options))
    if options.dataset_format or root.suffix.lower() in TABLE_FORMATS:
        items, columns, dropped = _list_table(root, options)
        _assign_splits(items, options.val_fraction, options.test_fraction, options.seed)
        return _Listing(items, columns=columns, dropped=dropped)
    raise DataError(f"cannot read {root}: expected a folder or a "
                    f"{'/'.join(sorted(TABLE_FORMATS))} file",
                    "pass an image folder ROOT/<class>/*.png or a table of image paths")


def _builtin_digits() -> tuple[np.ndarray, list[ImageItem]]:
    from ttc.inputs.builtin_digits import load_digits_arrays  # scikit-learn's file, not its import

    images, target = load_digits_arrays()
    pixels = (images / 16.0).astype(np.float32)[:, None]  # 0..16 → [0, 1]
    items = [ImageItem(source=i, label=str(int(t))) for i, t in enumerate(target)]
    return pixels, items


def _class_folder_items(root: Path, split: str) -> list[ImageItem]:
    items = []
    for class_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        items += [ImageItem(source=file, label=class_dir.name, split=split)
                  for file in image_files(class_dir)]
    return items


def _list_folder(root: Path, options: DataOptions) -> tuple[list[ImageItem], bool]:
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


def _list_table(path: Path, options: DataOptions) -> tuple[list[ImageItem], Columns, list[dict]]:
    named = [s for s in (options.image_column, options.label_column) if s]
    frame = read_table(path, options.dataset_format, options.has_header, named)
    columns = detect_columns(frame, "image", path, options.label_column, options.image_column,
                             table_reader(options.model_type))
    image_col = columns.inputs[0]
    import pandas as pd

    labels = pd.Series(label_texts(frame[columns.label]), index=frame.index, dtype=object)
    no_path = frame[image_col].isna() | (frame[image_col].astype(str).str.strip() == "")
    dropped = [dropped_rows(path, "missing label", frame.index[labels.isna()]),
               dropped_rows(path, "missing image path", frame.index[no_path & labels.notna()])]
    keep = labels.notna() & ~no_path
    base = path.parent
    items = [ImageItem(source=(base / str(img)).resolve() if not Path(str(img)).is_absolute()
                   else Path(str(img)), label=lab)
             for img, lab in zip(frame[image_col][keep], labels[keep])]
    return items, columns, [d for d in dropped if d["count"]]


def _sorted_labels(values) -> list[str]:
    """Class names in order: numerically when every one is a number, else as text."""
    unique = set(values)
    if all(is_number(v) for v in unique):
        return sorted(unique, key=float)
    return sorted(unique)


def _check_labels(present: set[str], labels: list[str], source: str, trained: bool) -> None:
    """Labels are data: the messages quote a few, cut short (quoted_sample), and a count."""
    if len(labels) < 2:
        raise DataError(f"{source} has {len(labels)} class(es) {quoted_sample(labels)} for "
                        "training; a classifier needs at least 2",
                        "add a folder (or label) per class")
    unknown = sorted(present - set(labels))
    if unknown and trained:
        raise DataError(f"{source} has labels the model was not trained on: "
                        f"{quoted_sample(unknown)}",
                        f"the model knows {len(labels)}: {quoted_sample(labels, 10)}")
    if unknown:
        raise DataError(f"{source} has classes in its val/test split that the training split "
                        f"lacks: {quoted_sample(unknown)}",
                        "add training images for them or remove them")


def assign_splits(labels: Sequence[str], val_fraction: float, test_fraction: float,
                  seed: int) -> list[str]:
    """Deterministic stratified split: within each class, shuffle with `seed` and cut."""
    rng = np.random.default_rng(seed)
    by_class: dict[str, list[int]] = {}
    for index, label in enumerate(labels):
        by_class.setdefault(label, []).append(index)
    splits = ["train"] * len(labels)
    for label in sorted(by_class):
        group = by_class[label]
        order = rng.permutation(len(group))
        n_test = _share(len(group), test_fraction)
        n_val = _share(len(group) - n_test, val_fraction / max(1e-9, 1 - test_fraction))
        for rank, position in enumerate(order):
            splits[group[position]] = ("test" if rank < n_test else
                                       "val" if rank < n_test + n_val else "train")
    return splits


def _assign_splits(items: list[ImageItem], val_fraction: float, test_fraction: float,
                   seed: int) -> None:
    for item, split in zip(items, assign_splits([i.label for i in items], val_fraction,
                                                test_fraction, seed)):
        item.split = split


def _share(n: int, fraction: float) -> int:
    """round(n * fraction), at least 1 when the fraction is positive and n ≥ 3, leaving 1 to train."""
    if fraction <= 0 or n < 2:
        return 0
    return min(max(1 if n >= 3 else 0, round(n * fraction)), n - 1)


# ----------------------------------------------------------------------------- decoding


def _derive_preprocessing(items: list[ImageItem], builtin_pixels: np.ndarray | None,
                          options: DataOptions) -> dict:
    if builtin_pixels is not None:
        data_size, data_channels, note = tuple(builtin_pixels.shape[2:]), 1, "1/16 (builtin:digits)"
    else:
        data_size, data_channels = scan_image_headers([i for i in items if i.split == "train"])
        note = "by image mode: 8-bit /255, 16-bit /65535 (docs/data.md)"
    size = options.image_size or _capped(data_size)
    if options.image_size is None and size != data_size:
        LOG.info("images are %dx%d; training at %dx%d (set --image_size to change)",
                 data_size[0], data_size[1], size[0], size[1])
    channels = options.channels or data_channels
    return {"kind": "image", "image_size": [int(size[0]), int(size[1])], "channels": int(channels),
            "color_mode": "L" if channels == 1 else "RGB", "resample": "bilinear",
            "pixel_scale": note, "input_range": [0.0, 1.0], "layout": "NCHW",
            "normalization": "in_graph"}


def scan_image_headers(items: list[ImageItem]) -> tuple[tuple[int, int], int]:
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


def _decode_split(items: list[ImageItem], labels: list[str], preprocessing: dict,
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
                reason = first_line(err)
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


def channel_stats(x: np.ndarray) -> dict:
    mean = x.mean(axis=(0, 2, 3))
    std = x.std(axis=(0, 2, 3))
    std = np.where(std < 1e-6, 1.0, std)
    return {"mean": [float(v) for v in mean], "std": [float(v) for v in std]}


# ----------------------------------------------------------------------------- text and tabular


@dataclass
class _TableSplits:
    """Per split: labels and either texts (text models) or a frame of feature columns."""

    labels: dict[str, list[str]]
    inputs: dict[str, object]  # list[str] of texts, or a DataFrame of features
    ids: dict[str, list[str]]
    given: bool
    dropped: list[dict]
    columns: Columns


def load_table_dataset(options: DataOptions, *, preprocessing: dict | None = None,
                       labels: Sequence[str] | None = None,
                       splits: Sequence[str] = ALL_SPLITS) -> Dataset:
    table = _read_table_splits(options)
    trained = labels is not None
    labels = list(labels) if trained else _sorted_labels(table.labels["train"])
    present = {label for split in table.labels.values() for label in split}
    _check_labels(present, labels, options.path, trained)
    text = task_for(options.model_type).input_role == "text"
    if preprocessing is None:
        preprocessing = fit_table_preprocessing(table.inputs["train"], text, options)
    index = {label: i for i, label in enumerate(labels)}
    encoded: dict[str, Split] = {}
    for split in splits:
        x = encode_table(table.inputs[split], preprocessing, text, split)
        y = np.array([index[label] for label in table.labels[split]], dtype=np.int64)
        encoded[split] = Split(x=x, y=y, ids=table.ids[split],
                               raw=list(table.inputs[split]) if text else None)
    if "test" in encoded and len(encoded["test"]) == 0:
        raise DataError(f"the test split of {options.path} is empty",
                        "add rows, pass --test_path, or raise --test_fraction")
    return Dataset(model_type=options.model_type, labels=labels, preprocessing=preprocessing,
                   splits=encoded, counts={s: len(table.labels[s]) for s in ALL_SPLITS},
                   given_splits=table.given, options=options, dropped=table.dropped,
                   columns=table.columns)



# (a table, its label column, the path it came from) -> None, or DataError naming bad rows
LabelCheck = Callable[[Any, str, Any], None]


@dataclass
class TableParts:
    """The usable rows of the main table and of any --val_path/--test_path table ("main",
    "val", "test": _clean_rows' frames), the columns found, and the main table's path."""

    parts: dict[str, Any]
    columns: Columns
    path: Any


def read_table_parts(options: DataOptions, main_table: tuple[Any, Any] | None = None,
                     check_labels: LabelCheck | None = None) -> TableParts:
    """The one reading of a table type's data (the classifiers' and a regressor's): the main
    table (`main_table`: (frame, path) a type read itself, e.g. its builtin), its columns
    found, each split file's matched to them, and the rows every type drops. `check_labels`
    sees each table's label column before any row is dropped (a regressor's numeric target)."""
    role = task_for(options.model_type).input_role
    text = role == "text"
    main, path = main_table or _read_main_table(options)
    columns = detect_columns(main, role, path, options.label_column,
                             options.text_column if text else options.feature_columns,
                             table_reader(options.model_type))
    if check_labels:
        check_labels(main, columns.label, path)
    parts = {"main": _clean_rows(main, columns, text, path)}
    for split in ("val", "test"):
        extra = getattr(options, f"{split}_path")
        if extra:
            frame = read_table(Path(extra), options.dataset_format, options.has_header,
                               [columns.label, *columns.inputs])
            found = split_columns(frame, columns, list(main.columns), Path(extra),
                                  f"--{split}_path")
            if check_labels:
                check_labels(frame, found.label, extra)
            parts[split] = _clean_rows(frame, found, text, Path(extra), store_as=columns.inputs)
    return TableParts(parts, columns, path)


def _read_table_splits(options: DataOptions) -> _TableSplits:
    text = task_for(options.model_type).input_role == "text"
    read = read_table_parts(options)
    parts, columns, path = read.parts, read.columns, read.path
    main_frame = parts["main"]
    if main_frame.empty:
        reasons = "; ".join(f"{d['count']} with {with_article(d['reason'])}"
                            for d in main_frame.attrs["dropped"])
        raise DataError(f"no usable rows in {path}: {reasons or 'no data rows'}",
                        "a row needs a label cell and (text) a text; check --label_column and "
                        f"--{'text_column' if text else 'feature_columns'}")
    missing = {s: getattr(options, f"{s}_fraction") for s in ("val", "test") if s not in parts}
    assigned = assign_splits(list(main_frame["__label__"]), missing.get("val", 0.0),
                             missing.get("test", 0.0), options.seed)
    frames = {s: main_frame.loc[np.array([a == s for a in assigned], dtype=bool)] for s in SPLITS}
    for split in ("val", "test"):
        if split in parts:
            frames[split] = parts[split]
    train = frames["train"]
    sliced = calibration_cut(list(train["__label__"]), options.calibration_fraction, options.seed)
    frames["train"], frames[CALIBRATION] = train.loc[~sliced], train.loc[sliced]
    dropped = [d for f in parts.values() for d in f.attrs["dropped"]]
    return _TableSplits(
        labels={s: list(f["__label__"]) for s, f in frames.items()},
        inputs={s: list(f["__text__"]) if text else f.drop(columns="__label__")
                for s, f in frames.items()},
        ids={s: [f"{f.attrs.get('source', path)}:{i}" for i in f.index] for s, f in frames.items()},
        given=len(parts) > 1, dropped=dropped, columns=columns)


def _read_main_table(options: DataOptions):
    if options.path in BUILTIN_TABLES:
        import pandas as pd
        import sklearn.datasets

        bunch = getattr(sklearn.datasets, BUILTIN_TABLES[options.path])()
        frame = pd.DataFrame(bunch.data, columns=[str(c) for c in bunch.feature_names])
        frame = frame.map(repr)
        frame["label"] = [str(bunch.target_names[t]) for t in bunch.target]
        return frame, options.path
    path = Path(options.path)
    if not path.exists():
        raise DataError(f"dataset path {path} does not exist", "check the path")
    if path.is_dir():
        raise DataError(f"{path} is a folder; {options.model_type} reads a CSV/TSV/JSON/JSONL file",
                        "pass the data file itself")
    named = [*split_spec(options.text_column), *split_spec(options.feature_columns),
             *([options.label_column] if options.label_column else [])]
    return read_table(path, options.dataset_format, options.has_header, named), path


def _clean_rows(frame, columns: Columns, text: bool, path, store_as: list[str] | None = None):
    """Rows with an empty label cell (or, for text, every text cell empty) are dropped, with one
    WARNING per reason; `attrs["dropped"]` holds the dropped_rows() records.

    Features are kept under the training file's column names (`store_as`) so that a split file
    matched by position encodes like the training file."""
    import pandas as pd

    out = pd.DataFrame({"__label__": label_texts(frame[columns.label])}, index=frame.index,
                       dtype=object)
    no_label = out["__label__"].isna()
    no_text = pd.Series(False, index=frame.index)
    if text:
        out["__text__"] = joined_texts(frame, columns.inputs)
        no_text = (out["__text__"] == "") & ~no_label
    else:
        for column, name in zip(columns.inputs, store_as or columns.inputs):
            out[name] = frame[column]
    dropped = [dropped_rows(path, "missing label", frame.index[no_label]),
               dropped_rows(path, "empty text", frame.index[no_text])]
    out = out[~(no_label | no_text)]
    out.attrs.update(dropped=[d for d in dropped if d["count"]], source=str(path))
    return out




def dropped_rows(path, reason: str, rows) -> dict:
    """A record of rows left out of a data set (the report's `dataset.dropped_reasons`), with
    one WARNING naming the file, the reason and the first rows (numbered like inference.py's
    row ids: 1 is the first data row, the header excluded)."""
    first = [int(r) + 1 for r in list(rows)[:10]]
    if len(rows):
        more = f" and {len(rows) - len(first)} more" if len(rows) > len(first) else ""
        LOG.warning("dropped %d rows of %s with %s (rows %s%s)", len(rows), path, with_article(reason),
                    ", ".join(map(str, first)), more)
    return {"file": str(path), "reason": reason, "count": int(len(rows)), "first_rows": first}


def fit_table_preprocessing(train_inputs, text: bool, options: DataOptions) -> dict:
    if len(train_inputs) == 0:
        raise DataError(f"no training rows in {options.path}", "add rows of data")
    if text and hf_source(options.arch) is not None:
        from ttc.nets.hf import tokenizer_preprocessing  # torch and transformers: hf only

        return tokenizer_preprocessing(hf_source(options.arch), options.max_length)
    if text:
        tokenizer = Tokenizer.fit(train_inputs, options.max_vocab, options.max_length)
        LOG.info("vocabulary: %d unigrams and bigrams seen at least twice in %d training texts",
                 tokenizer.vocab_size - 2, len(train_inputs))
        return tokenizer.to_manifest()
    encoder = TabularEncoder.fit(train_inputs)
    x, _ = encoder.transform(train_inputs)
    return encoder.to_manifest(x)


def encode_table(inputs, preprocessing: dict, text: bool, split: str) -> np.ndarray:
    if text:
        return text_tokenizer(preprocessing).encode_batch(list(inputs))
    encoder = TabularEncoder.from_manifest(preprocessing)
    missing = [c["name"] for c in encoder.columns if c["name"] not in inputs.columns]
    if missing:
        raise DataError(f"the data lacks the feature columns {quoted_sample(missing)} the model "
                        "was trained on",
                        f"its columns are {quoted_sample(inputs.columns, 10)}")
    x, bad = encoder.transform(inputs)
    if bad:
        LOG.warning("%d rows of the %s split hold a non-numeric or out-of-range value in a "
                    "numeric column; non-numbers are treated as missing", bad, split)
    return x


# the classifiers' readers cut the slice from the listed rows, before decoding or fitting an
# encoder (the other types' readers: load_dataset cuts it from their training split)
load_image_dataset.carves_calibration = True  # type: ignore[attr-defined]
load_table_dataset.carves_calibration = True  # type: ignore[attr-defined]
