"""Quantization that explains itself: the per-layer diagnosis, automatic and manual exclusion of
nodes from int8, and quantize.py --diagnose on an existing bundle."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import REPO, assert_clean_failure, run_cli

pytestmark = pytest.mark.xdist_group("quantize_diagnosis")  # one worker builds the bundle

HOSTILE_NET = REPO / "tests" / "hostile_net.py"  # a --model_def file


@pytest.fixture(scope="module")
def hostile_bundle(tmp_path_factory):
    """builtin:digits on a network built to lose everything under full int8, quantized
    statically with --quantize_exclude auto."""
    out = tmp_path_factory.mktemp("hostile")
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--model_def",
                  f"{HOSTILE_NET}:build", "--epochs", "3", "--no_progress", "true",
                  "--quantize", "static", "--quantize_exclude", "auto", "--plots", "none",
                  "--output_model", out / "model.onnx", "--report_json", out / "report.json")
    assert run.returncode == 0, run.stderr[-3000:]
    return {"dir": out, "run": run, "report": json.loads((out / "report.json").read_text())}


def test_auto_exclusion_recovers_accuracy_and_reports_every_step(hostile_bundle):
    quantize, run = hostile_bundle["report"]["quantize"], hostile_bundle["run"]
    steps, exclusion = quantize["exclusion"]["steps"], quantize["exclusion"]
    # full int8 rounds the informative channels away: no better than the majority class
    assert not steps[0]["within_bound"] and steps[0]["excluded"] == []
    assert steps[0]["accuracy_val"] < steps[0]["accuracy_val_fp32"] - 0.3
    # the selection MatMul is the node the diagnosis names, and leaving it out is enough
    assert quantize["layers"] and steps[1]["excluded"] == ["node_matmul"]
    assert steps[1]["within_bound"]
    kept = steps[exclusion["kept_step"]]
    assert kept["within_bound"] and "node_matmul" in kept["excluded"]
    assert exclusion["excluded"] == kept["excluded"]
    for step in steps:
        assert step["latency_ms_p50"] > 0 and step["latency_ms_p50_fp32"] > 0
        assert step["within_bound"] == (step["accuracy_val_fp32"] - step["accuracy_val"] <= 0.01)
    # the written graph is the kept step's: its test accuracy is fp32's, and it has no
    # QuantizeLinear feeding the excluded node
    assert abs(quantize["accuracy"] - quantize["accuracy_fp32"]) <= 0.03
    graph = onnx.load(str(hostile_bundle["dir"] / "model.int8.onnx"))
    producers = {out: n.op_type for n in graph.graph.node for out in n.output}
    matmul = next(n for n in graph.graph.node if n.name == "node_matmul")
    assert all(producers.get(i) != "DequantizeLinear" for i in matmul.input)
    assert quantize["used_for_inference"] == (not quantize["problems"])
    assert "auto exclusion" in run.stdout and "node_matmul" in run.stdout
    assert "worst layers" in run.stdout
    page = (hostile_bundle["dir"] / "report.html").read_text()
    assert "automatic exclusion" in page
    assert "Worst layers" in page and page.count("node_matmul") >= len(steps) - 1


def test_auto_exclusion_falls_back_to_fp32_when_no_set_is_fast_enough(hostile_bundle, tmp_path):
    """Dynamic Conv runs as ConvInteger, about 4x slower than fp32 Conv here: within the bound,
    never faster, and its one node cannot be left out without leaving nothing in int8."""
    bundle = tmp_path / "b"
    shutil.copytree(hostile_bundle["dir"], bundle)
    run = run_cli("quantize.py", "--output_model", bundle / "model.onnx", "--quantize",
                  "dynamic", "--quantize_ops", "Conv", "--quantize_exclude", "auto",
                  "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    quantize = json.loads(run.stdout)["quantize"]
    assert quantize["op_types"] == ["Conv"]
    assert quantize["exclusion"]["steps"][0]["within_bound"]
    assert "not faster than fp32" in quantize["exclusion"]["outcome"]
    assert quantize["used_for_inference"] is False
    assert "inference uses fp32" in quantize["verdict"]
    manifest = json.loads((bundle / "model.json").read_text())
    assert manifest["quantization"]["used_for_inference"] is False


def test_manual_exclusion_and_diagnose_on_an_existing_bundle(hostile_bundle, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(hostile_bundle["dir"], bundle)
    run = run_cli("quantize.py", "--output_model", bundle / "model.onnx", "--quantize",
                  "static", "--quantize_exclude", "node_matmul", "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    quantize = json.loads(run.stdout)["quantize"]
    assert quantize["exclusion"] == {"requested": ["node_matmul"], "excluded": ["node_matmul"]}
    assert quantize["accuracy_val_fp32"] - quantize["accuracy_val"] <= 0.03
    assert "node_matmul" not in [row["node"] for row in quantize["layers"]]
    # --diagnose reads the graph on disk, quantizes nothing, and leaves the bundle as it was
    before = (bundle / "model.int8.onnx").read_bytes()
    diagnosed = run_cli("quantize.py", "--output_model", bundle / "model.onnx", "--diagnose",
                        "true", "--report_json", "-")
    assert diagnosed.returncode == 0, diagnosed.stderr[-2000:]
    section = json.loads(diagnosed.stdout)["quantize"]
    assert section["diagnosis_only"] is True and section["path"].endswith("model.int8.onnx")
    assert 1 <= len(section["layers"]) <= 10
    assert {"node", "op_type", "output", "sqnr_db", "noise_added"} <= set(section["layers"][0])
    assert (bundle / "model.int8.onnx").read_bytes() == before


def test_auto_op_set_tries_both_and_keeps_the_wider_only_where_the_judge_prefers_it(
        hostile_bundle, tmp_path):
    """Both op sets lose everything here (no exclusion): the default set is kept, and both
    trials are in the report with the figures the choice was made on."""
    bundle = tmp_path / "b"
    shutil.copytree(hostile_bundle["dir"], bundle)
    run = run_cli("quantize.py", "--output_model", bundle / "model.onnx", "--quantize", "static",
                  "--quantize_ops", "auto", "--quantize_exclude", "none", "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    quantize = json.loads(run.stdout)["quantize"]
    default, wider = quantize["op_sets"]
    assert default["op_types"] == ["Conv", "Gemm", "MatMul"]
    assert {"Relu", "Concat"} <= set(wider["op_types"]) and set(default["op_types"]) < set(
        wider["op_types"])
    assert not default["within_bound"] and not wider["within_bound"]
    assert default["kept"] and not wider["kept"]
    assert quantize["op_types"] == default["op_types"]
    assert quantize["used_for_inference"] is False


@pytest.mark.parametrize("default,wider,kept", [
    ((True, 1.10), (True, 1.30), 1),  # both pass, the wider 5% faster still
    ((True, 1.25), (True, 1.30), 0),  # both pass, within 5% of each other: the default set
    ((False, 0.95), (True, 1.10), 1),  # only the wider passes
    ((True, 1.10), (False, 2.00), 0),  # the wider loses accuracy
    ((False, 0.90), (False, 0.99), 0),  # neither: fp32 serves, the default set is reported
])
def test_the_op_set_choice(default, wider, kept):
    from ttc.compress.exclusion import ExclusionStep, OpSetTrial, choose_op_set
    from ttc.compress.judging import MIN_SPEEDUP

    def trial(within: bool, speedup: float) -> OpSetTrial:
        step = ExclusionStep([], 0.9 if within else 0.5, 0.9, 1.0 / speedup, 1.0,
                             within_bound=within, faster=speedup >= MIN_SPEEDUP)
        return OpSetTrial(["Conv"], None, [], {}, step)

    assert choose_op_set([trial(*default), trial(*wider)]) == kept


def test_exclusion_and_op_type_mistakes_are_one_line_errors(hostile_bundle, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(hostile_bundle["dir"], bundle)
    (bundle / "model.int8.onnx").unlink()
    manifest = json.loads((bundle / "model.json").read_text())
    run = run_cli("quantize.py", "--output_model", bundle / "model.onnx", "--quantize", "static",
                  "--quantize_exclude", "node_nonexistent")
    assert_clean_failure(run, 2, "--quantize_exclude names node_nonexistent", "node_matmul")
    run = run_cli("quantize.py", "--output_model", bundle / "model.onnx", "--quantize", "static",
                  "--quantize_ops", "Conv,Frobnicate")
    assert_clean_failure(run, 2, "--quantize_ops: Frobnicate cannot be quantized")
    del manifest["files"]["int8"]
    (bundle / "model.json").write_text(json.dumps(manifest))
    run = run_cli("quantize.py", "--output_model", bundle / "model.onnx", "--diagnose", "true")
    assert_clean_failure(run, 4, "int8")


# ----------------------------------------------------------------------------- the diagnosis

def mlp_graph(rng: np.random.Generator) -> onnx.ModelProto:
    """x → MatMul mm1 → Relu → MatMul mm2 → Relu → MatMul mm3 → y."""
    sizes = [12, 16, 16, 4]
    weights = [numpy_helper.from_array((rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
                                       f"w{k + 1}")
               for k, (a, b) in enumerate(zip(sizes, sizes[1:]))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"], name="mm1"),
             helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
             helper.make_node("MatMul", ["r1", "w2"], ["h2"], name="mm2"),
             helper.make_node("Relu", ["h2"], ["r2"], name="relu2"),
             helper.make_node("MatMul", ["r2", "w3"], ["y"], name="mm3")]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.mark.parametrize("sabotaged,expected", [
    ("w2_scale", "mm2"),  # mm2's weights rounded with a scale 30x too large
    ("r1_scale", "mm2"),  # mm2's input activation rounded with a scale 30x too large
    ("w3_scale", "mm3"),
])
def test_the_diagnosis_ranks_the_node_with_a_sabotaged_scale_first(tmp_path, sabotaged,
                                                                  expected):
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                          quantize_static)

    from ttc.convert.diagnosis import diagnose

    rng = np.random.default_rng(0)
    fp32 = tmp_path / "fp32.onnx"
    onnx.save(mlp_graph(rng), str(fp32))
    feeds = [{"x": rng.normal(size=(32, 12)).astype(np.float32)} for _ in range(4)]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter(feeds)

        def get_next(self):
            return next(self.batches, None)

    int8 = tmp_path / "int8.onnx"
    quantize_static(str(fp32), str(int8), Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=False, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])
    healthy = diagnose(fp32, int8, feeds, ["MatMul"])
    assert {row.node for row in healthy} == {"mm1", "mm2", "mm3"}
    assert all(row.sqnr_db > 20 for row in healthy)

    model = onnx.load(str(int8))
    scale = next(t for t in model.graph.initializer if t.name == sabotaged)
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * 30, sabotaged))
    onnx.save(model, str(int8))
    ort.InferenceSession(str(int8), providers=["CPUExecutionProvider"])  # still a valid graph
    ranked = diagnose(fp32, int8, feeds, ["MatMul"])
    assert ranked[0].node == expected, ranked
    assert ranked[0].noise_added > 10 * max(row.noise_added for row in ranked[1:])
