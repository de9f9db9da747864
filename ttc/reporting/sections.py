"""The report's sections, declared once: SECTIONS lists them in the order a reader meets them,
each with its key in the report, its title on the page, what the human summary shows of it (its
labelled keys and/or a formatter), how the page renders it and which plots it owns.
`report.py` (the summary and the JSON's skeleton), `ttc/reporting/page.py` and
`ttc/reporting/plots.py` read this table; a new section is one row here (plus its renderer or
formatter, if it needs one of its own). The labels here are a classifier's; another model
type's report part (its `Parts.report`, ttc/reporting/classifier_report.py's interface) adds its
own rows, formatters, renderers and plots, which the summary, the page and the plots ask it for.

Three orders are read from the one list: the page's is the table's; the summary has always
printed the profile after the TTA block (`summary_after`), and the JSON keeps the key order the
format has had since its first versions (`json_after`), so that a report's text does not change.
stdlib only (no torch, no matplotlib): the CLIs import it at start-up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from ttc.reporting.summary import (KeyLabels, format_benchmark, format_calibration,
                                   format_compression, format_dataset,
                                   format_engine, format_evaluation,
                                   format_iterative, format_profile, format_quantize_details,
                                   format_training, format_ttt)
from ttc.tasks.registry import TASKS

Formatter = Callable[[Any], list[str]]


@dataclass(frozen=True)
class Section:
    """One section of the report (`report[key]`, a dict unless `rows`)."""

    key: str
    title: str  # its heading on the page
    # the summary's rows "label  value", one per key with a value; the page's key/value rows too
    # (when its caller passes the labels; otherwise the page shows the section's plain keys)
    keys: KeyLabels = ()
    details: Formatter | None = None  # the summary's lines after its key rows
    page: str = "keys"  # its renderer in page.py, `_render_<page>`; "keys": the key/value rows
    plots: tuple[str, ...] = ()  # the plots (PLOT_CAPTIONS) shown in its part of the page
    own_tables: frozenset[str] = frozenset()  # keys its renderer shows in tables of their own
    rows: bool = False  # its data is a list of rows (the benchmark's), not a dict
    summary_after: str | None = None  # the summary prints it after that section instead
    summary_beneath: str | None = None  # the summary prints it only beneath that section's
    # block, in a run that predicted no --input
    json_after: str | None = None  # its key follows that section's in the JSON
    of_input: bool = False  # in a run that predicted an --input, it describes those predictions
    # and follows them: after the predictions block in the summary, at the end of the page


DATASET_KEYS: KeyLabels = (
    ("path", "path"), ("model_type", "model type"), ("num_classes", "classes"),
    ("train", "train samples"), ("calibration", "calibration slice"), ("val", "val samples"),
    ("test", "test samples"),
    ("skipped_images", "skipped images"), ("dropped_rows", "dropped rows"),
    ("vocab_size", "vocabulary"), ("num_features", "features"),
)
TEACHER_KEYS: KeyLabels = (
    ("lm", "LM"), ("program", "program"), ("demos", "demos in its prompt"),
    ("val_accuracy", "teacher val accuracy"), ("val_samples", "on val texts"),
    ("unlabeled_texts", "unlabeled texts"),
    ("skipped_known_or_repeated", "skipped (known/repeated)"), ("labelled", "labelled"),
    ("dropped_outside_classes", "dropped (not a class)"), ("unparseable", "unparseable answers"),
    ("student_train_samples", "student train samples"),
    ("student_accuracy_without_teacher", "student test acc without"),
    ("student_accuracy_with_teacher", "student test acc with"),
    ("student_val_accuracy_without_teacher", "student val acc without"),
    ("student_val_accuracy_with_teacher", "student val acc with"), ("verdict", "verdict"),
    ("seconds", "seconds"),
)
TRAIN_KEYS: KeyLabels = (
    ("samples", "train samples"), ("epochs_run", "epochs run"),
    ("epochs_not_run", "epochs not run (early stop)"), ("best_epoch", "best epoch"),
    ("train_accuracy", "train accuracy"), ("val_accuracy", "val accuracy"),
    ("device", "device"), ("amp", "mixed precision"), ("seconds", "seconds"),
)
EXPORT_KEYS: KeyLabels = (
    ("path", "model"), ("opset", "opset"), ("nodes_before_slim", "nodes before slim"),
    ("nodes_after_slim", "nodes after slim"), ("size_bytes", "size (bytes)"),
    ("checker", "onnx.checker"), ("max_abs_diff", "max |onnx - torch|"),
    ("top1_agreement", "top-1 agreement"), ("padding_max_diff", "padding max diff"),
    ("seconds", "seconds"),
)
QUANTIZE_KEYS: KeyLabels = (
    ("mode", "mode"), ("path", "model"), ("metric", "accuracy is"), ("size_bytes_fp32", "size fp32 (bytes)"),
    ("size_bytes", "size int8 (bytes)"), ("accuracy_val_fp32", "val accuracy fp32"),
    ("accuracy_val", "val accuracy int8"), ("accuracy_fp32", "test accuracy fp32"),
    ("accuracy", "test accuracy int8"), ("top1_agreement", "top-1 agreement"),
    ("latency_ms_p50_batch1_fp32", "p50 batch 1 fp32 (ms)"),
    ("latency_ms_p50_batch1", "p50 batch 1 int8 (ms)"),
    ("latency_ms_p50_fp32", "p50 fp32 (ms/batch)"), ("latency_ms_p50", "p50 int8 (ms/batch)"),
    ("verdict", "verdict"),
)
FP16_KEYS: KeyLabels = (
    ("path", "model"), ("metric", "accuracy is"), ("provider", "provider"), ("size_bytes", "size (bytes)"),
    ("accuracy_fp32", "accuracy fp32"), ("accuracy", "accuracy fp16"),
    ("max_abs_diff", "max |fp16 - fp32|"), ("latency_ms_p50_fp32", "p50 fp32 (ms/batch)"),
    ("latency_ms_p50", "p50 fp16 (ms/batch)"), ("verdict", "verdict"),
)
INFERENCE_KEYS: KeyLabels = (
    ("model_path", "model"), ("providers_active", "providers"), ("accuracy", "test accuracy"),
    ("batch_size", "batch size"), ("latency_ms_p50", "latency p50 (ms/batch)"),
    ("latency_ms_p95", "latency p95 (ms/batch)"), ("throughput_per_s", "throughput (samples/s)"),
)
TTA_KEYS: KeyLabels = (
    ("transforms", "transforms"), ("merge", "merge"), ("views", "views per sample"),
    ("backend", "views and merge in"), ("plan", "plan"),
    ("accuracy_plain", "test accuracy plain"),
    ("accuracy", "test accuracy TTA"), ("accuracy_val_plain", "val accuracy plain"),
    ("accuracy_val", "val accuracy TTA"), ("fixed", "fixed (wrong → right)"),
    ("broken", "broken (right → wrong)"), ("cost_ratio", "cost ratio (TTA / plain)"),
    ("triggered_fraction", "triggered"), ("verdict", "verdict"),
)
PREDICTIONS_KEYS: KeyLabels = (
    ("input", "input"), ("output", "output"), ("mask_dir", "masks in"),
    ("overlay_dir", "overlays in"), ("images", "images read"), ("rows", "rows read"),
    ("predicted", "rows predicted"), ("failed", "rows failed"), ("errors", "images failed"),
    ("errors_path", "errors listed in"), ("labeled", "rows with a label"),
    ("outside_classes", "labels not a class"), ("accuracy", "accuracy"),
    ("rows_per_s", "rows/s end to end"),
)


# the plots the model types declare (Task.plots) beside the table's, in their evaluation section
TYPE_PLOTS: dict[str, str] = {name: caption for task in TASKS for name, caption in task.plots}
SECTIONS: tuple[Section, ...] = (
    Section("dataset", "Dataset", DATASET_KEYS, format_dataset, page="dataset",
            own_tables=frozenset({"dropped_reasons"})),
    Section("teacher", "Teacher", TEACHER_KEYS),
    Section("train", "Training", TRAIN_KEYS, format_training, page="train",
            plots=("training_curves",),
            own_tables=frozenset({"candidates", "chosen_candidate", "diverged_candidates",
                                  "history", "health"})),
    Section("export", "ONNX export", EXPORT_KEYS),
    Section("quantize", "Quantization", QUANTIZE_KEYS, format_quantize_details, page="quantize"),
    Section("fp16", "FP16", FP16_KEYS),
    Section("compression", "Compression (pruning, quantization-aware training)",
            details=format_compression, page="compression", plots=("compression",)),
    Section("inference", "Inference (ONNX Runtime)", INFERENCE_KEYS),
    Section("profile", "Profile (ONNX Runtime)", details=format_profile, page="profile",
            summary_after="tta", json_after="engine"),
    Section("evaluation", "Evaluation", details=format_evaluation, page="evaluation",
            plots=("class_iou", "class_ap", "pr_curve", "confusion_matrix",
                   "segmentation_examples", "reliability", *TYPE_PLOTS),
            of_input=True),
    Section("calibration", "Calibration", details=format_calibration, page="calibration",
            plots=("reliability", "calibration_shift"), summary_beneath="evaluation",
            of_input=True),
    Section("tta", "Test-time augmentation", TTA_KEYS, plots=("tta",), json_after="benchmark"),
    Section("benchmark", "Benchmark", details=format_benchmark, page="benchmark",
            plots=("benchmark",), rows=True),
    Section("ttt", "Test-time training", details=format_ttt, page="ttt", plots=("ttt_shifts",)),
    Section("iterative", "Iterative inference", details=format_iterative, page="iterative",
            plots=("reliability",)),
    Section("predictions", "Predictions", PREDICTIONS_KEYS),
    Section("engine", "Engine", details=format_engine),
)
SECTION: dict[str, Section] = {section.key: section for section in SECTIONS}

# Every plot, in the order they are drawn and listed (the report's "plots"), with its caption on
# the page. The reliability diagram belongs to three sections and is shown once: under the
# calibration, else the evaluation, else the iterative block.
PLOT_CAPTIONS: dict[str, str] = {
    "training_curves": "training curves: loss and accuracy per epoch",
    "confusion_matrix": "confusion matrix (rows: true class, columns: predicted class)",
    "class_iou": "segmentation: IoU and Dice per class, with the mean IoU and the "
                 "majority-class baseline's",
    "segmentation_examples": "segmentation: test images with their true and predicted masks "
                             "overlaid",
    "class_ap": "detection: AP@[.5:.95] and AP@.5 per class, with the mAP and the empty "
                "detector's",
    "pr_curve": "detection: precision against recall at IoU 0.5, over all classes and per "
                "class",
    "reliability": "reliability diagram: accuracy against confidence per bin, without and with "
                   "the temperature",
    "calibration_shift": "calibration under shift: ECE per variant and corruption",
    "ttt_shifts": "test-time training: accuracy per shift",
    "benchmark": "benchmark: latency, throughput and accuracy per variant",
    "tta": "test-time augmentation",
    "compression": "compression: validation accuracy against latency per variant (fp32 "
                   "marked), at the judged batch size",
    **TYPE_PLOTS,
}
PLOT_NAMES: tuple[str, ...] = tuple(PLOT_CAPTIONS)
assert {p for s in SECTIONS for p in s.plots} == set(PLOT_NAMES), "a plot without its section"

# the labels of the sections that have them (the page's key/value rows, when asked for)
SUMMARY_KEYS: dict[str, KeyLabels] = {s.key: s.keys for s in SECTIONS if s.keys}
PREDICTION_KEYS: KeyLabels = PREDICTIONS_KEYS


def moved(order: Iterable[Section], anchor: str | None, moving: Iterable[Section]
          ) -> list[Section]:
    """`order` with the sections of `moving` (in their order) taken out and put right behind
    the section `anchor` (at the end for None)."""
    moving = list(moving)
    rest = [section for section in order if section not in moving]
    at = len(rest) if anchor is None else rest.index(SECTION[anchor]) + 1
    return rest[:at] + moving + rest[at:]


def placed(field: str) -> list[Section]:
    """The table's order with each section whose `field` names another moved behind it."""
    order = list(SECTIONS)
    for section in SECTIONS:
        if getattr(section, field):
            order = moved(order, getattr(section, field), [section])
    return order


# the JSON's sections, in its key order (after "version", "status", "error" and "config")
JSON_KEYS: tuple[str, ...] = tuple(section.key for section in placed("json_after"))


def summary_order(report: Mapping[str, Any]) -> list[Section]:
    """The sections the summary may show, in its order: `summary_after` applied; in a run that
    predicted an --input its `of_input` sections after the predictions block; a
    `summary_beneath` section only beneath that section, in a run that predicted none."""
    order = placed("summary_after")
    predicted = bool(report.get("predictions"))
    if predicted:
        order = moved(order, "predictions", [s for s in order if s.of_input])
    return [s for s in order if s.summary_beneath is None
            or (report.get(s.summary_beneath) and not predicted)]
