"""Batch inference on new data (`inference.py --input`): read any size of input in chunks, encode
each chunk exactly as the bundle's model was trained (tables.py's rules and preprocess.py's
encoders: the same code training used), predict, and write the predictions as they come (flat
memory), to a temporary file moved into place at the end.

Inputs: an image file, a folder of images (recursive; a first-level folder named like a class is
that image's label), a CSV/TSV/JSON/JSONL/Parquet table (text, tabular features, or image paths),
or "-" for one text per line on stdin. A row that cannot be used (an undecodable image, a
non-numeric feature, a missing image path) becomes an error row, not a failed run. Outputs: CSV,
JSONL or Parquet. The stages, reading → encoding (RowEncoder) → predicting → writing, are the
same functions whether they run here or on Ray workers (cluster.py). numpy, pandas and Pillow
(pyarrow for Parquet) only.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ttc.reporting.evaluation import Tally, bundle_evaluation
from ttc.inputs.limits import LIMITS, images_per_chunk, row_hint
from ttc.inputs.preprocess import TabularEncoder, decode_image_file, image_files, text_tokenizer
from ttc.serving.manifest import Manifest, as_manifest
from ttc.inputs.data import table_reader
from ttc.inputs.tables import (IMAGE_EXTENSIONS, TABLE_FORMATS, Cells, Columns, FeatureBlock,
                    iter_table, ID_NAMES, PARQUET_BATCH_ROWS, canonical_number, find_by_name,
                    frame_columns, joined_text_list,
                    label_texts, parquet_cells, parquet_feature_blocks, parquet_header,
                    reads_as_numbers, refuse_nested, serving_columns, split_spec, table_format)
from ttc.tasks.registry import task_of_kind
from utils import (LOG, ConfigError, DataError, atomic_write_stream, first_line, progress,
                   quoted_sample, raise_if_interrupted, with_article)

Predictor = Callable[[np.ndarray], tuple[np.ndarray, dict[str, np.ndarray]]]
# A row frame (what reading hands to encoding, in this process or on a Ray worker): the rows'
# ids, their true labels ("" none), the reason a row already failed ("" none), and the inputs
# under fixed names: the texts to join (__text0, __text1, ... in order), an image's absolute
# path (__path) or its file bytes (__image), or the tabular features under their training names.
ROW_ID, ROW_LABEL, ROW_ERROR, ROW_PATH, ROW_TEXT = "__id", "__label", "__error", "__path", "__text"
ROW_IMAGE = "__image"  # an image's file bytes (serve.py's requests) in place of its path
ROW_KEY = "__key:"  # + a name: the input's own id column under that name (see RowKeys)


@dataclass
class RowKeys:
    """The input's own id column (a table's, batch.TableReader._key_column), which the prediction
    table carries under its `name`: each row id's cell as text."""

    name: str
    values: dict[str, str]

    def of(self, ids: Sequence[str]) -> list[str]:
        return [self.values[i] for i in ids]


@dataclass
class Chunk:
    """Encoded rows ready for the model, the rows that failed, and the true labels if given."""

    ids: Sequence[str]  # a list, or RowIds
    x: np.ndarray | None
    labels: list[str | None] | None = None
    errors: list[tuple[str, str]] = field(default_factory=list)
    keys: RowKeys | None = None


@dataclass
class BatchOptions:
    """What the --input path takes from the inference stage's options."""

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
    max_row_bytes: int | None = None
    batch_size: int = 64
    ttt: bool = False
    id_column: str | None = None

    @classmethod
    def from_config(cls, options: Any, chunk_rows: int) -> "BatchOptions":
        """Out of the inference stage's options (ttc/options/stages.py's InferenceOptions, or
        any larger flags object)."""
        names = [n for n in cls.__dataclass_fields__ if n not in ("chunk_rows", "show_progress")]
        return cls(chunk_rows=chunk_rows, show_progress=not options.no_progress,
                   **{n: getattr(options, n) for n in names})

    def input_spec(self, role: str) -> str | None:
        return {"text": self.text_column, "feature": self.feature_columns,
                "image": self.image_column}[role]

    def rows_per_chunk(self, manifest: Manifest) -> int:
        """--chunk_rows, or fewer where the bundle's images would not fit
        --max_image_memory_mb (whole test-time training batches kept)."""
        preprocessing = manifest.preprocessing
        if not task_of_kind(preprocessing.kind).image_files:
            return self.chunk_rows
        return images_per_chunk(preprocessing.spec, self.chunk_rows,
                                self.batch_size if self.ttt else 1)


def row_frame(ids: Sequence[str], labels: Sequence[str | None] | None, inputs,
              errors: Sequence[str] | None = None,
              keys: tuple[str, Sequence[str]] | None = None, index=None):
    """A row frame from its parts: `inputs` a DataFrame already holding the input columns under
    their fixed names (its columns are kept as they are, not copied), or a dict of them (arrays
    or lists; `index` the rows' index, by default 0, 1, ...); labels None when the input has no
    label column; `keys` (a name, the cells) the input's own id column, for the prediction
    table. Cells of text are plain Python strings (pandas would copy them to Arrow)."""
    import pandas as pd

    if isinstance(inputs, pd.DataFrame):
        index, inputs = inputs.index, {k: v.to_numpy() for k, v in inputs.items()}
    index = pd.RangeIndex(len(ids)) if index is None else index
    return row_cells(ids, labels, inputs, errors, keys, np.asarray(index)).to_pandas(index)


