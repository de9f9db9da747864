"""page.py: the report as one self-contained HTML page. Parsed (every image a data URI, nothing
fetched from elsewhere), every user string escaped, reports from older runs still rendered, and
the page drawn by headless Chromium to a screenshot that shows its plots."""
from __future__ import annotations

import base64
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import chromium_screenshot
from ttc.reporting.page import render_page, write_page
from ttc.reporting.sections import PREDICTION_KEYS, SUMMARY_KEYS

SCRIPT = "<script>alert(1)</script>"
ESCAPED_SCRIPT = "&lt;script&gt;alert(1)&lt;/script&gt;"
QUOTED = 'dog "quoted" & co'
URL = "http://localhost:8000/v1"
LABELS = ["cat", SCRIPT, QUOTED, "bird"]
# one pure colour per plot, none of which the page's own style uses: the screenshot shows
# each plot when it holds a block of that colour
PLOT_COLOURS = {"training_curves": (255, 0, 255), "confusion_matrix": (0, 255, 255),
                "reliability": (255, 128, 0), "calibration_shift": (0, 0, 255),
                "ttt_shifts": (0, 255, 0),
                "benchmark": (128, 0, 255), "tta": (255, 255, 0)}
PLOT_SIZE = (220, 110)
SECTIONS = ["dataset", "teacher", "train", "export", "quantize", "fp16", "inference", "tta",
            "benchmark", "ttt", "iterative", "predictions", "evaluation", "calibration", "config"]
# where a src/href/… may point: an embedded PNG or a place on the page itself
URL_ATTRIBUTES = {"src", "href", "srcset", "action", "formaction", "poster", "background",
                  "data", "xlink:href", "ping", "cite", "longdesc", "manifest", "codebase"}


def reliability(shift: float = 0.0) -> dict:
    count = [0] * 9 + [3, 5, 8, 13, 21, 40]
    confidence = [None] * 9 + [0.63, 0.7, 0.76, 0.83, 0.9, 0.97]
    accuracy = [None] * 9 + [0.5 + shift, 0.6, 0.75, 0.8 + shift, 0.9, 0.95]
    return {"bins": 15, "confidence": confidence, "accuracy": accuracy, "count": count}


def calibration() -> dict:
    """The issue-21 `calibration` section: T = 0.515 fitted on validation, its effect on the
    test split, and two corruptions measuring four variants (one a hostile name)."""
    variants = ["single", "single+T", "mc_dropout", "<b>mc</b>+T"]
    shifts = [{"name": name, "severity": 3, "rows": [
        {"variant": v, "accuracy": 0.8 - 0.3 * k, "ece": 0.0612 + 0.2 * k + 0.01 * j,
         "nll": 0.5} for j, v in enumerate(variants)]}
        for k, name in enumerate(["gaussian_noise", "<contrast>"])]
    return {"temperature": 0.5151376, "method": "laplace", "fitted_on": "validation",
            "fit_samples": 120, "fit_errors": 0,
            "fit_note": "0 errors in 120 & NLL keeps falling as T → 0", "split": "test",
            "samples": 84, "accuracy_before": 0.8690476, "accuracy_after": 0.8690476,
            "mean_confidence_before": 0.81, "mean_confidence_after": 0.86,
            "ece_before": 0.0227339, "ece_after": 0.0093670, "nll_before": 0.0287287,
            "nll_after": 0.0130318, "ece_change_interval_90": [-0.01774, -0.00972],
            "nll_change_interval_90": [-0.02138, -0.01111],
            "verdict": f"temperature scaling (T = 0.515) lowers ECE {SCRIPT}",
            "reliability_before": reliability(0.1), "reliability_after": reliability(),
            "shifts": shifts,
            "under_shift": {"mean_ece": {v: 0.1612 + 0.01 * j for j, v in enumerate(variants)},
                            "best": "single"}}


