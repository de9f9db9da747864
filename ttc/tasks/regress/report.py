"""A regressor's part in its report (Parts.report): its training scores as RMSEs, its inference
rows (RMSE, MAE, R²), its evaluation's summary and page section (the figures against the
mean-of-train baseline, the verdict, the conformal interval's coverage and width, the error by
target decile, and its plots: residuals, predicted against true, error by decile, drawn by
report_plots.py with matplotlib only when plots are drawn) and its headline. stdlib only."""
from __future__ import annotations

from typing import Any, Mapping

from ttc.reporting import page
from ttc.reporting.classifier_report import ClassifierReport, Plot, Renderer, ScoreNames, with_rows
from ttc.reporting.sections import Formatter, KeyLabels
from ttc.reporting.summary import fmt

FIGURES: KeyLabels = (("rmse", "RMSE"), ("mae", "MAE"), ("r2", "R²"))
EVALUATION_KEYS: KeyLabels = (("split", "split"), ("target", "target"), ("samples", "rows"),
                              *FIGURES)
TRAIN_ROWS: KeyLabels = (("train_rmse", "train RMSE"), ("val_rmse", "val RMSE"))
INFERENCE_ROWS: KeyLabels = (("rmse", "test RMSE"), ("mae", "test MAE"), ("r2", "test R²"))
DATASET_ROWS: KeyLabels = (("target", "target"), ("target_min", "target min (train)"),
                           ("target_max", "target max (train)"),
                           ("target_mean", "target mean (train)"),
                           ("target_std", "target std (train)"))
EXPORT_ROWS: KeyLabels = (("max_abs_diff_target_units", "max |onnx-torch| (units)"),)
ROWS_AFTER: dict[str, tuple[str, KeyLabels, frozenset[str]]] = {
    "dataset": ("model_type", DATASET_ROWS, frozenset({"num_classes"})),
    "train": ("best_epoch", TRAIN_ROWS, frozenset({"train_accuracy", "val_accuracy"})),
    "export": ("max_abs_diff", EXPORT_ROWS, frozenset({"top1_agreement"})),
    "inference": ("accuracy", INFERENCE_ROWS, frozenset({"accuracy"}))}
# the table's rows that mean something else for a number (quantize.py's agreement: rows whose
# int8 prediction is within 1% of the target's σ of fp32's)
RELABELLED: dict[str, dict[str, str]] = {
    "export": {"max_abs_diff": "max |onnx-torch| (σ)"},
    "quantize": {"metric": "judged by", "top1_agreement": "rows within 1% σ of fp32",
                 "max_abs_diff": "max |int8 - fp32| (target units)"}}


class RegressorReport(ClassifierReport):
    names = ScoreNames(history=("train RMSE", "val RMSE"), curves=("train RMSE", "val RMSE"),
                       curves_title="RMSE", candidate="val RMSE", metric="RMSE",
                       judged="RMSE skill")

    def recognises(self, report: Mapping[str, Any]) -> bool:
        """Its evaluation or training is scored by RMSE."""
        evaluation, train = (page.as_dict(report.get(key)) for key in ("evaluation", "train"))
        return evaluation.get("metric") == "rmse" or train.get("metric") == "rmse"

    def keys(self, section: str, labels: KeyLabels | None, data: Any) -> KeyLabels | None:
        labels = super().keys(section, labels, data)
        if labels is None:
            return None
        names = RELABELLED.get(section, {})
        labels = tuple((key, names.get(key, label)) for key, label in labels)
        if section not in ROWS_AFTER:
            return labels
        after, rows, without = ROWS_AFTER[section]
        return with_rows(labels, after, rows, without)

    def formatters(self) -> dict[str, Formatter]:
        return {**super().formatters(), "evaluation": format_evaluation}

    def renderers(self) -> dict[str, Renderer]:
        return {"evaluation": render_evaluation}

    def headline(self, report: Mapping[str, Any]) -> list[tuple[str, Any]]:
        evaluation = page.as_dict(report.get("evaluation"))
        split = evaluation.get("split") or "test"
        baseline = page.as_dict(evaluation.get("baseline"))
        interval = page.as_dict(evaluation.get("interval"))
        return [(f"{split} R²", evaluation.get("r2")), (f"{split} RMSE", evaluation.get("rmse")),
                ("MAE", evaluation.get("mae")), ("baseline RMSE (mean of train)",
                                                 baseline.get("rmse")),
                ("interval coverage", interval.get("coverage"))]

    def plots(self) -> dict[str, Plot]:
        from ttc.tasks.regress.report_plots import PLOTS  # matplotlib: only to draw them

        return PLOTS


