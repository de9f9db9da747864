"""Batch inference on new data (`inference.py --input`): read any size of input in chunks, encode
each chunk exactly as the bundle's model was trained (tables.py's rules and preprocess.py's
encoders: the same code training used), predict, and write the predictions as they come (flat
memory), to a temporary file moved into place at the end.

Inputs: an image file, a folder of images (recursive; a first-level folder named like a class is
that image's label), a CSV/TSV/JSON/JSONL table (text, tabular features, or image paths), or "-"
for one text per line on stdin. A row that cannot be used (an undecodable image, a non-numeric
feature, a missing image path) becomes an error row, not a failed run. numpy, pandas and Pillow
only.
"""
from __future__ import annotations

import csv
import io
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from evaluation import Tally, bundle_evaluation
from preprocess import TabularEncoder, decode_image_file, image_files, text_tokenizer
from tables import (IMAGE_EXTENSIONS, Columns, iter_table, joined_texts, label_texts,
                    serving_columns, split_spec, table_format)
from utils import LOG, ConfigError, DataError, atomic_write_stream, progress, first_line

ROLES = {"text": "text", "tabular": "feature", "image": "image"}  # preprocessing kind → inputs
Predictor = Callable[[np.ndarray], tuple[np.ndarray, dict[str, np.ndarray]]]


@dataclass
class Chunk:
    """Encoded rows ready for the model, the rows that failed, and the true labels if given."""

    ids: list[str]
    x: np.ndarray | None
    labels: list[str | None] | None = None
    errors: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class BatchOptions:
    """What the --input path takes from the Config."""

    input: str
    output: str
    chunk_rows: int = 4096
    errors: str | None = None
    allow_errors: bool = False
    top_k: int = 1
    label_column: str | None = None
    text_column: str | None = None
    feature_columns: str | None = None
    image_column: str | None = None
    dataset_format: str | None = None
    show_progress: bool = True

    @classmethod
    def from_config(cls, config, chunk_rows: int) -> "BatchOptions":
        names = [n for n in cls.__dataclass_fields__ if n not in ("chunk_rows", "show_progress")]
        return cls(chunk_rows=chunk_rows, show_progress=not config.no_progress,
                   **{n: getattr(config, n) for n in names})

    def input_spec(self, role: str) -> str | None:
        return {"text": self.text_column, "feature": self.feature_columns,
                "image": self.image_column}[role]


# ----------------------------------------------------------------------------- images


def _decode_images(paths: Sequence[Path], ids: Sequence[str], labels: Sequence[str | None],
                   preprocessing: dict) -> Chunk:
    pixels, kept_ids, kept_labels, errors = [], [], [], []
    for path, ident, label in zip(paths, ids, labels):
        try:
            pixels.append(decode_image_file(path, preprocessing))
        except Exception as err:  # noqa: BLE001 - any decoder failure is this row's error
            reason = first_line(err)
            errors.append((ident, f"unreadable image: {reason}"))
            continue
        kept_ids.append(ident)
        kept_labels.append(label)
    x = np.stack(pixels).astype(np.float32) if pixels else None
    return Chunk(kept_ids, x, kept_labels if any(v is not None for v in kept_labels) else None,
                 errors)


def image_folder_chunks(root: Path, manifest: dict, chunk_rows: int) -> Iterator[Chunk]:
    classes = set(manifest["labels"])

    def label_of(path: Path) -> str | None:
        parts = path.relative_to(root).parts if root.is_dir() else ()
        return parts[0] if len(parts) > 1 and parts[0] in classes else None

    files = list(image_files(root))
    for start in range(0, len(files), chunk_rows):
        batch = [p for p in files[start:start + chunk_rows] if utf8_name(p)]
        chunk = _decode_images(batch, [str(p) for p in batch], [label_of(p) for p in batch],
                               manifest["preprocessing"])
        chunk.errors += [(printable_name(p), "the file name is not valid UTF-8; rename the file")
                         for p in files[start:start + chunk_rows] if not utf8_name(p)]
        yield chunk


def utf8_name(path: Path) -> bool:
    """Can the path be written to a UTF-8 output? (Linux hands undecodable bytes of a file name
    to Python as lone surrogates, which no UTF-8 writer accepts.)"""
    try:
        str(path).encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def printable_name(path: Path) -> str:
    """A path's bytes as UTF-8 text, undecodable bytes as \\xNN escapes."""
    import os

    return os.fsencode(path).decode("utf-8", "backslashreplace")


# ----------------------------------------------------------------------------- tables


