"""`--model_type object_detector` through the CLIs (issue 44): one pipeline run on tiny digit
canvases in COCO format (training in the DSPy program, export with decoding and NMS in the
graph, COCO mAP) whose bundle the other tests read with ONNX Runtime; inference.py alone on the
test split and on new images (`--input`); train.py and export.py alone; and the flags and data
a detector refuses, each with its exit code."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pandas as pd
import pytest
from PIL import Image

from conftest import assert_clean_failure, run_cli
from ttc.tasks.detect.canvases import write_yolo_canvases
from utils import EXIT_DATA, EXIT_USAGE

SIDE = 32
OUTPUTS = ["boxes", "scores", "labels", "num_detections"]


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_the_manifest_records_the_graph_s_contract_and_its_nms(detect_bundle):
    manifest = json.loads((detect_bundle["dir"] / "model.json").read_text())
    assert manifest["model_type"] == "object_detector"
    assert [o["name"] for o in manifest["outputs"]] == OUTPUTS
    assert manifest["input"]["shape"] == ["batch", 1, "height", "width"]
    assert manifest["preprocessing"]["nms"] == {"iou_threshold": 0.5, "score_threshold": 0.05,
                                                "max_detections": 20}
    assert manifest["labels"] == [str(d) for d in range(10)]
    assert manifest["dataset"]["annotations"] == str(detect_bundle["annotations"].resolve())


@pytest.mark.parametrize("batch,size", [(1, (SIDE, SIDE)), (3, (45, 38))])
def test_the_graph_returns_padded_sorted_detections_at_any_batch_and_size(detect_bundle, batch,
                                                                          size):
    x = np.random.default_rng(0).random((batch, 1, *size), dtype=np.float32)
    boxes, scores, labels, counts = session(detect_bundle["model"]).run(OUTPUTS, {"image": x})
    assert boxes.shape == (batch, 20, 4) and boxes.dtype == np.float32
    assert scores.shape == labels.shape == (batch, 20) and labels.dtype == np.int64
    assert counts.shape == (batch,) and counts.dtype == np.int64
    for i, n in enumerate(counts):
        assert 0 <= n <= 20
        assert np.all(np.diff(scores[i, :n]) <= 0) and np.all(scores[i, :n] > 0.05)
        assert np.all((labels[i, :n] >= 0) & (labels[i, :n] < 10))
        assert np.all(labels[i, n:] == -1) and not boxes[i, n:].any() and not scores[i, n:].any()
        height, width = size
        assert np.all(boxes[i, :n, 0::2] >= 0) and np.all(boxes[i, :n, 0::2] <= width)
        assert np.all(boxes[i, :n, 1::2] >= 0) and np.all(boxes[i, :n, 1::2] <= height)


def test_the_report_scores_boxes_with_coco_metrics(detect_bundle):
    report = detect_bundle["report"]
    export, evaluation = report["export"], report["evaluation"]
    assert export["min_matched_iou"] >= 0.99 and export["count_mismatches"] == 0
    assert export["resolutions_checked"] == [f"{SIDE}x{SIDE}", "48x48"]
    assert export["nms"]["max_detections"] == 20
    assert 0.0 <= evaluation["map"] <= evaluation["map50"] <= 1.0
    assert evaluation["baseline_map"] == 0.0 and evaluation["verdict"]
    assert [row["label"] for row in evaluation["per_class"]] == [str(d) for d in range(10)]
    assert sum(row["instances"] for row in evaluation["per_class"]) == evaluation["instances"]
    assert len(evaluation["examples"]) == min(8, report["dataset"]["test"])
    assert report["train"]["metric"] == "map" and "val_map" in report["train"]
    assert report["calibration"] is None or "temperature" not in (report["calibration"] or {})
    assert "mAP@[.5:.95]" in detect_bundle["run"].stdout


def test_bn_adapts_through_the_bundle_s_batchnorm_graph_under_a_corruption(detect_bundle):
    folder = detect_bundle["dir"]
    bn = session(folder / "model.bn.onnx")
    assert [o.name for o in bn.get_outputs()] == OUTPUTS
    manifest = json.loads((folder / "model.json").read_text())
    assert manifest["extra_graphs"]["bn"]["batchnorm_layers"] > 0
    ttt = detect_bundle["report"]["ttt"]
    assert ttt["method"] == "bn" and ttt["metric"] == "map"
    assert [row["name"] for row in ttt["shifts"]] == ["contrast"]
    for row in (ttt["clean"], ttt["shifts"][0]):
        assert 0.0 <= row["map_source"] <= row["map50_source"] <= 1.0
        assert 0.0 <= row["map_bn"] <= row["map50_bn"] <= 1.0
    assert "mAP@.5" in ttt["verdict"]


def test_tta_fuses_the_default_views_in_one_graph_and_reports_the_map_change(detect_bundle):
    folder = detect_bundle["dir"]
    tta = session(folder / "model.tta.onnx")
    assert [o.name for o in tta.get_outputs()] == OUTPUTS
    boxes = tta.run(["boxes"], {"image": np.zeros((3, 1, SIDE, 40), np.float32)})[0]
    assert boxes.shape == (3, 20, 4)
    graph = json.loads((folder / "model.json").read_text())["extra_graphs"]["tta"]
    assert graph["views"] == "scale:0.75,scale:1.25"
    assert graph["fusion"]["fusion_iou"] == 0.55 and graph["min_matched_iou"] >= 0.99
    section = detect_bundle["report"]["tta"]
    assert section["transforms"] == graph["views"] and section["views"] == 3
    assert section["map_plain"] == detect_bundle["report"]["evaluation"]["map"]
    for key in ("map", "map50", "map_wbf", "map50_wbf", "map_plain", "map50_plain"):
        assert 0.0 <= section[key] <= 1.0
    assert section["cost_ratio"] > 0 and "mAP@[.5:.95]" in section["verdict"]
    assert "test mAP@[.5:.95] TTA" in detect_bundle["run"].stdout


def test_inference_alone_scores_the_same_test_split(detect_bundle, tmp_path):
    run = run_cli("inference.py", "--output_model", detect_bundle["model"], "--dataset_path",
                  detect_bundle["images"], "--annotations", detect_bundle["annotations"],
                  "--report_json", tmp_path / "r.json", "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-2000:]
    alone = json.loads((tmp_path / "r.json").read_text())["evaluation"]
    assert alone["map"] == pytest.approx(detect_bundle["report"]["evaluation"]["map"])
    assert alone["instances"] == detect_bundle["report"]["evaluation"]["instances"]


def test_a_coco_bundle_needs_its_annotations_named_again(detect_bundle):
    run = run_cli("inference.py", "--output_model", detect_bundle["model"], "--dataset_path",
                  detect_bundle["images"])
    assert_clean_failure(run, EXIT_USAGE, "--annotations")


def test_input_rows_are_the_graph_s_detections_scaled_to_each_image(detect_bundle, tmp_path):
    folder = tmp_path / "new"
    folder.mkdir()
    for name in sorted(p.name for p in detect_bundle["images"].iterdir())[:6]:
        picture = Image.open(detect_bundle["images"] / name)
        picture.resize((SIDE * 2, SIDE)).save(folder / name)  # twice as wide as trained
    out = tmp_path / "dets.jsonl"
    run = run_cli("inference.py", "--output_model", detect_bundle["model"], "--input", folder,
                  "--output", out, "--overlay", "true", "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-2000:]
    rows = pd.read_json(out, lines=True)
    graph = session(detect_bundle["model"])
    for name in sorted(p.name for p in folder.iterdir()):
        pixels = np.asarray(Image.open(folder / name).convert("L").resize((SIDE, SIDE),
                            Image.Resampling.BILINEAR), np.float32)[None, None] / 255.0
        boxes, scores, labels, counts = graph.run(OUTPUTS, {"image": pixels})
        mine = rows[rows["image"] == name].sort_values("score", ascending=False)
        assert len(mine) == counts[0]
        assert np.allclose(mine[["x1", "x2"]].to_numpy(), boxes[0, :counts[0], 0::2] * 2,
                           atol=1e-3)
        assert np.allclose(mine[["y1", "y2"]].to_numpy(), boxes[0, :counts[0], 1::2], atol=1e-3)
        assert mine["class_index"].tolist() == labels[0, :counts[0]].tolist()
    assert len(list((tmp_path / "dets_overlays").iterdir())) == 6
    assert "predictions:" in run.stdout
    # the summary counts images and boxes (issue 63: not "rows predicted" for images)
    summary = {line[2:28].rstrip(): line[29:] for line in run.stdout.splitlines()
               if line.startswith("  ")}
    assert summary["images read"] == summary["images predicted"] == "6"
    assert summary["boxes found"] == str(len(rows)) and "rows predicted" not in summary


def test_outputs_beside_the_output_are_checked_with_every_other_path(detect_bundle, tmp_path):
    """--input's COCO images file (OUTPUT-STEM_images.json) and overlay folder
    (OUTPUT-STEM_overlays) are checked, before any work, against every path of the run as
    --errors is: over a bundle's manifest, under --report_json, a symbolic link, a folder
    holding another output's PNG, a linked subfolder. Exit 2, one line, nothing changed."""
    folder = tmp_path / "new"
    (folder / "sub").mkdir(parents=True)
    for name in sorted(p.name for p in detect_bundle["images"].iterdir())[:2]:
        (folder / "sub" / name).write_bytes((detect_bundle["images"] / name).read_bytes())
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    for file in detect_bundle["dir"].glob("model.*"):  # a bundle named dets_images.onnx
        shutil.copy(file, bundle / file.name.replace("model.", "dets_images.", 1))
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "sub").mkdir(parents=True)
    (elsewhere / "sub" / "mine.png").write_bytes(b"the user's")
    (tmp_path / "linked_overlays").symlink_to(elsewhere)
    (tmp_path / "sublinked_overlays").mkdir()
    (tmp_path / "sublinked_overlays" / "sub").symlink_to(elsewhere / "sub")
    (tmp_path / "r_images.json").write_text("kept")
    before = {p: p.read_bytes() for p in [*bundle.iterdir(), tmp_path / "r_images.json"]}
    infer = ["inference.py", "--model", detect_bundle["model"], "--input", folder]
    coco = ["--output_format", "coco"]
    for command, phrases in [
            (["inference.py", "--model", bundle / "dets_images.onnx", "--input", folder,
              "--output", bundle / "dets.json", *coco], ["COCO images file", "manifest"]),
            ([*infer, "--output", tmp_path / "r.json", *coco, "--report_json",
              tmp_path / "r_images.json"], ["--report_json", "COCO images file"]),
            ([*infer, "--output", tmp_path / "s.csv", "--overlay", "true", "--report_json",
              tmp_path / "s_overlays"], ["overlay folder", "--report_json"]),
            ([*infer, "--output", tmp_path / "t.csv", "--overlay", "true", "--errors",
              tmp_path / "t_overlays" / "sub" / "x.png"], ["--errors", "would replace it"]),
            ([*infer, "--output", tmp_path / "linked.csv", "--overlay", "true"],
             ["overlay folder", "is a symbolic link"]),
            ([*infer, "--output", tmp_path / "sublinked.jsonl", "--overlay", "true"],
             ["sublinked_overlays/sub is a symbolic link inside"])]:
        run = run_cli(*command)
        assert_clean_failure(run, EXIT_USAGE, *phrases)
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in (elsewhere / "sub").iterdir()) == ["mine.png"]
    for name in ("r.json", "s.csv", "s_overlays", "t.csv", "linked.csv", "sublinked.jsonl"):
        assert not (tmp_path / name).exists(), name


