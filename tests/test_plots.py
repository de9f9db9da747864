"""The report's charts: each PNG is written exactly when its data exists, is a real picture, and
survives odd user strings, many classes, nulls and reports from older runs."""
from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ttc.reporting import plots

NAMES = ["training_curves", "confusion_matrix", "reliability", "calibration_shift", "ttt_shifts",
         "benchmark", "tta"]
SHIFTS = ["gaussian_noise", "contrast", "blur"]


def reliability_section(seed: int, samples: int = 270, bins: int = 15) -> dict:
    """Equal-width confidence bins of a made-up, slightly underconfident classifier."""
    rng = np.random.default_rng(seed)
    confidence = rng.beta(5, 2, samples)
    correct = rng.random(samples) < np.clip(confidence + 0.1, 0, 1)
    index = np.clip(np.ceil(confidence * bins).astype(int) - 1, 0, bins - 1)
    section = {"bins": bins, "confidence": [], "accuracy": [], "count": []}
    for k in range(bins):
        chosen = index == k
        count = int(chosen.sum())
        section["count"].append(count)
        section["confidence"].append(float(confidence[chosen].mean()) if count else None)
        section["accuracy"].append(float(correct[chosen].mean()) if count else None)
    return section


def evaluation_section(labels: list[str], seed: int = 0) -> dict:
    n = len(labels)
    rng = np.random.default_rng(seed)
    matrix = rng.integers(0, 3, (n, n)) + np.diag(rng.integers(15, 30, n))
    support = matrix.sum(axis=1)
    recall = np.diag(matrix) / support
    return {
        "split": "test", "samples": int(matrix.sum()), "labels": labels,
        "accuracy": float(np.trace(matrix) / matrix.sum()),
        "per_class": [{"label": label, "precision": float(r), "recall": float(r), "f1": float(r),
                       "support": int(s)} for label, r, s in zip(labels, recall, support)],
        "macro_f1": float(recall.mean()), "balanced_accuracy": float(recall.mean()),
        "confusion_matrix": matrix.tolist(),
        "top_confusions": [{"true": labels[0], "predicted": labels[-1], "count": 2}],
        "baseline_class": labels[0], "baseline_accuracy": 0.1, "baseline_source": "train split",
        "verdict": "fine", "warnings": [], "reliability": reliability_section(seed),
    }


def calibration_section(variants: tuple[str, ...] = ("single", "single+T", "mc_dropout",
                                                     "mc_dropout+T"),
                        shifts: list[str] | None = SHIFTS) -> dict:
    """The report's `calibration` of a run at T = 0.515 (issue 21), with --eval_shift `shifts`
    (None: no shifts) measuring `variants`."""
    section = {
        "temperature": 0.515, "method": "laplace", "fitted_on": "validation",
        "fit_samples": 269, "fit_errors": 0, "fit_note": "no validation errors", "split": "test",
        "samples": 270, "accuracy_before": 0.94, "accuracy_after": 0.94,
        "mean_confidence_before": 0.9, "mean_confidence_after": 0.93, "ece_before": 0.0227,
        "ece_after": 0.0094, "nll_before": 0.0287, "nll_after": 0.013,
        "ece_change_interval_90": [-0.0177, -0.0097], "nll_change_interval_90": [-0.0214, -0.0111],
        "verdict": "temperature scaling (T = 0.515) lowers ECE",
        "reliability_before": reliability_section(11), "reliability_after": reliability_section(12),
        "shifts": None}
    if shifts is None:
        return section
    section["shifts"] = [{"name": name, "severity": 3, "rows": [
        {"variant": v, "accuracy": 0.9 - 0.2 * k, "ece": 0.05 + 0.1 * k + 0.01 * j, "nll": 0.4}
        for j, v in enumerate(variants)]} for k, name in enumerate(shifts)]
    means = {v: 0.15 + 0.01 * j for j, v in enumerate(variants)}
    section["under_shift"] = {"mean_ece": means, "best": min(means, key=means.get)}
    return section


