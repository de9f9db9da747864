"""Tent over LayerNorm: a network without BatchNorm (--arch transformer) is adapted through the
LayerNorm affine parameters of model.onnx, in pipeline.py and inference.py (--input too); bn is
refused alone and reported not applicable beside tent; the text corruptions of --eval_shift."""
from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import assert_clean_failure, pipeline_bundle, run_cli, topic_texts

SHIFTS = "unknown_tokens,token_deletion"


def write_texts(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("text,label\n" + "".join(f'"{t}",{label}\n' for t, label in rows))
    return path


@pytest.fixture(scope="module")
def transformer(tmp_path_factory) -> dict:
    """A transformer trained on topic_texts() by pipeline.py with tent under both text shifts."""
    out = tmp_path_factory.mktemp("tent_ln")
    data = write_texts(out / "texts.csv", topic_texts(per_class=60))
    return pipeline_bundle(out, "--model_type", "text_classifier", "--dataset_path", data,
                           "--arch", "transformer", "--epochs", "6", "--num_threads", "1",
                           "--ttt", "true", "--ttt_method", "tent", "--eval_shift", SHIFTS)


def session_of(model: onnx.ModelProto | bytes | str) -> ort.InferenceSession:
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"])


def token_ids(manifest, rows: list[tuple[str, str]]) -> np.ndarray:
    from ttc.inputs.preprocess import Tokenizer

    return Tokenizer.from_manifest(manifest.preprocessing.spec).encode_batch([t for t, _ in rows])


def test_pipeline_runs_tent_over_layernorm_under_text_shifts(transformer):
    report, out = transformer["report"], transformer["dir"]
    ttt = report["ttt"]
    assert ttt["method"] == "tent" and ttt["not_applicable"] == {}
    assert [s["name"] for s in ttt["shifts"]] == ["unknown_tokens", "token_deletion"]
    for row in [ttt["clean"], *ttt["shifts"]]:
        assert 0 <= row["accuracy_tent"] <= 1 and row["cost_ratio_tent"] > 0
        assert row["accuracy_bn"] is None and row["cost_ratio_bn"] is None
    assert ttt["resets"] == {"tent": 0}
    assert "unknown_tokens (severity 3)" in transformer["run"].stdout
    # no BatchNorm, so no adaptation graph: tent adapts model.onnx's 5 LayerNorm layers
    manifest = json.loads((out / "model.json").read_text())
    assert "bn" not in manifest["files"] and not (out / "model.bn.onnx").exists()
    assert "tent adapts the 5 LayerNorm/GroupNorm layers" in transformer["run"].stderr


def test_layernorm_parameters_fed_into_the_graph_give_the_adapted_network(transformer):
    """Defaults reproduce model.onnx; Tent's parameters change the probabilities, lower their
    entropy, and equal the adapted PyTorch network's, so each reached its own layer."""
    import torch

    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.reporting.metrics import entropy
    from ttc.nets.models import WithProbabilities
    from ttc.testtime.ttt import AdaptationGraph, Tent

    paths = BundlePaths.from_model_path(transformer["model"])
    manifest = read_manifest(paths)
    graph = AdaptationGraph(onnx.load(str(paths.onnx)), session_of)
    assert graph.normalisation == "LayerNorm" and len(graph.layers) == 5
    assert "LayerNorm" in graph.not_applicable["bn"]
    x = token_ids(manifest, topic_texts(per_class=22, seed=3))
    plain = session_of(str(paths.onnx)).run(["probabilities"], {"token_ids": x})[0]
    defaults, stats = graph.run(x, 0.0, {})
    np.testing.assert_allclose(defaults, plain, atol=1e-6)
    assert stats == {}

    tent = Tent(manifest, paths.weights, graph.layers, learning_rate=0.02, steps=3)
    params = tent.adapt(x)
    assert set(params) == {n for layer in graph.layers for n in (layer.scale, layer.bias)}
    adapted, _ = graph.run(x, 0.0, params)
    assert np.abs(adapted - plain).max() > 1e-3
    assert entropy(adapted).mean() < entropy(plain).mean()
    with torch.no_grad():
        expected = WithProbabilities(tent.net.eval(), manifest.calibration.temperature)(
            torch.from_numpy(x))[1].numpy()
    np.testing.assert_allclose(adapted, expected, atol=1e-5)
    tent.reset()
    np.testing.assert_array_equal(graph.run(x, 0.0, tent.parameters())[0], defaults)


def test_online_tent_starts_each_run_from_the_bundle(transformer):
    """Online adaptation carries over within a run (and across the calls sharing a carry), but a
    run with a fresh carry, such as each case of --eval_shift, starts from the bundle's
    parameters: the same data gives the same predictions twice."""
    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.testtime.ttt import AdaptationGraph, OnlineCarry, Tent, adapt_and_predict

    paths = BundlePaths.from_model_path(transformer["model"])
    manifest = read_manifest(paths)
    graph = AdaptationGraph(onnx.load(str(paths.onnx)), session_of)
    tent = Tent(manifest, paths.weights, graph.layers, learning_rate=0.005, steps=1)
    x = token_ids(manifest, topic_texts(per_class=22, seed=5))
    first = adapt_and_predict(graph, "tent", x, 32, "online", 0, 0, tent).probabilities
    again = adapt_and_predict(graph, "tent", x, 32, "online", 0, 0, tent).probabilities
    np.testing.assert_array_equal(first, again)
    carry = OnlineCarry()  # one carry over two calls: the second goes on from the first
    adapt_and_predict(graph, "tent", x, 32, "online", 0, 0, tent, carry)
    going_on = adapt_and_predict(graph, "tent", x, 32, "online", 0, 0, tent, carry).probabilities
    assert np.abs(going_on - first).max() > 1e-4


def test_layers_pair_by_name_and_a_mismatch_is_exit_4(transformer):
    from dataclasses import replace

    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.nets.models import load_weights
    from ttc.testtime.ttt import AdaptationGraph, paired_norm_modules
    from utils import ExportError

    paths = BundlePaths.from_model_path(transformer["model"])
    net = load_weights(read_manifest(paths), paths.weights)
    layers = AdaptationGraph(onnx.load(str(paths.onnx)), session_of).layers
    reversed_layers = layers[::-1]  # named: paired by name whatever the order
    assert paired_norm_modules(net, reversed_layers) == paired_norm_modules(net, layers)[::-1]
    unnamed = [replace(layer, exported_scale=f"anonymous{k}")
               for k, layer in enumerate(reversed_layers)]  # in order: the values disagree
    with pytest.raises(ExportError, match="differ from model.pt's"):
        paired_norm_modules(net, unnamed)
    with pytest.raises(ExportError, match="model.pt has 5 LayerNorm/GroupNorm layers"):
        paired_norm_modules(net, layers[:4])


def two_layer_norms_sharing_parameters() -> onnx.ModelProto:
    """x → LayerNormalization → LayerNormalization → Softmax, both nodes fed by the same scale
    and bias initializers, as onnxslim leaves layers whose parameters are equal."""
    inits = [numpy_helper.from_array(np.array([1.0, 2.0, 0.5], np.float32), "scale"),
             numpy_helper.from_array(np.array([0.1, -0.2, 0.3], np.float32), "bias")]
    nodes = [helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["h"], axis=-1),
             helper.make_node("LayerNormalization", ["h", "scale", "bias"], ["logits"], axis=-1),
             helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1)]
    graph = helper.make_graph(
        nodes, "two_ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_shared_layernorm_parameters_get_a_copy_per_layer():
    from ttc.testtime.ttt import AdaptationGraph

    model = two_layer_norms_sharing_parameters()
    graph = AdaptationGraph(model, session_of)
    first, second = graph.layers
    assert len({first.scale, second.scale, first.bias, second.bias}) == 4
    x = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)
    defaults, _ = graph.run(x, 0.0, {})
    np.testing.assert_allclose(defaults, session_of(model).run(None, {"x": x})[0], atol=1e-6)
    # the second layer's scale alone, as in a plain graph where only that layer changed
    new_scale = np.array([3.0, 0.2, 1.0], np.float32)
    fed, _ = graph.run(x, 0.0, {second.scale: new_scale})
    expected_model = copy.deepcopy(model)
    expected_model.graph.initializer.append(numpy_helper.from_array(new_scale, "scale2"))
    expected_model.graph.node[1].input[1] = "scale2"
    np.testing.assert_allclose(fed, session_of(expected_model).run(None, {"x": x})[0], atol=1e-6)
    assert np.abs(fed - defaults).max() > 1e-2


