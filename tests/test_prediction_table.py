"""The prediction table of `inference.py --input ... --output ...` (docs/deploy.md): the row
number, the input's own id column under its own name (found by name, or --id_column), the top
class once (label, confidence), the classes after it up to --top_k, the true label; the same
columns in CSV, JSONL and Parquet."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_clean_failure, feature_rows, run_cli, write_image_folder
from ttc.serving.batch import PredictionWriter, RowKeys

ROWS = ["5.1,0.2,red,a", "0.1,2.9,blue,b", "-4.2,-3.1,green,c", "lots,0.1,red,a",
        "5.0,0.3,red,a"]
IDS = ["r-17", "007", "=x", "r-3", "r 9"]  # kept as written: leading zeros, a formula cell


def write_rows(path: Path, header: str, cells: list[str]) -> Path:
    path.write_text(header + "\n" + "".join(f"{c}\n" for c in cells), encoding="utf-8")
    return path


def predict(model, source: Path, output: Path, *flags: str):
    return run_cli("inference.py", "--model", model, "--input", source, "--output", output,
                   "--allow_errors", "true", "--no_progress", "true", *flags)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def header_of(path: Path) -> list[str]:
    with open(path, newline="", encoding="utf-8") as handle:
        return next(csv.reader(handle))


def test_an_id_column_is_carried_in_input_order(tabular_bundle, tmp_path):
    source = write_rows(tmp_path / "new.csv", "uid,weight,height,color,kind",
                        [f"{i},{row}" for i, row in zip(IDS, ROWS)])
    out = tmp_path / "preds.csv"
    run = predict(tabular_bundle["model"], source, out, "--top_k", "2")
    assert run.returncode == 0, run.stderr[-2000:]
    assert header_of(out) == ["id", "uid", "label", "confidence", "top2_label",
                              "top2_probability", "true_label"]
    rows = read_csv(out)
    # row 4's weight is no number: an error row, the others in input order
    assert [r["uid"] for r in rows] == ["r-17", "007", "'=x", "r 9"]
    assert [r["id"] for r in rows] == ["1", "2", "3", "5"]
    assert all(r["label"] != r["top2_label"] for r in rows)
    assert all(float(r["confidence"]) >= float(r["top2_probability"]) for r in rows)


@pytest.mark.parametrize("name", ["id", "ID"])
def test_a_column_named_id_keeps_its_name_and_the_row_number_is_row(tabular_bundle, tmp_path,
                                                                     name):
    source = write_rows(tmp_path / "new.csv", f"weight,height,color,kind,{name}",
                        [f"{row},{i}" for i, row in zip(IDS, ROWS)])
    jsonl, csv_out = tmp_path / "preds.jsonl", tmp_path / "preds.csv"
    assert predict(tabular_bundle["model"], source, jsonl).returncode == 0
    assert predict(tabular_bundle["model"], source, csv_out).returncode == 0
    lines = [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines()]
    assert list(lines[0]) == header_of(csv_out) == ["row", name, "label", "confidence",
                                                    "true_label"]
    assert [r[name] for r in lines] == ["r-17", "007", "=x", "r 9"]  # JSON: data, as written
    assert [r["row"] for r in lines] == ["1", "2", "3", "5"]


def test_without_an_id_column_the_row_number_alone(tabular_bundle, tmp_path):
    source = write_rows(tmp_path / "new.csv", "weight,height,color,kind", ROWS)
    out = tmp_path / "preds.csv"
    run = predict(tabular_bundle["model"], source, out, "--top_k", "3")
    assert run.returncode == 0, run.stderr[-2000:]
    columns = header_of(out)
    assert columns == ["id", "label", "confidence", "top2_label", "top2_probability",
                       "top3_label", "top3_probability", "true_label"]
    assert len(set(columns)) == len(columns)
    assert [r["id"] for r in read_csv(out)] == ["1", "2", "3", "5"]


def test_id_column_names_a_column_by_name_or_position(tabular_bundle, tmp_path):
    source = write_rows(tmp_path / "new.csv", "ref,weight,height,color,kind",
                        [f"{i},{row}" for i, row in zip(IDS, ROWS)])
    for spec in ("ref", "0"):
        out = tmp_path / f"preds-{spec}.parquet"
        run = predict(tabular_bundle["model"], source, out, "--id_column", spec)
        assert run.returncode == 0, run.stderr[-2000:]
        import pyarrow.parquet as pq

        table = pq.read_table(out)
        assert table.column_names == ["id", "ref", "label", "confidence", "true_label"]
        assert table.column("ref").to_pylist() == ["r-17", "007", "=x", "r 9"]


def test_a_wrong_id_column_is_a_usage_error(tabular_bundle, tmp_path):
    source = write_rows(tmp_path / "new.csv", "weight,height,color,kind", ROWS)
    out = tmp_path / "preds.csv"
    run = predict(tabular_bundle["model"], source, out, "--id_column", "order_no")
    assert_clean_failure(run, 2, "--id_column 'order_no'", "weight")
    assert not out.exists()
    run = predict(tabular_bundle["model"], source, out, "--id_column", "kind")  # the label
    assert run.returncode == 0, run.stderr[-2000:]  # its own column, beside the true label
    assert header_of(out) == ["id", "kind", "label", "confidence", "true_label"]


def test_jsonl_output_has_the_csv_fields(tabular_bundle, tmp_path):
    source = write_rows(tmp_path / "new.csv", "key,weight,height,color,kind",
                        [f"{i},{row}" for i, row in zip(IDS, ROWS)])
    csv_out, jsonl = tmp_path / "preds.csv", tmp_path / "preds.jsonl"
    for out in (csv_out, jsonl):
        run = predict(tabular_bundle["model"], source, out, "--top_k", "2")
        assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines()]
    rows = read_csv(csv_out)
    assert all(list(line) == header_of(csv_out) for line in lines)
    assert [line["key"] for line in lines] == ["r-17", "007", "=x", "r 9"]
    assert [line["label"] for line in lines] == [r["label"] for r in rows]


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_the_writer_refuses_an_id_column_named_like_a_prediction_column(fmt):
    with pytest.raises(Exception, match="has the name of a prediction column"):
        PredictionWriter(io.StringIO(), fmt, ["a", "b"], 2, False, [], "top2_label")


def test_the_writer_takes_each_rows_key_by_its_id():
    handle = io.StringIO()
    writer = PredictionWriter(handle, "csv", ["a", "b"], 1, False, ["entropy"], "path")
    writer.write(["2", "1"], np.array([[0.25, 0.75], [0.9, 0.1]]), {"entropy": np.ones(2)},
                 None, RowKeys("path", {"1": "x/1.png", "2": "x/2.png", "3": "x/3.png"}))
    assert handle.getvalue().splitlines() == ["id,path,label,confidence,entropy",
                                              "2,x/2.png,b,0.75,1.0", "1,x/1.png,a,0.9,1.0"]


def test_an_image_tables_path_column_is_its_id(digits_bundle, tmp_path):
    folder = write_image_folder(tmp_path / "imgs", classes=(3, 7), per_class=3)
    paths = sorted(str(p.relative_to(tmp_path)) for p in folder.rglob("*.png"))
    source = write_rows(tmp_path / "new.csv", "note,picture", [f"n{k},{p}"
                                                              for k, p in enumerate(paths)])
    out = tmp_path / "preds.jsonl"
    run = predict(digits_bundle["model"], source, out, "--image_column", "picture")
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert list(lines[0]) == ["id", "picture", "label", "confidence"]
    assert [line["picture"] for line in lines] == paths  # as written in the table
    run = predict(digits_bundle["model"], folder, tmp_path / "folder.csv", "--id_column", "x")
    assert_clean_failure(run, 2, "--id_column names a column of a table --input")


@pytest.mark.xdist_group("ray")  # a Ray cluster of the machine's CPUs, as tests/test_ray.py's
def test_ray_writes_the_id_column_as_the_local_engine(tabular_bundle, tmp_path):
    import pandas as pd
    from test_ray import assert_same_predictions, both_engines

    frame = pd.DataFrame(feature_rows(per_class=100, seed=4)).drop(columns="kind")
    frame.insert(1, "order_id", [f"o{k:04d}" for k in range(len(frame))])
    frame.loc[7, "weight"] = "heavy"  # an error row
    data = tmp_path / "new.parquet"
    frame.to_parquet(data, row_group_size=100)  # 3 row groups: read by several tasks
    local, ray, _ = both_engines(tabular_bundle["model"], tmp_path, data, ".csv",
                                 "--id_column", "order_id", "--chunk_rows", "64")
    preds = assert_same_predictions(local, ray)
    assert list(preds.columns) == ["id", "order_id", "label", "confidence"]
    expected = [f"o{k:04d}" for k in range(len(frame)) if k != 7]
    assert list(preds["order_id"]) == expected
    assert list(preds["id"]) == [str(k + 1) for k in range(len(frame)) if k != 7]


@pytest.mark.parametrize("chunk_rows", [7, 4096])
@pytest.mark.parametrize("key, spec", [("id", None), ("record_id", None), ("i", "i")])
def test_the_columnar_parquet_path_carries_the_id_column_as_the_row_frames(tmp_path, chunk_rows,
                                                                           key, spec):
    """An all-numeric Parquet table keeps its columnar path with an id column (by name, or a
    numeric feature named by --id_column) and gives the row frames' keys, all-empty rows and
    row groups included."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from test_columnar import FEATURES, manifest_of, messy_table, read_chunks

    table = messy_table(90)
    if key != "i":
        cells = [None if k % 11 == 0 else f"k{k:03d}" for k in range(table.num_rows)]
        table = table.append_column(key, pa.array(cells) if key == "id" else
                                    pa.array([k * 3 for k in range(table.num_rows)]))
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=40)
    flags = {"id_column": spec} if spec else {}
    columnar, used = read_chunks(path, manifest_of(FEATURES), True, chunk_rows, **flags)
    frames, _ = read_chunks(path, manifest_of(FEATURES), False, chunk_rows, **flags)
    assert used
    assert [(c.keys.name, c.keys.values) for c in columnar] == \
        [(c.keys.name, c.keys.values) for c in frames]
    assert columnar[0].keys.name == key and len(columnar[0].keys.values) > 0
