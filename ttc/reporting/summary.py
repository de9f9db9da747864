"""The human summary's formatting of each report section: the lines `ttc.reporting.run.format_summary`
prints under a section's name, either its labelled key rows (`format_keys`, with the labels
ttc/reporting/sections.py declares) or a formatter of its own. Plain text, stdlib only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

KeyLabels = Sequence[tuple[str, str]]


def fmt(value: Any) -> str:
    """A value as the summary shows it: floats to 4 significant digits, lists joined."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(fmt(v) for v in value)
    return str(value)


def format_keys(data: dict, keys: KeyLabels) -> list[str]:
    """A section's labelled rows, one per key of `keys` that has a value."""
    return [f"  {label:<26} {fmt(data[key])}" for key, label in keys
            if data.get(key) is not None]


def format_dropped(dataset: dict) -> list[str]:
    """The dataset's dropped rows: how many for each reason, in which file, the first rows."""
    return [f"  {'':<26} {d['count']} with {d['reason']} in {Path(d['file']).name} "
            f"(rows {', '.join(map(str, d['first_rows']))}"
            f"{', ...' if d['count'] > len(d['first_rows']) else ''})"
            for d in dataset.get("dropped_reasons") or []]


def format_dataset(dataset: dict) -> list[str]:
    """The dataset's dropped rows (format_dropped), then the columns a table's run used: the
    label and the inputs, each marked when it was guessed (not named by a flag)."""
    columns = dataset.get("columns")
    if not isinstance(columns, dict):
        return format_dropped(dataset)
    guessed = columns.get("guessed") or []
    candidates = columns.get("label_candidates") or []
    label = "" if "label" not in guessed else (
        f" (guessed among {', '.join(map(repr, candidates))}; --label_column to choose)"
        if candidates else " (guessed; --label_column to choose)")
    inputs = list(columns.get("inputs") or [])
    shown = ", ".join(map(str, inputs[:INPUTS_SHOWN])) + (
        f" and {len(inputs) - INPUTS_SHOWN} more" if len(inputs) > INPUTS_SHOWN else "")
    return [*format_dropped(dataset),
            f"  {'label column':<26} {columns.get('label')}{label}",
            f"  {'input columns':<26} {shown}{' (guessed)' if 'inputs' in guessed else ''}"]


INPUTS_SHOWN = 5  # input columns the summary names


def format_training(train: dict, score: str = "val acc") -> list[str]:
    """The training-health hint, then the candidate search (`score`: what its validation
    score is, the model type's name for it)."""
    lines = []
    if (train.get("health") or {}).get("hint"):
        lines.append(f"  {'hint':<26} {train['health']['hint']}")
    if train.get("candidates"):
        lines += format_candidates(train["candidates"], train["chosen_candidate"], score)
    return lines


SHOWN_CLASSES = 20  # per-class rows in the text summary; more classes: the weakest ones


def format_evaluation(evaluation: dict) -> list[str]:
    """A classifier's: verdict, baseline, macro figures, the per-class table and the top
    confusions (another model type formats its own: its report part's `formatters`)."""
    lines = [f"  {'verdict':<26} {evaluation['verdict']}",
             f"  {'baseline (majority class)':<26} {fmt(evaluation['baseline_accuracy'])} "
             f"(always {evaluation['baseline_class']!r}, from the {evaluation['baseline_source']})",
             f"  {'macro-F1':<26} {fmt(evaluation['macro_f1'])}",
             f"  {'balanced accuracy':<26} {fmt(evaluation['balanced_accuracy'])}"]
    if evaluation.get("ece") is not None:
        lines.append(f"  {'ECE (15 bins)':<26} {fmt(evaluation['ece'])}")
    rows = evaluation["per_class"]
    title = "class"
    if len(rows) > SHOWN_CLASSES:
        rows = sorted(rows, key=lambda r: (r["f1"], -r["support"]))[:SHOWN_CLASSES]
        title = f"class ({SHOWN_CLASSES} lowest F1 of {len(evaluation['per_class'])})"
    width = max(12, min(28, max(len(str(r["label"])) for r in rows)))
    lines.append(f"  {title:<{width}} {'precision':>9} {'recall':>8} {'f1':>8} {'support':>8}")
    lines += [f"  {clip(str(r['label']), width):<{width}} {r['precision']:>9.4f} "
              f"{r['recall']:>8.4f} {r['f1']:>8.4f} {r['support']:>8}" for r in rows]
    if evaluation["top_confusions"]:
        lines.append("  most frequent confusions (true → predicted):")
        lines += [f"    {clip(str(c['true']), 28)} → {clip(str(c['predicted']), 28)}: "
                  f"{c['count']}" for c in evaluation["top_confusions"]]
    lines += [f"  WARNING: {warning}" for warning in evaluation["warnings"]]
    return lines


