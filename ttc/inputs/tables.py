"""The input rules for users' tables, one implementation for training (data.py) and serving
(batch.py): reading CSV, TSV, JSON (array of records) and JSONL (UTF-8 with or without BOM, with
or without a header row, whole or in chunks) and Parquet (streamed by record batch), which cells
count as missing, which columns hold what (names, 0-based positions, lists like `1,2`), how
several text columns become one text, and how a label cell becomes a class name. A model served on other inputs than it was validated on
is the worst bug this tool can have: change a rule here, and both sides change.
"""
from __future__ import annotations

import contextlib
import csv
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np

from ttc.inputs.formats import FORMAT_NAMES, TABLE_FORMATS  # noqa: F401 - read from here too
from ttc.inputs.limits import LIMITS, check_line_lengths, check_text_lengths
from utils import LOG, DataError, quoted, quoted_sample, with_article

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
LABEL_NAMES = ("label", "labels", "class", "target", "category", "y", "sentiment", "intent")
TEXT_NAMES = ("text", "message", "sms", "sentence", "review", "content", "body", "comment",
              "tweet", "document", "title", "description", "question", "utterance")
IMAGE_NAMES = ("image", "image_path", "path", "file", "filename", "filepath", "img")
# A column that identifies a row (the prediction table carries it, batch.TableReader): by
# priority; an image path column counts
ID_NAMES = ("id", "uid", "uuid", "guid", "key", "row_id", "record_id", "sample_id", "example_id",
            "doc_id", "image_id", "image", "image_path", "path", "file", "filename", "filepath")
HEADER_WORDS = set(LABEL_NAMES + TEXT_NAMES + IMAGE_NAMES + ("id", "name", "feature"))
# A label, text or image-path cell is missing only when it is empty: `NA` is North America and
# `None` a class name. In a feature column these markers mean missing too (`?` where a number is
# expected, UCI's habit).
EMPTY = frozenset({""})
MISSING = frozenset({"", "nan", "NaN", "NA", "N/A", "null", "None"})
NUMERIC_MISSING = MISSING | {"?"}
HEADER_SAMPLE_ROWS = 1000  # header detection looks at this many rows, whatever the chunk size
# A frame's attrs key: {column: what nested values it holds} (a Parquet column's Arrow type,
# "JSON arrays"); their cells read as text for column detection, but a run that uses one stops
NESTED = "nested_columns"
_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def table_format(path: Path, override: str | None = None) -> str:
    if override:
        return override
    kind = TABLE_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"cannot tell the format of {path} from its extension",
                        f"use one of {', '.join(sorted(TABLE_FORMATS))} or pass --dataset_format")
    return kind


# ----------------------------------------------------------------------------- reading


def read_table(path: Path, fmt: str | None = None, has_header: str = "auto",
               named_columns: Sequence[str] = ()):
    """The whole table as one DataFrame of strings (missing cells NaN), string column names,
    indexed by data row (0-based); see iter_table."""
    import pandas as pd

    frame = next(iter_table(path, fmt, has_header, named_columns), pd.DataFrame())  # one chunk
    if frame.empty:
        raise DataError(f"{path} has no data rows", "add rows of data")
    return frame


def iter_table(path: Path, fmt: str | None = None, has_header: str = "auto",
               named_columns: Sequence[str] = (), chunk_rows: int | None = None,
               numeric_columns: Sequence[str] = (), row_groups: range | None = None,
               max_row_bytes: int | None = None) -> Iterator:
    """DataFrames of `chunk_rows` rows (all rows when None): cells are strings, empty cells are
    NaN (and NUMERIC_MISSING markers in `numeric_columns`), rows with every cell empty are left
    out, the index is the data row (0-based, header excluded), and columns are named by the
    header or "0", "1", ... .

    Whether a CSV/TSV's first row is a header is decided once, on its first HEADER_SAMPLE_ROWS
    rows (`named_columns`, names the user or the bundle gave, count as evidence). The
    `numeric_columns` are left to the C parser's number reading (10x faster for wide numeric
    tables; a chunk where such a column holds a non-number gets that column as strings).
    A CSV, TSV or JSONL file with a line longer than `max_row_bytes` (default: the process's
    --max_row_bytes) is refused before it is parsed."""
    kind = table_format(path, fmt)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist", "check the path")
    if kind in LINE_FORMATS:
        checked_line_lengths(path, max_row_bytes)
    with reading_errors(path, kind):
        if kind in ("csv", "tsv"):
            yield from _delimited_chunks(path, kind, has_header, named_columns, chunk_rows,
                                         numeric_columns)
        elif kind == "parquet":
            yield from _parquet_chunks(path, chunk_rows, numeric_columns, row_groups)
        else:
            yield from _json_chunks(path, kind, chunk_rows)


@contextlib.contextmanager
def reading_errors(path: Path, kind: str) -> Iterator[None]:
    """What reading a table may raise (pandas', pyarrow's errors) as one DataError (exit 3)."""
    try:
        yield
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text", "re-save it as UTF-8") from None
    except Exception as err:  # noqa: BLE001 - pandas raises several types for a bad file
        import pandas as pd

        if isinstance(err, pd.errors.EmptyDataError):
            raise DataError(f"{path} is empty", "add a header and rows of data") from None
        if not isinstance(err, (ValueError, pd.errors.ParserError)) and \
                type(err).__module__.split(".")[0] != "pyarrow":
            raise
        first = (str(err).strip().splitlines() or [""])[0]
        raise DataError(f"cannot parse {path} as {kind.upper()}: {first or 'no data'}",
                        "check the file's format, or pass --dataset_format") from None


LINE_FORMATS = ("csv", "tsv", "jsonl")  # one row a line (a quoted CSV cell may span lines)
_LINES_CHECKED: set[tuple] = set()  # (file identity, limit) whose lines were checked


