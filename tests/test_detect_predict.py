"""A detector's batch inference (ttc/tasks/detect/predict.py) through a hand-made ONNX graph
that keeps the detection contract (input `image` (batch, 1, h, w); boxes, scores, labels,
num_detections padded to M = 5) without a trained model: per image two boxes whose coordinates
follow the image's size and a score that follows its pixels. The rows must be the graph's boxes
of each image (decoded at the training size) scaled back to the image's own size, the same in
CSV, JSONL and Parquet; the COCO results loadable by pycocotools; --min_score, error rows,
overlays, atomic outputs, and the flags' checks."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from config import build_parser, parse_config
from ttc.inputs.preprocess import decode_image_file
from ttc.tasks.detect.evaluate import detection_runner
from ttc.tasks.detect.overlay import class_colour
from ttc.tasks.detect.predict import DetectBatchOptions, predict_detections_input
from ttc.tasks.outputs import default_overlay_dir, images_json_path
from utils import ConfigError, DataError, ExportError

LABELS = ["=zero", "one", "two"]  # "=zero": a CSV cell that must not run as a formula
PREPROCESSING = {"kind": "detection", "image_size": [20, 24], "channels": 1}
M = 5
# name → (height, width, mode) as saved; photo.jpg is turned upright by its EXIF orientation
IMAGES = {"a.png": (20, 24, "L"), "b.png": (37, 50, "RGB"), "sub/c.jpg": (64, 30, "L"),
          "sub/d.png": (9, 80, "RGB"), "photo.jpg": (10, 26, "RGB")}
UPRIGHT = {"photo.jpg": (26, 10)}
GOOD = sorted(IMAGES)  # the listing's order
COLUMNS = ["image", "label", "class_index", "score", "x1", "y1", "x2", "y2", "error"]


def detection_graph():
    """Per image: class 1 at [W/4, H/4, 3W/4, H/2] scored 0.9, class 0 at [0, 0, W/2, H]
    scored half the image's mean pixel, then three padding rows (labels -1)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def const(name, value, dtype=np.float32):
        return numpy_helper.from_array(np.asarray(value, dtype), name)

    nodes = [
        helper.make_node("Shape", ["image"], ["shape"]),
        helper.make_node("Slice", ["shape", "zero", "one"], ["n"]),
        helper.make_node("Cast", ["shape"], ["shape_f"], to=TensorProto.FLOAT),
        helper.make_node("Gather", ["shape_f", "whwh_at"], ["whwh"]),
        helper.make_node("Mul", ["whwh", "box_a"], ["a"]),
        helper.make_node("Mul", ["whwh", "box_b"], ["b"]),
        helper.make_node("Unsqueeze", ["a", "zero"], ["a1"]),
        helper.make_node("Unsqueeze", ["b", "zero"], ["b1"]),
        helper.make_node("Concat", ["a1", "b1", "pad_boxes"], ["one_image"], axis=0),
        helper.make_node("Unsqueeze", ["one_image", "zero"], ["boxes1"]),
        helper.make_node("Concat", ["n", "m4"], ["boxes_shape"], axis=0),
        helper.make_node("Expand", ["boxes1", "boxes_shape"], ["boxes"]),
        helper.make_node("ReduceMean", ["image"], ["mean4"], axes=[1, 2, 3], keepdims=1),
        helper.make_node("Reshape", ["mean4", "column"], ["mean"]),
        helper.make_node("Mul", ["mean", "half"], ["score_b"]),
        helper.make_node("Concat", ["n", "one"], ["column_shape"], axis=0),
        helper.make_node("Expand", ["score_a1", "column_shape"], ["score_a"]),
        helper.make_node("Concat", ["n", "three"], ["pad_shape"], axis=0),
        helper.make_node("Expand", ["pad_scores1", "pad_shape"], ["pad_scores"]),
        helper.make_node("Concat", ["score_a", "score_b", "pad_scores"], ["scores"], axis=1),
        helper.make_node("Concat", ["n", "m"], ["labels_shape"], axis=0),
        helper.make_node("Expand", ["labels1", "labels_shape"], ["labels"]),
        helper.make_node("Expand", ["two", "n"], ["num_detections"]),
    ]
    initializers = [
        const("zero", [0], np.int64), const("one", [1], np.int64),
        const("three", [3], np.int64), const("m", [M], np.int64),
        const("m4", [M, 4], np.int64), const("column", [-1, 1], np.int64),
        const("whwh_at", [3, 2, 3, 2], np.int64), const("box_a", [0.25, 0.25, 0.75, 0.5]),
        const("box_b", [0.0, 0.0, 0.5, 1.0]), const("pad_boxes", np.zeros((M - 2, 4))),
        const("half", 0.5), const("score_a1", [[0.9]]), const("pad_scores1", np.zeros((1, 3))),
        const("labels1", [[1, 0, -1, -1, -1]], np.int64), const("two", [2], np.int64)]
    graph = helper.make_graph(
        nodes, "detections",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 1, "h", "w"])],
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["batch", M, 4]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", M]),
         helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch", M]),
         helper.make_tensor_value_info("num_detections", TensorProto.INT64, ["batch"])],
        initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def session():
    import onnxruntime as ort

    return ort.InferenceSession(detection_graph().SerializeToString(),
                                providers=["CPUExecutionProvider"])


