"""serve.py --engine ray: the same HTTP application (app.py's endpoints, limits, errors and
micro-batcher) as a Ray Serve deployment of --num_replicas replicas behind Ray Serve's HTTP
proxy on --host/--port.

Each replica holds one ONNX Runtime session of --num_threads intra-op threads (its num_cpus:
Ray's OMP_NUM_THREADS does not reach ONNX Runtime) and one inter-op thread, its own
`ModelServer` and micro-batcher, and create_app's FastAPI app. The deployment class opens the
bundle in its constructor and hands Ray Serve the app from `__serve_build_asgi_app__`
(serve.ingress() without an app: Ray builds it on the replica, after the constructor); Ray Serve
then runs the app's lifespan, which starts the batcher, on the replica's user-code event loop,
the loop the replica's requests are answered on. The proxy sends each request to one replica,
which answers exactly what the local server answers.

This process checks and warms the bundle before Ray starts (a bad bundle is exit 3/4 with its
one line, as with --engine local), starts a local cluster of this machine's CPUs or joins
--ray_address, deploys, and waits for SIGTERM (exit 0 once the replicas drained) or SIGINT
(130); it then deletes its application (the replicas answer what they hold within --drain_s),
shuts down Serve if it started it on a joined cluster, and stops the cluster it started, every
process of it.

Not on Ray: reloading the bundle. A replica's /v2/repository/models/NAME/load reaches only that
replica, and Ray Serve 2.60 changes a deployment only by replacing its replicas (a deployment
`version`, which allowed updates in place, was removed), losing the local reload's promise that
the old model serves until the new one passed every check; so the endpoint answers 501 and
SIGHUP is logged and ignored. Restart serve.py to serve new weights.

Ray is imported only here, and only for --engine ray.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ttc.online.app import ModelServer, ServerError, create_app, warmed_predictor
from ttc.online.predictor import FlagCheck
from ttc.options.stages import ServeOptions
from ttc.serving import cluster
from utils import EXIT_INTERRUPTED, LOG, ConfigError, RuntimeFailure

GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
DEPLOYMENT = "ttc_model"  # the deployment's name in Ray (its replicas: ServeReplica:NAME:ttc_model)
DEPLOY_POLL_S = 0.25  # how often the replicas' start is checked
RELOAD_UNSUPPORTED = ("reloading is not available with --engine ray (each replica holds its own "
                      "copy of the model); restart serve.py to serve the bundle's new weights")


# ----------------------------------------------------------------------------- the replicas


class RayModelServer(ModelServer):
    """app.py's ModelServer in a replica: everything but reloads (501)."""

    async def reload(self) -> dict:
        raise ServerError(501, RELOAD_UNSUPPORTED)


class ModelReplica:
    """One Ray Serve replica: the bundle opened with every check and warmed (a session of
    --num_threads threads), the server around it, and create_app's app for Ray to run."""

    def __init__(self, options: ServeOptions) -> None:
        from ttc.inputs.limits import configure

        configure(options)  # the driver's --max_* flags, in this replica's process
        # the flags were checked against the bundle's model type by the driver, before deploying
        self.server = RayModelServer(options, warmed_predictor(options, None))

    def __serve_build_asgi_app__(self):
        return create_app(self.server)