def full_report(tmp_path: Path) -> dict:
    """A report with every section, the issue-20 and 21 keys included, and hostile user
    strings."""
    matrix = [[20, 1, 0, 2], [3, 15, 1, 0], [0, 2, 18, 1], [1, 0, 0, 19]]
    per_class = [{"label": label, "precision": 0.9 - 0.05 * k, "recall": 0.85 + 0.02 * k,
                  "f1": 0.961111 - 0.1 * k, "support": sum(matrix[k])}
                 for k, label in enumerate(LABELS)]
    return {
        "version": 1, "status": "ok", "error": None,
        "config": {"model_type": "text_classifier", "dataset_path": "data/<b>reviews</b>.csv",
                   "teacher_lm": "openai/local-model", "teacher_api_base": URL,
                   "lr_candidates": [0.003, 0.001], "ep_options": {"<i>key</i>": "v"},
                   "<img src=http://evil.example/x.png>": "a hostile key", "seed": 0,
                   "tta_threshold": None},
        "dataset": {"path": "data/<img src=x onerror=alert(1)>.csv",
                    "model_type": "text_classifier", "num_classes": 4, "train": 560,
                    "val": 120, "test": 84, "given_splits": False, "skipped_images": 0,
                    "dropped_rows": 3, "vocab_size": 5012,
                    "dropped_reasons": [{"count": 3, "reason": "an empty <label>",
                                         "file": "/data/my <file>.csv", "first_rows": [2, 5]}]},
        "teacher": {"lm": f"openai/local-model at {URL}", "program": "predict", "demos": 4,
                    "val_accuracy": 0.81, "val_samples": 120, "unlabeled_texts": 300,
                    "labelled": 290, "student_accuracy_without_teacher": 0.8,
                    "student_accuracy_with_teacher": 0.86,
                    "verdict": f"the teacher helps: +6 pt {SCRIPT}", "seconds": 12.5},
        "train": {"samples": 560, "epochs_run": 3, "best_epoch": 3, "train_accuracy": 0.97,
                  "val_accuracy": 0.9123456, "seconds": 4.2, "learning_rate": 0.003,
                  "candidates": [{"index": 0, "learning_rate": 0.003, "seed": 0,
                                  "val_accuracy": 0.91, "val_loss": 0.31, "best_epoch": 3,
                                  "seconds": 2.0},
                                 {"index": 1, "learning_rate": 0.001, "seed": 1,
                                  "val_accuracy": 0.88, "val_loss": 0.4, "best_epoch": 2,
                                  "seconds": 2.1}],
                  "chosen_candidate": 0,
                  "diverged_candidates": [{"index": 2, "learning_rate": 10.0,
                                           "reason": "diverged at epoch 1, batch 3"}],
                  "history": [{"epoch": e, "loss": 1.2 / e, "train_accuracy": 0.6 + 0.1 * e,
                               "val_accuracy": 0.58 + 0.1 * e,
                               "val_loss": None if e == 1 else 1.0 / e, "seconds": 1.4}
                              for e in (1, 2, 3)],
                  "health": {"loss_start": 1.2, "loss_end": 0.4, "loss_fall": 0.6667,
                             "hint": "the training loss fell only 3.0% over 3 epochs at "
                                     "learning rate 0.003: try --lr_candidates"}},
        "evaluation": {"split": "test", "samples": 84, "labels": LABELS, "accuracy": 0.8690476,
                       "per_class": per_class, "macro_f1": 0.8612, "balanced_accuracy": 0.8655,
                       "confusion_matrix": matrix,
                       "top_confusions": [{"true": SCRIPT, "predicted": "cat", "count": 3},
                                          {"true": "cat", "predicted": "bird", "count": 2}],
                       "baseline_class": SCRIPT, "baseline_accuracy": 0.25,
                       "baseline_source": "train split",
                       "verdict": f"useful: accuracy 0.8690 against 0.2500 for always "
                                  f"{SCRIPT!r} (+0.6190); every class recognised",
                       "warnings": [f"recall 0 for 1 class: {QUOTED!r} never predicted right"],
                       "reliability": reliability()},
        "export": {"path": str(tmp_path / "model <v2>.onnx"), "opset": 18,
                   "nodes_before_slim": 14, "nodes_after_slim": 12, "size_bytes": 265844,
                   "checker": "passed", "max_abs_diff": 1.430511474609375e-06,
                   "top1_agreement": 1.0, "seconds": 1.2},
        "quantize": {"mode": "dynamic", "path": "model.int8.onnx", "size_bytes_fp32": 265844,
                     "size_bytes": 90000, "accuracy_fp32": 0.869, "accuracy": 0.857,
                     "top1_agreement": 0.98, "latency_ms_p50_fp32": 2.9553,
                     "latency_ms_p50": 2.1, "verdict": "int8 is 29% faster"},
        "fp16": {"path": "model.fp16.onnx", "provider": "CUDAExecutionProvider",
                 "accuracy_fp32": 0.869, "accuracy": 0.869, "max_abs_diff": 0.0004,
                 "verdict": "fp16 keeps the accuracy"},
        "inference": {"model_path": "model.onnx", "providers_active": ["CPUExecutionProvider"],
                      "accuracy": 0.8690476, "batch_size": 64, "latency_ms_p50": 2.85,
                      "latency_ms_p95": 3.39, "throughput_per_s": 21044.0},
        "tta": {"transforms": ["shift:1"], "merge": "mean", "views": 5, "backend": "onnx_graph",
                "accuracy_plain": 0.869, "accuracy": 0.881, "accuracy_val_plain": 0.9,
                "accuracy_val": 0.91, "fixed": 2, "broken": 1, "cost_ratio": 4.93,
                "triggered_fraction": 1.0, "verdict": "TTA helps on validation"},
        "ttt": {"method": "all", "mode": "episodic", "iterations": 1, "bn_prior": 0.0,
                "learning_rate": 0.001, "batch_size": 64, "severity": 3,
                "clean": {"accuracy_source": 0.869, "accuracy_bn": 0.87, "accuracy_tent": None,
                          "cost_ratio_bn": 1.39},
                "shifts": [{"name": "<noise>", "severity": 3, "accuracy_source": 0.5,
                            "accuracy_bn": 0.7, "accuracy_tent": 0.72, "cost_ratio_bn": 1.4,
                            "cost_ratio_tent": 7.3}],
                "mean_shifted": {"accuracy_source": 0.5, "accuracy_bn": 0.7,
                                 "accuracy_tent": 0.72},
                "not_applicable": {}, "verdict": "bn: shifted +20 pt"},
        "iterative": {"mode": "mc_dropout", "backend": "batched", "iterations": 8,
                      "passes_used": 8.0, "verdict": "mc_dropout lowers ECE",
                      "rows": [{"variant": "single", "temperature": None, "accuracy": 0.869,
                                "nll": 0.42, "ece": 0.08, "mean_confidence": 0.8,
                                "accuracy_at_90_coverage": 0.9, "passes_used": 1,
                                "cost_ratio": 1.0, "reliability": reliability()},
                               {"variant": "single+T", "temperature": 0.5151376,
                                "accuracy": 0.869, "nll": 0.3, "ece": 0.04,
                                "mean_confidence": 0.85, "accuracy_at_90_coverage": 0.9,
                                "passes_used": 1, "cost_ratio": 1.0,
                                "reliability": reliability(0.02)},
                               {"variant": "mc_dropout", "temperature": None, "accuracy": 0.87,
                                "nll": 0.4, "ece": 0.05, "mean_confidence": 0.82,
                                "accuracy_at_90_coverage": 0.91, "passes_used": 8.0,
                                "cost_ratio": 1.15, "reliability": reliability(0.05)}]},
        "benchmark": [{"variant": "pytorch eager fp32", "provider": "torch cpu",
                       "size_mb": 0.273, "accuracy": 0.869, "latency_ms_p50_batch1": 0.4875,
                       "latency_ms_p95_batch1": 0.5616, "throughput_per_s": 11277.7,
                       "batch_size": 64},
                      {"variant": "onnxruntime <fp32>", "provider": "CPUExecutionProvider",
                       "size_mb": 0.266, "accuracy": 0.869, "latency_ms_p50_batch1": 0.0856,
                       "latency_ms_p95_batch1": 0.1154, "throughput_per_s": 26813.9,
                       "batch_size": 64}],
        "calibration": calibration(),
        "predictions": {"input": "new <rows>.csv", "output": "predictions.csv", "rows": 10,
                        "predicted": 9, "failed": 1, "errors_path": "errors.csv",
                        "labeled": 10, "accuracy": 0.9, "rows_per_s": 1234.5},
        "plots": {},
        "seconds_total": 23.981,
    }


