"""Plumbing every script shares: errors with exit codes, logging to stderr, progress bars,
keeping noisy libraries off stdout, the CLI runner, and atomic writes.

Nothing here imports torch or dspy: the inference path must start lean.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NoReturn, Sequence, TextIO

# Set before any heavy import anywhere in the process: stop ORT telemetry files and litellm's
# network fetch of its cost map (dspy imports litellm lazily).
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

LOG = logging.getLogger("ttc")

# Exit codes (README, "Exit codes").
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_DATA = 3
EXIT_EXPORT = 4
EXIT_RUNTIME = 5
EXIT_TIMEOUT = 124  # --timeout_s, as coreutils' timeout
EXIT_INTERRUPTED = 130


class PipelineError(Exception):
    """An error the user can act on: one line of what is wrong, one hint of how to fix it."""

    exit_code = EXIT_RUNTIME

    def __init__(self, message: str, hint: str = "", *, raise_flags: tuple[str, ...] = ()
                 ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.raise_flags = raise_flags  # the flags the hint says to raise (a command repeating
        # the step with them names them: ttc/convert/failure.py)

    def one_line(self) -> str:
        text = self.message.rstrip(".")
        return shortened(f"{text}; {self.hint}" if self.hint else text)


MAX_ERROR_CHARS = 2000  # an error line: a long path and a hint fit; a quoted file's content not


def shortened(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """An error line of at most `limit` characters: its start (what is wrong) and its end (how
    to fix it) around "…", wherever a message quotes more of a value than was meant."""
    if len(text) <= limit:
        return text
    tail = limit // 4
    return f"{text[:limit - tail - 40]} …({len(text) - limit + 40:,} characters cut)… " \
        f"{text[-tail:]}"


def first_line(err: BaseException, limit: int | None = None) -> str:
    """An exception's message as one line (its first), or its type's name when it has none."""
    return ((str(err).strip().splitlines() or [type(err).__name__])[0])[:limit]


def with_article(noun: str) -> str:
    """'an image_classifier', 'a zero-area box'."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def quoted(value: object, width: int = 20) -> str:
    """A value a user may not have given (a cell, a column name, a path a bundle records) as a
    short quoted string: escaped like repr, cut to `width` characters with "…"."""
    text = str(value)
    return repr(text[:width]) + ("…" if len(text) > width else "")


def quoted_sample(values: Iterable[object], shown: int = 3, width: int = 20) -> str:
    """At most `shown` values, each quoted(), and how many more there are: an error message
    says which values are wrong without printing a file's (or a bundle's) content."""
    values = list(values)
    more = f" and {len(values) - shown} more" if len(values) > shown else ""
    return "[" + ", ".join(quoted(v, width) for v in values[:shown]) + "]" + more


class ConfigError(PipelineError):
    exit_code = EXIT_USAGE


class DataError(PipelineError):
    exit_code = EXIT_DATA


class ExportError(PipelineError):
    exit_code = EXIT_EXPORT


class TrainingError(PipelineError):
    """The model itself is unusable: training diverged (a loss or weights that are no longer
    finite numbers). Exit 4, the code of every model failure (export, validation, bundle)."""

    exit_code = EXIT_EXPORT


class RuntimeFailure(PipelineError):
    exit_code = EXIT_RUNTIME


class UserCodeFailure(BaseException):
    """The user's own code (a --model_def module) failed: carries the ConfigError (exit 2) that
    blames it. A BaseException, like the SystemExit it may stand for, so that no `except
    Exception` on its way out (dspy.Evaluate's, the ONNX exporter's, the tool's own) makes it
    another error; run_cli and the report unwrap it (user_code_error)."""

    def __init__(self, error: ConfigError) -> None:
        super().__init__(error.one_line())
        self.error = error


# A user's code file (resolved) → how an error names it ("--model_def mynet.py"): an exception
# raised there outside models.user_code (a custom backward, a hook) is still the user's.
_USER_CODE_FILES: dict[str, str] = {}


