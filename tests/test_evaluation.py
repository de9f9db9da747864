"""The evaluation section (per-class figures, the majority-class baseline and its verdict) and the
training-health hint: against hand-computed numbers, on a deliberately useless run, on a good
one, and on labelled `inference.py --input` rows read in several chunks."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from conftest import run_cli
from ttc.reporting.evaluation import Tally, evaluation_section
from ttc.reporting.metrics import expected_calibration_error

# (true, predicted) pairs whose confusion matrix is [[3, 1, 0], [0, 2, 2], [1, 0, 1]]
PAIRS = [(0, 0)] * 3 + [(0, 1)] + [(1, 1)] * 2 + [(1, 2)] * 2 + [(2, 0), (2, 2)]


def one_hot_predictions(pairs, classes=3, confidence=0.8):
    y = np.array([t for t, _ in pairs])
    probabilities = np.full((len(pairs), classes), (1 - confidence) / (classes - 1))
    probabilities[np.arange(len(pairs)), [p for _, p in pairs]] = confidence
    return probabilities, y


def test_per_class_figures_match_a_hand_computed_confusion_matrix():
    probabilities, y = one_hot_predictions(PAIRS)
    tally = Tally(3).add(probabilities[:4], y[:4]).add(probabilities[4:], y[4:])  # two chunks
    section = evaluation_section(tally, ["a", "b", "c"], train_counts=[5, 10, 1])
    assert section["confusion_matrix"] == [[3, 1, 0], [0, 2, 2], [1, 0, 1]]
    rows = {row["label"]: row for row in section["per_class"]}
    expected = {"a": (3 / 4, 3 / 4, 3 / 4, 4), "b": (2 / 3, 2 / 4, 4 / 7, 4),
                "c": (1 / 3, 1 / 2, 2 / 5, 2)}
    for label, (precision, recall, f1, support) in expected.items():
        assert rows[label]["precision"] == pytest.approx(precision)
        assert rows[label]["recall"] == pytest.approx(recall)
        assert rows[label]["f1"] == pytest.approx(f1)
        assert rows[label]["support"] == support
    assert section["accuracy"] == pytest.approx(0.6)
    assert section["macro_f1"] == pytest.approx((3 / 4 + 4 / 7 + 2 / 5) / 3)
    assert section["balanced_accuracy"] == pytest.approx((3 / 4 + 1 / 2 + 1 / 2) / 3)
    assert section["top_confusions"] == [{"true": "b", "predicted": "c", "count": 2},
                                         {"true": "a", "predicted": "b", "count": 1},
                                         {"true": "c", "predicted": "a", "count": 1}]
    # the baseline answers the training split's majority class 'b': 4 of the 10 test rows
    assert (section["baseline_class"], section["baseline_source"]) == ("b", "train split")
    assert section["baseline_accuracy"] == pytest.approx(0.4)
    assert section["warnings"] == [] and section["verdict"].startswith("useful")
    assert section["ece"] == pytest.approx(expected_calibration_error(probabilities, y))
    assert section["ece"] == pytest.approx(0.2)  # confidence 0.8 everywhere, accuracy 0.6
    assert sum(section["reliability"]["count"]) == 10
    assert section["reliability"]["accuracy"][11] == pytest.approx(0.6)  # 0.8 is in (11/15, 12/15]


def test_a_model_that_never_predicts_a_class_or_ties_the_baseline_is_flagged():
    # always 'a': precision of 'b' and 'c' is 0 (never predicted), their recall 0
    probabilities, y = one_hot_predictions([(0, 0)] * 6 + [(1, 0)] * 3 + [(2, 0)])
    section = evaluation_section(Tally(3).add(probabilities, y), ["a", "b", "c"], [7, 2, 1])
    assert [row["precision"] for row in section["per_class"]] == [0.6, 0.0, 0.0]
    assert len(section["warnings"]) == 2
    assert "does not beat always answering the majority class 'a'" in section["warnings"][0]
    assert "recall 0 for 2 classes: 'b' (3 samples), 'c' (1 samples)" in section["warnings"][1]
    assert section["verdict"].startswith("NOT USEFUL")
    # beats the baseline by far, but one class is never recognised: still a warning
    probabilities, y = one_hot_predictions([(0, 0)] * 2 + [(1, 1)] * 6 + [(2, 0)] * 2)
    section = evaluation_section(Tally(3).add(probabilities, y), ["a", "b", "c"], [5, 3, 2])
    assert section["accuracy"] - section["baseline_accuracy"] == pytest.approx(0.6)
    assert len(section["warnings"]) == 1 and "recall 0 for 1 class: 'c'" in section["warnings"][0]
    # a bundle without the training split's class counts: the evaluated data's majority class
    section = evaluation_section(Tally(3).add(probabilities, y), ["a", "b", "c"], None)
    assert (section["baseline_class"], section["baseline_source"]) == ("b", "evaluated data")


@pytest.fixture(scope="module")
def useless_run(tmp_path_factory) -> dict:
    """A deliberately useless run: learning rate 1e-6 for one epoch."""
    out = tmp_path_factory.mktemp("useless")
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--output_model",
                  out / "model.onnx", "--report_json", out / "report.json", "--epochs", "1",
                  "--learning_rate", "1e-6", "--plots", "none", "--no_progress", "true")
    return {"dir": out, "run": run, "report": json.loads((out / "report.json").read_text())}


def test_a_useless_run_warns_and_still_exits_0(useless_run):
    run, report = useless_run["run"], useless_run["report"]
    assert run.returncode == 0, run.stderr[-2000:]  # a CI script reads the JSON
    evaluation = report["evaluation"]
    assert evaluation["accuracy"] < evaluation["baseline_accuracy"] + 0.01
    assert any("does not beat always answering the majority class" in w
               for w in evaluation["warnings"])
    assert evaluation["verdict"].startswith("NOT USEFUL")
    assert "WARNING" in run.stderr and "does not beat always answering" in run.stderr
    assert f"verdict                    {evaluation['verdict']}" in run.stdout
    hint = report["train"]["health"]["hint"]
    assert "at learning rate 1e-06" in hint and "--lr_candidates" in hint
    assert hint in run.stderr and hint in run.stdout
    # --plots none: no pictures, but the page beside the report
    assert report["plots"] == {} and not (useless_run["dir"] / "plots").exists()
    assert (useless_run["dir"] / "report.html").is_file()


def test_a_good_run_has_no_warning_and_no_hint(digits_bundle):
    report = digits_bundle["report"]
    assert report["evaluation"]["warnings"] == []
    assert report["evaluation"]["verdict"].startswith("useful")
    assert report["train"]["health"]["hint"] is None
    assert report["train"]["health"]["loss_end"] < report["train"]["health"]["loss_prior"]
    history = report["train"]["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    assert all(h["val_loss"] > 0 for h in history)
    assert "does not beat" not in digits_bundle["run"].stderr
    # the evaluation agrees with the inference stage's own accuracy, on the same test split
    assert report["evaluation"]["accuracy"] == pytest.approx(report["inference"]["accuracy"])
    assert report["evaluation"]["samples"] == report["dataset"]["test"]


def test_labelled_input_rows_are_evaluated_across_chunks(tabular_bundle, tmp_path):
    rows = [line.split(",") for line in
            (tabular_bundle["dir"] / "test.csv").read_text().splitlines()]
    new = tmp_path / "new.csv"
    new.write_text("height,weight,color,kind\n" + "".join(",".join(r) + "\n" for r in rows)
                   + "1.0,2.0,red,zebra\n")  # a label that is none of the classes
    preds = tmp_path / "preds.csv"
    run = run_cli("inference.py", "--model", tabular_bundle["model"], "--input", new, "--output",
                  preds, "--chunk_rows", "7", "--report_json", tmp_path / "inference.json")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "inference.json").read_text())
    with open(preds, newline="") as handle:
        written = [row for row in csv.DictReader(handle) if row["true_label"] != "zebra"]
    labels = report["evaluation"]["labels"]
    confusion = np.zeros((len(labels), len(labels)), int)
    for row in written:
        confusion[labels.index(row["true_label"]), labels.index(row["label"])] += 1
    assert report["evaluation"]["confusion_matrix"] == confusion.tolist()
    assert report["evaluation"]["split"] == "input" and report["evaluation"]["samples"] == len(rows)
    assert report["predictions"]["outside_classes"] == 1
    assert report["predictions"]["labeled"] == len(rows) + 1
    assert "evaluation:" in run.stdout and "macro-F1" in run.stdout
    # unlabelled input: no evaluation
    new.write_text("height,weight,color\n1.0,2.0,red\n")
    run = run_cli("inference.py", "--model", tabular_bundle["model"], "--input", new, "--output",
                  preds, "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout).get("evaluation") is None
