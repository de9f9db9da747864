"""int8 for an object detector (issue 44, item 6): train.py, export.py and quantize.py on tiny
YOLO canvases (one epoch). The int8 graph keeps the detection contract at any batch and size,
quantizes only the backbone (the head and the NMS run in float), is judged on COCO mAP, and
inference.py serves what the gate chose."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import run_cli
from ttc.tasks.detect.canvases import write_yolo_canvases
from ttc.tasks.detect.quantize import graph_parts

SIDE = 24
OUTPUTS = ["boxes", "scores", "labels", "num_detections"]
INTEGER_OPS = ("QuantizeLinear", "DequantizeLinear", "QLinearConv", "ConvInteger",
               "MatMulInteger", "QLinearMatMul")


@pytest.fixture(scope="module")
def int8_bundle(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("detect_int8")
    data = write_yolo_canvases(root / "yolo", 40, size=SIDE, seed=1)
    model = root / "run" / "model.onnx"
    for script, *flags in (("train.py", "--model_type", "object_detector", "--epochs", "1",
                            "--batch_size", "16"),
                           ("export.py", "--max_detections", "10"),
                           ("quantize.py", "--quantize", "static", "--force_quantized", "true",
                            "--batch_size", "8", "--report_json", root / "quantize.json")):
        run = run_cli(script, "--dataset_path", data, "--output_model", model, *flags,
                      "--no_progress", "true")
        assert run.returncode == 0, (script, run.stderr[-3000:])
    return {"data": data, "model": model, "int8": model.with_name("model.int8.onnx"),
            "report": json.loads((root / "quantize.json").read_text())}


@pytest.mark.parametrize("batch,size", [(1, (SIDE, SIDE)), (3, (37, 30))])
def test_int8_keeps_the_graph_s_contract(int8_bundle, batch, size):
    graph = ort.InferenceSession(str(int8_bundle["int8"]), providers=["CPUExecutionProvider"])
    assert [o.name for o in graph.get_outputs()] == OUTPUTS
    x = np.random.default_rng(0).random((batch, 1, *size), dtype=np.float32)
    boxes, scores, labels, counts = graph.run(OUTPUTS, {"image": x})
    assert boxes.shape == (batch, 10, 4) and boxes.dtype == np.float32
    assert scores.shape == labels.shape == (batch, 10) and labels.dtype == np.int64
    assert counts.shape == (batch,) and counts.dtype == np.int64
    for i, n in enumerate(counts):
        assert np.all(np.diff(scores[i, :n]) <= 0) and np.all(labels[i, n:] == -1)
        assert not boxes[i, n:].any() and not scores[i, n:].any()


def test_only_the_backbone_is_quantized(int8_bundle):
    """The int8 graph, split by what NMS's boxes and scores depend on: integer ops only in the
    backbone; no head or NMS node is integer or reads a dequantized tensor."""
    model = onnx.load(str(int8_bundle["int8"]))
    nodes = {n.name: n for n in model.graph.node}
    producer = {out: n.op_type for n in model.graph.node for out in n.output}
    parts = graph_parts(model)
    assert any(nodes[name].op_type == "DequantizeLinear" for name in parts.backbone)
    head_convs = [name for name in parts.head if nodes[name].op_type == "Conv"]
    assert len(head_convs) == 4  # each head: Conv 3x3 and Conv 1x1
    for name in [*parts.head, *parts.postprocessing]:
        assert nodes[name].op_type not in INTEGER_OPS, name
        assert all(producer.get(i) != "DequantizeLinear" for i in nodes[name].input), name
    kept = int8_bundle["report"]["quantize"]["exclusion"]["kept_float"]
    assert sorted(kept["quantizable"]) == sorted(head_convs)
    assert {"nms/selected", "boxes", "num_detections"} <= set(kept["postprocessing"])


def test_int8_is_judged_on_coco_map(int8_bundle):
    quantize = int8_bundle["report"]["quantize"]
    assert quantize["metric"] == "map" and quantize["mode"] == "static"
    for key in ("accuracy_val", "accuracy_val_fp32", "accuracy", "accuracy_fp32"):
        assert 0.0 <= quantize[key] <= 1.0, key
    assert set(quantize["test_metrics"]) == {"map50", "map50_fp32"}
    assert quantize["calibration"]["source"] == "train split"
    assert quantize["used_for_inference"]  # --force_quantized, or the gate passed it
    assert any(word in quantize["verdict"] for word in ("mAP@[.5:.95]", "--force_quantized"))
    exclusion = quantize["exclusion"]
    assert set(exclusion["kept_float"]["quantizable"]) <= set(exclusion["excluded"])


def test_inference_serves_the_graph_the_gate_chose(int8_bundle):
    run = run_cli("inference.py", "--model", int8_bundle["model"], "--dataset_path",
                  int8_bundle["data"], "--variant", "auto", "--report_json", "-",
                  "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-2000:]
    report, quantize = json.loads(run.stdout), int8_bundle["report"]["quantize"]
    served = "model.int8.onnx" if quantize["used_for_inference"] else "model.onnx"
    assert Path(report["inference"]["model_path"]).name == served == "model.int8.onnx"
    assert report["evaluation"]["map"] == pytest.approx(quantize["accuracy"])


def test_reduced_range_int8_keeps_the_detector_s_float_head(int8_bundle, tmp_path):
    """--int8_range reduced (issue 61: 7-bit weights for CPUs without VNNI) on the detector:
    the backbone's int8 weights lie in [-64, 64], the head and NMS stay float, and the report and
    manifest record the range."""
    import shutil

    from ttc.tasks.detect.quantize import float_violations

    for path in int8_bundle["model"].parent.glob("model.*"):
        shutil.copy(path, tmp_path / path.name)
    model = tmp_path / "model.onnx"
    run = run_cli("quantize.py", "--dataset_path", int8_bundle["data"], "--output_model", model,
                  "--quantize", "static", "--int8_range", "reduced", "--batch_size", "8",
                  "--no_progress", "true", "--report_json", "-")
    assert run.returncode == 0, run.stderr[-3000:]
    quantize = json.loads(run.stdout)["quantize"]
    assert quantize["reduce_range"] is True and quantize["metric"] == "map"
    int8 = onnx.load(str(tmp_path / "model.int8.onnx"))
    weights = [onnx.numpy_helper.to_array(init) for init in int8.graph.initializer
               if init.data_type == onnx.TensorProto.INT8]
    assert weights and all(w.min() >= -64 and w.max() <= 64 for w in weights)
    kept = quantize["exclusion"]["kept_float"]
    assert float_violations(int8, [*kept["head"], *kept["postprocessing"]]) == []
    assert json.loads(model.with_suffix(".json").read_text())["quantization"]["reduce_range"]