def register_user_code(path: Path, label: str) -> None:
    _USER_CODE_FILES[str(Path(path).resolve())] = label


def user_code_error(err: BaseException) -> PipelineError | None:
    """The error to report when `err` came out of the user's code: a UserCodeFailure's own, or a
    ConfigError for an exception (SystemExit too) raised in a registered user file; None when
    it is the tool's, and for interrupts and running out of memory, which stay the tool's."""
    if isinstance(err, UserCodeFailure):
        return err.error
    if not _USER_CODE_FILES or isinstance(err, (KeyboardInterrupt, MemoryError, PipelineError)):
        return None
    frames = [(frame.f_code.co_filename, line) for frame, line in
              traceback.walk_tb(err.__traceback__)]
    for filename, line in reversed(frames):  # the innermost frame of the user's code
        label = _USER_CODE_FILES.get(str(Path(filename).resolve())) if filename else None
        if label:
            what = (f"called sys.exit({err.code!r})" if isinstance(err, SystemExit)
                    else f"raised {type(err).__name__}: {first_line(err, 200)}")
            return ConfigError(f"{label}: its code {what} (line {line})",
                               "the error is in that module: fix it")
    return None


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


def nesting_depth(value: object) -> int:
    """How deeply lists and objects nest in a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1)
                         for child in (item.values() if isinstance(item, dict) else item))
    return deepest


# fd 2 belongs to the process: whoever redirects it (captured_stderr, preprocess's tokenizer
# calls) holds this lock, so two threads never swap it under each other.
STDERR_FD_LOCK = threading.RLock()


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Collect what C++ libraries write to fd 2 (ONNX Runtime's provider errors) into a list."""
    lines: list[str] = []
    with STDERR_FD_LOCK, tempfile.TemporaryFile() as sink:
        sys.stderr.flush()
        saved_fd = os.dup(2)
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


# ----------------------------------------------------------------------------- stopping a run
#
# SIGTERM, SIGINT and --timeout_s (SIGALRM) stop a run. In Python code the handler raises
# KeyboardInterrupt in the main thread: staged files are discarded on the way out and run_cli
# exits 130 (124 for --timeout_s, as coreutils' timeout). But Python runs signal handlers only in
# the main thread, between bytecodes: while that thread is in native code (session.run on a graph
# whose Loop runs 10^12 times) the handler waits for it. So Python's C-level handler also writes
# the signal's number to a wakeup pipe, and a watcher thread reads it at once: it calls the stop
# callbacks (runtime.py's sets the terminate flag of the RunOptions every session.run gets, which
# ONNX Runtime checks before each node, also in a Loop's body), and where a thread is still in a
# native section STOP_GRACE_S later (a Loop body without nodes never checks the flag; ONNX
# Runtime's quantization calibrator runs sessions of its own), it removes every staged file and
# scratch folder and ends the process itself: the same last line and exit code, no report.
# The watcher and the timer are POSIX's (elsewhere a stop waits for the main thread, as before).

STOP_GRACE_S = 2.0  # how long native code may take to honour a stop before the process ends
_TIMER_SIGNAL = getattr(signal, "SIGALRM", None)
_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, _TIMER_SIGNAL} - {None})
_stopped_by: int | None = None  # the signal that stopped the run; SIGALRM: --timeout_s
_stopped_in: str | None = None  # the native section the main thread was in at that moment
_timeout_s = 0.0
_stop_callbacks: list[Callable[[], None]] = []
_native: dict[int, str] = {}  # thread id → the native section it is in
_left_behind: set[Path] = set()  # staged files and scratch folders a hard end removes
_wakeup: tuple[int, int] | None = None  # the watcher's pipe: (read end, write end)
_fork_hook = False


def _stop_handler(signum: int, frame: Any) -> None:
    note_stop(signum)
    raise KeyboardInterrupt


