"""Test-time training: the adaptation graph's statistics, Tent, episodic/online modes, the shift
suite, the bundle left untouched, and the CLIs."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import assert_clean_failure, heavy_modules_after, run_cli


def one_bn_model(features: int = 5, channels: int = 4, seed: int = 0) -> tuple[onnx.ModelProto,
                                                                               np.ndarray]:
    """x → MatMul W → BatchNormalization → logits → Softmax: the BN layer's input is x @ W."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((features, channels)).astype(np.float32)
    inits = [numpy_helper.from_array(weight, "w"),
             numpy_helper.from_array(rng.random(channels).astype(np.float32) + 0.5, "bn.weight"),
             numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "bn.bias"),
             numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32),
                                     "bn.running_mean"),
             numpy_helper.from_array(rng.random(channels).astype(np.float32) + 0.5,
                                     "bn.running_var")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("BatchNormalization", ["h", "bn.weight", "bn.bias",
                                                     "bn.running_mean", "bn.running_var"],
                              ["logits"], epsilon=1e-5),
             helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1)]
    graph = helper.make_graph(
        nodes, "one_bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", channels])
         for n in ("logits", "probabilities")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return model, weight


def session_of(model_bytes: bytes) -> ort.InferenceSession:
    return ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])


def test_adapted_statistics_equal_numpy_statistics_of_the_layer_input_and_patch_cleanly():
    from ttc.testtime.ttt import AdaptationGraph, patched_model

    model, weight = one_bn_model()
    graph = AdaptationGraph(model, session_of)
    x = np.random.default_rng(1).standard_normal((50, 5)).astype(np.float32) * 3 + 2
    layer_input = x @ weight
    probabilities, stats = graph.run(x, 0.0, {})
    np.testing.assert_allclose(stats["bn.running_mean"], layer_input.mean(0), atol=1e-4)
    np.testing.assert_allclose(stats["bn.running_var"], layer_input.var(0), atol=1e-4)
    # a prior of N samples blends: n/(n+N) of the batch, N/(n+N) of the stored statistics
    stored = numpy_helper.to_array(next(i for i in model.graph.initializer
                                        if i.name == "bn.running_mean"))
    _, blended = graph.run(x, 150.0, {})
    np.testing.assert_allclose(blended["bn.running_mean"],
                               0.25 * layer_input.mean(0) + 0.75 * stored, atol=1e-4)
    # the statistics written into the plain graph give the adapted predictions
    patched = session_of(patched_model(model, stats).SerializeToString())
    np.testing.assert_allclose(patched.run(["probabilities"], {"x": x})[0], probabilities,
                               atol=1e-5)
    unadapted = session_of(model.SerializeToString()).run(["probabilities"], {"x": x})[0]
    assert np.abs(unadapted - probabilities).max() > 1e-2  # adaptation changed something


def test_collapse_guard():
    from ttc.testtime.ttt import collapse_reason

    piled = np.tile([[0.97, 0.01, 0.01, 0.01]], (20, 1))
    spread = np.eye(4)[np.arange(20) % 4] * 0.9 + 0.025
    assert "one class" in collapse_reason(piled, lambda: spread)
    assert collapse_reason(piled, lambda: piled) is None  # the source model piles up too
    assert collapse_reason(spread, lambda: piled) is None
    certain = np.eye(4)[np.arange(20) % 4] * (1 - 4e-7) + 1e-7
    assert "entropy" in collapse_reason(certain, lambda: spread)


@pytest.mark.parametrize("name", ["gaussian_noise", "contrast", "blur", "shift", "brightness"])
def test_image_corruptions_keep_shape_and_range_and_grow_with_severity(name):
    from ttc.inputs.shifts import corrupt

    ramp = np.add.outer(np.arange(8), np.arange(8)) / 14
    x = (ramp * np.random.default_rng(2).uniform(0.3, 1, (64, 1, 1, 1))).astype(np.float32)
    changes = []
    for severity in (1, 5):
        out = corrupt(x, name, severity, {"kind": "image"}, seed=0)
        assert out.shape == x.shape and out.dtype == np.float32
        assert out.min() >= 0 and out.max() <= 1
        changes.append(float(np.abs(out - x).mean()))
    np.testing.assert_array_equal(corrupt(x, name, 3, {"kind": "image"}, 0),
                                  corrupt(x, name, 3, {"kind": "image"}, 0))  # seeded
    assert 0 < changes[0] < changes[1]


