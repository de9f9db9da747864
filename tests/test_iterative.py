"""Iterative inference: MC-dropout and its backends, early stopping, ensembles, the state loop,
and the calibration metrics."""
from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ttc.testtime.calibrate import rescale, softmax
from conftest import assert_clean_failure, run_cli


def test_ece_and_abstention_match_hand_computations():
    from ttc.reporting.metrics import accuracy_at_coverage, expected_calibration_error, nll

    p = np.array([[0.95, 0.05], [0.58, 0.42], [0.3, 0.7], [0.55, 0.45]])
    y = np.array([0, 1, 1, 0])
    # 15 bins of 1/15: 0.95 (right) alone in (14/15, 1]; 0.58 (wrong) and 0.55 (right) in
    # (8/15, 9/15]; 0.7 (right) alone in (10/15, 11/15]
    expected = (abs(1 - 0.95) * 1 + abs(0.5 - (0.58 + 0.55) / 2) * 2 + abs(1 - 0.7) * 1) / 4
    assert expected_calibration_error(p, y) == pytest.approx(expected)
    assert nll(p, y) == pytest.approx(-np.mean(np.log([0.95, 0.42, 0.7, 0.55])))
    uncertainty = np.array([0.1, 0.9, 0.3, 0.5])  # abstain on sample 1 (wrong) at 75% coverage
    assert accuracy_at_coverage(p, y, uncertainty, coverage=0.75) == 1.0
    assert accuracy_at_coverage(p, y, uncertainty, coverage=1.0) == 0.75


def naive_ece(p, y, bins=15):
    confidence, correct = p.max(1), p.argmax(1) == y
    edges, total = np.linspace(0, 1, bins + 1), 0.0
    for lower, upper in zip(edges[:-1], edges[1:]):
        inside = (confidence > lower) & (confidence <= upper)
        if inside.any():
            total += abs(correct[inside].mean() - confidence[inside].mean()) * inside.mean()
    return total


def test_binned_ece_matches_the_bin_by_bin_formula_on_edges_too():
    from ttc.reporting.metrics import expected_calibration_error

    rng = np.random.default_rng(0)
    for classes in (2, 3, 10):
        p = rng.dirichlet(np.full(classes, 0.3), 500)
        p[:30, 0] = np.linspace(0, 1, 16)[-2:].repeat(15)  # confidences on bin edges
        p[:30, 1:] = (1 - p[:30, :1]) / (classes - 1)
        y = rng.integers(0, classes, 500)
        assert expected_calibration_error(p, y) == pytest.approx(naive_ece(p, y), abs=1e-12)


def test_ece_interval_and_verdict_tell_a_real_gain_from_noise():
    from ttc.testtime.iterative import calibration_row, calibration_verdict
    from ttc.reporting.metrics import ece_change_interval

    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 400)
    right = rng.random(400) < 0.8  # 80% accuracy
    predicted = np.where(right, y, 1 - y)
    def probs(confidence):
        p = np.full((400, 2), 1 - confidence)
        p[np.arange(400), predicted] = confidence
        return p
    overconfident, calibrated = probs(0.99), probs(0.8)
    assert ece_change_interval(overconfident, overconfident, y) == (0.0, 0.0)
    low, high = ece_change_interval(overconfident, calibrated, y)
    assert low < high < 0  # ECE 0.19 -> ~0: a gain the test split shows
    single = calibration_row("single", overconfident, y, 1, 1, 1)
    better = calibration_row("mc_dropout", calibrated, y, 4, 1, 16)
    assert calibration_verdict(single, better, (low, high), 400).startswith(
        f"mc_dropout lowers ECE {single['ece']:.4f} -> {better['ece']:.4f} (90% bootstrap")
    # the other way round: less well calibrated, and an underconfident single pass says why
    worse = calibration_verdict(better | {"variant": "single", "mean_confidence": 0.7},
                                single | {"variant": "mc_dropout"}, (-high, -low), 400)
    assert worse.startswith("mc_dropout is less well calibrated than a single pass")
    assert "already underconfident" in worse
    noise = calibration_verdict(single, single | {"variant": "ensemble"}, (-0.01, 0.01), 400)
    assert "no calibration gain this test split can detect" in noise


@pytest.fixture(scope="module")
def mc(digits_bundle):
    from sklearn.datasets import load_digits

    model = onnx.load(str(digits_bundle["dir"] / "model.mc.onnx"))
    x = (load_digits().images[:40] / 16.0).astype(np.float32)[:, None]
    return model, x


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    from ttc.testtime.iterative import MC_SESSION_ARGS

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"],
                                **MC_SESSION_ARGS)