def checked_line_lengths(path: Path, limit: int | None) -> None:
    """limits.check_line_lengths, once per file version and limit in this process."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, limit or LIMITS.max_row_bytes)
    if key not in _LINES_CHECKED:
        check_line_lengths(path, limit)
        _LINES_CHECKED.add(key)


def _csv_options(kind: str) -> dict:
    return {"sep": "," if kind == "csv" else "\t", "encoding": "utf-8-sig",
            "skip_blank_lines": True, "keep_default_na": False, "na_values": sorted(EMPTY),
            "quoting": csv.QUOTE_MINIMAL if kind == "csv" else csv.QUOTE_NONE}


def _delimited_chunks(path: Path, kind: str, has_header: str, named_columns: Sequence[str],
                      chunk_rows: int | None, numeric_columns: Sequence[str]) -> Iterator:
    import pandas as pd

    options = _csv_options(kind)
    sample = pd.read_csv(path, header=None, nrows=HEADER_SAMPLE_ROWS + 1, dtype=str, **options)
    header = {"true": True, "false": False}.get(has_header)
    if header is None:
        header = looks_like_header(sample, named_columns)
    names = (unique_names(sample.iloc[0].fillna("").astype(str)) if header
             else [str(i) for i in range(sample.shape[1])])
    typed = set(numeric_columns)
    options["na_values"] = {name: sorted(NUMERIC_MISSING if name in typed else EMPTY)
                            for name in names}
    reader = pd.read_csv(path, header=0 if header else None, names=names,
                         dtype={name: str for name in names if name not in typed},
                         chunksize=chunk_rows or None, **options)
    rows = 0
    for chunk in ([reader] if chunk_rows is None else reader):
        chunk.index = pd.RangeIndex(rows, rows + len(chunk))
        rows += len(chunk)
        yield chunk.dropna(how="all")


def _json_chunks(path: Path, kind: str, chunk_rows: int | None) -> Iterator:
    import pandas as pd

    first = _first_character(path) if kind == "json" else "["
    if first not in ("[", ""):
        raise DataError(f"{path} holds a JSON {'object' if first == '{' else 'value'}, not an "
                        "array of records", 'write it as [{"text": ..., "label": ...}, '
                        "...], or one record per line as .jsonl")

    # dtype=False: no type conversion (pandas 3 then leaves a column named like a date,
    # "created_at", as it is; json_records builds the same frame of parsed records)
    if kind == "jsonl" and chunk_rows:
        frames = pd.read_json(path, lines=True, dtype=False, encoding="utf-8-sig",
                              chunksize=chunk_rows)
    else:
        whole = pd.read_json(path, lines=kind == "jsonl", dtype=False, encoding="utf-8-sig")
        step = chunk_rows or max(1, len(whole))
        frames = (whole.iloc[start:start + step] for start in range(0, len(whole), step))
    rows = 0
    for frame in frames:
        yield json_cells(frame, rows)
        rows += len(frame)


def json_records(records: Sequence[Mapping]):
    """JSON objects (serve.py's request rows, already parsed) as the frame the lines of a JSONL
    file holding them read as: the records' values by key, keys in the order they first appear
    and a missing key empty (what read_json builds of them with dtype=False), and the same cells
    (json_cells). A DataFrame of json_record_cells."""
    return json_record_cells(records).to_pandas()


def json_record_cells(records: Sequence[Mapping]) -> "Cells":
    """json_records' cells as Cells, without pandas: what serve.py encodes. Built as one array
    of cells, not through pandas' record parser or frame, whose costs are per call (a request
    of one row paid them whole)."""
    names: dict = {}
    for record in records:
        names.update(dict.fromkeys(record))
    for name in names:
        _unicode(str(name))
    values = np.full((len(records), len(names)), np.nan, dtype=object)
    where = {name: j for j, name in enumerate(names)}
    for i, record in enumerate(records):
        for name, value in record.items():
            values[i, where[name]] = value
    return json_value_cells(values, list(names), 0)


_CELL_TEXTS = np.frompyfunc(lambda value: _cell_text(value), 1, 1)  # elementwise, kept object


def json_cells(frame, first_row: int):
    """A frame pandas read from JSON as a table's cells (cell_frame)."""
    return cell_frame(frame.to_numpy(dtype=object), list(frame.columns), first_row)


def cell_frame(values: np.ndarray, columns: Sequence, first_row: int):
    """json_value_cells as a DataFrame (what iter_table's JSON chunks are)."""
    return json_value_cells(values, columns, first_row).to_pandas()


def json_value_cells(values: np.ndarray, columns: Sequence, first_row: int) -> "Cells":
    """JSON values (rows, columns; an object array) as a table's cells: text as a CSV cell would
    hold it (_cell_text), empty cells NaN, rows with every cell empty left out, the index the
    data row; which columns hold nested values is kept for refuse_nested. One pass over the
    cells as an array (a column at a time cost a served row milliseconds of pandas' fixed
    costs)."""
    import pandas as pd

    nested = [_json_nested(values[:, j]) for j in range(values.shape[1])] \
        if _json_nested(values.ravel()) else []  # the columns looked at where one holds any
    with np.errstate(invalid="ignore"):  # NaN compared with itself, on purpose
        cells = _CELL_TEXTS(values) if values.size else values
    present = ~(pd.isna(cells) | (cells == "")) if values.size else \
        np.zeros(values.shape, dtype=bool)
    cells[~present] = np.nan
    keep = present.any(axis=1)
    index = np.arange(first_row, first_row + len(values), dtype=np.int64)
    if not keep.all():
        cells, index = cells[keep], index[keep]
    names = unique_names(columns)
    return Cells({name: cells[:, j] for j, name in enumerate(names)}, index,
                 {NESTED: {n: k for n, k in zip(names, nested) if k}})


