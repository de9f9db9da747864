"""A fork server for the tests' CLI runs: `python X.py ARGS` without paying torch's import again.

Each CLI run the tests make is a process of its own, as a user's would be, but about half of a
short pipeline run's CPU time is importing torch (and the parts of it that training and the ONNX
exporter load), onnx, onnxslim, pandas and matplotlib, the same in every run. This server imports
them once; each run is then a fork of it that takes the caller's stdin, stdout and stderr (passed
over a Unix socket), its working directory, environment and arguments, and runs the script as
`__main__` exactly as `python X.py ARGS` would: sys.argv, sys.path[0] the script's folder, the
interpreter's normal exit (threads joined, atexit handlers, exit code; a traceback when the
script raises), less the module-by-module teardown, which has nothing to show and costs half a
second.

What a fork does not reproduce, and so what the tests that check it run real interpreters for:
which modules a CLI imports (tests/conftest.py heavy_modules_after), signals and resource limits
set before exec (run_cli's popen arguments), and a library that prints while it is imported.
Preloaded are only libraries that read no per-run environment at import and start no thread:
not transformers (HF_HUB_OFFLINE), not onnxruntime or torchvision (they start threads). dspy is:
it reads DSPY_CACHEDIR at import only into the defaults of configure_cache and of fine-tuning,
which the tool never calls; the cache it uses is built on first use from the run's environment
(tests/test_forkserver.py checks that). torch.onnx.export's table of decompositions for the
default opset is built here too (prebuild_export_table): every exporting run saved its second
of CPU. Then everything loaded is frozen (gc.freeze), so that a run's garbage collections skip it.

Protocol: the client connects, sends its three standard descriptors (SCM_RIGHTS) with one JSON
message {argv, cwd, env, executable}, and reads back the child's pid, then its exit status
("exit N" or "signal N"); a run with TTC_TEST_CENSUS=FILE in its environment also
gets a line of its test, argv, wall and CPU seconds in FILE (Census; tests/census.py sums
them). When the client goes away first (a test's timeout), the child kills
itself. The client passes on SIGTERM, SIGINT and SIGHUP to the child (a documented serve.py stops
and reloads so).

    python tests/forkserver.py SOCKET   # serve (prints "ready" when it listens)
    python tests/forkserver.py --client SOCKET ROOT SHIM ARGS...   # `python ARGS`: client_main
"""
from __future__ import annotations

import array
import gc
import json
import os
import selectors
import signal
import socket
import sys
import time

PRELOAD = ("numpy", "pandas", "PIL.Image", "onnx", "onnxslim", "torch", "torch._dynamo",
           "torch.onnx", "torch.onnx._internal.exporter._core", "torch.export._trace",
           "torch._functorch.aot_autograd", "onnxscript.function_libs.torch_lib.ops",
           "sklearn.datasets", "matplotlib", "matplotlib.figure", "matplotlib.axes", "dspy")
MAX_MESSAGE = 1 << 20


# ----------------------------------------------------------------------------- client side

