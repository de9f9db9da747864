"""A segmenter's batch inference (ttc/tasks/segment/predict.py) through an exported, untrained
U-Net run by ONNX Runtime: a mask PNG per image at the image's own size holding the graph's
mask of the decoded image resized back (computed here on its own), the folder structure kept,
the summary in CSV, JSONL and Parquet, overlays, error rows, and the refusals."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from ttc.inputs.preprocess import decode_image_file
from ttc.tasks.outputs import default_mask_dir, default_overlay_dir
from ttc.tasks.segment.predict import SegmentBatchOptions, predict_images
from utils import ConfigError, DataError

LABELS = ["background", "digit", "edge"]
PREPROCESSING = {"kind": "segmentation", "image_size": [16, 16], "channels": 3,
                 "ignore_index": 255}
# name → (height, width, mode); "sub/a.png" shares its name with "a.png", "a.jpg" its stem
IMAGES = {"a.png": (16, 16, "RGB"), "b.png": (23, 31, "RGB"), "c.jpg": (40, 12, "RGB"),
          "sub/a.png": (9, 20, "L"), "sub/a.jpg": (30, 30, "RGB")}
EXPECTED_MASKS = {"a.png": "a.png", "b.png": "b.png", "c.jpg": "c.png",
                  "sub/a.png": "sub/a.png", "sub/a.jpg": "sub/a.jpg.png"}


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """An untrained U-Net exported as a SegmentationGraph with dynamic batch, height, width."""
    import onnxruntime as ort
    import torch

    from ttc.convert.tracing import export_graph
    from ttc.serving.bundle import InputSpec
    from ttc.tasks.segment.nets import (SEGMENTATION_MODULES, SEGMENTATION_NETWORKS,
                                        SegmentationGraph)

    torch.manual_seed(0)
    record = SEGMENTATION_NETWORKS["unet"](PREPROCESSING, len(LABELS))
    net = SEGMENTATION_MODULES[record["name"]](**record).eval()
    with torch.no_grad():  # centred logits: masks of several classes, not one everywhere
        seen = {}
        hook = net.head.register_forward_hook(lambda _m, x, _y: seen.setdefault("x", x[0]))
        net(torch.rand(4, 3, 16, 16))
        hook.remove()
        centre = seen["x"].mean(dim=(0, 2, 3))
        net.head.bias.copy_(-(net.head.weight[:, :, 0, 0] @ centre))
    spec = InputSpec(name="image", shape=("batch", 3, "height", "width"), dtype="float32",
                     padding_id=None, max_length=None, extra_inputs=())
    example = np.random.default_rng(0).random((2, 3, 16, 16), dtype=np.float32)
    graph = export_graph(net, example, 18, spec, ["logits", "probabilities", "mask"],
                         wrapper=SegmentationGraph(net))
    return ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])


def runner(session):
    return lambda x: session.run(["mask"], {"image": x})[0]


def image_folder(root):
    rng = np.random.default_rng(3)
    for name, (height, width, mode) in IMAGES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        shape = (height, width) if mode == "L" else (height, width, 3)
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(path)
    (root / "sub" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    return root


def expected_mask(session, path):
    """The graph's mask of the image decoded at the training size, resized back (NEAREST)."""
    x = decode_image_file(path, PREPROCESSING)[None]
    (mask,) = session.run(["mask"], {"image": x})
    with Image.open(path) as img:
        size = img.size
    return np.asarray(Image.fromarray(mask[0].astype(np.uint8)).resize(size, Image.NEAREST))


def read_summary(path):
    if path.suffix == ".csv":
        return pd.read_csv(path, keep_default_na=False, na_values=[""])
    if path.suffix == ".jsonl":
        return pd.read_json(path, lines=True)
    return pd.read_parquet(path)


