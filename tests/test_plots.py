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

import plots

NAMES = ["training_curves", "confusion_matrix", "reliability", "ttt_shifts", "benchmark", "tta"]


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
    for seed, row in enumerate(report["iterative"]["rows"], start=1):
        row["reliability"] = reliability_section(seed)
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
              "benchmark": None, "tta": None, "ttt": None}
    assert plots.write_plots(failed, tmp_path / "b") == {}
    assert list((tmp_path / "b").iterdir()) == []


@pytest.mark.parametrize("missing, gone", [
    (lambda r: r["train"].pop("history"), "training_curves"),
    (lambda r: r.pop("evaluation"), "confusion_matrix"),
    (lambda r: r.update(benchmark=[]), "benchmark"),
    (lambda r: r.update(tta=None), "tta"),
    (lambda r: r.update(ttt=None), "ttt_shifts"),
])
def test_a_missing_section_drops_its_chart(missing, gone):
    report = full_report()
    missing(report)
    assert plots.PLOTS[gone](report) is None


def test_reliability_needs_a_curve_from_either_source():
    report = full_report()
    report["evaluation"]["reliability"] = None
    assert [name for name, _, _ in plots.reliability_curves(report)] == ["single pass",
                                                                          "mc_dropout"]
    for row in report["iterative"]["rows"]:
        row["reliability"] = None
    assert plots.reliability(report) is None


def test_reliability_names_each_variant_once():
    report = full_report()
    report["iterative"]["rows"].append({"variant": "ensemble", "ece": 0.1,
                                        "reliability": reliability_section(7)})
    names = [name for name, _, _ in plots.reliability_curves(report)]
    assert names == ["single pass", "mc_dropout", "ensemble"]  # iterative "single" not repeated


def test_nulls_are_skipped_not_drawn_as_zero(tmp_path):
    report = full_report()
    del report["tta"]
    for row in report["train"]["history"]:
        row["val_loss"] = None
    report["train"]["history"][2]["val_accuracy"] = None
    report["ttt"]["clean"]["accuracy_tent"] = None
    for row in report["ttt"]["shifts"]:
        row["accuracy_bn"] = None
    curve = report["evaluation"]["reliability"]
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
    full["iterative"]["rows"][1]["variant"] = "$x$ & <b>"
    report = {key: full[key] for key in ("evaluation", "iterative", "benchmark", "ttt")}
    written = plots.write_plots(report, tmp_path)  # mathtext would fail on \frac{
    assert list(written) == ["confusion_matrix", "reliability", "ttt_shifts", "benchmark"]
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
