"""A regressor's data: a table with a numeric target column and feature columns (or text
columns), read, split and encoded by the classifiers' own input rules (ttc/inputs: the table
readers, the column detection, the text joining, the feature encoder and the tokenizer), with
what differs for a number: the target is parsed as a number (a row whose target is missing or is
no number is exit 3, naming the rows: a regressor has no class to drop it from), the splits and
the calibration slice are stratified by the target's quantiles (a class's role), and the
preprocessing record gains the target's name and training mean and standard deviation, which
the network's graph undoes. No torch here: inference.py imports it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ttc.inputs.data import (ALL_SPLITS, CALIBRATION, SPLITS, Dataset, DataOptions, Split,
                             encode_table, fit_table_preprocessing, assign_splits,
                             calibration_cut, read_table_parts)
from ttc.inputs.tables import Columns, numeric_cells
from ttc.tasks.registry import task_for
from utils import DataError

TARGET_KIND = {"feature": "tabular_regression", "text": "text_regression"}
MAX_STRATA = 10  # target quantile bins the splits are stratified by (deciles)
ROWS_PER_STRATUM = 30  # fewer bins on a small table: each keeps enough rows to split


def builtin_frame(name: str):
    """A built-in regression table (ttc/tasks/regress/builtin.py), its target in `target`."""
    from ttc.tasks.regress import builtin

    if name == "builtin:diabetes":
        return builtin.load_diabetes_table()
    if name == "builtin:friedman1":
        return builtin.friedman1_table()
    return builtin.review_scores_table()


@dataclass
class _Frames:
    frames: dict  # split → the cleaned frame (__label__ and the inputs)
    targets: dict[str, np.ndarray]
    columns: Columns
    given: bool
    dropped: list[dict]
    source: str


def target_values(frame, column: str, path) -> np.ndarray:
    """The target column as float64 numbers; a missing or non-numeric cell is a DataError
    (exit 3) naming the first rows (1: the first data row, as dropped rows are numbered)."""
    numbers, wrong = numeric_cells(frame[column])
    missing = np.isnan(numbers) & ~wrong
    infinite = np.isinf(numbers)
    for mask, what in ((missing, "a missing"), (wrong, "a non-numeric"),
                       (infinite, "an infinite")):
        if mask.any():
            rows = [int(r) + 1 for r in frame.index[mask][:10]]
            more = f" and {int(mask.sum()) - len(rows)} more" if mask.sum() > len(rows) else ""
            raise DataError(f"{path}: {int(mask.sum())} rows hold {what} target in the column "
                            f"{column!r} (rows {', '.join(map(str, rows))}{more}); a regressor "
                            "predicts a number and learns from numbers",
                            "fix or remove those rows, or name the target with --label_column")
    return numbers


def strata(targets: np.ndarray) -> list[str]:
    """Each row's target quantile bin (up to MAX_STRATA, ROWS_PER_STRATUM rows each at least):
    the splits stratified by it keep the target's spread in every split."""
    bins = max(1, min(MAX_STRATA, len(targets) // ROWS_PER_STRATUM))
    if bins == 1:
        return ["all"] * len(targets)
    edges = np.quantile(targets, np.linspace(0, 1, bins + 1)[1:-1])
    return [f"q{int(k)}" for k in np.searchsorted(edges, targets, side="right")]


def _read_frames(options: DataOptions) -> _Frames:
    builtin = options.path in task_for(options.model_type).builtins
    # the target checked before any row is dropped: exit 3 names the rows
    read = read_table_parts(options, (builtin_frame(options.path), options.path)
                            if builtin else None, check_labels=target_values)
    parts, columns, path = read.parts, read.columns, read.path
    main_frame = parts["main"]
    if main_frame.empty:
        raise DataError(f"no usable rows in {path}", "a row needs a target and (text) a text")
    values = {name: numeric_cells(frame["__label__"])[0] for name, frame in parts.items()}
    missing = {s: getattr(options, f"{s}_fraction") for s in ("val", "test") if s not in parts}
    assigned = np.array(assign_splits(strata(values["main"]), missing.get("val", 0.0),
                                      missing.get("test", 0.0), options.seed))
    frames = {s: main_frame.loc[assigned == s] for s in SPLITS}
    targets = {s: values["main"][assigned == s] for s in SPLITS}
    for split in ("val", "test"):
        if split in parts:
            frames[split], targets[split] = parts[split], values[split]
    sliced = calibration_cut(strata(targets["train"]), options.calibration_fraction,
                             options.seed)
    train, train_y = frames["train"], targets["train"]
    frames["train"], frames[CALIBRATION] = train.loc[~sliced], train.loc[sliced]
    targets["train"], targets[CALIBRATION] = train_y[~sliced], train_y[sliced]
    dropped = [d for f in parts.values() for d in f.attrs["dropped"]]
    return _Frames(frames, targets, columns, len(parts) > 1, dropped, str(path))


def target_record(name: str, train: np.ndarray) -> dict:
    """The preprocessing's `target`: its column and the training split's mean and standard
    deviation (1 where the target is constant), which the graph multiplies and adds back, and
    its range (the report's dataset section shows it)."""
    if len(train) == 0:
        raise DataError("no training rows", "add rows of data")
    std = float(train.std())
    return {"name": str(name), "mean": float(train.mean()), "std": std if std > 1e-12 else 1.0,
            "min": float(train.min()), "max": float(train.max())}


def load_regression_dataset(options: DataOptions, *, preprocessing: dict | None = None,
                            labels: Sequence[str] | None = None,
                            splits: Sequence[str] = ALL_SPLITS) -> Dataset:
    """Parts.reader of the regressors: find, split (stratified by the target's quantiles) and
    encode; `labels` is [the target's name] (a bundle's), the dataset's too. With a bundle's
    `preprocessing` the inputs are encoded exactly as at training time."""
    read = _read_frames(options)
    text = task_for(options.model_type).input_role == "text"
    inputs = {s: list(f["__text__"]) if text else f.drop(columns="__label__")
              for s, f in read.frames.items()}
    if preprocessing is None:
        base = fit_table_preprocessing(inputs["train"], text, options)
        preprocessing = {**base, "kind": TARGET_KIND[task_for(options.model_type).input_role],
                         "target": target_record(read.columns.label, read.targets["train"])}
    encoded = {}
    for split in splits:
        x = encode_table(inputs[split], preprocessing, text, split)
        ids = [f"{read.frames[split].attrs.get('source', read.source)}:{i}"
               for i in read.frames[split].index]
        encoded[split] = Split(x=x, y=read.targets[split].astype(np.float64), ids=ids,
                               raw=list(inputs[split]) if text else None)
    if "test" in encoded and len(encoded["test"]) == 0:
        raise DataError(f"the test split of {options.path} is empty",
                        "add rows, pass --test_path, or raise --test_fraction")
    return Dataset(model_type=options.model_type,
                   labels=list(labels) if labels else [preprocessing["target"]["name"]],
                   preprocessing=preprocessing, splits=encoded,
                   counts={s: len(read.frames[s]) for s in ALL_SPLITS}, given_splits=read.given,
                   options=options, dropped=read.dropped, columns=read.columns)


# the slice is cut here, stratified by the target (load_dataset leaves it to this reader)
load_regression_dataset.carves_calibration = True  # type: ignore[attr-defined]