def row_cells(ids: Sequence[str], labels: Sequence[str | None] | None, inputs: Mapping,
              errors: Sequence[str] | None = None,
              keys: tuple[str, Sequence[str]] | None = None,
              index: np.ndarray | None = None) -> Cells:
    """row_frame's columns as Cells (a request's rows: serve.py's row frames, without pandas'
    cost per call); `inputs` a dict, `index` the rows' 0-based data rows (default 0, 1, ...)."""
    columns = {ROW_ID: ids}
    if labels is not None:
        columns[ROW_LABEL] = ["" if v is None else v for v in labels]
    columns[ROW_ERROR] = errors if errors is not None else np.full(len(ids), "", object)
    columns.update(inputs)
    if keys is not None:
        columns[ROW_KEY + keys[0]] = keys[1]
    arrays = {name: np.asarray(v, dtype=object)
              if not isinstance(v, np.ndarray) or v.dtype.kind in "OUS" else v
              for name, v in columns.items()}
    return Cells(arrays, np.arange(len(ids)) if index is None else index)


def row_keys(frame, names: Sequence[str] | None = None) -> RowKeys | None:
    """A row frame's id column (ROW_KEY), by row id; None when it has none. `names`: its
    columns, where the caller has them."""
    column = next((c for c in (names or frame.columns) if c.startswith(ROW_KEY)), None)
    if column is None:
        return None
    return RowKeys(column[len(ROW_KEY):], dict(zip(frame[ROW_ID].tolist(),
                                                   frame[column].tolist())))


def id_texts(values) -> list[str]:
    """An id column's cells as written (a number a Parquet column stores as one in its one
    spelling); a missing cell empty."""
    def text(value) -> str:
        if value is None or (isinstance(value, float) and value != value):
            return ""
        if isinstance(value, (float, np.floating)):
            return canonical_number(float(value)) or str(value)
        return str(value)

    return [text(v) for v in values]


class RowIds(Sequence[str]):
    """The ids of a table's rows (their 1-based data row numbers, as text) kept as numbers until
    read as text: the columnar path's ids, most of which are only counted or written as a
    Parquet column (converted by Arrow at once)."""

    __hash__ = None  # type: ignore[assignment] - a sequence compared by value, as a list

    def __init__(self, numbers: np.ndarray) -> None:
        self.numbers = numbers

    def __len__(self) -> int:
        return len(self.numbers)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return RowIds(self.numbers[index])
        return str(self.numbers[index])

    def __iter__(self) -> Iterator[str]:
        return map(str, self.numbers.tolist())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and \
            list(self) == list(other)

    def __repr__(self) -> str:
        return f"RowIds({list(self)!r})"

    def arrow(self):
        """The ids as an Arrow string array."""
        import pyarrow as pa

        return pa.array(self.numbers).cast(pa.string())


# ----------------------------------------------------------------------------- encoding


class RowEncoder:
    """Row frames → model inputs, by the encoders the bundle's model was trained with
    (preprocess.py, tables.py): the one step between reading and predicting, the same in this
    process and on a Ray worker."""

    def __init__(self, manifest: Manifest | Mapping) -> None:
        preprocessing = as_manifest(manifest).preprocessing
        self.rows = task_of_kind(preprocessing.kind).part("rows")(preprocessing.spec)

    def encode(self, frame) -> Chunk:
        names = list(frame.columns)
        keys = row_keys(frame, names)
        own = frame_columns(frame, [n for n in (ROW_ID, ROW_ERROR, ROW_LABEL) if n in names])
        reasons, ids = own[ROW_ERROR], own[ROW_ID]
        failed = reasons != ""
        errors = [(str(ids[k]), str(reasons[k])) for k in np.flatnonzero(failed)]
        if errors:
            frame = frame[~failed]
            ids = ids[~failed]
        ids = ids.tolist()
        labels = ([v if v != "" else None for v in own[ROW_LABEL][~failed].tolist()]
                  if ROW_LABEL in own else None)
        chunk = self._encoded(frame, ids, labels)
        chunk.errors = errors + chunk.errors
        chunk.keys = keys
        return chunk

    def _encoded(self, frame, ids: list[str], labels: list[str | None] | None) -> Chunk:
        if not ids:
            return Chunk([], None, labels)
        return self.rows.encode(frame, ids, labels)


class ImageRows:
    """Image paths → pixels at the bundle's size and channels; an unreadable file fails its row."""

    def __init__(self, preprocessing: dict) -> None:
        self.preprocessing = preprocessing

    def encode(self, frame, ids: list[str], labels: list[str | None] | None) -> Chunk:
        sources = ([io.BytesIO(b) for b in frame[ROW_IMAGE]] if ROW_IMAGE in frame
                   else [Path(p) for p in frame[ROW_PATH]])
        return _decode_images(sources, ids, labels or [None] * len(ids), self.preprocessing)


class TextRows:
    """Text cells → token ids; an empty text is predicted too (its tokens: [UNK])."""

    def __init__(self, preprocessing: dict) -> None:
        self.tokenizer = text_tokenizer(preprocessing)

    def encode(self, frame, ids: list[str], labels: list[str | None] | None) -> Chunk:
        texts = [c for c in frame.columns if c.startswith(ROW_TEXT)]
        return Chunk(ids, self.tokenizer.encode_batch(joined_text_list(frame, texts)), labels)


class FeatureRows:
    """Feature cells → the standardised-at-training feature matrix; a row the encoder refuses
    (an unknown category, a non-number) fails alone."""

    def __init__(self, preprocessing: dict) -> None:
        self.encoder = TabularEncoder.from_manifest(preprocessing)

    def encode(self, frame, ids: list[str], labels: list[str | None] | None) -> Chunk:
        x, reasons = self.encoder.encode(frame)  # reads its columns by name
        usable = [r is None for r in reasons]
        errors = [(i, r) for i, r in zip(ids, reasons) if r is not None]
        return Chunk(_kept(ids, usable), x[np.array(usable, dtype=bool)] if any(usable) else None,
                     _kept(labels, usable) if labels else None, errors)