class TableReader:
    """Chunks of a table, its columns chosen and its rows encoded as at training time."""

    def __init__(self, path: Path, manifest: dict, options: BatchOptions) -> None:
        self.path, self.manifest, self.options = path, manifest, options
        self.kind = manifest["preprocessing"]["kind"]
        self.role = ROLES[self.kind]
        self.fmt = table_format(path, options.dataset_format)
        self.recorded = manifest.get("dataset") or {}
        self.tokenizer = text_tokenizer(manifest["preprocessing"]) \
            if self.kind == "text" else None
        self.encoder = TabularEncoder.from_manifest(manifest["preprocessing"]) \
            if self.kind == "tabular" else None
        self.columns: Columns | None = None
        self.renamed: dict[str, str] = {}

    def _named_columns(self) -> list[str]:
        """Column names the header would hold: the flags given now and the training file's."""
        resolved = self.recorded.get("columns") or {}
        specs = [self.options.label_column, self.options.input_spec(self.role),
                 resolved.get("label"), *resolved.get("inputs", []),
                 self.recorded.get("label_column"), self.recorded.get(f"{self.role}_column")]
        if self.encoder is not None:
            specs += [c["name"] for c in self.encoder.columns]
        return [name for spec in specs for name in split_spec(spec)]

    def _trained_columns(self) -> Columns:
        """The columns training used: recorded by name, or (bundles from before names were
        recorded) as the flags gave them; a tabular model's inputs are its feature columns."""
        recorded = self.recorded.get("columns")
        if recorded:
            trained = Columns(recorded["label"], list(recorded["inputs"]))
        else:
            spec = self.recorded.get("feature_columns" if self.role == "feature"
                                     else f"{self.role}_column")
            trained = Columns(self.recorded.get("label_column"), split_spec(spec))
        if self.encoder is not None:
            trained.inputs = [c["name"] for c in self.encoder.columns]
        return trained

    def _choose_columns(self, frame) -> Columns:
        columns = serving_columns(frame, self._trained_columns(), self.path, self.role,
                                  self.options.label_column, self.options.input_spec(self.role))
        if self.encoder is not None:  # the encoder reads features by their training names
            self.renamed = dict(zip(columns.inputs, (c["name"] for c in self.encoder.columns)))
        return columns

    def __iter__(self) -> Iterator[Chunk]:
        numeric = ([c["name"] for c in self.encoder.columns if c["type"] == "numeric"]
                   if self.encoder is not None else [])
        for frame in iter_table(self.path, self.fmt, self.recorded.get("has_header") or "auto",
                                self._named_columns(), self.options.chunk_rows, numeric):
            if self.columns is None:
                self.columns = self._choose_columns(frame)
            if frame.empty:  # a header alone
                continue
            ids = [str(i + 1) for i in frame.index]  # 1-based data rows, header excluded
            label = self.columns.label
            labels = label_texts(frame[label]) if label else None
            yield self._encode(frame, ids, labels)

    def _encode(self, frame, ids: list[str], labels: list[str | None] | None) -> Chunk:
        inputs = self.columns.inputs
        if self.kind == "image":
            return self._decode_image_paths(list(frame[inputs[0]]), ids,
                                            labels or [None] * len(ids))
        if self.kind == "text":  # an empty text is predicted too (its tokens: [UNK])
            return Chunk(ids, self.tokenizer.encode_batch(list(joined_texts(frame, inputs))),
                         labels)
        x, reasons = self.encoder.encode(frame[inputs].rename(columns=self.renamed))
        usable = [r is None for r in reasons]
        errors = [(i, r) for i, r in zip(ids, reasons) if r is not None]
        return Chunk(_kept(ids, usable), x[np.array(usable, dtype=bool)] if any(usable) else None,
                     _kept(labels, usable) if labels else None, errors)


    def _decode_image_paths(self, cells: list, ids: list[str], labels: list[str | None]
                            ) -> Chunk:
        """Image paths relative to the table; a missing path (NaN) is an error row."""
        usable = [cell == cell for cell in cells]
        paths = [Path(str(cell)) if Path(str(cell)).is_absolute() else self.path.parent / str(cell)
                 for cell, ok in zip(cells, usable) if ok]
        chunk = _decode_images(paths, _kept(ids, usable), _kept(labels, usable),
                               self.manifest["preprocessing"])
        chunk.errors += [(i, "missing image path") for i, ok in zip(ids, usable) if not ok]
        return chunk


def _kept(values: Sequence, keep: Sequence[bool]) -> list:
    return [v for v, k in zip(values, keep) if k]


# ----------------------------------------------------------------------------- stdin