def old_report() -> dict:
    """The sections a run of `pipeline.py --tta true --ttt true --ttt_method all --eval_shift ...
    --iterative mc_dropout --quantize dynamic` writes before the new keys existed."""
    shift = {"severity": 3, "cost_ratio_bn": 1.5, "cost_ratio_tent": 8.0}
    return {
        "version": 1, "status": "ok", "error": None, "config": {}, "dataset": {"num_classes": 10},
        "train": {"epochs_run": 3, "best_epoch": 3, "train_accuracy": 0.97, "val_accuracy": 0.96},
        "benchmark": [
            {"variant": "pytorch eager fp32", "provider": "torch cpu", "size_mb": 0.273,
             "accuracy": 0.9405, "latency_ms_p50_batch1": 0.52, "latency_ms_p95_batch1": 0.95,
             "throughput_per_s": 11872.2, "batch_size": 64},
            {"variant": "onnxruntime fp32", "provider": "CPUExecutionProvider", "size_mb": 0.266,
             "accuracy": 0.9405, "latency_ms_p50_batch1": 0.094, "latency_ms_p95_batch1": 0.14,
             "throughput_per_s": 27051.9, "batch_size": 64},
            {"variant": "onnxruntime int8 (dynamic)", "provider": "CPUExecutionProvider",
             "size_mb": 0.07, "accuracy": 0.9368, "latency_ms_p50_batch1": 0.07,
             "latency_ms_p95_batch1": 0.13, "throughput_per_s": 27757.8, "batch_size": 64}],
        "tta": {"transforms": ["shift:1"], "merge": "mean", "views": 5, "accuracy": 0.955,
                "accuracy_plain": 0.9405, "fixed": 6, "broken": 2, "cost_ratio": 5.1,
                "accuracy_val": 0.9517, "accuracy_val_plain": 0.9628, "verdict": "mixed"},
        "ttt": {"method": "all", "mode": "episodic", "batch_size": 64,
                "clean": {"accuracy_source": 0.94, "accuracy_bn": 0.95, "accuracy_tent": 0.95},
                "shifts": [{"name": "gaussian_noise", "accuracy_source": 0.90,
                            "accuracy_bn": 0.91, "accuracy_tent": 0.92, **shift},
                           {"name": "contrast", "accuracy_source": 0.10, "accuracy_bn": 0.91,
                            "accuracy_tent": 0.90, **shift},
                           {"name": "blur", "accuracy_source": 0.48, "accuracy_bn": 0.90,
                            "accuracy_tent": 0.91, **shift}],
                "mean_shifted": {"accuracy_source": 0.49, "accuracy_bn": 0.91,
                                 "accuracy_tent": 0.91},
                "verdict": "bn helps"},
        "iterative": {"mode": "mc_dropout", "rows": [
            {"variant": "single", "accuracy": 0.9405, "ece": 0.228, "cost_ratio": 1.0},
            {"variant": "mc_dropout", "accuracy": 0.944, "ece": 0.251, "cost_ratio": 0.93}]},
        "predictions": None,
    }


def full_report(labels: list[str] | None = None) -> dict:
    """An old report plus every key the new contract adds."""
    report = old_report()
    report["train"]["history"] = [
        {"epoch": e, "loss": 2.3 / e, "train_accuracy": 1 - 0.5 / e, "val_accuracy": 1 - 0.6 / e,
         "val_loss": 2.4 / e, "seconds": 1.5} for e in range(1, 6)]
    report["train"]["health"] = {"loss_start": 2.3, "loss_end": 0.46, "loss_fall": 0.8,
                                 "hint": None}
    report["evaluation"] = evaluation_section(labels or [f"digit {i}" for i in range(10)])
    # the served graph bakes the temperature in: its curve is the calibration's "after"
    report["evaluation"]["reliability"] = reliability_section(12)
    rows = report["iterative"]["rows"]
    rows[1:1] = [{"variant": "single+T", "accuracy": 0.9405, "ece": 0.1, "cost_ratio": 1.0}]
    rows.append({"variant": "mc_dropout+T", "accuracy": 0.944, "ece": 0.09, "cost_ratio": 0.93})
    for seed, row in enumerate(rows, start=1):
        row["reliability"] = reliability_section(seed)
        row["temperature"] = 0.5 if row["variant"].endswith("+T") else None
    report["calibration"] = calibration_section()
    return report


def assert_real_png(path: str | Path) -> None:
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert min(image.size) >= 200, image.size
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is None or len(colours) > 1


def test_a_full_report_writes_every_chart(tmp_path):
    folder = tmp_path / "new" / "plots"  # created when missing
    report = full_report()
    before = copy.deepcopy(report)
    written = plots.write_plots(report, folder)
    assert report == before  # not modified
    assert list(written) == NAMES
    for name, path in written.items():
        assert Path(path) == folder / f"{name}.png"
        assert_real_png(path)
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{n}.png" for n in NAMES)  # no temp
    json.dumps(written)  # the report stores it as is


def test_an_old_report_writes_what_its_data_allows(tmp_path):
    written = plots.write_plots(old_report(), tmp_path)
    assert set(written) == {"ttt_shifts", "benchmark", "tta"}
    assert not (tmp_path / "confusion_matrix.png").exists()
    for path in written.values():
        assert_real_png(path)


