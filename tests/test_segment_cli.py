"""`--model_type image_segmenter` through the CLIs (issue 43): one pipeline run on tiny digit
canvases (training in the DSPy program, export with the mask in the graph, the TTA and BatchNorm
graphs, mean IoU, TTA and bn under a corruption) whose bundle the other tests read with ONNX
Runtime; inference.py alone on the test split and on new images (`--input`); train.py and
export.py alone; and the flags and data a segmenter refuses, each with its exit code."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pandas as pd
import pytest
from PIL import Image

from conftest import assert_clean_failure, run_cli

from utils import EXIT_DATA, EXIT_USAGE

SIDE = 20

def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

def test_the_bundle_holds_the_three_graphs_and_a_segmenter_s_manifest(segment_bundle):
    folder = segment_bundle["dir"]
    for name in ("model.onnx", "model.bn.onnx", "model.tta.onnx", "model.pt", "model.json"):
        assert (folder / name).is_file(), name
    manifest = json.loads((folder / "model.json").read_text())
    assert manifest["model_type"] == "image_segmenter"
    assert manifest["input"]["shape"] == ["batch", 1, "height", "width"]
    assert [o["name"] for o in manifest["outputs"]] == ["logits", "probabilities", "mask"]
    assert manifest["outputs"][2]["shape"] == ["batch", "height", "width"]
    assert manifest["preprocessing"]["ignore_index"] == 255
    assert manifest["labels"][0] == "background" and len(manifest["labels"]) == 11
    assert manifest["extra_graphs"]["tta"]["views"] == "hflip"
    assert sum(manifest["dataset"]["train_class_counts"]) == \
        segment_bundle["report"]["dataset"]["train"] * SIDE * SIDE  # pixels, no void here

@pytest.mark.parametrize("size", [(SIDE, SIDE), (31, 17)])
def test_the_graph_s_mask_is_the_argmax_of_its_logits_at_any_size(segment_bundle, size):
    graph = session(segment_bundle["model"])
    x = np.random.default_rng(0).random((3, 1, *size), dtype=np.float32)
    logits, probabilities, mask = graph.run(None, {"image": x})
    assert logits.shape == probabilities.shape == (3, 11, *size)
    assert mask.shape == (3, *size) and mask.dtype == np.int64
    assert np.array_equal(mask, logits.argmax(axis=1))
    calibration = json.loads(Path(segment_bundle["model"]).with_suffix(".json").read_text()
                             ).get("calibration") or {}
    temperature = calibration.get("temperature", 1.0)
    scaled = logits / temperature  # the graph's softmax over the class axis, written out
    expected = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    assert np.allclose(probabilities, expected / expected.sum(axis=1, keepdims=True), atol=1e-6)

def test_the_report_scores_pixels(segment_bundle):
    report = segment_bundle["report"]
    export, evaluation = report["export"], report["evaluation"]
    assert export["mask_agreement"] >= 0.9999 and export["max_abs_diff"] < 1e-3
    assert export["resolutions_checked"] == [f"{SIDE}x{SIDE}", "30x30"]
    assert 0 <= evaluation["mean_iou"] <= evaluation["pixel_accuracy"] <= 1 or \
        evaluation["mean_iou"] <= 1
    assert set(evaluation["per_class"]) == set(json.loads(
        (segment_bundle["dir"] / "model.json").read_text())["labels"])
    assert {"iou", "dice", "pixels"} <= set(evaluation["per_class"]["background"])
    matrix = np.array(evaluation["confusion_matrix"])
    assert matrix.sum() == evaluation["pixels"] == report["dataset"]["test"] * SIDE * SIDE
    assert evaluation["pixel_accuracy"] == pytest.approx(np.trace(matrix) / matrix.sum())
    assert len(evaluation["examples"]) == min(8, report["dataset"]["test"])
    assert report["inference"]["mean_iou"] == evaluation["mean_iou"]
    assert report["inference"]["model_path"].endswith("model.int8.onnx")
    assert report["train"]["val_mean_iou"] == report["train"]["val_accuracy"]
    tta, ttt = report["tta"], report["ttt"]
    # TTA and bn are compared with the fp32 graph (the int8 one serves: see below)
    assert tta["transforms"] == "hflip" and tta["cost_ratio"] > 0
    assert ttt["metric"] == "mean_iou" and [s["name"] for s in ttt["shifts"]] == \
        ["gaussian_noise"]
    assert ttt["clean"]["mean_iou_source"] == pytest.approx(tta["mean_iou_plain"])
    summary = segment_bundle["run"].stderr + (segment_bundle["dir"] / "report.html").read_text()
    assert "mean IoU" in summary

def test_the_summary_says_pixel_accuracy_and_mean_iou_with_their_values(segment_bundle):
    """Issue 63: the run's summary shows the segmenter's training mean IoUs under that name (not
    as "train accuracy"), and its pixel accuracy and mean IoU as the report holds them."""
    from ttc.reporting.summary import fmt

    report, lines = segment_bundle["report"], segment_bundle["run"].stdout.splitlines()
    blocks: dict[str, dict[str, str]] = {}
    for line in lines:
        if line and not line.startswith(" ") and line.endswith(":"):
            blocks[line[:-1]] = rows = {}
        elif line.startswith("  ") and blocks:
            rows[line[2:28].rstrip()] = line[29:]
    train, evaluation = blocks["train"], blocks["evaluation"]
    assert train["train mean IoU"] == fmt(report["train"]["train_mean_iou"])
    assert train["val mean IoU"] == fmt(report["train"]["val_mean_iou"])
    assert "train accuracy" not in train and "val accuracy" not in train
    assert evaluation["pixel accuracy"] == fmt(report["evaluation"]["pixel_accuracy"])
    assert evaluation["mean IoU"] == fmt(report["evaluation"]["mean_iou"])

def test_int8_is_judged_on_mean_iou_and_serves_the_masks(segment_bundle):
    """--quantize static for a segmenter: judged on validation mean IoU (forced into use here,
    so the inference stage runs the int8 graph, whose masks it scores)."""
    report = segment_bundle["report"]
    quantize = report["quantize"]
    assert quantize["metric"] == "mean_iou" and "mean IoU" in quantize["verdict"]
    assert quantize["used_for_inference"] and report["inference"]["model_path"].endswith(
        "model.int8.onnx")
    int8 = session(segment_bundle["dir"] / "model.int8.onnx")
    x = np.random.default_rng(2).random((2, 1, SIDE, SIDE), dtype=np.float32)
    logits, _, mask = int8.run(None, {"image": x})
    assert np.array_equal(mask, logits.argmax(axis=1))
    assert report["evaluation"]["mean_iou"] == pytest.approx(quantize["accuracy"])

def test_tent_minimises_pixel_entropy_beside_bn(segment_bundle):
    """--ttt_method all: bn and tent (entropy over each pixel's classes, EATA's pixel filter),
    each scored by mean IoU next to the source graph on the same corrupted images."""
    run = run_cli("inference.py", "--model", segment_bundle["model"], "--dataset_path",
                  segment_bundle["data"], "--ttt", "true", "--ttt_method", "all",
                  "--eval_shift", "contrast", "--batch_size", "8", "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    ttt = json.loads(run.stdout)["ttt"]
    assert ttt["method"] == "all" and ttt["guard"] == "filter" and ttt["predict"] == "after"
    for row in (ttt["clean"], *ttt["shifts"]):
        assert {"mean_iou_source", "mean_iou_bn", "mean_iou_tent"} <= set(row)
        assert 0 <= row["mean_iou_tent"] <= 1 and row["cost_ratio_tent"] > 0
    assert ttt["clean"]["mean_iou_source"] == pytest.approx(
        segment_bundle["report"]["ttt"]["clean"]["mean_iou_source"])
    assert "tent" in ttt["verdict"]

def test_inference_alone_scores_the_same_test_split(segment_bundle):
    """The int8 graph the pipeline served (--quantized true), on the same split."""
    run = run_cli("inference.py", "--model", segment_bundle["model"], "--dataset_path",
                  segment_bundle["data"], "--quantized", "true", "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report["evaluation"]["mean_iou"] == segment_bundle["report"]["evaluation"]["mean_iou"]
    assert report["evaluation"]["confusion_matrix"] == \
        segment_bundle["report"]["evaluation"]["confusion_matrix"]

def test_input_masks_are_the_test_split_s(segment_bundle, tmp_path):
    """--input on the test split's own files: each mask PNG holds the indices the graph gives
    those images as the evaluation decoded them."""
    from ttc.inputs.data import DataOptions
    from ttc.tasks.segment.data import load_segmentation_dataset

    manifest = json.loads((segment_bundle["dir"] / "model.json").read_text())
    data = segment_bundle["data"]
    test = load_segmentation_dataset(
        DataOptions(path=str(data), model_type="image_segmenter", show_progress=False),
        preprocessing=manifest["preprocessing"], labels=manifest["labels"],
        splits=("test",)).test
    folder = tmp_path / "new"
    folder.mkdir()
    for name in test.ids:
        (folder / name).write_bytes((data / "images" / name).read_bytes())
    (folder / "broken.png").write_bytes(b"not a png")
    output = tmp_path / "out" / "preds.parquet"
    run = run_cli("inference.py", "--model", segment_bundle["model"], "--input", folder,
                  "--output", output, "--overlay", "true", "--allow_errors", "true")
    assert run.returncode == 0, run.stderr[-2000:]
    expected = session(segment_bundle["model"]).run(["mask"], {"image": test.x})[0]
    for k, name in enumerate(test.ids):
        written = np.asarray(Image.open(tmp_path / "out" / "preds_masks" / name))
        assert np.array_equal(written, expected[k]), name
        assert (tmp_path / "out" / "preds_overlays" / name).is_file()
    table = pd.read_parquet(output)
    assert len(table) == len(test.ids) + 1
    broken = table[table["id"] == "broken.png"].iloc[0]
    assert broken["error"] and not broken["mask"]
    shares = table[table["error"] == ""].filter(like="share_").to_numpy()
    assert np.allclose(shares.sum(axis=1), 1.0)

def test_the_mask_and_overlay_folders_are_real_folders_of_their_own(segment_bundle, tmp_path):
    """The folders a segmenter's --input fills beside --output (OUTPUT-STEM_masks, and
    OUTPUT-STEM_overlays) are refused, exit 2 before any file is written, when they are a
    symbolic link, hold a linked subfolder, or would hold the plots; a --mask_dir the user
    names is used as named, link or not (as --plots is)."""
    folder = tmp_path / "new"
    (folder / "sub").mkdir(parents=True)
    image = sorted((segment_bundle["data"] / "images").iterdir())[0]
    (folder / "sub" / "a.png").write_bytes(image.read_bytes())
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "sub").mkdir(parents=True)
    (elsewhere / "sub" / "a.png").write_bytes(b"the user's")
    (tmp_path / "linked_masks").symlink_to(elsewhere)
    (tmp_path / "over_overlays").symlink_to(elsewhere)
    (tmp_path / "deep_masks").mkdir()
    (tmp_path / "deep_masks" / "sub").symlink_to(elsewhere / "sub")
    infer = ["inference.py", "--model", segment_bundle["model"], "--input", folder]
    for command, phrases in [
            ([*infer, "--output", tmp_path / "linked.csv"], ["mask folder", "symbolic link"]),
            ([*infer, "--output", tmp_path / "over.csv", "--overlay", "true"],
             ["overlay folder", "symbolic link"]),
            ([*infer, "--output", tmp_path / "deep.csv"], ["deep_masks/sub is a symbolic link"]),
            ([*infer, "--output", tmp_path / "p.csv", "--report_json", tmp_path / "r.json",
              "--plots", tmp_path / "p_masks"], ["--plots", "would replace it"])]:
        run = run_cli(*command)
        assert_clean_failure(run, EXIT_USAGE, *phrases)
    assert (elsewhere / "sub" / "a.png").read_bytes() == b"the user's"
    assert not any((tmp_path / name).exists() for name in ("linked.csv", "over.csv", "deep.csv",
                                                            "p.csv", "p_masks"))
    run = run_cli(*infer, "--output", tmp_path / "named.csv", "--mask_dir",
                  tmp_path / "linked_masks")
    assert run.returncode == 0, run.stderr[-2000:]
    with Image.open(elsewhere / "sub" / "a.png") as mask:
        assert mask.mode == "P"

def test_train_and_export_alone_make_the_same_kind_of_bundle(segment_bundle, tmp_path):
    model = tmp_path / "alone" / "model.onnx"
    common = ["--dataset_path", segment_bundle["data"], "--no_progress", "true"]
    run = run_cli("train.py", "--model_type", "image_segmenter", "--epochs", "1",
                  "--batch_size", "16", "--output_model", model, *common)
    assert run.returncode == 0, run.stderr[-2000:]
    assert not model.exists() and model.with_suffix(".pt").is_file()
    run = run_cli("export.py", "--output_model", model, "--tta", "true", "--tta_transforms",
                  "vflip,scale:0.5", *common)
    assert run.returncode == 0, run.stderr[-2000:]
    manifest = json.loads(model.with_suffix(".json").read_text())
    assert manifest["extra_graphs"]["tta"]["views"] == "vflip,scale:0.5"
    x = np.random.default_rng(1).random((2, 1, 15, 22), dtype=np.float32)
    logits, _, mask = session(model.with_suffix(".tta.onnx")).run(None, {"image": x})
    assert mask.shape == (2, 15, 22) and np.array_equal(mask, logits.argmax(axis=1))

@pytest.mark.parametrize("flags, phrase", [
    (["--ensemble_size", "3"], "--ensemble_size does not apply to an image_segmenter"),
    (["--ttt", "true", "--ttt_mode", "online"], "each batch on its own"),
    (["--ttt", "true", "--eval_shift", "shift"], "unknown --eval_shift corruption 'shift'"),
    (["--eval_shift", "blur"], "add --ttt true"),
    (["--tta", "true", "--tta_transforms", "rotate:10"], "does not fit segmentation models"),
    (["--ignore_index", "300"], "--ignore_index"),
])
def test_flags_a_segmenter_does_not_take_are_refused_before_any_work(tmp_path, flags, phrase):
    run = run_cli("pipeline.py", "--model_type", "image_segmenter", "--dataset_path",
                  "builtin:digit_canvases", "--output_model", tmp_path / "m.onnx", *flags)
    assert_clean_failure(run, EXIT_USAGE, phrase)
    assert not (tmp_path / "m.onnx").exists()

def test_ignore_index_is_refused_for_a_classifier(tmp_path):
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--ignore_index", "3",
                  "--output_model", tmp_path / "m.onnx")
    assert_clean_failure(run, EXIT_USAGE, "--ignore_index", "no masks")

def test_a_folder_without_masks_is_a_data_error(tmp_path):
    (tmp_path / "data" / "images").mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "data" / "images" / "a.png")
    run = run_cli("pipeline.py", "--model_type", "image_segmenter", "--dataset_path",
                  tmp_path / "data", "--output_model", tmp_path / "m.onnx")
    assert_clean_failure(run, EXIT_DATA, "has no masks/ folder")

def test_a_segmenter_s_int8_takes_the_asked_weight_range(segment_bundle, tmp_path):
    """--int8_range reduced (issue 61: 7-bit weights for CPUs without VNNI) for a segmenter:
    int8 weights in [-64, 64], judged on mean IoU, recorded in report and manifest."""
    import onnx
    from onnx import numpy_helper

    from conftest import copy_bundle

    model = copy_bundle(segment_bundle, tmp_path / "bundle")
    run = run_cli("quantize.py", "--output_model", model, "--dataset_path",
                  segment_bundle["data"], "--quantize", "static", "--int8_range", "reduced",
                  "--report_json", "-")
    assert run.returncode == 0, run.stderr[-3000:]
    quantize = json.loads(run.stdout)["quantize"]
    assert quantize["metric"] == "mean_iou" and quantize["reduce_range"] is True
    weights = [numpy_helper.to_array(init)
               for init in onnx.load(str(model.with_suffix(".int8.onnx"))).graph.initializer
               if init.data_type == onnx.TensorProto.INT8]
    assert weights and all(w.min() >= -64 and w.max() <= 64 for w in weights)
    record = json.loads(model.with_suffix(".json").read_text())["quantization"]
    assert record["reduce_range_reason"] == "--int8_range reduced"

def test_a_reload_onto_a_segmenter_keeps_the_classifier_serving(segment_bundle, tmp_path):
    """A reload onto a segmenter (its files copied over the served classifier's) is refused,
    400 with one line (a reload keeps the model type), and the classifier keeps answering (it
    was {"loaded": true}, then every prediction 500)."""
    import shutil

    from test_serve import serving

    served = tmp_path / "served" / "model.onnx"
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:iris", "--epochs", "1", "--plots", "none", "--no_progress", "true",
                  "--output_model", served)
    assert run.returncode == 0, run.stderr[-3000:]
    row = {name: 1.0 for name in json.loads(served.with_suffix(".json").read_text())
           ["preprocessing"]["feature_names"]}
    with serving(served, logs=tmp_path) as server:
        version = server.version()
        for path in segment_bundle["dir"].glob("model.*"):
            shutil.copyfile(path, served.parent / f".{path.name}.new")
            (served.parent / f".{path.name}.new").replace(served.parent / path.name)
        reload = server.post("/v2/repository/models/model/load")
        assert reload.status_code == 400, reload.text
        assert reload.json()["loaded"] is False and reload.json()["version"] == version
        assert "a reload keeps the model type" in reload.json()["error"]
        assert server.version() == version
        assert len(server.predict([row])) == 1