def stdin_chunks(manifest: dict, chunk_rows: int, stream: io.TextIOBase | None = None
                 ) -> Iterator[Chunk]:
    """One text per line (a blank line is an empty text)."""
    if manifest["preprocessing"]["kind"] != "text":
        raise ConfigError("--input - reads one text per line, and this is a "
                          f"{manifest['model_type']}", "give a file or folder as --input")
    tokenizer = text_tokenizer(manifest["preprocessing"])
    texts: list[str] = []
    row = 0
    for line in stream or sys.stdin:
        texts.append(line.rstrip("\r\n"))
        if len(texts) == chunk_rows:
            yield Chunk([str(row + i + 1) for i in range(len(texts))],
                        tokenizer.encode_batch(texts))
            row += len(texts)
            texts = []
    if texts:
        yield Chunk([str(row + i + 1) for i in range(len(texts))], tokenizer.encode_batch(texts))


def input_chunks(manifest: dict, options: BatchOptions) -> Iterator[Chunk]:
    """The chunks of --input, whatever it is."""
    if options.input == "-":
        return stdin_chunks(manifest, options.chunk_rows)
    path = Path(options.input)
    if not path.exists():
        raise DataError(f"input {path} does not exist", "check the path")
    if path.is_dir() or path.suffix.lower() in IMAGE_EXTENSIONS:
        if manifest["preprocessing"]["kind"] != "image":
            raise ConfigError(f"{path} is an image or a folder, and this is a "
                              f"{manifest['model_type']}", "give a CSV/TSV/JSON/JSONL file")
        return image_folder_chunks(path, manifest, options.chunk_rows)
    return iter(TableReader(path, manifest, options))


# ----------------------------------------------------------------------------- writing


def neutralised(value: str) -> str:
    """A cell a spreadsheet would not run as a formula (=, +, -, @ first)."""
    return "'" + value if value[:1] in ("=", "+", "-", "@") else value


def _csv_cell(value: str) -> str:
    value = neutralised(value)
    if any(c in value for c in ',"\r\n'):
        return '"' + value.replace('"', '""') + '"'
    return value


def csv_lines(columns: Sequence[object]) -> str:
    """Rows of CSV text from whole columns: numbers formatted by numpy, object arrays taken as
    cells already made safe (the labels, quoted once), other strings quoted where needed and
    neutralised. Faster than a csv.writer loop or DataFrame.to_csv."""
    cells = []
    for column in columns:
        if isinstance(column, np.ndarray):
            cells.append(column.astype(str).tolist() if column.dtype.kind == "f"
                         else column.tolist())
        else:
            cells.append([_csv_cell(str(v)) for v in column])
    return "".join(line + "\n" for line in map(",".join, zip(*cells)))


class PredictionWriter:
    """Rows to CSV or JSONL (by the output's extension) in an open temporary file, a chunk at
    a time through pandas (a Python loop over rows cost more than the model)."""

    def __init__(self, handle: io.TextIOBase, fmt: str, labels: Sequence[str], top_k: int,
                 with_truth: bool, extra: Sequence[str]) -> None:
        self.handle, self.fmt, self.top_k = handle, fmt, top_k
        shown = [_csv_cell(str(label)) for label in labels] if fmt == "csv" else list(labels)
        self.labels = np.array(shown, dtype=object)
        self.columns = ["id", "label", "confidence"]
        for k in range(1, top_k + 1):
            self.columns += [f"top{k}_label", f"top{k}_probability"]
        self.columns += list(extra) + (["true_label"] if with_truth else [])
        if fmt == "csv":
            csv.writer(handle).writerow(self.columns)

    def write(self, ids: Sequence[str], probabilities: np.ndarray,
              extra: dict[str, np.ndarray], truth: Sequence[str | None] | None) -> None:
        rows = np.arange(len(ids))
        order = np.argsort(-probabilities, axis=1, kind="stable")[:, : self.top_k]
        top = probabilities[rows[:, None], order].round(6)
        plain_ids = self.fmt == "csv" and all(i.isdigit() for i in ids)  # row numbers
        columns: dict[str, object] = {"id": np.array(ids, dtype=object) if plain_ids
                                      else list(ids), "label": self.labels[order[:, 0]],
                                      "confidence": top[:, 0]}
        for k in range(self.top_k):
            columns[f"top{k + 1}_label"] = self.labels[order[:, k]]
            columns[f"top{k + 1}_probability"] = top[:, k]
        for name, values in extra.items():
            columns[name] = np.round(values, 6)
        if "true_label" in self.columns:
            columns["true_label"] = ["" if truth is None or t is None else t
                                     for t in (truth or [None] * len(ids))]
        if self.fmt == "csv":
            self.handle.write(csv_lines([columns[name] for name in self.columns]))
        else:
            import pandas as pd

            frame = pd.DataFrame(columns, columns=self.columns)
            text = frame.to_json(orient="records", lines=True, double_precision=6,
                                 force_ascii=False)
            self.handle.write(text if text.endswith("\n") else text + "\n")


# ----------------------------------------------------------------------------- running