def test_train_and_export_alone_bake_export_s_nms_thresholds(tmp_path):
    data = write_yolo_canvases(tmp_path / "yolo", 40, size=24, seed=1)
    model = tmp_path / "run" / "model.onnx"
    trained = run_cli("train.py", "--model_type", "object_detector", "--dataset_path", data,
                      "--epochs", "1", "--batch_size", "16", "--output_model", model,
                      "--no_progress", "true")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert not model.exists()
    exported = run_cli("export.py", "--dataset_path", data, "--output_model", model,
                       "--iou_threshold", "0.3", "--max_detections", "7", "--no_progress",
                       "true")
    assert exported.returncode == 0, exported.stderr[-2000:]
    manifest = json.loads(model.with_suffix(".json").read_text())
    assert manifest["preprocessing"]["nms"] == {"iou_threshold": 0.3, "score_threshold": 0.05,
                                                "max_detections": 7}
    boxes = session(model).run(["boxes"], {"image": np.zeros((2, 1, 24, 24), np.float32)})[0]
    assert boxes.shape == (2, 7, 4)


@pytest.mark.parametrize("flags,phrase", [
    (["--tta_merge", "max"], "--tta_merge"), (["--fp16", "true"], "--fp16"),
    (["--tta", "true", "--tta_transforms", "rotate:10"],
     "'rotate:10' does not fit detection models"),
    (["--ignore_index", "3"], "--ignore_index"),
    (["--ttt", "true", "--ttt_method", "tent"], "--ttt_method tent"),
    (["--eval_shift", "blur"], "add --ttt true")])
