"""Training on Ray Train (`pipeline.py` / `train.py --engine ray`) against a local run, on a local
cluster of this machine's CPUs that each run starts and stops; and the training checkpoints
(--checkpoint_dir, --resume) a local run keeps. The tests share the Ray tests' xdist worker:
two clusters at once would not fit on two cores."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import assert_clean_failure, run_cli

pytestmark = pytest.mark.xdist_group("ray")

DIGITS = ["--dataset_path", "builtin:digits", "--epochs", "2", "--no_progress", "true",
          "--num_threads", "1"]


def weights(bundle: Path) -> dict:
    return torch.load(bundle / "model.pt", weights_only=True)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def train(out: Path, *args: str) -> dict:
    """train.py into out/model.onnx; it must exit 0. Its report."""
    run = run_cli("train.py", *DIGITS, "--output_model", out / "model.onnx", "--report_json",
                  out / "report.json", *args)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def test_one_ray_worker_trains_the_local_run_s_weights(tmp_path):
    """Same seed, one worker: the epoch loop on the worker is the local one (EpochRunner), with
    the driver's starting weights and random state, so the weights agree to float noise."""
    local = train(tmp_path / "local")
    ray = train(tmp_path / "ray", "--engine", "ray", "--num_workers", "1")
    assert max_difference(weights(tmp_path / "local"), weights(tmp_path / "ray")) <= 1e-5
    engine = ray["train"]["engine"]
    assert engine["engine"] == "ray" and engine["workers"] == 1
    assert [h["epoch"] for h in ray["train"]["history"]] == [1, 2]
    assert ray["train"]["val_accuracy"] == pytest.approx(local["train"]["val_accuracy"])
    assert local["train"]["engine"]["engine"] == "local"
    checkpoints = list((tmp_path / "ray" / "model.checkpoints").rglob("state.pt"))
    assert checkpoints, "a Ray run keeps its checkpoints beside the bundle"


def test_two_ray_workers_train_and_export(tmp_path):
    out = tmp_path / "two"
    run = run_cli("pipeline.py", *DIGITS, "--output_model", out / "model.onnx",
                  "--report_json", out / "report.json", "--engine", "ray", "--num_workers", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    engine = report["train"]["engine"]
    assert report["status"] == "ok" and engine["workers"] == 2
    assert len(engine["epoch_seconds"]) == 2 and len(engine["allreduce_seconds"]) == 2
    assert 0 < engine["allreduce_share"] < 1
    assert [h["epoch"] for h in report["train"]["history"]] == [1, 2]
    assert report["export"]["max_abs_diff"] is not None and (out / "model.onnx").is_file()
    assert report["inference"]["accuracy"] > 0.8


def test_a_local_run_resumes_from_its_last_checkpoint(tmp_path):
    """A 3-epoch run whose last checkpoint is lost (as if killed in epoch 3) resumes from epoch
    2's: the same weights as the whole run, and each epoch once in the history."""
    whole = train(tmp_path / "whole", "--epochs", "3", "--checkpoint_dir", tmp_path / "ck")
    [third] = list((tmp_path / "ck").glob("local-*/epoch-0003"))
    shutil.rmtree(third)
    resumed = train(tmp_path / "resumed", "--epochs", "3", "--checkpoint_dir", tmp_path / "ck",
                    "--resume", "true")
    assert [h["epoch"] for h in resumed["train"]["history"]] == [1, 2, 3]
    assert resumed["train"]["engine"]["resumed_from_epoch"] == 2
    assert resumed["train"]["history"][:2] == whole["train"]["history"][:2]
    assert max_difference(weights(tmp_path / "whole"), weights(tmp_path / "resumed")) <= 1e-6
    more = train(tmp_path / "more", "--epochs", "4", "--checkpoint_dir", tmp_path / "ck",
                 "--resume", "true")  # a longer run continues the finished one
    assert [h["epoch"] for h in more["train"]["history"]] == [1, 2, 3, 4]


MODEL_DEF = '''import sys
from torch import nn

if sys.argv and sys.argv[0].endswith("default_worker.py"):  # a Ray worker's process
    raise ImportError("No module named 'site_helpers' (installed on the driver's machine only)")


def build(num_classes, input_spec):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))
'''


def bad_inputs(tmp_path: Path) -> list[tuple[list, int, str]]:
    (tmp_path / "empty").mkdir()
    (tmp_path / "net.py").write_text(MODEL_DEF)
    out = str(tmp_path / "bad" / "model.onnx")
    cases = [
        (["--engine", "ray", "--ray_address", "127.0.0.1:1"], 5, "no Ray cluster answers"),
        (["--engine", "ray", "--num_workers", "64"], 2, "--num_workers 64"),
        (["--use_gpu", "true"], 2, "--use_gpu applies only to --engine ray"),
        (["--engine", "ray", "--lr_candidates", "1e-3,3e-3"], 2, "not built yet"),
        (["--model_type", "image_segmenter", "--dataset_path", "builtin:digit_canvases",
          "--engine", "ray"], 2, "not built yet"),
        (["--resume", "true", "--checkpoint_dir", str(tmp_path / "empty")], 2,
         "holds no checkpoint"),
        (["--checkpoint_dir", out], 2, "is the same path as --output_model"),
        (["--engine", "ray", "--num_workers", "1", "--model_def", f"{tmp_path / 'net.py'}:build"],
         2, "cannot be built on the Ray workers"),
    ]
    if torch.cuda.device_count() == 0:
        cases.append((["--engine", "ray", "--num_workers", "1", "--use_gpu", "true"], 2,
                      "need a GPU each"))
    return [(case, code, phrase) for case, code, phrase in cases]


def test_bad_input_is_one_line_and_its_exit_code(tmp_path):
    """Each before training starts (the model_def one once the cluster is up), one error line,
    no traceback, no bundle."""
    for args, code, phrase in bad_inputs(tmp_path):
        run = run_cli("train.py", *DIGITS, "--output_model", tmp_path / "bad" / "model.onnx",
                      *args)
        assert_clean_failure(run, code, phrase)
        assert not (tmp_path / "bad" / "model.pt").exists(), args
