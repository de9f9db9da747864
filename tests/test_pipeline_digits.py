"""End to end on scikit-learn's bundled digits: the bundle, the report and stdout hygiene."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import torch
from sklearn.datasets import load_digits

from conftest import REPO, run_cli

REPORT_KEYS = {"version", "status", "error", "config", "dataset", "train", "export", "quantize",
               "inference", "tta", "ttt", "iterative"}


def all_digits() -> tuple[np.ndarray, np.ndarray]:
    digits = load_digits()
    return (digits.images / 16.0).astype(np.float32)[:, None], digits.target


def test_report_follows_the_contract(digits_bundle):
    report = digits_bundle["report"]
    assert REPORT_KEYS <= set(report)
    assert report["status"] == "ok" and report["error"] is None
    for later in ("quantize", "tta", "ttt", "iterative"):
        assert report[later] is None
    dataset = report["dataset"]
    assert dataset["path"] == "builtin:digits" and dataset["num_classes"] == 10
    assert dataset["train"] + dataset["calibration"] + dataset["val"] + dataset["test"] == 1797
    assert dataset["calibration"] == 126 and dataset["calibration_fraction"] == 0.1
    assert dataset["test"] >= 250
    train = report["train"]
    assert train["epochs_run"] == 4 and 1 <= train["best_epoch"] <= 4
    assert 0.8 <= train["val_accuracy"] <= 1 and 0.8 <= train["train_accuracy"] <= 1
    export = report["export"]
    assert export["checker"] == "passed" and export["opset"] == 18
    assert 0 <= export["max_abs_diff"] <= 1e-4 and export["top1_agreement"] == 1.0
    assert export["nodes_after_slim"] <= export["nodes_before_slim"]
    inference = report["inference"]
    assert inference["providers_active"] == ["CPUExecutionProvider"]
    assert inference["accuracy"] >= 0.85
    assert 0 < inference["latency_ms_p50"] <= inference["latency_ms_p95"]
    assert inference["throughput_per_s"] > 0 and inference["batch_size"] == 64
    assert report["config"]["epochs"] == 4 and report["config"]["dataset_path"] == "builtin:digits"


def test_stdout_is_only_the_summary(digits_int8_bundle):
    # digits_bundle's stdout is its JSON report; this run (quantization on top) prints the summary
    run = digits_int8_bundle["run"]
    assert run.stdout.startswith("status: ok")
    for noise in ("[torch.onnx]", "Average Metric", "epoch 1/", "INFO", "WARNING"):
        assert noise not in run.stdout
    assert "epoch 4/4" in run.stderr  # the per-epoch log goes to stderr
    assert "Traceback" not in run.stderr
    summary = digits_int8_bundle["report"]["inference"]
    assert f"{summary['accuracy']:.4g}" in run.stdout


def test_onnx_model_runs_at_batch_1_and_7(digits_bundle):
    session = ort.InferenceSession(str(digits_bundle["model"]), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["image"]
    assert [o.name for o in session.get_outputs()] == ["logits", "probabilities"]
    x, y = all_digits()
    for batch in (1, 7):
        logits, probs = session.run(None, {"image": x[:batch]})
        assert logits.shape == probs.shape == (batch, 10)
        np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-5)
    probs = np.concatenate([session.run(["probabilities"], {"image": x[i:i + 256]})[0]
                            for i in range(0, len(x), 256)])
    assert (probs.argmax(1) == y).mean() >= 0.9  # a real classifier, not a constant


def test_onnx_is_one_self_contained_checked_file(digits_bundle):
    out = digits_bundle["dir"]
    assert not list(out.glob("*.data")) and not list(out.glob(".*.tmp"))
    model = onnx.load(str(digits_bundle["model"]))
    onnx.checker.check_model(model, full_check=True)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # dynamic batch


def test_no_graph_of_the_bundle_names_the_checkout_that_made_it(digits_bundle):
    """The exporter's per-node stack traces hold absolute source paths: none is shipped."""
    graphs = sorted(digits_bundle["dir"].glob("*.onnx"))
    assert {p.name for p in graphs} >= {"model.onnx", "model.bn.onnx", "model.mc.onnx"}
    for path in graphs:
        assert str(REPO).encode() not in path.read_bytes(), path.name
        nodes = onnx.load(path).graph.node
        assert not any(p.key == "pkg.torch.onnx.stack_trace" for n in nodes
                       for p in n.metadata_props), path.name


def test_manifest_and_weights_rebuild_the_same_model(digits_bundle):
    from ttc.nets.models import build_model
    from utils import sha256_of

    out = digits_bundle["dir"]
    manifest = json.loads((out / "model.json").read_text())
    assert manifest["format_version"] == 1 and manifest["model_type"] == "image_classifier"
    assert manifest["labels"] == [str(i) for i in range(10)]
    assert manifest["input"]["shape"][1:] == [1, 8, 8]
    pre = manifest["preprocessing"]
    assert pre["image_size"] == [8, 8] and pre["channels"] == 1 and len(pre["mean"]) == 1
    assert manifest["files"]["sha256"]["onnx"] == sha256_of(out / "model.onnx")
    assert manifest["export"]["max_abs_diff"] == digits_bundle["report"]["export"]["max_abs_diff"]
    state = torch.load(out / "model.pt", weights_only=True)
    net = build_model(manifest["architecture"], pre).eval()
    net.load_state_dict(state)
    x, _ = all_digits()
    with torch.no_grad():
        expected = net(torch.from_numpy(x[:32])).numpy()
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(["logits"], {"image": x[:32]})[0], expected, atol=1e-4)


def test_report_json_dash_prints_only_json(digits_bundle):
    run = digits_bundle["run"]  # trained with --report_json -
    report = json.loads(run.stdout)  # the whole of stdout is one JSON document
    assert report["status"] == "ok" and report["train"]["epochs_run"] == 4
    assert "epoch 4/4" in run.stderr and "Traceback" not in run.stderr


def test_inference_cli_on_existing_bundle_matches_pipeline(digits_bundle, tmp_path):
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--report_json",
                  tmp_path / "inf.json", "--batch_size", "32", "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "inf.json").read_text())
    assert report["inference"]["accuracy"] == digits_bundle["report"]["inference"]["accuracy"]
    assert report["inference"]["batch_size"] == 32 and report["train"] is None
    assert report["dataset"]["test"] == digits_bundle["report"]["dataset"]["test"]