def clip(text: str, width: int) -> str:
    """`text` cut to `width` characters, an ellipsis marking the cut."""
    return text if len(text) <= width else text[:width - 1] + "…"


def format_candidates(candidates: list[dict], chosen: int, score: str = "val acc"
                      ) -> list[str]:
    """The candidate search: every candidate's validation score (`score` names it), the kept
    one marked."""
    lines = [f"  {'candidate':<11} {'lr':>8} {'seed':>5} {score:>8} {'val loss':>9} "
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
    if quantize.get("reduce_range") is not None:
        weights = "7-bit (reduced range)" if quantize["reduce_range"] else "8-bit (full range)"
        lines.append(f"  {'int8 weights':<26} {weights}: {quantize.get('reduce_range_reason')}")
    if quantize.get("op_types") is not None:
        lines.append(f"  {'op types quantized':<26} {', '.join(quantize['op_types']) or 'none'}")
    if quantize.get("op_sets"):
        lines.append(f"  {'op sets tried':<26} {'val acc':>8} {'fp32':>8} {'int8 ms':>8} "
                     f"{'fp32 ms':>8}  op types")
        lines += [f"  {'<- kept' if row['kept'] else '':<26} {row['accuracy_val']:>8.4f} "
                  f"{row['accuracy_val_fp32']:>8.4f} {row['latency_ms_p50']:>8.3g} "
                  f"{row['latency_ms_p50_fp32']:>8.3g}  {clip(', '.join(row['op_types']), 60)}"
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
                         f"{clip(', '.join(added) or '-', 60)}{mark}")
    elif exclusion.get("excluded"):
        lines.append(f"  {'kept in fp32':<26} {', '.join(exclusion['excluded'])}")
    if quantize.get("layers"):
        lines.append(f"  {'worst layers':<26} {'node':<32} {'op':<14} {'SQNR dB':>8} "
                     f"{'noise added':>11}")
        lines += [f"  {'':<26} {clip(r['node'], 32):<32} {r['op_type']:<14} "
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


def format_compression(section: dict) -> list[str]:
    """One line per variant (fp32 first): size, accuracy, latency and speed-up at the judged
    batch size, and which one inference serves; then each verdict."""
    batch = section.get("batch_size")
    header = (f"  {'variant':<30} {'params':>10} {'MACs':>12} {'size KB':>9} {'val acc':>8} "
              f"{'test acc':>8} {f'ms@{batch}':>9} {'speedup':>8}  served")
    lines = [header]
    for row in section["variants"]:
        lines.append(
            f"  {row['name']:<30} {_count(row.get('params')):>10} {_count(row.get('macs')):>12} "
            f"{_scaled(row.get('size_bytes'), 1024, 1):>9} {fixed(row.get('val_accuracy')):>8} "
            f"{fixed(row.get('test_accuracy')):>8} {fixed(row.get('latency_ms'), 3):>9} "
            f"{fixed(row.get('speedup'), 2):>7}x  {'yes' if row.get('served') else ''}")
    lines += [f"  {row['name']}: {row['verdict']}" for row in section["variants"][1:]]
    return lines


def _count(value: Any) -> str:
    return "n/a" if value is None else f"{value:,}"


def _scaled(value: Any, unit: int, digits: int) -> str:
    return "n/a" if value is None else f"{value / unit:.{digits}f}"


def fixed(value: Any, digits: int = 4) -> str:
    """A number to `digits` decimals; "n/a" for none."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_ttt(ttt: dict, metric: str = "accuracy") -> list[str]:
    """Accuracy (`metric`: the model type's score) without and with each adaptation method,
    clean and per corruption."""
    methods = [m for m in ("bn", "tent") if ttt["clean"].get(f"accuracy_{m}") is not None]
    steps = f", tent steps {ttt['iterations']}" if "tent" in methods else ""
    lines = [f"  method {ttt['method']}, {ttt['mode']}, batches of {ttt['batch_size']}, "
             f"bn prior {ttt['bn_prior']:g}{steps}; {metric}:",
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
    if ttt.get("guard"):
        acted = ", ".join(f"{m} {ttt['resets'].get(m, 0)} reset, "
                          f"{ttt.get('skipped', {}).get(m, 0)} skipped" for m in methods)
        lines.append(f"  guard {ttt['guard']}: {acted} (batches)")
    return (lines + format_shift_score(ttt.get("shift")) + format_stream(ttt.get("stream"))
            + [f"  verdict: {ttt['verdict']}"])


def format_shift_score(shift: dict | None) -> list[str]:
    """The label-free shift score beside the TTT verdict: per case the batches whose score
    passed the threshold, and the verdict."""
    if not shift:
        return []
    if not shift.get("available"):
        return [f"  shift score: {shift['verdict']}"]
    lines = [f"  shift score (KS distance of the unadapted model's prediction entropies from "
             f"{shift['reference_samples']} held-out ones; threshold {shift['threshold']:.3f} "
             f"per batch of {shift['batch_size']}, {shift['alpha']:.0%} false alarms):"]
    for case in shift["cases"]:
        name = case["name"] + (f" (severity {case['severity']})" if case["severity"] else "")
        quantiles = case["score_quantiles"]
        lines.append(f"    {name:<28} median {quantiles['median']:.3f}, max {quantiles['max']:.3f}"
                     f"; {case['flagged']}/{case['batches']} batches flagged; overall "
                     f"{case['overall']:.3f} "
                     f"({'shift seen' if case['shift_seen'] else 'no shift'})")
    return lines + [f"    {shift['verdict']}"]


def format_stream(stream: dict | None) -> list[str]:
    """--eval_stream: accuracy per pass of each method and guard next to the source model's."""
    if not stream:
        return []
    lines = [f"  stream {stream['order']}, {stream['passes']} passes, {stream['mode']}, "
             f"batches of {stream['batch_size']}:",
             f"    {'data':<16} {'method':<6} {'guard':<7} {'source':>7}  accuracy per pass"]
    for run in stream["runs"]:
        passes = " ".join(f"{a:.4f}" for a in run["accuracy_per_pass"])
        acted = f"  ({run['resets']} reset, {run['skipped']} skipped)" if run["guard"] != \
            "none" else ""
        lines.append(f"    {run['shift']:<16} {run['method']:<6} {run['guard']:<7} "
                     f"{run['source_accuracy_per_pass'][0]:>7.4f}  {passes}{acted}")
    return lines


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
    """The temperature, how it was fitted, whether it is applied and why, what it does on the
    test split, and under shift."""
    interval = calibration.get("temperature_interval_90")
    spread = f", 90% interval [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""
    fitted = calibration.get("fitted_temperature")
    kept = calibration.get("applied") is False and fitted is not None
    shown = f"1 (not applied; fitted {fitted:.4f}, " if kept else \
        f"{calibration['temperature']:.4f} ("
    errors = calibration.get("fit_errors")
    lines = [f"  {'temperature':<26} {shown}{calibration['method']}, "
             f"fitted on {calibration.get('fit_samples')} {calibration['fitted_on']} samples "
             f"with {errors} error{'' if errors == 1 else 's'}{spread})"]
    if calibration.get("fit_note"):
        lines.append(f"  {'':<26} {calibration['fit_note']}")
    # the gains' intervals on the fitted data: in the reason (applied) or the verdict (not)
    if calibration.get("reason") and calibration.get("applied"):
        lines.append(f"  {'applied':<26} {calibration['reason']}")
    for key, label in (("ece", "ECE"), ("nll", "NLL")):  # Brier's: in the verdict
        if f"{key}_change_interval_90" not in calibration:  # Brier: an older report's lacks it
            continue
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


def format_engine(engine: dict) -> list[str]:
    """One line: where --input was predicted, how wide, and Ray's start-up cost."""
    line = (f"  {engine['engine']}: {engine['workers']} worker(s) x "
            f"{engine['threads_per_worker']} thread(s), {engine['rows']} rows "
            f"({engine['failed_rows']} failed), {fmt(engine['rows_per_s'])} rows/s")
    if engine["engine"] == "ray":
        line += (f"; cluster start {engine['cluster_start_s']:.1f} s, first predictions after "
                 f"{fmt(engine['first_batch_s'])} s, batches of {engine['worker_batch_size']}")
    return [line]