def test_ttt_method_all_reports_bn_not_applicable(transformer):
    run = run_cli("inference.py", "--model", transformer["model"], "--dataset_path",
                  transformer["dir"] / "texts.csv", "--ttt", "true",
                  "--ttt_method", "all", "--eval_shift", "unknown_tokens", "--num_threads", "1",
                  "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    ttt = json.loads(run.stdout)["ttt"]
    assert ttt["method"] == "all"
    assert ttt["not_applicable"] == {
        "bn": "the network has no BatchNorm layers (its normalisation is LayerNorm)"}
    for row in [ttt["clean"], *ttt["shifts"]]:
        assert row["accuracy_bn"] is None and row["accuracy_tent"] is not None
    assert ttt["mean_shifted"]["accuracy_bn"] is None
    assert ttt["resets"] == {"tent": 0}
    assert "bn does not apply: the network has no BatchNorm layers" in ttt["verdict"]


def test_ttt_method_bn_without_batchnorm_exits_2(transformer, tmp_path):
    line = ("--ttt_method bn re-estimates BatchNorm statistics, and --arch transformer has none "
            "(its normalisation is LayerNorm); use --ttt_method tent")
    run = run_cli("inference.py", "--model", transformer["model"], "--ttt", "true")  # bn: default
    assert_clean_failure(run, 2, line)
    data = write_texts(tmp_path / "texts.csv", topic_texts(per_class=5))
    run = run_cli("pipeline.py", "--model_type", "text_classifier", "--dataset_path", data,
                  "--arch", "transformer", "--ttt", "true", "--ttt_method", "bn",
                  "--output_model", tmp_path / "m.onnx")
    assert_clean_failure(run, 2, line)
    assert not (tmp_path / "m.onnx").exists()


def decompose_layer_norms(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with every LayerNormalization spelled out in primitive ops (as an exporter
    without the op writes it): the same predictions, and no LayerNorm node left to adapt."""
    out = copy.deepcopy(model)
    graph = out.graph
    graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), "ln_axes"))
    nodes = []
    for k, node in enumerate(graph.node):
        if node.op_type != "LayerNormalization":
            nodes.append(node)
            continue
        (x, scale, bias), y, p = node.input, node.output[0], f"ln{k}_"
        epsilon = next(a.f for a in node.attribute if a.name == "epsilon")
        graph.initializer.append(numpy_helper.from_array(np.array(epsilon, np.float32), p + "eps"))
        make = helper.make_node
        nodes += [make("ReduceMean", [x, "ln_axes"], [p + "mean"]),
                  make("Sub", [x, p + "mean"], [p + "centred"]),
                  make("Mul", [p + "centred", p + "centred"], [p + "squares"]),
                  make("ReduceMean", [p + "squares", "ln_axes"], [p + "var"]),
                  make("Add", [p + "var", p + "eps"], [p + "var_eps"]),
                  make("Sqrt", [p + "var_eps"], [p + "std"]),
                  make("Div", [p + "centred", p + "std"], [p + "normed"]),
                  make("Mul", [p + "normed", scale], [p + "scaled"]),
                  make("Add", [p + "scaled", bias], [y])]
    del graph.node[:]
    graph.node.extend(nodes)
    return out


def test_a_graph_with_neither_batchnorm_nor_layernorm_exits_2(transformer, tmp_path):
    for name in ("model.json", "model.pt"):
        shutil.copy(transformer["dir"] / name, tmp_path / name)
    model = tmp_path / "model.onnx"
    onnx.save(decompose_layer_norms(onnx.load(str(transformer["model"]))), str(model))
    manifest = json.loads((tmp_path / "model.json").read_text())
    manifest["files"]["sha256"]["onnx"] = hashlib.sha256(model.read_bytes()).hexdigest()
    (tmp_path / "model.json").write_text(json.dumps(manifest))
    plain = run_cli("inference.py", "--model", model, "--dataset_path",
                    transformer["dir"] / "texts.csv", "--report_json", "-")
    assert plain.returncode == 0, plain.stderr[-2000:]  # the graph itself still serves
    assert json.loads(plain.stdout)["inference"]["accuracy"] == pytest.approx(
        transformer["report"]["inference"]["accuracy"])
    run = run_cli("inference.py", "--model", model, "--dataset_path",
                  transformer["dir"] / "texts.csv", "--ttt", "true", "--ttt_method", "tent")
    assert_clean_failure(run, 2, "no BatchNorm layers and no LayerNorm or GroupNorm",
                         "without --ttt")


def predictions(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_inference_input_runs_tent_episodic_and_online(transformer, tmp_path):
    """--input with tent: the predictions move away from the plain graph's; online adaptation
    carries over from chunk to chunk (the same predictions whatever the chunk size) and so
    differs from episodic."""
    data = write_texts(tmp_path / "new.csv", topic_texts(per_class=32, seed=11))
    tent = ["--ttt", "true", "--ttt_method", "tent", "--ttt_learning_rate", "0.02",
            "--ttt_iterations", "2", "--batch_size", "32"]
    runs = {"plain": [], "episodic": tent,
            "online, chunks of 32": [*tent, "--ttt_mode", "online", "--chunk_rows", "32"],
            "online, at once": [*tent, "--ttt_mode", "online"]}
    outputs = {}
    for name, flags in runs.items():
        out = tmp_path / f"{name}.jsonl"
        run = run_cli("inference.py", "--model", transformer["model"], "--input", data,
                      "--output", out, "--top_k", "3", "--num_threads", "1", "--quiet", "true",
                      *flags)
        assert run.returncode == 0, run.stderr[-2000:]
        outputs[name] = predictions(out)
    assert len(outputs["episodic"]) == len(outputs["plain"]) == 96

    def confidences(name: str) -> np.ndarray:
        return np.array([row["confidence"] for row in outputs[name]])

    assert np.abs(confidences("episodic") - confidences("plain")).max() > 1e-3
    assert outputs["online, chunks of 32"] == outputs["online, at once"]
    assert outputs["online, at once"][32:] != outputs["episodic"][32:]
    assert outputs["online, at once"][:32] == outputs["episodic"][:32]  # the first batch alike


@pytest.mark.parametrize("name", ["unknown_tokens", "token_deletion"])
def test_text_corruptions_keep_padding_and_grow_with_severity(name):
    from ttc.inputs.shifts import corrupt

    pre = {"kind": "text", "pad_id": 0, "unk_id": 1}
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 20, 200)
    x = np.where(np.arange(24) < lengths[:, None], rng.integers(2, 500, (200, 24)), 0)
    changed = []
    for severity in (1, 5):
        out = corrupt(x, name, severity, pre, seed=0)
        assert out.shape == x.shape and out.dtype == x.dtype
        real = out != 0
        assert (real.sum(1) >= 1).all() and (real.sum(1) <= lengths).all()
        assert not (np.diff(real.astype(int), axis=1) > 0).any()  # padding only at the right
        changed.append(float((out != x).mean()))
    np.testing.assert_array_equal(corrupt(x, name, 3, pre, 0), corrupt(x, name, 3, pre, 0))
    assert 0 < changed[0] < changed[1]
    if name == "token_deletion":  # what is left keeps its order: a subsequence of the text
        out = corrupt(x, name, 3, pre, seed=0)
        for row, source in zip(out[:20], x[:20]):
            kept, it = row[row != 0], iter(source)
            assert all(token in it for token in kept)