def test_masks_overlays_and_the_summary_in_each_format(session, tmp_path):
    source = image_folder(tmp_path / "in")
    seen_classes = set()
    for fmt in ("csv", "jsonl", "parquet"):
        output = tmp_path / fmt / f"preds.{fmt}"
        options = SegmentBatchOptions(source, output, overlay=fmt == "csv", batch_size=2,
                                      errors=tmp_path / f"errors_{fmt}.csv", allow_errors=True)
        batches = []

        def run(x):  # one batch at a time, never the whole folder
            batches.append(x.shape)
            return runner(session)(x)

        section = predict_images(options, PREPROCESSING, LABELS, run)
        assert batches == [(2, 3, 16, 16), (2, 3, 16, 16), (1, 3, 16, 16)]
        mask_dir = default_mask_dir(output)
        assert options.mask_dir == mask_dir == tmp_path / fmt / "preds_masks"
        assert section["images"] == 6 and section["predicted"] == 5 and section["errors"] == 1
        assert section["mask_dir"] == str(mask_dir)

        summary = read_summary(output)
        assert list(summary.columns) == ["id", "mask", "height", "width", "share_background",
                                         "share_digit", "share_edge", "error"]
        assert summary["id"].tolist() == ["a.png", "b.png", "c.jpg", "sub/a.jpg", "sub/a.png",
                                          "sub/corrupt.png"]
        good = summary[summary["error"].fillna("") == ""]
        shares = good[[f"share_{label}" for label in LABELS]].to_numpy(dtype=float)
        np.testing.assert_allclose(shares.sum(axis=1), 1.0, atol=1e-5)
        mean = {label: pytest.approx(v, abs=1e-6) for label, v in
                zip(LABELS, shares.mean(axis=0))}
        assert section["class_pixel_shares"] == mean
        for row in good.itertuples():
            height, width, _ = IMAGES[row.id]
            assert row.mask == f"preds_masks/{EXPECTED_MASKS[row.id]}"
            assert (row.height, row.width) == (height, width)
            with Image.open(output.parent / row.mask) as png:
                assert png.mode == "P" and png.size == (width, height)
                mask = np.asarray(png)
            np.testing.assert_array_equal(mask, expected_mask(session, source / row.id))
            counts = np.bincount(mask.ravel(), minlength=3) / mask.size
            np.testing.assert_allclose([row.share_background, row.share_digit, row.share_edge],
                                       counts, atol=1e-6)
            seen_classes |= set(np.unique(mask).tolist())
        bad = summary[summary["id"] == "sub/corrupt.png"].iloc[0]
        assert bad["error"].startswith("unreadable image: ")
        assert pd.isna(bad["mask"]) or bad["mask"] == ""  # CSV reads the empty cell as NaN
        assert pd.isna(bad["height"]) and pd.isna(bad["share_digit"])
        assert pd.read_csv(tmp_path / f"errors_{fmt}.csv")["id"].tolist() == ["sub/corrupt.png"]
        assert not (mask_dir / "sub" / "corrupt.png").exists()

        overlay_dir = default_overlay_dir(output)
        if options.overlay:
            assert section["overlay_dir"] == str(overlay_dir)
            for name, (height, width, _) in IMAGES.items():
                with Image.open(overlay_dir / EXPECTED_MASKS[name]) as picture:
                    assert picture.mode == "RGB" and picture.size == (width, height)
        else:
            assert section["overlay_dir"] is None and not overlay_dir.exists()
    assert len(seen_classes) > 1  # the check above compared masks of more than one class


def test_one_image_file_and_a_report(session, tmp_path):
    source = image_folder(tmp_path / "in") / "b.png"
    report: dict = {}
    output = tmp_path / "one.jsonl"
    section = predict_images(SegmentBatchOptions(source, output), PREPROCESSING, LABELS,
                             runner(session), report)
    assert report["predictions"] == section and section["predicted"] == 1
    [row] = [json.loads(line) for line in output.read_text().splitlines()]
    assert row["id"] == "b.png" and row["mask"] == "one_masks/b.png" and row["error"] == ""
    json.dumps(section)


