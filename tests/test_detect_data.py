"""The detection data layer: digit-box canvases (ttc/tasks/detect/canvases.py) and the YOLO and
COCO readers (ttc/tasks/detect/data.py, yolo.py, coco.py) on tiny files: both formats read to
the generator's boxes, every bad annotation counted with its reason, the errors' types (exit
codes), split folders, data.yaml names and the builtin."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import assert_clean_failure, run_cli
from ttc.inputs.data import DataOptions
from ttc.tasks.detect import coco, tally, yolo
from ttc.tasks.detect.canvases import (BUILTIN, CLASS_NAMES, MAX_IOU, box_iou,
                                       digit_box_canvases, digit_sides, write_coco_canvases,
                                       write_yolo_canvases)
from ttc.tasks.detect.data import load_detection_dataset
from utils import EXIT_DATA, EXIT_USAGE, ConfigError, DataError


def options(path: Path | str, **kw) -> DataOptions:
    return DataOptions(path=str(path), model_type="object_detector", show_progress=False, **kw)


def every_image(dataset) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """id → (x, boxes) over all splits."""
    return {ident: (split.x[i], split.y[i]) for split in dataset.splits.values()
            for i, ident in enumerate(split.ids)}


def reasons(dataset) -> dict[str, int]:
    return {d["reason"]: d["count"] for d in dataset.dropped}


def save(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


def test_canvases_are_deterministic_with_tight_boxes_that_hardly_overlap(tmp_path):
    images, boxes = digit_box_canvases(30, size=48, seed=0)
    again, same = digit_box_canvases(30, size=48, seed=0)
    other, _ = digit_box_canvases(30, size=48, seed=1)
    assert images.shape == (30, 48, 48) and images.dtype == np.uint8
    assert np.array_equal(images, again) and all(np.array_equal(a, b) for a, b in zip(boxes, same))
    assert not np.array_equal(images, other)
    assert digit_sides(96) == (16, 40) and digit_sides(48) == (8, 20)
    assert CLASS_NAMES == tuple("0123456789")
    for image, found in zip(images, boxes):
        assert found.dtype == np.float32 and found.shape[1] == 5 and 1 <= len(found) <= 5
        assert set(found[:, 0]) <= set(range(10)) and (found[:, 1:] == found[:, 1:].round()).all()
        for c, x1, y1, x2, y2 in found.astype(int):
            assert 0 <= x1 < x2 <= 48 and 0 <= y1 < y2 <= 48
            inside = image[y1:y2, x1:x2] > 127  # stroke: glyph over 0.5, noise under 0.25
            assert inside[0].any() and inside[-1].any()  # tight: strokes on every edge
            assert inside[:, 0].any() and inside[:, -1].any()
        pairs = [(a, b) for i, a in enumerate(found) for b in found[i + 1:]]
        assert all(box_iou(a[1:], b[1:]) <= MAX_IOU for a, b in pairs)
        assert 0 < np.median(image) <= 0.25 * 255  # the background: faint noise
    assert len({int(c) for found in boxes for c in found[:, 0]}) == 10


def test_yolo_and_coco_files_read_to_the_generator_s_boxes_at_any_size(tmp_path):
    root = write_yolo_canvases(tmp_path / "yolo", 20, size=48, seed=3)
    json_path = write_coco_canvases(tmp_path / "coco", tmp_path / "coco.json", 20, size=48,
                                    seed=3)
    _, truth = digit_box_canvases(20, size=48, seed=3)
    first = (root / "labels/00000.txt").read_text().splitlines()[0].split()
    assert len(first) == 5 and first[0] in CLASS_NAMES and all(0 < float(v) < 1 for v in first[1:])
    document = json.loads(json_path.read_text())
    assert document["images"][0] == {"id": 1, "file_name": "00000.png", "width": 48, "height": 48}
    assert [c["id"] for c in document["categories"]] == list(range(1, 11))
    assert {a["iscrowd"] for a in document["annotations"]} == {0}
    for size in (None, (24, 36)):
        read = [load_detection_dataset(options(root, image_size=size)),
                load_detection_dataset(options(tmp_path / "coco", annotations=str(json_path),
                                               image_size=size))]
        scale = np.array([1, 1, 1, 1, 1.0]) if size is None else np.array(
            [1, 36 / 48, 24 / 48, 36 / 48, 24 / 48])
        for dataset in read:
            assert dataset.labels == list(CLASS_NAMES) and dataset.dropped == []
            assert dataset.preprocessing["image_size"] == list(size or (48, 48))
            found = every_image(dataset)
            assert sorted(found) == [f"{i:05d}.png" for i in range(20)]
            for name, (x, boxes) in found.items():
                assert x.shape == (1, *(size or (48, 48))) and boxes.dtype == np.float32
                assert np.allclose(boxes, truth[int(name[:5])] * scale, atol=1e-4)
        assert [d.ids for d in read[0].splits.values()] == [d.ids for d in read[1].splits.values()]


def test_the_reader_s_preprocessing_record_and_seeded_cut(tmp_path):
    root = write_yolo_canvases(tmp_path / "data", 30, size=32)
    dataset = load_detection_dataset(options(root))
    pre = dataset.preprocessing
    assert dataset.model_type == "object_detector" and dataset.given_splits is False
    assert {k: pre[k] for k in ("kind", "image_size", "channels", "color_mode", "resample",
                                "input_range", "layout", "normalization")} == {
        "kind": "detection", "image_size": [32, 32], "channels": 1, "color_mode": "L",
        "resample": "bilinear", "input_range": [0.0, 1.0], "layout": "NCHW",
        "normalization": "in_graph"}
    assert len(pre["mean"]) == len(pre["std"]) == 1 and "pixel_scale" in pre
    assert sum(dataset.counts.values()) == 30 and min(dataset.counts.values()) >= 4
    assert dataset.test.y.dtype == object and len(dataset.test.y) == len(dataset.test.ids)
    again = load_detection_dataset(options(root))
    assert {s: d.ids for s, d in again.splits.items()} == {
        s: d.ids for s, d in dataset.splits.items()}
    assert load_detection_dataset(options(root, seed=1)).test.ids != dataset.test.ids


def write_bad_yolo(root: Path) -> None:
    """Two good images and one of every bad YOLO input beside them."""
    blank = np.zeros((20, 40), np.uint8)
    for name in ("good", "clip", "nolabel", "twice", "corrupt", "huge", "empty"):
        save(root / f"images/{name}.png", blank)
    save(root / "images/twice.jpg", blank)  # a second image of one stem
    (root / "images/corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    (root / "labels").mkdir(parents=True, exist_ok=True)
    lines = {"good": "1 0.5 0.5 0.5 0.5\n",
             "clip": ("0 0.9 0.5 0.4 0.2\n"  # x2 1.1: clipped
                      "1 1.5 0.5 0.2 0.2\n"  # wholly right of the image: dropped
                      "2 0.5 0.5 0.0 0.3\n"  # zero width
                      "9 0.5 0.5 0.1 0.1\n"  # class 9 of 3
                      "-1 0.5 0.5 0.1 0.1\n"  # class -1
                      "1 0.5 0.5 0.1\n"  # 4 fields
                      "1 a b c d\n"  # not numbers
                      "1.5 0.5 0.5 0.1 0.1\n"  # a fractional class
                      "\n"  # blank lines are nothing
                      "2 0.25 0.25 0.5 0.5\n"),
             "twice": "0 0.5 0.5 0.2 0.2\n", "corrupt": "0 0.5 0.5 0.2 0.2\n",
             "orphan": "0 0.5 0.5 0.2 0.2\n", "empty": ""}
    for name, text in lines.items():
        (root / f"labels/{name}.txt").write_text(text)
    (root / "labels/huge.txt").write_text("0 0.5 0.5 0.2 0.2\n" * 60000)  # over 1 MiB
    (root / "labels/classes.txt").write_text("ignored\n")  # LabelImg's; not a label file
    (root / "classes.txt").write_text("a\nb\nc\n")


def test_each_bad_yolo_input_is_counted_with_its_reason(tmp_path):
    root = tmp_path / "data"
    write_bad_yolo(root)
    dataset = load_detection_dataset(options(root, val_fraction=0.2, test_fraction=0.2))
    assert reasons(dataset) == {
        tally.CLIPPED: 1, tally.OUTSIDE: 1, tally.ZERO_AREA: 1, tally.UNKNOWN_CLASS: 2,
        tally.MALFORMED_LINE: 3, tally.NO_LABEL_FILE: 1, tally.NO_IMAGE: 1,
        tally.DUPLICATE_STEM: 1, tally.UNREADABLE_IMAGE: 1, tally.LARGE_LABELS: 1}
    assert all(d["file"] == str(root) for d in dataset.dropped)
    named = {d["reason"]: d["first_rows"] for d in dataset.dropped}
    assert named[tally.CLIPPED] == ["labels/clip.txt:1"]
    assert named[tally.MALFORMED_LINE] == ["labels/clip.txt:6", "labels/clip.txt:7",
                                           "labels/clip.txt:8"]
    assert named[tally.NO_IMAGE] == ["labels/orphan.txt"]
    assert named[tally.NO_LABEL_FILE] == ["images/nolabel.png"]
    assert named[tally.LARGE_LABELS] == ["labels/huge.txt"]
    assert {d["reason"] for d in dataset.dropped if d["kept"]} == {tally.CLIPPED,
                                                                   tally.NO_LABEL_FILE}
    assert sorted(Path(p).name for p in dataset.skipped) == ["corrupt.png", "huge.png",
                                                             "twice.png"]
    found = every_image(dataset)
    assert sorted(found) == ["clip.png", "empty.png", "good.png", "nolabel.png", "twice.jpg"]
    assert dataset.labels == ["a", "b", "c"]
    assert np.allclose(found["clip.png"][1], [[0, 28, 8, 40, 12], [2, 0, 0, 20, 10]])
    assert np.allclose(found["good.png"][1], [[1, 10, 5, 30, 15]])
    assert found["nolabel.png"][1].shape == found["empty.png"][1].shape == (0, 5)


def write_bad_coco(root: Path) -> Path:
    """IMAGES_DIR root/images and root/instances.json: good images and every bad COCO input."""
    blank = np.zeros((20, 40), np.uint8)
    for name in ("good", "bare", "other", "small", "corrupt"):
        save(root / f"images/{name}.png", blank)
    save(root / "outside.png", blank)
    (root / "images/corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    images = [{"id": 1, "file_name": "good.png", "width": 40, "height": 20},
              {"id": 2, "file_name": "bare.png"},  # no annotation: background
              {"id": 1, "file_name": "other.png"},  # a second id 1
              {"id": 3, "file_name": "../outside.png"},  # outside IMAGES_DIR
              {"id": 4, "file_name": str(root / "outside.png")},  # absolute
              {"id": 5, "file_name": "gone.png"},  # no such file
              {"id": 6, "file_name": "good.png"},  # the same file again
              {"id": 7, "file_name": "small.png", "width": 30, "height": 20},  # wrong size
              {"id": 8, "file_name": "corrupt.png"},
              {"file_name": "other.png"},  # no id
              *({"id": f"g{i}", "file_name": f"g{i}.png"} for i in range(4))]
    for i in range(4):
        save(root / f"images/g{i}.png", blank)
    box = {"image_id": 1, "category_id": 20, "bbox": [10, 5, 20, 10], "iscrowd": 0}
    annotations = [{"id": 1, **box},
                   {"id": 1, **box},  # a second annotation id 1
                   {"id": 2, **box, "image_id": 99},  # no image 99
                   {"id": 3, **box, "category_id": 30},  # no category 30
                   {"id": 4, **box, "iscrowd": 1},
                   {"id": 5, **box, "bbox": [1, 2, 3]},
                   {"id": 6, **box, "bbox": [1, 2, 0, 3]},
                   {"id": 7, **box, "category_id": 10, "bbox": [30, -5, 20, 10]},  # clipped
                   {**box},  # no id
                   {"id": 8, **box, "image_id": 7}, {"id": 9, **box, "image_id": 8},
                   *({"id": f"a{i}", **box, "image_id": f"g{i}"} for i in range(4))]
    categories = [{"id": 20, "name": "cat"}, {"id": 10, "name": "dog"}]  # dog first: id 10
    path = root / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations,
                                "categories": categories}))
    return path


def test_each_bad_coco_input_is_counted_with_its_reason(tmp_path):
    path = write_bad_coco(tmp_path)
    dataset = load_detection_dataset(options(tmp_path / "images", annotations=str(path),
                                             val_fraction=0.3, test_fraction=0.3))
    assert reasons(dataset) == {
        tally.NO_ANNOTATIONS: 1, tally.DUPLICATE_IMAGE_ID: 1, tally.UNSAFE_NAME: 2,
        tally.MISSING_FILE: 1, tally.LISTED_TWICE: 1, tally.MALFORMED_IMAGE: 1,
        tally.DUPLICATE_ANNOTATION_ID: 1, tally.NO_IMAGE_RECORD: 1, tally.UNKNOWN_CATEGORY: 1,
        tally.CROWD: 1, tally.MALFORMED_ANNOTATION: 2, tally.ZERO_AREA: 1, tally.CLIPPED: 1,
        tally.SIZE_MISMATCH: 1, tally.UNREADABLE_IMAGE: 1}
    assert all(d["file"] == str(path) for d in dataset.dropped)
    named = {d["reason"]: d["first_rows"] for d in dataset.dropped}
    assert named[tally.UNSAFE_NAME] == ["../outside.png", str(tmp_path / "outside.png")]
    assert named[tally.MALFORMED_ANNOTATION] == ["annotation 5", "annotations[8]"]
    assert named[tally.NO_ANNOTATIONS] == ["bare.png"]
    assert dataset.labels == ["dog", "cat"]  # the categories in the order of their ids
    found = every_image(dataset)
    assert sorted(found) == ["bare.png", "g0.png", "g1.png", "g2.png", "g3.png", "good.png"]
    assert np.allclose(found["good.png"][1], [[1, 10, 5, 30, 15], [0, 30, 0, 40, 5]])
    assert np.allclose(found["g3.png"][1], [[1, 10, 5, 30, 15]])
    assert len(dataset.skipped) == 8  # the image records left out


def test_errors_carry_their_exit_codes(tmp_path):
    assert ConfigError("x").exit_code == EXIT_USAGE and DataError("x").exit_code == EXIT_DATA
    corrupt = tmp_path / "corrupt"
    save(corrupt / "images/a.png", np.random.default_rng(0).integers(0, 255, (64, 64), np.uint8))
    whole = (corrupt / "images/a.png").read_bytes()
    for name in "abc":  # headers that read, pixels that do not
        (corrupt / f"images/{name}.png").write_bytes(whole[:len(whole) // 2])
    (corrupt / "labels").mkdir()
    (corrupt / "classes.txt").write_text("a\n")
    with pytest.raises(DataError, match="no usable images in the training split .*3 with an "
                       "unreadable image"):
        load_detection_dataset(options(corrupt, val_fraction=0.01, test_fraction=0.01))
    for name in "abc":
        (corrupt / f"images/{name}.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"none of the \d training images could be read"):
        load_detection_dataset(options(corrupt, val_fraction=0.01, test_fraction=0.01))
    with pytest.raises(DataError, match="does not exist"):
        load_detection_dataset(options(tmp_path / "nowhere"))
    classes = tmp_path / "classes"
    save(classes / "cat/a.png", np.zeros((8, 8), np.uint8))
    with pytest.raises(ConfigError, match="neither YOLO's layout"):
        load_detection_dataset(options(classes))
    with pytest.raises(ConfigError, match="classes has no images/ folder"):
        load_detection_dataset(options(corrupt, val_path=str(classes)))
    (corrupt / "labels").rmdir()
    with pytest.raises(ConfigError, match="corrupt has no labels/ folder"):
        load_detection_dataset(options(corrupt))
    with pytest.raises(ConfigError, match="--annotations .* does not exist"):
        load_detection_dataset(options(classes, annotations=str(tmp_path / "none.json")))
    unlabelled = tmp_path / "unlabelled"
    save(unlabelled / "images/a.png", np.zeros((8, 8), np.uint8))
    (unlabelled / "labels").mkdir()
    with pytest.raises(DataError, match="hold no box, and nothing names the classes"):
        load_detection_dataset(options(unlabelled))


def test_bad_coco_files_are_data_errors_and_bounded(tmp_path, monkeypatch):
    save(tmp_path / "images/a.png", np.zeros((8, 8), np.uint8))
    path = tmp_path / "a.json"
    load = lambda: load_detection_dataset(options(tmp_path / "images", annotations=str(path)))
    for text, said in (("{", "cannot parse"), ("[]", "no \"images\" list"),
                       ('{"images": [], "categories": []}', "has no categories"),
                       ('{"images": [], "categories": [{"id": 1, "name": "a"}, '
                        '{"id": 2, "name": "a"}]}', "category name \\['a'\\] more than once")):
        path.write_text(text)
        with pytest.raises(DataError, match=said):
            load()
    path.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.png"}], "annotations": [],
                                "categories": [{"id": 1, "name": "a"}]}))
    monkeypatch.setattr(coco, "MAX_ANNOTATIONS_BYTES", 16)
    with pytest.raises(DataError, match="over 0 MiB|is over"):
        load()


def test_yolo_split_folders_val_path_and_ultralytics_layout(tmp_path):
    for folder, count, seed in (("train", 8, 0), ("valid", 3, 1), ("test", 4, 2)):
        write_yolo_canvases(tmp_path / "rf" / folder, count, size=24, seed=seed)
    dataset = load_detection_dataset(options(tmp_path / "rf"))
    assert dataset.given_splits is True and dataset.counts == {"train": 8, "val": 3, "test": 4}
    assert dataset.labels == [str(i) for i in range(10)]  # no class list: 0..largest
    assert dataset.dropped == []

    ultra = tmp_path / "ultra"
    for split, count in (("train", 6), ("val", 2)):
        source = write_yolo_canvases(tmp_path / f"src_{split}", count, size=24)
        for sub in ("images", "labels"):
            (source / sub).rename(ultra / sub / split) if (ultra / sub).is_dir() else (
                (ultra / sub).mkdir(parents=True), (source / sub).rename(ultra / sub / split))
    dataset = load_detection_dataset(options(ultra, test_fraction=0.34))
    assert dataset.given_splits is True and dataset.counts == {"train": 4, "val": 2, "test": 2}
    assert all(name.startswith("val/") for name in dataset.val.ids)

    main = write_yolo_canvases(tmp_path / "main", 10, size=24)
    extra = write_yolo_canvases(tmp_path / "extra", 3, size=24, seed=5)
    dataset = load_detection_dataset(options(main, val_path=str(extra)))
    assert dataset.counts["val"] == 3 and dataset.counts["train"] + dataset.counts["test"] == 10


def test_coco_val_and_test_json_files_match_categories_by_name(tmp_path):
    path = write_coco_canvases(tmp_path / "images", tmp_path / "all.json", 12, size=24)
    document = json.loads(path.read_text())
    val = dict(document, images=document["images"][8:10],
               categories=[dict(c, id=100 - c["id"]) for c in document["categories"]])
    val["annotations"] = [dict(a, category_id=100 - a["category_id"])
                          for a in document["annotations"] if a["image_id"] in (9, 10)]
    (tmp_path / "val.json").write_text(json.dumps(val))
    for name, ids in (("train", range(1, 9)), ("test", (11, 12))):
        (tmp_path / f"{name}.json").write_text(json.dumps(dict(
            document, images=[i for i in document["images"] if i["id"] in ids],
            annotations=[a for a in document["annotations"] if a["image_id"] in ids])))
    flags = {"annotations": str(tmp_path / "train.json"), "val_path": str(tmp_path / "val.json"),
             "test_path": str(tmp_path / "test.json")}
    split = load_detection_dataset(options(tmp_path / "images", **flags))
    whole = every_image(load_detection_dataset(options(tmp_path / "images",
                                                       annotations=str(path))))
    assert split.given_splits and split.counts == {"train": 8, "val": 2, "test": 2}
    assert sorted(split.val.ids) == ["00008.png", "00009.png"]
    for name, (_, boxes) in every_image(split).items():
        assert np.array_equal(boxes, whole[name][1])
    flags["val_path"] = str(tmp_path / "train.json")  # the same images again: counted, once
    again = load_detection_dataset(options(tmp_path / "images", **flags))
    assert reasons(again) == {tally.LISTED_TWICE: 8}
    assert again.counts == {"train": 8, "val": 0, "test": 2}


def test_data_yaml_names_and_the_simple_forms_without_pyyaml(tmp_path):
    root = write_yolo_canvases(tmp_path / "data", 6, size=24)
    (root / "classes.txt").unlink()
    words = [f"d{i}" for i in range(10)]
    for text in (f"path: .\nnames: [{', '.join(words)}]\n",
                 "nc: 10\nnames:\n" + "".join(f"  {i}: d{i}\n" for i in range(10)),
                 "names:\n" + "".join(f"  - 'd{i}'\n" for i in range(10)) + "train: images\n"):
        (root / "data.yaml").write_text(text)
        assert load_detection_dataset(options(root)).labels == words
        simple = yolo._simple_yaml_names(text)
        assert (list(simple.values()) if isinstance(simple, dict) else simple) == words
    (root / "data.yaml").write_text("names: {0: a, 2: b}\n")
    with pytest.raises(DataError, match="not 0..1"):
        load_detection_dataset(options(root))
    (root / "data.yaml").write_text("names: [a, b, a]\n")
    with pytest.raises(DataError, match="more than once"):
        load_detection_dataset(options(root))


def test_a_bundle_s_size_and_classes_are_used(tmp_path):
    root = write_yolo_canvases(tmp_path / "data", 10, size=32)
    trained = load_detection_dataset(options(root))
    bundle = dict(trained.preprocessing, image_size=[16, 16])
    again = load_detection_dataset(options(root), preprocessing=bundle, labels=list("abcd"),
                                   splits=("test",))
    assert list(again.splits) == ["test"] and again.preprocessing is bundle
    assert again.labels == list("abcd") and again.test.x.shape[2:] == (16, 16)
    kept = np.concatenate(list(again.test.y))
    assert len(kept) == 0 or kept[:, 0].max() < 4  # digits 4..9: unknown classes, counted
    truth = every_image(trained)
    for name, (_, boxes) in every_image(again).items():
        known = truth[name][1][truth[name][1][:, 0] < 4]
        assert np.allclose(boxes, known * [1, 0.5, 0.5, 0.5, 0.5], atol=1e-4)


def test_the_builtin_and_the_annotations_flag_s_model_type(tmp_path):
    dataset = load_detection_dataset(options(BUILTIN))
    assert sum(dataset.counts.values()) == 600 and dataset.labels == list(CLASS_NAMES)
    assert dataset.train.x.shape == (dataset.counts["train"], 1, 64, 64)
    assert dataset.train.x.dtype == np.float32 and 0 <= dataset.train.x.min()
    assert dataset.preprocessing["kind"] == "detection" and dataset.preprocessing[
        "image_size"] == [64, 64]
    assert all(b.dtype == np.float32 and b.shape[1] == 5 and len(b) >= 1
               for b in dataset.test.y)
    with pytest.raises(ConfigError, match="64x64 grayscale"):
        load_detection_dataset(options(BUILTIN, image_size=(32, 32)))
    from config import Config, flags_for

    assert all("annotations" in flags_for(script)
               for script in ("pipeline", "train", "export", "quantize", "inference"))
    config = Config()
    config.annotations = str(tmp_path / "a.json")
    with pytest.raises(ConfigError, match="--annotations is for an object_detector"):
        config.refuse_flags_for("image_classifier")
    config.refuse_flags_for("object_detector")


def test_coco_values_the_os_or_number_parsing_refuse_are_counted_not_fatal(tmp_path):
    """A file_name the file system refuses (a 300-byte name, a NUL byte), numbers past a float
    (a 350-digit bbox value, a 5,000-digit integer Python's int will not parse), in the main
    and a --val_path file: each record counted with its reason and left out, the rest read;
    a run left with nothing exits 3 with the reason in its one line."""
    blank = np.zeros((20, 40), np.uint8)
    for name in ("good", "also", "val"):
        save(tmp_path / f"images/{name}.png", blank)
    box = {"image_id": 1, "category_id": 1, "bbox": [2, 2, 10, 10]}
    main = tmp_path / "instances.json"
    main.write_text(json.dumps({
        "images": [{"id": 1, "file_name": "good.png"}, {"id": 2, "file_name": "also.png"},
                   {"id": 3, "file_name": "n" * 300 + ".png"},
                   {"id": 4, "file_name": "sub/\u0000.png"}],
        "annotations": [{"id": 1, **box}, {"id": 2, **box, "image_id": 2},
                        {"id": 3, **box, "bbox": [2, 2, -(10 ** 350), 10]}],
        "categories": [{"id": 1, "name": "cat"}]}))
    val = tmp_path / "val.json"
    val.write_text('{"images": [{"id": 1, "file_name": "val.png"}, {"id": 9, "file_name": "'
                   + "v" * 4096 + '.png"}], "categories": [{"id": 1, "name": "cat"}], '
                   '"annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, '
                   + "7" * 5000 + ', 4]}, {"id": 2, "image_id": 1, "category_id": 1, '
                   '"bbox": [1, 1, 5, 4]}]}')
    dataset = load_detection_dataset(options(tmp_path / "images", annotations=str(main),
                                             val_path=str(val), test_fraction=0.5))
    counted = {(Path(d["file"]).name, d["reason"]): d["count"] for d in dataset.dropped}
    assert counted == {("instances.json", tally.REFUSED_NAME): 2,
                       ("instances.json", tally.REFUSED_NUMBER): 1,
                       ("val.json", tally.REFUSED_NAME): 1,
                       ("val.json", tally.REFUSED_NUMBER): 1}
    shown = [name for d in dataset.dropped for name in d["first_rows"]]
    assert all(len(name) < 100 and name.isprintable() for name in shown)
    found = every_image(dataset)
    assert sorted(found) == ["also.png", "good.png", "val.png"]
    assert len(found["val.png"][1]) == 1  # its other box kept
    main.write_text(json.dumps({"images": [{"id": 1, "file_name": "x\u0000.png"}],
                                "annotations": [], "categories": [{"id": 1, "name": "cat"}]}))
    run = run_cli("train.py", "--model_type", "object_detector", "--dataset_path",
                  tmp_path / "images", "--annotations", main, "--output_model",
                  tmp_path / "m.onnx")
    assert_clean_failure(run, EXIT_DATA, "no usable images", "file_name the file system refuses")
    assert not (tmp_path / "m.onnx").exists()


def test_a_yolo_data_yaml_with_a_number_too_long_to_parse_is_one_data_error(tmp_path):
    write_yolo_canvases(tmp_path, 4, size=24, seed=0)
    (tmp_path / "classes.txt").unlink(missing_ok=True)
    (tmp_path / "data.yaml").write_text("names:\n  - a\n  - " + "9" * 5000 + "\n")
    with pytest.raises(DataError, match="a number in it is too long to read"):
        load_detection_dataset(options(tmp_path))