def test_an_empty_or_failed_report_writes_nothing(tmp_path):
    assert plots.write_plots({}, tmp_path / "a") == {}
    failed = {"status": "error", "train": None, "evaluation": None, "iterative": None,
              "benchmark": None, "tta": None, "ttt": None, "calibration": None}
    assert plots.write_plots(failed, tmp_path / "b") == {}
    assert list((tmp_path / "b").iterdir()) == []


@pytest.mark.parametrize("missing, gone", [
    (lambda r: r["train"].pop("history"), "training_curves"),
    (lambda r: r.pop("evaluation"), "confusion_matrix"),
    (lambda r: r.update(benchmark=[]), "benchmark"),
    (lambda r: r.update(tta=None), "tta"),
    (lambda r: r.update(ttt=None), "ttt_shifts"),
    (lambda r: r.pop("calibration"), "calibration_shift"),
])
def test_a_missing_section_drops_its_chart(missing, gone):
    report = full_report()
    missing(report)
    assert plots.PLOTS[gone](report) is None


def names(report: dict) -> list[str]:
    return [curve.name for curve in plots.reliability_curves(report)]


def test_reliability_needs_a_curve_from_either_source():
    report = full_report()
    del report["calibration"]
    report["evaluation"]["reliability"] = None
    for row in report["iterative"]["rows"]:
        if row["variant"].endswith("+T"):
            row["reliability"] = None
    assert names(report) == ["single", "mc_dropout"]
    for row in report["iterative"]["rows"]:
        row["reliability"] = None
    assert plots.reliability(report) is None


def test_reliability_names_each_variant_once():
    report = full_report()
    del report["calibration"]
    report["iterative"]["rows"] = [r for r in report["iterative"]["rows"]
                                   if not r["variant"].endswith("+T")]
    report["iterative"]["rows"].append({"variant": "ensemble", "ece": 0.1,
                                        "reliability": reliability_section(7)})
    report["evaluation"]["ece"] = 0.0764
    curves = plots.reliability_curves(report)
    assert [c.name for c in curves] == ["single", "mc_dropout", "ensemble"]
    assert curves[0].bins is report["evaluation"]["reliability"]  # not the iterative "single"
    labels = [t.get_text() for t in plots.reliability(report).axes[0].get_legend().get_texts()]
    assert labels[:2] == ["perfectly calibrated", "single pass (ECE 0.076)"]


def test_reliability_shows_the_single_pass_without_and_with_the_temperature():
    report = full_report()
    calibration = report["calibration"]
    curves = plots.reliability_curves(report)
    # each variant once: the single pass from the calibration section, not again from the
    # evaluation (the same calibrated curve) or the iterative rows
    assert [c.name for c in curves] == ["single", "single+T", "mc_dropout", "mc_dropout+T"]
    assert curves[0].bins is calibration["reliability_before"]
    assert curves[1].bins is calibration["reliability_after"]
    assert [c.temperature for c in curves] == [None, 0.515, None, 0.5]
    assert [c.ece for c in curves[:2]] == [0.0227, 0.0094]
    top = plots.reliability(report).axes[0]
    labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert labels == ["perfectly calibrated", "single pass (ECE 0.023)",
                      "single pass+T (T 0.515, ECE 0.009)", "mc_dropout (ECE 0.251)",
                      "mc_dropout+T (T 0.500, ECE 0.090)"]
    assert "+T: temperature scaled" in top.get_title()
    # a variant and its "+T" twin share a colour: the unscaled one dashed
    lines = top.lines[1:]
    assert lines[0].get_color() == lines[1].get_color() != lines[2].get_color()
    assert [line.get_linestyle() for line in lines] == ["--", "-", "--", "-"]
    # without iterative rows the evaluation's curve stands in for a missing "after"
    calibration["reliability_after"] = None
    del report["iterative"]
    curves = plots.reliability_curves(report)
    assert [c.name for c in curves] == ["single", "single+T"]
    assert curves[1].bins is report["evaluation"]["reliability"]


def test_an_uncalibrated_run_draws_the_evaluation_as_the_single_pass():
    report = full_report()
    report["calibration"].update(method="none", temperature=1.0)
    report["iterative"]["rows"] = [r for r in report["iterative"]["rows"]
                                   if not r["variant"].endswith("+T")]
    curves = plots.reliability_curves(report)
    assert [c.name for c in curves] == ["single", "mc_dropout"]
    assert curves[0].bins is report["evaluation"]["reliability"]
    title = plots.reliability(report).axes[0].get_title()
    assert title == "Reliability diagram"