REPORT = RegressorReport()


def interval_text(interval: Mapping[str, Any], show=fmt) -> str:
    return (f"{interval.get('level', 0):.0%} conformal: ± {show(interval.get('radius'))} "
            f"(from {interval.get('n_calibration')} calibration rows), coverage "
            f"{show(interval.get('coverage'))}, mean width {show(interval.get('mean_width'))}")


def format_evaluation(evaluation: dict) -> list[str]:
    """The verdict, the figures beside the mean-of-train baseline's, the interval."""
    baseline = evaluation.get("baseline") or {}
    lines = [f"  {'verdict':<26} {evaluation.get('verdict')}"]
    lines += [f"  {label:<26} {fmt(evaluation.get(key))} (baseline {fmt(baseline.get(key))})"
              for key, label in FIGURES if evaluation.get(key) is not None]
    if evaluation.get("interval"):
        lines.append(f"  {'interval':<26} {interval_text(evaluation['interval'])}")
    return lines + [f"  {label:<26} {text}" for label, text in test_time_lines(evaluation)]


TEST_TIME: KeyLabels = (("iterative", "MC-dropout"), ("tta", "TTA"), ("ttt", "BN adaptation"))


def test_time_lines(evaluation: Mapping[str, Any], show=fmt) -> list[tuple[str, str]]:
    """Each test-time method's verdict and its RMSE beside the plain pass's (testtime.py)."""
    lines = []
    for key, label in TEST_TIME:
        section = evaluation.get(key)
        if isinstance(section, dict):
            if key == "iterative" and section.get("mode") == "ensemble":
                label = "ensemble"
            lines.append((label, f"{section.get('verdict')} (test RMSE {show(section.get('rmse'))}"
                                 f", plain {show(section.get('rmse_plain'))})"))
    return lines


def decile_table(rows: Any) -> page.Html:
    rows = [(r.get("decile"), r.get("rows"), page.fmt(r.get("target_low")),
             page.fmt(r.get("target_high")), page.fmt(r.get("mae")), page.fmt(r.get("rmse")))
            for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
    if not rows:
        return page.Html("")
    return page.Html("<h3>Error by target decile</h3>" + page.table(
        ["decile", "rows", "target from", "target to", "MAE", "RMSE"], rows))


def render_evaluation(data: dict, view: page.View) -> list[str]:
    """The figures and the baseline's side by side, the verdict, the interval, the deciles,
    then the plots."""
    baseline = page.as_dict(data.get("baseline"))
    parts: list[str] = [page.kv_table(page.pairs(data, EVALUATION_KEYS[:3])),
                        page.Html("<h3>Against the mean-of-train baseline</h3>" + page.table(
                            ["", "model", "baseline"],
                            [(label, page.fmt(data.get(key)), page.fmt(baseline.get(key)))
                             for key, label in FIGURES]))]
    if data.get("verdict"):
        parts.append(page.labelled_line("verdict", data["verdict"]))
    if isinstance(data.get("interval"), dict):
        parts.append(page.labelled_line("interval", interval_text(data["interval"], page.fmt)))
    parts += [page.labelled_line(label, text) for label, text in test_time_lines(data, page.fmt)]
    return [*parts, decile_table(data.get("deciles")), view.figures()]
