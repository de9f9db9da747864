"""The segmentation data layer: digit canvases, and ROOT/images + ROOT/masks read, checked,
resized and split (ttc/tasks/segment/data.py), on tiny files."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import assert_clean_failure, run_cli
from ttc.inputs.data import DataOptions
from ttc.tasks.segment import data as seg
from ttc.tasks.segment.canvases import CLASS_NAMES, write_digit_canvases
from utils import EXIT_DATA, DataError

REPO = Path(__file__).resolve().parent.parent


def options(path: Path, **kw) -> DataOptions:
    return DataOptions(path=str(path), model_type="image_segmenter", show_progress=False, **kw)


def every_split(dataset) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """id → (x, y) over all splits."""
    return {ident: (split.x[i], split.y[i]) for split in dataset.splits.values()
            for i, ident in enumerate(split.ids)}


def save(path: Path, array: np.ndarray, mode: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.fromarray(array)
    (img.convert(mode) if mode else img).save(path)


def test_canvases_are_deterministic_and_masks_mark_each_digit_s_strokes(tmp_path):
    first = write_digit_canvases(tmp_path / "a", 12, size=24, seed=0)
    again = write_digit_canvases(tmp_path / "b", 12, size=24, seed=0)
    other = write_digit_canvases(tmp_path / "c", 12, size=24, seed=1)
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert len(files) == 25 and Path("images/00011.png") in files
    assert all((first / f).read_bytes() == (again / f).read_bytes() for f in files)
    assert (first / "masks/00000.png").read_bytes() != (other / "masks/00000.png").read_bytes()
    assert (first / "classes.txt").read_text().split() == list(CLASS_NAMES)
    assert CLASS_NAMES == ("background", *"0123456789")
    seen = set()
    for i in range(12):
        image = Image.open(first / f"images/{i:05d}.png")
        mask = Image.open(first / f"masks/{i:05d}.png")
        assert image.mode == mask.mode == "L" and image.size == mask.size == (24, 24)
        pixels, classes = np.asarray(image), np.asarray(mask)
        assert 1 <= len(set(np.unique(classes)) - {0}) <= 4 and classes.max() <= 10
        assert (pixels[classes > 0] >= 128).all() and (pixels[classes == 0] <= 128).all()
        seen |= set(np.unique(classes))
    assert len(seen) >= 8  # background and most digits over a dozen canvases


def test_reader_returns_nchw_pixels_and_index_masks_split_by_seed(tmp_path):
    root = write_digit_canvases(tmp_path / "data", 30, size=16)
    dataset = seg.load_segmentation_dataset(options(root))
    assert dataset.model_type == "image_segmenter" and dataset.labels == list(CLASS_NAMES)
    assert sum(dataset.counts.values()) == 30 and min(dataset.counts.values()) >= 3
    assert dataset.given_splits is False and dataset.skipped == [] and dataset.dropped == []
    pre = dataset.preprocessing
    assert pre["kind"] == "segmentation" and pre["image_size"] == [16, 16]
    assert pre["channels"] == 1 and pre["ignore_index"] == 255
    assert pre["resize"] == "bilinear/nearest" and pre["normalization"] == "in_graph"
    assert len(pre["mean"]) == len(pre["std"]) == 1
    for split in dataset.splits.values():
        assert split.x.dtype == np.float32 and split.x.shape == (len(split), 1, 16, 16)
        assert split.y.dtype == np.int64 and split.y.shape == (len(split), 16, 16)
        assert 0 <= split.x.min() and split.x.max() <= 1
    name = dataset.test.ids[0]
    assert name.endswith(".png") and "/" not in name
    x, y = every_split(dataset)[name]
    assert (y == np.asarray(Image.open(root / "masks" / name))).all()
    assert np.allclose(x[0], np.asarray(Image.open(root / "images" / name)) / 255)

    again = seg.load_segmentation_dataset(options(root))
    assert {s: d.ids for s, d in again.splits.items()} == {
        s: d.ids for s, d in dataset.splits.items()}
    assert all(np.array_equal(again.splits[s].y, d.y) for s, d in dataset.splits.items())
    reseeded = seg.load_segmentation_dataset(options(root, seed=1))
    assert reseeded.test.ids != dataset.test.ids
    assert sorted(sum((d.ids for d in dataset.splits.values()), [])) == sorted(
        p.name for p in (root / "images").iterdir())


def write_bad_pairs(root: Path) -> None:
    """One pair per bad-input rule (and a palette mask and a partly void one that are fine)."""
    blank, strokes = np.zeros((16, 16), np.uint8), np.zeros((16, 16), np.uint8)
    strokes[4:12, 6:9] = 3
    save(root / "images/orphan.png", blank)  # no mask
    save(root / "masks/lonely.png", strokes)  # no image
    save(root / "images/small.png", blank)
    save(root / "masks/small.png", strokes[:12])  # 16x12 beside 16x16
    save(root / "images/beyond.png", blank)
    save(root / "masks/beyond.png", np.where(strokes > 0, 11, 0).astype(np.uint8))  # 11 classes
    save(root / "images/void.png", blank)
    save(root / "masks/void.png", np.full((16, 16), 255, np.uint8))
    (root / "images/corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    save(root / "masks/corrupt.png", strokes)
    save(root / "images/badmask.png", blank)
    (root / "masks/badmask.png").write_bytes(b"\x89PNG\r\n\x1a\ntruncated")
    save(root / "images/rgbmask.png", blank)
    save(root / "masks/rgbmask.png", strokes, "RGB")
    save(root / "images/twice.png", blank)
    save(root / "images/twice.jpg", blank)  # the second file of one stem
    save(root / "masks/twice.png", strokes)
    palette = Image.fromarray(strokes, mode="P")  # index 3 coloured pure red
    palette.putpalette([0, 0, 0] * 3 + [255, 0, 0] + [9, 9, 9] * 252)
    save(root / "images/palette.png", blank)
    palette.save(root / "masks/palette.png")
    save(root / "images/partvoid.png", blank)
    save(root / "masks/partvoid.png", np.where(strokes > 0, 3, 255).astype(np.uint8))


def test_each_bad_input_is_skipped_with_its_reason_and_palettes_read_as_indices(tmp_path):
    root = write_digit_canvases(tmp_path / "data", 12, size=16)
    write_bad_pairs(root)
    dataset = seg.load_segmentation_dataset(options(root))
    reasons = {d["reason"]: d["count"] for d in dataset.dropped}
    assert reasons == {seg.NO_MASK: 1, seg.NO_IMAGE: 1, seg.SIZE_MISMATCH: 1, seg.BEYOND_CLASSES: 1,
                       seg.ALL_VOID: 1, seg.UNREADABLE_IMAGE: 1, seg.UNREADABLE_MASK: 1,
                       seg.MASK_MODE: 1, seg.DUPLICATE: 1}
    assert all(d["file"] == str(root) for d in dataset.dropped)
    names = {d["reason"]: d["first_rows"] for d in dataset.dropped}
    assert names[seg.NO_IMAGE] == ["masks/lonely.png"]
    assert names[seg.DUPLICATE] == ["images/twice.png"]
    assert names[seg.ALL_VOID] == ["images/void.png"]
    assert len(dataset.skipped) == 9 and str(root / "images/corrupt.png") in dataset.skipped
    found = every_split(dataset)
    assert len(found) == 12 + 3 and "twice.jpg" in found
    assert set(np.unique(found["palette.png"][1])) == {0, 3}  # indices, never the colours
    assert set(np.unique(found["partvoid.png"][1])) == {3, 255}  # void kept as it is


def test_nothing_left_missing_folders_and_an_empty_class_list_are_data_errors(tmp_path):
    root = tmp_path / "void"
    for i in range(3):
        save(root / f"images/{i}.png", np.zeros((8, 8), np.uint8))
        save(root / f"masks/{i}.png", np.full((8, 8), 255, np.uint8))
    with pytest.raises(DataError) as caught:
        seg.load_segmentation_dataset(options(root))
    line = caught.value.one_line()
    assert "no usable image/mask pairs in the training split" in line
    assert "3 skipped: 3 with an all-void mask" in line and caught.value.exit_code == EXIT_DATA == 3

    (root / "masks").rename(tmp_path / "elsewhere")
    with pytest.raises(DataError, match="has no masks/ folder"):
        seg.load_segmentation_dataset(options(root))
    with pytest.raises(DataError, match="does not exist"):
        seg.load_segmentation_dataset(options(tmp_path / "nowhere"))
    canvases = write_digit_canvases(tmp_path / "data", 6, size=16)
    (canvases / "classes.txt").write_text("\n  \n\n")
    with pytest.raises(DataError, match="names no class"):
        seg.load_segmentation_dataset(options(canvases))

    # what a command line makes of it: exit 3 and one line on stderr
    code = ("import sys, utils\nfrom ttc.inputs.data import DataOptions\n"
            "from ttc.tasks.segment.data import load_segmentation_dataset\n"
            "sys.exit(utils.run_cli(lambda argv: load_segmentation_dataset("
            "DataOptions(path=sys.argv[1], show_progress=False)) and 0, []))\n")
    run = subprocess.run([sys.executable, "-c", code, str(canvases)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert run.returncode == 3 and len(errors) == 1, run.stderr
    assert "classes.txt names no class; write one class name per line" in errors[0]


def test_mixed_sizes_train_at_the_most_common_size_with_nearest_masks(tmp_path):
    root = tmp_path / "mixed"
    stripes = np.indices((20, 24)).sum(axis=0) % 3  # diagonal stripes of 0, 1, 2
    big = np.array([0, 2, 5], np.uint8)[stripes]  # neighbours differ: blending would invent 1, 3, 4
    small = np.zeros((16, 16), np.uint8)
    small[2:6, 2:6] = 5
    for i in range(8):
        save(root / f"images/s{i}.png", np.full((16, 16), 30 * i, np.uint8),
             "RGB" if i == 0 else None)
        save(root / f"masks/s{i}.png", small)
    for i in range(2):
        save(root / f"images/b{i}.png", (stripes * 100).astype(np.uint8))
        save(root / f"masks/b{i}.png", big)
    dataset = seg.load_segmentation_dataset(options(root, val_fraction=0.1, test_fraction=0.1))
    pre = dataset.preprocessing
    assert pre["image_size"] == [16, 16] and pre["channels"] == 3  # one RGB image among gray
    assert dataset.labels == ["0", "1", "2", "3", "4", "5"]  # no classes.txt: 1 + largest index
    found = every_split(dataset)
    assert len(found) == 10
    for name in ("b0.png", "b1.png"):
        x, y = found[name]
        assert x.shape == (3, 16, 16) and y.shape == (16, 16)
        assert set(np.unique(y)) == {0, 2, 5}


def test_given_split_roots_and_a_bundle_s_size_and_classes(tmp_path):
    main = write_digit_canvases(tmp_path / "main", 20, size=16, seed=0)
    test = write_digit_canvases(tmp_path / "test", 6, size=16, seed=1)
    dataset = seg.load_segmentation_dataset(options(main, test_path=str(test)))
    assert dataset.given_splits is True
    assert sorted(dataset.test.ids) == [f"{i:05d}.png" for i in range(6)]
    assert dataset.counts == {"train": 17, "val": 3, "test": 6}

    folders = tmp_path / "folders"  # ROOT/train, ROOT/test as the classifier's folders
    write_digit_canvases(folders / "train", 20, size=16, seed=0)
    write_digit_canvases(folders / "test", 5, size=16, seed=1)
    (folders / "classes.txt").write_text((main / "classes.txt").read_text())
    given = seg.load_segmentation_dataset(options(folders))
    assert given.given_splits and given.counts == {"train": 17, "val": 3, "test": 5}
    assert given.labels == list(CLASS_NAMES)

    # a bundle's rules: its size, channels and classes, not the data's
    bundle = dict(dataset.preprocessing, image_size=[12, 10], mean=[0.5], std=[0.25])
    read = seg.load_segmentation_dataset(options(main, test_path=str(test)), preprocessing=bundle,
                                         labels=CLASS_NAMES[:10], splits=("test",))
    assert list(read.splits) == ["test"] and read.preprocessing == bundle
    assert read.labels == list(CLASS_NAMES[:10])
    assert read.test.x.shape[1:] == (1, 12, 10) and read.test.y.shape[1:] == (12, 10)
    assert 0 < len(read.test) < 6 and read.test.y.max() <= 9  # a 9 is beyond its classes
    assert [(d["reason"], d["count"]) for d in read.dropped] == [(seg.BEYOND_CLASSES,
                                                                  6 - len(read.test))]


def test_a_data_set_too_large_for_the_image_memory_bound_is_refused_before_decoding(
        tmp_path, monkeypatch):
    from ttc.inputs.limits import LIMITS

    root = write_digit_canvases(tmp_path / "canvases", count=40, size=32)
    monkeypatch.setattr(LIMITS, "max_image_memory_mb", 0)  # any data set is over it
    decoded = []
    monkeypatch.setattr(seg, "decode_split", lambda *a, **k: decoded.append(a))
    with pytest.raises(DataError) as refused:
        seg.load_segmentation_dataset(options(root))
    message = str(refused.value)
    assert "40 image/mask pairs" in message and "at 32x32" in message
    assert "over --max_image_memory_mb 0" in message and "--image_size" in refused.value.hint
    assert decoded == []  # refused before any image was decoded


def test_lossy_masks_are_skipped_by_their_decoded_format_whatever_their_suffix(tmp_path):
    """Masks are PNG (docs/segmentation.md): a gray JPEG (named .png, or .jpg), a lossy WebP
    and a JPEG-compressed TIFF would read compression noise as classes; each pair is skipped
    with its reason and the format, while lossless BMP and LZW TIFF masks are read. With no
    pair left, train.py exits 3 naming the reason, before any training."""
    root = write_digit_canvases(tmp_path / "data", 10, size=16)
    masks = sorted((root / "masks").iterdir())

    def resave(mask: Path, suffix: str, **how) -> None:
        picture = Image.open(mask)
        picture.load()
        mask.unlink()
        picture.convert(how.pop("mode", picture.mode)).save(mask.with_suffix(suffix), **how)

    resave(masks[0], ".png", format="JPEG", quality=95)  # a JPEG under a PNG's name
    resave(masks[1], ".jpg", quality=100)
    resave(masks[2], ".webp", mode="RGB", lossless=False)
    resave(masks[3], ".tif", compression="tiff_jpeg")
    resave(masks[4], ".bmp")
    resave(masks[5], ".tiff", compression="tiff_lzw")
    dataset = seg.load_segmentation_dataset(options(root))
    dropped = {d["reason"]: d for d in dataset.dropped}
    assert set(dropped) == {seg.LOSSY_MASK} and dropped[seg.LOSSY_MASK]["count"] == 4
    assert sorted(dropped[seg.LOSSY_MASK]["first_rows"]) == sorted(
        f"images/{m.name}" for m in masks[:4])
    assert len(every_split(dataset)) == 6  # the BMP and LZW TIFF masks among them
    for mask in sorted((root / "masks").iterdir()):
        if mask.suffix in (".png", ".bmp", ".tiff"):
            resave(mask, ".jpeg")
    run = run_cli("train.py", "--model_type", "image_segmenter", "--dataset_path", root,
                  "--output_model", tmp_path / "m.onnx")
    assert_clean_failure(run, EXIT_DATA, "no usable image/mask pairs", "mask in a lossy format")
    assert not (tmp_path / "m.onnx").exists()