def test_reliability_draws_at_most_six_curves():
    report = full_report()
    report["iterative"]["rows"] += [
        {"variant": name, "ece": 0.1, "reliability": reliability_section(20 + k)}
        for k, name in enumerate(["ensemble", "ensemble+T", "state_feedback"])]
    assert len(plots.reliability_curves(report)) == 7
    top = plots.reliability(report).axes[0]
    assert len(top.lines) == 1 + plots.MAX_CURVES + 1  # the diagonal, six curves, the note
    assert top.get_legend().get_texts()[-1].get_text() == "1 more in the report"


def test_calibration_shift_draws_ece_per_variant_and_corruption(tmp_path):
    report = full_report()
    fig = plots.calibration_shift(report)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["clean", *SHIFTS, "mean of shifts"]
    bars = {c.get_label(): [bar.get_height() for bar in c] for c in ax.containers}
    assert list(bars) == ["single", "single+T", "mc_dropout", "mc_dropout+T"]
    # clean: the single pass from the calibration section, the others from the iterative rows
    assert [heights[0] for heights in bars.values()] == pytest.approx([0.0227, 0.0094, 0.251,
                                                                       0.09])
    assert bars["single+T"][1:4] == pytest.approx([0.06, 0.16, 0.26])
    assert bars["mc_dropout"][-1] == pytest.approx(0.17)  # the mean from under_shift
    assert ax.get_title() == "Calibration under shift (severity 3); best calibrated: single"
    # no iterative section and no temperature: only what the calibration section measured
    del report["iterative"]
    report["calibration"] = calibration_section(("single",), ["contrast"])
    report["calibration"]["method"] = "none"
    ax = plots.calibration_shift(report).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["clean", "contrast"]
    assert [[bar.get_height() for bar in c] for c in ax.containers] == [
        pytest.approx([0.0227, 0.05])]


@pytest.mark.parametrize("change", [
    lambda r: r["calibration"].update(shifts=None),
    lambda r: r["calibration"].update(shifts=[]),
    lambda r: r.update(calibration=None),
    lambda r: r.pop("calibration"),
])
def test_calibration_shift_is_written_only_when_shifts_exist(tmp_path, change):
    report = full_report()
    written = plots.write_plots(report, tmp_path / "with")
    assert "calibration_shift" in written
    assert_real_png(tmp_path / "with" / "calibration_shift.png")
    change(report)
    written = plots.write_plots(report, tmp_path / "without")
    assert "calibration_shift" not in written and "reliability" in written
    assert not (tmp_path / "without" / "calibration_shift.png").exists()


def test_nulls_are_skipped_not_drawn_as_zero(tmp_path):
    report = full_report()
    del report["tta"]
    for row in report["train"]["history"]:
        row["val_loss"] = None
    report["train"]["history"][2]["val_accuracy"] = None
    report["ttt"]["clean"]["accuracy_tent"] = None
    for row in report["ttt"]["shifts"]:
        row["accuracy_bn"] = None
    curve = report["calibration"]["reliability_before"]  # the first curve drawn
    curve["accuracy"][-1] = None
    report["benchmark"][1]["accuracy"] = None

    loss, accuracy = plots.training_curves(report).axes
    assert [line.get_label() for line in loss.lines] == ["train", "kept (epoch 3)"]
    assert list(accuracy.lines[1].get_xdata()) == [1, 2, 4, 5]
    bars = {container.get_label(): len(container) for container in
            plots.ttt_shifts(report).axes[0].containers}
    assert bars == {"source": 5, "bn": 2, "tent": 4}  # clean, 3 shifts, their mean
    single = plots.reliability(report).axes[0].lines[1]
    assert len(single.get_xdata()) == sum(
        1 for n, a in zip(curve["count"], curve["accuracy"]) if n and a is not None)
    assert [t.get_text() for t in plots.benchmark(report).axes[0].texts] == ["0.941", "0.937"]
    report["evaluation"]["samples"] = None  # the confusion matrix's title leaves it out
    title = plots.confusion_matrix(report).axes[0].get_title()
    assert "samples" not in title and "(accuracy " in title
    written = plots.write_plots(report, tmp_path)
    assert list(written) == [name for name in NAMES if name != "tta"]


def test_a_method_with_no_numbers_leaves_the_ttt_legend():
    report = old_report()
    for row in [report["ttt"]["clean"], report["ttt"]["mean_shifted"], *report["ttt"]["shifts"]]:
        row["accuracy_tent"] = None
    fig = plots.ttt_shifts(report)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["source", "bn"]


