"""A segmenter's part in its report (Parts.report): its training, export, inference and TTA
rows, its evaluation's summary and page section (pixel figures, IoU and Dice per class, the
pixel confusion matrix, the examples as pictures), its headline and its plots (report_plots.py,
drawn with matplotlib, imported only when plots are drawn). ttc/reporting asks it through
ttc/reporting/kinds.py; the labels of its evaluation are here once, for the page and summary."""
from __future__ import annotations

from typing import Any, Mapping

from ttc.reporting import page
from ttc.reporting.classifier_report import (ClassifierReport, Plot, Renderer, ScoreNames,
                                             TtaFigures, with_rows)
from ttc.reporting.sections import Formatter, KeyLabels
from ttc.reporting.summary import SHOWN_CLASSES, clip, fixed, fmt

# its evaluation's figures over the test pixels (ttc/tasks/segment/metrics.py)
EVALUATION_KEYS: KeyLabels = (
    ("split", "split"), ("pixels", "pixels"), ("pixel_accuracy", "pixel accuracy"),
    ("mean_iou", "mean IoU"), ("mean_dice", "mean Dice"),
    ("frequency_weighted_iou", "frequency-weighted IoU"),
    ("baseline_mean_iou", "baseline mean IoU"),
    ("baseline_pixel_accuracy", "baseline pixel accuracy"),
    ("baseline_class", "baseline class (always answered)"),
    ("baseline_source", "baseline counted on"))
LABEL = dict(EVALUATION_KEYS)
# train.py records its train_accuracy and val_accuracy (mean IoUs, not accuracies) again under
# these names: shown under them, never as accuracies
TRAIN_ROWS: KeyLabels = (("train_mean_iou", "train mean IoU"), ("val_mean_iou", "val mean IoU"))
ACCURACY_ALIASES = frozenset({"train_accuracy", "val_accuracy"})
EXPORT_ROWS: KeyLabels = (("mask_agreement", "mask agreement (pixels)"),
                          ("resolutions_checked", "resolutions checked"))
INFERENCE_ROWS: KeyLabels = (("pixel_accuracy", "test pixel accuracy"),
                             ("mean_iou", "test mean IoU"))
TTA_ROWS: KeyLabels = (("mean_iou_plain", "test mean IoU plain"),
                       ("mean_iou", "test mean IoU TTA"),
                       ("pixel_accuracy_plain", "test pixel accuracy plain"),
                       ("pixel_accuracy", "test pixel accuracy TTA"))
# where its rows go among the table's: (section, the key they follow, the rows)
ROWS_AFTER: dict[str, tuple[str, KeyLabels]] = {
    "train": ("best_epoch", TRAIN_ROWS), "export": ("padding_max_diff", EXPORT_ROWS),
    "inference": ("accuracy", INFERENCE_ROWS), "tta": ("accuracy_val_plain", TTA_ROWS)}
# an example's pictures: (its key, the caption under it)
PICTURES = (("image", "image"), ("truth", "true mask"), ("predicted", "predicted mask"))


class SegmenterReport(ClassifierReport):
    names = ScoreNames(history=("train pixel accuracy", "val mean IoU"),
                       curves=("train pixel accuracy", "val mean IoU"),
                       curves_title="pixel accuracy, mean IoU", candidate="val mIoU",
                       metric="mean IoU")
    tta = TtaFigures(scores=(("test", "mean_iou"),), unit="test pixels", metric="mean IoU")
    confusion_unit = "pixels"
    confusion_score = "pixel_accuracy"

    def recognises(self, report: Mapping[str, Any]) -> bool:
        """Its evaluation scores pixels, its training ran on masks, or its --input wrote
        masks."""
        evaluation, train, predictions = (page.as_dict(report.get(key)) for key in
                                          ("evaluation", "train", "predictions"))
        return ("mean_iou" in evaluation or train.get("val_mean_iou") is not None
                or "class_pixel_shares" in predictions)

    def keys(self, section: str, labels: KeyLabels | None, data: Any) -> KeyLabels | None:
        if labels is None or section not in ROWS_AFTER:
            return labels
        after, rows = ROWS_AFTER[section]
        own = section == "train" and page.as_dict(data).get("val_mean_iou") is not None
        return with_rows(labels, after, rows, ACCURACY_ALIASES if own else frozenset())

    def formatters(self) -> dict[str, Formatter]:
        return {**super().formatters(), "evaluation": format_evaluation}

    def renderers(self) -> dict[str, Renderer]:
        return {"evaluation": render_evaluation}

    def headline(self, report: Mapping[str, Any]) -> list[tuple[str, Any]]:
        evaluation = page.as_dict(report.get("evaluation"))
        split = evaluation.get("split") or "test"
        return [(f"{split} mean IoU", evaluation.get("mean_iou")),
                ("pixel accuracy", evaluation.get("pixel_accuracy")),
                ("mean Dice", evaluation.get("mean_dice")),
                ("baseline mean IoU", evaluation.get("baseline_mean_iou"))]

    def plots(self) -> dict[str, Plot]:
        from ttc.tasks.segment.report_plots import PLOTS  # matplotlib: only to draw them

        return PLOTS


