"""Quantized graphs: validated, timed against fp32, used only when they earn it; strict providers."""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict

import numpy as np
import onnxruntime as ort
from sklearn.datasets import load_digits

from conftest import assert_clean_failure, run_cli
from ttc.serving.runtime import cpu_info
from utils import sha256_of

QUANTIZE_KEYS = {"mode", "path", "size_bytes_fp32", "size_bytes", "accuracy", "accuracy_fp32",
                 "top1_agreement", "latency_ms_p50", "latency_ms_p50_fp32",
                 "latency_ms_p50_batch1", "latency_ms_p50_batch1_fp32", "used_for_inference",
                 "verdict", "problems", "max_abs_diff", "batch_size"}


def check_int8_graph(path, fp32_path):
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    int8 = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    fp32 = ort.InferenceSession(str(fp32_path), providers=["CPUExecutionProvider"])
    for batch in (1, 7):
        assert int8.run(["probabilities"], {"image": x[:batch]})[0].shape == (batch, 10)
    run = lambda s: np.concatenate([s.run(["probabilities"], {"image": x[i:i + 200]})[0]
                                    for i in range(0, len(x), 200)]).argmax(1)
    assert abs((run(int8) == digits.target).mean() - (run(fp32) == digits.target).mean()) <= 0.03


def test_pipeline_static_int8_is_validated_and_used_only_if_it_earns_it(digits_int8_bundle):
    bundle = digits_int8_bundle
    out, run, report = bundle["dir"], bundle["run"], bundle["report"]
    quantize = report["quantize"]
    assert QUANTIZE_KEYS <= set(quantize) and quantize["mode"] == "static"
    assert quantize["size_bytes"] < quantize["size_bytes_fp32"] / 2
    assert abs(quantize["accuracy"] - quantize["accuracy_fp32"]) <= 0.03
    assert quantize["calibration"] == {"method": "minmax", "samples": 128, "source": "train split"}
    # The verdict and the graph inference ran agree, whichever way the timing went here.
    assert quantize["used_for_inference"] == (not quantize["problems"])
    used = report["inference"]["model_path"]
    assert used.endswith(".int8.onnx") == quantize["used_for_inference"]
    assert "quantize:" in run.stdout and quantize["verdict"] in run.stdout
    # The CPU that timed int8 is named (int8 speed depends on its instructions).
    here = cpu_info()
    assert quantize["cpu"] == {**asdict(here), "description": here.describe()}
    assert f"timed on                   {here.describe()}" in run.stdout
    manifest = json.loads((out / "model.json").read_text())
    assert manifest["files"]["sha256"]["int8"] == sha256_of(out / "model.int8.onnx")
    assert manifest["quantization"]["verdict"] == quantize["verdict"]
    check_int8_graph(out / "model.int8.onnx", out / "model.onnx")
    rows = report["benchmark"]  # always there once an int8 variant exists
    assert [r["variant"] for r in rows] == ["pytorch eager fp32", "onnxruntime fp32",
                                            "onnxruntime int8 (static)"]
    for row in rows:
        assert row["size_mb"] > 0 and 0.8 <= row["accuracy"] <= 1 and row["throughput_per_s"] > 0
        assert 0 < row["latency_ms_p50_batch1"] <= row["latency_ms_p95_batch1"]
    assert "benchmark:" in run.stdout and "onnxruntime int8 (static)" in run.stdout


