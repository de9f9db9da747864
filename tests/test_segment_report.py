"""A segmenter's report page and plots (issue 43, item 5): the evaluation section shows the
figures, the per-class IoU/Dice table and a grid of test images with their true and predicted
masks as pictures (never their data URLs as text); `class_iou` and `segmentation_examples` are
written for a segmenter and for no classifier; headless Chromium draws the example pictures.

The report is built by hand from the real metric and overlay code (no training)."""
from __future__ import annotations

import base64
import copy
import html
import io
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import chromium_screenshot
from ttc.reporting.run import format_summary
from ttc.reporting import plots
from ttc.reporting.page import render_page, write_page
from ttc.reporting.sections import PREDICTION_KEYS, SUMMARY_KEYS
from ttc.reporting.summary import fmt
from ttc.tasks.segment import report_plots
from ttc.tasks.segment.evaluate import example_overlays, train_pixel_counts
from ttc.tasks.segment.metrics import PixelConfusion, segmentation_scores
from ttc.tasks.segment.report import format_evaluation

LABELS = ["background", "road", "<b>car</b>", 'sign "stop" & co']
IGNORE = 255
HEIGHT, WIDTH = 20, 28  # not square: the page keeps the aspect ratio
IMAGES = 8
# pure colours of the Chromium check's pictures, none of which the page's own style uses
PICTURE_COLOURS = {"image": (255, 0, 255), "truth": (0, 255, 255), "predicted": (255, 255, 0)}
SEG_PLOTS = {"class_iou", "segmentation_examples"}


def masks_and_images(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images (N, 1, H, W) in [0, 1], true masks, predicted masks): a block of each class per
    image, a corner of void, and the prediction wrong on a stripe."""
    rng = np.random.default_rng(seed)
    truth = np.zeros((IMAGES, HEIGHT, WIDTH), np.int64)
    for k in range(IMAGES):
        for label in range(1, len(LABELS)):
            top, left = rng.integers(0, HEIGHT - 6), rng.integers(0, WIDTH - 6)
            truth[k, top:top + 6, left:left + 6] = label
        truth[k, :2, :2] = IGNORE
    predicted = np.where(truth == IGNORE, 0, truth)
    predicted[:, :, 3 + np.arange(IMAGES) % 4] = 1  # each image a wrong column of 'road'
    x = np.clip(0.2 + 0.2 * np.where(truth == IGNORE, 0, truth)
                + rng.normal(0, 0.05, truth.shape), 0, 1)
    return x[:, None].astype(np.float32), truth, predicted


def segmenter_report() -> dict:
    x, truth, predicted = masks_and_images()
    confusion = PixelConfusion(len(LABELS), IGNORE).add(predicted, truth)
    evaluation = segmentation_scores(confusion.matrix, LABELS,
                                     train_pixel_counts(truth, len(LABELS)))
    evaluation["examples"] = example_overlays(x, truth, predicted, IGNORE)
    history = [{"epoch": e, "loss": 2.0 / e, "train_accuracy": 0.5 + 0.1 * e,
                "val_accuracy": 0.3 + 0.1 * e, "val_loss": 1.8 / e, "seconds": 0.2}
               for e in (1, 2, 3)]
    return {
        "version": 1, "status": "ok", "error": None,
        "config": {"model_type": "image_segmenter", "dataset_path": "data/canvases"},
        "dataset": {"path": "data/canvases", "model_type": "image_segmenter",
                    "num_classes": len(LABELS), "train": 84, "val": 18, "test": IMAGES},
        "train": {"samples": 84, "epochs_run": 3, "best_epoch": 3, "train_accuracy": 0.62,
                  "val_accuracy": 0.6, "val_mean_iou": 0.6, "train_mean_iou": 0.8,
                  "seconds": 1.2, "history": history},
        "inference": {"model_path": "model.onnx", "providers_active": ["CPUExecutionProvider"],
                      "pixel_accuracy": evaluation["pixel_accuracy"],
                      "mean_iou": evaluation["mean_iou"], "batch_size": 16},
        "evaluation": evaluation, "plots": {}, "seconds_total": 9.5,
    }


def classifier_report() -> dict:
    matrix = [[20, 2], [3, 15]]
    return {"status": "ok", "evaluation": {
        "split": "test", "samples": 40, "labels": ["cat", "dog"], "accuracy": 0.875,
        "per_class": [{"label": "cat", "precision": 0.87, "recall": 0.91, "f1": 0.89,
                       "support": 22}, {"label": "dog", "precision": 0.88, "recall": 0.83,
                                        "f1": 0.86, "support": 18}],
        "confusion_matrix": matrix, "baseline_class": "cat", "baseline_accuracy": 0.55,
        "baseline_source": "train split", "verdict": "useful", "warnings": []}}


@pytest.fixture(scope="module")
def report() -> dict:
    return segmenter_report()


@pytest.fixture(scope="module")
def written(report, tmp_path_factory) -> dict[str, str]:
    """The plots of the segmenter's report, drawn once."""
    return plots.write_plots(report, tmp_path_factory.mktemp("seg") / "plots")


