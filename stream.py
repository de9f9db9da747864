"""Batch inference on new data: read any size of input in chunks, encode each chunk as the
bundle's model was trained, and write predictions as they come (flat memory).

Inputs: an image file, a folder of images (recursive; a first-level folder named like a class is
that image's label), a CSV/TSV/JSON/JSONL table (text, tabular features, or image paths), or "-"
for one text per line on stdin. A row that cannot be used (an undecodable image, a
non-numeric feature) becomes an error row, not a failed run. numpy, pandas and Pillow only.
"""
from __future__ import annotations

import csv
import io
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from data import IMAGE_EXTENSIONS, decode_image_file
from preprocess import Tokenizer, TabularEncoder
from tables import MISSING, table_format
from utils import ConfigError, DataError

LABEL_NAMES = ("label", "labels", "class", "target", "y", "category")
TEXT_NAMES = ("text", "message", "sms", "sentence", "review", "content", "body")
NUMERIC_MISSING = {"", "nan", "NaN", "NA", "N/A", "?", "null", "None"}


@dataclass
class Chunk:
    """Encoded rows ready for the model, the rows that failed, and the true labels if given."""

    ids: list[str]
    x: np.ndarray | None
    labels: list[str | None] | None = None
    errors: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class StreamOptions:
    source: str
    chunk_rows: int
    label_column: str | None = None
    text_column: str | None = None
    image_column: str | None = None
    dataset_format: str | None = None


# ----------------------------------------------------------------------------- images


def _image_files(root: Path) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS and not any(
                part.startswith(".") for part in path.relative_to(root).parts):
            yield path


def _decode_images(paths: Sequence[Path], ids: Sequence[str], labels: Sequence[str | None],
                   preprocessing: dict) -> Chunk:
    pixels, kept_ids, kept_labels, errors = [], [], [], []
    for path, ident, label in zip(paths, ids, labels):
        try:
            pixels.append(decode_image_file(path, preprocessing))
        except Exception as err:  # noqa: BLE001 - any decoder failure is this row's error
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            errors.append((ident, f"unreadable image: {reason}"))
            continue
        kept_ids.append(ident)
        kept_labels.append(label)
    x = np.stack(pixels).astype(np.float32) if pixels else None
    return Chunk(kept_ids, x, kept_labels if any(v is not None for v in kept_labels) else None,
                 errors)


def image_folder_chunks(root: Path, manifest: dict, chunk_rows: int) -> Iterator[Chunk]:
    classes = set(manifest["labels"])
    batch: list[Path] = []

    def label_of(path: Path) -> str | None:
        parts = path.relative_to(root).parts if root.is_dir() else ()
        return parts[0] if len(parts) > 1 and parts[0] in classes else None

    for path in _image_files(root):
        batch.append(path)
        if len(batch) == chunk_rows:
            yield _decode_images(batch, [str(p) for p in batch], [label_of(p) for p in batch],
                                 manifest["preprocessing"])
            batch = []
    if batch:
        yield _decode_images(batch, [str(p) for p in batch], [label_of(p) for p in batch],
                             manifest["preprocessing"])


# ----------------------------------------------------------------------------- tables