def image_folder(root):
    rng = np.random.default_rng(7)
    for name, (height, width, mode) in IMAGES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        shape = (height, width) if mode == "L" else (height, width, 3)
        picture = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)
        if name in UPRIGHT:
            exif = Image.Exif()
            exif[0x0112] = 6  # turned 90 degrees: shown upright as (width, height)
            picture.save(path, exif=exif)
        else:
            picture.save(path)
    (root / "sub" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    return root


def own_size(name):
    height, width, _ = IMAGES[name]
    return UPRIGHT.get(name, (height, width))


def expected_rows(session, source, min_score=0.0):
    """The graph's detections of each image alone, scaled to its own size by hand."""
    rows = []
    for name in GOOD:
        x = decode_image_file(source / name, PREPROCESSING)[None]
        boxes, scores, labels, count = session.run(None, {"image": x})
        height, width = own_size(name)
        factors = np.array([width / 24, height / 20] * 2)
        for k in range(int(count[0])):
            if scores[0, k] >= min_score:
                rows.append([name, LABELS[labels[0, k]], int(labels[0, k]), float(scores[0, k]),
                             *(boxes[0, k] * factors)])
    return rows


def read_rows(path):
    if path.suffix == ".csv":
        return pd.read_csv(path, keep_default_na=False, na_values=[""])
    if path.suffix == ".jsonl":
        return pd.DataFrame([json.loads(line) for line in path.read_text().splitlines()])
    return pd.read_parquet(path)


def box_rows(frame):
    good = frame[frame["error"].fillna("") == ""]
    return [[r.image, r.label.lstrip("'"), int(r.class_index), float(r.score), float(r.x1),
             float(r.y1), float(r.x2), float(r.y2)] for r in good.itertuples()]


def plain_cells(frame):
    """The table's cells as Python values (numbers as floats, empty cells and empty strings as None,
    a CSV label's neutralising quote dropped), to compare one format with another."""
    def cell(value):
        if value is None or value == "" or (isinstance(value, float) and np.isnan(value)):
            return None
        return float(value) if isinstance(value, (int, float, np.number)) else \
            str(value).lstrip("'")

    return [[cell(v) for v in row] for row in frame.itertuples(index=False)]


def assert_same_rows(got, want):
    assert [r[:3] for r in got] == [r[:3] for r in want]
    np.testing.assert_allclose([r[3] for r in got], [r[3] for r in want], atol=1e-6)
    np.testing.assert_allclose([r[4:] for r in got], [r[4:] for r in want], atol=1e-4)


def test_rows_are_the_graph_s_boxes_at_each_image_s_size_in_every_format(session, tmp_path):
    source = image_folder(tmp_path / "in")
    want = expected_rows(session, source)
    for name in GOOD:  # the boxes follow the size: class 1 at [W/4, H/4, 3W/4, H/2]
        height, width = own_size(name)
        [row] = [r for r in want if r[0] == name and r[2] == 1]
        np.testing.assert_allclose(row[4:], [width / 4, height / 4, 3 * width / 4, height / 2],
                                   rtol=1e-5)
    frames = {}
    for fmt in ("csv", "jsonl", "parquet"):
        output = tmp_path / fmt / f"dets.{fmt}"
        shapes, report = [], {}

        def run(x):  # a batch at a time, never the whole folder
            shapes.append(x.shape)
            return detection_runner(session)(x)

        options = DetectBatchOptions(source, output, batch_size=4, allow_errors=True,
                                     errors=tmp_path / f"errors_{fmt}.csv", show_progress=False)
        predict_detections_input(options, PREPROCESSING, LABELS, run, report)
        # sorted: a, b, photo, sub/bad (not decoded) | sub/c, sub/d
        assert shapes == [(3, 1, 20, 24), (2, 1, 20, 24)]
        frame = read_rows(output)
        assert list(frame.columns) == COLUMNS
        assert_same_rows(box_rows(frame), want)
        bad = frame[frame["image"] == "sub/bad.png"]
        assert len(bad) == 1 and bad["error"].iloc[0].startswith("unreadable image: ")
        assert bad[["label", "score", "x1"]].isna().all(axis=None)
        assert pd.read_csv(tmp_path / f"errors_{fmt}.csv")["id"].tolist() == ["sub/bad.png"]
        section = report["predictions"]
        assert {k: section[k] for k in ("images", "predicted", "errors", "boxes",
                                        "images_without_detections")} == \
            {"images": 6, "predicted": 5, "errors": 1, "boxes": 10,
             "images_without_detections": 0}
        assert section["boxes_per_class"] == {"=zero": 5, "one": 5, "two": 0}
        assert section["output_format"] == "rows" and section["images_json"] is None
        assert section["overlay_dir"] is None and not default_overlay_dir(output).exists()
        json.dumps(section)
        frames[fmt] = plain_cells(frame)
    assert ",'=zero,0," in (tmp_path / "csv" / "dets.csv").read_text()  # batch.py's neutralised
    assert frames["jsonl"] == frames["parquet"] == frames["csv"]


def test_coco_results_and_their_images_load_in_pycocotools(session, tmp_path):
    from pycocotools.coco import COCO

    source = image_folder(tmp_path / "in")
    output = tmp_path / "dets.json"
    report = {}
    predict_detections_input(DetectBatchOptions(source, output, output_format="coco",
                                                allow_errors=True, show_progress=False),
                             PREPROCESSING, LABELS, detection_runner(session), report)
    results = json.loads(output.read_text())
    images = json.loads(images_json_path(output).read_text())
    assert images["categories"] == [{"id": k + 1, "name": label}
                                    for k, label in enumerate(LABELS)]
    names = sorted([*GOOD, "sub/bad.png"])
    assert [image["file_name"] for image in images["images"]] == names
    assert [image["id"] for image in images["images"]] == list(range(len(names)))
    bad = images["images"][names.index("sub/bad.png")]
    assert bad["error"].startswith("unreadable image: ") and "height" not in bad
    by_id = {image["id"]: image for image in images["images"]}
    for name in GOOD:
        assert (by_id[names.index(name)]["height"], by_id[names.index(name)]["width"]) == \
            own_size(name)
    assert all(set(r) == {"image_id", "category_id", "bbox", "score"} for r in results)
    got = [[by_id[r["image_id"]]["file_name"], LABELS[r["category_id"] - 1],
            r["category_id"] - 1, r["score"], r["bbox"][0], r["bbox"][1],
            r["bbox"][0] + r["bbox"][2], r["bbox"][1] + r["bbox"][3]] for r in results]
    assert_same_rows(got, expected_rows(session, source))
    assert report["predictions"]["images_json"] == str(images_json_path(output))
    truth = COCO(str(images_json_path(output)))  # the images file is a COCO dataset's part
    loaded = truth.loadRes(str(output))
    assert len(loaded.getAnnIds()) == len(results) == 10


def test_min_score_keeps_the_boxes_scored_at_least_it(session, tmp_path):
    source = image_folder(tmp_path / "in")
    means = {name: 0.5 * decode_image_file(source / name, PREPROCESSING).mean()
             for name in GOOD}
    threshold = float(np.median(list(means.values())))  # some images keep their class-0 box
    output = tmp_path / "dets.jsonl"
    report = {}
    predict_detections_input(DetectBatchOptions(source, output, min_score=threshold,
                                                allow_errors=True, show_progress=False),
                             PREPROCESSING, LABELS, detection_runner(session), report)
    want = expected_rows(session, source, threshold)
    assert 5 < len(want) < 10
    assert_same_rows(box_rows(read_rows(output)), want)
    assert report["predictions"]["boxes"] == len(want)
    assert report["predictions"]["min_score"] == threshold

    predict_detections_input(DetectBatchOptions(source, output, min_score=0.95,
                                                allow_errors=True, show_progress=False),
                             PREPROCESSING, LABELS, detection_runner(session), report)
    frame = read_rows(output)
    assert frame["image"].tolist() == ["sub/bad.png"]  # only the error row
    assert report["predictions"]["images_without_detections"] == 5
    assert report["predictions"]["boxes"] == 0


def test_overlays_at_each_image_s_own_size_with_the_boxes_drawn(session, tmp_path):
    source = image_folder(tmp_path / "in")
    output = tmp_path / "out" / "dets.csv"
    report = {}
    predict_detections_input(DetectBatchOptions(source, output, overlay=True,
                                                allow_errors=True, show_progress=False),
                             PREPROCESSING, LABELS, detection_runner(session), report)
    folder = tmp_path / "out" / "dets_overlays"
    assert report["predictions"]["overlay_dir"] == str(folder)
    names = {"a.png": "a.png", "b.png": "b.png", "sub/c.jpg": "sub/c.png",
             "sub/d.png": "sub/d.png", "photo.jpg": "photo.png"}
    for name, overlay in names.items():
        height, width = own_size(name)
        with Image.open(folder / overlay) as picture:
            assert picture.mode == "RGB" and picture.size == (width, height)
            pixels = np.asarray(picture)
        # the class-1 box's left edge at x = W/4 (y from H/4 to H/2) in class 1's colour
        edge = pixels[height // 4:-(-height // 2), max(0, width // 4 - 1):width // 4 + 2]
        assert (edge == class_colour(1)).all(axis=-1).any(), name
    assert not (folder / "sub" / "bad.png").exists()


def test_failures_keep_or_leave_the_output_as_batch_py_does(session, tmp_path):
    source = image_folder(tmp_path / "in")
    output = tmp_path / "dets.csv"
    with pytest.raises(DataError, match=r"1 of 6 images could not be predicted"):
        predict_detections_input(DetectBatchOptions(source, output, show_progress=False),
                                 PREPROCESSING, LABELS, detection_runner(session), {})
    assert len(read_rows(output)) == 11  # written: the other detections are usable

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("x.png", "y.jpg"):
        (broken / name).write_bytes(b"garbage")
    output.write_text("previous\n")
    with pytest.raises(DataError, match="none of the 2 images"):
        predict_detections_input(DetectBatchOptions(broken, output, allow_errors=True,
                                                    errors=tmp_path / "e.csv"),
                                 PREPROCESSING, LABELS, detection_runner(session), {})
    assert output.read_text() == "previous\n"
    assert len(pd.read_csv(tmp_path / "e.csv")) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="holds no image"):
        predict_detections_input(DetectBatchOptions(empty, output), PREPROCESSING, LABELS,
                                 detection_runner(session), {})


@pytest.mark.parametrize("suffix", ["csv", "parquet", "json"])
def test_a_run_that_fails_midway_leaves_no_partial_output(session, tmp_path, suffix):
    source = image_folder(tmp_path / "in")
    output = tmp_path / "out" / f"dets.{suffix}"
    output.parent.mkdir()
    output.write_bytes(b"previous")
    calls = []

    def run(x):  # the second batch holds a class the model does not have
        calls.append(len(x))
        found = detection_runner(session)(x)
        if len(calls) == 2:
            boxes, scores, labels = found[0]
            found[0] = (boxes, scores, labels + 7)
        return found

    with pytest.raises(ExportError, match="outside its 3 classes"):
        predict_detections_input(
            DetectBatchOptions(source, output, output_format="coco" if suffix == "json"
                               else "rows", batch_size=2, allow_errors=True,
                               show_progress=False), PREPROCESSING, LABELS, run, {})
    assert calls == [2, 1]  # a, b | photo, sub/bad (not decoded)
    assert output.read_bytes() == b"previous"
    assert sorted(p.name for p in output.parent.iterdir()) == [output.name]  # no temp files


def test_bad_options_are_refused_before_any_work(tmp_path):
    source = image_folder(tmp_path / "in")

    def never(x):
        raise AssertionError("nothing may run")

    for options, message in [
            (DetectBatchOptions(source, tmp_path / "d.json"), r"\.csv, \.jsonl or \.parquet"),
            (DetectBatchOptions(source, tmp_path / "d.csv", output_format="coco"), r"\.json"),
            (DetectBatchOptions(source, tmp_path / "d.csv", output_format="voc"), "not one of"),
            (DetectBatchOptions(source, tmp_path / "d.csv", min_score=1.5), "min_score"),
            (DetectBatchOptions(source, source / "d.csv", overlay=True), "overlap"),
            (DetectBatchOptions(tmp_path / "missing", tmp_path / "d.csv"), "does not exist")]:
        with pytest.raises((ConfigError, DataError), match=message):
            predict_detections_input(options, PREPROCESSING, LABELS, never, {})
    assert not (tmp_path / "d.csv").exists() and not (tmp_path / "d.json").exists()


def test_the_flags_are_checked_and_refused_for_other_model_types():
    parser = build_parser("inference", "")

    def config(*argv):
        return parse_config(parser, ["--output_model", "m.onnx", "--input", "in", *argv])

    def checked(cfg):
        cfg.check_batch(lambda: 1, False, False)
        return cfg

    checked(config("--output", "d.json", "--output_format", "coco", "--min_score", "0.5"))
    with pytest.raises(ConfigError, match="--output 'd.csv'") as refused:
        checked(config("--output", "d.csv", "--output_format", "coco"))
    assert "give a path ending in .json" in refused.value.hint
    with pytest.raises(ConfigError, match="--output 'd.json'") as refused:
        checked(config("--output", "d.json"))
    assert refused.value.hint.startswith("give a path ending in .csv, .jsonl or .parquet")
    with pytest.raises(ConfigError, match="--min_score"):
        checked(config("--output", "d.csv", "--min_score", "2"))
    detector_flags = config("--output", "d.json", "--output_format", "coco", "--min_score", "0.5")
    detector_flags.refuse_flags_for("object_detector")
    for model_type in ("image_classifier", "image_segmenter"):
        with pytest.raises(ConfigError, match="--output_format is for an object_detector"):
            detector_flags.refuse_flags_for(model_type)


def test_overlay_names_that_clash_fail_only_with_overlays(tmp_path):
    from ttc.tasks.detect.predict import listed_detection_images

    for name in ("a.jpg", "a.png", "a.jpg.png"):  # a.jpg's overlay is a.jpg.png, as segment's
        Image.fromarray(np.zeros((4, 4), np.uint8)).save(tmp_path / name)
    assert [item.error for item in listed_detection_images(tmp_path, False)] == ["", "", ""]
    errors = [item.error for item in listed_detection_images(tmp_path, True)]
    assert errors[0] == errors[2] == ""
    assert errors[1].startswith("its overlay name a.jpg.png is another image's")


def test_the_inference_path_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys, onnxruntime, ttc.tasks.detect.predict, ttc.tasks.detect.evaluate; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=root)
