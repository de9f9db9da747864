"""A detector's part in its report (Parts.report): its training, export, inference, TTA and
--input rows, its evaluation's summary and page section (COCO's figures, AP per class, the
examples with their boxes drawn), the NMS its graph runs, its headline and its plots
(report_plots.py, drawn with matplotlib, imported only when plots are drawn). ttc/reporting asks
it through ttc/reporting/kinds.py; the labels of its evaluation are here once, for the page and
the summary."""
from __future__ import annotations

from typing import Any, Callable, Mapping

from ttc.reporting import page
from ttc.reporting.classifier_report import (ClassifierReport, Plot, Renderer, ScoreNames,
                                             with_rows)
from ttc.reporting.sections import Formatter, KeyLabels
from ttc.reporting.summary import SHOWN_CLASSES, clip, fixed, fmt

# COCO's figures over the test boxes (ttc/tasks/detect/metrics.py), in the summary and the page
FIGURES: KeyLabels = (
    ("map", "mAP@[.5:.95]"), ("map50", "mAP@.5"), ("map75", "mAP@.75"),
    ("recall_100", "recall@100 (AR)"), ("map_small", "mAP small (< 32²)"),
    ("map_medium", "mAP medium"), ("map_large", "mAP large (≥ 96²)"))
# the page's rows of its evaluation
EVALUATION_KEYS: KeyLabels = (
    ("split", "split"), ("images", "images"), ("instances", "true boxes"),
    ("detections", "detections"), *FIGURES,
    ("baseline_map", "baseline mAP (an empty detector)"))
# train.py records its train_accuracy and val_accuracy (mAPs) again under these names: shown
# under them, never as accuracies
TRAIN_ROWS: KeyLabels = (("train_map", "train mAP@[.5:.95]"), ("val_map", "val mAP@[.5:.95]"))
ACCURACY_ALIASES = frozenset({"train_accuracy", "val_accuracy"})
EXPORT_ROWS: KeyLabels = (
    ("resolutions_checked", "resolutions checked"), ("detections_checked", "detections checked"),
    ("min_matched_iou", "min matched IoU"), ("count_mismatches", "images with another count"))
INFERENCE_ROWS: KeyLabels = (("map", "test mAP@[.5:.95]"), ("map50", "test mAP@.5"))
TTA_ROWS: KeyLabels = (
    ("map_plain", "test mAP@[.5:.95] plain"), ("map", "test mAP@[.5:.95] TTA"),
    ("map_wbf", "exact WBF mAP@[.5:.95]"), ("map50_plain", "test mAP@.5 plain"),
    ("map50", "test mAP@.5 TTA"), ("map50_wbf", "exact WBF mAP@.5"),
    ("fusion_iou", "box fusion IoU"))
# --input counts images (ttc/tasks/detect/predict.py's section): predicted images, found boxes,
# the images with at least one box
PREDICTION_ROWS: KeyLabels = (("predicted", "images predicted"), ("boxes", "boxes found"),
                              ("images_with_detections", "images with boxes"))
# where its rows go among the table's: (section, the key they follow, the rows, the keys left
# out: the table's label of `predicted` counts rows)
ROWS_AFTER: dict[str, tuple[str, KeyLabels, frozenset[str]]] = {
    "train": ("best_epoch", TRAIN_ROWS, ACCURACY_ALIASES),
    "export": ("padding_max_diff", EXPORT_ROWS, frozenset()),
    "inference": ("accuracy", INFERENCE_ROWS, frozenset()),
    "tta": ("accuracy_val_plain", TTA_ROWS, frozenset()),
    "predictions": ("predicted", PREDICTION_ROWS, frozenset({"predicted"}))}
PICTURES = (("truth", "true boxes"), ("predicted", "predicted boxes"))
EXAMPLE_SIDE = 192  # CSS pixels: an example's longer side on the page, its class names legible


class DetectorReport(ClassifierReport):
    names = ScoreNames(history=("train box recall@.5", "val mAP"),
                       curves=("train box recall@.5", "val mAP@[.5:.95]"),
                       curves_title="box recall, mAP", candidate="val mAP",
                       metric="mAP@[.5:.95]")

    def recognises(self, report: Mapping[str, Any]) -> bool:
        """Its evaluation or training is scored by COCO's mAP, or its --input found boxes."""
        evaluation, train, predictions = (page.as_dict(report.get(key)) for key in
                                          ("evaluation", "train", "predictions"))
        return (evaluation.get("metric") == "map" or train.get("metric") == "map"
                or train.get("val_map") is not None or "boxes_per_class" in predictions)

    def keys(self, section: str, labels: KeyLabels | None, data: Any) -> KeyLabels | None:
        if labels is None or section not in ROWS_AFTER:
            return labels
        after, rows, without = ROWS_AFTER[section]
        if section == "train" and page.as_dict(data).get("val_map") is None:
            without = frozenset()  # an older section: its scores under the accuracy keys only
        return with_rows(labels, after, rows, without)

    def formatters(self) -> dict[str, Formatter]:
        return {**super().formatters(), "evaluation": format_evaluation, "export": format_nms}

    def renderers(self) -> dict[str, Renderer]:
        return {"evaluation": render_evaluation, "export": render_export}

    def headline(self, report: Mapping[str, Any]) -> list[tuple[str, Any]]:
        """mAP, mAP@.5 and @.75, recall, the empty detector's mAP."""
        evaluation = page.as_dict(report.get("evaluation"))
        split = evaluation.get("split") or "test"
        return [(f"{split} mAP@[.5:.95]", evaluation.get("map")),
                ("mAP@.5", evaluation.get("map50")), ("mAP@.75", evaluation.get("map75")),
                ("recall@100", evaluation.get("recall_100")),
                ("baseline mAP (empty detector)", evaluation.get("baseline_map"))]

    def plots(self) -> dict[str, Plot]:
        from ttc.tasks.detect.report_plots import PLOTS  # matplotlib: only to draw them

        return PLOTS


