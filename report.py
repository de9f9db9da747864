"""The run's report: the sections each stage fills, the human summary on stdout, the JSON for CI
scripts, the plots and the HTML page, and the runner that writes them (the JSON also when a stage
fails).

    python report.py runs/digits/report.json

rebuilds the plots and the page from a saved report (a cron job's JSON, looked at later).
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from utils import (EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, LOG, ConfigError, DataError,
                   PipelineError, atomic_write_json, check_paths, exit_cli, first_line,
                   nesting_depth, run_cli, setup_logging, stop_error, user_code_error)


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
                 ("size_bytes", "size int8 (bytes)"), ("accuracy_val_fp32", "val accuracy fp32"),
                 ("accuracy_val", "val accuracy int8"), ("accuracy_fp32", "test accuracy fp32"),
                 ("accuracy", "test accuracy int8"), ("top1_agreement", "top-1 agreement"),
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
        if section == "tta" and report.get("evaluation") and not report.get("predictions"):
            # the evaluation follows the inference block (the predictions block on --input)
            lines += ["evaluation:", *format_evaluation(report["evaluation"])]
            if report.get("calibration"):
                lines += ["calibration:", *format_calibration(report["calibration"])]
        if not data:
            continue
        lines.append(f"{section}:")
        for key, label in keys:
            if data.get(key) is not None:
                lines.append(f"  {label:<26} {_fmt(data[key])}")
        if section == "train" and (data.get("health") or {}).get("hint"):
            lines.append(f"  {'hint':<26} {data['health']['hint']}")
        if section == "dataset":
            lines += [f"  {'':<26} {d['count']} with {d['reason']} in {Path(d['file']).name} "
                      f"(rows {', '.join(map(str, d['first_rows']))}"
                      f"{', ...' if d['count'] > len(d['first_rows']) else ''})"
                      for d in data.get("dropped_reasons") or []]
        if section == "train" and data.get("candidates"):
            lines += format_candidates(data["candidates"], data["chosen_candidate"])
        if section == "quantize":
            lines += format_quantize_details(data)
    if report.get("profile"):
        lines += ["profile:", *format_profile(report["profile"])]
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
        if report.get("evaluation"):
            lines += ["evaluation:", *format_evaluation(report["evaluation"])]
    if report.get("engine"):
        lines += ["engine:", format_engine(report["engine"])]
    if report.get("plots"):
        folder = Path(next(iter(report["plots"].values()))).parent
        lines.append(f"plots: {len(report['plots'])} PNG in {folder}")
    if report.get("html"):
        lines.append(f"page: {report['html']}")
    if report.get("seconds_total") is not None:
        lines.append(f"total seconds: {report['seconds_total']:.1f}")
    return "\n".join(lines)


SHOWN_CLASSES = 20  # per-class rows in the text summary; more classes: the weakest ones


def format_evaluation(evaluation: dict) -> list[str]:
    """Verdict, baseline, macro figures, the per-class table and the top confusions."""
    lines = [f"  {'verdict':<26} {evaluation['verdict']}",
             f"  {'baseline (majority class)':<26} {_fmt(evaluation['baseline_accuracy'])} "
             f"(always {evaluation['baseline_class']!r}, from the {evaluation['baseline_source']})",
             f"  {'macro-F1':<26} {_fmt(evaluation['macro_f1'])}",
             f"  {'balanced accuracy':<26} {_fmt(evaluation['balanced_accuracy'])}"]
    if evaluation.get("ece") is not None:
        lines.append(f"  {'ECE (15 bins)':<26} {_fmt(evaluation['ece'])}")
    rows = evaluation["per_class"]
    title = "class"
    if len(rows) > SHOWN_CLASSES:
        rows = sorted(rows, key=lambda r: (r["f1"], -r["support"]))[:SHOWN_CLASSES]
        title = f"class ({SHOWN_CLASSES} lowest F1 of {len(evaluation['per_class'])})"
    width = max(12, min(28, max(len(str(r["label"])) for r in rows)))
    lines.append(f"  {title:<{width}} {'precision':>9} {'recall':>8} {'f1':>8} {'support':>8}")
    lines += [f"  {_clip(str(r['label']), width):<{width}} {r['precision']:>9.4f} "
              f"{r['recall']:>8.4f} {r['f1']:>8.4f} {r['support']:>8}" for r in rows]
    if evaluation["top_confusions"]:
        lines.append("  most frequent confusions (true → predicted):")
        lines += [f"    {_clip(str(c['true']), 28)} → {_clip(str(c['predicted']), 28)}: "
                  f"{c['count']}" for c in evaluation["top_confusions"]]
    lines += [f"  WARNING: {warning}" for warning in evaluation["warnings"]]
    return lines


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


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


def format_quantize_details(quantize: dict) -> list[str]:
    """What int8 was allowed (and, with --quantize_ops auto, each op set tried), the nodes kept
    in fp32 (each step of the automatic exclusion) and the diagnosis's worst layers (where a
    slower variant's time grew is in its verdict)."""
    lines = []
    if (quantize.get("cpu") or {}).get("description"):
        lines.append(f"  {'timed on':<26} {quantize['cpu']['description']}")
    if quantize.get("op_types") is not None:
        lines.append(f"  {'op types quantized':<26} {', '.join(quantize['op_types']) or 'none'}")
    if quantize.get("op_sets"):
        lines.append(f"  {'op sets tried':<26} {'val acc':>8} {'fp32':>8} {'int8 ms':>8} "
                     f"{'fp32 ms':>8}  op types")
        lines += [f"  {'<- kept' if row['kept'] else '':<26} {row['accuracy_val']:>8.4f} "
                  f"{row['accuracy_val_fp32']:>8.4f} {row['latency_ms_p50']:>8.3g} "
                  f"{row['latency_ms_p50_fp32']:>8.3g}  {_clip(', '.join(row['op_types']), 60)}"
                  for row in quantize["op_sets"]]
    exclusion = quantize.get("exclusion") or {}
    if exclusion.get("requested") == "auto":
        lines.append(f"  {'auto exclusion':<26} {exclusion['outcome']}")
        lines.append(f"  {'step':<6} {'val acc':>8} {'fp32':>8} {'int8 ms':>8} {'fp32 ms':>8}  "
                     "also kept in fp32")
        before: list[str] = []
        for k, step in enumerate(exclusion["steps"]):
            mark = " <- kept" if k == exclusion.get("kept_step") else ""
            added = [name for name in step["excluded"] if name not in before]
            before = step["excluded"]
            lines.append(f"  {k:<6} {step['accuracy_val']:>8.4f} {step['accuracy_val_fp32']:>8.4f}"
                         f" {step['latency_ms_p50']:>8.3g} {step['latency_ms_p50_fp32']:>8.3g}  "
                         f"{_clip(', '.join(added) or '-', 60)}{mark}")
    elif exclusion.get("excluded"):
        lines.append(f"  {'kept in fp32':<26} {', '.join(exclusion['excluded'])}")
    if quantize.get("layers"):
        lines.append(f"  {'worst layers':<26} {'node':<32} {'op':<14} {'SQNR dB':>8} "
                     f"{'noise added':>11}")
        lines += [f"  {'':<26} {_clip(r['node'], 32):<32} {r['op_type']:<14} "
                  f"{r['sqnr_db']:>8.1f} {r['noise_added']:>11.3g}" for r in quantize["layers"]]
    return lines


