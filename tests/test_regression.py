"""`--model_type tabular_regressor` through the CLIs (issue 67): one pipeline run on a tiny
learnable table (y linear in its features plus small noise; --interval 0.9, --quantize dynamic)
whose bundle the other tests read with ONNX Runtime, inference.py and serve.py; the target
errors and flags a regressor refuses, each with its exit code."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from conftest import assert_clean_failure, heavy_modules_after, run_cli
from test_serve import serving
from utils import EXIT_DATA, EXIT_USAGE

ROWS = 200


def linear_table(path: Path, rows: int = ROWS, seed: int = 0) -> Path:
    """y = 100 + 30 a - 20 b + 5 c + N(0, 3²): learnable, in units far from 0 and 1."""
    rng = np.random.default_rng(seed)
    a, b, c = rng.uniform(-2, 2, rows), rng.uniform(-2, 2, rows), rng.uniform(0, 10, rows)
    y = 100 + 30 * a - 20 * b + 5 * c + rng.normal(0, 3, rows)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["a", "b", "c", "y"])
        writer.writerows(zip(a.round(4), b.round(4), c.round(4), y.round(3)))
    return path


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("regress")
    data = linear_table(root / "linear.csv")
    model = root / "run" / "model.onnx"
    run = run_cli("pipeline.py", "--model_type", "tabular_regressor", "--dataset_path", data,
                  "--epochs", "3", "--interval", "0.9", "--quantize", "dynamic",
                  "--iterative", "mc_dropout", "--iterations", "8", "--tta", "true",
                  "--ttt", "true", "--output_model", model, "--report_json", root / "report.json",
                  "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    return {"data": data, "root": root, "model": model, "run": run,
            "manifest": json.loads(model.with_suffix(".json").read_text()),
            "report": json.loads((root / "report.json").read_text())}


def rows_of(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_the_manifest_records_the_target_and_its_interval(bundle):
    manifest = bundle["manifest"]
    assert manifest["model_type"] == "tabular_regressor" and manifest["labels"] == ["y"]
    assert manifest["outputs"] == [{"name": "prediction", "shape": ["batch"], "dtype": "float32"}]
    target = manifest["preprocessing"]["target"]
    assert target["name"] == "y" and 100 < target["mean"] < 160 and target["std"] > 10
    interval = manifest["preprocessing"]["interval"]
    assert interval["level"] == 0.9 and interval["radius"] > 0
    assert interval["calibration_rows"] == bundle["report"]["dataset"]["calibration"] > 0


def test_the_graph_answers_in_the_target_s_units(bundle):
    session = ort.InferenceSession(str(bundle["model"]), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["prediction"]
    x = np.array([[0, 0, 5], [1, -1, 2], [-2, 2, 9]], dtype=np.float32)
    prediction = session.run(None, {"features": x})[0]
    assert prediction.shape == (3,) and prediction.dtype == np.float32
    truth = 100 + 30 * x[:, 0] - 20 * x[:, 1] + 5 * x[:, 2]
    spread = bundle["manifest"]["preprocessing"]["target"]["std"]
    assert np.abs(prediction - truth).max() < spread  # standardisation undone in the graph


def test_the_report_scores_rmse_against_the_mean_of_train(bundle):
    report = bundle["report"]
    evaluation = report["evaluation"]
    assert {"mae", "rmse", "r2", "baseline", "verdict"} <= set(evaluation)
    assert set(evaluation["baseline"]) >= {"mae", "rmse", "r2"}
    assert evaluation["r2"] > 0.5 and evaluation["rmse"] < evaluation["baseline"]["rmse"]
    assert evaluation["verdict"].startswith("useful")
    assert abs(evaluation["baseline"]["r2"]) < 0.2  # the mean of train explains nothing
    assert evaluation["interval"]["level"] == 0.9 and 0 <= evaluation["interval"]["coverage"] <= 1
    assert report["train"]["metric"] == "rmse" and report["train"]["val_rmse"] > 0
    assert report["export"]["max_abs_diff"] < 1e-4
    assert "R²" in bundle["run"].stdout and "verdict" in bundle["run"].stdout


def test_int8_is_judged_by_rmse(bundle):
    quantize = bundle["report"]["quantize"]
    assert quantize["metric"] == "rmse_skill"
    assert quantize["test_metrics"]["rmse"] > 0 and quantize["test_metrics"]["rmse_fp32"] > 0
    std = bundle["manifest"]["preprocessing"]["target"]["std"]
    assert quantize["accuracy_fp32"] == pytest.approx(
        1 - quantize["test_metrics"]["rmse_fp32"] / std, abs=1e-6)


def test_inference_input_writes_a_prediction_and_its_interval_per_row(bundle, tmp_path):
    source = rows_of(bundle["data"])[:5]
    given = tmp_path / "new.csv"
    with open(given, "w", newline="") as handle:
        writer = csv.DictWriter(handle, ["a", "b", "c"])
        writer.writeheader()
        writer.writerows({k: row[k] for k in "abc"} for row in source)
    out = tmp_path / "predictions.csv"
    run = run_cli("inference.py", "--model", bundle["model"], "--input", given, "--output", out,
                  "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-2000:]
    written = rows_of(out)
    assert list(written[0]) == ["id", "prediction", "lower", "upper"]
    session = ort.InferenceSession(str(bundle["model"]), providers=["CPUExecutionProvider"])
    x = np.array([[float(row[k]) for k in "abc"] for row in source], dtype=np.float32)
    expected = session.run(None, {"features": x})[0]
    got = np.array([float(row["prediction"]) for row in written])
    assert np.allclose(got, expected, atol=1e-4)
    radius = bundle["manifest"]["preprocessing"]["interval"]["radius"]
    assert np.allclose([float(r["upper"]) - float(r["lower"]) for r in written], 2 * radius,
                       atol=1e-4)


def test_inference_input_imports_neither_torch_nor_dspy(bundle, tmp_path):
    """The regressor's batch inference is the lean path: ONNX Runtime and the bundle only."""
    given = tmp_path / "new.csv"
    given.write_text("a,b,c\n0,0,5\n1,-1,2\n")
    assert heavy_modules_after("inference.py", "--model", bundle["model"], "--input", given,
                               "--output", tmp_path / "predictions.csv") == []


