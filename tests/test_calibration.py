"""Temperature scaling (issue 21): the fit recovers a known temperature, falls back as documented
on a validation split without errors, never changes a prediction; every graph a bundle ships
bakes its temperature in (checked with onnxruntime against numpy); the report's calibration
section, with and without shift; bundles without a temperature still load."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ttc.testtime.calibrate import T_MAX, T_MIN, fit_temperature, rescale, softmax
from conftest import FAST_TRAINING, pipeline_bundle, run_cli


def sampled_labels(logits: np.ndarray, seed: int) -> np.ndarray:
    """Labels drawn from softmax(logits): these logits are perfectly calibrated for them."""
    rng = np.random.default_rng(seed)
    p = softmax(logits)
    return (p.cumsum(1) > rng.random((len(p), 1))).argmax(1)


@pytest.mark.parametrize("true_t", [1 / 3, 2.5])
def test_fit_recovers_a_known_temperature(true_t):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (20000, 10))
    y = sampled_labels(logits, 1)
    fit = fit_temperature(logits * true_t, y)  # divided by 3: T ≈ 1/3 brings them back
    assert fit.method == "nll"
    assert abs(fit.temperature - true_t) / true_t < 0.05, fit.temperature
    assert fit.nll_after < fit.nll_before


def test_no_errors_falls_back_to_the_accuracy_lower_bound():
    """NLL falls without end as T → 0 when every answer is right: T is set so that the mean
    confidence equals the one-sided 90% lower bound of the accuracy, 0.1 ** (1 / n) (before the
    calibration slice: Laplace's (n + 1) / (n + 2)), and the fit says so."""
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 1, (200, 5))
    logits[np.arange(200), rng.integers(0, 5, 200)] += 4
    y = logits.argmax(1)
    fit = fit_temperature(logits, y)
    assert fit.method == "lower_bound" and fit.errors == 0
    assert T_MIN < fit.temperature < T_MAX
    assert softmax(logits, fit.temperature).max(1).mean() == pytest.approx(0.1 ** (1 / 200), abs=1e-6)
    assert "no errors in 200" in fit.note and "lower bound" in fit.note


def test_empty_validation_split_fits_nothing():
    fit = fit_temperature(np.zeros((0, 3)), np.zeros(0, np.int64))
    assert (fit.temperature, fit.method) == (1.0, "none")


@pytest.mark.parametrize("temperature", [0.05, 0.3, 1.0, 4.0, 20.0])
def test_a_temperature_changes_no_prediction(temperature):
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 4, (500, 7))
    y = rng.integers(0, 7, 500)
    scaled = softmax(logits, temperature)
    assert (scaled.argmax(1) == logits.argmax(1)).all()
    averaged = softmax(logits[:250]) / 2 + softmax(logits[250:]) / 2
    assert (rescale(averaged, temperature).argmax(1) == averaged.argmax(1)).all()
    assert np.mean(scaled.argmax(1) == y) == np.mean(logits.argmax(1) == y)


# ----------------------------------------------------------------------------- the graphs


def bundle_test_inputs(bundle: dict) -> tuple[np.ndarray, dict]:
    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.inputs.data import load_bundle_dataset

    manifest = read_manifest(BundlePaths.from_model_path(bundle["model"]))  # an hf tokenizer too
    recorded = manifest.dataset.fields  # the test's own data: a bundle's path is never read alone
    data = load_bundle_dataset(manifest, recorded["path"], ("test",), False)
    return data.test.x[:64], manifest


def run_graph(path, x: np.ndarray, outputs: list[str]) -> list[np.ndarray]:
    from ttc.serving.runtime import session_feeder

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = session_feeder(session)(x)
    for i in session.get_inputs():
        if i.type == "tensor(float16)":
            feed[i.name] = feed[i.name].astype(np.float16)
    return [np.asarray(o, np.float64) for o in session.run(outputs, feed)]


SINGLE_PASS = {"onnx": 1e-6, "int8": 1e-6, "bn": 1e-6, "mc": 1e-6, "fp16": 2e-3}


@pytest.mark.parametrize("fixture", ["digits_bundle", "digits_int8_bundle", "wine_bundle",
                                     "hf_bundle", "hf_pad1_bundle"])
def test_every_graph_bakes_the_temperature(fixture, request):
    """probabilities == softmax(logits / T) in each single-pass graph (fp32, int8, fp16,
    BatchNorm adaptation, MC-dropout with dropout off), and the ensemble's == softmax(log(mean
    of its members) / T_ensemble)."""
    bundle = request.getfixturevalue(fixture)
    x, manifest = bundle_test_inputs(bundle)
    temperature = manifest.calibration.temperature
    assert manifest.calibration.method in ("nll", "lower_bound") and temperature != 1.0
    files = manifest.files
    checked = []
    for key, atol in SINGLE_PASS.items():
        if files.name(key):
            logits, probabilities = run_graph(bundle["dir"] / files.name(key), x,
                                              ["logits", "probabilities"])
            np.testing.assert_allclose(probabilities, softmax(logits, temperature), atol=atol,
                                       err_msg=key)
            checked.append(key)
    if files.name("ensemble"):
        members, probabilities = run_graph(bundle["dir"] / files.name("ensemble"), x,
                                           ["pass_probabilities", "probabilities"])
        ensemble_t = manifest.extra_graphs.ensemble.temperature
        assert ensemble_t != 1.0
        np.testing.assert_allclose(probabilities, rescale(members.mean(0), ensemble_t),
                                   atol=1e-6)
        np.testing.assert_allclose(members.sum(-1), 1, atol=1e-5)  # members stay uncalibrated
        checked.append("ensemble")
    assert "onnx" in checked and len(checked) >= 2, checked


