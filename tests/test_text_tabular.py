"""Text and tabular classifiers through the CLIs, on messy files the tests write themselves."""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

from conftest import TABLE_TRAINING, assert_clean_failure, feature_rows, run_cli, topic_texts

TRAIN = [*TABLE_TRAINING, "--no_progress", "true"]


def pipeline(model_type, dataset, out, *extra, code=0):
    run = run_cli("pipeline.py", "--model_type", model_type, "--dataset_path", dataset,
                  "--output_model", out / "model.onnx", "--report_json", out / "report.json",
                  *TRAIN, *extra)
    assert run.returncode == code, run.stderr[-3000:]
    return run, json.loads((out / "report.json").read_text())


def session_and_manifest(out):
    manifest = json.loads((out / "model.json").read_text())
    return ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"]), manifest


def test_text_csv_with_header_bom_and_bad_rows(text_bundle):
    """text_bundle's CSV (conftest): topic_texts() with a BOM, a blank line and two bad rows."""
    run, report = text_bundle["run"], text_bundle["report"]
    assert report["dataset"]["dropped_rows"] == 2
    assert [(d["reason"], d["count"], d["first_rows"]) for d in report["dataset"]["dropped_reasons"]
            ] == [("missing label", 1, [6]), ("empty text", 1, [5])]  # 1-based data rows
    splits = ("train", "calibration", "val", "test")
    assert sum(report["dataset"][s] for s in splits) == len(topic_texts())
    warnings = [l for l in run.stderr.splitlines() if "WARNING" in l and "dropped 1 rows" in l]
    assert len(warnings) == 2 and "missing label (rows 6)" in warnings[0]
    assert "with 1 with missing label" not in run.stdout and "missing label in texts.csv (rows 6)" in run.stdout
    assert report["inference"]["accuracy"] >= 0.8
    assert report["export"]["padding_max_diff"] <= 1e-4
    assert set(report["export"]["probes"]) == {"held_out", "length_1", "padded"}

    from ttc.inputs.preprocess import Tokenizer

    session, manifest = session_and_manifest(text_bundle["dir"])
    assert manifest["labels"] == ["food", "sports", "weather"]
    assert manifest["input"] == {"name": "token_ids", "dtype": "int64",
                                 "shape": ["batch", "length"], "padding_id": 0}
    tokenizer = Tokenizer.from_manifest(manifest["preprocessing"])
    ids = tokenizer.encode_batch(["The storm and rain with snow", "Bake the garlic salad"])
    probs = session.run(["probabilities"], {"token_ids": ids})[0]
    assert [manifest["labels"][k] for k in probs.argmax(1)] == ["weather", "food"]
    padded = np.pad(ids, ((0, 0), (0, 9)))
    np.testing.assert_allclose(session.run(["probabilities"], {"token_ids": padded})[0], probs,
                               atol=1e-6)
    one = session.run(["probabilities"], {"token_ids": ids[:1, :1]})[0]
    assert one.shape == (1, 3)


def test_headerless_tsv_with_positional_and_joined_text_columns(tmp_path):
    rows = topic_texts(seed=1)
    body = "".join(f"{label}\t{t.split()[0]}\t{' '.join(t.split()[1:])}\n" for t, label in rows)
    (tmp_path / "t.tsv").write_text(body)
    _, report = pipeline("text_classifier", tmp_path / "t.tsv", tmp_path, "--label_column", "0",
                         "--text_column", "1,2")
    splits = ("train", "calibration", "val", "test")
    assert sum(report["dataset"][s] for s in splits) == len(rows)
    manifest = json.loads((tmp_path / "model.json").read_text())
    assert manifest["dataset"]["text_column"] == "1,2"
    assert report["inference"]["accuracy"] >= 0.8


