"""A segmenter and a detector on Ray Train (`train.py` / `pipeline.py --model_type
image_segmenter|object_detector --engine ray`) against a local run, on the test worker's
running head node (conftest's ray_cluster, joined by --ray_address); and a segmenter's local
checkpoints (--resume).
Tiny canvases and two epochs: the runs are shared by the tests (module fixtures), and the
tests share the Ray tests' xdist worker (two clusters at once would not fit on two cores)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from conftest import assert_clean_failure, ray_head, run_cli
from ttc.tasks.detect.canvases import write_yolo_canvases
from ttc.tasks.segment.canvases import write_digit_canvases

pytestmark = pytest.mark.xdist_group("ray")

QUICK = ["--epochs", "2", "--batch_size", "8", "--no_progress", "true", "--num_threads", "1"]


def weights(bundle: Path) -> dict:
    return torch.load(bundle / "model.pt", weights_only=True)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def train(out: Path, *args: str, script: str = "train.py") -> dict:
    """`script` into out/model.onnx; it must exit 0. Its report."""
    run = run_cli(script, *QUICK, "--output_model", out / "model.onnx", "--report_json",
                  out / "report.json", *args)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def segmenter(tmp_path_factory) -> dict:
    """24 canvases of 16 pixels, trained locally (keeping checkpoints) and by one Ray worker
    on the running cluster."""
    root = tmp_path_factory.mktemp("ray_segmenter")
    data = ["--model_type", "image_segmenter", "--dataset_path",
            write_digit_canvases(root / "canvases", 24, size=16, seed=0)]
    local = train(root / "local", *data, "--checkpoint_dir", root / "ck")
    ray = train(root / "ray", *data, "--engine", "ray", "--num_workers", "1", "--ray_address",
                ray_head())
    return {"root": root, "data": data, "local": local, "ray": ray}


def test_one_ray_worker_trains_the_local_segmenter_s_weights(segmenter):
    """Same seed, one worker: the worker runs the local ImageRunner from the driver's weights
    and random state, so the weights agree (the local run's checkpoints change nothing)."""
    root = segmenter["root"]
    assert max_difference(weights(root / "local"), weights(root / "ray")) <= 1e-5
    local, ray = segmenter["local"]["train"], segmenter["ray"]["train"]
    assert ray["engine"]["engine"] == "ray" and ray["engine"]["workers"] == 1
    assert local["engine"]["engine"] == "local" and local["engine"]["checkpoint_dir"]
    assert [h["epoch"] for h in ray["history"]] == [1, 2]
    assert ray["val_accuracy"] == pytest.approx(local["val_accuracy"])
    assert list((root / "ray" / "model.checkpoints").rglob("state.pt"))


def test_a_local_segmenter_resumes_from_its_last_checkpoint(segmenter):
    """The second checkpoint lost (as if killed in epoch 2): the run resumes from epoch 1's,
    with the whole run's weights and each epoch once; another --seed is refused."""
    root, data = segmenter["root"], segmenter["data"]
    [second] = list((root / "ck").glob("local-*/epoch-0002"))
    shutil.rmtree(second)
    resumed = train(root / "resumed", *data, "--checkpoint_dir", root / "ck", "--resume",
                    "true")["train"]
    assert resumed["engine"]["resumed_from_epoch"] == 1
    assert [h["epoch"] for h in resumed["history"]] == [1, 2]
    assert resumed["history"][0] == segmenter["local"]["train"]["history"][0]
    assert max_difference(weights(root / "local"), weights(root / "resumed")) <= 1e-6
    run = run_cli("train.py", *QUICK, *data, "--seed", "7", "--checkpoint_dir", root / "ck",
                  "--resume", "true", "--output_model", root / "other" / "model.onnx")
    assert_clean_failure(run, 2, "written by another training", "seed")


def test_two_ray_workers_train_and_export_a_detector(ray_cluster, tmp_path):
    """30 canvases of 24 pixels, two workers: trained, exported (ONNX Runtime runs the graph
    with its NMS) and reported as a local run, with the workers in train.engine."""
    data = write_yolo_canvases(tmp_path / "canvases", 30, size=24, seed=1)
    out = tmp_path / "two"
    report = train(out, "--model_type", "object_detector", "--dataset_path", data,
                   "--engine", "ray", "--num_workers", "2", "--ray_address", ray_cluster,
                   "--plots", "none",
                   script="pipeline.py")
    engine = report["train"]["engine"]
    assert report["status"] == "ok" and engine["engine"] == "ray" and engine["workers"] == 2
    assert sum(engine["shard_rows"]) == report["dataset"]["train"]
    assert abs(engine["shard_rows"][0] - engine["shard_rows"][1]) <= 1
    assert len(engine["epoch_seconds"]) == 2 and len(engine["allreduce_seconds"]) == 2
    history = report["train"]["history"]
    assert [h["epoch"] for h in history] == [1, 2] and all(np.isfinite(h["loss"])
                                                           for h in history)
    assert report["export"]["max_abs_diff"] is not None
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    boxes, scores, labels, count = session.run(
        ["boxes", "scores", "labels", "num_detections"],
        {"image": np.random.default_rng(0).random((2, 1, 24, 24), dtype=np.float32)})
    assert boxes.shape[:2] == scores.shape == labels.shape and boxes.shape[0] == 2
    assert count.shape == (2,) and (count <= boxes.shape[1]).all()