def make_plots(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    plots = {}
    for name, colour in PLOT_COLOURS.items():
        plots[name] = folder / f"{name}.png"
        Image.new("RGB", PLOT_SIZE, colour).save(plots[name], format="PNG")
    return plots


def render(report: dict, plots: dict) -> str:
    return render_page(report, plots, SUMMARY_KEYS, PREDICTION_KEYS)


class Page(HTMLParser):
    """The page's tags with their attributes, its text and its style sheet."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.style: list[str] = []
        self._in_style = False
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        (self.style if self._in_style else self.text).append(data)

    def all(self, tag: str) -> list[dict]:
        return [attrs for name, attrs in self.tags if name == tag]

    def ids(self) -> list[str]:
        return [attrs["id"] for _, attrs in self.tags if "id" in attrs]


@pytest.fixture
def full(tmp_path):
    return full_report(tmp_path), make_plots(tmp_path / "plots")


def test_full_page_is_self_contained_and_shows_every_section(full):
    report, plots = full
    text = render(report, plots)
    page = Page(text)
    images = page.all("img")
    assert len(images) == len(PLOT_COLOURS)
    embedded = set()
    for attrs in images:
        assert attrs["src"].startswith("data:image/png;base64,"), attrs["src"][:60]
        embedded.add(base64.b64decode(attrs["src"].split(",", 1)[1], validate=True))
    assert embedded == {path.read_bytes() for path in plots.values()}
    # nothing fetched: no script, stylesheet, frame or base; every URL an image or an anchor
    assert not {tag for tag, _ in page.tags} & {"script", "link", "iframe", "object", "embed",
                                                 "base", "frame", "audio", "video", "source"}
    for tag, attrs in page.tags:
        for name, value in attrs.items():
            if name in URL_ATTRIBUTES:
                assert value.startswith(("data:image/png;base64,", "#")), (tag, name, value)
        if tag == "meta":
            assert "http-equiv" not in attrs
    style = "".join(page.style)
    assert "url(" not in style and "@import" not in style and "http" not in style
    # a URL the report mentions stays readable text: not a reference
    assert URL in "".join(page.text)
    # every section, in the order of the text summary, and the headline's verdict and warning
    assert [i for i in page.ids() if i in SECTIONS] == SECTIONS
    assert "useful: accuracy 0.8690" in text and "never predicted right" in text
    assert "the training loss fell only 3.0%" in text  # the training-health hint
    assert "0.9611" in text and "0.961111" not in text  # 4 significant digits, like _fmt
    assert any(attrs.get("class") == "cm" for attrs in page.all("table"))
    assert "total seconds: 24.0" in text


def test_every_user_string_is_escaped(full):
    report, plots = full
    text = render(report, plots)
    assert SCRIPT not in text
    assert text.count(ESCAPED_SCRIPT) >= 4  # per-class table, confusions, matrix, baseline
    assert "dog &quot;quoted&quot; &amp; co" in text
    assert "<b>" not in text and "<i>" not in text and "<label>" not in text
    page = Page(text)
    # the hostile file name and config key stayed text: only the six plots are images
    assert len(page.all("img")) == len(PLOT_COLOURS)
    assert "data/<img src=x onerror=alert(1)>.csv" in "".join(page.text)
    assert "<img src=http://evil.example/x.png>" in "".join(page.text)
    assert not any("onerror" in attrs for _, attrs in page.tags)
    # a label in an attribute (the confusion matrix's titles) cannot close the quotes
    titles = [attrs["title"] for _, attrs in page.tags if "title" in attrs]
    assert QUOTED in titles and SCRIPT in titles


def test_error_report_and_older_reports_render(tmp_path):
    error = {"version": 1, "status": "error", "config": {"dataset_path": "x.csv"},
             "error": {"code": 3, "message": "cannot read <x.csv>: no such file"},
             "dataset": None, "train": None, "seconds_total": 0.5}
    text = render(error, {})
    assert 'class="banner error"' in text and "cannot read &lt;x.csv&gt;" in text
    assert "exit 3" in text
    older = full_report(tmp_path)
    for key in ("evaluation", "calibration", "teacher", "fp16", "tta", "ttt", "iterative",
                "benchmark", "predictions", "plots"):
        older.pop(key)
    for key in ("history", "health", "candidates", "chosen_candidate", "diverged_candidates"):
        older["train"].pop(key)
    missing = {"training_curves": tmp_path / "not_written.png"}
    page = Page(render(older, missing))
    assert page.all("img") == []
    assert [i for i in page.ids() if i in SECTIONS] == ["dataset", "train", "export",
                                                        "quantize", "inference", "config"]
    assert "<html" in render_page({}, {})


def test_without_label_lists_each_section_shows_its_own_keys(full):
    report, plots = full
    text = render_page(report, plots)
    assert "vocab size" in text and "5012" in text and "rows per s" in text
    assert len(Page(text).all("img")) == len(PLOT_COLOURS)


def test_evaluation_follows_inference_in_a_run_without_predictions(full):
    report, plots = full
    del report["predictions"]
    text = render(report, plots)
    page = Page(text)
    assert [i for i in page.ids() if i in SECTIONS] == [
        "dataset", "teacher", "train", "export", "quantize", "fp16", "inference", "evaluation",
        "calibration", "tta", "benchmark", "ttt", "iterative", "config"]
    # the reliability diagram drawn once, under the calibration; the iterative block points there
    assert len(page.all("img")) == len(PLOT_COLOURS)
    assert "see the diagram under <a href=\"#calibration\">Calibration</a>" in text
    del report["calibration"]  # an older report: the diagram under the evaluation
    text = render(report, plots)
    assert "see the diagram under <a href=\"#evaluation\">Evaluation</a>" in text
    assert images_in(text, "evaluation") == [plots["confusion_matrix"].read_bytes(),
                                             plots["reliability"].read_bytes()]


def section_html(text: str, name: str) -> str:
    """The markup of one section of the page ("" when it has none)."""
    start = text.find(f'<section id="{name}">')
    return text[start:text.index("</section>", start)] if start >= 0 else ""


def images_in(text: str, name: str) -> list[bytes]:
    """The PNGs embedded in one section, in order."""
    return [base64.b64decode(attrs["src"].split(",", 1)[1])
            for attrs in Page(section_html(text, name)).all("img")]


def test_calibration_section_shows_the_temperature_its_effect_and_the_shifts(full):
    report, plots = full
    text = render(report, plots)
    html = section_html(text, "calibration")
    shown = " ".join(" ".join(Page(html).text).split())
    assert "<h2>Calibration</h2>" in html
    assert "temperature T = 0.5151, method laplace, fitted on 120 validation samples, " \
        "0 errors" in shown
    assert "fit: 0 errors in 120 & NLL keeps falling as T → 0" in shown
    assert "0 errors in 120 &amp; NLL" in html  # escaped
    # the before/after table: 4 decimals, and the intervals of the ECE and NLL changes
    assert "without T (T = 1) with T = 0.5151 90% interval of the change" in shown
    assert "ECE 0.0227 0.0094 [-0.0177, -0.0097]" in shown
    assert "NLL 0.0287 0.0130 [-0.0214, -0.0111]" in shown
    assert "mean confidence 0.8100 0.8600" in shown
    # the verdict, escaped
    assert f"verdict: temperature scaling (T = 0.515) lowers ECE {SCRIPT}" in shown
    assert SCRIPT not in html and ESCAPED_SCRIPT in html
    # under shift: a row per variant, ECE / accuracy per corruption, the mean, the best in bold
    assert "Under shift, ECE / accuracy (severity 3)" in shown
    assert "variant gaussian_noise <contrast> mean ECE" in shown
    assert "single+T 0.0712 / 0.8000 0.2712 / 0.5000 0.1712" in shown
    assert "<b>mc</b>+T 0.0912 / 0.8000 0.2912 / 0.5000 0.1912" in shown
    assert "&lt;b&gt;mc&lt;/b&gt;+T" in html and "&lt;contrast&gt;" in html
    assert '<tr class="kept"><td>single</td>' in html
    assert "best calibrated under shift (lowest mean ECE): single" in shown
    # its two plots here, and the reliability diagram not again under the evaluation
    assert images_in(text, "calibration") == [plots["reliability"].read_bytes(),
                                              plots["calibration_shift"].read_bytes()]
    assert images_in(text, "evaluation") == [plots["confusion_matrix"].read_bytes()]
    # the iterative table shows the "+T" rows with their temperature
    iterative = " ".join(" ".join(Page(section_html(text, "iterative")).text).split())
    assert "variant T accuracy NLL ECE" in iterative
    assert "single 0.869 0.42" in iterative and "single+T 0.5151 0.869 0.3" in iterative


def test_a_report_without_calibration_has_no_calibration_section(full):
    report, plots = full
    for change in (lambda r: r.pop("calibration"), lambda r: r.update(calibration=None)):
        changed = {**report, "iterative": {**report["iterative"], "rows": [
            {k: v for k, v in row.items() if k != "temperature"}
            for row in report["iterative"]["rows"] if not row["variant"].endswith("+T")]}}
        change(changed)
        plots_now = {k: v for k, v in plots.items() if k != "calibration_shift"}
        text = render(changed, plots_now)
        assert 'id="calibration"' not in text and "Calibration" not in text
        assert "temperature T" not in text and "Under shift" not in text
        assert "variant accuracy NLL ECE" in " ".join(
            " ".join(Page(section_html(text, "iterative")).text).split())  # no T column
        assert images_in(text, "evaluation") == [plots["confusion_matrix"].read_bytes(),
                                                 plots["reliability"].read_bytes()]


def test_a_run_without_a_temperature_or_shifts_still_shows_its_calibration(full):
    report, plots = full
    report["calibration"].update(method="none", temperature=1.0, shifts=None, under_shift=None,
                                 fit_note=None, verdict="not calibrated (--calibrate none)")
    del plots["calibration_shift"]
    text = render(report, plots)
    shown = " ".join(" ".join(Page(section_html(text, "calibration")).text).split())
    assert "temperature T = 1.0000, method none" in shown and "fit:" not in shown
    assert "verdict: not calibrated (--calibrate none)" in shown
    assert "Under shift" not in shown
    assert images_in(text, "calibration") == [plots["reliability"].read_bytes()]


def test_big_confusion_matrix_is_left_to_its_plot(full):
    report, plots = full
    labels = [f"class {k}" for k in range(25)]
    report["evaluation"].update(labels=labels, confusion_matrix=[[1] * 25 for _ in labels])
    text = render(report, plots)
    assert 'class="cm"' not in text and "confusion matrix of 25 classes: see its plot" in text


def test_write_page_writes_the_rendered_page_atomically(full, tmp_path):
    report, plots = full
    out = tmp_path / "run" / "report.html"
    write_page(report, plots, out)
    assert out.read_text(encoding="utf-8") == render_page(report, plots)
    assert [p.name for p in out.parent.iterdir()] == ["report.html"]


def test_chromium_draws_the_page_with_its_plots(full, tmp_path):
    report, plots = full
    page = tmp_path / "report.html"
    write_page(report, plots, page)
    shot = tmp_path / "shot.png"
    width, height = 1280, 7500  # the whole page, plots included
    chromium_screenshot(page, shot, width, height)
    image = Image.open(shot).convert("RGB")
    assert image.size == (width, height)
    pixels = np.asarray(image).reshape(-1, 3).astype(np.int32)
    packed = (pixels[:, 0] << 16) | (pixels[:, 1] << 8) | pixels[:, 2]
    # text, tables, plots: not a blank or single-colour page
    assert len(np.unique(packed)) > 50
    inked = float((pixels.min(1) < 200).mean())
    assert inked > 0.01, inked
    # each plot drawn (its colour over most of its area), and the page fits the window
    for name, colour in PLOT_COLOURS.items():
        drawn = int((np.abs(pixels - np.array(colour)).max(1) <= 8).sum())
        assert drawn >= 0.8 * PLOT_SIZE[0] * PLOT_SIZE[1], (name, drawn)
    assert len(np.unique(packed[-100 * width:])) == 1, "the page is taller than the screenshot"