def note_stop(signum: int) -> None:
    """Record the first stop of the run (later ones do not change what it was)."""
    global _stopped_by, _stopped_in
    if _stopped_by is None:
        _stopped_in = _native.get(threading.main_thread().ident or 0)
        _stopped_by = signum


def stopped() -> bool:
    return _stopped_by is not None


def raise_if_interrupted() -> None:
    """Re-raise a SIGINT/SIGTERM (or --timeout_s) that a library swallowed: dspy.Evaluate's
    executor turns Ctrl-C into a cancelled evaluation, and training would go on. Call between
    steps; and in place of the error ONNX Runtime raises for a run a stop ended."""
    if _stopped_by is not None:
        raise KeyboardInterrupt


class TimedOut(PipelineError):
    """The run went past --timeout_s (exit 124, as coreutils' timeout)."""

    exit_code = EXIT_TIMEOUT


def stop_error() -> PipelineError | None:
    """The error a KeyboardInterrupt stands for when --timeout_s raised it; None for SIGINT and
    SIGTERM (exit 130, `interrupted`)."""
    if _stopped_by is None or _stopped_by != _TIMER_SIGNAL:
        return None
    what = f"ran longer than --timeout_s {_timeout_s:g} s"
    if not _stopped_in:
        return TimedOut(what, "allow more time with --timeout_s, or 0 for no limit")
    return TimedOut(f"{what} (stopped inside {_stopped_in})",
                    "allow more time with --timeout_s; a graph runs as long as it says (a "
                    "Loop's trip count can be 10^12): run only bundles you trust")


def on_stop(callback: Callable[[], None]) -> None:
    """Call `callback` from the watcher thread as soon as a stop arrives, even while the main
    thread is in native code (it must be quick and thread-safe)."""
    _stop_callbacks.append(callback)


def stop_after(seconds: float) -> None:
    """--timeout_s: stop the run `seconds` of wall-clock time from now (SIGALRM); 0: never."""
    global _timeout_s
    if seconds <= 0:
        return
    if not hasattr(signal, "setitimer"):
        raise ConfigError("--timeout_s needs a POSIX system (Linux, macOS)",
                          "leave it out here, and limit the run from outside")
    _timeout_s = seconds
    signal.signal(signal.SIGALRM, _stop_handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def enter_native(what: str) -> str | None:
    """This thread runs `what` in native code, where a stop waits; returns the section it was
    in, for leave_native. Two dict operations: cheap enough for every session.run."""
    ident = threading.get_ident()
    previous = _native.get(ident)
    _native[ident] = what
    return previous


def leave_native(previous: str | None) -> None:
    ident = threading.get_ident()
    if previous is None:
        _native.pop(ident, None)
    else:
        _native[ident] = previous


@contextlib.contextmanager
def native_section(what: str) -> Iterator[None]:
    """A block in native code that no stop can interrupt (ONNX Runtime's own sessions): a stop
    that finds a thread still in it STOP_GRACE_S later ends the process."""
    previous = enter_native(what)
    try:
        yield
    finally:
        leave_native(previous)


def watch_stops() -> None:
    """SIGTERM and SIGINT stop the run (SIGINT not where it is ignored: nohup, `&`), and the
    watcher thread starts. Call from the main thread; once per process is enough."""
    signal.signal(signal.SIGTERM, _stop_handler)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _stop_handler)
    global _wakeup, _fork_hook
    if _wakeup is not None or os.name != "posix":
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # the C-level handler must never block
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if previous != -1:  # another's (an event loop's): leave it to them
        signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)
        return
    _wakeup = (read_end, write_end)
    if not _fork_hook:
        os.register_at_fork(after_in_child=_forget_stops_in_child)
        _fork_hook = True
    threading.Thread(target=_watch_stops, args=(read_end,), name="stop-watcher",
                     daemon=True).start()