def test_report_judges_the_temperature_on_the_test_split(digits_bundle):
    report, manifest = digits_bundle["report"], json.loads(
        digits_bundle["model"].with_suffix(".json").read_text())
    calibration = report["calibration"]
    assert calibration["temperature"] == manifest["calibration"]["temperature"]
    assert report["train"]["calibration"] == manifest["calibration"]
    assert calibration["accuracy_before"] == calibration["accuracy_after"] == \
        report["inference"]["accuracy"]
    assert calibration["ece_after"] == pytest.approx(report["evaluation"]["ece"])
    for key in ("ece", "nll"):
        low, high = calibration[f"{key}_change_interval_90"]
        assert low <= calibration[f"{key}_after"] - calibration[f"{key}_before"] <= high
    assert f"T = {calibration['temperature']:.3f}" in calibration["verdict"]


def test_eval_shift_compares_every_variant_without_ttt(digits_bundle, tmp_path):
    """--eval_shift with --iterative and no --ttt: accuracy, ECE and NLL of the single pass and
    MC-dropout, each without and with its temperature, per corruption; the MC average's
    temperature is the bundle's, fitted at export."""
    out = tmp_path / "shift.json"
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--iterative", "mc_dropout",
                  "--iterations", "4", "--eval_shift", "gaussian_noise,blur", "--report_json",
                  out, "--plots", "none")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    manifest = json.loads(digits_bundle["model"].with_suffix(".json").read_text())
    variants = ["single", "single+T", "mc_dropout", "mc_dropout+T"]
    assert [r["variant"] for r in report["iterative"]["rows"]] == variants
    mc_t = manifest["extra_graphs"]["mc"]["temperature"]
    assert report["iterative"]["rows"][3]["temperature"] == mc_t
    shifts = report["calibration"]["shifts"]
    assert [s["name"] for s in shifts] == ["gaussian_noise", "blur"]
    for shift in shifts:
        rows = {r["variant"]: r for r in shift["rows"]}
        assert list(rows) == variants
        assert rows["single"]["accuracy"] == rows["single+T"]["accuracy"]
        assert rows["single"]["ece"] != rows["single+T"]["ece"]
    assert report["calibration"]["under_shift"]["best"] in variants
    assert "best calibrated under shift:" in run.stdout  # the summary names it too
    assert report["ttt"] is None


def test_calibrate_none_and_a_bundle_from_before_calibration(tmp_path):
    """--calibrate none: softmax(logits) exactly, no Div in the graph. The same bundle without
    its manifest's calibration entry (as written before calibration existed) still serves."""
    bundle = pipeline_bundle(tmp_path / "plain", "--model_type", "tabular_classifier",
                             "--dataset_path", "builtin:iris", "--calibrate", "none",
                             "--plots", "none", *FAST_TRAINING)
    manifest_path = bundle["model"].with_suffix(".json")
    manifest = json.loads(manifest_path.read_text())
    assert manifest["calibration"]["method"] == "none"
    assert manifest["calibration"]["temperature"] == 1.0
    graph = onnx.load(str(bundle["model"]))
    assert not any(n.op_type == "Div" and "probabilities" in n.output for n in graph.graph.node)
    x, _ = bundle_test_inputs(bundle)
    logits, probabilities = run_graph(bundle["model"], x, ["logits", "probabilities"])
    np.testing.assert_allclose(probabilities, softmax(logits), atol=1e-6)
    assert "not calibrated" in bundle["report"]["calibration"]["verdict"]

    old = tmp_path / "old"
    shutil.copytree(bundle["dir"], old)
    manifest.pop("calibration")
    (old / "model.json").write_text(json.dumps(manifest))
    out = old / "again.json"
    run = run_cli("inference.py", "--model", old / "model.onnx", "--report_json", out,
                  "--iterative", "mc_dropout", "--iterations", "3")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["calibration"]["method"] == "none"
    assert "before calibration" in report["calibration"]["verdict"]
    assert [r["variant"] for r in report["iterative"]["rows"]] == ["single", "mc_dropout"]


def test_a_bad_temperature_in_a_manifest_is_refused(digits_bundle, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(digits_bundle["dir"], folder)
    manifest = json.loads((folder / "model.json").read_text())
    manifest["calibration"]["temperature"] = -1
    (folder / "model.json").write_text(json.dumps(manifest))
    run = run_cli("inference.py", "--model", folder / "model.onnx")
    assert run.returncode != 0 and "calibration.temperature" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_the_temperature_interval_narrows_with_more_validation_data():
    """fit_with_interval: a 90% bootstrap interval that holds the fitted T, and is wider on a
    split of 300 than on one of 5,000 (what a few validation errors cost)."""
    from ttc.testtime.calibrate import fit_with_interval

    rng = np.random.default_rng(4)
    logits = rng.normal(0, 3, (5000, 4))
    y = sampled_labels(logits, 5)
    widths = []
    for n in (300, 5000):
        fit = fit_with_interval(logits[:n] * 2, y[:n])
        low, high = fit.interval
        assert low <= fit.temperature <= high
        widths.append(high - low)
    assert widths[0] > 2 * widths[1]
    assert fit_with_interval(logits[:0], y[:0]).interval is None
