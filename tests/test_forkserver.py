"""The fork server (tests/forkserver.py) runs a script as a fresh `python X.py` would: the same
arguments, import path, folder, environment, standard streams, exit code and exit handlers."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import CLI_ENV, REPO, assert_clean_failure, fork_server, run_cli

PROBE = """
import atexit, json, os, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
def late():
    time.sleep(0.2)
    print("thread joined", flush=True)
threading.Thread(target=late).start()  # not a daemon: the interpreter waits for it at exit
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                  "env": os.environ.get("PROBE_VALUE"), "name": __name__,
                  "stdin": sys.stdin.read(), "tty": sys.stdout.isatty(),
                  "executable": sys.executable}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def server():
    found = fork_server()
    if found is None:
        pytest.skip("TTC_TESTS_FORK=0: every run is a fresh interpreter already")
    return found


def both_ways(server, script, args, cwd, env, timeout=60):
    fresh = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    return fresh, server.run([str(script), *args], cwd, env, timeout)


def test_a_forked_run_is_the_fresh_interpreter_s_run(server, tmp_path):
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    env = dict(os.environ, **CLI_ENV, PROBE_VALUE="from the caller")
    fresh, forked = both_ways(server, script, ["3", "ä b"], tmp_path, env)
    assert forked.returncode == fresh.returncode == 3
    assert forked.stdout == fresh.stdout and forked.stderr == fresh.stderr
    seen = json.loads(fresh.stdout.splitlines()[0])
    assert seen == {"argv": [str(script), "3", "ä b"], "path0": str(script.parent),
                    "cwd": str(tmp_path), "env": "from the caller", "name": "__main__",
                    "stdin": "", "tty": False, "executable": sys.executable}
    assert fresh.stdout.splitlines()[1:] == ["thread joined", "atexit ran"]


def test_dspy_preloaded_keeps_its_cache_where_the_run_s_environment_says(server, tmp_path):
    """dspy is imported before the fork; the cache a run uses must follow the run's DSPY_CACHEDIR."""
    script = tmp_path / "cache_dir.py"
    script.write_text("import dspy\nprint(dspy.cache.disk_cache.directory)\n")
    for name in ("one", "two"):
        env = dict(os.environ, **CLI_ENV, DSPY_CACHEDIR=str(tmp_path / name))
        fresh, forked = both_ways(server, script, [], tmp_path, env)
        assert forked.returncode == fresh.returncode == 0, forked.stderr
        assert forked.stdout == fresh.stdout == f"{tmp_path / name}\n"