def test_a_single_benchmark_row_and_a_single_epoch_still_plot(tmp_path):
    full = full_report()
    report = {"benchmark": full["benchmark"][:1],
              "train": {**full["train"], "history": full["train"]["history"][:1]}}
    written = plots.write_plots(report, tmp_path)
    assert list(written) == ["training_curves", "benchmark"]
    for path in written.values():
        assert_real_png(path)


def test_user_strings_are_plain_text(tmp_path):
    odd = ["$5 off", "<script>alert(1)</script>", "50% & $$x^2$$", "a\\$b", "new\nline",
           r"cost $\frac{$ (not math)", "a very long class name that goes on and on"]
    full = full_report(odd)
    full["benchmark"][0]["variant"] = "$weird$ variant"
    full["ttt"]["shifts"][0]["name"] = r"$\noise_{1}"
    full["iterative"]["rows"][2]["variant"] = "$x$ & <b>"
    full["calibration"]["shifts"][0]["name"] = r"$\frac{noise"
    for shift in full["calibration"]["shifts"]:
        shift["rows"][0]["variant"] = r"$\frac{$ variant"
    full["calibration"]["under_shift"]["best"] = r"$\frac{$ variant"
    report = {key: full[key] for key in ("evaluation", "iterative", "benchmark", "ttt",
                                         "calibration")}
    written = plots.write_plots(report, tmp_path)  # mathtext would fail on \frac{
    assert list(written) == ["confusion_matrix", "reliability", "calibration_shift", "ttt_shifts",
                             "benchmark"]
    ax = plots.calibration_shift(report).axes[0]
    assert ax.containers[0].get_label() == r"\$\frac{\$ variant"
    assert ax.get_xticklabels()[1].get_text() == r"\$\frac{noise"
    assert ax.get_title().endswith(r"best calibrated: \$\frac{\$ variant")
    fig = plots.confusion_matrix(report)
    shown = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert shown[0] == r"\$5 off" and shown[2] == r"50% & \$\$x^2\$\$"
    assert all(len(s.replace("\\", "")) <= plots.MAX_LABEL_CHARS and "\n" not in s for s in shown)
    assert not any(re.search(r"(?<!\\)\$", s) for s in shown)  # every $ escaped: plain text


def test_many_classes_draw_without_per_cell_numbers(tmp_path):
    labels = [f"class number {i}" for i in range(60)]
    report = {"evaluation": {**evaluation_section(labels), "reliability": None}}
    fig = plots.confusion_matrix(report)
    assert len(fig.axes[0].texts) == 0  # 3600 cells would be unreadable
    assert len(fig.axes[0].get_xticklabels()) == 60
    few = evaluation_section(labels[:8])
    cells = plots.confusion_matrix({"evaluation": few}).axes[0].texts
    assert len(cells) == np.count_nonzero(few["confusion_matrix"])  # counts, zeros left blank
    written = plots.write_plots(report, tmp_path)
    assert list(written) == ["confusion_matrix"]
    assert_real_png(written["confusion_matrix"])


def test_malformed_data_is_skipped_with_a_warning(tmp_path, caplog):
    report = full_report()
    report["evaluation"]["confusion_matrix"] = [[1, 2], [3]]  # ragged: no chart, no error
    report["evaluation"]["reliability"] = {"bins": 2, "accuracy": [0.5], "count": [1, 2]}
    report["iterative"]["rows"] = "not a list"
    report["calibration"]["reliability_before"] = {"bins": 2, "accuracy": [0.5], "count": [1, 2]}
    report["calibration"]["reliability_after"] = None  # then the evaluation's: malformed too
    report["calibration"]["shifts"] = "not a list"
    report["benchmark"] = [{"variant": "x", "size_mb": "big", "latency_ms_p50_batch1": 1.0}]
    report["tta"]["fixed"] = {"not": "a number"}
    report["tta"]["broken"] = None
    report["ttt"]["clean"] = report["ttt"]["shifts"] = report["ttt"]["mean_shifted"] = None
    report["train"]["history"] = [{"epoch": "one", "loss": None}]
    assert plots.write_plots(report, tmp_path) == {}

    def broken(_report):
        raise TypeError("unexpected shape")

    original = plots.PLOTS["tta"]
    plots.PLOTS["tta"] = broken
    try:
        with caplog.at_level(logging.WARNING, logger="ttc"):
            written = plots.write_plots({"tta": old_report()["tta"],
                                         "benchmark": old_report()["benchmark"]}, tmp_path / "b")
    finally:
        plots.PLOTS["tta"] = original
    assert list(written) == ["benchmark"]
    assert "plot tta skipped" in caplog.text
