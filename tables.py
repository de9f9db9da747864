"""Reading users' tables as they are: CSV, TSV, JSON (array of records) and JSONL, UTF-8 with or
without BOM, with or without a header row, columns named or given by 0-based position.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Sequence

from utils import DataError

TABLE_FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".txt": "tsv", ".json": "json",
                 ".jsonl": "jsonl", ".ndjson": "jsonl"}
FORMAT_NAMES = ("csv", "tsv", "json", "jsonl")
LABEL_NAMES = ("label", "labels", "class", "target", "category", "y", "sentiment", "intent")
TEXT_NAMES = ("text", "message", "sms", "sentence", "review", "content", "body", "comment",
              "tweet", "document", "title", "description", "question", "utterance")
IMAGE_NAMES = ("image", "image_path", "path", "file", "filename", "filepath", "img")
HEADER_WORDS = set(LABEL_NAMES + TEXT_NAMES + IMAGE_NAMES + ("id", "name", "feature"))
MISSING = {"", "nan", "NaN", "NA", "N/A", "null", "None"}


def table_format(path: Path, override: str | None = None) -> str:
    if override:
        return override
    kind = TABLE_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"cannot tell the format of {path} from its extension",
                        f"use one of {', '.join(sorted(TABLE_FORMATS))} or pass --dataset_format")
    return kind


def read_table(path: Path, fmt: str | None = None, has_header: str = "auto",
               named_columns: Sequence[str] = ()):
    """A DataFrame of strings (missing cells NaN) with string column names.

    Headerless files get columns "0", "1", ...; `named_columns` (column names the user passed)
    count as evidence of a header.
    """
    import pandas as pd

    kind = table_format(path, fmt)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist", "check the path")
    try:
        if kind in ("csv", "tsv"):
            frame = pd.read_csv(path, sep="," if kind == "csv" else "\t", header=None, dtype=str,
                                encoding="utf-8-sig", keep_default_na=False,
                                skip_blank_lines=True,
                                quoting=csv.QUOTE_MINIMAL if kind == "csv" else csv.QUOTE_NONE)
            frame = _apply_header(frame, has_header, named_columns)
        else:
            frame = pd.read_json(path, lines=kind == "jsonl", dtype=False, encoding="utf-8-sig")
            frame = frame.astype(object).where(frame.notna(), None)
            frame = frame.apply(lambda col: col.map(lambda v: None if v is None else str(v)))
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text", "re-save it as UTF-8") from None
    except (ValueError, pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        if isinstance(err, pd.errors.EmptyDataError):
            raise DataError(f"{path} is empty", "add a header and rows of data") from None
        first = (str(err).strip().splitlines() or [""])[0]
        raise DataError(f"cannot parse {path} as {kind.upper()}: {first}",
                        "check the file's format, or pass --dataset_format") from None
    frame.columns = _unique_names(frame.columns)
    frame = frame.where(~frame.isin(MISSING)).dropna(how="all")
    if frame.empty:
        raise DataError(f"{path} has no data rows", "add rows of data")
    return frame


def _unique_names(columns) -> list[str]:
    seen: dict[str, int] = {}
    names = []
    for column in columns:
        name = str(column).strip()
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}.{seen[name] - 1}")
    return names


def _apply_header(frame, has_header: str, named_columns: Sequence[str]):
    if frame.empty:
        return frame
    header = {"true": True, "false": False}.get(has_header)
    if header is None:
        header = looks_like_header(frame, named_columns)
    if not header:
        frame.columns = [str(i) for i in range(frame.shape[1])]
        return frame.reset_index(drop=True)
    body = frame.iloc[1:].reset_index(drop=True)
    body.columns = list(frame.iloc[0].fillna("").astype(str))
    return body


def looks_like_header(frame, named_columns: Sequence[str] = ()) -> bool:
    """Is the first row a header? Evidence, strongest first: a column name the user passed;
    a well-known name (label, text, ...); a numeric column whose first cell is not a number;
    a low-cardinality column (labels) whose first cell never appears again."""
    import pandas as pd

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
    raise DataError(f"{path} has no column {spec!r} for the {role}; its columns are {columns}",
                    f"pass --{role}_column with one of them (a name or a 0-based position)")


def find_by_name(frame, names: Sequence[str], exclude: Sequence[str] = ()) -> str | None:
    by_lower = {c.lower(): c for c in frame.columns if c not in exclude}
    return next((by_lower[n] for n in names if n in by_lower), None)


def undetectable(path: Path, role: str, frame) -> DataError:
    return DataError(f"cannot tell which column of {path} holds the {role}; its columns are "
                     f"{list(frame.columns)}", f"pass --{role}_column (a name or a 0-based position)")