def test_an_uncaught_exception_is_a_traceback_and_exit_1(server, tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("raise ValueError('boom')\n")
    fresh, forked = both_ways(server, script, [], tmp_path, dict(os.environ, **CLI_ENV))
    assert forked.returncode == fresh.returncode == 1
    assert "Traceback" in forked.stderr and "ValueError: boom" in forked.stderr


def test_a_cli_error_is_the_same_through_the_server(tmp_path):
    missing = tmp_path / "none.onnx"
    forked = run_cli("inference.py", "--model", missing)
    fresh = run_cli("inference.py", "--model", missing, stdin=subprocess.DEVNULL)  # popen: fresh
    assert_clean_failure(forked, 4, str(missing))
    assert (forked.returncode, forked.stdout, untimed(forked.stderr)) == \
        (fresh.returncode, fresh.stdout, untimed(fresh.stderr))


def untimed(log: str) -> str:
    """A log without its lines' clock times."""
    return re.sub(r"^\d\d:\d\d:\d\d ", "", log, flags=re.M)


def test_a_timeout_kills_the_run(server, tmp_path):
    script = tmp_path / "slow.py"
    marker = tmp_path / "pid"
    script.write_text(f"import os, time\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\n"
                      "time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        server.run([str(script)], tmp_path, dict(os.environ, **CLI_ENV), timeout=3)
    pid = int(marker.read_text())
    deadline = time.time() + 10
    while time.time() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid)


def test_the_python_shim_forks_the_root_s_scripts_and_is_python_for_the_rest(server, tmp_path):
    """Through the shim, a script under the root forks (stdin passed, the shim its
    sys.executable, so the CLIs it starts fork too); `-c` and a script elsewhere (a library's,
    such as a Ray worker's) run on the real interpreter."""
    root, elsewhere = tmp_path / "checkout", tmp_path / "site-packages"
    for folder in (root, elsewhere):
        folder.mkdir()
        (folder / "probe.py").write_text(PROBE)
    shim = root / "bin" / "python"
    shim.parent.mkdir()
    server.python_shim(shim, root)
    env = dict(os.environ, **CLI_ENV)
    piped = subprocess.run(["bash", "-c", f"printf 'a\\nb' | bin/python probe.py 5; echo rc=$?"],
                           cwd=root, env=env, capture_output=True, text=True, timeout=60)
    seen = json.loads(piped.stdout.splitlines()[0])
    assert seen["stdin"] == "a\nb" and seen["executable"] == str(shim)
    assert piped.stdout.splitlines()[-1] == "rc=5"
    outside = subprocess.run([str(shim), str(elsewhere / "probe.py"), "0"], cwd=root, env=env,
                             capture_output=True, text=True, timeout=60)
    assert json.loads(outside.stdout.splitlines()[0])["executable"] == sys.executable
    other = subprocess.run([str(shim), "-c", "import sys; print(sys.executable)"], cwd=root,
                           env=env, capture_output=True, text=True, timeout=60)
    assert other.stdout.strip() == sys.executable


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead: only its status is left
        return stat.read().split(") ", 1)[1][0] != "Z"


def test_the_shim_passes_stops_and_reloads_on_to_the_run(server, tmp_path):
    """SIGHUP, then SIGTERM, sent to `python X.py` through the shim reach the forked run (a
    documented serve.py reloads and stops so in tests/test_docs_commands.py)."""
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "waits.py").write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGHUP, lambda *_: print('reload', flush=True))\n"
        "signal.signal(signal.SIGTERM, lambda *_: (print('stop', flush=True), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "while True:\n    time.sleep(0.05)\n")
    shim = root / "bin" / "python"
    shim.parent.mkdir()
    server.python_shim(shim, root)
    run = subprocess.Popen([str(shim), "waits.py"], cwd=root, env=dict(os.environ, **CLI_ENV),
                           stdout=subprocess.PIPE, text=True)
    assert run.stdout.readline().strip() == "ready"
    run.send_signal(signal.SIGHUP)
    assert run.stdout.readline().strip() == "reload"
    run.send_signal(signal.SIGTERM)
    assert run.stdout.readline().strip() == "stop"
    assert run.wait(timeout=30) == 0


def test_the_exporter_s_table_is_built_once_in_the_server(server, tmp_path):
    """Every forked run finds torch.onnx's decomposition table for the default opset already
    built (the same object each time it asks), and builds other opsets as before."""
    script = tmp_path / "table.py"
    script.write_text(
        "from torch.onnx._internal.exporter import _registration as r\n"
        "a, b = r.ONNXRegistry.from_torchlib(18), r.ONNXRegistry.from_torchlib(18)\n"
        "c, d = r.ONNXRegistry.from_torchlib(17), r.ONNXRegistry.from_torchlib(17)\n"
        "print(a is b, c is d, type(a).__name__)\n")
    run = server.run([str(script)], tmp_path, dict(os.environ, **CLI_ENV), timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "False", "ONNXRegistry"]


def test_the_census_records_each_forked_run_and_sums_them(server, tmp_path):
    """TTC_TEST_CENSUS=FILE in a run's environment: the server writes a line for the run (its
    test, argv, wall and CPU seconds), and tests/census.py sums the lines by script and by
    test file."""
    census = tmp_path / "census.jsonl"
    script = tmp_path / "busy.py"
    script.write_text("import sys, time\nend = time.process_time() + 0.2\n"
                      "while time.process_time() < end:\n    pass\nsys.exit(int(sys.argv[1]))\n")
    env = dict(os.environ, **CLI_ENV, TTC_TEST_CENSUS=str(census))
    assert [server.run([str(script), code], tmp_path, env, 60).returncode
            for code in ("0", "4")] == [0, 4]
    assert server.run([str(script), "0"], tmp_path, dict(os.environ, **CLI_ENV),
                      60).returncode == 0  # not counted: TTC_TEST_CENSUS is not in its env
    runs = [json.loads(line) for line in census.read_text().splitlines()]
    assert [r["argv"] for r in runs] == [[str(script), "0"], [str(script), "4"]]
    assert all(r["test"].startswith("tests/test_forkserver.py::test_the_census") for r in runs)
    assert all(0.2 <= r["cpu"] <= r["wall"] + 0.05 for r in runs), runs
    summary = subprocess.run([sys.executable, str(REPO / "tests" / "census.py"), str(census)],
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    assert summary.stdout.startswith("2 CLI runs: ")
    assert re.search(r"^busy\.py\s+2\s+0\.[4-9]", summary.stdout, re.M), summary.stdout
    assert re.search(r"^tests/test_forkserver\.py\s+2\s", summary.stdout, re.M), summary.stdout