def test_serve_answers_the_prediction_per_row(bundle, tmp_path):
    with serving(bundle["model"], logs=tmp_path) as server:
        answers = server.predict([{"a": 0, "b": 0, "c": 5}, {"a": 1, "b": -1, "c": 2}])
        assert [set(a) for a in answers] == [{"prediction", "lower", "upper"}] * 2
        session = ort.InferenceSession(str(bundle["model"]), providers=["CPUExecutionProvider"])
        expected = session.run(None, {"features": np.array([[0, 0, 5], [1, -1, 2]],
                                                           dtype=np.float32)})[0]
        assert np.allclose([a["prediction"] for a in answers], expected, atol=1e-4)
        body = {"inputs": [{"name": name, "datatype": "FP64", "shape": [1], "data": [value]}
                           for name, value in (("a", 0.0), ("b", 0.0), ("c", 5.0))]}
        v2 = server.post("/v2/models/model/infer", body)
        assert v2.status_code == 200, v2.text
        outputs = {o["name"]: o for o in v2.json()["outputs"]}
        assert outputs["prediction"]["datatype"] == "FP32"
        assert outputs["prediction"]["data"][0] == pytest.approx(float(expected[0]), abs=1e-4)


def test_a_non_numeric_target_is_exit_3_naming_its_rows(bundle, tmp_path):
    lines = bundle["data"].read_text().splitlines()
    lines[3] = lines[3].rsplit(",", 1)[0] + ",high"
    lines[8] = lines[8].rsplit(",", 1)[0] + ",n/a"
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join(lines) + "\n")
    run = run_cli("train.py", "--model_type", "tabular_regressor", "--dataset_path", bad,
                  "--output_model", tmp_path / "m.onnx", "--epochs", "1")
    assert_clean_failure(run, EXIT_DATA, "non-numeric target", "rows 3, 8")


def test_a_missing_target_is_exit_3_naming_its_row(bundle, tmp_path):
    lines = bundle["data"].read_text().splitlines()
    lines[5] = lines[5].rsplit(",", 1)[0] + ","
    bad = tmp_path / "missing.csv"
    bad.write_text("\n".join(lines) + "\n")
    run = run_cli("train.py", "--model_type", "tabular_regressor", "--dataset_path", bad,
                  "--output_model", tmp_path / "m.onnx", "--epochs", "1")
    assert_clean_failure(run, EXIT_DATA, "missing target", "rows 5")