def test_tabular_corruptions_touch_numeric_features_only():
    from ttc.inputs.shifts import corrupt

    pre = {"kind": "tabular", "feature_names": ["a", "b", "c=x"], "std": [2.0, 0.5, 0.4],
           "columns": [{"name": "a", "type": "numeric"}, {"name": "b", "type": "numeric"},
                       {"name": "c", "type": "categorical", "categories": ["x"]}]}
    x = np.array([[1.0, np.nan, 1.0], [2.0, 3.0, 0.0]], dtype=np.float32)
    for name in ("feature_noise", "feature_scale"):
        out = corrupt(x, name, 3, pre, seed=0)
        assert np.isnan(out[0, 1]) and not np.allclose(out[:, 0], x[:, 0])
        np.testing.assert_array_equal(out[:, 2], x[:, 2])


@pytest.fixture(scope="module")
def adaptation(digits_bundle):
    from ttc.testtime.ttt import AdaptationGraph
    from ttc.serving.bundle import BundlePaths, read_manifest

    paths = BundlePaths.from_model_path(digits_bundle["model"])
    manifest = read_manifest(paths)
    graph = AdaptationGraph(onnx.load(str(paths.bn)), session_of)
    from sklearn.datasets import load_digits

    x = (load_digits().images[:128] / 16.0).astype(np.float32)[:, None]
    return paths, manifest, graph, x


def test_tent_lowers_entropy_and_episodic_mode_restores_the_outputs_exactly(adaptation):
    from ttc.reporting.metrics import entropy
    from ttc.testtime.ttt import Tent, adapt_and_predict
    from ttc.inputs.shifts import corrupt

    paths, manifest, graph, x = adaptation
    shifted = corrupt(x, "contrast", 3, {"kind": "image"}, 0)[:64]
    tent = Tent(manifest, paths.weights, graph.layers, learning_rate=0.01, steps=5)
    before, _ = graph.run(shifted, 0.0, {})
    after, _ = graph.run(shifted, 0.0, tent.adapt(shifted))
    assert entropy(after).mean() < entropy(before).mean()
    tent.reset()
    restored, _ = graph.run(shifted, 0.0, tent.parameters())
    np.testing.assert_array_equal(restored, before)
    # episodic: the same batches give the same outputs whatever ran before
    first = adapt_and_predict(graph, "tent", shifted, 32, "episodic", 0, 0, tent).probabilities
    adapt_and_predict(graph, "tent", x, 32, "online", 0, 0, tent)
    again = adapt_and_predict(graph, "tent", shifted, 32, "episodic", 0, 0, tent).probabilities
    np.testing.assert_array_equal(first, again)
    bn_first = adapt_and_predict(graph, "bn", shifted, 32, "episodic", 16, 0).probabilities
    bn_again = adapt_and_predict(graph, "bn", shifted, 32, "episodic", 16, 0).probabilities
    np.testing.assert_array_equal(bn_first, bn_again)
    online = adapt_and_predict(graph, "bn", shifted, 32, "online", 16, 0).probabilities
    np.testing.assert_array_equal(online[:32], bn_first[:32])  # the first batch starts alike
    assert not np.array_equal(online[32:], bn_first[32:])  # then the state carries over


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.is_file() and p.suffix in (".onnx", ".json", ".pt")}


def test_inference_ttt_all_reports_every_shift_and_leaves_the_bundle_untouched(digits_bundle):
    before = file_hashes(digits_bundle["dir"])
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--ttt", "true",
                  "--ttt_method", "all", "--eval_shift", "contrast,blur", "--ttt_mode", "online",
                  "--ttt_reset_every", "2", "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    assert file_hashes(digits_bundle["dir"]) == before
    ttt = json.loads(run.stdout)["ttt"]
    assert ttt["method"] == "all" and ttt["mode"] == "online" and ttt["severity"] == 3
    assert [(s["name"], s["severity"]) for s in ttt["shifts"]] == [("contrast", 3), ("blur", 3)]
    for row in [ttt["clean"], *ttt["shifts"]]:
        for key in ("accuracy_source", "accuracy_bn", "accuracy_tent"):
            assert 0 <= row[key] <= 1
        assert row["cost_ratio_bn"] > 0 and row["cost_ratio_tent"] > 0
    contrast = ttt["shifts"][0]
    assert contrast["accuracy_bn"] > contrast["accuracy_source"] + 0.2  # adaptation is real
    assert ttt["mean_shifted"]["accuracy_bn"] == pytest.approx(
        np.mean([s["accuracy_bn"] for s in ttt["shifts"]]))


