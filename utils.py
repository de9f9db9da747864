"""Shared plumbing: errors with exit codes, logging to stderr, progress bars, atomic writes,
keeping noisy libraries off stdout, the bundle manifest, and the human summary of a report.

Nothing here imports torch or dspy: the inference path must start lean.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NoReturn, Sequence, TextIO

# Set before any heavy import anywhere in the process: stop ORT telemetry files and litellm's
# network fetch of its cost map (dspy imports litellm lazily).
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

LOG = logging.getLogger("ttc")

# Exit codes (README "Exit codes"; ../shared/DESIGN.md §5).
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_DATA = 3
EXIT_EXPORT = 4
EXIT_RUNTIME = 5
EXIT_INTERRUPTED = 130

BUNDLE_FORMAT = "ttc-model-bundle"
BUNDLE_FORMAT_VERSION = 1


class PipelineError(Exception):
    """An error the user can act on: one line of what is wrong, one hint of how to fix it."""

    exit_code = EXIT_RUNTIME

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        text = self.message.rstrip(".")
        return f"{text}; {self.hint}" if self.hint else text


class ConfigError(PipelineError):
    exit_code = EXIT_USAGE


class DataError(PipelineError):
    exit_code = EXIT_DATA


class ExportError(PipelineError):
    exit_code = EXIT_EXPORT


class RuntimeFailure(PipelineError):
    exit_code = EXIT_RUNTIME


# ----------------------------------------------------------------------------- logging / output

_DEBUG = False


def setup_logging(level: str) -> None:
    """Our logs and every library's go to stderr; library chatter only shows at DEBUG."""
    global _DEBUG
    _DEBUG = level.upper() == "DEBUG"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING if not _DEBUG else logging.DEBUG)
    LOG.setLevel(level.upper())
    quiet_library_loggers()
    if not _DEBUG:
        import warnings

        warnings.filterwarnings("ignore")


def quiet_library_loggers() -> None:
    """Library INFO/WARNING chatter only at DEBUG. Call again after importing torch or dspy:
    both reset their loggers when imported."""
    level = logging.DEBUG if _DEBUG else logging.ERROR
    for name in ("dspy", "torch", "torch.onnx", "torch.export", "torch._dynamo", "onnxscript",
                 "onnxslim", "LiteLLM", "httpx"):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not _DEBUG:
            logger.propagate = False
            logger.handlers[:] = []