@pytest.mark.parametrize("flags, phrase", [
    (["--loss", "huber"], "--loss is for a tabular_regressor"),
    (["--interval", "0.9"], "--interval is for a tabular_regressor"),
])
def test_a_classifier_refuses_the_regressor_s_flags(tmp_path, flags, phrase):
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:iris", "--output_model", tmp_path / "m.onnx", *flags)
    assert_clean_failure(run, EXIT_USAGE, phrase)


@pytest.mark.parametrize("flags, phrase", [
    (["--interval", "1.5"], "--interval"),
    (["--ttt", "true", "--ttt_method", "tent"], "--ttt_method tent does not apply to a regressor"),
    (["--eval_shift", "feature_noise"], "--eval_shift does not apply to a regressor"),
])
def test_a_regressor_refuses_what_it_does_not_take(tmp_path, flags, phrase):
    run = run_cli("pipeline.py", "--model_type", "tabular_regressor", "--dataset_path",
                  "builtin:diabetes", "--output_model", tmp_path / "m.onnx", *flags)
    assert_clean_failure(run, EXIT_USAGE, phrase)


def test_a_table_with_no_signal_is_not_useful(tmp_path):
    rng = np.random.default_rng(1)
    noise = tmp_path / "noise.csv"
    with open(noise, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["a", "b", "y"])
        writer.writerows(zip(rng.normal(size=150).round(4), rng.normal(size=150).round(4),
                             rng.normal(50, 10, 150).round(3)))
    report = tmp_path / "report.json"
    run = run_cli("pipeline.py", "--model_type", "tabular_regressor", "--dataset_path", noise,
                  "--epochs", "2", "--output_model", tmp_path / "run" / "model.onnx",
                  "--report_json", report, "--no_progress", "true", "--plots", "none")
    assert run.returncode == 0, run.stderr[-2000:]
    evaluation = json.loads(report.read_text())["evaluation"]
    assert evaluation["verdict"].startswith("not useful") == (
        evaluation["r2"] <= 0 or evaluation["rmse"] >= evaluation["baseline"]["rmse"])


def test_the_report_names_a_number_s_figures(bundle):
    """The summary's rows say what a regressor's values are: the target (not classes), the
    prediction's largest ONNX difference (not a top-1 agreement), int8 judged by RMSE skill."""
    report, stdout = bundle["report"], bundle["run"].stdout
    dataset = report["dataset"]
    assert dataset["target"] == "y" and dataset["target_min"] < dataset["target_max"]
    assert report["export"]["top1_agreement"] is None
    assert report["export"]["max_abs_diff_target_units"] < 1e-2
    assert "target min (train)" in stdout and "max |onnx-torch| (units)" in stdout
    assert "val RMSE skill fp32" in stdout and "judged by" in stdout
    for wrong in ("classes   ", "top-1 agreement", "val accuracy"):
        assert wrong not in stdout, wrong


def test_mc_dropout_s_nominal_interval_is_set_beside_the_conformal_one(bundle):
    mc = bundle["report"]["evaluation"]["iterative"]
    evaluation = bundle["report"]["evaluation"]
    assert mc["mode"] == "mc_dropout" and mc["passes"] == 8 and mc["level"] == 0.9
    assert 0 <= mc["coverage"] <= 1 and mc["mean_width"] > 0 and mc["mean_std"] > 0
    assert mc["conformal_coverage"] == evaluation["interval"]["coverage"]
    assert ("under-covers" in mc["verdict"]) == (mc["coverage"] < 0.86)
    # the MC graph: Dropout kept, equal to model.onnx where ONNX Runtime drops it
    mc_path = bundle["model"].with_suffix(".mc.onnx")
    x = np.array([[0, 0, 5], [1, -1, 2], [-2, 2, 9]], dtype=np.float32)
    plain = ort.InferenceSession(str(bundle["model"]), providers=["CPUExecutionProvider"])
    folded = ort.InferenceSession(str(mc_path), providers=["CPUExecutionProvider"])
    expected = plain.run(None, {"features": x})[0]
    assert np.allclose(folded.run(None, {"features": x})[0], expected, atol=1e-3)
    sampling = ort.InferenceSession(str(mc_path), providers=["CPUExecutionProvider"],
                                    disabled_optimizers=["EliminateDropout"])
    draws = np.stack([sampling.run(None, {"features": x})[0] for _ in range(4)])
    assert draws.std(0).max() > 0  # dropout on: the passes differ