def send_request(sock: socket.socket, argv: list[str], cwd: str, env: dict[str, str],
                 fds: tuple[int, int, int], executable: str | None = None) -> int:
    """Ask for one run (with `executable` as the child's sys.executable); the child's pid."""
    message = json.dumps({"argv": argv, "cwd": cwd, "env": env,
                          "executable": executable}).encode()
    sock.sendmsg([len(message).to_bytes(4, "big") + message],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    return int(_read_line(sock))


def read_status(sock: socket.socket) -> int:
    """The child's exit status as subprocess reports it: the code, or -N if signal N killed it."""
    kind, value = _read_line(sock).split()
    return int(value) if kind == "exit" else -int(value)


def _read_line(sock: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(64)
        if not chunk:
            raise ConnectionError("the fork server closed the connection")
        data += chunk
    return data.decode().strip()


FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def client_main(path: str, root: str, shim: str, argv: list[str]) -> None:
    """Be `python ARGV`, invoked as `shim`: a script of the repository under `root` runs
    through the server (its sys.executable the shim, so that the Python processes it starts
    itself fork too), exiting as it exits; anything else (`-c`, `-m`, a library's own script
    such as a Ray worker's) is the real interpreter."""
    script = os.path.realpath(argv[0]) if argv else ""
    inside = script.startswith(os.path.join(os.path.realpath(root), ""))
    if not (script.endswith(".py") and inside):
        os.execv(sys.executable, [sys.executable, *argv])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        pid = send_request(sock, argv, os.getcwd(), dict(os.environ), (0, 1, 2),
                           executable=os.path.abspath(shim))
        for signum in FORWARDED_SIGNALS:  # a stop (or serve.py's reload) sent to `python X.py`
            signal.signal(signum, lambda number, _frame: os.kill(pid, number))
        status = read_status(sock)
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


# ----------------------------------------------------------------------------- server side

EXPORT_OPSETS = (18,)  # the default --opset


def prebuild_export_table() -> None:
    """torch.onnx.export's table of ATen → ONNX decompositions (1-1.6 s of CPU), which every
    process that exports builds once (export.py memoises it per process): built here once, for
    the default opset, so that every forked run inherits it. Pure Python objects that the
    exporter only reads, built from nothing a run's environment changes; no thread starts. A
    torch without this private API is left as it is."""
    try:
        import torch.ao.quantization.fx._decomposed  # noqa: F401 - as export.py: the QDQ ops
        from torch.onnx._internal.exporter import _registration
        build = _registration.ONNXRegistry.__dict__["from_torchlib"].__func__
    except (ImportError, AttributeError, KeyError):
        return
    built = {opset: build(_registration.ONNXRegistry, opset_version=opset)
             for opset in EXPORT_OPSETS}

    def from_torchlib(cls: type, opset_version: int | None = None) -> object:
        if opset_version in built:
            return built[opset_version]
        return build(cls) if opset_version is None else build(cls, opset_version=opset_version)

    _registration.ONNXRegistry.from_torchlib = classmethod(from_torchlib)


def serve(path: str) -> dict | None:
    """Accept runs until stdin closes (the test worker went away). Returns, in each forked
    child, the run it is to make."""
    for name in PRELOAD:
        __import__(name)
    prebuild_export_table()
    # The preloaded objects (about 600,000: one full collection of them is 0.3 s of CPU) go to
    # the collector's permanent generation: a run's collections no longer walk them, nor write
    # into their pages (copy-on-write); 0.3-0.5 s of CPU less in a forked pipeline run.
    # Reference counting frees them as before; only cycles among them stay, in a short run.
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_read, selectors.EVENT_READ, "child")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    print("ready", flush=True)
    running: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select():
            if key.data == "stdin" and not sys.stdin.buffer.read1(1024):
                return None
            if key.data == "child":
                os.read(wake_read, 4096)
                _reap(running)
            if key.data == "accept":
                conn, _ = listener.accept()
                job = _receive(conn)
                pid = os.fork()
                if pid == 0:  # the child: nothing of the server's stays open in the run
                    selector.close()
                    listener.close()
                    for other in running.values():
                        other.close()
                    os.close(wake_read)
                    os.close(wake_write)
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    return {**job, "conn": conn}
                for fd in job["fds"]:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                running[pid] = conn
                census.started(pid, job)


def _receive(conn: socket.socket) -> dict:
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    size = int.from_bytes(data[:4], "big")
    while len(data) < 4 + size:
        data += conn.recv(MAX_MESSAGE)
    return {**json.loads(data[4:4 + size]), "fds": list(fds)}


class Census:
    """A run whose environment holds TTC_TEST_CENSUS=FILE (a suite run with it set: the tests
    pass their environment on) gets one JSON line in FILE when it ends: its test, argv, wall
    seconds, and the CPU seconds of the run and of the processes it waited for
    (tests/census.py sums them). Nothing is written otherwise."""

    def __init__(self) -> None:
        self.runs: dict[int, tuple] = {}

    def started(self, pid: int, job: dict) -> None:
        path = job["env"].get("TTC_TEST_CENSUS")
        if path:
            self.runs[pid] = (path, time.monotonic(), job["argv"],
                              job["env"].get("PYTEST_CURRENT_TEST"))

    def ended(self, pid: int, usage) -> None:
        if pid not in self.runs:
            return
        path, start, argv, test = self.runs.pop(pid)
        line = {"test": test, "argv": argv, "wall": round(time.monotonic() - start, 3),
                "cpu": round(usage.ru_utime + usage.ru_stime, 3)}
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps(line) + "\n")


census = Census()


def _reap(running: dict[int, socket.socket]) -> None:
    while running:
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            return
        census.ended(pid, usage)
        conn = running.pop(pid, None)
        if conn is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        try:
            conn.sendall((f"exit {code}\n" if code >= 0 else f"signal {-code}\n").encode())
        except OSError:
            pass  # the client went away (a timeout): nobody waits for this status
        conn.close()


def become(job: dict) -> None:
    """In the forked child: take the caller's descriptors, folder, environment and arguments."""
    for target, fd in enumerate(job["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    _no_exit_work_of_the_preloaded_libraries()
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    script = job["argv"][0]
    sys.argv = list(job["argv"])
    if job["executable"]:
        sys.executable = job["executable"]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    _die_with_the_client(job["conn"])


def _no_exit_work_of_the_preloaded_libraries() -> None:
    """torch's operator libraries unregister themselves at exit (weakref finalizers, 30 ms):
    work on the server's memory that a run which never imported torch would not do, and that
    leaves nothing behind either way. The run's own finalizers still run at its exit."""
    import weakref

    for info in weakref.finalize._registry.values():  # noqa: SLF001 - the only handle there is
        info.atexit = False


def _die_with_the_client(conn: socket.socket) -> None:
    """The client's timeout closes the connection: then this run is killed, as subprocess.run
    kills a process that outlives its timeout."""
    import threading

    def watch() -> None:
        while True:
            try:
                if not conn.recv(64):
                    break
            except OSError:
                break
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="forkserver-watch", daemon=True).start()


def _run_script() -> None:
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")


def exit_as_python_does(main) -> None:
    """Run main() and end the process as the interpreter ends it (the exit code of SystemExit,
    the traceback of an exception, non-daemon threads joined, atexit handlers, streams flushed),
    but without tearing down the modules one by one: with torch loaded that alone takes half a
    second, where a fresh interpreter that never imported it has nothing to tear down."""
    import atexit
    import threading

    try:
        main()
        code = 0
    except SystemExit as exit:
        code = _exit_code(exit.code)
    except KeyboardInterrupt:  # as the interpreter does: the traceback, then killed by SIGINT
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:  # as the interpreter does: the traceback, then exit 1
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # the interpreter's own wait for non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120  # as Python: a failed flush at exit is exit 120
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    if sys.argv[1] == "--client":
        client_main(*sys.argv[2:5], sys.argv[5:])
    job = serve(sys.argv[1])
    if job is None:
        sys.exit(0)
    become(job)
    del job
    exit_as_python_does(_run_script)