@dataclass
class Cells:
    """A table's cells without pandas: each column a 1-D array (object, or numbers), by name in
    order, the rows' index (their 0-based data rows) and the frame's attrs. What a request's
    rows are read into (json_record_cells) and the row frames serve.py encodes (batch.row_frame
    builds them for Cells): the few DataFrame operations the readers and encoders use (columns,
    index, len, empty, shape, a column by name, rows by a mask, frame_columns), at a cost per
    row, not pandas' per call. `to_pandas()`: the same table as a DataFrame of object columns
    (numbers kept as numbers)."""

    arrays: dict[str, np.ndarray]
    index: np.ndarray
    attrs: dict = field(default_factory=dict)

    @property
    def columns(self) -> list[str]:
        return list(self.arrays)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.index), len(self.arrays)

    @property
    def empty(self) -> bool:
        return not len(self.index) or not self.arrays

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, name: object) -> bool:
        return name in self.arrays

    def __getitem__(self, key):
        """A column's array by name, or the rows where a boolean mask is True."""
        if isinstance(key, str):
            return self.arrays[key]
        return Cells({name: values[key] for name, values in self.arrays.items()},
                     self.index[key], self.attrs)

    def to_pandas(self, index=None):
        """`index`: the pandas index the rows keep (default: built of `self.index`, a
        RangeIndex where the rows are consecutive)."""
        import pandas as pd

        if index is None:
            index = _pandas_index(self.index)
        names = pd.Index(list(self.arrays), dtype=object)
        arrays = list(self.arrays.values())
        if all(a.dtype == object for a in arrays):  # one block: one pass, whatever the columns
            frame = pd.DataFrame(np.stack(arrays, axis=1) if arrays else None, index=index,
                                 columns=names, dtype=object)
        else:
            frame = pd.DataFrame({k: pd.Series(a, index=index, dtype=a.dtype, copy=False)
                                  for k, a in zip(names, arrays)}, index=index, columns=names)
        frame.attrs.update(self.attrs)
        return frame


def _pandas_index(rows: np.ndarray):
    import pandas as pd

    if not len(rows):
        return pd.RangeIndex(0)
    start = int(rows[0])
    if np.array_equal(rows, np.arange(start, start + len(rows))):
        return pd.RangeIndex(start, start + len(rows))
    return pd.Index(rows, dtype=np.int64)


def _json_nested(column) -> str | None:
    """What nested values a JSON column's cells hold ("JSON arrays", "JSON objects"), if any."""
    kinds = {type(v) for v in column if isinstance(v, (list, dict))}
    return " and ".join(("JSON arrays" if k is list else "JSON objects")
                        for k in sorted(kinds, key=lambda k: k.__name__)) or None


# Parquet is decoded in record batches of at least this many rows, on Arrow's threads, then cut
# into chunks: one thread and batches of 4,096 rows read 30 float columns at 0.49M rows/s, this
# way at 3.0M (on 2 cores)
PARQUET_BATCH_ROWS = 65536


