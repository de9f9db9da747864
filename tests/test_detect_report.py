"""A detector's report (issue 44, item 4): the summary prints COCO's figures, the empty
detector's baseline and the verdict, the training's val mAP and the export's detection check;
the page shows the per-class AP table, a grid of test images with their true and predicted
boxes drawn (as pictures, never their data URLs as text) and the PR-curve and per-class AP
plots; `report.py` writes `pr_curve` and `class_ap` for a detector and for no classifier;
headless Chromium draws the example pictures.

The report is built by hand from the real metric and drawing code (no training)."""
from __future__ import annotations

import base64
import copy
import html
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import chromium_screenshot, run_cli
from ttc.reporting.run import format_summary
from ttc.reporting import plots
from ttc.reporting.page import render_page, write_page
from ttc.reporting.sections import PREDICTION_KEYS, SUMMARY_KEYS
from ttc.tasks.detect import report_plots
from ttc.tasks.detect.evaluate import evaluation_section, example_pictures

LABELS = ["zero", "<b>one</b>", 'sign "stop" & co', "never"]  # "never": no true box
HEIGHT, WIDTH = 48, 64  # not square: the page keeps the aspect ratio
IMAGES = 8
DET_PLOTS = {"class_ap", "pr_curve"}
# pure colours of the Chromium check's pictures, none of which the page's own style uses
PICTURE_COLOURS = {"truth": (255, 0, 255), "predicted": (0, 255, 255)}


def boxes_and_detections(seed: int = 0) -> tuple[np.ndarray, list, list]:
    """(images (N, 1, H, W), true (k, 5) boxes per image, detections per image): two or three
    true boxes of the first three classes per image; each found shifted by a pixel or two with
    a score, one missed per image, one false detection of class "never" now and then."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 0.3, (IMAGES, 1, HEIGHT, WIDTH)).astype(np.float32)
    truths, found = [], []
    for k in range(IMAGES):
        rows = []
        for _ in range(2 + k % 2):
            side = float(rng.integers(10, 20))
            x1, y1 = float(rng.integers(0, WIDTH - 20)), float(rng.integers(0, HEIGHT - 20))
            rows.append([float(rng.integers(0, 3)), x1, y1, x1 + side, y1 + side])
            x[k, 0, int(y1):int(y1 + side), int(x1):int(x1 + side)] = 0.9
        truth = np.array(rows, np.float32)
        kept = truth[1:]  # the first box missed
        shift = rng.integers(0, 3, (len(kept), 4)).astype(np.float32)
        boxes, classes = kept[:, 1:] + shift, kept[:, 0].astype(np.int64)
        scores = rng.uniform(0.5, 0.99, len(kept)).astype(np.float32)
        if k % 3 == 0:
            boxes = np.vstack([boxes, [[1, 1, 9, 9]]]).astype(np.float32)
            scores, classes = np.append(scores, 0.4).astype(np.float32), np.append(classes, 3)
        truths.append(truth)
        found.append((boxes, scores, classes))
    return x, truths, found


def detector_report() -> dict:
    x, truths, found = boxes_and_detections()
    evaluation = evaluation_section(found, truths, LABELS)
    evaluation["examples"] = example_pictures(x, truths, found, LABELS)
    history = [{"epoch": e, "loss": 2.0 / e, "train_accuracy": 0.3 + 0.1 * e,
                "val_accuracy": 0.2 + 0.1 * e, "val_loss": 1.8 / e, "seconds": 0.4}
               for e in (1, 2, 3)]
    nms = {"iou_threshold": 0.5, "score_threshold": 0.05, "max_detections": 100}
    return {
        "version": 1, "status": "ok", "error": None,
        "config": {"model_type": "object_detector", "dataset_path": "builtin:digit_boxes"},
        "dataset": {"path": "builtin:digit_boxes", "model_type": "object_detector",
                    "num_classes": len(LABELS), "train": 300, "val": 40, "test": IMAGES},
        "train": {"samples": 300, "epochs_run": 3, "best_epoch": 3, "metric": "map",
                  "train_accuracy": 0.61, "val_accuracy": 0.52, "train_map": 0.61,
                  "val_map": 0.52, "seconds": 12.5, "history": history},
        "export": {"path": "model.onnx", "opset": 17, "checker": "ok", "max_abs_diff": 2.4e-6,
                   "top1_agreement": 1.0, "detections_checked": 412, "min_matched_iou": 0.9991,
                   "count_mismatches": 0, "resolutions_checked": ["48x64", "64x80"],
                   "nms": nms},
        "inference": {"model_path": "model.onnx", "providers_active": ["CPUExecutionProvider"],
                      "map": evaluation["map"], "map50": evaluation["map50"],
                      "latency_ms_p50": 3.1, "latency_ms_p95": 3.9, "throughput_per_s": 810.0,
                      "batch_size": 8, "samples": IMAGES, "timed_batches": 30,
                      "image_size": [HEIGHT, WIDTH]},
        "evaluation": evaluation, "plots": {}, "seconds_total": 20.5,
    }


@pytest.fixture(scope="module")
def report() -> dict:
    return detector_report()


@pytest.fixture(scope="module")
def written(report, tmp_path_factory) -> dict[str, str]:
    """The plots of the detector's report, drawn once."""
    return plots.write_plots(report, tmp_path_factory.mktemp("det") / "plots")