def test_quantize_cli_dynamic_with_force_then_inference_quantized(digits_bundle, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(digits_bundle["dir"], bundle)
    fp32_hash = sha256_of(bundle / "model.onnx")
    run = run_cli("quantize.py", "--output_model", bundle / "model.onnx", "--quantize", "dynamic",
                  "--force_quantized", "true", "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    quantize = json.loads(run.stdout)["quantize"]
    assert quantize["mode"] == "dynamic" and quantize["used_for_inference"] is True
    assert sha256_of(bundle / "model.onnx") == fp32_hash  # fp32 graph untouched
    check_int8_graph(bundle / "model.int8.onnx", bundle / "model.onnx")
    infer = run_cli("inference.py", "--model", bundle / "model.onnx", "--quantized", "true",
                    "--benchmark", "true", "--report_json", "-")
    assert infer.returncode == 0, infer.stderr[-2000:]
    report = json.loads(infer.stdout)
    assert report["inference"]["model_path"].endswith("model.int8.onnx")
    assert [r["variant"] for r in report["benchmark"]] == ["onnxruntime fp32",
                                                           "onnxruntime int8 (dynamic)"]


def test_inference_quantized_without_int8_graph_exits_4(digits_bundle):
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--quantized", "true")
    assert_clean_failure(run, 4, "no int8 graph", "quantize.py")


def test_strict_ep_turns_a_fallback_into_exit_5(digits_bundle, tmp_path):
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--ep", "cuda",
                  "--strict_ep", "true", "--report_json", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    if run.returncode == 0:  # a machine where CUDA really runs
        assert "CUDAExecutionProvider" in report["inference"]["providers_active"]
        return
    assert_clean_failure(run, 5, "CUDAExecutionProvider", "--strict_ep")
    assert report["status"] == "error" and report["error"]["code"] == 5


def test_fallback_warning_names_the_reason(digits_bundle):
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--ep", "cuda")
    assert run.returncode == 0, run.stderr[-2000:]
    warnings = [line for line in run.stderr.splitlines() if "WARNING" in line]
    if "CUDAExecutionProvider" in run.stdout:
        return
    assert len(warnings) == 1 and "CUDAExecutionProvider could not start" in warnings[0]
    assert "running on CPUExecutionProvider" in warnings[0]


def test_provider_options_are_recorded_and_stdout_stays_json(digits_bundle, tmp_path):
    """TensorRT options with an engine cache; ORT's own 'EP Error' prints must not reach stdout."""
    cache = tmp_path / "trt_cache"
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--ep", "tensorrt,cuda",
                  "--ep_options", f'{{"tensorrt": {{"trt_fp16_enable": true, '
                                  f'"trt_engine_cache_path": "{cache}"}}, "cuda": {{"device_id": 0}}}}',
                  "--execution_mode", "parallel", "--inter_op_threads", "2", "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    inference = json.loads(run.stdout)["inference"]
    assert inference["provider_options"] == {
        "TensorrtExecutionProvider": {"trt_fp16_enable": "true", "trt_engine_cache_path": str(cache),
                                      "trt_engine_cache_enable": "true"},
        "CUDAExecutionProvider": {"device_id": "0"}}
    assert cache.is_dir()
    assert inference["providers_requested"] == ["TensorrtExecutionProvider",
                                                "CUDAExecutionProvider", "CPUExecutionProvider"]


def test_fp16_graph_is_validated_and_only_used_on_a_gpu_provider(wine_bundle):
    out, report = wine_bundle["dir"], wine_bundle["report"]
    half = report["fp16"]
    assert half["mode"] == "fp16" and half["size_bytes"] < half["size_bytes_fp32"]
    assert abs(half["accuracy"] - half["accuracy_fp32"]) <= 0.04 and half["max_abs_diff"] < 0.05
    if half["provider"] == "CPUExecutionProvider":
        assert half["used_for_inference"] is False and "GPU providers" in half["verdict"]
        assert not report["inference"]["model_path"].endswith(".fp16.onnx")
    session = ort.InferenceSession(str(out / "model.fp16.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].type == "tensor(float)"  # inputs and outputs stay fp32
    x = np.random.default_rng(0).normal(size=(7, 13)).astype(np.float32)
    for batch in (1, 7):
        probs = session.run(["probabilities"], {"features": x[:batch]})[0]
        assert probs.dtype == np.float32 and probs.shape == (batch, 3)
    infer = run_cli("inference.py", "--model", out / "model.onnx", "--fp16", "true",
                    "--report_json", "-")
    assert infer.returncode == 0, infer.stderr[-2000:]
    assert json.loads(infer.stdout)["inference"]["model_path"].endswith("model.fp16.onnx")


def test_iobinding_runner_matches_session_run(digits_bundle):
    """The IOBinding path used on CUDA, exercised on the CPU device: same probabilities."""
    from ttc.serving.runtime import iobinding_runner, session_runner

    session = ort.InferenceSession(str(digits_bundle["model"]), providers=["CPUExecutionProvider"])
    x = (load_digits().images[:7] / 16.0).astype(np.float32)[:, None]
    bound = iobinding_runner(session, "cpu")
    for batch in (x[:1], x):
        np.testing.assert_array_equal(bound(batch), session_runner(session)(batch))