def parquet_row_groups(path: Path) -> list[int]:
    """The row count of each row group of a Parquet file (how the file can be read in parts)."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(path).metadata
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"cannot parse {path} as PARQUET: {str(err).strip().splitlines()[0]}",
                        "check the file's format, or pass --dataset_format") from None
    return [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]


def _parquet_chunks(path: Path, chunk_rows: int | None, numeric_columns: Sequence[str],
                    row_groups: range | None) -> Iterator:
    import pyarrow.parquet as pq

    handle = pq.ParquetFile(path)
    names, nested = parquet_names(handle.schema_arrow)
    typed = set(numeric_columns)
    for first_row, part in _parquet_parts(handle, chunk_rows, row_groups):
        frame = _parquet_frame(part, names, typed, first_row)
        frame.attrs[NESTED] = nested
        yield frame


def parquet_names(schema) -> tuple[list[str], dict[str, str]]:
    """A Parquet schema's column names as iter_table's frames name them, and the Arrow type of
    those that hold nested values (a frame's attrs[NESTED])."""
    names = unique_names(schema.names)
    nested = {name: str(column.type) for name, column in zip(names, schema)
              if _is_nested(column.type)}
    return names, nested


def _parquet_parts(handle, chunk_rows: int | None, row_groups: range | None,
                   threads: bool = True) -> Iterator[tuple[int, object]]:
    """(its first data row, 0-based; the record batch) of each part of `chunk_rows` rows (a
    whole record batch when None) of an open Parquet file's row groups (all when None): how
    every reader of a Parquet file cuts it. `threads`: decode on Arrow's threads."""
    groups = list(row_groups if row_groups is not None
                  else range(handle.metadata.num_row_groups))
    rows = sum(handle.metadata.row_group(g).num_rows for g in range(groups[0])) if groups else 0
    step = chunk_rows or PARQUET_BATCH_ROWS
    for batch in handle.iter_batches(batch_size=max(step, PARQUET_BATCH_ROWS),
                                     row_groups=groups, use_threads=threads):
        for start in range(0, batch.num_rows, step):
            part = batch.slice(start, step)
            yield rows, part
            rows += part.num_rows


def _parquet_frame(batch, names: list[str], numeric: set[str], first_row: int):
    """A record batch as iter_table's frames are: cells as parquet_cells reads them (numbers
    kept in the `numeric` columns), empty cells NaN, all-empty rows left out, the index the
    data row."""
    import pandas as pd

    columns = {name: parquet_cells(array, name in numeric)
               for name, array in zip(names, batch.columns)}
    frame = pd.DataFrame(columns, columns=names)
    frame.index = pd.RangeIndex(first_row, first_row + len(frame))
    cells = frame.select_dtypes(exclude="number")
    if not cells.empty:
        frame[cells.columns] = cells.where(cells.notna() & ~cells.isin(EMPTY))
    return frame.dropna(how="all")


def parquet_cells(array, numeric: bool):
    """A Parquet column's cells as iter_table's frames hold them: in a `numeric` column (a
    numeric feature) integers, floats, dates and times as float64 numbers (parquet_numbers);
    strings as they are; anything else as CSV text (dates and times as the numbers of
    temporal_numbers)."""
    import pyarrow.types as pa_types

    numbers = parquet_numbers(array) if numeric else None
    if numbers is not None:
        return numbers
    moments = temporal_numbers(array)
    if moments is not None:
        import pandas as pd

        return pd.Series(moments).map(_cell_text)
    if pa_types.is_string(array.type) or pa_types.is_large_string(array.type):
        return array.to_pandas()
    return array.to_pandas().map(_cell_text)


def parquet_numbers(array) -> np.ndarray | None:
    """A numeric feature's Parquet column as float64 numbers, NaN where null: integers and
    floats, dates and times as temporal_numbers; None for another type (read as text cells)."""
    moments = temporal_numbers(array)
    if moments is not None:
        return moments
    if reads_as_numbers(array.type):
        return array.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
    return None


def reads_as_numbers(kind) -> bool:
    """Does a numeric feature's Parquet column of this Arrow type reach the encoder as numbers
    (integers, floats, dates, times, durations), not as text cells to parse?"""
    import pyarrow.types as pa_types

    return pa_types.is_integer(kind) or pa_types.is_floating(kind) or \
        _temporal_type(kind) is not None


def parquet_header(path: Path):
    """An empty frame of a Parquet file's columns, named as iter_table's frames are (the nested
    ones in its attrs[NESTED]), and each column's Arrow type by name; None when its schema
    cannot be read (reading the file then says why)."""
    import pandas as pd
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(path) as handle:
            schema = handle.schema_arrow
    except Exception:  # noqa: BLE001 - iter_table reports an unreadable file
        return None
    names, nested = parquet_names(schema)
    frame = pd.DataFrame(columns=names)
    frame.attrs[NESTED] = nested
    return frame, dict(zip(names, schema.types))


@dataclass
class FeatureBlock:
    """A part of a Parquet file read column-wise for a model whose features are all numeric:
    the data rows kept (0-based, header excluded), their features' numbers (rows, features;
    float64, or float32 where every feature column is float32; NaN where missing) and the label
    column's cells (None: no label column)."""

    rows: np.ndarray
    numbers: np.ndarray
    labels: object | None


def parquet_feature_blocks(path: Path, features: Sequence[str], label: str | None,
                           chunk_rows: int | None, row_groups: range | None = None,
                           threads: bool = False) -> Iterator[FeatureBlock]:
    """The rows of a Parquet file as iter_table reads them for numeric `features` (columns
    whose type reads_as_numbers), column-wise and without a frame: the same parts, each
    feature's numbers as parquet_numbers gives them (float32 and float64 columns converted by
    Arrow at once), the label's cells as parquet_cells, and the same rows left out (every
    cell of the row empty: the file's other columns are read for the rows whose features are
    all missing)."""
    import pyarrow.parquet as pq

    with reading_errors(path, "parquet"):
        handle = pq.ParquetFile(path)
        names, _ = parquet_names(handle.schema_arrow)
        wanted = [names.index(name) for name in features]
        others = [k for k in range(len(names)) if k not in set(wanted)]
        for first_row, part in _parquet_parts(handle, chunk_rows, row_groups, threads):
            if part.num_rows == 0:
                continue
            numbers = _feature_numbers(part, wanted)
            keep = ~_empty_rows(part, numbers, others)
            rows = np.arange(first_row, first_row + part.num_rows)
            labels = parquet_cells(part.column(names.index(label)), False) if label else None
            if not keep.all():
                if not keep.any():
                    continue
                numbers, rows = numbers[keep], rows[keep]
                labels = labels[keep] if labels is not None else None
            yield FeatureBlock(rows, numbers, labels)


_ARROW_FLOATS = ("float", "double")  # float32, float64: what RecordBatch.to_tensor converts


def _feature_numbers(batch, columns: list[int]) -> np.ndarray:
    """(rows, len(columns)) numbers of a batch's columns, C order: when all are float32 or
    float64, converted by Arrow at once (nulls as NaN); else a column at a time by
    parquet_numbers."""
    arrays = [batch.column(k) for k in columns]
    if all(str(a.type) in _ARROW_FLOATS for a in arrays):
        return batch.select(columns).to_tensor(null_to_nan=True, row_major=True).to_numpy()
    return np.column_stack([parquet_numbers(a) for a in arrays])


def _empty_rows(batch, numbers: np.ndarray, others: Sequence[int]) -> np.ndarray:
    """_parquet_frame's rule for the rows of a FeatureBlock: a row is left out when every
    feature is missing and every other column's cell is empty (NaN once read by parquet_cells,
    or an EMPTY text). The other columns are read for those rows alone."""
    import pandas as pd

    empty = np.isnan(numbers[:, 0]) if numbers.shape[1] else np.ones(len(numbers), dtype=bool)
    candidates = np.flatnonzero(empty)
    if len(candidates):
        empty[candidates] = np.isnan(numbers[candidates]).all(axis=1)
        candidates = np.flatnonzero(empty)
    for k in others:
        if not len(candidates):
            break
        cells = pd.Series(parquet_cells(batch.column(k).take(candidates), False))
        empty[candidates] = (cells.isna() | cells.isin(EMPTY)).to_numpy()
        candidates = np.flatnonzero(empty)
    return empty


def _is_nested(kind) -> bool:
    """An Arrow type whose cells hold several values: list, large_list, fixed_size_list,
    list_view, struct, map, union, or a dictionary or extension type of one."""
    import pyarrow as pa
    import pyarrow.types as pa_types

    if isinstance(kind, pa.ExtensionType):
        kind = kind.storage_type
    if pa_types.is_dictionary(kind):
        kind = kind.value_type
    return pa_types.is_nested(kind)


# Units of an Arrow timestamp, duration or time of day in one second
_PER_SECOND = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}


def temporal_numbers(array) -> np.ndarray | None:
    """A Parquet timestamp, date, time or duration column as the float64 numbers a model reads
    (NaN where null), None for other types: a timestamp is seconds since the Unix epoch, UTC (one without a
    time zone is taken as UTC), a date is days since the epoch, a time of day is seconds since
    midnight, a duration is seconds (docs/data.md)."""
    import pyarrow as pa
    import pyarrow.types as pa_types

    kind = _temporal_type(array.type)
    if kind is None:
        return None
    if pa_types.is_dictionary(array.type):
        array = array.dictionary_decode()
    if pa_types.is_date32(kind):
        per_unit = 1  # stored as days
    elif pa_types.is_date64(kind):
        per_unit = 86_400_000  # stored as milliseconds
    else:
        per_unit = _PER_SECOND[kind.unit]
    raw = array.cast(pa.int32() if kind.bit_width == 32 else pa.int64())
    raw = raw.to_numpy(zero_copy_only=False)
    return raw.astype(np.float64) / per_unit  # a division: whole seconds stay exact