REPORT = SegmenterReport()


# ----------------------------------------------------------------------------- summary


def format_evaluation(evaluation: dict) -> list[str]:
    """Verdict, baseline, pixel figures and per-class IoU and Dice (the weakest
    SHOWN_CLASSES when there are more)."""
    lines = [f"  {'verdict':<26} {evaluation['verdict']}",
             f"  {'baseline (majority class)':<26} mean IoU "
             f"{fmt(evaluation['baseline_mean_iou'])}, pixel accuracy "
             f"{fmt(evaluation['baseline_pixel_accuracy'])} (always "
             f"{evaluation['baseline_class']!r}, from the {evaluation['baseline_source']})"]
    lines += [f"  {LABEL[key]:<26} {fmt(evaluation[key])}"
              for key in ("pixel_accuracy", "mean_iou", "frequency_weighted_iou")]
    return lines + class_lines(evaluation) + [f"  WARNING: {warning}"
                                              for warning in evaluation["warnings"]]


def class_lines(evaluation: dict) -> list[str]:
    """The per-class table: IoU, Dice and pixels."""
    rows = [{"label": label, **row} for label, row in evaluation["per_class"].items()]
    title = "class"
    if len(rows) > SHOWN_CLASSES:
        rows = sorted(rows, key=lambda r: (r["iou"] if r["iou"] is not None else 2.0))
        rows, title = rows[:SHOWN_CLASSES], f"class ({SHOWN_CLASSES} lowest IoU of {len(rows)})"
    width = max(12, min(28, max(len(str(r["label"])) for r in rows)))
    return [f"  {title:<{width}} {'IoU':>8} {'Dice':>8} {'pixels':>10}",
            *[f"  {clip(str(r['label']), width):<{width}} {fixed(r['iou']):>8} "
              f"{fixed(r['dice']):>8} {r['pixels']:>10}" for r in rows]]


# ----------------------------------------------------------------------------- page


def class_table(per_class: Any) -> page.Html:
    """The per-class rows: IoU, Dice, true and predicted pixels."""
    rows = [(label, page.score(row.get("iou")), page.score(row.get("dice")), row.get("pixels"),
             row.get("predicted_pixels"))
            for label, row in page.as_dict(per_class).items() if isinstance(row, dict)]
    if not rows:
        return page.Html("")
    return page.Html("<h3>Per class</h3>" + page.table(["class", "IoU", "Dice", "pixels",
                                                        "predicted pixels"], rows))


def example_title(example: dict) -> str:
    """An example's index and pixel accuracy."""
    index, accuracy = example.get("index"), example.get("pixel_accuracy")
    title = f"example {page.fmt(index)}" if index is not None else "example"
    if page.is_number(accuracy):
        title += f" · pixel accuracy {accuracy:.3f}"
    return title


def confusion(data: dict, view: page.View) -> list[str]:
    """The pixel confusion matrix as a table, or where it is (too many classes)."""
    labels = [str(label) for label in data.get("labels") or []]
    matrix = data.get("confusion_matrix") or []
    if labels and len(matrix) == len(labels) and len(labels) <= page.MAX_MATRIX_CLASSES \
            and all(isinstance(r, list) and len(r) == len(labels) for r in matrix):
        return ["<h3>Confusion matrix (pixels)</h3>", page.confusion_table(labels, matrix)]
    if matrix:
        return [page.line(f"pixel confusion matrix of {len(matrix)} classes: "
                          + ("see its plot" if view.plots.has("confusion_matrix")
                             else "in the report JSON"))]
    return []


def render_evaluation(data: dict, view: page.View) -> list[str]:
    """Its figures and baseline, the verdict and warnings, the per-class IoU and Dice, the
    examples as pictures, the pixel confusion matrix, and its plots (the examples' grid only
    as a file: the page shows the pictures themselves)."""
    parts: list[str] = [page.kv_table(page.pairs(data, EVALUATION_KEYS))]
    if data.get("verdict"):
        parts.append(page.labelled_line("verdict", data["verdict"]))
    parts += [page.warnings_list(data), class_table(data.get("per_class"))]
    examples = page.examples_grid(data.get("examples"), PICTURES, example_title)
    parts.append(examples)
    if examples:
        view.plots.placed.add("segmentation_examples")
    return [*parts, *confusion(data, view), view.figures()]
