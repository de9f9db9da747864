"""The label-free shift score (ttc/testtime/shift_score.py): clean and shifted batches apart, its
report keys beside the TTT verdict, the clean-data summary line, and serve.py's drift gauge on
/metrics. Data and seeds other than bench/shift_score.py's (digits, seeds 0-2)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from conftest import run_cli
from test_serve import serving
from ttc.testtime.shift_score import (ShiftMonitor, ShiftReference, critical_distance,
                                      reference_record)


def confident(rng: np.random.Generator, rows: int, classes: int = 3, sharpness: float = 8.0
              ) -> np.ndarray:
    """Softmax probabilities of random logits: large `sharpness`, confident predictions."""
    logits = rng.normal(0, 1, (rows, classes)) * sharpness
    p = np.exp(logits - logits.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True)


def test_a_strong_shift_separates_and_a_clean_batch_does_not():
    rng = np.random.default_rng(11)
    reference = ShiftReference.of(reference_record(confident(rng, 400)))
    assert reference.samples == 256  # the quantiles kept
    clean = [reference.score(confident(rng, 64)) for _ in range(40)]
    shifted = [reference.score(confident(rng, 64, sharpness=0.7)) for _ in range(40)]
    threshold = reference.threshold(64)
    assert 0 < threshold <= critical_distance(64, 256)
    assert sum(s > threshold for s in clean) <= 2
    assert min(shifted) > max(clean) and all(s > threshold for s in shifted)


def test_the_monitor_scores_the_last_rows_served():
    rng = np.random.default_rng(12)
    monitor = ShiftMonitor(ShiftReference.of(reference_record(confident(rng, 300))), window=32)
    monitor.observe(confident(rng, 8))
    assert math.isnan(monitor.score)  # too few rows yet
    monitor.observe(confident(rng, 32))
    assert monitor.score < monitor.threshold
    monitor.observe(confident(rng, 32, sharpness=0.5))
    assert monitor.score > monitor.threshold


@pytest.fixture(scope="module")
def cancer_bundle(tmp_path_factory) -> dict:
    """breast_cancer with --ttt true and no --eval_shift: the clean-data verdict."""
    out = tmp_path_factory.mktemp("shift_cancer")
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:breast_cancer", "--seed", "7",
                  "--epochs", "6", "--ttt", "true", "--output_model", out / "model.onnx",
                  "--report_json", out / "report.json", "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    return {"model": out / "model.onnx", "run": run,
            "report": json.loads((out / "report.json").read_text())}


def test_the_report_and_summary_say_no_shift_was_seen_on_clean_data(cancer_bundle):
    shift = cancer_bundle["report"]["ttt"]["shift"]
    assert shift["available"] and shift["statistic"] == "scaled_entropy"
    assert {"threshold", "alpha", "batch_size", "reference_samples", "cases", "verdict"} <= set(
        shift)
    clean = shift["cases"][0]
    assert clean["name"] == "clean" and not clean["shift_seen"]
    assert {"batches", "flagged", "score_quantiles", "overall", "overall_threshold"} <= set(clean)
    summary = cancer_bundle["run"].stdout
    assert "shift score (KS distance" in summary
    verdict = next(line for line in summary.splitlines() if "verdict: bn" in line)
    assert "no shift seen on the test split" in verdict and "--eval_shift" in verdict


def test_inference_under_a_corruption_scores_it_higher_than_clean(cancer_bundle, tmp_path):
    """86 test rows and a reference of 40: the score rises, too little data to flag it."""
    report = tmp_path / "r.json"
    run = run_cli("inference.py", "--model", cancer_bundle["model"], "--ttt", "true",
                  "--eval_shift", "feature_noise", "--shift_severity", "5", "--seed", "3",
                  "--report_json", report)
    assert run.returncode == 0, run.stderr[-3000:]
    clean, noisy = json.loads(report.read_text())["ttt"]["shift"]["cases"]
    assert noisy["name"] == "feature_noise" and not clean["shift_seen"]
    assert noisy["overall"] > 1.5 * clean["overall"]


def test_metrics_expose_the_drift_gauge_after_a_request(cancer_bundle, tmp_path):
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    rows = [dict(zip(data.feature_names, map(float, x))) for x in data.data[:40]]
    with serving(cancer_bundle["model"], logs=tmp_path) as server:
        before = server.metrics()
        assert math.isnan(before[("ttc_shift_score", ())])
        server.predict(rows)
        after = server.metrics()
    assert 0 <= after[("ttc_shift_score", ())] <= 1
    reference = ShiftReference.of(json.loads(cancer_bundle["model"].with_suffix(".json")
                                             .read_text())["shift_reference"])
    assert after[("ttc_shift_threshold", ())] == pytest.approx(reference.threshold(64))
