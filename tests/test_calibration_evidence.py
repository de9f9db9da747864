"""Temperature only on evidence (issue 41): a fitted T is kept at 1 when its 90% bootstrap
interval contains 1 or that of its validation NLL gain does not lie above 0, and the manifest,
the report's verdict and the summary say so; --calibrate temperature_always applies it anyway;
bundles written before the decision still read (applied when T != 1)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import copy_bundle, edit_manifest, run_cli
from ttc.reporting.summary import format_calibration
from ttc.serving.manifest import Calibration
from ttc.testtime.calibrate import (RULES, TemperatureFit, calibrate_scores, calibration_section,
                                    decide, softmax)

DECISION_KEYS = ("applied", "reason", "rule", "fitted_temperature", "temperature_interval_90",
                 "nll_gain_interval_90")


def calibrated_scores(n: int = 1500, classes: int = 4, seed: int = 0
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Logits and labels drawn from softmax(logits): calibrated as they are (T = 1 is right)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2.0, (n, classes))
    p = softmax(logits)
    y = np.array([rng.choice(classes, p=row) for row in p])
    return logits, y


def graph_outputs(bundle: dict) -> tuple[np.ndarray, np.ndarray]:
    """model.onnx's logits and probabilities on the bundle's test split."""
    from ttc.inputs.data import load_bundle_dataset
    from ttc.serving.bundle import BundlePaths, read_manifest
    import onnxruntime as ort

    from ttc.serving.runtime import session_feeder

    manifest = read_manifest(BundlePaths.from_model_path(bundle["model"]))
    x = load_bundle_dataset(manifest, manifest.dataset.fields["path"], ("test",), False).test.x
    session = ort.InferenceSession(str(bundle["model"]), providers=["CPUExecutionProvider"])
    logits, probabilities = session.run(["logits", "probabilities"], session_feeder(session)(x))
    return np.asarray(logits, np.float64), np.asarray(probabilities, np.float64)


def test_t_kept_at_1_when_the_interval_contains_1():
    logits, y = calibrated_scores()
    fit = calibrate_scores(logits, y, "evidence")
    low, high = fit.interval
    assert low <= 1.0 <= high and fit.fitted != 1.0
    assert fit.applied is False and fit.temperature == 1.0  # what every graph bakes
    assert f"[{low:.3f}, {high:.3f}]" in fit.reason and "contains 1" in fit.reason
    entry = fit.manifest_entry()
    assert entry["applied"] is False and entry["temperature"] == 1.0
    assert entry["fitted_temperature"] == fit.fitted and entry["rule"] == "evidence"
    assert len(entry["nll_gain_interval_90"]) == 2
    # the same scores under --calibrate temperature_always: the fitted T, applied
    always = calibrate_scores(logits, y, RULES["temperature_always"])
    assert always.applied is True and always.temperature == always.fitted == fit.fitted
    assert "temperature_always" in always.reason and "contains 1" in always.reason


def test_t_applied_when_the_scores_are_three_times_too_sharp():
    logits, y = calibrated_scores()
    fit = calibrate_scores(logits * 3, y, "evidence")
    assert fit.applied is True and fit.temperature == fit.interval[0] < fit.fitted
    assert abs(fit.temperature - 3) / 3 < 0.1, fit.temperature
    assert fit.interval[0] > 1 and fit.gain_interval[0] > 0
    assert "excludes 1" in fit.reason and "lies above 0" in fit.reason


def test_an_nll_gain_interval_that_holds_0_keeps_t_at_1():
    """T's interval may exclude 1 while the validation NLL gain's does not lie above 0: no
    evidence either. A Laplace fit (no validation errors) is judged the same way: its gain lies
    above 0 only for a T < 1."""
    def fit(method: str, t: float, interval: list, gain: list | None) -> TemperatureFit:
        return TemperatureFit(t, method, 800, 3 if method == "nll" else 0, 0.05, 0.049,
                              interval=interval, gain_interval=gain, fitted=t)

    kept = decide(fit("nll", 1.4, [1.1, 1.7], [-0.0004, 0.0030]), "evidence")
    assert (kept.applied, kept.temperature) == (False, 1.0)
    assert "NLL gain" in kept.reason and "[-0.0004, +0.0030]" in kept.reason
    # applied at the end of T's interval nearest 1 (calibrate.cautious)
    assert decide(fit("nll", 1.4, [1.1, 1.7], [0.0010, 0.0030]), "evidence").temperature == 1.1
    softer = decide(fit("laplace", 1.4, [1.1, 1.7], [-0.04, -0.02]), "evidence")
    assert not softer.applied and "no answer in it is wrong" in softer.reason
    sharper = decide(fit("laplace", 0.5, [0.4, 0.7], [0.01, 0.02]), "evidence")
    assert sharper.applied and sharper.temperature == 0.7
    assert decide(fit("laplace", 1.4, [1.1, 1.7], [-0.04, -0.02]), "always").temperature == 1.4


def test_verdict_and_summary_say_when_and_why_t_was_not_applied():
    logits, y = calibrated_scores(600, seed=1)
    fit = calibrate_scores(logits, y, "evidence")
    assert not fit.applied
    raw = softmax(logits)
    section = calibration_section(fit.manifest_entry(), raw, raw, y, seed=0)
    assert section["applied"] is False and section["temperature"] == 1.0
    assert section["fitted_temperature"] == fit.fitted and section["reason"] == fit.reason
    assert section["verdict"].startswith("temperature not applied, T kept at 1: ")
    assert fit.reason in section["verdict"]
    text = "\n".join(format_calibration(section))
    assert f"1 (not applied; fitted {fit.fitted:.4f}" in text
    assert fit.reason in text  # the verdict line says why (the gains: in the reason, if they are)


def test_a_manifest_entry_from_before_the_decision_reads_as_applied():
    """No `applied`, `rule` or `fitted_temperature`: applied when T != 1 (the rule of the
    time), not applied for --calibrate none."""
    old = Calibration.from_dict({"temperature": 0.62, "method": "nll", "samples": 269})
    assert (old.applied, old.fitted_temperature, old.rule) == (True, 0.62, "always")
    assert old.report_entry()["applied"] is True
    nulls = Calibration.from_dict({"temperature": 0.62, "method": "nll", "applied": None,
                                   "fitted_temperature": None, "rule": None})
    assert (nulls.applied, nulls.fitted_temperature, nulls.rule) == (True, 0.62, "always")
    none = Calibration.from_dict({"temperature": 1.0, "method": "none"})
    assert (none.applied, none.fitted_temperature) == (False, None)


def test_a_bundle_records_its_decision_and_an_older_one_still_serves(text_bundle, tmp_path):
    """A session bundle (default --calibrate temperature): the manifest records the decision,
    the graph bakes T only where applied, the report repeats it; the same bundle with the
    decision's keys removed (as written before issue 41) serves, its T read as applied."""
    manifest = json.loads(text_bundle["model"].with_suffix(".json").read_text())
    entry = manifest["calibration"]
    assert set(DECISION_KEYS) <= set(entry) and entry["rule"] == "evidence"
    assert entry["temperature"] == (entry["fitted_temperature"] if entry["applied"] else 1.0)
    logits, probabilities = graph_outputs(text_bundle)
    np.testing.assert_allclose(probabilities, softmax(logits, entry["temperature"]), atol=1e-6)
    section = text_bundle["report"]["calibration"]
    assert section["applied"] == entry["applied"] and section["reason"] == entry["reason"]
    if not entry["applied"]:  # the graph is softmax(logits): before and after agree
        assert section["ece_before"] == pytest.approx(section["ece_after"], abs=1e-6)
        assert section["verdict"].startswith("temperature not applied")

    model = copy_bundle(text_bundle, tmp_path / "old")
    old = json.loads(model.with_suffix(".json").read_text())
    for key in ("applied", "reason", "rule", "fitted_temperature", "nll_gain_interval_90"):
        old["calibration"].pop(key)
    model.with_suffix(".json").write_text(json.dumps(old))
    out = tmp_path / "old.json"
    run = run_cli("inference.py", "--model", model, "--dataset_path",
                  text_bundle["dir"] / "texts.csv", "--report_json", out, "--plots", "none")
    assert run.returncode == 0, run.stderr[-3000:]
    again = json.loads(out.read_text())["calibration"]
    assert again["applied"] is (entry["temperature"] != 1.0)
    assert again["fitted_temperature"] == entry["temperature"] and again["rule"] == "always"


def test_an_unapplied_temperature_other_than_1_is_refused(text_bundle, tmp_path):
    model = copy_bundle(text_bundle, tmp_path / "bad")
    edit_manifest(model, lambda m: m["calibration"].update(applied=False, temperature=2.5))
    run = run_cli("inference.py", "--model", model, "--plots", "none")
    assert run.returncode == 4 and "calibration.applied is false" in run.stderr, \
        run.stderr[-2000:]