def section_html(text: str, name: str) -> str:
    start = text.index(f'<section id="{name}">')
    return text[start:text.index("</section>", start)]


def images_of(markup: str) -> list[str]:
    return re.findall(r'<img src="([^"]*)"', markup)


def test_the_page_shows_the_examples_as_pictures_and_the_per_class_table(report, written):
    text = render_page(report, written, SUMMARY_KEYS, PREDICTION_KEYS)
    evaluation = section_html(text, "evaluation")
    blocks = re.findall(r'<div class="example">(.*?)</div></div>', evaluation)
    assert len(blocks) == IMAGES >= 6
    for k, block in enumerate(blocks):
        sources = images_of(block)
        assert sources == [report["evaluation"]["examples"][k][key]
                           for key in ("image", "truth", "predicted")]
        assert all(s.startswith("data:image/png;base64,") for s in sources)
        # the longer side 96 CSS pixels, the aspect ratio kept, pixels drawn as squares
        assert re.findall(r'width="(\d+)" height="(\d+)"', block) == [("96", "69")] * 3
        accuracy = report["evaluation"]["examples"][k]["pixel_accuracy"]
        assert f"example {k} · pixel accuracy {accuracy:.3f}" in block
        assert [c for c in re.findall(r"<figcaption>([^<]*)</figcaption>", block)] == [
            "image", "true mask", "predicted mask"]
    assert ".example figure img { image-rendering: pixelated;" in text
    # no data URL as text: every one sits in an <img src>, the examples' plot is left out
    # (the page shows its pictures) and the IoU chart and confusion matrix are embedded
    sources = images_of(text)
    assert text.count("data:image") == len(sources)
    shown = {base64.b64decode(s.split(",", 1)[1]) for s in images_of(evaluation)}
    assert Path(written["class_iou"]).read_bytes() in shown
    assert Path(written["confusion_matrix"]).read_bytes() in shown
    assert Path(written["segmentation_examples"]).read_bytes() not in shown
    assert 'id="plots"' not in text  # nothing left over for "Other plots"
    # the per-class table: every label, escaped, with its IoU, Dice and pixels
    table = evaluation[evaluation.index("<h3>Per class</h3>"):]
    table = table[:table.index("</table>")]
    assert "<th>class</th><th>IoU</th><th>Dice</th><th>pixels</th><th>predicted pixels</th>" \
        in table
    per_class = report["evaluation"]["per_class"]
    for label in LABELS:
        row = per_class[label]
        assert (f"<td>{html.escape(label)}</td>"
                + f'<td class="num">{row["iou"]:.4f}</td>'
                + f'<td class="num">{row["dice"]:.4f}</td>'
                + f'<td class="num">{row["pixels"]}</td>') in table
    assert "<b>car</b>" not in text and 'sign "stop"' not in text
    # the figures, the verdict and the headline's mean IoU
    for label in ("pixel accuracy", "mean IoU", "mean Dice", "frequency-weighted IoU",
                  "baseline mean IoU"):
        assert re.search(f"<th[^>]*>{label}</th><td>[0-9.]+</td>", evaluation), label
    assert "verdict:" in evaluation and "Confusion matrix (pixels)" in evaluation
    assert f'{report["evaluation"]["mean_iou"]:.4g}</span><span class="k">test mean IoU' in text
    assert "<th>train pixel accuracy</th><th>val mean IoU</th>" in section_html(text, "train")


def test_a_broken_example_is_named_not_shown(report):
    broken = copy.deepcopy(report)
    examples = broken["evaluation"]["examples"]
    examples[0]["truth"] = 'data:image/png;base64,AAAA" onerror="alert(1)'
    examples[1]["image"] = "javascript:alert(1)"
    text = render_page(broken, {})
    assert "onerror" not in text and "javascript:" not in text
    assert text.count("true mask: not shown") == 1 and text.count("image: not shown") == 1
    assert len(images_of(section_html(text, "evaluation"))) == 3 * IMAGES - 2
    # the grid plot leaves both examples out rather than failing
    figure = report_plots.segmentation_examples(broken)
    assert figure is not None and len(figure.axes) == 3 * (IMAGES - 2)