def test_jsonl_with_a_given_test_file(tmp_path):
    rows = topic_texts(seed=2)
    write = lambda path, part: path.write_text(
        "".join(json.dumps({"message": t, "topic": label}) + "\n" for t, label in part))
    write(tmp_path / "train.jsonl", rows[:120])
    write(tmp_path / "test.jsonl", rows[120:])
    _, report = pipeline("text_classifier", tmp_path / "train.jsonl", tmp_path,
                         "--label_column", "topic", "--test_path", tmp_path / "test.jsonl")
    assert report["dataset"]["given_splits"] is True
    dataset = report["dataset"]
    assert dataset["test"] == 30
    assert dataset["train"] + dataset["calibration"] + dataset["val"] == 120
    assert report["inference"]["accuracy"] >= 0.8


def test_tabular_csv_with_categories_and_missing_values(tabular_bundle):
    """tabular_bundle's CSV (conftest): two numeric columns with missing cells, a categorical
    one, and the label named with --label_column."""
    assert tabular_bundle["report"]["inference"]["accuracy"] >= 0.85
    session, manifest = session_and_manifest(tabular_bundle["dir"])
    pre = manifest["preprocessing"]
    assert pre["feature_names"] == ["height", "weight", "color=blue", "color=green", "color=red"]
    assert manifest["input"]["name"] == "features" and manifest["input"]["shape"] == ["batch", 5]
    # A missing number (NaN) is imputed in the graph; an unseen category is all zeros.
    x = np.array([[np.nan, 5.0, 0, 0, 1], [3.0, 0.0, 0, 0, 0]], dtype=np.float32)
    probs = session.run(["probabilities"], {"features": x})[0]
    assert np.isfinite(probs).all() and [manifest["labels"][k] for k in probs.argmax(1)] == ["a", "b"]


def test_headerless_tabular_takes_the_last_column_as_label(tmp_path):
    rows = feature_rows(seed=3)
    (tmp_path / "f.csv").write_text("".join(f"{r['weight']},{r['color']},{r['kind']}\n" for r in rows))
    _, report = pipeline("tabular_classifier", tmp_path / "f.csv", tmp_path)
    manifest = json.loads((tmp_path / "model.json").read_text())
    assert manifest["labels"] == ["a", "b", "c"]
    assert [c["name"] for c in manifest["preprocessing"]["columns"]] == ["0", "1"]
    assert report["inference"]["accuracy"] >= 0.6


@pytest.mark.parametrize("name,floor", [("iris", 0.8), ("breast_cancer", 0.9)])
def test_builtin_tables(tmp_path, name, floor):
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  f"builtin:{name}", "--output_model", tmp_path / "m.onnx", "--report_json", "-",
                  "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report["inference"]["accuracy"] >= floor
    assert report["export"]["max_abs_diff"] <= 1e-4


def test_builtin_wine(wine_bundle):
    """builtin:wine is trained once, in conftest, for this and the tests of its optional stages."""
    report = wine_bundle["report"]
    assert report["dataset"]["path"] == "builtin:wine" and report["dataset"]["num_classes"] == 3
    assert report["inference"]["accuracy"] >= 0.85
    assert report["export"]["max_abs_diff"] <= 1e-4


def test_text_stage_clis_reuse_the_stored_tokenizer_and_split(tmp_path):
    # A headerless TSV: train.py detects the label (fewest values) and the text (longest) column
    # itself, and inference.py must find them again from the manifest.
    rows = topic_texts(seed=4)
    (tmp_path / "t.tsv").write_text("".join(f"{label}\t{text}\n" for text, label in rows))
    model = tmp_path / "b" / "model.onnx"
    common = ["--no_progress", "true"]
    train = run_cli("train.py", "--model_type", "text_classifier", "--dataset_path",
                    tmp_path / "t.tsv", "--output_model", model, *TABLE_TRAINING,
                    "--report_json", tmp_path / "train.json", *common)
    assert train.returncode == 0, train.stderr[-2000:]
    trained = json.loads((tmp_path / "train.json").read_text())
    assert trained["dataset"]["num_classes"] == 3
    export = run_cli("export.py", "--output_model", model, "--dataset_path", tmp_path / "t.tsv",
                     "--report_json", "-", *common)
    assert export.returncode == 0, export.stderr[-2000:]
    assert json.loads(export.stdout)["export"]["padding_max_diff"] <= 1e-4
    # One evaluation run with TTA also reports the plain accuracy on the re-derived split.
    infer = run_cli("inference.py", "--model", model, "--dataset_path", tmp_path / "t.tsv",
                    "--tta", "true", "--tta_transforms", "window:4,token_dropout:0.2",
                    "--report_json", "-", *common)
    assert infer.returncode == 0, infer.stderr[-2000:]
    report = json.loads(infer.stdout)
    assert report["dataset"]["model_type"] == "text_classifier"
    assert report["dataset"]["test"] == trained["dataset"]["test"] > 0  # the same split again
    assert report["inference"]["accuracy"] >= 0.8
    assert report["tta"]["transforms"] == ["window:4", "token_dropout:0.2"]
    wrong = run_cli("inference.py", "--model", model, "--tta", "true", "--tta_transforms", "hflip")
    assert_clean_failure(wrong, 2, "for text models")


