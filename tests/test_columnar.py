"""The columnar Parquet path (issue 41, item 6): a Parquet file whose trained columns are all
numeric is read as Arrow columns straight into one float32 matrix per chunk, and must give
exactly what the row frames (pandas) give: the same chunks, ids, labels, error rows and numbers;
anything else takes the row frames."""
from __future__ import annotations

import csv
import datetime as dt
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_cli

FEATURES = [{"name": "f", "type": "numeric"}, {"name": "i", "type": "numeric"},
            {"name": "g", "type": "numeric"}, {"name": "d", "type": "numeric"}]


def manifest_of(columns: list[dict]) -> dict:
    return {"model_type": "tabular_classifier", "labels": ["a", "b"], "dataset": {},
            "preprocessing": {"kind": "tabular", "columns": columns}}


def messy_table(n: int = 60) -> pa.Table:
    """Floats with nulls, NaN, ±inf and a number beyond float32; integers beyond 2**53 with
    nulls; float32; dates; rows whose features are all missing (some kept by another cell: a
    label, or an extra column's text); labels as text, numbers and blanks."""
    rng = np.random.default_rng(0)
    f = rng.normal(size=n) * 100
    f[[3, 8]] = np.nan
    f[4], f[6], f[7] = 1e39, -np.inf, np.inf
    missing = set(range(20, 30))  # every feature null: kept only where another cell is not empty
    f_null = [k in missing or k == 1 for k in range(n)]
    i = [None if k in missing or k % 6 == 0 else k * 10**15 + 1 for k in range(n)]
    g = pa.array(rng.normal(size=n).astype(np.float32),
                 mask=np.array([k in missing or k % 7 == 0 for k in range(n)]))
    d = [None if k in missing or k % 5 == 0 else dt.date(2020, 1, 1) + dt.timedelta(days=k)
         for k in range(n)]
    label = [None if k % 4 == 0 else ["a", " b ", "1.0", ""][k % 4] for k in range(n)]
    extra = [None if k % 3 else ("x" if k % 2 else "") for k in range(n)]
    return pa.table({"f": pa.array(f, mask=np.array(f_null)), "i": pa.array(i, pa.int64()),
                     "g": g, "d": pa.array(d, pa.date32()), "label": label, "extra": extra})


def read_chunks(path: Path, manifest: dict, columnar: bool, chunk_rows: int,
                **flags) -> tuple[list, bool]:
    """The encoded chunks of one path, and whether the columnar path read them."""
    from ttc.serving.batch import BatchOptions, TableReader

    reader = TableReader(path, manifest, BatchOptions(str(path), "out.csv", chunk_rows, **flags))
    reader.columnar = columnar
    used = []
    frames = reader._frame_chunks
    reader._frame_chunks = lambda: used.append("frames") or frames()
    chunks = list(reader)
    return chunks, not used


def assert_same_chunks(columnar: list, frames: list) -> None:
    assert len(columnar) == len(frames)
    for a, b in zip(columnar, frames):
        assert a.ids == b.ids and a.labels == b.labels and a.errors == b.errors
        if b.x is None:
            assert a.x is None
            continue
        assert a.x.dtype == b.x.dtype == np.float32 and a.x.flags.c_contiguous
        assert np.array_equal(a.x, b.x, equal_nan=True)


@pytest.mark.parametrize("chunk_rows", [7, 4096])
@pytest.mark.parametrize("label", [None, "label"])
def test_columnar_and_row_frames_give_identical_chunks(tmp_path, chunk_rows, label):
    path = tmp_path / "rows.parquet"
    pq.write_table(messy_table(), path, row_group_size=17)
    flags = {"label_column": label} if label else {}
    columnar, used = read_chunks(path, manifest_of(FEATURES), True, chunk_rows, **flags)
    frames, _ = read_chunks(path, manifest_of(FEATURES), False, chunk_rows, **flags)
    assert used
    assert_same_chunks(columnar, frames)
    ids = [i for c in columnar for i in c.ids]
    errors = [e for c in columnar for e in c.errors]
    assert errors == [("5", "value 1e+39 in column 'f' is out of range"),
                      ("7", "value -inf in column 'f' is out of range"),
                      ("8", "value inf in column 'f' is out of range")]
    # rows 21-30 (1-based) have no feature: kept where the label or the extra text is a value
    kept = {str(k + 1) for k in range(20, 30) if k % 4 not in (0, 3) or k % 6 == 3}
    assert {i for i in ids if 21 <= int(i) <= 30} == kept
    if label:
        assert [c.labels for c in columnar][0][:4] == [None, "b", "1", None]
    else:
        assert all(c.labels is None for c in columnar)


