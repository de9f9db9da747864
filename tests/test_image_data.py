"""Image folders and image tables of real PNG files, through the whole pipeline."""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image

from conftest import run_cli, write_image_folder, write_image_table

TRAIN = ["--epochs", "8", "--batch_size", "16", "--no_progress", "true"]


def run_pipeline(dataset, out, *extra):
    run = run_cli("pipeline.py", "--model_type", "image_classifier", "--dataset_path", dataset,
                  "--output_model", out / "model.onnx", "--report_json", out / "report.json",
                  *TRAIN, *extra)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def split_folder(tmp_path_factory) -> dict:
    """One pipeline run on RGB images laid out as train/ and test/ class folders, with a broken
    PNG among them and a stray text file beside the class folders."""
    out = tmp_path_factory.mktemp("split_folder")
    root = write_image_folder(out / "data", rgb=True, splits=True)
    (root / "train" / "1" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    (root / "train" / "notes.txt").write_text("ignored: not a class folder")
    run, report = run_pipeline(root, out)
    return {"root": root, "dir": out, "run": run, "report": report}


def test_folder_with_a_corrupt_image_trains_and_counts_the_skip(split_folder):
    run, report, root = split_folder["run"], split_folder["report"], split_folder["root"]
    assert report["dataset"]["skipped_images"] == 1
    assert report["dataset"]["num_classes"] == 3 and report["dataset"]["channels"] == 3
    assert sum(report["dataset"][s] for s in ("train", "calibration", "val", "test")) == 120
    warnings = [line for line in run.stderr.splitlines()
                if "WARNING" in line and "image" in line]
    assert len(warnings) == 1 and "broken.png" in warnings[0]
    assert report["inference"]["accuracy"] >= 0.8
    manifest = json.loads((split_folder["dir"] / "model.json").read_text())
    assert manifest["labels"] == ["0", "1", "2"]
    assert manifest["preprocessing"]["image_size"] == [16, 16]
    assert len(manifest["preprocessing"]["mean"]) == 3

    # The deployed graph takes decode → resize → /255 pixels, as the manifest says.
    pixels = np.asarray(Image.open(next((root / "test" / "2").glob("*.png"))).convert("RGB"),
                        dtype=np.float32) / 255
    session = ort.InferenceSession(str(split_folder["dir"] / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    probs = session.run(["probabilities"], {"image": pixels.transpose(2, 0, 1)[None]})[0]
    assert probs.shape == (1, 3) and manifest["labels"][int(probs.argmax())] == "2"


def test_train_and_test_subfolders_are_used_as_given_splits(split_folder):
    report, root = split_folder["report"], split_folder["root"]
    test_files = len(list((root / "test").rglob("*.png")))
    dataset = report["dataset"]
    assert dataset["given_splits"] is True and dataset["test"] == test_files
    assert dataset["train"] + dataset["calibration"] + dataset["val"] == 120 - test_files
    assert dataset["val"] > 0 and dataset["calibration"] > 0
    assert report["inference"]["accuracy"] >= 0.8


def test_csv_table_of_image_paths_and_labels_resized_to_one_channel(tmp_path):
    # the JSONL table goes through the stage CLIs in test_stages.py
    table = write_image_table(tmp_path / "data", "csv")
    _, report = run_pipeline(table, tmp_path / "out", "--image_size", "12", "--channels", "1")
    assert report["dataset"]["num_classes"] == 3
    assert report["dataset"]["image_size"] == [12, 12] and report["dataset"]["channels"] == 1
    manifest = json.loads((tmp_path / "out" / "model.json").read_text())
    assert manifest["labels"] == ["d0", "d1", "d2"]
    assert manifest["dataset"]["path"] == str(table.resolve())
    assert report["inference"]["accuracy"] >= 0.8


def test_split_is_deterministic_for_a_seed(tmp_path):
    """Same seed → same test split (inference.py re-derives it from the manifest)."""
    root = write_image_folder(tmp_path / "data", per_class=15)
    args = ["--epochs", "1", "--no_progress", "true", "--dataset_path", root]
    first = run_cli("train.py", *args, "--output_model", tmp_path / "a.onnx", "--report_json", "-")
    second = run_cli("train.py", *args, "--output_model", tmp_path / "b.onnx", "--report_json", "-")
    assert first.returncode == second.returncode == 0, first.stderr[-2000:]
    a, b = json.loads(first.stdout)["dataset"], json.loads(second.stdout)["dataset"]
    assert (a["train"], a["val"], a["test"]) == (b["train"], b["val"], b["test"])
