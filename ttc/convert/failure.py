"""What a failed export leaves (pipeline.py): the trained weights and their manifest, marked
`"exported": false`, kept as train.py writes them, so that export.py exports them again with
other flags without training; and the error line that names that command."""
from __future__ import annotations

import json
import os
import shlex
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Sequence

from ttc.convert.checking import RETRAIN
from ttc.options.stages import ExportOptions
from ttc.serving.bundle import BUNDLE_FORMAT, FILE_SIZE_LIMITS, BundlePaths
from utils import LOG, ExportError

KEPT_STEM = "unexported"  # model.unexported.pt and .json, beside a bundle a failure must not touch
# export.py's flags a re-export does not repeat: where it writes and how it talks
NOT_REPEATED = ("output_model", "report_json", "log_level", "no_progress", "timeout_s",
                "num_threads")
VALUE = "VALUE"  # the placeholder of the flag the error says to change


def keep_trained_weights(error: ExportError, options: ExportOptions, paths: BundlePaths,
                         keep: Callable[[BundlePaths], Any]) -> ExportError:
    """`error`, after `keep` (train.py's save_checkpoint) wrote the trained weights and their
    manifest where kept_paths says, with how to export them again added to its hint; `error`
    as it was when they could not be written (a full disk: the warning says so)."""
    kept = kept_paths(paths)
    try:
        keep(kept)
    except OSError as err:
        LOG.warning("the trained weights could not be kept in %s: %s", kept.weights,
                    err.strerror or err)
        return error
    return weights_kept(error, options, paths, kept)


def kept_paths(paths: BundlePaths) -> BundlePaths:
    """Where a failed export keeps the weights: the bundle's own paths (model.pt, model.json),
    unless a bundle that serves is there; it stays as it was, and the weights go beside it as
    model.unexported.pt and model.unexported.json (model.unexported-2.*, ... where an earlier
    one of those was exported since)."""
    candidate, number = paths, 1
    while not holds_no_bundle(candidate.manifest):
        stem = KEPT_STEM if number == 1 else f"{KEPT_STEM}-{number}"
        candidate, number = BundlePaths.from_model_path(
            paths.onnx.with_suffix(f".{stem}.onnx")), number + 1
    return candidate


def holds_no_bundle(manifest: Path) -> bool:
    """Nothing at `manifest`, or the manifest of weights never exported (train.py's, an earlier
    failed export's): what a new training may replace. Anything else (an exported bundle, a
    link, a file that is no manifest of ours) is left alone."""
    if not os.path.lexists(manifest):
        return True
    try:
        if manifest.is_symlink() or not manifest.is_file() or \
                manifest.stat().st_size > FILE_SIZE_LIMITS["manifest"]:
            return False
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    files = data.get("files") if isinstance(data, dict) else None
    return isinstance(data, dict) and data.get("format") == BUNDLE_FORMAT and \
        isinstance(files, dict) and not files.get("onnx")


def weights_kept(error: ExportError, options: ExportOptions, paths: BundlePaths,
                 kept: BundlePaths) -> ExportError:
    """`error` with where the weights are kept, and (unless the error says to retrain: diverged
    weights export no better a second time) the export.py command that exports them."""
    if kept == paths:
        where = f"the trained weights are kept in {kept.onnx.parent}"
    else:
        where = (f"the bundle already at {paths.onnx} was left as it was, and the trained "
                 f"weights are kept beside it ({kept.weights.name}, {kept.manifest.name})")
    parts = [error.hint, where]
    if RETRAIN not in error.hint:
        parts.append("to export them again without training: "
                     f"{export_command(options, kept, error.raise_flags)}")
    return ExportError(error.message, "; ".join(part for part in parts if part))


def export_command(options: ExportOptions, kept: BundlePaths, raise_flags: Sequence[str]) -> str:
    """export.py on the kept weights, with the run's own export flags (its data, tolerance, NMS
    and TTA settings as given; --trust_model_code true for the run's own --model_def file) and
    VALUE for each flag the error says to raise, whose value in this run follows in brackets."""
    takes = export_flags(options)
    raised = [name for name in raise_flags if name in takes]
    given = getattr(options, "given", ())
    words = ["python", "export.py", "--output_model", str(kept.onnx)]
    for name in takes:
        value = getattr(options, name)
        if name in given and name not in NOT_REPEATED and name not in raised and \
                value is not None and not str(value).startswith("builtin:"):
            words += [f"--{name}", flag_text(value)]
    if options.model_def and "trust_model_code" not in given:
        words += ["--trust_model_code", "true"]  # the user's own network file, kept beside
    words += [part for name in raised for part in (f"--{name}", VALUE)]
    command = shlex.join(words)
    if not raised:
        return command
    return command + " (this run: " + ", ".join(
        f"--{name} {flag_text(getattr(options, name))}" for name in raised) + ")"


def export_flags(options: ExportOptions) -> list[str]:
    """The flags export.py takes, in their declaration order (config.flags_for("export")): all
    of them are export's options."""
    return [f.name for f in fields(options) if "export" in f.metadata["scripts"]]


def flag_text(value: Any) -> str:
    """A setting as its flag takes it on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return repr(value) if isinstance(value, float) else str(value)
