"""Batch inference on a Ray cluster (`inference.py --input ... --engine ray`).

Ray Data runs the local engine's own stages, spread out: read tasks run batch.py's readers on
parts of the input (a Parquet file's row groups, a slice of an image folder's files; any other
table is read whole by one task, in chunks), a pool of actors each holding one ONNX Runtime
session encodes the rows (batch.RowEncoder) and predicts them (the predictor inference.py builds
for the local engine, test-time compute included), and this process writes the predictions in
input order through batch.py's writer: the same temporary file moved into place at the end, the
same error rows, the same evaluation. Nothing here decides how a row is read or encoded.

Ray itself is imported only here, and only for --engine ray.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from copy import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ttc.serving.batch import (BatchOptions, BatchRun, Predicted, Predictor, RowEncoder, RowKeys,
                   TableReader, folder_images, image_folder_frames, input_kind,
                   predict_chunk, write_predictions)
from ttc.inputs.limits import LIMITS, Limits, use_limits
from ttc.serving.manifest import Manifest
from ttc.serving.runtime import usable_cpus
from ttc.inputs.tables import parquet_row_groups, table_format
from utils import LOG, ConfigError, PipelineError, RuntimeFailure

PredictorFactory = Callable[[], tuple[Predictor, list[str]]]  # picklable; run on each worker
IMAGES_PER_PART = 2048  # an image folder is read in parts of about this many files
EXTRA_PREFIX = "extra:"
KEY_PREFIX = "key:"  # + a name: the input's own id column (batch.RowKeys)


@dataclass
class RayOptions:
    """Where and how wide the Ray engine runs."""

    address: str | None  # None: start a local cluster; "auto": join the running one; host:port
    workers: int
    worker_batch_size: int
    threads: int  # ONNX Runtime intra-op threads per worker, which is also its num_cpus
    gpus: float = 0.0  # per worker, for a CUDA/TensorRT provider
    debug: bool = False


@dataclass
class EngineStats:
    engine: str
    address: str | None
    workers: int
    threads_per_worker: int
    worker_batch_size: int | None
    cluster_start_s: float
    first_batch_s: float | None
    rows: int
    failed_rows: int
    rows_per_s: float | None
    seconds: float

    def report_section(self) -> dict:
        return dict(vars(self))


def local_engine_section(run: BatchRun, threads: int) -> dict:
    """The report's `engine` section for a run in this process."""
    return EngineStats("local", None, 1, threads, None, 0.0, None, run.rows, run.failed,
                       run.report_section()["rows_per_s"], run.seconds).report_section()


# ----------------------------------------------------------------------------- cluster


def ray_prints_to_stderr() -> contextlib.AbstractContextManager:
    """While this process is a Ray driver: Ray's thread that relays the cluster's error
    messages ("(raylet) Task ... failed", "A worker died ...") prints them to sys.stdout, which
    carries only the final summary or JSON; they are logs (stderr). Enter it before connect and
    leave it after stop_ray."""
    return contextlib.redirect_stdout(sys.stderr)


@dataclass
class RaySession:
    """The cluster a `driving_ray` block runs on; `stream`: the Ray Data stream to stop first."""

    address: str = ""
    start_seconds: float = 0.0
    stream: Iterator | None = None


@contextlib.contextmanager
def driving_ray(options: RayOptions) -> Iterator[RaySession]:
    """This process as a Ray driver for the block: connected (a local cluster started, or
    --ray_address joined), Ray's relayed errors on stderr, a worker's own error unwrapped, and
    the cluster left (stopped, if it was this run's) whatever happens."""
    session = RaySession()
    with ray_prints_to_stderr():
        try:
            session.address, session.start_seconds = connect(options)
            yield session
        except Exception as err:  # noqa: BLE001 - a worker's own error comes back wrapped by Ray
            raise unwrapped(err) from None
        finally:
            stop_ray(session.stream, local=options.address is None)