def _forget_stops_in_child() -> None:
    """A forked child (a DataLoader worker) shares neither the parent's pipe nor its files."""
    global _wakeup
    _left_behind.clear()
    _native.clear()
    if _wakeup is None:
        return
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):  # forked from a thread Python does not call main: keep it
        return
    for fd in _wakeup:
        os.close(fd)
    _wakeup = None


def _watch_stops(read_end: int) -> None:
    while True:
        try:
            data = os.read(read_end, 64)
        except OSError:
            return
        if not data:
            return
        stops = [signum for signum in data if signum in _STOP_SIGNALS]
        if stops:
            _stop_native_code(stops[0])


def _stop_native_code(signum: int) -> None:
    """Ask native code to stop; end the process if a thread is still inside it after the grace
    (where none is, the main thread's handler carries on in Python)."""
    note_stop(signum)
    for callback in list(_stop_callbacks):
        try:
            callback()
        except Exception:  # noqa: BLE001 - one failing callback must not keep the others
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    while _native and time.monotonic() < deadline:
        time.sleep(0.02)
    if _native:
        _end_now()


def _end_now() -> None:
    """Remove what was staged, say what the main thread would have said, and exit."""
    for path in list(_left_behind):
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        except OSError:
            pass
    prog = Path(sys.argv[0]).name
    stuck = ", ".join(sorted(set(_native.values())))
    lines = [f"{prog}: {stuck} did not stop within {STOP_GRACE_S:g} s: ended at once, "
             "without writing a report"]
    timeout = stop_error()
    lines.append(f"{prog}: error: {timeout.one_line()}" if timeout else f"{prog}: interrupted")
    os.write(2, ("\n".join(lines) + "\n").encode("utf-8", "replace"))
    os._exit(EXIT_TIMEOUT if timeout else EXIT_INTERRUPTED)