def _kept(values: Sequence, keep: Sequence[bool]) -> list:
    return [v for v, k in zip(values, keep) if k]


# ----------------------------------------------------------------------------- images


def _decode_images(sources: Sequence[Path | io.BytesIO], ids: Sequence[str],
                   labels: Sequence[str | None], preprocessing: dict) -> Chunk:
    pixels, kept_ids, kept_labels, errors = [], [], [], []
    for source, ident, label in zip(sources, ids, labels):
        try:
            pixels.append(decode_image_file(source, preprocessing))
        except Exception as err:  # noqa: BLE001 - any decoder failure is this row's error
            reason = first_line(err).replace(f" {source!r}", "")  # bytes: no file to name
            errors.append((ident, f"unreadable image: {reason}"))
            continue
        kept_ids.append(ident)
        kept_labels.append(label)
    x = np.stack(pixels).astype(np.float32) if pixels else None
    return Chunk(kept_ids, x, kept_labels if any(v is not None for v in kept_labels) else None,
                 errors)


def folder_images(root: Path, model_type: str | None = None) -> list[Path]:
    """The image files of an image or a folder (recursive, sorted): what --input predicts. A
    table given where images belong (a segmenter's or detector's --input: `model_type`) is an
    error saying so, not one image that cannot be decoded."""
    if root.is_file() and root.suffix.lower() in TABLE_FORMATS:
        bundle = f"this bundle is {with_article(model_type)}" if model_type else "this bundle"
        raise DataError(f"{bundle}; {root.name} is a table "
                        f"({TABLE_FORMATS[root.suffix.lower()]} rows), and it reads images, "
                        "not table rows", "give it an image or a folder of images")
    return list(image_files(root))