def section_html(text: str, name: str) -> str:
    start = text.index(f'<section id="{name}">')
    return text[start:text.index("</section>", start)]


def images_of(markup: str) -> list[str]:
    return re.findall(r'<img src="([^"]*)"', markup)


def summary_block(text: str, name: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(f"{name}:") + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith(" ")),
               len(lines))
    return lines[start:end]


def row(lines: list[str], label: str) -> str:
    """The value of the summary row `label` (the one line that starts with it)."""
    found = [line[29:] for line in lines if line[2:28].rstrip() == label]
    assert len(found) == 1, (label, lines)
    return found[0]


def test_the_summary_prints_the_detector_s_figures_training_and_check(report):
    text = format_summary(report)
    evaluation = report["evaluation"]
    assert 0 < evaluation["map"] < evaluation["map50"] < 1  # neither empty nor perfect
    lines = summary_block(text, "evaluation")
    assert row(lines, "verdict") == evaluation["verdict"]
    assert row(lines, "baseline (empty detector)") == "mAP 0 (finds nothing)"
    for key, label in (("map", "mAP@[.5:.95]"), ("map50", "mAP@.5"), ("map75", "mAP@.75"),
                       ("recall_100", "recall@100 (AR)")):
        assert row(lines, label) == f"{evaluation[key]:.4g}", label
    assert row(lines, "boxes") == (f"{evaluation['instances']} true in {IMAGES} images, "
                                   f"{evaluation['detections']} detected")
    per_class = {line.split()[0]: line.split()[1:] for line in lines[lines.index(
        next(line for line in lines if line.split()[:2] == ["class", "AP"])) + 1:]
        if not line.startswith("  WARNING")}
    assert per_class["zero"][:2] == [f"{evaluation['per_class'][0]['ap']:.4f}",
                                     f"{evaluation['per_class'][0]['ap50']:.4f}"]
    assert per_class["never"] == ["n/a", "n/a", "n/a", "0", str(evaluation["per_class"][3][
        "detections"])]
    assert not any("data:image" in line or "example" in line for line in lines)
    train = summary_block(text, "train")
    assert row(train, "val mAP@[.5:.95]") == "0.52" and row(train, "train mAP@[.5:.95]") == "0.61"
    assert not any("accuracy" in line for line in train)  # its mAP is not called an accuracy
    export = summary_block(text, "export")
    assert row(export, "detections checked") == "412"
    assert row(export, "min matched IoU") == "0.9991"
    assert row(export, "images with another count") == "0"
    assert row(export, "NMS in the graph") == ("class-aware, suppress at IoU > 0.5, keep score "
                                               "> 0.05, at most 100 detections per image")
    inference = summary_block(text, "inference")
    assert row(inference, "test mAP@[.5:.95]") == f"{evaluation['map']:.4g}"



