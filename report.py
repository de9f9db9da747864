"""The run's report: the sections each stage fills, the human summary on stdout, the JSON for CI
scripts, and the runner that writes both (also when a stage fails).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from utils import (EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, LOG, PipelineError,
                   atomic_write_json)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value)
    return str(value)


_SUMMARY_KEYS: dict[str, list[tuple[str, str]]] = {
    "dataset": [("path", "path"), ("model_type", "model type"), ("num_classes", "classes"),
                ("train", "train samples"), ("val", "val samples"), ("test", "test samples"),
                ("skipped_images", "skipped images"), ("dropped_rows", "dropped rows"),
                ("vocab_size", "vocabulary"), ("num_features", "features")],
    "teacher": [("lm", "LM"), ("program", "program"), ("demos", "demos in its prompt"),
                ("val_accuracy", "teacher val accuracy"), ("val_samples", "on val texts"),
                ("unlabeled_texts", "unlabeled texts"),
                ("skipped_known_or_repeated", "skipped (known/repeated)"),
                ("labelled", "labelled"), ("dropped_outside_classes", "dropped (not a class)"),
                ("unparseable", "unparseable answers"),
                ("student_train_samples", "student train samples"),
                ("student_accuracy_without_teacher", "student test acc without"),
                ("student_accuracy_with_teacher", "student test acc with"),
                ("student_val_accuracy_without_teacher", "student val acc without"),
                ("student_val_accuracy_with_teacher", "student val acc with"),
                ("verdict", "verdict"), ("seconds", "seconds")],
    "train": [("samples", "train samples"), ("epochs_run", "epochs run"), ("best_epoch", "best epoch"),
              ("train_accuracy", "train accuracy"), ("val_accuracy", "val accuracy"),
              ("seconds", "seconds")],
    "export": [("path", "model"), ("opset", "opset"), ("nodes_before_slim", "nodes before slim"),
               ("nodes_after_slim", "nodes after slim"), ("size_bytes", "size (bytes)"),
               ("checker", "onnx.checker"), ("max_abs_diff", "max |onnx - torch|"),
               ("top1_agreement", "top-1 agreement"),
               ("padding_max_diff", "padding max diff"), ("seconds", "seconds")],
    "quantize": [("mode", "mode"), ("path", "model"), ("size_bytes_fp32", "size fp32 (bytes)"),
                 ("size_bytes", "size int8 (bytes)"), ("accuracy_fp32", "accuracy fp32"),
                 ("accuracy", "accuracy int8"), ("top1_agreement", "top-1 agreement"),
                 ("latency_ms_p50_batch1_fp32", "p50 batch 1 fp32 (ms)"),
                 ("latency_ms_p50_batch1", "p50 batch 1 int8 (ms)"),
                 ("latency_ms_p50_fp32", "p50 fp32 (ms/batch)"),
                 ("latency_ms_p50", "p50 int8 (ms/batch)"), ("verdict", "verdict")],
    "fp16": [("path", "model"), ("provider", "provider"), ("size_bytes", "size (bytes)"),
             ("accuracy_fp32", "accuracy fp32"), ("accuracy", "accuracy fp16"),
             ("max_abs_diff", "max |fp16 - fp32|"), ("latency_ms_p50_fp32", "p50 fp32 (ms/batch)"),
             ("latency_ms_p50", "p50 fp16 (ms/batch)"), ("verdict", "verdict")],
    "inference": [("model_path", "model"), ("providers_active", "providers"),
                  ("accuracy", "test accuracy"), ("batch_size", "batch size"),
                  ("latency_ms_p50", "latency p50 (ms/batch)"),
                  ("latency_ms_p95", "latency p95 (ms/batch)"),
                  ("throughput_per_s", "throughput (samples/s)")],
    "tta": [("transforms", "transforms"), ("merge", "merge"), ("views", "views per sample"),
            ("backend", "views and merge in"),
            ("accuracy_plain", "test accuracy plain"), ("accuracy", "test accuracy TTA"),
            ("accuracy_val_plain", "val accuracy plain"), ("accuracy_val", "val accuracy TTA"),
            ("fixed", "fixed (wrong → right)"), ("broken", "broken (right → wrong)"),
            ("cost_ratio", "cost ratio (TTA / plain)"), ("triggered_fraction", "triggered"),
            ("verdict", "verdict")],
}


def format_summary(report: dict) -> str:
    """The human-readable final summary: one block per stage that ran."""
    lines = [f"status: {report.get('status')}"]
    if report.get("error"):
        lines.append(f"error: {report['error']['message']} (exit {report['error']['code']})")
    for section, keys in _SUMMARY_KEYS.items():
        data = report.get(section)
        if not data:
            continue
        lines.append(f"{section}:")
        for key, label in keys:
            if data.get(key) is not None:
                lines.append(f"  {label:<26} {_fmt(data[key])}")
        if section == "dataset":
            lines += [f"  {'':<26} {d['count']} with {d['reason']} in {Path(d['file']).name} "
                      f"(rows {', '.join(map(str, d['first_rows']))}"
                      f"{', ...' if d['count'] > len(d['first_rows']) else ''})"
                      for d in data.get("dropped_reasons") or []]
        if section == "train" and data.get("candidates"):
            lines += format_candidates(data["candidates"], data["chosen_candidate"])
    if report.get("benchmark"):
        lines += ["benchmark:", *format_benchmark(report["benchmark"])]
    if report.get("ttt"):
        lines += ["ttt:", *format_ttt(report["ttt"])]
    if report.get("iterative"):
        lines += ["iterative:", *format_iterative(report["iterative"])]
    if report.get("predictions"):
        lines += ["predictions:"] + [f"  {label:<26} {_fmt(report['predictions'][key])}"
                                     for key, label in PREDICTION_KEYS
                                     if report["predictions"].get(key) is not None]
    if report.get("seconds_total") is not None:
        lines.append(f"total seconds: {report['seconds_total']:.1f}")
    return "\n".join(lines)


def format_candidates(candidates: list[dict], chosen: int) -> list[str]:
    """The candidate search: every candidate's validation score, the kept one marked."""
    lines = [f"  {'candidate':<11} {'lr':>8} {'seed':>5} {'val acc':>8} {'val loss':>9} "
             f"{'best epoch':>10} {'seconds':>8}"]
    for c in candidates:
        mark = " <- kept" if c["index"] == chosen else ""
        lines.append(f"  {c['index'] + 1:<11} {c['learning_rate']:>8.2g} {c['seed']:>5} "
                     f"{c['val_accuracy']:>8.4f} {c['val_loss']:>9.4f} {c['best_epoch']:>10} "
                     f"{c['seconds']:>8.1f}{mark}")
    return lines