def format_profile(section: dict) -> list[str]:
    """--profile: time per run, the most expensive nodes, the op types, the trace's path."""
    lines = [f"  {'profiled':<26} {section['runs']} runs of batch {section['batch_size']}, "
             f"{section['ms_per_run']} ms per run, {section['node_ms_per_run']} ms in kernels"]
    lines.append(f"  {'node':<32} {'op type':<18} {'ms/run':>9} {'share':>7}")
    lines += [f"  {row['node'][:32]:<32} {row['op_type'][:18]:<18} {row['ms_per_run']:>9.4g} "
              f"{row['share']:>7.1%}" for row in section["top"]]
    by_op = ", ".join(f"{row['op_type']} {row['share']:.0%}" for row in section["by_op_type"][:5])
    lines.append(f"  {'by op type':<26} {by_op}")
    if section.get("trace"):
        lines.append(f"  {'trace':<26} {section['trace']} (chrome://tracing, ui.perfetto.dev)")
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


def format_calibration(calibration: dict) -> list[str]:
    """The temperature, how it was fitted, what it does on the test split, and under shift."""
    interval = calibration.get("temperature_interval_90")
    spread = f", 90% interval [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""
    lines = [f"  {'temperature':<26} {calibration['temperature']:.4f} ({calibration['method']}, "
             f"fitted on {calibration.get('fit_samples')} {calibration['fitted_on']} samples "
             f"with {calibration.get('fit_errors')} errors{spread})"]
    if calibration.get("fit_note"):
        lines.append(f"  {'':<26} {calibration['fit_note']}")
    for key, label in (("ece", "ECE"), ("nll", "NLL")):
        low, high = calibration[f"{key}_change_interval_90"]
        lines.append(f"  {label + ' before → after':<26} {calibration[f'{key}_before']:.4f} → "
                     f"{calibration[f'{key}_after']:.4f} (90% interval of the change "
                     f"[{low:+.4f}, {high:+.4f}])")
    lines.append(f"  {'mean confidence':<26} {calibration['mean_confidence_before']:.4f} → "
                 f"{calibration['mean_confidence_after']:.4f} at accuracy "
                 f"{calibration['accuracy_after']:.4f}")
    lines.append(f"  verdict: {calibration['verdict']}")
    shifts = calibration.get("shifts")
    if shifts:
        names = [s["name"] for s in shifts]
        lines.append(f"  under shift (severity {shifts[0]['severity']}), ECE / accuracy:")
        lines.append(f"  {'variant':<14}" + "".join(f" {n[:16]:>17}" for n in names)
                     + f" {'mean ECE':>9}")
        means = calibration["under_shift"]["mean_ece"]
        for variant, mean in means.items():
            cells = "".join(f" {r['ece']:>8.4f} /{r['accuracy']:>7.4f}" for s in shifts
                            for r in s["rows"] if r["variant"] == variant)
            lines.append(f"  {variant:<14}{cells} {mean:>9.4f}")
        lines.append(f"  best calibrated under shift: {calibration['under_shift']['best']}")
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
    err = user_code_error(err) or err  # the --model_def module's own failure (exit 2)
    if isinstance(err, KeyboardInterrupt):
        err = stop_error() or err  # --timeout_s: exit 124
    if isinstance(err, PipelineError):
        return {"code": err.exit_code, "message": err.one_line()}
    if isinstance(err, KeyboardInterrupt):
        return {"code": EXIT_INTERRUPTED, "message": "interrupted"}
    return {"code": EXIT_RUNTIME, "message": f"unexpected {type(err).__name__}: {err}"}