def debug_enabled() -> bool:
    return _DEBUG


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send everything written to stdout (Python prints and C-level writes) to stderr.

    The torch exporter, onnxslim and DSPy print progress to stdout; our stdout is reserved for
    the final summary or JSON, which scripts parse.
    """
    sys.stdout.flush()
    saved_fd = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Collect what C++ libraries write to fd 2 (ONNX Runtime's provider errors) into a list."""
    lines: list[str] = []
    sys.stderr.flush()
    saved_fd = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            sink.seek(0)
            lines.extend(sink.read().decode("utf-8", "replace").splitlines())


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "",
             enabled: bool = True, leave: bool = False):
    """A tqdm bar on stderr, shown only when stderr is a terminal and progress is enabled."""
    from tqdm import tqdm

    show = enabled and sys.stderr.isatty()
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, disable=not show, leave=leave,
                dynamic_ncols=True)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_cli(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Run a CLI entry point: map our errors to one stderr line and an exit code.

    A traceback is printed only at --log_level DEBUG.
    """
    signal.signal(signal.SIGTERM, _raise_interrupt)
    prog = Path(sys.argv[0]).name
    try:
        return main(argv)
    except PipelineError as err:
        _print_traceback_if_debug()
        print(f"{prog}: error: {err.one_line()}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as err:  # a full disk, a file too large, a permission: say which file
        _print_traceback_if_debug()
        where = f" {err.filename}" if err.filename else ""
        print(f"{prog}: error: cannot read or write{where}: {err.strerror or err}; free disk "
              "space, check permissions, or choose another path", file=sys.stderr)
        return EXIT_RUNTIME
    except MemoryError:
        _print_traceback_if_debug()
        print(f"{prog}: error: out of memory; lower --batch_size or use smaller images",
              file=sys.stderr)
        return EXIT_RUNTIME
    except Exception as err:  # noqa: BLE001 - the last line of defence: one line, not a traceback
        _print_traceback_if_debug()
        first = (str(err).strip().splitlines() or [""])[0]
        print(f"{prog}: error: unexpected {type(err).__name__}: {first}; "
              "rerun with --log_level DEBUG for the traceback and report it", file=sys.stderr)
        return EXIT_RUNTIME


def exit_cli(code: int) -> NoReturn:
    """End a CLI process with `code`. Every file is written and closed by now; gc.freeze() spares
    the interpreter's shutdown a garbage-collector walk over torch's and DSPy's objects, which
    took 1.6 of a 9 s pipeline run (0.2 s with it)."""
    import gc

    gc.freeze()
    raise SystemExit(code)


def _print_traceback_if_debug() -> None:
    if _DEBUG:
        traceback.print_exc(file=sys.stderr)


# ----------------------------------------------------------------------------- atomic files


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call write(tmp) on a temporary file beside `path`, fsync it, then move it into place.

    A run killed at any moment leaves either the old file or the new one, never a partial one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_current_umask())  # mkstemp makes 0600; keep the usual mode
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


class StagedFiles:
    """Several files written to temporary names first, then all moved into place in the order
    staged (the manifest last), one rename after another: a run killed while writing leaves
    every previous file untouched, and only a kill inside the few microseconds of renaming can
    mix old and new, which the manifest's hashes then expose."""

    def __init__(self) -> None:
        self.staged: list[tuple[Path, Path]] = []

    def __call__(self, path: str | Path, write: Callable[[Path], None]) -> Path:
        """Write `path`'s new content to a temporary file beside it (fsynced); return that."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        self.staged.append((tmp, path))
        write(tmp)
        os.chmod(tmp, 0o666 & ~_current_umask())
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        return tmp

    def commit(self) -> None:
        for tmp, path in self.staged:
            os.replace(tmp, path)
        self.staged = []

    def discard(self) -> None:
        for tmp, _ in self.staged:
            tmp.unlink(missing_ok=True)
        self.staged = []


@contextlib.contextmanager
def staged_files() -> Iterator[StagedFiles]:
    """StagedFiles committed when the block ends, discarded if it raises (or is interrupted)."""
    stage = StagedFiles()
    try:
        yield stage
    except BaseException:
        stage.discard()
        raise
    stage.commit()


@contextlib.contextmanager
def atomic_write_stream(path: str | Path) -> Iterator[TextIO]:
    """A text handle on a temporary file beside `path`, moved into place when the block ends
    without an error (removed otherwise): for outputs written row by row."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_current_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------- the model bundle


@dataclass(frozen=True)
class BundlePaths:
    """The files of one model bundle, all sharing the stem of `--output_model`."""

    onnx: Path
    manifest: Path
    weights: Path

    @classmethod
    def from_model_path(cls, model_path: str | Path) -> "BundlePaths":
        onnx_path = Path(model_path)
        if onnx_path.suffix != ".onnx":
            onnx_path = onnx_path.with_suffix(".onnx")
        return cls(onnx=onnx_path, manifest=onnx_path.with_suffix(".json"),
                   weights=onnx_path.with_suffix(".pt"))

    @property
    def int8(self) -> Path:
        return self.onnx.with_suffix(".int8.onnx")

    @property
    def fp16(self) -> Path:
        return self.onnx.with_suffix(".fp16.onnx")

    @property
    def bn(self) -> Path:
        """The graph with its BatchNorm nodes kept, for test-time adaptation."""
        return self.onnx.with_suffix(".bn.onnx")

    def variant(self, key: str) -> Path:
        """The graph file of a variant: "onnx" (fp32), "int8", "fp16", or of an extra graph:
        "bn" (BatchNorm adaptation), "mc" (MC-dropout), "ensemble"."""
        if key == "onnx":
            return self.onnx
        return self.onnx.with_suffix(f".{key}.onnx")


def read_manifest(paths: BundlePaths) -> dict:
    """Load and sanity-check a bundle manifest; any problem is an ExportError (exit 4)."""
    if not paths.manifest.is_file():
        raise ExportError(f"bundle manifest {paths.manifest} not found",
                          "train first (pipeline.py or train.py) with --output_model "
                          f"{paths.onnx}")
    try:
        manifest = json.loads(paths.manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ExportError(f"bundle manifest {paths.manifest} is not valid JSON ({err})",
                          "re-create the bundle with pipeline.py") from None
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        raise ExportError(f"{paths.manifest} is not a model bundle manifest",
                          "pass the .onnx written by pipeline.py or export.py")
    if manifest.get("format_version") != BUNDLE_FORMAT_VERSION:
        raise ExportError(f"{paths.manifest} has format version {manifest.get('format_version')!r}, "
                          f"this tool reads version {BUNDLE_FORMAT_VERSION}",
                          "re-create the bundle with this version of the tool")
    problem = manifest_problem(manifest)
    if problem:
        raise ExportError(f"{paths.manifest} is not a valid manifest: {problem}",
                          "re-create the bundle with pipeline.py")
    return manifest


MANIFEST_KEYS = {"format", "format_version", "created", "model_type", "labels", "input",
                 "outputs", "preprocessing", "architecture", "dataset", "training", "export",
                 "quantization", "fp16", "extra_graphs", "files"}
MODEL_KINDS = {"image_classifier": "image", "text_classifier": "text",
               "tabular_classifier": "tabular"}


def manifest_problem(manifest: dict) -> str | None:
    """What is wrong with a manifest's shape (keys, types, ranges), checked before anything in
    it is used; None when it is sound."""
    unknown = sorted(set(manifest) - MANIFEST_KEYS)
    if unknown:
        return f"unknown keys {unknown[:5]}"
    for key in ("model_type", "labels", "input", "preprocessing", "architecture"):
        if key not in manifest:
            return f"the key {key!r} is missing"
    kind = MODEL_KINDS.get(manifest["model_type"]) if isinstance(manifest["model_type"], str) \
        else None
    if kind is None:
        return f"model_type {manifest['model_type']!r} is not one of {sorted(MODEL_KINDS)}"
    labels = manifest["labels"]
    if not (isinstance(labels, list) and len(labels) >= 2 and
            all(isinstance(v, str) for v in labels) and len(set(labels)) == len(labels)):
        return "labels must be a list of 2 or more distinct strings"
    spec = manifest["input"]
    if not (isinstance(spec, dict) and isinstance(spec.get("name"), str) and
            isinstance(spec.get("shape"), list)):
        return "input must name the graph input and its shape"
    pre = manifest["preprocessing"]
    if not isinstance(pre, dict) or pre.get("kind") != kind:
        return f"preprocessing must be a {kind} preprocessing for a {manifest['model_type']}"
    if not isinstance(manifest["architecture"], dict) or \
            not isinstance(manifest["architecture"].get("name"), str):
        return "architecture must name the network"
    files = manifest.get("files") or {}
    if not isinstance(files, dict) or not isinstance(files.get("sha256", {}), dict):
        return "files must map names and sha256 hashes"
    for key, name in files.items():
        if key != "sha256" and name is not None and (
                not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..")):
            return f"files.{key} must be a bare file name, not {name!r}"
    for key, digest in files.get("sha256", {}).items():
        if not (isinstance(digest, str) and len(digest) == 64 and
                all(c in "0123456789abcdef" for c in digest)):
            return f"files.sha256.{key} is not a sha256 hex digest"
    return None


def require_onnx_in_bundle(paths: BundlePaths, manifest: dict, variant: str = "onnx") -> Path:
    """The graph file of `variant` ("onnx" fp32, or "int8"), refused if missing or from another
    run than its manifest."""
    files = manifest.get("files") or {}
    expected = (files.get("sha256") or {}).get(variant)
    path = paths.variant(variant)
    fix = {"onnx": f"python export.py --output_model {paths.onnx}",
           "int8": f"python quantize.py --output_model {paths.onnx} --quantize auto",
           "fp16": f"python quantize.py --output_model {paths.onnx} --fp16 true",
           "bn": f"python export.py --output_model {paths.onnx}",
           "mc": f"python export.py --output_model {paths.onnx}",
           "ensemble": f"python pipeline.py ... --ensemble_size N --output_model {paths.onnx}"
           }[variant]
    if not files.get(variant) or not expected:
        what = {"onnx": "exported ONNX graph", "int8": "int8 graph", "fp16": "fp16 graph",
                "bn": "BatchNorm adaptation graph (bundles exported before test-time training "
                      "existed lack it)",
                "mc": "MC-dropout graph (a model without dropout, or a bundle exported before "
                      "MC-dropout existed, has none)",
                "ensemble": "ensemble graph (train one with --ensemble_size N)"}[variant]
        raise ExportError(f"bundle {paths.manifest} has no {what} yet", f"run: {fix}")
    if not path.is_file():
        raise ExportError(f"model file {path} not found", f"run: {fix}")
    if sha256_of(path) != expected:
        raise ExportError(f"{path} does not match its manifest {paths.manifest.name} "
                          "(sha256 differs: the files come from different runs or were modified)",
                          f"re-run: {fix}")
    problem = external_data_problem(path)
    if problem:
        raise ExportError(f"{path} refused: {problem}",
                          "keep a model's external data files in its own folder")
    return path


def external_data_problem(path: Path) -> str | None:
    """Why an ONNX file's external data is unsafe to load (a location outside its folder, so
    a crafted model could read any file), or None. A file that does not parse is left to ONNX
    Runtime's own error."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - truncated or foreign: reported when a session loads it
        return None
    folder = path.parent.resolve()
    for tensor in _all_tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        if not (folder / location).resolve().is_relative_to(folder):
            return f"tensor {tensor.name!r} reads external data from {location!r}, outside {folder}"
    return None


def _all_tensors(graph: Any) -> Iterator[Any]:
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield from _all_tensors(sub)


# ----------------------------------------------------------------------------- report summary


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
    import time

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