def format_benchmark(rows: list[dict]) -> list[str]:
    """One line per variant, like `yolo benchmark`."""
    batch = rows[0]["batch_size"]
    header = (f"  {'variant':<28} {'provider':<26} {'size MB':>8} {'accuracy':>8} "
              f"{'p50 ms@1':>9} {'p95 ms@1':>9} {f'samples/s@{batch}':>14}")
    return [header] + [
        f"  {r['variant']:<28} {r['provider']:<26} {r['size_mb']:>8.3f} {r['accuracy']:>8.4f} "
        f"{r['latency_ms_p50_batch1']:>9.4f} {r['latency_ms_p95_batch1']:>9.4f} "
        f"{r['throughput_per_s']:>14.0f}" for r in rows]


def format_ttt(ttt: dict) -> list[str]:
    """Accuracy without and with each adaptation method, clean and per corruption."""
    methods = [m for m in ("bn", "tent") if ttt["clean"].get(f"accuracy_{m}") is not None]
    lines = [f"  method {ttt['method']}, {ttt['mode']}, batches of {ttt['batch_size']}, "
             f"bn prior {ttt['bn_prior']:g}, tent steps {ttt['iterations']}",
             f"  {'data':<30} {'source':>8}" + "".join(f" {m:>8} {'cost ' + m:>10}"
                                                      for m in methods)]
    rows = [("clean", ttt["clean"])] + [(f"{r['name']} (severity {r['severity']})", r)
                                        for r in ttt["shifts"]]
    if ttt.get("mean_shifted"):
        rows.append(("mean of the shifts", {**ttt["mean_shifted"]}))
    for name, row in rows:
        cells = "".join(f" {row[f'accuracy_{m}']:>8.4f} " + (
            f"{row[f'cost_ratio_{m}']:>9.2f}x" if row.get(f"cost_ratio_{m}") is not None
            else f"{'':>10}") for m in methods)
        lines.append(f"  {name:<30} {row['accuracy_source']:>8.4f}{cells}")
    return lines + [f"  verdict: {ttt['verdict']}"]