def test_the_summary_counts_a_detector_s_boxes_and_images():
    """inference.py --input on a detector: its predictions count images and boxes (issue 63:
    not "rows predicted 5" for 7 boxes in 5 images), in the summary and on the page; the report
    names no model type, and the detector's part recognises its section."""
    predictions = {"input": "new", "output": "dets.csv", "output_format": "rows",
                   "images_json": None, "overlay_dir": None, "min_score": 0.3, "images": 6,
                   "predicted": 5, "errors": 1, "errors_path": "errors.csv", "boxes": 7,
                   "images_without_detections": 1, "boxes_per_class": {"zero": 3, "one": 4},
                   "seconds": 1.0, "images_per_second": 5.0}
    report = {"version": 1, "status": "ok", "error": None, "config": {"input": "new"},
              "predictions": predictions}
    lines = summary_block(format_summary(report) + "\nend", "predictions")
    assert row(lines, "images read") == "6" and row(lines, "images predicted") == "5"
    assert row(lines, "boxes found") == "7" and row(lines, "images failed") == "1"
    assert not any("rows" in line for line in lines)
    page = section_html(render_page(report, {}, SUMMARY_KEYS, PREDICTION_KEYS), "predictions")
    assert "<th>boxes found</th><td>7</td>" in page.replace(' class="second"', "")
    assert "rows predicted" not in page

def test_the_page_shows_the_per_class_table_the_examples_and_the_plots(report, written):
    text = render_page(report, written, SUMMARY_KEYS, PREDICTION_KEYS)
    evaluation = section_html(text, "evaluation")
    data = report["evaluation"]
    blocks = re.findall(r'<div class="example">(.*?)</div></div>', evaluation)
    assert len(blocks) == IMAGES >= 6
    for k, block in enumerate(blocks):
        example = data["examples"][k]
        assert images_of(block) == [example["truth"], example["predicted"]]
        # the longer side 192 CSS pixels, the aspect ratio kept
        assert re.findall(r'width="(\d+)" height="(\d+)"', block) == [("192", "144")] * 2
        assert (f"example {k} · {example['true_boxes']} true, {example['predicted_boxes']} "
                "predicted") in block
        assert re.findall(r"<figcaption>([^<]*)</figcaption>", block) == [
            "true boxes", "predicted boxes"]
    assert len(images_of(evaluation)) == 2 * IMAGES + len(DET_PLOTS)
    # no data URL as text; the PR curves and the per-class AP chart embedded here
    assert text.count("data:image") == len(images_of(text))
    shown = {base64.b64decode(s.split(",", 1)[1]) for s in images_of(evaluation)}
    assert all(Path(written[name]).read_bytes() in shown for name in DET_PLOTS)
    assert 'id="plots"' not in text  # nothing left over for "Other plots"
    table = evaluation[evaluation.index("<h3>Per class</h3>"):]
    table = table[:table.index("</table>")]
    assert ("<th>class</th><th>AP@[.5:.95]</th><th>AP@.5</th><th>AP@.75</th>"
            "<th>true boxes</th><th>detections</th>") in table
    for label, row_ in zip(LABELS, data["per_class"]):
        cells = [f"{row_[k]:.4f}" if row_[k] is not None else "–"
                 for k in ("ap", "ap50", "ap75")]
        assert (f"<td>{html.escape(label)}</td>"
                + "".join(f'<td class="num">{c}</td>' for c in cells)
                + f'<td class="num">{row_["instances"]}</td>'
                + f'<td class="num">{row_["detections"]}</td>') in table, label
    assert "<b>one</b>" not in text and 'sign "stop"' not in text
    for label in ("mAP@[.5:.95]", "mAP@.5", "mAP@.75", "recall@100 (AR)", "true boxes"):
        assert re.search(f"<th[^>]*>{re.escape(label)}</th><td>[0-9.]+</td>", evaluation), label
    assert f"<strong>verdict:</strong> {html.escape(data['verdict'])}" in evaluation
    assert f'{data["map"]:.4g}</span><span class="k">test mAP@[.5:.95]' in text
    assert '0</span><span class="k">baseline mAP (empty detector)' in text
    train = section_html(text, "train")
    assert "<th>train box recall@.5</th><th>val mAP</th>" in train
    assert "val mAP@[.5:.95]" in train and "val accuracy" not in train
    export = section_html(text, "export")
    assert re.search(r"<th[^>]*>min matched IoU</th><td>0.9991</td>", export)
    assert "<strong>NMS in the graph:</strong> class-aware, suppress at IoU &gt; 0.5" in export