def test_tta_and_bn_adaptation_are_measured_against_the_plain_pass(bundle):
    evaluation = bundle["report"]["evaluation"]
    for key, name in (("tta", "TTA"), ("ttt", "BN adaptation")):
        method = evaluation[key]
        assert method["rmse_plain"] == pytest.approx(evaluation["rmse"])
        assert method["verdict"].startswith(f"{name} hurts") == (method["rmse"] >
                                                                 method["rmse_plain"])
        assert f"{name} " in bundle["run"].stdout
    assert evaluation["tta"]["views"] == 5 and evaluation["tta"]["merge"] == "mean"
    bn = onnx_nodes(bundle["model"].with_suffix(".bn.onnx"))
    assert evaluation["ttt"]["batchnorm_layers"] == bn.count("BatchNormalization") > 0


def onnx_nodes(path: Path) -> list[str]:
    import onnx

    return [node.op_type for node in onnx.load(str(path)).graph.node]


@pytest.fixture(scope="module")
def ensemble(bundle) -> dict:
    """Three members trained on the bundle's table (seeds 0, 1, 2, the same split), their
    spread reported beside the conformal interval; then MC-dropout on the same test split."""
    root = bundle["root"]
    model = root / "ensemble" / "model.onnx"
    run = run_cli("pipeline.py", "--model_type", "tabular_regressor", "--dataset_path",
                  bundle["data"], "--epochs", "3", "--interval", "0.9", "--ensemble_size", "3",
                  "--iterative", "ensemble", "--output_model", model, "--report_json",
                  root / "ensemble.json", "--no_progress", "true", "--plots", "none")
    assert run.returncode == 0, run.stderr[-3000:]
    return {"model": model, "run": run,
            "manifest": json.loads(model.with_suffix(".json").read_text()),
            "report": json.loads((root / "ensemble.json").read_text())}


def test_the_ensemble_graph_averages_its_members(ensemble):
    assert ensemble["manifest"]["extra_graphs"]["ensemble"]["members"] == 3
    x = np.array([[0, 0, 5], [1, -1, 2], [-2, 2, 9]], dtype=np.float32)
    merged = ort.InferenceSession(str(ensemble["model"].with_suffix(".ensemble.onnx")),
                                  providers=["CPUExecutionProvider"])
    mean, members = merged.run(["prediction", "member_predictions"], {"features": x})
    assert members.shape == (3, 3) and np.allclose(mean, members.mean(0), atol=1e-4)
    first = ort.InferenceSession(str(ensemble["model"]), providers=["CPUExecutionProvider"])
    assert np.allclose(members[0], first.run(None, {"features": x})[0], atol=1e-4)
    assert members.std(0).min() > 0  # other seeds: other networks


def test_the_ensemble_s_spread_is_set_beside_mc_dropout_and_the_conformal_interval(
        ensemble, bundle):
    evaluation = ensemble["report"]["evaluation"]
    spread = evaluation["iterative"]
    assert spread["mode"] == "ensemble" and spread["members"] == 3 and spread["level"] == 0.9
    assert 0 <= spread["coverage"] <= 1 and spread["mean_width"] > 0
    assert spread["rmse_plain"] == pytest.approx(evaluation["rmse"])
    assert spread["conformal_coverage"] == evaluation["interval"]["coverage"]
    assert spread["verdict"].startswith("The ensemble's nominal 90% interval covers")
    assert ("under-covers" in spread["verdict"]) == (spread["coverage"] < 0.86)
    assert "ensemble  " in ensemble["run"].stdout
    mc = bundle["report"]["evaluation"]["iterative"]  # the same table, split and level
    assert set(mc) - {"passes"} == set(spread) - {"members"}


def test_iterative_ensemble_needs_the_ensemble_graph_and_text_tta_is_refused(bundle, tmp_path):
    run = run_cli("inference.py", "--model", bundle["model"], "--dataset_path", bundle["data"],
                  "--iterative", "ensemble", "--no_progress", "true")
    assert_clean_failure(run, EXIT_USAGE, "--iterative ensemble needs the bundle's ensemble "
                         "graph", "--ensemble_size")
    run = run_cli("pipeline.py", "--model_type", "text_regressor", "--dataset_path",
                  "builtin:review_scores", "--output_model", tmp_path / "m.onnx", "--tta", "true")
    assert_clean_failure(run, EXIT_USAGE, "--tta does not apply to a text_regressor")