def test_dropout_is_really_active_and_the_seed_reproduces(mc):
    from ttc.testtime.iterative import seeded_dropout

    model, x = mc
    first = session(seeded_dropout(model, 3))
    a, b = (first.run(["probabilities"], {"image": x})[0] for _ in range(2))
    assert np.abs(a - b).max() > 1e-3  # two passes differ
    again = session(seeded_dropout(model, 3)).run(["probabilities"], {"image": x})[0]
    np.testing.assert_array_equal(again, a)  # the same seed gives the same passes
    other = session(seeded_dropout(model, 4)).run(["probabilities"], {"image": x})[0]
    assert not np.array_equal(other, a)
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(*(plain.run(["probabilities"], {"image": x})[0]
                                    for _ in range(2)))  # default optimisations drop Dropout


def test_the_three_backends_agree(mc):
    from ttc.testtime.iterative import PASSES_OUTPUT, MCSampler, mc_model_for

    model, x = mc
    means = {}
    for backend in ("python", "batched", "loop"):
        graph = session(mc_model_for(backend, model, 48, 10, seed=0))
        if backend == "python":  # the passes from the logits, as ttc/testtime/iterative_method.mc_sampler takes them
            run = lambda b, g=graph: softmax(g.run(["logits"], {"image": b})[0])  # noqa: E731
        else:
            run = lambda b, g=graph: g.run([PASSES_OUTPUT], {"image": b})[0]  # noqa: E731
        passes = MCSampler(backend, 48, run)([x[:20], x[20:]])
        assert passes.probabilities.shape == (48, 40, 10) and passes.passes_used == 48
        means[backend] = passes.mean
    # the loop replays the python loop's random stream; batching draws other masks
    np.testing.assert_allclose(means["loop"], means["python"], atol=1e-5)
    assert np.abs(means["batched"] - means["python"]).max() < 0.1
    assert (means["batched"].argmax(1) == means["python"].argmax(1)).mean() >= 0.95


def test_early_stopping_stops(mc):
    from ttc.testtime.iterative import python_loop, seeded_dropout

    model, x = mc
    graph = session(seeded_dropout(model, 0))
    run = lambda b: graph.run(["probabilities"], {"image": b})[0]  # noqa: E731
    assert len(python_loop(run, x, 32, tol=0.5, patience=2)) == 3
    assert len(python_loop(run, x, 32, tol=1e-12, patience=2)) == 32
    assert len(python_loop(run, x, 32, tol=None, patience=2)) == 32


def test_inference_mc_dropout_report(digits_bundle):
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--iterative",
                  "mc_dropout", "--iterations", "8", "--iterative_backend", "python",
                  "--iterative_tol", "0.02", "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    iterative = json.loads(run.stdout)["iterative"]
    assert iterative["mode"] == "mc_dropout" and iterative["iterations"] == 8
    rows = {row["variant"]: row for row in iterative["rows"]}
    assert list(rows) == ["single", "single+T", "mc_dropout", "mc_dropout+T"]
    single, mc = rows["single"], rows["mc_dropout"]
    assert rows["mc_dropout+T"]["accuracy"] == mc["accuracy"]
    assert rows["mc_dropout+T"]["temperature"] == json.loads(digits_bundle["model"].with_suffix(
        ".json").read_text())["extra_graphs"]["mc"]["temperature"]
    assert 2 <= mc["passes_used"] <= 8 and mc["cost_ratio"] > 1
    for row in (single, mc):
        assert 0 <= row["ece"] <= 1 and row["nll"] > 0 and 0 <= row["accuracy"] <= 1
        assert row["accuracy_at_90_coverage"] >= row["accuracy"] - 0.02
    assert iterative["ece_change"] == pytest.approx(mc["ece"] - single["ece"])
    low, high = iterative["ece_change_interval_90"]
    assert low <= high and iterative["verdict"].startswith("mc_dropout ")
    assert "verdict: mc_dropout " in run_cli("inference.py", "--model", digits_bundle["model"],
                                             "--iterative", "mc_dropout", "--iterations", "4"
                                             ).stdout