def image_folder_frames(root: Path, manifest: Manifest, chunk_rows: int,
                        files: Sequence[Path] | None = None) -> Iterator:
    """Row frames of an image folder's files (`files`: a part of them): ids are the paths as
    found, a first-level folder named like a class is the label."""
    classes = set(manifest.labels)

    def label_of(path: Path) -> str | None:
        parts = path.relative_to(root).parts if root.is_dir() else ()
        return parts[0] if len(parts) > 1 and parts[0] in classes else None

    files = folder_images(root) if files is None else files
    for start in range(0, len(files), chunk_rows):
        batch = files[start:start + chunk_rows]
        readable = [utf8_name(p) for p in batch]
        yield row_frame(
            [str(p) if ok else printable_name(p) for p, ok in zip(batch, readable)],
            [label_of(p) if ok else None for p, ok in zip(batch, readable)],
            {ROW_PATH: [str(p.absolute()) if ok else "" for p, ok in zip(batch, readable)]},
            ["" if ok else "the file name is not valid UTF-8; rename the file"
             for ok in readable])


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
    """Row frames of a table (`row_groups`: a part of a Parquet file), its columns chosen as at
    training time; iterating it gives the encoded chunks: column-wise, without row frames,
    where the columnar path applies (see _columnar_features)."""

    columnar = True  # False: always row frames (the bench and tests compare the two paths)

    def __init__(self, path: Path, manifest: Manifest | Mapping, options: BatchOptions,
                 row_groups: range | None = None) -> None:
        manifest = as_manifest(manifest)
        self.path, self.manifest, self.options = path, manifest, options
        self.task = task_of_kind(manifest.preprocessing.kind)
        self.role = self.task.input_role
        self.fmt = table_format(path, options.dataset_format)
        self.recorded = manifest.dataset
        self.encoder = TabularEncoder.from_manifest(manifest.preprocessing.spec) \
            if self.role == "feature" else None
        self.row_groups = row_groups
        self.columns: Columns | None = None
        self.renamed: dict[str, str] = {}
        self.key: str | None = None  # the column carried into the prediction table

    def _named_columns(self) -> list[str]:
        """Column names the header would hold: the flags given now and the training file's."""
        resolved = self.recorded.columns
        specs = [self.options.label_column, self.options.input_spec(self.role),
                 resolved.label if resolved else None, *(resolved.inputs if resolved else ()),
                 self.recorded.label_column, self.recorded.flag(f"{self.role}_column")]
        if self.encoder is not None:
            specs += [c["name"] for c in self.encoder.columns]
        return [name for spec in specs for name in split_spec(spec)]

    def _trained_columns(self) -> Columns:
        """The columns training used: recorded by name, or (bundles from before names were
        recorded) as the flags gave them; a tabular model's inputs are its feature columns."""
        recorded = self.recorded.columns
        if recorded:
            trained = Columns(recorded.label, list(recorded.inputs))
        else:
            spec = self.recorded.flag("feature_columns" if self.role == "feature"
                                      else f"{self.role}_column")
            trained = Columns(self.recorded.label_column, split_spec(spec))
        if self.encoder is not None:
            trained.inputs = [c["name"] for c in self.encoder.columns]
        return trained

    def _choose_columns(self, frame) -> Columns:
        columns = serving_columns(frame, self._trained_columns(), self.path, self.role,
                                  self.options.label_column, self.options.input_spec(self.role),
                                  table_reader(self.manifest.model_type, bundle=True))
        if self.encoder is not None:  # the encoder reads features by their training names
            self.renamed = dict(zip(columns.inputs, (c["name"] for c in self.encoder.columns)))
        elif self.task.image_files:
            self.renamed = {columns.inputs[0]: ROW_PATH}
        else:
            self.renamed = {name: f"{ROW_TEXT}{k}" for k, name in enumerate(columns.inputs)}
        self.key = self._key_column(frame, columns) if self.options.output else None
        return columns

    def _key_column(self, frame, columns: Columns) -> str | None:
        """The column that identifies a row, which the prediction table carries: --id_column
        (a name or 0-based position), else the first of ID_NAMES there (not the label), else
        an image table's path column; None: the row number alone."""
        spec = self.options.id_column
        if spec:
            if spec in frame.columns:
                return spec
            if spec.isdigit() and int(spec) < frame.shape[1]:
                return frame.columns[int(spec)]
            raise ConfigError(f"--id_column {spec!r}: {self.path} has no such column; its "
                              f"columns are {quoted_sample(frame.columns, 10)}",
                              "name one of them (or give its 0-based position)")
        found = find_by_name(frame, ID_NAMES, exclude=[columns.label] if columns.label else [])
        if found is None and self.task.image_files:
            found = columns.inputs[0]
        return found

    def frames(self) -> Iterator:
        numeric = ([c["name"] for c in self.encoder.columns if c["type"] == "numeric"]
                   if self.encoder is not None else [])
        for frame in iter_table(self.path, self.fmt, self.recorded.has_header or "auto",
                                self._named_columns(), self.options.rows_per_chunk(self.manifest),
                                numeric, self.row_groups, self.options.max_row_bytes):
            rows = self.row_frame_of(frame)
            if rows is not None:
                yield rows

    def row_frame_of(self, frame):
        """The row frame of a frame of the table's cells (None: a header alone); the columns
        are chosen on the first. Cells (a request's rows) give Cells."""
        light = isinstance(frame, Cells)
        if self.columns is None:
            self.columns = self._choose_columns(frame.to_pandas() if light else frame)
        # per chunk: a JSON column may turn to arrays in any chunk
        refuse_nested(frame, [self.columns.label, *self.columns.inputs], self.path)
        if frame.empty:
            return None
        ids = (np.asarray(frame.index) + 1).astype(str).astype(object)  # data rows, 1-based
        label = self.columns.label
        wanted = list(dict.fromkeys([*self.columns.inputs, *filter(None, (label, self.key))]))
        cells = frame_columns(frame, wanted)
        inputs = {self.renamed.get(name, name): cells[name] for name in self.columns.inputs}
        errors = None
        if self.task.image_files:
            inputs, errors = self._images(inputs[ROW_PATH])
        elif self.role == "text":  # text cells as plain strings (see row_frame)
            inputs = {name: values.astype(object) for name, values in inputs.items()}
        keys = (self.key, id_texts(cells[self.key])) if self.key else None
        build = row_cells if light else row_frame
        return build(ids, label_texts(cells[label]) if label else None, inputs, errors, keys,
                     index=frame.index)

    def _images(self, cells) -> tuple[dict, list[str]]:
        return self._image_paths(cells)

    def _image_paths(self, cells) -> tuple[dict, list[str]]:
        """Image paths relative to the table, made absolute; a missing path (NaN) is an error
        row."""
        paths, errors = [], []
        for cell in cells:
            if cell != cell:
                paths.append("")
                errors.append("missing image path")
                continue
            path = Path(str(cell))
            paths.append(str(path if path.is_absolute() else self.path.parent.absolute() / path))
            errors.append("")
        return {ROW_PATH: paths}, errors

    def __iter__(self) -> Iterator[Chunk]:
        if self.columnar and self.fmt == "parquet" and self.encoder is not None and \
                self.encoder.all_numeric:
            return self._columnar_chunks()
        return self._frame_chunks()

    def _frame_chunks(self) -> Iterator[Chunk]:
        encoder = RowEncoder(self.manifest)
        return (encoder.encode(frame) for frame in self.frames())

    # The columnar path: a Parquet file whose trained columns are all numeric and stored as
    # numbers, read as Arrow columns straight into one matrix per chunk (tables.py's
    # parquet_feature_blocks, preprocess.py's encode_numbers), with the same rows, ids, labels,
    # errors and numbers as the row frames give. Anything else takes the row frames.

    def _columnar_chunks(self) -> Iterator[Chunk]:
        features = self._columnar_features()
        if features is None:
            yield from self._frame_chunks()
            return
        keys = ParquetKeys(self.path, self.key, self.key in features, self.row_groups) \
            if self.key else None
        for block in parquet_feature_blocks(self.path, features, self.columns.label,
                                            self.options.rows_per_chunk(self.manifest),
                                            self.row_groups):
            chunk = self._block_chunk(block)
            if keys is not None:
                chunk.keys = RowKeys(self.key, dict(zip(map(str, (block.rows + 1).tolist()),
                                                        keys.of(block.rows))))
            yield chunk

    def _columnar_features(self) -> list[str] | None:
        """The file's feature columns, in the encoder's order, where the columnar path reads
        them as the row frames would: the columns chosen as on a first frame (any error there:
        None, and the row frames raise it as always), found under their training names (which
        the row frames read as numbers) and of a type read as numbers, each once."""
        header = parquet_header(self.path)
        if header is None:
            return None
        frame, types = header
        try:
            columns = self._choose_columns(frame)
            refuse_nested(frame, [columns.label, *columns.inputs], self.path)
        except DataError:
            self.renamed = {}
            return None
        inputs = columns.inputs
        if (self.key is not None and list(frame.columns).count(self.key) != 1) or any(old != new for old, new in self.renamed.items()) or \
                len(set(inputs)) != len(inputs) or \
                not all(reads_as_numbers(types[name]) for name in inputs):
            self.renamed = {}
            return None
        self.columns = columns
        return inputs

    def _block_chunk(self, block: FeatureBlock) -> Chunk:
        """A FeatureBlock as FeatureRows encodes the row frame of the same rows."""
        x, reasons = self.encoder.encode_numbers(block.numbers)
        ids = RowIds(block.rows + 1)  # 1-based data rows, no header
        labels = label_texts(block.labels) if block.labels is not None else None
        if not reasons:
            return Chunk(ids, x, labels)
        usable = np.ones(len(ids), dtype=bool)
        usable[list(reasons)] = False
        errors = [(ids[i], reasons[i]) for i in sorted(reasons)]
        return Chunk(RowIds(ids.numbers[usable]), x[usable] if usable.any() else None,
                     _kept(labels, usable) if labels else None, errors)