def _temporal_type(kind):
    """The date, time, timestamp or duration type of a column (also dictionary-encoded), or
    None."""
    import pyarrow.types as pa_types

    if pa_types.is_dictionary(kind) and pa_types.is_temporal(kind.value_type):
        kind = kind.value_type
    if pa_types.is_date32(kind) or pa_types.is_date64(kind) or pa_types.is_timestamp(kind) or \
            pa_types.is_duration(kind) or pa_types.is_time(kind):
        return kind
    return None


def _first_character(path: Path) -> str:
    """The first character of a text file that is not white space or a BOM ("" if none)."""
    with open(path, encoding="utf-8-sig") as handle:
        while block := handle.read(4096):
            stripped = block.lstrip()
            if stripped:
                return stripped[0]
    return ""


def _cell_text(value) -> str | None:
    """A JSON value as the text a CSV cell would hold: whole floats without '.0' (a column of
    integers with a gap comes as floats, and chunks of it may not)."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, str):
        return _unicode(value)
    return str(value)


def _unicode(text: str) -> str:
    """The text, where it is valid Unicode (UnicodeEncodeError for a lone surrogate, such as a
    JSON \\ud800 escape makes, as every UTF-8 encoder raises it)."""
    if not text.isascii():
        text.encode("utf-8")
    return text


def unique_names(columns) -> list[str]:
    seen: dict[str, int] = {}
    names = []
    for column in columns:
        name = str(column).strip()
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}.{seen[name] - 1}")
    return names


def looks_like_header(frame, named_columns: Sequence[str] = ()) -> bool:
    """Is the first row a header? Evidence, strongest first: a column name the user passed;
    a well-known name (label, text, ...); a numeric column whose first cell is not a number;
    a low-cardinality column (labels) whose first cell never appears again."""
    import pandas as pd

    if frame.empty:
        return False
    frame = frame.iloc[: HEADER_SAMPLE_ROWS + 1]
    first = frame.iloc[0].fillna("").astype(str).str.strip()
    rest = frame.iloc[1:]
    if any(n in set(first) for n in named_columns if n and not n.isdigit()):
        return True
    if set(first.str.lower()) & HEADER_WORDS:
        return True
    if len(rest) == 0:
        return False
    for j in range(frame.shape[1]):
        column = rest.iloc[:, j].dropna().astype(str).str.strip()
        if len(column) == 0:
            continue
        numeric = pd.to_numeric(column, errors="coerce").notna().mean()
        first_is_number = pd.to_numeric(pd.Series([first.iloc[j]]), errors="coerce").notna()[0]
        if numeric >= 0.9 and not first_is_number and first.iloc[j] != "":
            return True
        if column.nunique() <= max(2, len(column) // 2) and first.iloc[j] not in set(column):
            return True
    return False


# ----------------------------------------------------------------------------- columns


@dataclass
class Columns:
    """Which columns of a table hold what: the label (None: unlabelled) and the inputs (the
    texts to join, the feature columns, or the image-path column). Training records the
    resolved names in the bundle manifest; serving reads the same names."""

    label: str | None
    inputs: list[str] = field(default_factory=list)
    guessed: list[str] = field(default_factory=list)  # "label", "inputs": chosen without a flag
    candidates: list[str] = field(default_factory=list)  # the columns that could be the label,
    # when more than one could (the guess took the first rule's pick)

    def to_manifest(self) -> dict:
        return {"label": self.label, "inputs": list(self.inputs)}

    def to_report(self) -> dict:
        """The report's `dataset.columns`: the manifest's names and what was guessed."""
        return {**self.to_manifest(), "guessed": list(self.guessed),
                **({"label_candidates": list(self.candidates)} if self.candidates else {})}


@dataclass(frozen=True)
class Reader:
    """What reads a table, for the error when its columns hold another kind of data than that
    reader takes: a training run of `model_type`, or a bundle of it (`bundle`)."""

    model_type: str
    bundle: bool = False
    by_role: Mapping[str, str] = field(default_factory=dict)  # the model type to suggest for
    # each input role ("text", "feature", "image"): data.table_reader fills it from the registry


def split_spec(spec: str | None) -> list[str]:
    """'1,2' or 'title, description' → ['1', '2'] / ['title', 'description']."""
    return [s.strip() for s in (spec or "").split(",") if s.strip()]


def resolve(frame, spec: str, role: str, path: Path) -> str:
    """A column given by name or 0-based position → its name in `frame`."""
    columns = list(frame.columns)
    if spec in columns:
        return spec
    if spec.isdigit() and int(spec) < len(columns):
        return columns[int(spec)]
    raise DataError(f"{path} has no column {quoted(spec, 40)} for the {role}; its columns are "
                    f"{quoted_sample(columns, 10)}",
                    f"pass --{_flag(role)} with one of them (a name or a 0-based position)")


def resolve_all(frame, spec: str | None, role: str, path: Path) -> list[str]:
    """Every column of a spec like '1,2' or 'title,description'."""
    return [resolve(frame, s, role, path) for s in split_spec(spec)]


def _flag(role: str) -> str:
    return "feature_columns" if role == "feature" else f"{role}_column"


def find_by_name(frame, names: Sequence[str], exclude: Sequence[str] = ()) -> str | None:
    by_lower = {c.lower(): c for c in frame.columns if c not in exclude}
    return next((by_lower[n] for n in names if n in by_lower), None)


def undetectable(path: Path, role: str, frame) -> DataError:
    return DataError(f"cannot tell which column of {path} holds the {role}; its columns are "
                     f"{quoted_sample(frame.columns, 10)}",
                     f"pass --{_flag(role)} (a name or a 0-based position)")


def detect_columns(frame, role: str, path: Path, label_spec: str | None = None,
                   input_spec: str | None = None, reader: Reader | None = None) -> Columns:
    """The label and input columns of a table, from the flags or detected (role: "text",
    "feature" or "image"). Detected: the label has a well-known name, else (text) the column
    with the fewest distinct values or (features) the last column; a text column has a
    well-known name, else the longest values; an image column a well-known name or image file
    names; the features are all columns but the label. A detected text label with other
    label-like columns beside it is a WARNING naming them; `reader` (a run or bundle of a model
    type) turns a table of another kind of data into an error saying so."""
    label = resolve(frame, label_spec, "label", path) if label_spec else None
    inputs = resolve_all(frame, input_spec, role, path)
    guessed = [*([] if label_spec else ["label"]), *([] if input_spec else ["inputs"])]
    candidates: list[str] = []
    if not inputs and role != "feature":
        inputs = [detect_input(frame, role, path, exclude=[label] if label else [],
                               reader=reader)]
    if label is None:
        label = find_by_name(frame, LABEL_NAMES, exclude=inputs)
    if label is None:
        others = [c for c in frame.columns if c not in inputs]
        if role == "text":
            label = fewest_values_column(frame, exclude=inputs)
            candidates = label_candidates(frame, others, label)
        elif role == "feature":
            label = others[-1] if others else None
        else:
            label = others[0] if len(others) == 1 else None
        if label is None:
            raise undetectable(path, "label", frame)
    if not inputs:
        inputs = [c for c in frame.columns if c != label]
    if label in inputs or not inputs:
        raise DataError(f"{path}: the label column {quoted(label, 40)} is also an input, or "
                        "there are no input columns; its columns are "
                        f"{quoted_sample(frame.columns, 10)}",
                        f"pass --label_column and --{_flag(role)}")
    refuse_nested(frame, [label, *inputs], path)
    if len(candidates) > 1:
        LOG.warning("%s: %d columns could be the label, %s; the guess took %s (the fewest "
                    "distinct values); pass --label_column to choose", path, len(candidates),
                    quoted_sample(candidates, 5, 40), quoted(label, 40))
    return Columns(label, inputs, guessed, candidates if len(candidates) > 1 else [])


LABEL_SAMPLE_ROWS = 1000  # rows looked at to tell whether a column could be the label


def label_candidates(frame, columns: Sequence[str], chosen: str | None) -> list[str]:
    """The `columns` that could be the label (the `chosen` one first): a few repeated values,
    as a label column has (at most half as many distinct values as rows)."""
    sample = frame.iloc[:LABEL_SAMPLE_ROWS]
    found = []
    for column in columns:
        values = sample[column].dropna().astype(str).str.strip()
        values = values[values != ""]
        if len(values) and values.nunique() <= max(2, len(values) // 2):
            found.append(column)
    return sorted(found, key=lambda c: c != chosen)


def detect_input(frame, role: str, path: Path, exclude: Sequence[str] = (),
                 reader: Reader | None = None) -> str:
    """The text column (a well-known name, else the longest values) or the image column (a
    well-known name, else image file names) of a table. With a `reader`, a table that clearly
    holds another kind of data than `role` (texts or numbers for images, image paths or numbers
    for texts) is an error naming that and the model type that reads it."""
    by_name = find_by_name(frame, TEXT_NAMES if role == "text" else IMAGE_NAMES, exclude)
    found = by_name or (longest_text_column(frame, exclude) if role == "text" else
                        image_like_column(frame, exclude))
    if reader is not None and by_name is None:
        mismatch = kind_mismatch(frame, role, path, reader, found)
        if mismatch is not None:
            raise mismatch
    if found is None:
        raise undetectable(path, role, frame)
    return found


KIND_SAMPLE_ROWS = 200  # rows looked at to tell what kind of data a table holds
ROLE_DATA = {"image": "image paths", "text": "texts", "feature": "feature columns"}
BUNDLE_INPUT = {"image": "images, a folder of them or a table of image paths",
                "text": "a table of texts"}


def table_kind(frame, role: str, found: str | None) -> str | None:
    """What a table that `role` cannot read clearly holds, or None: "numeric" (numbers only);
    for images (no image column `found`), "text" (a column of mostly multi-word cells); for
    texts, "image path" (the column `found` for the text holds image file names)."""
    import pandas as pd

    sample = frame.iloc[:KIND_SAMPLE_ROWS]
    cells = {c: sample[c].dropna().astype(str).str.strip() for c in sample.columns}
    cells = {c: v[v != ""] for c, v in cells.items() if len(v[v != ""])}
    if not cells:
        return None
    if all(pd.to_numeric(v, errors="coerce").notna().mean() >= 0.9 for v in cells.values()):
        return "numeric"
    if role == "image" and found is None and \
            any(v.str.contains(r"\s").mean() >= 0.5 for v in cells.values()):
        return "text"
    if role == "text" and found is not None and image_like_column(sample[[found]]) == found:
        return "image path"
    return None


def kind_mismatch(frame, role: str, path: Path, reader: Reader,
                  found: str | None) -> DataError | None:
    """The error for a table whose data is of another kind than `role` (None: it is not, or
    it is not clear; table_kind): texts or numbers where image paths belong, image paths or
    numbers where texts belong."""
    if role not in ("image", "text"):
        return None
    kind = table_kind(frame, role, found)
    if kind is None:
        return None
    other = {"text": "text", "numeric": "feature", "image path": "image"}[kind]
    suggested = reader.by_role.get(other)
    columns = quoted_sample(frame.columns, 10)
    if reader.bundle:
        return DataError(f"this bundle is {with_article(reader.model_type)}; {path.name} holds {kind} "
                         f"rows (columns {columns}), not {ROLE_DATA[role]}",
                         f"give it {BUNDLE_INPUT[role]}"
                         + (f", or predict with {with_article(suggested)} bundle" if suggested else ""))
    return DataError(f"{path} holds {kind} columns ({columns}), not {ROLE_DATA[role]}: this "
                     f"run trains {with_article(reader.model_type)}",
                     f"pass --model_type {suggested}" if suggested else
                     f"pass --{_flag(role)} naming the column of {ROLE_DATA[role]}")


def longest_text_column(frame, exclude: Sequence[str] = ()) -> str | None:
    lengths = {c: frame[c].dropna().astype(str).str.len().mean() for c in frame.columns
               if c not in exclude}
    return max(lengths, key=lengths.get) if lengths else None


def fewest_values_column(frame, exclude: Sequence[str]) -> str | None:
    counts = {c: frame[c].nunique() for c in frame.columns if c not in exclude}
    return min(counts, key=counts.get) if counts else None


def image_like_column(frame, exclude: Sequence[str] = ()) -> str | None:
    for column in frame.columns:
        values = frame[column].dropna().astype(str).str.lower()
        if column not in exclude and len(values) and \
                values.str.endswith(IMAGE_EXTENSIONS).mean() >= 0.8:
            return column
    return None


def serving_columns(frame, trained: Columns, path: Path, role: str,
                    label_spec: str | None = None, input_spec: str | None = None,
                    reader: Reader | None = None) -> Columns:
    """The columns of a table to predict, as the model was trained: the flags given now, else
    the columns training used (`trained`: the names it resolved, found by name, else a digit
    name by position; no inputs: detected as training would). A headerless table of texts or
    image paths alone (no label) maps onto them by position. The label is optional here."""
    if input_spec:
        inputs = resolve_all(frame, input_spec, role, path)
    elif not trained.inputs:
        inputs = [detect_input(frame, role, path, reader=reader)]
    else:
        found = [locate_column(frame, name) for name in trained.inputs]
        # columns without names on either side: the model's were positions (a headerless
        # training file), or this table's are
        unnamed = all(c.isdigit() for c in frame.columns) or \
            all(name.isdigit() for name in trained.inputs)
        if None not in found:
            inputs = found
        elif role != "feature" and unnamed and frame.shape[1] == len(found):
            inputs = list(frame.columns)  # a file of the inputs alone
        else:
            absent = [n for n, f in zip(trained.inputs, found) if f is None]
            raise DataError(f"{path} lacks the {role} columns {quoted_sample(absent)} the model "
                            f"was trained on; its columns are {quoted_sample(frame.columns, 10)}",
                            f"pass --{_flag(role)} naming them (names or 0-based positions)")
    if label_spec:
        return Columns(resolve(frame, label_spec, "label", path), inputs)
    label = locate_column(frame, trained.label) if trained.label else None
    return Columns(label if label not in inputs else None, inputs)


def split_columns(frame, trained: Columns, order: Sequence[str], path: Path,
                  flag: str) -> Columns:
    """The training table's label and input columns (`trained`; `order`: all its columns) in
    the table given for another split (`flag`: --val_path or --test_path), by locate_column's
    rule. Every one must be there; extra columns are ignored. Where positions decide (either
    table has no header), both need as many columns, or each column after a missing one would
    silently take its neighbour's place."""
    positional = is_headerless(frame.columns) or is_headerless(order)
    if positional and frame.shape[1] != len(order):
        raise DataError(f"{flag} {path} has {frame.shape[1]} columns and the training table "
                        f"{len(order)}; without a header row columns are matched by position",
                        "give it the training table's columns in the same order, or give both "
                        "tables a header row (columns are then matched by name)")
    wanted = [trained.label, *trained.inputs]
    found = [locate_column(frame, name, order) for name in wanted]
    absent = [name for name, column in zip(wanted, found) if column is None]
    if absent:
        raise DataError(f"{flag} {path} lacks the training table's column(s) "
                        f"{quoted_sample(absent)}; its columns are "
                        f"{quoted_sample(frame.columns, 10)}", "give it those columns, "
                        "named as in the training table (any order; extra columns are ignored)")
    columns = Columns(found[0], found[1:])
    refuse_nested(frame, [columns.label, *columns.inputs], path)
    return columns


