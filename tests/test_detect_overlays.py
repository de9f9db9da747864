"""A detector's overlays and counts (issue 64, item 7): each class in its own colour from a fixed
palette, labels on a filled background inside the image (inside the box at the top edge, moved
left at the right edge), the labels of overlapping boxes apart; the log line and the summary
count the images with at least one box, as the report's predictions section does. The drawing
is checked on made-up boxes (deterministic, whatever a trained detector finds), the counts and
the overlays on the trained detector of conftest.py's detect_bundle."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from conftest import DETECT_SIDE, run_cli
from ttc.tasks.detect.canvases import write_coco_canvases
from ttc.tasks.detect.overlay import (MIN_FONT, PALETTE, UNKNOWN_COLOUR, Rect, class_colour,
                                      draw_overlay, label_place, text_colour)

LABELS = ["cat", "dog", "bird"]
GREY = (90, 90, 90)
SIZE = (200, 150)  # width, height


def drawn(boxes, classes, scores=None, size=SIZE) -> np.ndarray:
    picture = Image.new("RGB", size, GREY)
    draw_overlay(picture, np.asarray(boxes, np.float64), classes, LABELS,
                 None if scores is None else np.asarray(scores, np.float64))
    return np.asarray(picture)


def has_colour(pixels: np.ndarray, colour) -> bool:
    return bool((pixels == colour).all(axis=-1).any())


def colour_mask(pixels: np.ndarray, colour) -> np.ndarray:
    return (pixels == colour).all(axis=-1)


def test_each_class_has_its_own_fixed_colour_and_a_contrasting_text():
    assert [class_colour(k) for k in range(12)] == [*PALETTE, PALETTE[0], PALETTE[1]]
    assert len(set(PALETTE)) == len(PALETTE)
    assert class_colour(3, classes=3) == class_colour(-1) == UNKNOWN_COLOUR
    assert text_colour((255, 255, 0)) == (0, 0, 0) and text_colour((31, 119, 180)) == \
        (255, 255, 255)


def test_two_classes_boxes_are_drawn_in_two_colours_at_their_edges():
    boxes = [[20, 60, 90, 140], [110, 70, 190, 140]]
    pixels = drawn(boxes, [0, 1], [0.9, 0.8])
    for (x1, y1, x2, y2), k in zip(boxes, (0, 1)):
        colour = class_colour(k)
        assert colour_mask(pixels[y1 + 20:y2 - 1, x1], colour).all()  # the left edge
        assert colour_mask(pixels[y2 - 1, x1 + 1:x2 - 1], colour).all()  # the bottom edge
    assert class_colour(0) != class_colour(1)
    assert not has_colour(pixels, class_colour(2))


def test_a_label_is_text_on_a_filled_background_of_its_class_colour():
    pixels = drawn([[40, 60, 160, 140]], [2], [0.75])
    above = pixels[30:60, 40:160]  # the label sits above the box
    fill = colour_mask(above, class_colour(2))
    text = colour_mask(above, text_colour(class_colour(2)))
    assert fill.sum() > 100 and text.sum() > 10  # a background with text on it
    rows = np.flatnonzero(fill.any(axis=1))
    assert rows.max() + 30 < 60  # wholly above the box's top edge


def test_labels_at_the_top_and_right_edges_stay_inside_the_image():
    width, height = SIZE
    top = label_place([10, 0, 80, 60], (50, 14), SIZE, [])
    assert top == Rect(10, 0, 60, 14)  # inside the box, below its top edge
    right = label_place([170, 50, 200, 90], (50, 14), SIZE, [])
    assert right.right == width and right.top == 36  # moved left, still above the box
    corner = label_place([150, 0, 200, 40], (300, 14), SIZE, [])
    assert corner.left == 0 and corner.top == 0  # wider than the image: from its left edge
    # drawn: the label's background lies in the image's first rows, inside the box
    pixels = drawn([[10, 0, 80, 60], [150, 0, 200, 40]], [0, 1], [0.9, 0.6])
    for (x1, _, x2, _), k in zip(([10, 0, 80, 60], [150, 0, 200, 40]), (0, 1)):
        fill = colour_mask(pixels[:MIN_FONT, x1:x2], class_colour(k))
        assert (fill.sum(axis=1) > 20).all() and fill[:, 0].all()  # from the box's left edge
    assert pixels.shape[:2] == (height, width)


def test_the_labels_of_overlapping_boxes_are_not_drawn_on_each_other():
    first = label_place([20, 50, 120, 120], (60, 14), SIZE, [])
    second = label_place([25, 55, 125, 125], (60, 14), SIZE, [first])
    assert not first.overlaps(second) and second.top == first.bottom
    # two classes on one box: both labels readable, each on its own background
    pixels = drawn([[20, 50, 120, 120], [20, 50, 120, 120]], [0, 1], [0.9, 0.6])
    rows = {k: set(np.flatnonzero(colour_mask(pixels[:, 21:80], class_colour(k))
                                  .sum(axis=1) > 30)) for k in (0, 1)}
    assert rows[0] and rows[1] and not rows[0] & rows[1]
    # no room below at the bottom edge: the second goes above the first
    low = label_place([20, 140, 120, 150], (60, 14), SIZE, [])
    assert label_place([20, 140, 120, 150], (60, 14), SIZE, [low]).bottom == low.top


def test_the_best_label_is_on_top_where_the_image_is_too_small():
    pixels = drawn([[0, 0, 10, 8], [0, 0, 10, 8]], [0, 1], [0.9, 0.5], size=(30, 10))
    assert has_colour(pixels[:, :3], class_colour(0))  # the best box's label, drawn last


# ----------------------------------------------------------------------------- a trained detector


@pytest.fixture(scope="module")
def new_images(tmp_path_factory) -> Path:
    """Five new canvases (another seed than the bundle's) four times as large as trained, and
    two blank images: some images with boxes, some likely without."""
    root = tmp_path_factory.mktemp("overlays")
    folder = root / "new"
    folder.mkdir()
    write_coco_canvases(root / "canvases", root / "instances.json", 5, size=DETECT_SIDE, seed=7)
    for path in sorted((root / "canvases").iterdir()):
        with Image.open(path) as picture:
            picture.resize((DETECT_SIDE * 4, DETECT_SIDE * 4)).save(folder / path.name)
    for k, shade in enumerate((0, 255)):
        Image.new("L", (160, 128), shade).save(folder / f"blank{k}.png")
    return folder


def test_the_count_line_and_report_count_the_images_with_boxes(detect_bundle, new_images,
                                                               tmp_path):
    infer = ("inference.py", "--output_model", detect_bundle["model"], "--input", new_images,
             "--no_progress", "true")
    first = run_cli(*infer, "--output", tmp_path / "all.csv")
    assert first.returncode == 0, first.stderr[-2000:]
    best = pd.read_csv(tmp_path / "all.csv").groupby("image")["score"].max()
    # a --min_score between the images' best scores: some images keep boxes, some none
    assert best.min() < best.max(), best
    out, report_path = tmp_path / "dets.csv", tmp_path / "report.json"
    run = run_cli(*infer, "--output", out, "--overlay", "true", "--report_json", report_path,
                  "--min_score", str((best.min() + best.max()) / 2))
    assert run.returncode == 0, run.stderr[-2000:]
    rows = pd.read_csv(out, keep_default_na=False)
    with_boxes = rows.loc[rows["label"] != "", "image"].nunique()
    images = len(list(new_images.iterdir()))
    assert 0 < with_boxes < images
    found = re.search(r"found (\d+) boxes in (\d+) of (\d+) images", run.stdout + run.stderr)
    assert found, (run.stdout + run.stderr)[-2000:]
    assert tuple(map(int, found.groups())) == (len(rows), with_boxes, images)
    section = json.loads(report_path.read_text())["predictions"]
    assert section["boxes"] == len(rows) and section["images"] == images
    assert section["images_with_detections"] == with_boxes
    assert section["images_without_detections"] == images - with_boxes
    summary = {line[2:28].rstrip(): line[29:] for line in run.stdout.splitlines()
               if line.startswith("  ")}
    assert summary["images with boxes"] == str(with_boxes)
    assert summary["boxes found"] == str(len(rows))
    # each image's overlay shows the colour of every class it found (boxes and labels), and no
    # other class's (the grey one aside: a grey canvas may hold it)
    for name, mine in rows[rows["label"] != ""].groupby("image"):
        with Image.open(out.parent / "dets_overlays" / Path(name).with_suffix(".png")) as pic:
            pixels = np.asarray(pic.convert("RGB"))
        classes = set(mine["class_index"])
        for k in range(len(PALETTE)):
            if k in classes or len(set(class_colour(k))) > 1:
                assert has_colour(pixels, class_colour(k)) == (k in classes), (name, k)