class ParquetKeys:
    """The id column of a Parquet file beside the columnar path's blocks: each block's cells as
    the row frames give them (id_texts), read a record batch at a time (flat memory)."""

    def __init__(self, path: Path, name: str, numeric: bool,
                 row_groups: range | None) -> None:
        import pyarrow.parquet as pq

        handle = pq.ParquetFile(path)
        groups = list(row_groups if row_groups is not None
                      else range(handle.metadata.num_row_groups))
        self.numeric = numeric
        self.start = sum(handle.metadata.row_group(g).num_rows for g in range(groups[0])) \
            if groups else 0  # the data row (0-based) of cells[0]
        self.cells: list[str] = []
        self.batches = handle.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=groups,
                                           columns=[name], use_threads=False)

    def of(self, rows: np.ndarray) -> list[str]:
        """The cells of these data rows (0-based, increasing, none before the last call's)."""
        first, end = int(rows[0]), int(rows[-1]) + 1
        del self.cells[:first - self.start]
        self.start = first
        while self.start + len(self.cells) < end:
            self.cells += id_texts(parquet_cells(next(self.batches).column(0), self.numeric))
        return [self.cells[k] for k in (rows - first).tolist()]


# ----------------------------------------------------------------------------- stdin


def stdin_frames(manifest: Manifest, chunk_rows: int, stream: io.TextIOBase | None = None,
                 max_row_bytes: int | None = None) -> Iterator:
    """One text per line (a blank line is an empty text); a line longer than `max_row_bytes`
    characters (default --max_row_bytes) is refused (exit 3) without being read whole."""
    if not task_of_kind(manifest.preprocessing.kind).reads_lines:
        raise ConfigError("--input - reads one text per line, and this is a "
                          f"{manifest.model_type}", "give a file or folder as --input")
    texts: list[str] = []
    row = 0
    for line in bounded_lines(stream or sys.stdin, max_row_bytes or LIMITS.max_row_bytes):
        texts.append(line)
        if len(texts) == chunk_rows:
            yield row_frame([str(row + i + 1) for i in range(len(texts))], None,
                            {f"{ROW_TEXT}0": texts})
            row += len(texts)
            texts = []
    if texts:
        yield row_frame([str(row + i + 1) for i in range(len(texts))], None,
                        {f"{ROW_TEXT}0": texts})


def bounded_lines(stream: io.TextIOBase, limit: int) -> Iterator[str]:
    """The lines of a text stream without their line ends, each read at most `limit` characters
    (and its line end) at a time."""
    number = 0
    while line := stream.readline(limit + 2):
        number += 1
        text = line.rstrip("\r\n")
        if len(text) > limit:
            raise DataError(f"line {number} of the standard input is longer than "
                            f"--max_row_bytes {limit}; one text is never that long",
                            row_hint(limit))
        yield text


def input_kind(manifest: Manifest, options: BatchOptions) -> str:
    """What --input is: "stdin", "images" (an image or a folder) or "table"; checked against
    the bundle's model type."""
    if options.input == "-":
        kind = "stdin"
    else:
        path = Path(options.input)
        if not path.exists():
            raise DataError(f"input {path} does not exist", "check the path")
        kind = "images" if path.is_dir() or path.suffix.lower() in IMAGE_EXTENSIONS else "table"
        if kind == "images" and not task_of_kind(manifest.preprocessing.kind).image_files:
            raise ConfigError(f"{path} is an image or a folder, and this is a "
                              f"{manifest.model_type}", "give a CSV/TSV/JSON/JSONL/Parquet "
                              "file")
    if kind != "table" and options.id_column:
        what, ids = ("the standard input", "line number") if kind == "stdin" else \
            ("no table", "path")
        raise ConfigError(f"--id_column names a column of a table --input, and {options.input} "
                          f"is {what}", f"drop --id_column (its rows are named by their {ids})")
    return kind


def input_frames(manifest: Manifest, options: BatchOptions) -> Iterator:
    """The row frames of --input, whatever it is."""
    kind = input_kind(manifest, options)
    if kind == "stdin":
        return stdin_frames(manifest, options.chunk_rows, max_row_bytes=options.max_row_bytes)
    if kind == "images":
        return image_folder_frames(Path(options.input), manifest,
                                   options.rows_per_chunk(manifest))
    return TableReader(Path(options.input), manifest, options).frames()


def input_chunks(manifest: Manifest, options: BatchOptions) -> Iterator[Chunk]:
    """The encoded chunks of --input, whatever it is."""
    manifest = as_manifest(manifest)
    if input_kind(manifest, options) == "table":
        return iter(TableReader(Path(options.input), manifest, options))
    frames = input_frames(manifest, options)
    encoder = RowEncoder(manifest)
    return (encoder.encode(frame) for frame in frames)


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