def locate_column(frame, name: str, order: Sequence[str] = ()) -> str | None:
    """Where a column of the training table (`name`) is in a table read against it (a
    --val_path or --test_path split, inference.py --input): the one rule for all of them. By
    name; a digit name (training had no header) by that position; else, in a table without a
    header, by the name's position among the training table's columns (`order`, when known).
    None when it is not there: never a neighbour's column by position in a table with a header.
    """
    if name in frame.columns:
        return name
    if name.isdigit() and int(name) < frame.shape[1]:
        return frame.columns[int(name)]
    order = list(order)
    if is_headerless(frame.columns) and name in order and order.index(name) < frame.shape[1]:
        return frame.columns[order.index(name)]
    return None


def is_headerless(columns: Sequence[str]) -> bool:
    """Columns named 0, 1, ...: a CSV/TSV read without a header row."""
    return [str(c) for c in columns] == [str(i) for i in range(len(columns))]


def refuse_nested(frame, used: Sequence[str | None], path: Path) -> None:
    """Exit 3 when a column the run uses holds nested values (a Parquet list, struct or map,
    JSON arrays or objects): a model takes one number or text per cell, and the text of a list
    (`"['Wat', 'uniform?']"`) is no input. Nested columns a run does not use are left alone."""
    nested = frame.attrs.get(NESTED) or {}
    bad = [f"{name!r} ({nested[name]})" for name in dict.fromkeys(used) if name in nested]
    if bad:
        one = len(bad) == 1
        raise DataError(f"{path}: {'column' if one else 'columns'} {', '.join(bad[:5])} "
                        f"{'holds' if one else 'hold'} nested values, and a model takes one "
                        "number or text per cell", "flatten it into plain columns (one per "
                        "field or element; a list of words joined into one string), or name "
                        "the columns to use (--label_column, --feature_columns, --text_column)")