def connect(options: RayOptions) -> tuple[str, float]:
    """ray.init: a new local cluster (of this machine's CPUs), or the one at --ray_address;
    its address and the seconds it took. Ray's own logs reach stderr at ERROR (all of them at
    --log_level DEBUG); workers' prints stay in Ray's log folder, never on our stdout. The
    caller stops the cluster (stop_ray) whatever happens, this call failing included."""
    level = logging.DEBUG if options.debug else logging.ERROR
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report from cron jobs
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", logging.getLevelName(level))
    if not options.debug:  # the C++ core's log lines (e.g. on actor restarts) stay in its files
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    import ray

    logging.getLogger("ray").setLevel(level)
    if options.address is not None:
        _require_reachable(options.address)
        _attach_token_if_any()
    started = time.perf_counter()
    try:
        with _signals_held(), _ray_sigterm_handler_off(), _quiet_native_logs(not options.debug):
            _init(ray, options, level)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise RuntimeFailure(f"cannot reach a Ray cluster at {options.address}: "
                             f"{str(err).strip().splitlines()[0] if str(err).strip() else err}",
                             "start one with `ray start --head` (then --ray_address auto), or "
                             "leave --ray_address out for a local cluster") from None
    seconds = time.perf_counter() - started
    _require_room(ray.cluster_resources(), options)
    return ray.get_runtime_context().gcs_address, seconds


def _init(ray, options: RayOptions, level: int) -> None:
    if options.address is None:
        # "local": always a new cluster (a bare ray.init() joins one `ray start` runs here), of
        # the CPUs this process may use: config.py refused more workers than they hold
        ray.init(address="local", num_cpus=usable_cpus(),
                 include_dashboard=False, log_to_driver=False, logging_level=level,
                 configure_logging=False)
    else:
        ray.init(address=options.address, log_to_driver=False, logging_level=level,
                 configure_logging=False)


def stop_ray(stream: Iterator | None, local: bool) -> None:
    """Stop the run's Ray Data stream, then leave the cluster (stopping it, and every process
    of it, if the run started it: `local`), with Ctrl-C held off until both are done: a
    shutdown cut short leaves Ray's processes behind, and one under a running stream can crash
    the process at exit."""
    ray = sys.modules.get("ray")
    with _signals_held():
        if stream is not None and hasattr(stream, "close"):
            try:
                stream.close()  # Ray Data's executor and its threads stop here
            except Exception as err:  # noqa: BLE001 - the run's own outcome is what counts
                LOG.debug("stopping the Ray Data stream: %s", err)
        if ray is not None and ray.is_initialized():
            processes = _local_cluster_processes() if local else []
            _shutdown(ray)
            _end_stragglers(processes)


def _local_cluster_processes() -> list:
    """The processes of the cluster this run started: its descendants, found while the cluster
    runs (once the raylet is gone, its workers are nobody's children)."""
    try:
        import psutil  # Ray's own copy (ray/thirdparty_files) where none is installed
    except ImportError:
        return []
    return psutil.Process().children(recursive=True)


def _end_stragglers(processes: list, timeout: float = 10.0) -> None:
    """ray.shutdown stops the cluster's services, and its idle workers outlive them by seconds
    (a graceful exit of theirs took 2 s here): kill those, which hold nothing of the run's any
    more, so that none outlives this process."""
    if not processes:
        return
    import psutil

    alive = [p for p in processes if _running(p)]
    for process in alive:
        with contextlib.suppress(psutil.Error):  # gone already; psutil checks a reused pid
            process.kill()
    deadline = time.monotonic() + timeout
    while any(_running(p) for p in alive) and time.monotonic() < deadline:
        time.sleep(0.05)


