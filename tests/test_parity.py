"""Training and serving read inputs through one implementation: pipeline.py with --test_path,
then inference.py --input on that same file, must give exactly the pipeline's own test
predictions and accuracy, for every model type (the test that would have caught the
train/serve skew of multi-column texts)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import FAST_TRAINING, pipeline_bundle, run_cli, write_image_folder

TOPICS = {"sport": ["match", "goal", "team", "coach", "league"],
          "tech": ["software", "chip", "robot", "code", "startup"],
          "money": ["market", "bank", "stocks", "profit", "budget"]}
FILLER = ["the", "a", "today", "report", "says", "new", "after", "week", "people", "city"]


def news_rows(n: int, seed: int) -> list[list[str]]:
    """(class, title, description) like a public news-topic CSV, headerless. The topic words
    sit in the title for half the rows and in the description for the other half, so a model
    served on one column alone gets half the rows wrong."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(n):
        topic = list(TOPICS)[k % 3]
        signal = " ".join(rng.choice(TOPICS[topic], 3))
        noise = lambda m: " ".join(rng.choice(FILLER, m))  # noqa: E731
        title, description = (signal, noise(8)) if k % 2 else (noise(3), f"{noise(5)} {signal}")
        rows.append([topic, title, description])
    return rows


def write_csv(path: Path, rows: list[list[str]], header: list[str] | None = None) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        if header:
            writer.writerow(header)
        writer.writerows(rows)
    return path


def training_path_predictions(model: Path) -> dict[str, str]:
    """The bundle's test split read and encoded by data.py (the training code), predicted by
    ONNX Runtime: {sample id: predicted label}."""
    import onnxruntime as ort

    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.inputs.data import load_bundle_dataset

    manifest = read_manifest(BundlePaths.from_model_path(model))
    recorded = manifest.dataset.fields  # the test's own data: a bundle's paths are never read alone
    test = load_bundle_dataset(manifest, recorded["path"], ("test",), False,
                               {"val": recorded["val_path"], "test": recorded["test_path"]}).test
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    predicted = np.concatenate([session.run(["probabilities"], {name: test.x[i:i + 1]})[0]
                                for i in range(len(test))]).argmax(1)
    return {ident: manifest.labels[k] for ident, k in zip(test.ids, predicted)}


