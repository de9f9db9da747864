"""--device and --amp (issue 62) on a machine without a GPU, as CI has: the default trains on
the CPU, a GPU that is not there is exit 2 with one line before any data is read, and every
trainer (a classifier's, a segmenter's, a detector's, compression's fine-tuning) takes its device
and precision as parameters, run here in bf16 and fp16 autocast on the CPU: the bundle exports
and passes the numeric check, and the report says what ran."""
from __future__ import annotations

import json

import onnxruntime as ort
import pytest
import torch

from conftest import assert_clean_failure, run_cli
from ttc.tasks.detect.canvases import write_coco_canvases
from ttc.tasks.segment.canvases import write_digit_canvases
from utils import EXIT_USAGE

SIDE = 20


def absent_gpu() -> str:
    """A --device this machine does not have."""
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize("script", ["train.py", "pipeline.py"])
def test_a_gpu_that_is_not_there_is_exit_2_before_the_data(tmp_path, script):
    run = run_cli(script, "--dataset_path", "builtin:digits", "--output_model",
                  tmp_path / "out" / "model.onnx", "--device", absent_gpu())
    assert_clean_failure(run, EXIT_USAGE, f"--device {absent_gpu()}")
    assert "train samples" not in run.stderr  # refused before the data is read
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, phrase", [
    (["--device", "gpu"], "use auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:x"], "use auto, cpu, cuda or cuda:N"),
    (["--amp", "fp8"], "--amp"),
    (["--use_gpu", "true"], "--use_gpu applies only to --engine ray"),
])
def test_bad_device_flags_are_one_line(tmp_path, flags, phrase):
    run = run_cli("train.py", "--dataset_path", "builtin:digits", "--output_model",
                  tmp_path / "model.onnx", *flags)
    assert_clean_failure(run, EXIT_USAGE, phrase)


def trained_report(tmp_path, *args: str) -> dict:
    report = tmp_path / "report.json"
    run = run_cli("pipeline.py", *args, "--output_model", tmp_path / "run" / "model.onnx",
                  "--report_json", report, "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(report.read_text())


def test_default_device_is_the_cpu_here_in_float32(tmp_path):
    report = trained_report(tmp_path, "--model_type", "tabular_classifier", "--dataset_path",
                            "builtin:iris", "--epochs", "2")
    expected = "cpu" if not torch.cuda.is_available() else "cuda:0"
    assert report["train"]["device"].startswith(expected)
    assert report["train"]["amp"] == ("off" if expected == "cpu" else "bf16")


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_classifier_in_mixed_precision_exports_a_checked_graph(tmp_path, amp):
    report = trained_report(tmp_path, "--dataset_path", "builtin:digits", "--epochs", "1",
                            "--device", "cpu", "--amp", amp)
    assert (report["train"]["device"], report["train"]["amp"]) == ("cpu", amp)
    assert report["export"]["checker"] == "passed"
    assert report["evaluation"]["accuracy"] > 0.5  # one epoch learns digits in any precision


def test_segmenter_in_fp16_trains_with_loss_scaling_and_exports(tmp_path):
    data = write_digit_canvases(tmp_path / "canvases", 40, size=SIDE, seed=0)
    report = trained_report(tmp_path, "--model_type", "image_segmenter", "--dataset_path",
                            data, "--epochs", "1", "--batch_size", "16", "--amp", "fp16")
    assert report["train"]["amp"] == "fp16"
    assert report["export"]["checker"] == "passed"
    session = ort.InferenceSession(str(tmp_path / "run" / "model.onnx"))
    assert session.get_inputs()[0].type == "tensor(float)"  # the graph stays float32


def test_detector_in_bf16_trains_and_exports(tmp_path):
    images, annotations = tmp_path / "images", tmp_path / "instances.json"
    write_coco_canvases(images, annotations, 40, size=32, seed=0)
    report = trained_report(tmp_path, "--model_type", "object_detector", "--dataset_path",
                            images, "--annotations", annotations, "--epochs", "1",
                            "--batch_size", "16", "--amp", "bf16")
    assert report["train"]["amp"] == "bf16"
    assert report["export"]["checker"] == "passed"


def test_pruning_fine_tunes_on_the_device_in_its_precision(tmp_path):
    report = trained_report(tmp_path, "--dataset_path", "builtin:digits", "--epochs", "1",
                            "--prune", "0.25", "--prune_steps", "1", "--prune_epochs", "1",
                            "--amp", "bf16")
    assert report["train"]["amp"] == "bf16"
    assert any(row.get("name") == "pruned" for row in report["compression"]["variants"])