def data_error(tmp_path, model_type, path, *phrases, extra=()):
    run = run_cli("pipeline.py", "--model_type", model_type, "--dataset_path", path,
                  "--output_model", tmp_path / "o" / "m.onnx", "--epochs", "1", *extra)
    assert_clean_failure(run, 3, *phrases)


def test_text_errors_exit_3(tmp_path):
    (tmp_path / "one.csv").write_text("text,label\nhello there,a\nhi again,a\nhey,a\n")
    data_error(tmp_path, "text_classifier", tmp_path / "one.csv", "1 class")
    (tmp_path / "cols.csv").write_text("text,label\nhello,a\nbye,b\n")
    data_error(tmp_path, "text_classifier", tmp_path / "cols.csv", "no column 'body'",
               "['text', 'label']", extra=["--text_column", "body"])
    (tmp_path / "empty.tsv").write_text("")
    data_error(tmp_path, "text_classifier", tmp_path / "empty.tsv", "empty.tsv")
    (tmp_path / "latin.csv").write_bytes("text,label\ncaf\xe9 au lait,a\nthé,b\n".encode("latin-1"))
    data_error(tmp_path, "text_classifier", tmp_path / "latin.csv", "not UTF-8")
    (tmp_path / "bad.json").write_text("[{\"text\": \"a\", ")
    data_error(tmp_path, "text_classifier", tmp_path / "bad.json", "cannot parse")


def test_tabular_errors(tmp_path):
    (tmp_path / "f.csv").write_text("a,b,label\n1,2,x\n3,4,y\n")
    data_error(tmp_path, "tabular_classifier", tmp_path / "f.csv", "no column 'zzz'",
               extra=["--feature_columns", "a,zzz"])
    run = run_cli("pipeline.py", "--model_type", "image_classifier", "--dataset_path",
                  "builtin:iris", "--output_model", tmp_path / "m.onnx")
    assert_clean_failure(run, 2, "tabular_classifier")
    data_error(tmp_path, "tabular_classifier", tmp_path, "is a folder")


def test_format_override_and_forced_header(tmp_path):
    """A .dat file read as CSV; a first row that looks like data declared a header."""
    rows = feature_rows(seed=5)
    first = "1.0,2.0,red,a\n"  # column names that look like a data row
    (tmp_path / "f.dat").write_text(first + "".join(",".join(r.values()) + "\n" for r in rows))
    _, report = pipeline("tabular_classifier", tmp_path / "f.dat", tmp_path,
                         "--dataset_format", "csv", "--has_header", "true")
    manifest = json.loads((tmp_path / "model.json").read_text())
    assert [c["name"] for c in manifest["preprocessing"]["columns"]] == ["1.0", "2.0", "red"]
    splits = ("train", "calibration", "val", "test")
    assert sum(report["dataset"][s] for s in splits) == len(rows)
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  tmp_path / "f.dat", "--output_model", tmp_path / "x.onnx")
    assert_clean_failure(run, 3, "--dataset_format")


def test_tabular_test_file_without_header_matches_columns_by_position(tabular_bundle):
    """tabular_bundle (conftest) was trained on a CSV with a header and a --test_path without."""
    report = tabular_bundle["report"]
    assert report["dataset"]["given_splits"] is True and report["dataset"]["test"] == 30
    assert report["inference"]["accuracy"] >= 0.8