def test_failures_are_counted_and_refused_without_allow_errors(session, tmp_path):
    source = image_folder(tmp_path / "in")
    output = tmp_path / "preds.csv"
    with pytest.raises(DataError, match=r"1 of 6 images could not be segmented"):
        predict_images(SegmentBatchOptions(source, output), PREPROCESSING, LABELS,
                       runner(session))
    assert len(read_summary(output)) == 6  # written: the other masks are usable

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("x.png", "y.jpg"):
        (broken / name).write_bytes(b"garbage")
    output.write_text("previous\n")
    with pytest.raises(DataError, match="none of the 2 images"):
        predict_images(SegmentBatchOptions(broken, output, allow_errors=True,
                                           errors=tmp_path / "e.csv"),
                       PREPROCESSING, LABELS, runner(session))
    assert output.read_text() == "previous\n"
    assert len(pd.read_csv(tmp_path / "e.csv")) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="holds no image"):
        predict_images(SegmentBatchOptions(empty, output), PREPROCESSING, LABELS,
                       runner(session))


def test_mask_folders_that_would_mix_with_inputs_or_outputs_are_refused(tmp_path):
    source = image_folder(tmp_path / "in")
    output = tmp_path / "preds.parquet"
    a_file = tmp_path / "file"
    a_file.write_text("x")

    def never(x):
        raise AssertionError("nothing may run")

    for mask_dir, overlay, message in [
            (source, False, "is the input folder"),
            (source / "sub" / "masks", False, "or inside it"),
            (tmp_path, False, "holds the input folder"),
            (a_file, False, "is a file"),
            (output, False, "same path as the summary"),
            (tmp_path / "out" / "preds_overlays", True, "overlap")]:
        with pytest.raises(ConfigError, match=message):
            predict_images(SegmentBatchOptions(source, output, mask_dir, overlay=overlay),
                           PREPROCESSING, LABELS, never)
    with pytest.raises(ConfigError, match="is a file"):  # the overlays' folder too
        (tmp_path / "preds_overlays").write_text("x")
        predict_images(SegmentBatchOptions(source, output, overlay=True), PREPROCESSING,
                       LABELS, never)
    with pytest.raises(ConfigError, match=r"\.csv, \.jsonl or \.parquet"):
        predict_images(SegmentBatchOptions(source, tmp_path / "p.txt"), PREPROCESSING, LABELS,
                       never)
    assert not output.exists() and not default_mask_dir(output).exists()


def test_a_rotated_photo_gets_its_mask_and_overlay_at_its_shown_size(session, tmp_path):
    """A JPEG whose EXIF orientation turns it (6: 90 degrees) is decoded upright: its mask and
    overlay take its upright size, as its summary row says."""
    source = tmp_path / "in"
    source.mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6
    pixels = np.random.default_rng(5).integers(0, 256, (10, 24, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(source / "photo.jpg", exif=exif)
    output = tmp_path / "preds.csv"
    predict_images(SegmentBatchOptions(source, output, overlay=True), PREPROCESSING, LABELS,
                   runner(session))
    row = read_summary(output).iloc[0]
    assert (row["height"], row["width"]) == (24, 10)
    for folder in (default_mask_dir(output), default_overlay_dir(output)):
        with Image.open(folder / "photo.png") as png:
            assert png.size == (10, 24)


def test_folders_beside_the_output_are_written_only_as_real_folders(tmp_path):
    """The overlay folder the tool chooses must not be a symbolic link, and no mask goes
    through a linked subfolder (each write checks again): ConfigError (exit 2), the linked
    folder untouched."""
    source = image_folder(tmp_path / "in")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "a.png").write_bytes(b"the user's")

    def never(x):
        raise AssertionError("nothing may run")

    (tmp_path / "p_overlays").symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="overlay folder .* is a symbolic link"):
        predict_images(SegmentBatchOptions(source, tmp_path / "p.csv", overlay=True),
                       PREPROCESSING, LABELS, never)
    (tmp_path / "q_masks").mkdir()
    (tmp_path / "q_masks" / "sub").symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="q_masks/sub is a symbolic link inside"):
        predict_images(SegmentBatchOptions(source, tmp_path / "q.csv"), PREPROCESSING, LABELS,
                       never)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["a.png"]
    assert (elsewhere / "a.png").read_bytes() == b"the user's"
    assert not (tmp_path / "p.csv").exists() and not (tmp_path / "q.csv").exists()