PREDICTION_KEYS = [("input", "input"), ("output", "output"), ("rows", "rows read"),
                   ("predicted", "rows predicted"), ("failed", "rows failed"),
                   ("errors_path", "errors listed in"), ("labeled", "rows with a label"),
                   ("outside_classes", "labels not a class"),
                   ("accuracy", "accuracy"), ("rows_per_s", "rows/s end to end")]

REPORT_SECTIONS = ("dataset", "teacher", "train", "export", "quantize", "fp16", "inference",
                   "evaluation", "calibration", "benchmark", "tta", "ttt", "iterative",
                   "predictions", "engine", "profile")


def format_engine(engine: dict) -> str:
    """One line: where --input was predicted, how wide, and Ray's start-up cost."""
    line = (f"  {engine['engine']}: {engine['workers']} worker(s) x "
            f"{engine['threads_per_worker']} thread(s), {engine['rows']} rows "
            f"({engine['failed_rows']} failed), {_fmt(engine['rows_per_s'])} rows/s")
    if engine["engine"] == "ray":
        line += (f"; cluster start {engine['cluster_start_s']:.1f} s, first predictions after "
                 f"{_fmt(engine['first_batch_s'])} s, batches of {engine['worker_batch_size']}")
    return line


def preload_plots() -> None:
    """Import plots.py and matplotlib (about half a second) in a background thread, to be
    called once the run's own heavy imports are done: training then hides the import, and
    drawing at the end costs only the drawing."""
    threading.Thread(target=_import_plots, name="preload-plots", daemon=True).start()


def _import_plots() -> None:
    try:
        importlib.import_module("ttc.reporting.plots")
    except Exception:  # noqa: BLE001 - write_visuals imports it again and says what is wrong
        pass


def write_visuals(report: dict, plots_folder: Path | None, page: Path | None,
                  strict: bool = False) -> None:
    """The plots (into `plots_folder`) and the HTML page, their paths into the report. In a
    run, a failure here costs the pictures, not the run: a WARNING, and the JSON still says it
    all; `strict` (report.py, whose only job they are) lets it fail."""
    report.update(plots={}, html=None)
    if plots_folder is None and page is None:
        return
    started = time.perf_counter()
    try:
        plots: dict[str, str] = {}
        if plots_folder is not None:
            from ttc.reporting.plots import write_plots  # matplotlib, only when pictures are wanted

            plots = write_plots(report, plots_folder)
        report["plots"] = plots
        if page is not None:
            from ttc.reporting.page import write_page

            report["html"] = str(page)
            write_page(report, {name: Path(path) for name, path in plots.items()}, page,
                       summary_keys=_SUMMARY_KEYS, prediction_keys=PREDICTION_KEYS)
    except Exception as err:  # noqa: BLE001 - pictures must never cost a finished run its JSON
        if strict:
            raise
        LOG.warning("could not write the plots or the report page: %s: %s",
                    type(err).__name__, first_line(err, 300))
        report["html"] = None
    report["seconds_visuals"] = round(time.perf_counter() - started, 3)
    LOG.info("plots and page written in %.2f s", report["seconds_visuals"])


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
    if hasattr(config, "plots_folder") and "plots" in config.names():
        write_visuals(report, config.plots_folder(), config.page_path())
    emit_report(report, config.report_json, json_stdout=getattr(config, "json", False),
                quiet=getattr(config, "quiet", False))
    return EXIT_OK


