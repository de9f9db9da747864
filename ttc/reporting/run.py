"""A run's report, as every CLI writes it: the sections the stages fill, the human summary on
stdout, the JSON for CI scripts, the plots and the HTML page, and the runner that writes them
(the JSON also when a stage fails); and reading a saved report back (report.py)."""
from __future__ import annotations

import importlib
import itertools
import json
import re
import shlex
import sys
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ttc.reporting.kinds import report_part
from ttc.reporting.sections import (JSON_KEYS, PREDICTION_KEYS, SUMMARY_KEYS, summary_order)
from utils import (EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, LOG, DataError, PipelineError,
                   atomic_write_json, first_line, nesting_depth, stop_error, user_code_error)


def format_summary(report: dict, next_steps: Sequence[str] = ()) -> str:
    """The human-readable final summary: the status with the run's seconds, one block per
    section the run filled (SECTIONS says which lines, the model type's report part adds its
    own), where the page and the plots went, and the commands that use what the run wrote
    (`next:`, next_commands)."""
    kind = report_part(report)
    lines = [f"status: {report.get('status')}"]
    if report.get("seconds_total") is not None:  # here, not a line: room for next:
        lines[0] += f" (total seconds: {report['seconds_total']:.1f})"
    if report.get("error"):
        lines.append(f"error: {report['error']['message']} (exit {report['error']['code']})")
    for section in summary_order(report):
        data = report.get(section.key)
        if data:
            lines += [f"{section.key}:", *kind.summary(section, data)]
    lines += visuals_lines(report)
    # the label on the first command's line: the summary no longer than before it had next:
    labels = ["next:", *[""] * (len(next_steps) - 1)]
    lines += [f"{label:<6}{command}" for label, command in zip(labels, next_steps)]
    return "\n".join(lines)


def visuals_lines(report: dict) -> list[str]:
    """Where the page and the plots went: one line for both."""
    plots = ""
    if report.get("plots"):
        folder = Path(next(iter(report["plots"].values()))).parent
        plots = f"plots: {len(report['plots'])} PNG in {folder}"
    if report.get("html"):
        return [f"page: {report['html']}" + (f" ({plots})" if plots else "")]
    return [plots] if plots else []


def next_commands(script: str | None, model: str | None) -> list[str]:
    """What to run on the bundle `script` wrote at `model`, with its real path: export.py
    after train.py; inference.py on new data and serve.py after pipeline.py or export.py."""
    if not model:
        return []
    bundle = shlex.quote(model)
    if script == "train":
        return [f"python export.py --output_model {bundle}"]
    if script in ("pipeline", "export"):
        return [f"python inference.py --model {bundle} --input FILE --output predictions.csv",
                f"python serve.py --model {bundle}"]
    return []


def emit_report(report: dict, report_json: str | None, json_stdout: bool = False,
                quiet: bool = False, next_steps: Sequence[str] = ()) -> None:
    """Write the report JSON (atomically to a file; on stdout with '-' or json_stdout) and
    otherwise the human summary (none when quiet)."""
    if report_json and report_json != "-":
        atomic_write_json(report_json, report)
    if report_json == "-" or json_stdout:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    elif not quiet:
        sys.stdout.write(format_summary(report, next_steps) + "\n")
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
                       summary_keys=SUMMARY_KEYS, prediction_keys=PREDICTION_KEYS)
    except Exception as err:  # noqa: BLE001 - pictures must never cost a finished run its JSON
        if strict:
            raise
        LOG.warning("could not write the plots or the report page: %s: %s",
                    type(err).__name__, first_line(err, 300))
        report["html"] = None
    report["seconds_visuals"] = round(time.perf_counter() - started, 3)
    LOG.info("plots and page written in %.2f s", report["seconds_visuals"])


@dataclass
class ReportOptions:
    """What a run's report takes of its flags (config.Config.report_options makes it): the
    config section (the script's resolved settings), where the JSON goes and whether stdout
    gets it or the summary, the plots and the page (`visuals`: whether the script takes --plots;
    `plots`, `page`: where they go, None for none), and the script and bundle the summary's
    next: lines name."""

    config: dict
    report_json: str | None = None
    json: bool = False
    quiet: bool = False
    visuals: bool = False
    plots: Path | None = None
    page: Path | None = None
    script: str | None = None
    output_model: str | None = None


def run_with_report(options: ReportOptions, stages: Callable[[dict], None]) -> int:
    """Run `stages(report)`, which fills report sections; then write the report and summary.

    On failure the report (status "error", the sections that finished) is still written where
    --report_json asked, and the error propagates to run_cli for its one line and exit code.
    """
    started = time.perf_counter()
    report: dict[str, Any] = {"version": 1, "status": "running", "error": None,
                              "config": options.config, **{s: None for s in JSON_KEYS}}
    try:
        stages(report)
    except BaseException as err:
        report.update(status="error", error=error_section(err),
                      seconds_total=round(time.perf_counter() - started, 3))
        try:
            if options.report_json and options.report_json != "-":
                atomic_write_json(options.report_json, report)
            if options.report_json == "-" or options.json:
                sys.stdout.write(json.dumps(report, indent=2) + "\n")
        except OSError as write_err:  # never let the report hide the real error
            LOG.warning("could not write the report to %s: %s", options.report_json, write_err)
        raise
    report.update(status="ok", seconds_total=round(time.perf_counter() - started, 3))
    if options.visuals:
        write_visuals(report, options.plots, options.page)
    emit_report(report, options.report_json, json_stdout=options.json, quiet=options.quiet,
                next_steps=next_commands(options.script, options.output_model))
    return EXIT_OK


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