def deployment(options: ServeOptions, threads: int, gpu: bool):
    """The Serve application: --num_replicas ModelReplica actors of `threads` CPUs each."""
    from ray import serve

    # the replicas import this checkout's code (Ray adds the driver's folder to its own job's
    # workers only, and Serve's controller may be another job's), from the same path
    paths = [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
    actor: dict[str, Any] = {"num_cpus": threads, "runtime_env": {"env_vars": {
        "PYTHONPATH": os.pathsep.join(p for p in paths if p)}}}
    if gpu:
        actor["num_gpus"] = 1
    return serve.deployment(
        serve.ingress()(ModelReplica), name=DEPLOYMENT, num_replicas=options.num_replicas,
        ray_actor_options=actor,
        # the replica's own batcher queues up to --max_queue requests and answers 429 beyond,
        # as locally: Ray lets that many, the batch being run and those being parsed reach it
        # (its default, 5, would cap every batch at 5 requests and hold the rest in the proxy)
        max_ongoing_requests=options.max_queue + options.max_batch_size + 16,
        # a stop drains the replica's accepted requests within --drain_s
        graceful_shutdown_timeout_s=max(options.drain_s, 0.1), graceful_shutdown_wait_loop_s=0.1,
        # a replica that cannot open the bundle fails the deployment at once, not 20 times
        max_constructor_retry_count=1).bind(options)


# ----------------------------------------------------------------------------- the driver


def serve_on_ray(options: ServeOptions, check_flags: FlagCheck) -> int:
    """Check and warm the bundle here (`check_flags`: the flags against its model type), start
    or join the cluster, deploy, serve until SIGTERM (exit 0) or SIGINT (130), and stop what was
    started."""
    threads = max(1, options.ray_threads())
    local = options.local_ray()
    if local:  # both before the model, as the local server checks its port
        _require_local_cpus(options.num_replicas, threads)
        port = _free_port(options.host, options.port)
    elif options.port == 0:  # a free port here says nothing of the cluster's nodes
        raise ConfigError("--port 0 (any free port) works only on a local cluster: a joined "
                          "cluster's proxies listen on the same port on every node",
                          "give --port a number")
    else:  # each node's proxy listens there
        port = options.port
    replica_options = dataclasses.replace(
        options, intra_op_threads=threads, inter_op_threads=1, no_progress=True,
        output_model=str(Path(options.output_model).absolute()))  # the replicas' path
    replica_options.script = "serve"
    # a bad bundle: exit 3/4 before Ray starts
    predictor = warmed_predictor(replica_options, check_flags)
    name = options.name or predictor.paths.onnx.stem
    gpu = predictor.providers[0] in GPU_PROVIDERS
    del predictor
    debug = options.log_level == "DEBUG"
    started_serve, deployed, stops = False, False, None
    with cluster.ray_prints_to_stderr():
        try:
            address, seconds = _connect(options, local)
            _require_room(options.num_replicas, threads, gpu)
            started_serve = _start_serve(options.host, port, name, local, debug)
            # from here on SIGTERM is a drained stop (exit 0), also while the replicas start: the
            # first one answers before the others are up
            stops = _StopSignals()
            began, deployed = time.perf_counter(), True
            if _deploy(deployment(replica_options, threads, gpu), name, stops, debug):
                LOG.info("serving %s as %r on http://%s:%d with Ray Serve: %d replica(s) of %d "
                         "thread(s) (POST /predict, /v2/models/%s/infer; cluster %s ready in "
                         "%.1f s, replicas in %.1f s)", replica_options.output_model, name,
                         f"[{options.host}]" if ":" in options.host else options.host, port,
                         options.num_replicas, threads, name, address, seconds,
                         time.perf_counter() - began)
                stops.wait()
        finally:
            _stop(name, started_serve, deployed, local, debug)
    LOG.info("stopped: Ray Serve drained its replicas")
    return EXIT_INTERRUPTED if stops.first == signal.SIGINT else 0


def _require_local_cpus(replicas: int, threads: int) -> None:
    """A local cluster has this machine's CPUs: replicas it cannot place would wait forever."""
    from ttc.serving.runtime import usable_cpus

    cpus = usable_cpus()
    if replicas * threads > cpus:
        raise ConfigError(f"--num_replicas {replicas} with {threads} thread(s) each needs "
                          f"{replicas * threads} CPUs, and a local Ray cluster has this "
                          f"machine's {cpus}", "lower --num_replicas or --num_threads, or join "
                          "a larger cluster with --ray_address")


def _free_port(host: str, port: int) -> int:
    """The port a local cluster's proxy will listen on, checked free now, before the model
    (one in use: exit 5 with the local server's line; port 0: a free one)."""
    from ttc.online.app import bound_socket

    with bound_socket(host, port) as sock:
        return sock.getsockname()[1]


def _connect(options: ServeOptions, local: bool) -> tuple[str, float]:
    """ray.init as batch inference does it (cluster.py): a new local cluster of this machine's
    CPUs, or the cluster at --ray_address, with SIGTERM and SIGINT held until it is done; Ray's
    logs at ERROR on stderr (all of them at --log_level DEBUG). The cluster's address and the
    seconds it took."""
    debug = options.log_level == "DEBUG"
    level = logging.DEBUG if debug else logging.ERROR
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not debug:
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    import ray

    logging.getLogger("ray").setLevel(level)
    ray_options = cluster.RayOptions(None if local else options.ray_address,
                                     options.num_replicas, 1, 1, debug=debug)
    if not local:
        cluster._require_reachable(options.ray_address)
        cluster._attach_token_if_any()
    started = time.perf_counter()
    try:
        with cluster._signals_held(), cluster._ray_sigterm_handler_off(), \
                cluster._quiet_native_logs(not debug):
            cluster._init(ray, ray_options, level)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise RuntimeFailure(f"cannot reach a Ray cluster at {options.ray_address}: "
                             f"{_first_line(err)}", "start one with `ray start --head` (then "
                             "--ray_address auto), or leave --ray_address out for a local "
                             "cluster") from None
    return ray.get_runtime_context().gcs_address, time.perf_counter() - started


def _require_room(replicas: int, threads: int, gpu: bool) -> None:
    """Replicas the cluster cannot place would keep the deployment waiting forever."""
    import ray

    resources = ray.cluster_resources()
    cpus, gpus = resources.get("CPU", 0), resources.get("GPU", 0)
    if replicas * threads > cpus:
        raise ConfigError(f"--num_replicas {replicas} with {threads} thread(s) each needs "
                          f"{replicas * threads} CPUs, and the Ray cluster has {cpus:g}",
                          "lower --num_replicas or --num_threads")
    if gpu and replicas > gpus:
        raise ConfigError(f"--num_replicas {replicas} on a GPU provider needs {replicas} GPUs, "
                          f"and the Ray cluster has {gpus:g}", "lower --num_replicas, or use "
                          "--ep cpu")


def _start_serve(host: str, port: int, name: str, local: bool, debug: bool) -> bool:
    """Serve's controller and HTTP proxies (on host:port); whether this process started them
    (False: Serve ran on the cluster already, listening where this run asks). Where they cannot
    start, a joined cluster is left without this run's controller."""
    from ray import serve
    from ray.exceptions import RayError
    from ray.serve.context import _get_global_client

    # Serve's lines here ("Started Serve in namespace ...") at Ray's level: importing
    # ray.serve set its logger, which does not propagate, to INFO
    logging.getLogger("ray.serve").setLevel(logging.DEBUG if debug else logging.ERROR)
    running = _get_global_client(raise_if_no_controller_running=False)  # Serve already here?
    if running is not None:
        http = running.http_config
        if (http.host, http.port) != (host, port):
            raise RuntimeFailure(f"Ray Serve already runs on this cluster, listening on "
                                 f"{http.host}:{http.port}", f"serve there (--host {http.host} "
                                 f"--port {http.port}), or shut that Serve down first")
        if name in serve.status().applications:  # someone else's: not to be replaced
            raise RuntimeFailure(f"the cluster's Ray Serve already runs an application named "
                                 f"{name!r}", "give this one another --name")
        return False
    try:
        serve.start(http_options={"host": host, "port": port, "keep_alive_timeout_s": 30},
                    logging_config=_logging_config(debug))
    except RayError as err:  # the proxy's port taken since it was checked; a controller died
        if not local:  # a local cluster's Serve goes with the cluster
            with contextlib.suppress(Exception):
                serve.shutdown()
        raise RuntimeFailure(f"Ray Serve could not start its controller and HTTP proxy on "
                             f"{host}:{port}: {_last_line(err)}", "choose another --port if "
                             "another process took that one; otherwise rerun with --log_level "
                             "DEBUG (Ray's logs are in /tmp/ray/session_latest/logs)") from None
    return True


def _logging_config(debug: bool) -> dict:
    """Serve's own logs (in Ray's log folder) at WARNING, without a line per request; all of
    them at --log_level DEBUG."""
    return {"log_level": "DEBUG" if debug else "WARNING", "enable_access_log": debug}


def _deploy(app, name: str, stops: "_StopSignals", debug: bool) -> bool:
    """Deploy the application at route / and wait until its replicas run (True), or until a
    stop comes first (False). A replica that cannot start is exit 5 with Ray's reason."""
    from ray import serve
    from ray.exceptions import RayError
    from ray.serve.api import RunTarget
    from ray.serve.exceptions import RayServeException
    from ray.serve.schema import ApplicationStatus

    try:
        serve.run_many([RunTarget(app, name=name, route_prefix="/",
                                  logging_config=_logging_config(debug))],
                       wait_for_applications_running=False)
        while not stops.wait(DEPLOY_POLL_S):
            application = serve.status().applications.get(name)
            status = application.status if application else None
            if status == ApplicationStatus.RUNNING:
                return True
            if status in (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY):
                raise RuntimeFailure(f"a Ray Serve replica failed to start: "
                                     f"{_replica_error(application) or status.value}",
                                     "rerun with --log_level DEBUG; the replicas' logs are in "
                                     "/tmp/ray/session_latest/logs/serve")
    # the route / taken by another application (raised in Serve's controller)
    except (RuntimeError, ValueError, RayServeException, RayError) as err:
        reason = _last_line(err) if isinstance(err, RayError) else _first_line(err)
        raise RuntimeFailure(f"Ray Serve could not deploy {name!r}: {reason}",
                             "rerun with --log_level DEBUG; the replicas' logs are in "
                             "/tmp/ray/session_latest/logs/serve") from None
    return False


class _StopSignals:
    """SIGTERM and SIGINT recorded (the server stops on the first), SIGHUP logged: no reloads
    on Ray. In place of run_cli's handlers, which would end the process at once."""

    def __init__(self) -> None:
        from utils import hand_stops_to_server

        self.signals: list[int] = []
        self.event = threading.Event()
        sigint_ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # nohup, `&`
        hand_stops_to_server()
        signal.signal(signal.SIGTERM, self._stop)
        if not sigint_ignored:
            signal.signal(signal.SIGINT, self._stop)
        with contextlib.suppress(AttributeError, ValueError):  # no SIGHUP on Windows
            signal.signal(signal.SIGHUP, self._hangup)

    def _stop(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)
        self.event.set()

    @staticmethod
    def _hangup(signum: int, frame: Any) -> None:
        LOG.warning("SIGHUP: %s", RELOAD_UNSUPPORTED)

    @property
    def first(self) -> int | None:
        return self.signals[0] if self.signals else None

    def wait(self, timeout: float | None = None) -> bool:
        """Whether a stop came (within `timeout`; None: wait until one does)."""
        if timeout is not None:
            return self.event.wait(timeout)
        while not self.event.wait(0.5):  # short waits: the handler runs between them
            pass
        return True


def _stop(name: str, started_serve: bool, deployed: bool, local: bool, debug: bool) -> None:
    """This run's application deleted (its replicas drain within --drain_s), and Serve shut
    down if this run started it on a joined cluster (a local cluster's Serve goes with it);
    then the cluster left, and stopped with every process of it if it was this run's own.
    SIGTERM and SIGINT wait until that is done."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    # Ray's core may print a line while Serve's actors go (a shutdown call it would retry):
    # hidden unless --log_level DEBUG. A local cluster's Serve is not shut down on its own:
    # serve.shutdown() there printed that line past this, and the cluster's stop ends it anyway
    with cluster._signals_held(), cluster._quiet_native_logs(not debug):
        try:
            from ray import serve

            if started_serve and not local:
                serve.shutdown()  # deletes the application first
            elif deployed:  # never another's: _start_serve refused a name in use
                serve.delete(name)
        except Exception as err:  # noqa: BLE001 - the cluster is left (or stopped) anyway
            LOG.debug("stopping Ray Serve: %s", err)
        cluster.stop_ray(None, local)


def _replica_error(application) -> str | None:
    """The exception a replica's constructor raised, from its deployment's status message (a
    traceback, whose last line is e.g. `utils.ExportError: ... does not match its manifest`)."""
    for deployment in application.deployments.values():
        if "Error" in (deployment.message or ""):
            return _last_line(deployment.message)
    return None


def _last_line(text: BaseException | str) -> str:
    """A remote traceback's last line, the exception, without its module's path."""
    import re

    lines = [line.strip() for line in _plain(text).splitlines() if line.strip()]
    return re.sub(r"^[\w.]+\.(\w+: )", r"\1", lines[-1] if lines else str(text))[:500]


def _first_line(err: BaseException) -> str:
    return (_plain(err).splitlines() or [type(err).__name__])[0][:300]


def _plain(text: BaseException | str) -> str:
    """Without terminal colours (Ray colours its tracebacks' first line)."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", str(text).strip())