def test_the_segmenter_plots_are_written_and_absent_for_a_classifier(report, written,
                                                                     tmp_path):
    assert set(written) == {"training_curves", "confusion_matrix"} | SEG_PLOTS
    for name in SEG_PLOTS:
        with Image.open(written[name]) as image:
            assert image.format == "PNG" and min(image.size) >= 200
            assert len(image.convert("RGB").getcolors(1 << 20) or [0, 0]) > 1
    with Image.open(written["segmentation_examples"]) as image:  # a row per example
        assert image.size[1] > IMAGES * 100
    classifier = plots.write_plots(classifier_report(), tmp_path)
    assert "confusion_matrix" in classifier and not set(classifier) & SEG_PLOTS
    for name in SEG_PLOTS:
        assert plots.PLOTS[name](classifier_report()) is None
        assert plots.PLOTS[name]({}) is None
    no_examples = copy.deepcopy(report)
    no_examples["evaluation"]["examples"] = []
    assert report_plots.segmentation_examples(no_examples) is None
    assert report_plots.class_iou(no_examples) is not None


def test_the_charts_name_a_segmenter_s_scores_and_colours(report):
    from ttc.tasks.segment.masks import voc_palette

    curves = plots.training_curves(report)
    assert curves.axes[1].get_title() == "pixel accuracy, mean IoU per epoch"
    assert [t.get_text() for t in curves.axes[1].get_legend().get_texts()][:2] == [
        "train pixel accuracy", "val mean IoU"]
    matrix = plots.confusion_matrix(report)
    assert f'{report["evaluation"]["pixels"]:,} pixels, pixel accuracy' in \
        matrix.axes[0].get_title()
    # the legend under the examples colours each class as the overlays do
    assert [np.round(np.array(report_plots.voc_colour(k)) * 255).tolist() for k in range(256)] == \
        voc_palette().tolist()



def summary_rows(text: str, name: str) -> dict[str, str]:
    """The summary's labelled rows of section `name`: label -> value."""
    lines = text.splitlines()
    start = lines.index(f"{name}:") + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith(" ")),
               len(lines))
    return {line[2:28].rstrip(): line[29:] for line in lines[start:end]}


def test_the_summary_names_a_segmenter_s_figures(report):
    """Issue 63: a segmenter's training scores are mean IoUs, shown as such (never as "train
    accuracy"), and its evaluation says pixel accuracy and mean IoU with their values."""
    text = format_summary(report)
    train = summary_rows(text, "train")
    assert train["train mean IoU"] == "0.8" and train["val mean IoU"] == "0.6"
    assert "train accuracy" not in train and "val accuracy" not in train
    evaluation = summary_rows(text, "evaluation")
    assert evaluation["pixel accuracy"] == fmt(report["evaluation"]["pixel_accuracy"])
    assert evaluation["mean IoU"] == fmt(report["evaluation"]["mean_iou"])
    inference = summary_rows(text, "inference")
    assert inference["test mean IoU"] == fmt(report["evaluation"]["mean_iou"])
    page = section_html(render_page(report, {}, SUMMARY_KEYS, PREDICTION_KEYS), "train")
    assert "train accuracy" not in page and "<th>train mean IoU</th>" in page.replace(
        ' class="second"', "")

def test_the_summary_does_not_print_the_examples(report):
    lines = format_evaluation(report["evaluation"])
    assert not any("data:image" in line or "example" in line for line in lines)
    assert any(line.split()[:1] == ["road"] for line in lines)


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
    # every picture drawn at about 96 x 69 CSS pixels (a 28 x 20 PNG scaled up)
    expected = IMAGES * 96 * 69
    for key, colour in PICTURE_COLOURS.items():
        drawn = int((np.abs(pixels - np.array(colour)).max(1) <= 8).sum())
        assert 0.9 * expected <= drawn <= 1.1 * expected, (key, drawn, expected)
    packed = (pixels[:, 0] << 16) | (pixels[:, 1] << 8) | pixels[:, 2]
    assert len(np.unique(packed[-100 * width:])) == 1, "the page is taller than the screenshot"