def test_flags_a_detector_does_not_take_are_refused_before_any_work(tmp_path, flags, phrase):
    run = run_cli("pipeline.py", "--model_type", "object_detector", "--dataset_path",
                  "builtin:digit_boxes", "--output_model", tmp_path / "m.onnx", *flags)
    assert_clean_failure(run, EXIT_USAGE, phrase)
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("flags", [["--iou_threshold", "0.3"], ["--annotations", "x.json"]])
def test_a_detector_s_flags_are_refused_for_a_classifier(tmp_path, flags):
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", *flags, "--output_model",
                  tmp_path / "m.onnx")
    assert_clean_failure(run, EXIT_USAGE, flags[0], "object_detector")


def test_a_folder_without_any_usable_image_is_a_data_error(tmp_path):
    root = tmp_path / "yolo"
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    (root / "images" / "a.png").write_bytes(b"not a png")
    (root / "labels" / "a.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    run = run_cli("pipeline.py", "--model_type", "object_detector", "--dataset_path", root,
                  "--output_model", tmp_path / "m.onnx")
    assert_clean_failure(run, EXIT_DATA)


def test_the_guide_s_python_snippet_reads_the_graph(detect_bundle, tmp_path):
    """docs/detection.md's "Calling the graph from another program", run as written beside a
    bundle and an image of the names it uses."""
    page = (Path(__file__).parents[1] / "docs" / "detection.md").read_text(encoding="utf-8")
    section = page.split("## Calling the graph from another program", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "runs" / "shelves").mkdir(parents=True)
    for name in ("model.onnx", "model.json"):
        (tmp_path / "runs" / "shelves" / name).symlink_to(detect_bundle["dir"] / name)
    first = sorted(detect_bundle["images"].iterdir())[0]
    (tmp_path / "shelf.png").write_bytes(first.read_bytes())
    (tmp_path / "snippet.py").write_text(snippet, encoding="utf-8")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    count = session(detect_bundle["model"]).run(["num_detections"], {"image": np.asarray(
        Image.open(first).convert("L"), np.float32)[None, None] / 255.0})[0][0]
    assert len(done.stdout.splitlines()) == count


def test_tta_and_ttt_on_new_images_are_refused_not_ignored(detect_bundle, tmp_path):
    run = run_cli("inference.py", "--model", detect_bundle["model"], "--input",
                  detect_bundle["images"], "--output", tmp_path / "d.csv", "--tta", "true")
    assert_clean_failure(run, EXIT_USAGE, "--input", "--tta")
    assert not (tmp_path / "d.csv").exists()
