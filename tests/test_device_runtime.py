"""ONNX Runtime on a GPU (issue 62), the parts a CPU-only machine can check: TensorRT's engine
cache in the bundle's folder (or where --ep_options says, or none when the folder is
read-only), --variant auto preferring the fp16 graph when a GPU provider runs first, and the
dense types' runners giving session.run's values through the one output runner."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from ttc.online.predictor import served_variant
from ttc.serving.runtime import (ENGINE_CACHE, TENSORRT, gpu_runs_first, outputs_runner,
                                 with_engine_cache)

CPU = "CPUExecutionProvider"


def test_tensorrt_engines_are_cached_beside_the_bundle(tmp_path):
    options = with_engine_cache({}, [TENSORRT, CPU], tmp_path)
    assert options[TENSORRT] == {"trt_engine_cache_enable": "true",
                                 "trt_engine_cache_path": str(tmp_path / ENGINE_CACHE)}
    assert (tmp_path / ENGINE_CACHE).is_dir()


def test_an_engine_cache_named_in_ep_options_wins(tmp_path):
    chosen = str(tmp_path / "engines")
    options = with_engine_cache({TENSORRT: {"trt_engine_cache_path": chosen}}, [TENSORRT, CPU],
                                tmp_path / "bundle")
    assert options[TENSORRT]["trt_engine_cache_path"] == chosen
    assert not (tmp_path / "bundle").exists()


def test_no_tensorrt_no_cache(tmp_path):
    assert with_engine_cache({}, ["CUDAExecutionProvider", CPU], tmp_path) == {}
    assert not (tmp_path / ENGINE_CACHE).exists()


def test_a_file_in_the_way_of_the_cache_is_a_warning_not_a_failure(tmp_path, caplog):
    (tmp_path / ENGINE_CACHE).write_text("not a folder")
    options = with_engine_cache({}, [TENSORRT, CPU], tmp_path)
    assert "trt_engine_cache_path" not in options[TENSORRT]
    assert "engines are built afresh" in caplog.text


def manifest_with(*files: str) -> SimpleNamespace:
    return SimpleNamespace(files={name: f"model.{name}.onnx" for name in ("onnx", *files)},
                           compression=None, variant=lambda key: None,
                           full_range_int8=lambda key: False)


def test_auto_serves_fp16_on_a_gpu_and_fp32_on_the_cpu():
    assert served_variant("auto", manifest_with("fp16"), gpu=True) == "fp16"
    assert served_variant("auto", manifest_with("fp16"), gpu=False) == "onnx"
    assert served_variant("auto", manifest_with(), gpu=True) == "onnx"
    assert served_variant("fp32", manifest_with("fp16"), gpu=True) == "onnx"


def test_a_gpu_provider_this_build_lacks_is_not_a_gpu():
    cuda_here = "CUDAExecutionProvider" in ort.get_available_providers()
    assert gpu_runs_first(["CUDAExecutionProvider", CPU]) is cuda_here
    assert gpu_runs_first([CPU]) is False


def test_the_output_runner_gives_session_runs_values():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 3]) for n in ("a", "b")]
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["a"]),
                               helper.make_node("Neg", ["x"], ["b"])], "g", [x], outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    session = ort.InferenceSession(model.SerializeToString(), providers=[CPU])
    feed = {"x": np.array([[-1.0, 0.5, 2.0]], np.float32)}
    for got, expected in zip(outputs_runner(session, ["a", "b"])(feed),
                             session.run(["a", "b"], feed)):
        np.testing.assert_array_equal(got, expected)
    assert onnx.checker.check_model(model) is None