# ----------------------------------------------------------------------------- CLI

def read_report(path: Path) -> dict:
    """A report JSON as the scripts write it; exit 3 for a missing, unreadable or foreign file."""
    if not path.is_file():
        raise DataError(f"{path} does not exist", "give the --report_json file of a run")
    size = path.stat().st_size
    if size > MAX_REPORT_BYTES:
        raise DataError(f"{path} is {size:,} bytes, over the {MAX_REPORT_BYTES >> 20} MiB no "
                        "run's report comes near; it was not read",
                        "give the --report_json file of a run")
    try:
        text = path.read_text(encoding="utf-8")
        # bounded before parsing: json's parser recurses once per level, so it never sees a
        # file nested deeper than any report (RecursionError stays a fallback)
        report = json.loads(text) if text_nesting_depth(text) <= MAX_REPORT_DEPTH else None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path} is not JSON ({err})", "give the --report_json file of a run")
    except RecursionError:
        report = None  # nested deeper than the parser goes: no report of ours
    if report is None or nesting_depth(report) > MAX_REPORT_DEPTH:
        raise DataError(f"{path} is JSON nested deeper than {MAX_REPORT_DEPTH} levels, which no "
                        "run's report is", "give the --report_json file of a run")
    if not isinstance(report, dict) or "version" not in report or "status" not in report:
        raise DataError(f"{path} is JSON but not a run's report (no version and status)",
                        "give the --report_json file of a run")
    return report


# A run's report nests about 6 levels deep; this bounds the drawing code's recursion.
MAX_REPORT_DEPTH = 32
# A run's report is tens of KB (a 1,000-class confusion matrix: about 5 MB).
MAX_REPORT_BYTES = 64 << 20


# a string, or an unterminated one up to the end: never a failed match to retry from each
# later quote (which would take quadratic time on a file of escaped quotes)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def text_nesting_depth(text: str) -> int:
    """How deeply brackets nest in JSON text, outside strings, without parsing it: an upper
    bound of the parsed value's nesting_depth for any prefix the parser accepts."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    steps = (1 if char in "[{" else -1 for char in brackets)
    return max(itertools.accumulate(steps, initial=0))



def main(argv: Sequence[str] | None = None) -> int:
    from config import (LOG_LEVELS, PLOT_NAMES, OneLineParser, page_beside,
                        refuse_linked_plots_folder, visuals_beside)

    parser = OneLineParser(
        prog="report.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Rebuild the plots and the HTML page of a saved report "
        "JSON (pipeline.py or inference.py --report_json).",
        epilog="example:\n  python report.py runs/digits/report.json   # writes "
               "runs/digits/plots/*.png and runs/digits/report.html")
    parser.add_argument("report_json", metavar="REPORT.json", help="the report to draw")
    parser.add_argument("--plots", metavar="DIR", help="where the PNGs go, or 'none' (default: "
                        "plots/ beside the report, NAME_plots/ for a report not called "
                        "report.json)")
    parser.add_argument("--html", metavar="PATH", help="where the page goes, or 'none' "
                        "(default: the report's name with .html)")
    parser.add_argument("--log_level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                        help="log verbosity on stderr (default: INFO)")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    source = Path(args.report_json)
    plots = (None if (args.plots or "").lower() == "none"
             else Path(args.plots) if args.plots else visuals_beside(source))
    page = (None if (args.html or "").lower() == "none"
            else Path(args.html) if args.html else page_beside(source))
    if plots is None and page is None:
        raise ConfigError("--plots none and --html none leave nothing to write",
                          "drop one of them")
    refuse_linked_plots_folder(plots, named=bool(args.plots))
    if plots is not None and plots.exists() and not plots.is_dir():
        raise ConfigError(f"--plots {plots} is a file", "give a folder, or 'none'")
    writes = ({f"--plots ({name}.png)": plots / f"{name}.png" for name in PLOT_NAMES}
              if plots else {})
    if page is not None:
        writes["--html"] = page
    check_paths({"REPORT.json": source}, writes)
    report = read_report(source)
    write_visuals(report, plots, page, strict=True)
    if report.get("html"):
        print(f"page: {report['html']}")
    for name, path in (report.get("plots") or {}).items():
        print(f"{name}: {path}")
    return EXIT_OK


if __name__ == "__main__":
    exit_cli(run_cli(main))