def _running(process) -> bool:
    """Not exited (a zombie has: it waits for its new parent, init, to reap it)."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _shutdown(ray) -> None:
    """ray.shutdown, waiting (where Ray can) until the processes it started have exited."""
    import inspect

    if "wait_for_processes" in inspect.signature(ray.shutdown).parameters:
        ray.shutdown(wait_for_processes=True)
    else:  # an older Ray
        ray.shutdown()


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and --timeout_s wait until the block ends and are then delivered as
    usual: ray.init cut short by Ctrl-C leaves the processes it started running
    (ray::DashboardAgent, RuntimeEnvAgent) or crashes the process at exit. The handlers in
    place before the block are back after it, also where ray.init replaced ours (its SIGTERM
    handler exits 15)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)  # SIGALRM: --timeout_s
    saved = {sig: signal.getsignal(sig) for sig in held}
    caught: list[int] = []
    for sig, handler in saved.items():
        if callable(handler):  # ours (or Python's); an ignored SIGINT (nohup) stays ignored
            signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
    if caught:
        signal.raise_signal(caught[0])


@contextlib.contextmanager
def _ray_sigterm_handler_off() -> Iterator[None]:
    """ray.init installs its own SIGTERM handler (sys.exit(15)) at its start, in place of the
    one holding signals off: a SIGTERM then would stop it half-way. Keep it from doing so
    (where this Ray version does it through ray._private.utils.set_sigterm_handler)."""
    try:
        import ray._private.utils as ray_utils
    except ImportError:
        ray_utils = None
    original = getattr(ray_utils, "set_sigterm_handler", None)
    if original is None:
        yield
        return
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original


@contextlib.contextmanager
def _quiet_native_logs(quiet: bool) -> Iterator[None]:
    """Ray's C++ core writes a line or two to file descriptor 2 while it starts (which log level
    it read, token warnings), past Python's logging: hidden unless --log_level DEBUG. Its
    failures still come back as Python exceptions."""
    if not quiet:
        yield
        return
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _require_reachable(address: str, timeout: float = 10.0) -> None:
    """Fail in seconds where ray.init would retry for ever: the cluster's head must accept a
    connection at the address (`auto`: the one this machine's `ray start` recorded)."""
    import socket

    from ray._private.services import canonicalize_bootstrap_address

    where = address
    try:
        where = canonicalize_bootstrap_address(address) or ""
    except Exception:  # noqa: BLE001 - Ray says "no running cluster" in several ways
        where = ""
    if address == "auto" and not where:
        raise RuntimeFailure("--ray_address auto found no Ray cluster started on this machine",
                             "start one with `ray start --head`, give its host:port, or leave "
                             "--ray_address out for a local cluster")
    host, _, port = where.rpartition(":")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)),
                                 timeout=timeout).close()
    except (OSError, ValueError) as err:
        raise RuntimeFailure(f"no Ray cluster answers at {where or address} "
                             f"({getattr(err, 'strerror', None) or err})",
                             "check --ray_address (host:port of the head node, or auto), and "
                             "that `ray start --head` runs there") from None


