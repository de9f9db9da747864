"""Rows given as JSON objects (serve.py's requests, the Python API's rows), encoded by the rules
the lines of an `inference.py --input rows.jsonl` file are: the same JSON parser and cells
(tables.json_record_cells, read into Cells, not a DataFrame: pandas' fixed cost per call was most
of a one-row request's), the same choice of columns (batch.TableReader), the same encoders
(batch.RowEncoder). One difference, where a request cannot carry a path: an image row holds its
file's bytes, base64-encoded, under "image" (or the image column the model was trained on).

A problem of the whole request (a column the model needs is absent, nested values) raises a
DataError; a row that cannot be used (a non-number where a number is expected, an undecodable
image) is a RowError naming the row and the reason the batch path gives for it.
"""
from __future__ import annotations

import base64
import binascii
import threading
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ttc.inputs.tables import Columns, json_record_cells, locate_column
from ttc.serving.batch import (ROW_IMAGE, ROW_PATH, ROW_TEXT, BatchOptions, Chunk,
                               RowEncoder, TableReader)
from ttc.serving.manifest import Manifest
from utils import DataError, first_line, quoted_sample

IMAGE_KEY = "image"
REQUEST = Path("the request")  # how messages name where the rows came from


class RowError(DataError):
    """A row of a request that cannot be predicted (the others are fine)."""