def test_report_py_writes_the_detector_plots_and_no_classifier_gets_them(report, tmp_path):
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(report), encoding="utf-8")
    run = run_cli("report.py", saved)
    assert run.returncode == 0, run.stderr
    folder = tmp_path / "plots"
    assert {p.stem for p in folder.iterdir()} == {"training_curves"} | DET_PLOTS
    for name in DET_PLOTS:
        with Image.open(folder / f"{name}.png") as image:
            assert image.format == "PNG" and min(image.size) >= 200
            assert len(image.convert("RGB").getcolors(1 << 20) or [0, 0]) > 1
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert len(images_of(section_html(page, "evaluation"))) == 2 * IMAGES + len(DET_PLOTS)
    # the curves drawn: one per class with a true box, and the mean over them, in black
    figure = report_plots.pr_curve(report)
    lines = figure.axes[0].lines
    assert [line.get_label() for line in lines] == [
        "zero", "<b>one</b>", 'sign "stop" & co',
        f"all classes (mAP@.5 {report['evaluation']['map50']:.3f})"]
    assert np.mean(lines[-1].get_ydata()) == pytest.approx(report["evaluation"]["map50"])
    bars = report_plots.class_ap(report).axes[0]
    assert [t.get_text() for t in bars.texts][-1] == "no true box"
    curves = plots.training_curves(report).axes[1]
    assert curves.get_title() == "box recall, mAP per epoch"
    assert [t.get_text() for t in curves.get_legend().get_texts()][:2] == [
        "train box recall@.5", "val mAP@[.5:.95]"]
    classifier = {"evaluation": {"split": "test", "accuracy": 0.9, "labels": ["a", "b"],
                                 "per_class": [{"label": "a", "f1": 0.9}]}}
    for name in DET_PLOTS:
        assert plots.PLOTS[name](classifier) is None and plots.PLOTS[name]({}) is None
    no_curve = copy.deepcopy(report)
    no_curve["evaluation"]["pr_curve"] = {"recall": "broken"}
    assert report_plots.pr_curve(no_curve) is None and report_plots.class_ap(no_curve) is not None


def solid_png(colour: tuple[int, int, int]) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (WIDTH, HEIGHT), colour).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def test_chromium_draws_the_example_pictures(report, tmp_path):
    coloured = copy.deepcopy(report)
    for example in coloured["evaluation"]["examples"]:
        example.update({key: solid_png(colour) for key, colour in PICTURE_COLOURS.items()})
    page = tmp_path / "report.html"
    write_page(coloured, {}, page, SUMMARY_KEYS, PREDICTION_KEYS)
    shot = tmp_path / "shot.png"
    width, height = 1280, 3500
    chromium_screenshot(page, shot, width, height)
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3).astype(np.int32)
    expected = IMAGES * 192 * 144  # every picture drawn at 192 x 144 CSS pixels
    for key, colour in PICTURE_COLOURS.items():
        drawn = int((np.abs(pixels - np.array(colour)).max(1) <= 8).sum())
        assert 0.9 * expected <= drawn <= 1.1 * expected, (key, drawn, expected)
    packed = (pixels[:, 0] << 16) | (pixels[:, 1] << 8) | pixels[:, 2]
    assert len(np.unique(packed[-100 * width:])) == 1, "the page is taller than the screenshot"