def test_bn_path_of_inference_never_imports_torch(digits_bundle):
    assert heavy_modules_after("inference.py", "--model", digits_bundle["model"], "--ttt",
                               "true", "--eval_shift", "contrast", "--log_level",
                               "ERROR") == []


def copy_bundle(digits_bundle, target: Path) -> Path:
    for name in ("model.onnx", "model.json", "model.pt", "model.bn.onnx"):
        shutil.copy(digits_bundle["dir"] / name, target / name)
    return target / "model.onnx"


def test_a_graph_without_batchnorm_exits_2(digits_bundle, tmp_path):
    model = copy_bundle(digits_bundle, tmp_path)
    shutil.copy(model, tmp_path / "model.bn.onnx")  # the deployable graph: BatchNorm folded
    manifest = json.loads((tmp_path / "model.json").read_text())
    manifest["files"]["sha256"]["bn"] = hashlib.sha256(model.read_bytes()).hexdigest()
    (tmp_path / "model.json").write_text(json.dumps(manifest))
    run = run_cli("inference.py", "--model", model, "--ttt", "true")
    assert_clean_failure(run, 2, "no BatchNorm layers", "without --ttt")


def test_a_bundle_without_the_adaptation_graph_exits_4(digits_bundle, tmp_path):
    model = copy_bundle(digits_bundle, tmp_path)
    manifest = json.loads((tmp_path / "model.json").read_text())
    del manifest["files"]["bn"], manifest["files"]["sha256"]["bn"]
    (tmp_path / "model.json").write_text(json.dumps(manifest))
    run = run_cli("inference.py", "--model", model, "--ttt", "true")
    assert_clean_failure(run, 4, "no BatchNorm adaptation graph", "python export.py")


@pytest.mark.parametrize("args,phrase", [
    (["--eval_shift", "blurr"], "unknown --eval_shift corruption 'blurr'"),  # no --ttt needed
    (["--ttt", "true", "--eval_shift", "fog"], "unknown --eval_shift corruption 'fog'"),
    (["--ttt", "true", "--ttt_bn_prior", "-1"], "--ttt_bn_prior"),
    (["--ttt", "true", "--ttt_method", "sgd"], "--ttt_method"),
    (["--ttt", "true", "--shift_severity", "6"], "--shift_severity"),
    (["--ttt", "true", "--batch_size", "1"], "--batch_size"),
])
def test_bad_ttt_flags_exit_2(tmp_path, args, phrase):
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--output_model",
                  tmp_path / "m.onnx", *args)
    assert_clean_failure(run, 2, phrase)


def test_shifts_of_another_model_type_exit_2(tmp_path):
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:iris", "--output_model", tmp_path / "m.onnx", "--ttt", "true",
                  "--eval_shift", "blur")
    assert_clean_failure(run, 2, "for tabular models", "feature_noise")
    texts = tmp_path / "texts.tsv"
    texts.write_text("".join(f"good day {i}\tpos\nbad day {i}\tneg\n" for i in range(20)))
    run = run_cli("pipeline.py", "--model_type", "text_classifier", "--dataset_path", texts,
                  "--output_model", tmp_path / "t.onnx", "--ttt", "true", "--eval_shift", "blur")
    assert_clean_failure(run, 2, "unknown --eval_shift corruption 'blur' for text models",
                         "unknown_tokens, token_deletion")


def test_pipeline_tabular_ttt_under_feature_shift(wine_bundle):
    run, out = wine_bundle["run"], wine_bundle["dir"]  # --ttt true under two feature shifts
    assert "ttt:" in run.stdout and "feature_scale (severity 3)" in run.stdout
    manifest = json.loads((out / "model.json").read_text())
    assert manifest["extra_graphs"]["bn"]["batchnorm_layers"] == 2
    assert (out / "model.bn.onnx").is_file()