def run_cli(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Run a CLI entry point: map our errors to one stderr line and an exit code.

    A traceback is printed only at --log_level DEBUG.
    """
    watch_stops()  # SIGTERM and SIGINT stop it, also inside ONNX Runtime
    prog = Path(sys.argv[0]).name
    try:
        try:
            return main(argv)
        except (UserCodeFailure, SystemExit, Exception) as err:
            blamed = user_code_error(err)  # the user's --model_def code failed: exit 2
            if blamed is None:
                raise
            raise blamed from err
        finally:  # the run is over: --timeout_s no longer cuts its last line or its exit
            if _timeout_s:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except PipelineError as err:
        _print_traceback_if_debug()
        say_error(prog, err.one_line())
        return err.exit_code
    except KeyboardInterrupt:
        timeout = stop_error()
        if timeout is not None:
            _print_traceback_if_debug()
            say_error(prog, timeout.one_line())
            return timeout.exit_code
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as err:  # a full disk, a file too large, a permission: say which file
        _print_traceback_if_debug()
        where = f" {err.filename}" if err.filename else ""
        say_error(prog, f"cannot read or write{where}: {err.strerror or err}; free disk space, "
                  "check permissions, or choose another path")
        return EXIT_RUNTIME
    except MemoryError:
        _print_traceback_if_debug()
        say_error(prog, "out of memory; lower --batch_size or use smaller images")
        return EXIT_RUNTIME
    except Exception as err:  # noqa: BLE001 - the last line of defence: one line, not a traceback
        _print_traceback_if_debug()
        first = (str(err).strip().splitlines() or [""])[0]
        say_error(prog, f"unexpected {type(err).__name__}: {first}; "
                  "rerun with --log_level DEBUG for the traceback and report it")
        return EXIT_RUNTIME


def say_error(prog: str, text: str) -> None:
    """The one error line on stderr. Its text may quote a file name or a library's message:
    control characters (a terminal's escape sequences, line breaks) are shown escaped, so the
    line stays one line and cannot recolour or rewrite the user's terminal."""
    shown = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in shortened(text))
    print(f"{prog}: error: {shortened(shown)}", file=sys.stderr)


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


def _temp_file_beside(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(tmp_name)


def _seal(tmp: Path) -> None:
    """The usual file mode (mkstemp makes 0600) and the bytes on disk before any rename."""
    os.chmod(tmp, 0o666 & ~_current_umask())
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())


class StagedFiles:
    """Files written to temporary names beside their targets first, then all moved into place
    in the order staged (a manifest last), one rename after another: a run killed while writing
    leaves every previous file untouched, and only a kill inside the few microseconds of
    renaming can mix old and new, which a bundle manifest's hashes then expose. Every atomic
    write in the tool goes through here."""

    def __init__(self) -> None:
        self.staged: list[tuple[Path, Path]] = []

    def reserve(self, path: str | Path) -> Path:
        """A temporary file that replaces `path` on commit."""
        tmp = _temp_file_beside(Path(path))
        self.staged.append((tmp, Path(path)))
        _left_behind.add(tmp)  # removed even by a stop that ends the process at once
        return tmp

    def __call__(self, path: str | Path, write: Callable[[Path], None]) -> Path:
        """Write `path`'s new content with write(tmp) to a temporary file; return that."""
        tmp = self.reserve(path)
        write(tmp)
        _seal(tmp)
        return tmp

    def commit(self) -> None:
        for tmp, path in self.staged:
            os.replace(tmp, path)
            _left_behind.discard(tmp)
        self.staged = []

    def discard(self) -> None:
        for tmp, _ in self.staged:
            tmp.unlink(missing_ok=True)
            _left_behind.discard(tmp)
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


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call write(tmp) on a temporary file beside `path`, fsync it, then move it into place.

    A run killed at any moment leaves either the old file or the new one, never a partial one.
    """
    with staged_files() as stage:
        stage(path, write)
    return Path(path)


@contextlib.contextmanager
def scratch_folder(parent: Path) -> Iterator[str]:
    """A temporary folder in `parent` (e.g. beside a bundle), removed when the block ends, also
    by a stop that ends the process inside native code (see "stopping a run")."""
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        _left_behind.add(Path(tmp))
        try:
            yield tmp
        finally:
            _left_behind.discard(Path(tmp))


@contextlib.contextmanager
def atomic_write_stream(path: str | Path, binary: bool = False) -> Iterator[TextIO]:
    """A text (or binary) handle on a temporary file beside `path`, moved into place when the
    block ends without an error (removed otherwise): for outputs written row by row."""
    with staged_files() as stage:
        tmp = stage.reserve(path)
        with (open(tmp, "wb") if binary
              else open(tmp, "w", encoding="utf-8", newline="")) as handle:
            yield handle
        _seal(tmp)


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


# ----------------------------------------------------------------------------- paths


def same_file(a: Path, b: Path) -> bool:
    """Do two paths name one file: equal once resolved (symlinks followed, also for a file not
    yet written), or the same inode (hard links)?"""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_paths(reads: dict[str, Path], writes: dict[str, Path]) -> None:
    """Before any work: no output may be an input or another output, no output may need
    another output to be its folder, and every output must be writable. Keys
    name where a path came from ("--report_json", "the bundle's manifest ..."); raises
    ConfigError (exit 2)."""
    names = list(writes)
    for i, name in enumerate(names):
        path = writes[name]
        for other, other_path in [*reads.items(), *((n, writes[n]) for n in names[i + 1:])]:
            if same_file(path, other_path):
                raise ConfigError(f"{name} {path} is the same file as {other} {other_path}; "
                                  "nothing was read or written",
                                  f"give {name.split()[0]} a path of its own")
        for other, other_path in writes.items():
            if other != name and inside(path, other_path):
                raise ConfigError(f"{name} {path} would need {other} {other_path} to be a "
                                  "folder; nothing was read or written",
                                  f"give {name.split()[0]} a path of its own")
        problem = unwritable(path)
        if problem:
            raise ConfigError(f"{name} {path} cannot be written: {problem}",
                              "choose a writable location")


def check_output_folders(folders: dict[str, Path], reads: dict[str, Path],
                         writes: dict[str, Path], suffix: str = ".png") -> None:
    """Before any work, folders an output fills with files named `NAME{suffix}` (masks,
    overlays), keyed as check_paths' paths are: none may be a file, an input or an output, lie
    under an output file, or hold an output of that suffix (a file it would replace); raises
    ConfigError (exit 2)."""
    for name, folder in folders.items():
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"{name} {folder} is a file, not a folder; nothing was read or "
                              "written", f"move it away, or give {name.split()[0]} another path")
        for other, path in [*reads.items(), *writes.items()]:
            if same_file(folder, path) or inside(folder, path):
                raise ConfigError(f"{name} {folder} is, or lies under, {other} {path}; nothing "
                                  "was read or written", f"give {other.split()[0]} another path")
        for other, path in writes.items():
            if path.name.lower().endswith(suffix) and inside(path, folder):
                raise ConfigError(f"{other} {path} lies in {name} {folder}, whose {suffix} files "
                                  "would replace it; nothing was read or written",
                                  f"give {other.split()[0]} a path outside it")


def refuse_linked_folder(folder: Path, what: str, files: str, hint: str) -> None:
    """A folder the tool chose for its outputs (`what`: "the plots folder" beside a report, the
    masks and overlays beside --output) must be a real folder, never a symbolic link: one placed
    there (in a shared or downloaded folder) would send the `files` wherever it points, over
    what is there. ConfigError (exit 2), before any work; a folder a flag names is used as
    named."""
    if folder.is_symlink():
        raise ConfigError(f"{what} {folder} is a symbolic link (to "
                          f"{quoted(os.readlink(folder), 80)}), and {files} are written only "
                          "into a real folder", hint)


def file_in_folder(folder: Path, name: Path) -> Path:
    """folder/name, for an output written under `folder` (a mask, an overlay): never through a
    symbolic link to a folder on the way (a linked subfolder would put the file, or replace
    one, wherever it points). ConfigError (exit 2)."""
    path = folder
    for part in Path(name).parts[:-1]:
        path = path / part
        if path.is_symlink():
            raise ConfigError(f"{path} is a symbolic link inside {folder}, and outputs are "
                              "written only into real folders; nothing was written through it",
                              "remove the link")
    return folder / name


def inside(path: Path, folder: Path) -> bool:
    """Does `path` lie (at any depth) under `folder`, both resolved?"""
    return folder.resolve() in path.resolve().parents


def unwritable(path: Path) -> str | None:
    """Why `path` cannot be created or replaced (None: it can). A missing folder is fine when
    it can be created: the nearest existing one must be a folder a file can be created in,
    which is tried (as root, os.access says yes to /sys and to read-only mounts)."""
    if path.is_dir():
        return "it is a folder"
    folder = path.parent
    while not folder.exists():
        if folder.is_symlink():  # a dangling link
            return f"{folder} is a broken symbolic link"
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} is not writable"
    try:
        fd, probe = tempfile.mkstemp(prefix=".ttc-probe-", suffix=".tmp", dir=folder)
    except OSError as err:
        return f"no file can be created in {folder} ({err.strerror or err})"
    os.close(fd)
    os.unlink(probe)
    return None


def hand_stops_to_server() -> None:
    """A server that drains itself on SIGTERM (serve.py under uvicorn, which installs its own
    handlers while it runs) takes the stops from here on: they no longer stop ONNX Runtime's
    runs or end the process from the watcher, and once the server has drained, the signal it
    re-raises ends nothing."""
    if _wakeup is not None:
        signal.set_wakeup_fd(-1)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