def top_classes(probabilities: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's `top_k` classes, most probable first (ties: the lower index), and their
    probabilities as written: float64 rounded to 6 decimals (every output of predictions)."""
    rows = np.arange(len(probabilities))
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :top_k]
    return order, probabilities[rows[:, None], order].astype(np.float64).round(6)


def abandon_parquet(writer) -> None:
    """Let go of an unfinished Parquet file (a pyarrow ParquetWriter, or None) while its handle
    is still open (the temporary file is removed next). Left open, pyarrow's
    ParquetWriter.__del__ would write the footer to the closed handle after the run's last line,
    and print an "Exception ignored" traceback. A no-op after close()."""
    if writer is None or not writer.is_open:
        return
    try:
        writer.close()
    except Exception as err:  # noqa: BLE001 - the file is discarded either way
        LOG.debug("closing an abandoned Parquet writer: %s", err)
    finally:
        writer.is_open = False  # pyarrow's __del__ closes only a writer still open


class PredictionWriter:
    """Rows to CSV, JSONL or Parquet (by the output's extension) in an open temporary file, a
    chunk at a time through whole columns (a Python loop over rows cost more than the model).
    Parquet takes a binary handle and is written in row groups of PARQUET_GROUP_ROWS.

    The columns (docs/deploy.md): `id` (the row number, a line number, an image's path; `row`
    where the input's own id column is named id, in any case), the input's id column (`key`)
    under its own name, label and confidence (the top class), top2_label, top2_probability ...
    up to top_k, the test-time method's `extra` values, and true_label where the input has
    labels."""

    PARQUET_GROUP_ROWS = 65536

    def __init__(self, handle, fmt: str, labels: Sequence[str], top_k: int,
                 with_truth: bool, extra: Sequence[str], key: str | None = None) -> None:
        self.handle, self.fmt, self.top_k, self.key = handle, fmt, top_k, key
        shown = [_csv_cell(str(label)) for label in labels] if fmt == "csv" else list(labels)
        self.labels = np.array(shown, dtype=object)
        self.row = "row" if key is not None and key.lower() == "id" else "id"
        self.columns = [self.row, *([key] if key else []), "label", "confidence"]
        for k in range(2, top_k + 1):
            self.columns += [f"top{k}_label", f"top{k}_probability"]
        self.columns += list(extra) + (["true_label"] if with_truth else [])
        if key is not None and self.columns.count(key) > 1:
            raise ConfigError(f"the input's id column {key!r} has the name of a prediction "
                              "column", "pass --id_column naming another column")
        self.parquet = None
        self.arrow_labels = None
        self.pending: list = []
        if fmt == "csv":
            csv.writer(handle).writerow(self.columns)

    def write(self, ids: Sequence[str], probabilities: np.ndarray,
              extra: dict[str, np.ndarray], truth: Sequence[str | None] | None,
              keys: RowKeys | None = None) -> None:
        order, top = top_classes(probabilities, self.top_k)
        labels = self._label_column
        columns: dict[str, object] = {self.row: self._id_column(ids),
                                      "label": labels(order[:, 0]), "confidence": top[:, 0]}
        if self.key is not None:
            columns[self.key] = keys.of(ids) if keys is not None else [""] * len(ids)
        for k in range(1, self.top_k):
            columns[f"top{k + 1}_label"] = labels(order[:, k])
            columns[f"top{k + 1}_probability"] = top[:, k]
        for name, values in extra.items():
            columns[name] = np.round(np.asarray(values, dtype=np.float64), 6)
        if "true_label" in self.columns:
            missing = None if self.fmt == "parquet" else ""
            columns["true_label"] = [missing if truth is None or t is None else t
                                     for t in (truth or [None] * len(ids))]
        if self.fmt == "csv":
            self.handle.write(csv_lines([columns[name] for name in self.columns]))
        elif self.fmt == "parquet":
            self._write_parquet(columns)
        else:
            import pandas as pd

            frame = pd.DataFrame(columns, columns=self.columns)
            text = frame.to_json(orient="records", lines=True, double_precision=6,
                                 force_ascii=False)
            self.handle.write(text if text.endswith("\n") else text + "\n")

    def _id_column(self, ids: Sequence[str]):
        if self.fmt == "parquet":
            return ids.arrow() if isinstance(ids, RowIds) else list(ids)
        if self.fmt == "csv" and (isinstance(ids, RowIds) or all(i.isdigit() for i in ids)):
            return np.array(list(ids), dtype=object)  # row numbers: cells as they are
        return list(ids)

    def _label_column(self, classes: np.ndarray):
        """The labels of these class indices: an Arrow array for Parquet (taken from the
        labels' array, not converted a cell at a time), else an array of the cells."""
        if self.fmt != "parquet":
            return self.labels[classes]
        if self.arrow_labels is None:
            import pyarrow as pa

            self.arrow_labels = pa.array(list(self.labels), pa.string())
        return self.arrow_labels.take(classes)

    def _write_parquet(self, columns: dict[str, object]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        texts = (self.row, self.key, "true_label")
        schema = pa.schema([(name, pa.string() if name in texts or
                             name.endswith("label") else pa.float64())
                            for name in self.columns])
        self.pending.append(pa.table({name: columns[name] for name in self.columns},
                                     schema=schema))
        if self.parquet is None:
            self.parquet = pq.ParquetWriter(self.handle, schema)
        if sum(t.num_rows for t in self.pending) >= self.PARQUET_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self.pending:
            self.parquet.write_table(pa.concat_tables(self.pending),
                                     row_group_size=self.PARQUET_GROUP_ROWS)
            self.pending = []

    def close(self) -> None:
        """Write what is buffered (Parquet's last row group and footer)."""
        if self.parquet is not None:
            self._flush()
            self.parquet.close()

    def abandon(self) -> None:
        abandon_parquet(self.parquet)


class RecordWriter:
    """Records (one dict a row, in `columns`' order) to CSV, JSONL or Parquet (by `fmt`) in an
    open temporary file, a batch at a time: strings in CSV neutralised and None an empty cell;
    Parquet in row groups of PARQUET_GROUP_ROWS under schema(). For outputs of a few rows per
    image (the segmenter's summary, the detector's boxes), where a loop over rows costs little
    next to the model."""

    PARQUET_GROUP_ROWS = 65536

    def __init__(self, handle, fmt: str, columns: Sequence[str]) -> None:
        self.handle, self.fmt = handle, fmt
        self.parquet = None
        self.pending: list[dict] = []
        if fmt == "csv":
            csv.writer(handle).writerow(columns)

    def schema(self):
        """The Parquet schema of the records (pyarrow)."""
        raise NotImplementedError

    def write_records(self, records: Sequence[dict]) -> None:
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

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = self.schema()
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


# ----------------------------------------------------------------------------- running


# How long a closed prefetch waits for its thread to leave native code (a stop ends a
# session.run at its next node, and a read at its next batch)
PREFETCH_JOIN_SECONDS = 10.0


def prefetched(chunks, depth: int = 2):
    """Read and encode the next chunks in a thread while the model runs on this one (ONNX
    Runtime releases the GIL); the reader's errors are raised here. Closing the generator (an
    error, an interrupt: predict_input closes it) stops the thread and waits for it: a thread
    left inside ONNX Runtime or Arrow while the interpreter exits ends the process with
    "terminate called without an active exception" (SIGABRT, seen on a Ctrl-C under load)."""
    import queue
    import threading

    # The reader holds the GIL while it tokenises; hand it back to the model thread sooner than
    # the default 5 ms after each session.run (SMS texts at batch 256: 18k → 26k rows/s).
    sys.setswitchinterval(0.0001)
    items: queue.Queue = queue.Queue(maxsize=depth)
    done, stop = object(), threading.Event()

    def put(item) -> bool:
        """Queue `item` unless the consumer has gone (then False)."""
        while not stop.is_set():
            try:
                items.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for chunk in chunks:
                if not put(chunk):
                    return
            put(done)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer
            put(err)
        finally:
            getattr(chunks, "close", lambda: None)()  # a prefetch of its own stops here too

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        while True:
            item = items.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(PREFETCH_JOIN_SECONDS)


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


@dataclass
class Predicted:
    """A chunk's predictions, rows in input order: what either engine (this process, or Ray
    workers) hands to the writer."""

    ids: Sequence[str]  # a list, or RowIds
    probabilities: np.ndarray | None  # (rows, classes); None when every row failed
    extra: dict[str, np.ndarray]
    labels: list[str | None] | None
    errors: list[tuple[str, str]]
    keys: RowKeys | None = None  # the input's own id column, carried into the table


# Why a row whose model output is not finite is an error row, not a prediction
NON_FINITE_OUTPUT = ("the model's output for this row is not a finite number (a value the "
                     "network overflows on)")


def non_finite_rows(probabilities: np.ndarray, extra: Mapping[str, np.ndarray]) -> np.ndarray:
    """Which rows of a prediction hold NaN or infinity, in the probabilities or an extra value:
    such a row is an error, never an answer (every path that predicts checks here). A
    regressor's outputs are one value a row."""
    bad = ~np.isfinite(np.reshape(probabilities, (len(probabilities), -1))).all(axis=1)
    for values in extra.values():
        values = np.asarray(values, dtype=np.float64)
        bad |= ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
    return bad


def predict_chunk(chunk: Chunk, predict: Predictor) -> Predicted:
    """A chunk's predictions; a row whose output is not finite becomes an error row."""
    if chunk.x is None:
        return Predicted([], None, {}, None, chunk.errors, chunk.keys)
    probabilities, extra = predict(chunk.x)
    bad = non_finite_rows(probabilities, extra)
    if not bad.any():
        return Predicted(chunk.ids, probabilities, extra, chunk.labels, chunk.errors,
                         chunk.keys)
    ids = chunk.ids.numbers if isinstance(chunk.ids, RowIds) else np.array(chunk.ids, object)
    errors = chunk.errors + [(str(ids[i]), NON_FINITE_OUTPUT) for i in np.flatnonzero(bad)]
    if bad.all():
        return Predicted([], None, {}, None, errors, chunk.keys)
    keep = ~bad
    kept_ids = RowIds(ids[keep]) if isinstance(chunk.ids, RowIds) else ids[keep].tolist()
    return Predicted(kept_ids, probabilities[keep], {k: np.asarray(v)[keep] for k, v in
                                                     extra.items()},
                     _kept(chunk.labels, keep) if chunk.labels else None, errors, chunk.keys)


def predict_input(options: BatchOptions, manifest: Manifest, predict: Predictor, report: dict
                  ) -> BatchRun:
    """--input → --output in this process: chunks read and encoded in a thread, predicted by
    `predict` (the model with the test-time compute asked for), and written as they come.
    Parquet in and out: predicted in a third thread, so that the model does not wait for the
    writer. Arrow's reader and writer and ONNX Runtime release the GIL; measured on 1M rows of
    30 features at batch 4096, 4 alternating runs: 1.04M → 1.20M rows/s best, 0.97M → 1.11M
    median. Where a stage holds the GIL (tokenising, CSV lines) a third thread costs more
    than it gives (SMS texts to CSV: 49k → 45k rows/s best), so those keep two."""
    chunks = prefetched(input_chunks(manifest, options))
    predicted = (predict_chunk(chunk, predict) for chunk in chunks)
    if all(Path(path).suffix.lower() == ".parquet" for path in (options.input, options.output)):
        predicted = prefetched(predicted)
    try:
        return write_predictions(options, manifest, predicted, report)
    finally:  # stop the threads before anything else runs (see prefetched)
        predicted.close()
        with contextlib.suppress(ValueError):  # still iterated by a thread that did not stop
            chunks.close()


def write_predictions(options: BatchOptions, manifest: Manifest, predicted: Iterator[Predicted],
                      report: dict) -> BatchRun:
    """Predictions → --output, to a temporary file moved into place at the end (and the
    errors to --errors likewise); the accuracy and evaluation of the rows with a true label;
    the run's `predictions` section. Raises when no row could be predicted, or when some could
    not without --allow_errors."""
    run = BatchRun(options.input, options.output, errors_path=options.errors)
    fmt = Path(options.output).suffix.lower().lstrip(".")
    labels = list(manifest.labels)
    index = {label: i for i, label in enumerate(labels)}
    top_k = min(options.top_k, len(labels))
    error_rows: list[tuple[str, str]] = []
    tally = Tally(len(labels))  # the rows with a true label among the classes
    started = time.perf_counter()
    with atomic_write_stream(options.output, binary=fmt == "parquet") as handle, \
            contextlib.ExitStack() as before_closing:
        writer = None
        for item in progress(predicted, desc="predict", enabled=options.show_progress):
            raise_if_interrupted()  # a stop that Ray's iterator swallowed still ends the run
            run.rows += len(item.ids) + len(item.errors)
            run.failed += len(item.errors)
            error_rows += item.errors
            if item.probabilities is None:
                continue
            if writer is None:
                writer = PredictionWriter(handle, fmt, labels, top_k, item.labels is not None,
                                          list(item.extra), item.keys and item.keys.name)
                before_closing.callback(writer.abandon)  # an interrupt, an error: let go
            writer.write(item.ids, item.probabilities, item.extra, item.labels, item.keys)
            run.predicted += len(item.ids)
            if item.labels is not None:
                known = [(i, index.get(t)) for i, t in enumerate(item.labels) if t is not None]
                run.labeled += len(known)
                run.correct += sum(item.probabilities[i].argmax() == k for i, k in known)
                classes = [(i, k) for i, k in known if k is not None]
                run.outside_classes += len(known) - len(classes)
                if classes:
                    rows, truth = map(list, zip(*classes))
                    tally.add(item.probabilities[rows], np.asarray(truth))
        raise_if_interrupted()  # nothing is committed after a stop, however late it came
        if writer is not None:
            writer.close()
        run.seconds = round(time.perf_counter() - started, 3)
        report["predictions"] = run.report_section()
        if tally.samples:
            section_of = task_of_kind(manifest.preprocessing.kind).part("evaluation")
            report["evaluation"] = bundle_evaluation(
                section_of, manifest.labels, manifest.dataset.train_class_counts, tally, "input")
        if run.predicted == 0:  # raised inside the block: the previous output stays as it was
            _fail_without_predictions(run, options, error_rows)
    if options.errors:
        write_errors(options.errors, error_rows)
    LOG.info("predicted %d of %d rows into %s (%.0f rows/s)%s", run.predicted, run.rows,
             options.output, run.predicted / max(run.seconds, 1e-9),
             f", {run.failed} failed" if run.failed else "")
    raise_for_error_rows(options, run.failed, run.rows, "rows", "predicted",
                         f"the other predictions are in {options.output}")
    return run


def _fail_without_predictions(run: BatchRun, options: BatchOptions,
                              error_rows: Sequence[tuple[str, str]]) -> None:
    if run.rows == 0:
        raise DataError(f"{options.input} has no rows to predict; {options.output} was left "
                        "as it was", "check the input (a header alone is no rows)")
    fail_without_predictions(options, run.rows, "rows", "predicted", error_rows,
                             "fix those rows")


def errors_hint(errors: str | Path | None) -> str:
    """Where a run's error rows are, for its failure's message: --errors, or the flag to give."""
    return f"listed in {errors}" if errors else "add --errors PATH to list them"


def raise_for_error_rows(options, failed: int, total: int, unit: str, verb: str,
                         elsewhere: str) -> None:
    """`failed` error rows of `total` without --allow_errors: a DataError (exit 3) once
    everything is written ("2 of 9 images could not be segmented (...); `elsewhere`").
    `options`: a run's (BatchOptions, or an image model's), with errors and allow_errors."""
    if failed and not options.allow_errors:
        raise DataError(f"{failed} of {total} {unit} could not be {verb} "
                        f"({errors_hint(options.errors)}); {elsewhere}",
                        f"fix those {unit}, or pass --allow_errors true")


def fail_without_predictions(options, total: int, unit: str, verb: str,
                             error_rows: Sequence[tuple[str, str]], hint: str) -> None:
    """None of `total` rows predicted: the error rows to --errors, and a DataError (exit 3),
    raised while the output's temporary file is open (the previous output stays as it was).
    `options`: a run's (BatchOptions, or an image model's), with input, output and errors."""
    if options.errors:
        write_errors(str(options.errors), error_rows)
    raise DataError(f"none of the {total} {unit} of {options.input} could be {verb} "
                    f"({errors_hint(options.errors)}); {options.output} was left as it was",
                    hint)


def write_errors(path: str, rows: Sequence[tuple[str, str]]) -> None:
    with atomic_write_stream(path) as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "reason"])
        writer.writerows([neutralised(ident), neutralised(reason)] for ident, reason in rows)