def test_what_the_columnar_path_leaves_to_the_row_frames(tmp_path):
    """A categorical column, a feature column of text, features renamed by --feature_columns
    or a file without the trained columns take the row frames, as before (same chunks, same
    errors)."""
    table = messy_table()
    cases = {
        "categorical": (table.append_column("c", pa.array(["red"] * len(table))),
                        FEATURES + [{"name": "c", "type": "categorical",
                                     "categories": ["red"]}], {}),
        "text feature": (table.set_column(0, "f", pa.array(
            ["1.5", None, "x"] * (len(table) // 3))), FEATURES, {}),
        "renamed": (table.rename_columns(["F", "i", "g", "d", "label", "extra"]), FEATURES,
                    {"feature_columns": "F,i,g,d"}),
    }
    for name, (data, columns, flags) in cases.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(data, path, row_group_size=17)
        columnar, used = read_chunks(path, manifest_of(columns), True, 7, **flags)
        assert not used, name
        assert_same_chunks(columnar, read_chunks(path, manifest_of(columns), False, 7,
                                                 **flags)[0])
    from utils import DataError

    path = tmp_path / "lacking.parquet"
    pq.write_table(table.drop_columns(["g"]), path)
    with pytest.raises(DataError, match="lacks the feature columns"):
        read_chunks(path, manifest_of(FEATURES), True, 7)


def write_feature_csv(path: Path, table: pa.Table) -> None:
    """The same cells as CSV text (floats as repr, so they read back exactly; null empty)."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(table.column_names)
        for row in zip(*(column.to_pylist() for column in table.columns)):
            writer.writerow(["" if v is None else repr(v) for v in row])


def test_parquet_predictions_match_the_same_rows_as_csv(wine_bundle, tmp_path):
    """inference.py --input: an all-numeric bundle (wine) on a Parquet file with missing and
    out-of-range cells predicts as on the same rows as CSV: the same predictions, error rows and
    counts (and the Parquet file took the columnar path)."""
    pre = json.loads((wine_bundle["dir"] / "model.json").read_text())["preprocessing"]
    names = [c["name"] for c in pre["columns"]]
    rng = np.random.default_rng(4)
    rows = 300
    columns = {}
    for k, name in enumerate(names):
        values = pre["mean"][k] + pre["std"][k] * rng.normal(size=rows)
        if k == 1:
            values[10] = 1e40  # beyond float32: an error row
        columns[name] = pa.array(values, mask=rng.random(rows) < 0.1)
    table = pa.table(columns)
    pq.write_table(table, tmp_path / "new.parquet", row_group_size=128)
    write_feature_csv(tmp_path / "new.csv", table)
    outputs = []
    for source in ("new.parquet", "new.csv"):
        out, errors = tmp_path / f"{source}.preds.csv", tmp_path / f"{source}.errors.csv"
        report = tmp_path / f"{source}.json"
        run = run_cli("inference.py", "--model", wine_bundle["model"], "--input",
                      tmp_path / source, "--output", out, "--errors", errors, "--top_k", "2",
                      "--allow_errors", "true", "--chunk_rows", "100", "--report_json", report)
        assert run.returncode == 0, run.stderr[-2000:]
        section = json.loads(report.read_text())["predictions"]
        outputs.append((out.read_text(), errors.read_text(), section["rows"],
                        section["predicted"], section["failed"]))
    assert outputs[0] == outputs[1]
    assert outputs[0][2:] == (300, 299, 1) and "value 1e+40 in column" in outputs[0][1]
    from ttc.serving.bundle import BundlePaths, read_manifest

    manifest = read_manifest(BundlePaths.from_model_path(wine_bundle["model"]))
    assert read_chunks(tmp_path / "new.parquet", manifest, True, 100)[1]