def prefetched(chunks, depth: int = 2):
    """Read and encode the next chunks in a thread while the model runs on this one (ONNX
    Runtime releases the GIL); the reader's errors are raised here."""
    import queue
    import threading

    # The reader holds the GIL while it tokenises; hand it back to the model thread sooner than
    # the default 5 ms after each session.run (SMS texts at batch 256: 18k → 26k rows/s).
    sys.setswitchinterval(0.0001)
    items: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def produce() -> None:
        try:
            for chunk in chunks:
                items.put(chunk)
            items.put(done)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer
            items.put(err)

    threading.Thread(target=produce, daemon=True).start()
    while True:
        item = items.get()
        if item is done:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


@dataclass
class BatchRun:
    input: str
    output: str
    rows: int = 0
    predicted: int = 0
    failed: int = 0
    labeled: int = 0
    correct: int = 0
    outside_classes: int = 0  # labelled rows whose label is none of the model's classes
    errors_path: str | None = None
    seconds: float = 0.0

    def report_section(self) -> dict:
        section = dict(vars(self))
        section["accuracy"] = self.correct / self.labeled if self.labeled else None
        section["rows_per_s"] = round(self.predicted / self.seconds, 1) if self.seconds else None
        del section["correct"]
        return section


def predict_input(options: BatchOptions, manifest: dict, predict: Predictor,
                  extra_names: Sequence[str], report: dict) -> None:
    """--input → --output: chunks read and encoded in a thread, predicted by `predict` (the
    model with the test-time compute asked for), and written as they come, to a temporary file
    moved into place at the end (and the errors to --errors likewise)."""
    run = BatchRun(options.input, options.output, errors_path=options.errors)
    fmt = Path(options.output).suffix.lower().lstrip(".")
    labels = manifest["labels"]
    index = {label: i for i, label in enumerate(labels)}
    top_k = min(options.top_k, len(labels))
    error_rows: list[tuple[str, str]] = []
    tally = Tally(len(labels))  # the rows with a true label among the classes
    started = time.perf_counter()
    chunks = prefetched(input_chunks(manifest, options))
    with atomic_write_stream(options.output) as handle:
        writer = None
        for chunk in progress(chunks, desc="predict", enabled=options.show_progress):
            run.rows += len(chunk.ids) + len(chunk.errors)
            run.failed += len(chunk.errors)
            error_rows += chunk.errors
            if chunk.x is None:
                continue
            if writer is None:
                writer = PredictionWriter(handle, fmt, labels, top_k, chunk.labels is not None,
                                          extra_names)
            probabilities, extra = predict(chunk.x)
            writer.write(chunk.ids, probabilities, extra, chunk.labels)
            run.predicted += len(chunk.ids)
            if chunk.labels is not None:
                known = [(i, index.get(t)) for i, t in enumerate(chunk.labels) if t is not None]
                run.labeled += len(known)
                run.correct += sum(probabilities[i].argmax() == k for i, k in known)
                classes = [(i, k) for i, k in known if k is not None]
                run.outside_classes += len(known) - len(classes)
                if classes:
                    rows, truth = map(list, zip(*classes))
                    tally.add(probabilities[rows], np.asarray(truth))
        run.seconds = round(time.perf_counter() - started, 3)
        report["predictions"] = run.report_section()
        if tally.samples:
            report["evaluation"] = bundle_evaluation(manifest, tally, "input")
        if run.predicted == 0:  # raised inside the block: the previous output stays as it was
            _fail_without_predictions(run, options, error_rows)
    if options.errors:
        write_errors(options.errors, error_rows)
    LOG.info("predicted %d of %d rows into %s (%.0f rows/s)%s", run.predicted, run.rows,
             options.output, run.predicted / max(run.seconds, 1e-9),
             f", {run.failed} failed" if run.failed else "")
    if run.failed and not options.allow_errors:
        where = (f"listed in {options.errors}" if options.errors
                 else "add --errors PATH to list them")
        raise DataError(f"{run.failed} of {run.rows} rows could not be predicted ({where}); the "
                        f"other predictions are in {options.output}",
                        "fix those rows, or pass --allow_errors true")


def _fail_without_predictions(run: BatchRun, options: BatchOptions,
                              error_rows: Sequence[tuple[str, str]]) -> None:
    if run.rows == 0:
        raise DataError(f"{options.input} has no rows to predict; {options.output} was left "
                        "as it was", "check the input (a header alone is no rows)")
    if options.errors:
        write_errors(options.errors, error_rows)
    where = f"listed in {options.errors}" if options.errors else "add --errors PATH to list them"
    raise DataError(f"none of the {run.rows} rows of {options.input} could be predicted "
                    f"({where}); {options.output} was left as it was", "fix those rows")


def write_errors(path: str, rows: Sequence[tuple[str, str]]) -> None:
    with atomic_write_stream(path) as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "reason"])
        writer.writerows([neutralised(ident), neutralised(reason)] for ident, reason in rows)
