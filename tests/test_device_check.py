"""bench/device_check.py, issue 62's GPU device check, as CI can run it: --quick on this machine
(no GPU) trains the digits CNN and the detector on the CPU through pipeline.py, passes the
numeric checks, writes its figures to --json, says the GPU rows are not measured and why, and
exits 0; its goal judging on made-up rows; and the device machine's shell scripts parse."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import CLI_ENV, REPO, fork_server
from test_bench import repository_files

BENCH = REPO / "bench"


def device_check_module():
    """bench/device_check.py as a module (bench/ first on sys.path, as when it runs)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("device_check")


def run_quick(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    python = sys.executable
    server = fork_server()
    if server:  # the script and the pipeline.py runs it starts fork from the server
        python = tmp_path / "python"
        server.python_shim(python, REPO)
    return subprocess.run([str(python), str(BENCH / "device_check.py"), "--quick", *args],
                          cwd=REPO, env=dict(os.environ, **CLI_ENV), capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, set]:
    tmp_path = tmp_path_factory.mktemp("device_check")
    before = repository_files()
    run = run_quick(tmp_path, "--json", str(tmp_path / "figures.json"))
    figures = json.loads((tmp_path / "figures.json").read_text()) \
        if (tmp_path / "figures.json").exists() else {}
    return run, figures, repository_files() - before


def test_quick_runs_the_cpu_rows_and_exits_0(quick):
    run, figures, new_files = quick
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert figures["checks_failed"] == [] and figures["quick"] is True
    cpu = [row for row in figures["rows"] if row["device"] == "cpu"]
    assert [row["model"] for row in cpu] == ["digits_cnn", "centernet"]
    for row in cpu:
        assert row["status"] == "ok" and row["failures"] == [], row
        assert row["device_reported"] == "cpu" and row["amp_reported"] == "off"
        assert row["checker"] == "passed" and row["max_abs_diff"] <= row["atol"]
        assert row["samples"] > 0 and row["samples_per_s"] > 0
        assert len(row["epoch_seconds"]) == row["epochs"]
        assert 0 <= row["test_metric_pt"] <= 100
    assert new_files == set(), "the check left files in the repository"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_cuda_the_gpu_rows_say_why_and_no_goal_is_judged(quick):
    run, figures, _ = quick
    line = f"cuda: not available (torch {torch.__version__}, CUDA build " \
           f"{torch.version.cuda or 'none'})"
    assert line in run.stdout
    gpu = [row for row in figures["rows"] if row["device"] == "cuda"]
    assert {(row["model"], row["amp"]) for row in gpu} == {
        (model, amp) for model in ("digits_cnn", "centernet") for amp in ("off", "bf16")}
    assert all(row["status"] == f"not measured: {line}" for row in gpu)
    assert figures["cuda"] == {"available": False, "line": line, "torch": torch.__version__,
                               "cuda_build": torch.version.cuda}
    assert figures["goals"] and all(goal["met"] is None for goal in figures["goals"])


def test_the_output_names_what_it_measures_and_what_it_cannot(quick):
    run, figures, _ = quick
    for words in ("samples/s", "x CPU", "x fp32", "goals:", "not measured",
                  "--num_threads 1 for every run", "onnxruntime ", "checks: all passed"):
        assert words in run.stdout, (words, run.stdout[-3000:])
    assert figures["onnxruntime"]["providers"] and figures["onnxruntime"]["note"]
    assert "CUDA and TensorRT" in figures["onnxruntime"]["note"] or \
        "available but not measured" in figures["onnxruntime"]["note"]


def row(check, model: str, device: str, amp: str, rate: float, metric: float):
    return check.Row(model, device, amp, 3, status="ok", samples=1000,
                     epoch_seconds=[1.0] * 3, samples_per_s=rate, test_metric_pt=metric)


def test_goals_are_judged_from_the_ratios_and_the_metric():
    check = device_check_module()
    rows = [row(check, "resnet18", "cpu", "off", 100, 97.0),
            row(check, "resnet18", "cuda", "off", 1500, 97.4),
            row(check, "resnet18", "cuda", "bf16", 2100, 97.0),  # 1.4x at -0.4 pt
            row(check, "centernet", "cpu", "off", 50, 40.0),
            row(check, "centernet", "cuda", "off", 400, 40.0),  # 8x
            row(check, "centernet", "cuda", "bf16", 800, 39.0)]  # 2x but -1 pt
    met = {goal["goal"].split(" (")[0]: (goal["value"], goal["met"])
           for goal in check.goals(rows, "bf16")}
    assert met["resnet18: CUDA fp32 / CPU samples/s >= 10x"] == (15.0, True)
    assert met["centernet: CUDA fp32 / CPU samples/s >= 10x"] == (8.0, False)
    assert met["resnet18: CUDA bf16 / fp32 samples/s >= 1.3x at test metric within ±0.5 pt"] \
        == (1.4, True)
    assert met["centernet: CUDA bf16 / fp32 samples/s >= 1.3x at test metric within ±0.5 pt"] \
        == (2.0, False)
    assert met["resnet18: CUDA fp32 test metric within ±0.5 pt of the CPU's"] == (0.4, True)
    assert met["centernet: CUDA fp32 test metric within ±0.5 pt of the CPU's"] == (0.0, True)


def test_a_failed_numeric_check_is_a_failure_and_a_cut_run_keeps_its_epochs():
    check = device_check_module()
    bad = check.Row("resnet18", "cuda", "bf16", 2, device_reported="cuda:0 (GPU)",
                    amp_reported="bf16", epoch_seconds=[2.0, 1.0], checker="passed",
                    max_abs_diff=3e-4, atol=1e-4)
    check.check_row(bad, 0)
    assert bad.failures == ["export.max_abs_diff 0.0003 > 0.0001"]
    cut = check.Row("resnet18", "cpu", "off", 3)
    check.read_log(cut, "12:00:00 INFO    training resnet18 (11172810 parameters) on 1259 "
                        "samples, validating on 269\n12:00:30 INFO    epoch 1/3  loss 1.0  "
                        "train_acc 0.6  val_acc 0.9  (30.0s)\n12:00:55 INFO    epoch 2/3  "
                        "loss 0.5  train_acc 0.8  val_acc 0.9  (25.0s)\n")
    assert (cut.samples, cut.epoch_seconds) == (1259, [30.0, 25.0])
    assert cut.samples_per_s == pytest.approx(1259 / 25.0)


@pytest.mark.parametrize("script", ["device_check.sh", "build_wheelhouse.sh"])
def test_the_shell_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(BENCH / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_device_check_flags_parse_without_running():
    done = subprocess.run([sys.executable, str(BENCH / "device_check.py"), "--models",
                           "resnet18", "--gpu_amp", "fp16", "--check_flags"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    bad = subprocess.run([sys.executable, str(BENCH / "device_check.py"), "--models", "vgg",
                          "--check_flags"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--models: unknown vgg" in bad.stderr, bad.stderr