REPORT = DetectorReport()


# ----------------------------------------------------------------------------- summary


def format_evaluation(evaluation: dict) -> list[str]:
    """Verdict, the empty detector's mAP as the baseline, COCO's figures, the boxes, and the
    per-class table."""
    lines = [f"  {'verdict':<26} {evaluation['verdict']}",
             f"  {'baseline (empty detector)':<26} mAP "
             f"{fmt(evaluation.get('baseline_map', 0.0))} (finds nothing)"]
    lines += [f"  {label:<26} {fmt(evaluation[key])}" for key, label in FIGURES
              if evaluation.get(key) is not None]
    lines.append(f"  {'boxes':<26} {evaluation.get('instances')} true in "
                 f"{evaluation.get('images')} images, {evaluation.get('detections')} detected")
    return lines + class_lines(evaluation) + [
        f"  WARNING: {warning}" for warning in evaluation.get("warnings") or []]


def class_lines(evaluation: dict) -> list[str]:
    """Per class AP, AP@.5, AP@.75, true and detected boxes (the lowest SHOWN_CLASSES APs when
    there are more)."""
    rows = list(evaluation.get("per_class") or [])
    title = "class"
    if len(rows) > SHOWN_CLASSES:
        ranked = sorted(rows, key=lambda r: 2.0 if r["ap"] is None else r["ap"])
        rows, title = ranked[:SHOWN_CLASSES], f"class ({SHOWN_CLASSES} lowest AP of {len(rows)})"
    if not rows:
        return []
    width = max(12, min(28, max(len(str(r["label"])) for r in rows)))
    return [f"  {title:<{width}} {'AP':>8} {'AP@.5':>8} {'AP@.75':>8} {'boxes':>8} "
            f"{'detected':>9}",
            *[f"  {clip(str(r['label']), width):<{width}} {fixed(r['ap']):>8} "
              f"{fixed(r['ap50']):>8} {fixed(r['ap75']):>8} {r['instances']:>8} "
              f"{r['detections']:>9}" for r in rows]]


def nms_text(nms: dict, show: Callable[[Any], str] = fmt) -> str:
    """The NMS the graph runs, in words (its values as `show` writes them)."""
    return (f"class-aware, suppress at IoU > {show(nms.get('iou_threshold'))}, keep score > "
            f"{show(nms.get('score_threshold'))}, at most {show(nms.get('max_detections'))} "
            "detections per image")


def format_nms(export: dict) -> list[str]:
    """The export check beyond the key rows: the NMS the graph runs."""
    nms = export.get("nms")
    return [f"  {'NMS in the graph':<26} {nms_text(nms)}"] if isinstance(nms, dict) else []


# ----------------------------------------------------------------------------- page


def class_table(per_class: Any) -> page.Html:
    """The per-class rows: AP@[.5:.95], AP@.5, AP@.75 (a dash for a class without a true box),
    true boxes and detections."""
    rows = [(row.get("label"), page.score(row.get("ap")), page.score(row.get("ap50")),
             page.score(row.get("ap75")), row.get("instances"), row.get("detections"))
            for row in per_class if isinstance(row, dict)] if isinstance(per_class, list) else []
    if not rows:
        return page.Html("")
    return page.Html("<h3>Per class</h3>" + page.table(
        ["class", "AP@[.5:.95]", "AP@.5", "AP@.75", "true boxes", "detections"], rows))


def example_title(example: dict) -> str:
    """An example's index and how many boxes are true and drawn as predicted."""
    index = example.get("index")
    title = f"example {page.fmt(index)}" if index is not None else "example"
    counts = [f"{page.fmt(example[key])} {name}" for key, name in
              (("true_boxes", "true"), ("predicted_boxes", "predicted"))
              if page.is_number(example.get(key))]
    return " · ".join([title, ", ".join(counts)]) if counts else title


def render_evaluation(data: dict, view: page.View) -> list[str]:
    """COCO's figures and the empty detector's, the verdict and warnings, AP per class, the
    examples with their true and predicted boxes drawn, then its plots (per-class AP, the
    precision/recall curves)."""
    parts: list[str] = [page.kv_table(page.pairs(data, EVALUATION_KEYS))]
    if data.get("verdict"):
        parts.append(page.labelled_line("verdict", data["verdict"]))
    return [*parts, page.warnings_list(data), class_table(data.get("per_class")),
            page.examples_grid(data.get("examples"), PICTURES, example_title, EXAMPLE_SIDE),
            view.figures()]


def render_export(data: dict, view: page.View) -> list[str]:
    """The key/value rows, the NMS settings in a line of their own."""
    parts = page.render_keys(data, view)
    nms = page.as_dict(data.get("nms"))
    if nms:
        parts.insert(1, page.labelled_line("NMS in the graph", nms_text(nms, page.fmt)))
    return parts