def _attach_token_if_any() -> None:
    """Send this machine's Ray token (~/.ray/auth_token, or RAY_AUTH_TOKEN) when joining by
    address, as ray.init does for a cluster it starts: Ray 2.60's `ray start --head` turns
    token authentication on when a token exists, while ray.init(address=...) leaves it off, and
    the connection is refused (ray-project/ray#64755's review)."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available)
    except ImportError:  # another Ray version: its own rules apply
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _require_room(resources: dict, options: RayOptions) -> None:
    """Workers the cluster cannot place would wait forever: say so now."""
    cpus, gpus = resources.get("CPU", 0), resources.get("GPU", 0)
    if options.workers * options.threads > cpus:
        raise ConfigError(f"--num_workers {options.workers} with {options.threads} thread(s) "
                          f"each needs {options.workers * options.threads} CPUs, and the Ray "
                          f"cluster has {cpus:g}", "lower --num_workers or --num_threads")
    if options.gpus and options.workers * options.gpus > gpus:
        raise ConfigError(f"--num_workers {options.workers} on a GPU provider needs "
                          f"{options.workers * options.gpus:g} GPUs, and the Ray cluster has "
                          f"{gpus:g}", "lower --num_workers, or use --ep cpu")


# ----------------------------------------------------------------------------- reading


def input_parts(manifest: Manifest, options: BatchOptions) -> list[Callable[[], Iterator]]:
    """The input as parts that read tasks can run anywhere, each yielding batch.py's row
    frames: a Parquet file's row groups (a few per part), an image folder's files in slices;
    any other table is one part (its rows can only be found by reading it from the start)."""
    kind = input_kind(manifest, options)
    if kind == "stdin":
        raise ConfigError("--input - is read by this process, and --engine ray reads the input "
                          "on the cluster", "give a file (a .txt of one text per line is a "
                          "headerless TSV), or use --engine local")
    path = Path(options.input).absolute()
    if kind == "images":  # parts of whole worker batches
        files = folder_images(path)
        rows = options.rows_per_chunk(manifest)
        step = rows * max(1, IMAGES_PER_PART // rows)
        return [_ImagePart(path, manifest, rows, files[start:start + step])
                for start in range(0, len(files), step)]
    options = BatchOptions(**{**vars(options), "input": str(path)})
    if table_format(path, options.dataset_format) == "parquet" and path.is_file():
        groups = len(parquet_row_groups(path))
        per_part = max(1, -(-groups // 64))
        return [_TablePart(path, manifest, options, range(g, min(g + per_part, groups)))
                for g in range(0, groups, per_part)]
    return [_TablePart(path, manifest, options, None)]


@dataclass
class _TablePart:
    path: Path
    manifest: Manifest
    options: BatchOptions
    row_groups: range | None

    def __call__(self) -> Iterator:
        return TableReader(self.path, self.manifest, self.options, self.row_groups).frames()


@dataclass
class _ImagePart:
    root: Path
    manifest: Manifest
    chunk_rows: int
    files: Sequence[Path]

    def __call__(self) -> Iterator:
        return image_folder_frames(self.root, self.manifest, self.chunk_rows, self.files)


def input_datasource(parts: list[Callable[[], Iterator]]):
    """A Ray Datasource of one read task per part."""
    from ray.data import Datasource, ReadTask
    from ray.data.block import BlockMetadata

    class InputDatasource(Datasource):
        def estimate_inmemory_data_size(self) -> None:
            return None

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                           data_context=None) -> list:
            unknown = BlockMetadata(num_rows=None, size_bytes=None, input_files=None,
                                    exec_stats=None)
            return [ReadTask(part, unknown) for part in parts]

        def get_name(self) -> str:
            return "ReadInput"

    return InputDatasource()


# ----------------------------------------------------------------------------- workers


class PredictWorker:
    """A Ray actor: row frames in, predictions out. One ONNX Runtime session (made by the
    factory, with intra-op threads = the actor's CPUs) lives as long as the actor."""

    def __init__(self, make_predictor: PredictorFactory, manifest: Manifest,
                 limits: Limits | None = None) -> None:
        use_limits(limits)  # the driver's --max_* flags, in this worker process
        self.predict, self.extra_names = make_predictor()
        self.encoder = RowEncoder(manifest)
        self.classes = manifest.classes

    def __call__(self, frame) -> dict:
        chunk = self.encoder.encode(frame)
        labelled = chunk.labels is not None
        done = predict_chunk(chunk, self.predict)  # the batch path's predict stage
        rows = len(done.ids)
        if done.probabilities is not None:
            probabilities, extra = done.probabilities, done.extra
        else:  # every row failed: the same columns, empty
            probabilities = np.zeros((0, self.classes), dtype=np.float32)
            extra = {name: np.zeros(0) for name in self.extra_names}
        failed = len(done.errors)
        truth = done.labels or [None] * rows
        ids = list(done.ids) + [i for i, _ in done.errors]
        keys = ({KEY_PREFIX + done.keys.name: np.array(done.keys.of(ids), dtype=object)}
                if done.keys is not None else {})
        return {
            "id": np.array(ids, dtype=object), **keys,
            "error": np.array([""] * rows + [r for _, r in done.errors], dtype=object),
            "truth": np.array(["" if t is None else t for t in truth] + [""] * failed,
                              dtype=object),
            "labelled": np.full(rows + failed, labelled),
            "probabilities": np.concatenate(
                [np.asarray(probabilities, dtype=np.float32),
                 np.zeros((failed, self.classes), dtype=np.float32)]),
            **{EXTRA_PREFIX + name: np.concatenate([np.asarray(values, dtype=np.float64),
                                                    np.zeros(failed)])
               for name, values in extra.items()}}


def predicted_from(batch: dict) -> Predicted:
    """A worker's output batch as the writer takes it."""
    ok = batch["error"] == ""
    ids = [str(i) for i in batch["id"][ok]]
    errors = [(str(i), str(r)) for i, r in zip(batch["id"][~ok], batch["error"][~ok])]
    column = next((name for name in batch if name.startswith(KEY_PREFIX)), None)
    keys = None if column is None else RowKeys(
        column.removeprefix(KEY_PREFIX), dict(zip(map(str, batch["id"]), map(str, batch[column]))))
    if not ok.any():
        return Predicted([], None, {}, None, errors, keys)
    labels = ([t if t != "" else None for t in batch["truth"][ok]]
              if batch["labelled"][ok].any() else None)
    extra = {name.removeprefix(EXTRA_PREFIX): np.asarray(values)[ok]
             for name, values in batch.items() if name.startswith(EXTRA_PREFIX)}
    return Predicted(ids, np.asarray(batch["probabilities"])[ok], extra, labels, errors, keys)


# ----------------------------------------------------------------------------- running


def predict_on_ray(options: BatchOptions, manifest: Manifest, make_predictor: PredictorFactory,
                   report: dict, ray_options: RayOptions) -> BatchRun:
    """--input → --output on Ray: the input read by read tasks, encoded and predicted by
    `ray_options.workers` actors, and written here in input order by batch.py's writer; the
    report's `engine` section. The rows predicted together are the local engine's chunks
    (reader frames of options.chunk_rows rows, the worker batch size) as long as the reader's
    frames are whole: a Parquet row group or a chunk with blank rows ends a frame early, and a
    Ray batch does not stop there. Only batch-dependent methods (episodic TTT, dynamic int8)
    can tell."""
    parts = input_parts(manifest, options)  # before the cluster: a bad input fails at once
    with driving_ray(ray_options) as session:
        import ray
        import ray.data

        ordered_data_context()
        # one block stream per part (Ray would otherwise split the blocks to reach its
        # default read parallelism), cut into batches of the worker batch size; as many parts
        # read at a time as there are workers to take them (each read task is a worker process
        # of its own: the 24 row groups of 120,000 Parquet rows read at once on 2 CPUs put the
        # first predictions 38-40 s after the start, against 7 s so, and the whole run took
        # 51-55 s against 26-28 s)
        dataset = ray.data.read_datasource(input_datasource(parts), num_cpus=0,
                                           concurrency=ray_options.workers,
                                           override_num_blocks=len(parts)).map_batches(
            PredictWorker, fn_constructor_args=(make_predictor, manifest, copy(LIMITS)),
            batch_size=ray_options.worker_batch_size, batch_format="pandas",
            compute=ray.data.ActorPoolStrategy(size=ray_options.workers),
            num_cpus=ray_options.threads, num_gpus=ray_options.gpus or None)
        # Ray Data restarts a dead actor and retries its tasks (max_restarts and
        # max_task_retries -1 by default), and preserve_order keeps the rows where they were
        timing = FirstBatch()
        session.stream = iter(dataset.iter_batches(batch_size=None, batch_format="numpy"))
        run = write_predictions(options, manifest,
                                timing.watch(map(predicted_from, session.stream)), report)
    report["engine"] = EngineStats(
        "ray", session.address, ray_options.workers, ray_options.threads,
        ray_options.worker_batch_size, round(session.start_seconds, 3), timing.seconds, run.rows,
        run.failed, run.report_section()["rows_per_s"], run.seconds).report_section()
    LOG.info("ray: %d workers, cluster start %.1f s, first predictions after %.1f s",
             ray_options.workers, session.start_seconds, timing.seconds or 0.0)
    return run


def ordered_data_context() -> None:
    """Ray Data's settings for a run: rows back in input order, no progress bar of its own
    (ours counts what is written), nothing printed at the start of an execution."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    context.print_on_execution_start = False


class FirstBatch:
    """Seconds from the start of the run to its first predictions (the pool's start-up)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: float | None = None

    def watch(self, items: Iterator) -> Iterator:
        for item in items:
            if self.seconds is None:
                self.seconds = round(time.perf_counter() - self.started, 3)
            yield item


def unwrapped(err: BaseException) -> BaseException:
    """Our own error (a bad row file, a provider that did not start) out of Ray's wrappers,
    whose chain holds it as a cause; any other failure of Ray's as one RuntimeFailure line."""
    import re

    seen: set[int] = set()
    pending = [err]
    while pending:
        current = pending.pop()
        if id(current) in seen or current is None:
            continue
        seen.add(id(current))
        if isinstance(current, PipelineError):
            return current
        pending += [getattr(current, "cause", None), current.__cause__, current.__context__]
    if type(err).__module__.split(".")[0] != "ray":
        return err
    first = re.sub(r"\x1b\[[0-9;]*m", "", str(err).strip()).splitlines()[0][:300]
    return RuntimeFailure(f"a Ray worker failed: {type(err).__name__}: {first}",
                          "rerun with --log_level DEBUG; the workers' logs are in "
                          "/tmp/ray/session_latest/logs")