def recurrent_bundle(digits_bundle, folder):
    """The digits bundle with a recurrent graph: probabilities = (state + model) / 2, and
    state_out = probabilities; after K passes from zeros: (1 − 2^−K) × the model's."""
    for name in ("model.json", "model.pt", "model.bn.onnx", "model.mc.onnx"):
        shutil.copy(digits_bundle["dir"] / name, folder / name)
    model = onnx.load(str(digits_bundle["model"]))
    graph = model.graph
    for node in graph.node:
        node.output[:] = ["inner_probabilities" if o == "probabilities" else o for o in node.output]
    graph.node.extend([
        helper.make_node("Add", ["inner_probabilities", "state"], ["summed"]),
        helper.make_node("Mul", ["summed", "half"], ["probabilities"]),
        helper.make_node("Identity", ["probabilities"], ["state_out"])])
    graph.initializer.append(onnx.numpy_helper.from_array(np.array(0.5, np.float32), "half"))
    graph.input.append(helper.make_tensor_value_info("state", TensorProto.FLOAT, ["batch", 10]))
    graph.output.append(helper.make_tensor_value_info("state_out", TensorProto.FLOAT,
                                                      ["batch", 10]))
    onnx.checker.check_model(model)
    path = folder / "model.onnx"
    onnx.save(model, str(path))
    manifest = json.loads((folder / "model.json").read_text())
    manifest["files"]["sha256"]["onnx"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (folder / "model.json").write_text(json.dumps(manifest))
    return path


def test_state_feedback_loop_iterates_the_state(digits_bundle, tmp_path):
    model = recurrent_bundle(digits_bundle, tmp_path)
    run = run_cli("inference.py", "--model", model, "--iterative", "state", "--iterations", "3",
                  "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    _, single, looped = json.loads(run.stdout)["iterative"]["rows"]  # single+T: the graph's
    assert looped["variant"] == "state_feedback" and looped["passes_used"] == 3
    assert looped["accuracy"] == single["accuracy"]  # the same argmax, scaled
    assert looped["mean_confidence"] / single["mean_confidence"] == pytest.approx(1.75, rel=1e-4)


def test_state_mode_needs_a_state_input(digits_bundle):
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--iterative", "state")
    assert_clean_failure(run, 5, "'state' input")


def test_pipeline_trains_an_ensemble_graph(wine_bundle):
    from sklearn.datasets import load_wine

    out = wine_bundle["dir"]  # trained with --ensemble_size 3
    iterative = wine_bundle["report"]["iterative"]
    assert iterative["mode"] == "ensemble" and [r["variant"] for r in iterative["rows"]] == [
        "single", "single+T", "ensemble", "ensemble+T"]
    assert iterative["rows"][2]["passes_used"] == 3
    manifest = json.loads((out / "model.json").read_text())
    assert manifest["extra_graphs"]["ensemble"]["members"] == 3
    ensemble = ort.InferenceSession(str(out / "model.ensemble.onnx"),
                                    providers=["CPUExecutionProvider"])
    # real wine rows from the three classes: random ones are so far out that every member is
    # certain, which would hide whether the members differ
    rows = load_wine().data[::40].astype(np.float32)
    mean, members = ensemble.run(["probabilities", "pass_probabilities"], {"features": rows})
    assert members.shape == (3, 5, 3)
    temperature = manifest["extra_graphs"]["ensemble"]["temperature"]  # after the average
    np.testing.assert_allclose(mean, rescale(members.mean(0), temperature), atol=1e-6)
    assert np.abs(members[0] - members[1]).max() > 1e-4  # different seeds, different members
    single = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(members[0], softmax(single.run(["logits"], {"features": rows})[0]),
                               atol=1e-5)  # member 1 is model.onnx, uncalibrated


def test_inference_ensemble_of_bundles(digits_bundle, tmp_path):
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--iterative", "ensemble",
                  "--ensemble", digits_bundle["model"], "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    single, _, ensemble = json.loads(run.stdout)["iterative"]["rows"]  # no ensemble+T: these
    assert ensemble["passes_used"] == 2 and ensemble["accuracy"] == single["accuracy"]  # merged
    for name in ("model.onnx", "model.json", "model.pt"):  # the same bundle, other labels
        shutil.copy(digits_bundle["dir"] / name, tmp_path / name)
    manifest = json.loads((tmp_path / "model.json").read_text())
    manifest["labels"] = [f"digit {label}" for label in manifest["labels"]]
    (tmp_path / "model.json").write_text(json.dumps(manifest))
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--iterative", "ensemble",
                  "--ensemble", tmp_path / "model.onnx")
    assert_clean_failure(run, 2, "other labels or preprocessing")


@pytest.mark.parametrize("args,phrase", [
    (["--iterative", "mc_dropout", "--iterative_tol", "0.01"], "--iterative_backend python"),
    (["--iterative", "bayes"], "--iterative"),
    (["--iterations", "0"], "--iterations"),
    (["--ensemble_size", "0"], "--ensemble_size"),
])
def test_bad_iterative_flags_exit_2(tmp_path, args, phrase):
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--output_model",
                  tmp_path / "m.onnx", *args)
    assert_clean_failure(run, 2, phrase)