def _frames(path: Path, fmt: str, chunk_rows: int, header: bool, typed: bool = False
            ) -> Iterator:
    """DataFrames, chunk_rows at a time, columns named by the header (or 0, 1, ...): strings,
    or with `typed` the C parser's own column types (numbers parsed in C, missing as NaN; a
    column holding a non-number comes as strings), 10x faster for numeric tables."""
    import pandas as pd

    strings = {} if typed else {"dtype": str, "keep_default_na": False}
    try:
        if fmt in ("csv", "tsv"):
            yield from pd.read_csv(
                path, sep="," if fmt == "csv" else "\t", header=0 if header else None,
                encoding="utf-8-sig", skip_blank_lines=True, **strings,
                quoting=csv.QUOTE_MINIMAL if fmt == "csv" else csv.QUOTE_NONE,
                chunksize=chunk_rows)
        elif fmt == "jsonl":
            yield from pd.read_json(path, lines=True, dtype=False, chunksize=chunk_rows,
                                    encoding="utf-8-sig")
        else:
            frame = pd.read_json(path, dtype=False, encoding="utf-8-sig")
            for start in range(0, len(frame), chunk_rows):
                yield frame.iloc[start:start + chunk_rows]
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text", "re-save it as UTF-8") from None
    except (ValueError, pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise DataError(f"cannot parse {path} as {fmt.upper()}: {first or 'no data'}",
                        "check the file's format, or pass --dataset_format") from None


def _has_header(path: Path, fmt: str, manifest: dict) -> bool:
    """Whether a CSV/TSV's first row names columns: the training file's setting when recorded,
    else whether it holds a known column name (a feature, or a label/text column name)."""
    if fmt not in ("csv", "tsv"):
        return True
    recorded = (manifest.get("dataset") or {}).get("has_header")
    if recorded in ("true", "false"):
        return recorded == "true"
    with open(path, encoding="utf-8-sig", errors="replace") as handle:
        first = handle.readline().rstrip("\r\n")
    cells = [c.strip().strip('"').lower() for c in first.split("," if fmt == "csv" else "\t")]
    known = {c["name"].lower() for c in manifest["preprocessing"].get("columns", [])}
    known |= set(LABEL_NAMES) | set(TEXT_NAMES) | {"image", "path", "file", "filename"}
    recorded_columns = [(manifest.get("dataset") or {}).get(k) for k in
                        ("label_column", "text_column", "image_column")]
    known |= {str(c).lower() for c in recorded_columns if c}
    return any(c in known for c in cells)


def _pick(frame, wanted: str | None, names: Sequence[str], role: str, path: Path,
          required: bool) -> str | None:
    columns = [str(c) for c in frame.columns]
    if wanted is not None:
        if wanted in columns:
            return wanted
        if wanted.isdigit() and int(wanted) < len(columns):
            return columns[int(wanted)]
        if required:
            raise DataError(f"{path} has no {role} column {wanted!r}",
                            f"its columns are {columns[:20]}; pass --{role}_column")
        return None
    for name in names:
        for column in columns:
            if column.lower() == name:
                return column
    return None


class TableReader:
    """Chunks of a table, encoded for the bundle's model type."""

    def __init__(self, path: Path, manifest: dict, options: StreamOptions) -> None:
        self.path, self.manifest, self.options = path, manifest, options
        self.kind = manifest["preprocessing"]["kind"]
        self.fmt = table_format(path, options.dataset_format)
        self.header = _has_header(path, self.fmt, manifest)
        recorded = manifest.get("dataset") or {}
        self.label_wanted = options.label_column or recorded.get("label_column")
        self.text_wanted = options.text_column or recorded.get("text_column")
        self.image_wanted = options.image_column or recorded.get("image_column")
        self.tokenizer = Tokenizer.from_manifest(manifest["preprocessing"]) \
            if self.kind == "text" else None
        self.encoder = TabularEncoder.from_manifest(manifest["preprocessing"]) \
            if self.kind == "tabular" else None
        self.columns: dict[str, str | None] | None = None
        self.row = 0

    def _choose_columns(self, frame) -> dict[str, str | None]:
        label = _pick(frame, self.label_wanted, LABEL_NAMES, "label", self.path,
                      required=self.options.label_column is not None)
        if self.kind == "tabular":
            features = [c["name"] for c in self.encoder.columns]
            missing = [name for name in features if name not in frame.columns]
            if missing:
                raise DataError(f"{self.path} lacks the feature columns {missing[:5]} the model "
                                "was trained on", f"its columns are {list(frame.columns)[:20]}")
            others = [c for c in frame.columns if c not in features]
            if label is None and len(others) == 1:  # one column besides the features
                label = others[0]
            return {"label": label}
        role = "text" if self.kind == "text" else "image"
        wanted = self.text_wanted if role == "text" else self.image_wanted
        names = TEXT_NAMES if role == "text" else ("image", "path", "file", "filename")
        column = _pick(frame, wanted, names, role, self.path,
                       required=getattr(self.options, f"{role}_column") is not None)
        if column is None:
            others = [c for c in frame.columns if c != label]
            if len(others) == 1 or (role == "text" and others):
                column = others[0] if len(others) == 1 else max(
                    others, key=lambda c: frame[c].astype(str).str.len().mean())
        if column is None:
            raise DataError(f"cannot tell which column of {self.path} holds the {role}s",
                            f"pass --{role}_column")
        others = [c for c in frame.columns if c != column]
        if label is None and len(others) == 1 and self.options.label_column is None:
            label = others[0]  # one column besides the texts (or image paths)
        return {"label": label, role: column}

    def __iter__(self) -> Iterator[Chunk]:
        typed = self.kind == "tabular"
        for frame in _frames(self.path, self.fmt, self.options.chunk_rows, self.header, typed):
            frame.columns = [str(c) for c in frame.columns]
            if self.columns is None:
                self.columns = self._choose_columns(frame)
            ids = [str(self.row + i + 1) for i in range(len(frame))]  # 1-based data rows
            self.row += len(frame)
            label = self.columns["label"]
            labels = [None if v is None or v != v or str(v).strip() in MISSING
                      else _label_text(v) for v in frame[label]] if label else None
            yield self._encode(frame, ids, labels)

    def _encode(self, frame, ids: list[str], labels: list[str | None] | None) -> Chunk:
        if self.kind == "text":
            texts = [("" if v is None else str(v)) for v in frame[self.columns["text"]]]
            return Chunk(ids, self.tokenizer.encode_batch(texts), labels)
        if self.kind == "image":
            base = self.path.parent
            paths = [Path(str(v)) if Path(str(v)).is_absolute() else base / str(v)
                     for v in frame[self.columns["image"]]]
            return _decode_images(paths, ids, labels or [None] * len(ids),
                                  self.manifest["preprocessing"])
        return self._encode_features(frame, ids, labels)

    def _encode_features(self, frame, ids: list[str], labels: list[str | None] | None) -> Chunk:
        """Features as at training (TabularEncoder's rules); a row with a non-numeric value in
        a numeric column fails. Columns the parser already read as numbers skip the checks."""
        import pandas as pd

        bad = np.zeros(len(frame), dtype=bool)
        reasons = [""] * len(frame)
        parts = []
        for column in self.encoder.columns:
            values = frame[column["name"]]
            if column["type"] != "numeric":
                text = values.astype(str).str.strip()
                parts.append(np.stack([(text == c).to_numpy(np.float32)
                                       for c in column["categories"]], axis=1))
                continue
            if pd.api.types.is_numeric_dtype(values.dtype):
                numbers = values.to_numpy(dtype=np.float64)
            else:
                numbers = pd.to_numeric(values, errors="coerce").to_numpy(dtype=np.float64)
                text = values.astype(str).str.strip()
                wrong = np.isnan(numbers) & values.notna().to_numpy() & \
                    ~text.isin(NUMERIC_MISSING).to_numpy()
                for i in np.flatnonzero(wrong & ~bad):
                    reasons[i] = (f"non-numeric value {text.iloc[i][:40]!r} in column "
                                  f"{column['name']!r}")
                bad |= wrong
            with np.errstate(over="ignore"):
                as_float32 = numbers.astype(np.float32)
            huge = np.isinf(as_float32)  # beyond float32, or inf: the model would return NaN
            for i in np.flatnonzero(huge & ~bad):
                reasons[i] = f"value {numbers[i]:g} in column {column['name']!r} is out of range"
            bad |= huge
            parts.append(as_float32[:, None])
        x = np.concatenate(parts, axis=1) if parts else np.zeros((len(frame), 0), np.float32)
        keep = ~bad
        errors = [(ident, reason) for ident, reason, b in zip(ids, reasons, bad) if b]
        kept_labels = [lab for lab, k in zip(labels, keep) if k] if labels else None
        return Chunk([i for i, k in zip(ids, keep) if k], x[keep] if keep.any() else None,
                     kept_labels, errors)


def _label_text(value) -> str:
    text = str(value).strip()
    return text[:-2] if text.endswith(".0") and text[:-2].lstrip("-").isdigit() else text


# ----------------------------------------------------------------------------- stdin


def stdin_chunks(manifest: dict, chunk_rows: int, stream: io.TextIOBase | None = None
                 ) -> Iterator[Chunk]:
    if manifest["preprocessing"]["kind"] != "text":
        raise ConfigError("--input - reads one text per line, and this is a "
                          f"{manifest['model_type']}", "give a file or folder as --input")
    tokenizer = Tokenizer.from_manifest(manifest["preprocessing"])
    stream = stream or sys.stdin
    texts: list[str] = []
    row = 0
    for line in stream:
        texts.append(line.rstrip("\r\n"))
        if len(texts) == chunk_rows:
            yield Chunk([str(row + i + 1) for i in range(len(texts))],
                        tokenizer.encode_batch(texts))
            row += len(texts)
            texts = []
    if texts:
        yield Chunk([str(row + i + 1) for i in range(len(texts))], tokenizer.encode_batch(texts))


def input_chunks(manifest: dict, options: StreamOptions) -> Iterator[Chunk]:
    """The chunks of --input, whatever it is."""
    if options.source == "-":
        return stdin_chunks(manifest, options.chunk_rows)
    path = Path(options.source)
    if not path.exists():
        raise DataError(f"input {path} does not exist", "check the path")
    kind = manifest["preprocessing"]["kind"]
    if path.is_dir() or path.suffix.lower() in IMAGE_EXTENSIONS:
        if kind != "image":
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