def format_iterative(iterative: dict) -> list[str]:
    """Single pass against the iterative mode: accuracy, calibration, abstention, cost."""
    if iterative["mode"] == "ensemble":
        head = f"  mode ensemble, {iterative['passes_used']:g} members"
    else:
        head = (f"  mode {iterative['mode']}, backend {iterative['backend']}, "
                f"{iterative['iterations']} passes asked, {iterative['passes_used']:g} used")
    lines = [head,
             f"  {'variant':<16} {'accuracy':>8} {'NLL':>8} {'ECE':>8} {'confidence':>10} "
             f"{'acc@90%':>8} {'cost':>8}"]
    for row in iterative["rows"]:
        lines.append(f"  {row['variant']:<16} {row['accuracy']:>8.4f} {row['nll']:>8.4f} "
                     f"{row['ece']:>8.4f} {row['mean_confidence']:>10.4f} "
                     f"{row['accuracy_at_90_coverage']:>8.4f} {row['cost_ratio']:>7.2f}x")
    if iterative.get("verdict"):
        lines.append(f"  verdict: {iterative['verdict']}")
    return lines


def emit_report(report: dict, report_json: str | None, json_stdout: bool = False,
                quiet: bool = False) -> None:
    """Write the report JSON (atomically to a file; on stdout with '-' or json_stdout) and
    otherwise the human summary (none when quiet)."""
    if report_json and report_json != "-":
        atomic_write_json(report_json, report)
    if report_json == "-" or json_stdout:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    elif not quiet:
        sys.stdout.write(format_summary(report) + "\n")
    sys.stdout.flush()


def error_section(err: BaseException) -> dict:
    if isinstance(err, PipelineError):
        return {"code": err.exit_code, "message": err.one_line()}
    if isinstance(err, KeyboardInterrupt):
        return {"code": EXIT_INTERRUPTED, "message": "interrupted"}
    return {"code": EXIT_RUNTIME, "message": f"unexpected {type(err).__name__}: {err}"}


PREDICTION_KEYS = [("input", "input"), ("output", "output"), ("rows", "rows read"),
                   ("predicted", "rows predicted"), ("failed", "rows failed"),
                   ("errors_path", "errors listed in"), ("labeled", "rows with a label"),
                   ("accuracy", "accuracy"), ("rows_per_s", "rows/s end to end")]

REPORT_SECTIONS = ("dataset", "teacher", "train", "export", "quantize", "fp16", "inference", "benchmark", "tta",
                   "ttt", "iterative", "predictions")


def run_with_report(config: Any, stages: Callable[[dict], None]) -> int:
    """Run `stages(report)`, which fills report sections; then write the report and summary.

    On failure the report (status "error", the sections that finished) is still written where
    --report_json asked, and the error propagates to run_cli for its one line and exit code.
    """
    started = time.perf_counter()
    report: dict[str, Any] = {"version": 1, "status": "running", "error": None,
                              "config": config.as_dict(), **{s: None for s in REPORT_SECTIONS}}
    try:
        stages(report)
    except BaseException as err:
        report.update(status="error", error=error_section(err),
                      seconds_total=round(time.perf_counter() - started, 3))
        try:
            if config.report_json and config.report_json != "-":
                atomic_write_json(config.report_json, report)
            if config.report_json == "-" or getattr(config, "json", False):
                sys.stdout.write(json.dumps(report, indent=2) + "\n")
        except OSError as write_err:  # never let the report hide the real error
            LOG.warning("could not write the report to %s: %s", config.report_json, write_err)
        raise
    report.update(status="ok", seconds_total=round(time.perf_counter() - started, 3))
    emit_report(report, config.report_json, json_stdout=getattr(config, "json", False),
                quiet=getattr(config, "quiet", False))
    return EXIT_OK