class RecordReader(TableReader):
    """JSON objects → the model's input array, one row per object, in order."""

    def __init__(self, manifest: Manifest) -> None:
        super().__init__(REQUEST, manifest, BatchOptions(input="", output="",
                                                         dataset_format="jsonl"))
        self.rows = RowEncoder(self.manifest)
        self.names = self._request_names()
        self._lock = threading.Lock()  # the column choice is per call
        self._last_choice: tuple = (None, None, {})  # (keys, Columns, renamed)
        self._by_keys = self._keys_decide()

    def encode(self, records: Sequence[Mapping]) -> np.ndarray:
        """The rows' model inputs; raises DataError for the request, RowError for a row."""
        self.check(records)
        outcome = self.encode_parts([records])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def check(self, records: Sequence) -> None:
        """What a request's rows must be before they can join others: some, each an object."""
        if not len(records):
            raise DataError("the request has no rows", 'send {"instances": [ROW, ...]} with at '
                            "least one row")
        for number, record in enumerate(records, 1):
            if not isinstance(record, Mapping):
                raise RowError(f"row {number} is a JSON {type(record).__name__}, not an object",
                               f"send each row as an object of its columns, e.g. "
                               f"{self.example_row()}")

    def encode_parts(self, parts: Sequence[Sequence[Mapping]], first_rows: Sequence[int] = ()
                     ) -> list[np.ndarray | DataError]:
        """Several requests' rows (each checked) → each one's model inputs, or the error that
        request alone gets. Requests whose rows have the same keys are encoded together, in one
        pass of the encoders (a pass costs about the same for one row as for a batch); where
        that fails for the whole group (a nested value; any exception, a library's too), each
        of them is encoded alone, so that a bad request never fails another. `first_rows`: the
        number of each part's first row in its request (a request split across batches), for
        the messages."""
        firsts = list(first_rows) or [1] * len(parts)
        groups: dict[tuple, list[int]] = {}
        for k, rows in enumerate(parts):
            groups.setdefault(tuple(dict.fromkeys(key for row in rows for key in row)),
                              []).append(k)
        out: list = [None] * len(parts)
        for members in groups.values():
            try:
                chunk = self._chunk([row for k in members for row in parts[k]])
            except Exception as err:  # noqa: BLE001 - whatever it is, it is one request's
                if len(members) == 1:
                    out[members[0]] = self._failure(err, parts[members[0]], firsts[members[0]])
                    continue
                for k in members:  # who is to blame
                    try:
                        out[k] = self._part_of(self._chunk(parts[k]), 0, len(parts[k]),
                                               firsts[k])
                    except Exception as alone:  # noqa: BLE001 - this request's own
                        out[k] = self._failure(alone, parts[k], firsts[k])
                continue
            start = 0
            for k in members:
                out[k] = self._part_of(chunk, start, len(parts[k]), firsts[k])
                start += len(parts[k])
        return out

    def _failure(self, err: Exception, rows: Sequence[Mapping], first: int) -> DataError:
        """What a request whose rows failed to encode gets: the DataError raised, or, for any
        other exception (one the rows' values caused in a library), a RowError naming the first
        row that fails alone."""
        if isinstance(err, DataError):
            return err
        if len(rows) > 1:
            for number, row in enumerate(rows, first):
                try:
                    self._chunk([row])
                except DataError:
                    continue  # alone it lacks what the others give it: not this failure
                except Exception as alone:  # noqa: BLE001 - this row's own
                    return encoding_failure(alone, f"row {number}")
        return encoding_failure(err, f"row {first}" if len(rows) == 1 else "the rows")

    def _chunk(self, records: Sequence[Mapping]) -> Chunk:
        frame = json_record_cells(records)
        keys = tuple(frame.columns)
        with self._lock:  # each group's keys are its own
            known = self._by_keys and self._last_choice[0] == keys  # the last choice again
            self.columns, self.renamed = self._last_choice[1:] if known else (None, {})
            rows = self.row_frame_of(frame)
            self._last_choice = (keys, self.columns, self.renamed)
        return self.rows.encode(rows) if rows is not None else Chunk([], None)

    def _part_of(self, chunk: Chunk, start: int, count: int, first: int) -> np.ndarray | RowError:
        """Rows start+1 .. start+count of an encoded chunk (its ids are 1-based row numbers):
        their inputs, or the error of the first that failed, numbered from `first`."""
        failed = [(int(ident), reason) for ident, reason in chunk.errors
                  if start < int(ident) <= start + count]
        if failed:
            number, reason = failed[0]
            more = f" (and {len(failed) - 1} more rows)" if len(failed) > 1 else ""
            return RowError(f"row {number - start - 1 + first}: {reason}{more}",
                            "fix the row; the others were fine")
        ids = np.array([int(i) for i in chunk.ids], dtype=np.int64)
        mine = np.flatnonzero((ids > start) & (ids <= start + count))
        if len(mine) != count:
            have = set(ids[mine].tolist())
            number = next(k for k in range(start + 1, start + count + 1) if k not in have)
            return RowError(f"row {number - start - 1 + first} is empty (every value missing or "
                            f"blank)", f"send the columns the model reads: {self.example_row()}")
        return chunk.x[mine[0]:mine[-1] + 1]

    def _keys_decide(self) -> bool:
        """Does the column choice depend on a request's keys alone (then the last one is kept
        for the same keys)? Always, but where _choose_columns leaves it to serving_columns
        without trained inputs, which detects them from the cells (made anew each call)."""
        trained = list(self._trained_columns().inputs)
        return bool(self.task.image_files or trained or
                    (self.role == "text" and self.names != trained))

    def _request_names(self) -> list[str]:
        if self.task.image_files:
            return [IMAGE_KEY]
        names = list(self._trained_columns().inputs) or [self.role]
        if self.role == "text" and all(name.isdigit() for name in names):  # headerless training
            return ["text"] if len(names) == 1 else [f"text{k + 1}" for k in range(len(names))]
        return names

    def _choose_columns(self, frame) -> Columns:
        names = self.names
        if self.role == "text" and names != list(self._trained_columns().inputs):
            return self._named_texts(frame, names)  # a headerless training file's positions
        if not self.task.image_files:
            return super()._choose_columns(frame)
        names = [IMAGE_KEY, *self._trained_columns().inputs]
        found = [column for name in names if (column := locate_column(frame, name))]
        if not found:
            raise DataError(f"the request's rows lack the key {IMAGE_KEY!r}; their keys are "
                            f"{quoted_sample(frame.columns, 10)}",
                            f'send {{"{IMAGE_KEY}": "<the image file\'s bytes, base64>"}}')
        self.renamed = {found[0]: ROW_PATH}
        return Columns(None, [found[0]])

    def _named_texts(self, frame, names: list[str]) -> Columns:
        """The text keys of a model trained on a headerless file, whose columns were positions:
        "text" (or text1, text2, ... for several), in the trained order."""
        found = [locate_column(frame, name) for name in names]
        if None in found or not all(isinstance(c, str) and not c.isdigit() for c in found):
            raise DataError(f"the request's rows lack the keys {names}; their keys are "
                            f"{quoted_sample(frame.columns, 10)}",
                            f"send the rows as {self.example_row()}")
        self.renamed = {name: f"{ROW_TEXT}{k}" for k, name in enumerate(found)}
        return Columns(None, found)

    def _images(self, cells) -> tuple[dict, list[str]]:
        """Base64 cells → the files' bytes; a cell that is not base64 fails its row."""
        images, errors = [], []
        for cell in cells:
            if cell != cell:  # NaN: the key is null in this row
                images.append(b"")
                errors.append("missing image")
                continue
            try:
                images.append(base64.b64decode(str(cell), validate=True))
                errors.append("" if images[-1] else "the image is empty")
            except (binascii.Error, ValueError):
                images.append(b"")
                errors.append("the image is not base64 (send the file's bytes base64-encoded)")
        return {ROW_IMAGE: images}, errors

    def example_row(self) -> str:
        """One row as the model takes it, for messages."""
        if self.task.image_files:
            return f'{{"{IMAGE_KEY}": "<base64>"}}'
        names = self.names
        return "{" + ", ".join(f'"{name}": ...' for name in names[:4]) + \
            (", ..." if len(names) > 4 else "") + "}"


def encoding_failure(err: Exception, where: str) -> RowError:
    """The one line for rows whose values an encoder's library refused with an exception that
    is not the tool's own: text that is no Unicode (a lone surrogate, which JSON's \\uD800
    escapes can make, and Arrow and every UTF-8 encoder refuse), or the library's own words."""
    if isinstance(err, UnicodeError):
        return RowError(f"{where}: a key or value holds text that is not valid Unicode (a lone "
                        "surrogate such as \\ud800)", "send text as valid UTF-8 (a character "
                        "beyond U+FFFF as its surrogate pair)")
    return RowError(f"{where}: its values cannot be encoded: {first_line(err)}", "fix the row")