def serve(bundle: dict, source: Path, tmp_path: Path, *flags: str) -> tuple[dict, dict]:
    """inference.py --input `source`: (its report, {id: predicted label})."""
    output = tmp_path / "preds.csv"
    run = run_cli("inference.py", "--model", bundle["model"], "--input", source, "--output",
                  output, "--json", "--no_progress", "true", *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(output, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    return json.loads(run.stdout), {row["id"]: row["label"] for row in rows}


def assert_same_predictions(bundle: dict, served: dict, report: dict, key) -> None:
    expected = training_path_predictions(bundle["model"])
    assert len(served) == len(expected)
    mismatched = [i for i, label in expected.items() if served[key(i)] != label]
    assert mismatched == [], f"{len(mismatched)} of {len(expected)} rows differ"
    assert report["predictions"]["accuracy"] == bundle["report"]["inference"]["accuracy"]


def row_id(training_id: str) -> str:
    """A table row's id in data.py ('path:0-based data row') as batch.py writes it (1-based)."""
    return str(int(training_id.rsplit(":", 1)[1]) + 1)


@pytest.fixture(scope="module")
def news_bundle(tmp_path_factory) -> dict:
    """A text model trained on title + description (columns 1,2 of a headerless CSV)."""
    folder = tmp_path_factory.mktemp("news")
    train = write_csv(folder / "news.csv", news_rows(240, seed=0))
    test = write_csv(folder / "news_test.csv", news_rows(60, seed=1))
    bundle = pipeline_bundle(folder / "run", "--model_type", "text_classifier",
                             "--dataset_path", train, "--test_path", test, "--label_column", "0",
                             "--text_column", "1,2", "--epochs", "8", "--no_progress", "true")
    return {**bundle, "test": test}


def test_multi_column_text_is_served_as_trained(news_bundle, tmp_path):
    manifest = json.loads(news_bundle["model"].with_suffix(".json").read_text())
    assert manifest["dataset"]["columns"] == {"label": "0", "inputs": ["1", "2"]}
    assert news_bundle["report"]["inference"]["accuracy"] > 0.9  # both columns carry the topic
    report, served = serve(news_bundle, news_bundle["test"], tmp_path)
    assert_same_predictions(news_bundle, served, report, row_id)


def test_texts_alone_map_onto_the_trained_columns(news_bundle, tmp_path):
    """A headerless file of just the two text columns (no label) is served as title +
    description, not as whichever column looks longest."""
    bundle = news_bundle
    rows = news_rows(60, seed=2)
    unlabeled = write_csv(tmp_path / "texts.csv", [row[1:] for row in rows])
    _, served = serve(bundle, unlabeled, tmp_path)
    right = np.array([served[str(k + 1)] == row[0] for k, row in enumerate(rows)])
    # the topic is in the title of the odd rows, in the description of the even ones: served on
    # one column alone, half the rows would fall to chance (1 in 3)
    assert right[1::2].mean() >= 0.75 and right[0::2].mean() >= 0.75, right


def mixed_table_rows(n: int, seed: int) -> list[list[str]]:
    """Numeric cells with missing markers ('NA', '?', ''), a categorical column most of whose
    categories look like numbers, and a label."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        size, plan = rng.normal(), str(rng.choice(["1", "2", "3", "gold"]))
        label = "big" if size + (plan in ("3", "gold")) > 0.5 else "small"
        cell = f"{size:.3f}" if rng.random() > 0.15 else str(rng.choice(["NA", "?", ""]))
        rows.append([cell, f"{rng.normal():.2f}", plan, label])
    return rows


def test_tabular_is_served_as_trained(tmp_path):
    header = ["size", "noise", "plan", "label"]
    train = write_csv(tmp_path / "t.csv", mixed_table_rows(300, seed=0), header)
    test = write_csv(tmp_path / "t_test.csv", mixed_table_rows(80, seed=1), header)
    bundle = pipeline_bundle(tmp_path / "run", "--model_type", "tabular_classifier",
                             "--dataset_path", train, "--test_path", test, *FAST_TRAINING)
    manifest = json.loads(bundle["model"].with_suffix(".json").read_text())
    plan = next(c for c in manifest["preprocessing"]["columns"] if c["name"] == "plan")
    assert plan == {"name": "plan", "type": "categorical",
                    "categories": ["1", "2", "3", "gold"]}
    report, served = serve(bundle, test, tmp_path)
    assert_same_predictions(bundle, served, report, row_id)


def test_image_folder_is_served_as_trained(tmp_path):
    root = write_image_folder(tmp_path / "digits", per_class=24, splits=True)
    bundle = pipeline_bundle(tmp_path / "run", "--dataset_path", root, *FAST_TRAINING)
    report, served = serve(bundle, root / "test", tmp_path)
    by_file = {Path(ident).name: label for ident, label in served.items()}
    assert_same_predictions(bundle, by_file, report, lambda ident: Path(ident).name)


@pytest.mark.parametrize("value, expected", [("1", "1"), ("1.0", "1"), (1.0, "1"), (" 2 ", "2"),
                                             ("-3.00", "-3"), ("1.5", "1.5"), ("NA", "NA"),
                                             ("", None), (None, None), (float("nan"), None)])
def test_one_label_rule(value, expected):
    from ttc.inputs.tables import label_text

    assert label_text(value) == expected


def test_training_and_serving_read_the_same_cells(tmp_path):
    """Whole-file reading (training) and chunked reading with typed numbers (serving) give the
    same cells, header and row numbers."""
    from ttc.inputs.tables import iter_table, read_table

    path = write_csv(tmp_path / "t.csv", mixed_table_rows(50, seed=3) + [["", "", "", ""]],
                     ["size", "noise", "plan", "label"])
    whole = read_table(path)
    chunks = list(iter_table(path, chunk_rows=7, numeric_columns=["size", "noise"]))
    assert [list(c.columns) for c in chunks] == [list(whole.columns)] * len(chunks)
    import pandas as pd

    joined = pd.concat(chunks)
    assert list(joined.index) == list(whole.index) and len(whole) == 50
    for column in ("plan", "label"):
        assert joined[column].tolist() == whole[column].tolist()
    from ttc.inputs.tables import numeric_cells

    for column in ("size", "noise"):
        typed, _ = numeric_cells(joined[column])
        parsed, _ = numeric_cells(whole[column])
        np.testing.assert_array_equal(typed, parsed)