# ----------------------------------------------------------------------------- cells


def frame_columns(frame, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The frame's `names` columns as 1-D arrays: typed (numeric) columns as they are, the
    others as object arrays, read in one pass where the frame has no typed column (selecting
    columns in pandas costs tens to hundreds of microseconds whatever the rows: a row served
    alone paid that per column)."""
    if isinstance(frame, Cells):
        return {name: _as_cells(frame.arrays[name]) for name in names}
    import pandas as pd

    typed = {name for name, kind in zip(frame.columns, frame.dtypes.to_numpy())
             if kind != object and pd.api.types.is_numeric_dtype(kind)}
    if not typed:
        where = {name: k for k, name in enumerate(frame.columns)}
        block = frame.to_numpy(dtype=object)
        return {name: block[:, where[name]] for name in names}
    return {name: frame[name].to_numpy() if name in typed else
            frame[name].to_numpy(dtype=object) for name in names}


def _as_cells(values: np.ndarray) -> np.ndarray:
    """A Cells column as frame_columns gives a DataFrame's: numbers as they are, any other
    column as an object array."""
    return values if values.dtype == object or np.issubdtype(values.dtype, np.number) \
        else values.astype(object)


def joined_texts(frame, columns: Sequence[str]):
    """joined_text_list as a Series on the frame's index."""
    import pandas as pd

    return pd.Series(joined_text_list(frame, columns), index=frame.index, dtype=object)


def joined_text_list(frame, columns: Sequence[str]) -> list[str]:
    """The text of each row of a frame (or Cells): its `columns` joined with a space (missing
    cells empty), stripped; one longer than --max_row_bytes refused (check_text_lengths).
    Computed on the cells as arrays: per row, not per call."""
    import pandas as pd

    cells = frame_columns(frame, list(columns))
    parts = [_TEXT(values, pd.isna(values)) if len(values) else values
             for values in cells.values()]
    joined = parts[0] if len(parts) == 1 else [" ".join(row) for row in zip(*parts)]
    texts = _RowTexts(text.strip() for text in joined)
    texts.index = frame.index
    check_text_lengths(texts)
    return list(texts)


class _RowTexts(list):
    """Texts with their rows' index, as check_text_lengths names a row."""

    index: object = None


_TEXT = np.frompyfunc(lambda value, missing: "" if missing else str(value), 2, 1)


def label_text(value) -> str | None:
    """A label cell as a class name: stripped; None only when empty or blank (`NA`, `None`,
    `null` are class names). A number names one class however it is written: `1`, `1.0`,
    `+1`, `01` and `1e0` are class "1", `0.50` and `.5` class "0.5"."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    text = str(value).strip()
    if not text:
        return None
    if _INTEGER.fullmatch(text):
        return str(int(text))  # exact at any length (ids)
    if _NUMBER.fullmatch(text):
        return canonical_number(float(text)) or text
    return text


def is_number(text: str) -> bool:
    """A decimal number as a class name or cell may spell it (not inf or nan)."""
    return bool(_NUMBER.fullmatch(text.strip()))


def canonical_number(number: float) -> str | None:
    """The one spelling of a number used as a class name (None for inf/nan)."""
    if number != number or number in (float("inf"), float("-inf")):
        return None
    if number.is_integer() and abs(number) < 1e15:
        return str(int(number))
    return repr(number)


def label_texts(values) -> list[str | None]:
    return [label_text(v) for v in values]


def numeric_cells(values) -> tuple[np.ndarray, np.ndarray]:
    """A column (a pandas Series or a 1-D array of cells) as float64 numbers (NaN where missing)
    and a mask of the cells that are not numbers (NaN too): the parser's numbers pass through,
    strings are parsed, NUMERIC_MISSING markers are missing, not wrong. Array in, array out, so
    that the cost is per cell, not per call (a served row is one cell a column)."""
    import pandas as pd

    cells = _cell_array(values)
    if pd.api.types.is_numeric_dtype(cells.dtype):
        return cells.astype(np.float64), np.zeros(len(cells), dtype=bool)
    text, absent = _stripped(cells)
    missing = absent | _member(text, NUMERIC_MISSING)
    kept = cells.astype(object)  # a copy: the caller's cells stay as they are
    kept[missing] = np.nan
    numbers = np.asarray(pd.to_numeric(kept, errors="coerce"), dtype=np.float64)
    return numbers, np.isnan(numbers) & ~missing


def category_texts(values) -> np.ndarray:
    """A categorical column's cells (a Series or a 1-D array) as the text one-hot encoding
    compares: stripped, MISSING markers as NaN (no category); an object array."""
    text, absent = _stripped(_cell_array(values))
    text[absent | _member(text, MISSING)] = np.nan
    return text


def category_cells(values) -> "object":
    """category_texts as a Series on the column's index (what fitting counts)."""
    import pandas as pd

    return pd.Series(category_texts(values), index=values.index, dtype=object)


def _cell_array(values) -> np.ndarray:
    return values.to_numpy() if hasattr(values, "to_numpy") else np.asarray(values)


_STRIPPED = np.frompyfunc(lambda value: str(value).strip(), 1, 1)
_MEMBER = {}  # a frozenset → its elementwise membership test


def _stripped(cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each cell's text, stripped (an object array), and where the cell is missing (None,
    NaN, NA), whose text is then meaningless."""
    import pandas as pd

    absent = np.asarray(pd.isna(cells), dtype=bool)
    text = _STRIPPED(cells) if len(cells) else np.array([], dtype=object)
    return np.asarray(text, dtype=object), absent


def _member(text: np.ndarray, words: frozenset) -> np.ndarray:
    if words not in _MEMBER:
        _MEMBER[words] = np.frompyfunc(words.__contains__, 1, 1)
    return np.asarray(_MEMBER[words](text), dtype=bool) if len(text) else \
        np.zeros(0, dtype=bool)


def numeric_share(values) -> tuple[float, list[str]]:
    """Of a feature column's present cells (not NUMERIC_MISSING), the share that are numbers,
    and the cells that are not: how TabularEncoder decides numeric or categorical."""
    import pandas as pd

    present = category_cells(values).dropna()
    present = present[~present.isin(NUMERIC_MISSING)]
    if len(present) == 0:
        return 1.0, []
    numbers = pd.to_numeric(present, errors="coerce").notna()
    return float(numbers.mean()), list(present[~numbers])
