"""serve.py --engine ray (Ray Serve) against serve.py's local engine on one bundle: the same
status codes and JSON bodies for the same requests (/predict, /v2 infer, metadata, health, the
errors), answered by either of two replicas; reloads refused with 501; SIGTERM ends it with
exit 0 and no process of its local cluster left.

It starts a Ray cluster of the machine's CPUs, so it shares tests/test_ray.py's xdist worker."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import CLI_ENV, REPO, feature_rows
from test_ray import descendants, still_running

pytestmark = pytest.mark.xdist_group("ray")

STARTUP_S = 180  # a local cluster, Serve's controller and proxy, two replicas (12-23 s here)
STOP_S = 60  # the replicas drain, the cluster stops (2.5-3 s here)
BODY_MB = 0.01  # --max_body_mb on both servers: a 10 kB body is 413


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model: Path, log: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """serve.py of `model` on a free port, its stderr in `log`; the process and its URL."""
    port = free_port()
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "serve.py"), "--model", str(model), "--port", str(port),
             "--max_body_mb", str(BODY_MB), *args], cwd=REPO, env=dict(os.environ, **CLI_ENV),
            stdout=subprocess.DEVNULL, stderr=stderr)
    return proc, f"http://127.0.0.1:{port}"


def wait_until(ready, proc: subprocess.Popen, log: Path, seconds: float) -> None:
    deadline = time.time() + seconds
    while not ready():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, f"not ready in {seconds} s: {log.read_text()[-3000:]}"
        time.sleep(0.2)


def answers_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def requests_to_compare(rows: list[dict]) -> list[tuple[str, str, dict]]:
    """(method, path, httpx arguments): answers, and each kind of error, of both protocols."""
    tensors = [{"name": "height", "datatype": "FP64", "shape": [3],
                "data": [float(r["height"] or 0) for r in rows[:3]]},
               {"name": "weight", "datatype": "FP64", "shape": [3],
                "data": [float(r["weight"]) for r in rows[:3]]},
               {"name": "color", "datatype": "BYTES", "shape": [3],
                "data": [r["color"] for r in rows[:3]]}]
    return [
        ("POST", "/predict", {"json": {"instances": rows}}),
        ("POST", "/predict", {"json": {"instances": rows[:1]}}),
        ("POST", "/predict", {"json": {"instances": [rows[0], {**rows[1], "weight": "heavy"}]}}),
        ("POST", "/predict", {"content": b"{not json"}),
        ("POST", "/predict", {"json": {"rows": rows}}),
        ("POST", "/predict", {"json": {"instances": rows * 40}}),  # over --max_body_mb: 413
        ("POST", "/predict/image", {"files": {"file": ("a.png", b"not an image")}}),
        ("POST", "/v2/models/model/infer", {"json": {"id": "r1", "inputs": tensors}}),
        ("POST", "/v2/models/model/infer", {"json": {"inputs": tensors,
                                                     "outputs": [{"name": "label"}]}}),
        ("POST", "/v2/models/model/infer", {"json": {"inputs": tensors[:2]}}),
        ("POST", "/v2/models/other/infer", {"json": {"inputs": tensors}}),
        ("GET", "/v2/models/model", {}),
        ("GET", "/v2/models/model/ready", {}),
        ("GET", "/v2/health/live", {}),
        ("GET", "/v2", {}),
        ("POST", "/v2/repository/index", {}),
        ("GET", "/no/such/path", {}),
        # one request's bad value: an overflowing number, an integer of more digits than Python
        # converts, a lone surrogate, a V2 value its datatype cannot hold
        ("POST", "/predict", {"json": {"instances": [{**rows[0], "height": 3e38}]}}),
        ("POST", "/predict", {"content": b'{"instances": [{"height": ' + b"9" * 4400 + b"}]}"}),
        ("POST", "/predict", {"content": b'{"instances": [{"color": "\\ud800"}]}'}),
        ("POST", "/v2/models/model/infer", {"json": {"inputs": [
            dict(tensors[0], datatype="UINT8", data=[-5, 1, 2]), *tensors[1:]]}}),
    ]


def answer(client: httpx.Client, url: str, method: str, path: str, args: dict) -> tuple:
    response = client.request(method, url + path, **args)
    return response.status_code, response.json()


def test_ray_serve_answers_as_the_local_server_and_stops_clean(tabular_bundle, tmp_path):
    model = tabular_bundle["model"]
    local, local_url = start_server(model, tmp_path / "local.log")
    started = time.time()
    ray, ray_url = start_server(model, tmp_path / "ray.log", "--engine", "ray",
                                "--num_replicas", "2", "--num_threads", "1")
    seen: dict[int, str] = {}
    try:
        wait_until(lambda: answers_ready(local_url), local, tmp_path / "local.log", 60)
        # every replica up: the driver logs its line once Serve reports the application running
        ray_log = tmp_path / "ray.log"
        wait_until(lambda: seen.update(descendants(ray.pid)) or
                   "with Ray Serve" in ray_log.read_text(), ray, ray_log, STARTUP_S)
        assert answers_ready(ray_url)
        startup = time.time() - started
        seen.update(descendants(ray.pid))
        assert any("ServeReplica" in command for command in seen.values()), seen

        rows = [{k: v for k, v in row.items() if k != "kind"}
                for row in feature_rows(per_class=4, seed=11)]
        with httpx.Client(timeout=30) as client:
            for method, path, args in requests_to_compare(rows) * 3:  # either replica answers
                expected = answer(client, local_url, method, path, args)
                assert answer(client, ray_url, method, path, args) == expected, (method, path)
            statuses = [answer(client, local_url, *r)[0] for r in requests_to_compare(rows)]
            assert statuses == [200, 200, 422, 400, 422, 413, 422, 200, 200, 400, 404, 200,
                                200, 200, 200, 200, 404, 422, 400, 400, 400]
            # a reload reaches one replica only: refused on Ray, with the reason
            status, body = answer(client, ray_url, "POST", "/v2/repository/models/model/load",
                                  {})
            assert status == 501 and "--engine ray" in body["error"], body
            assert answer(client, local_url, "POST", "/v2/repository/models/model/load",
                          {})[0] == 200
    finally:
        for proc in (local, ray):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        stopping = time.time()
        codes = [proc.wait(timeout=STOP_S + 30) for proc in (local, ray)]
        stop = time.time() - stopping
    log = (tmp_path / "ray.log").read_text()
    assert codes == [0, 0], (codes, log[-3000:])
    assert stop < STOP_S, stop
    assert "Traceback" not in log and "(raylet)" not in log, log[-3000:]
    assert log.strip().splitlines()[-1].endswith("stopped: Ray Serve drained its replicas")
    left = still_running(seen)
    grace = time.time() + 10  # a worker Ray forked in the last instant, before its raylet died
    while left and time.time() < grace:
        time.sleep(0.2)
        left = still_running(left)
    assert not left, left
    print(f"ray serve: ready in {startup:.1f} s, stopped in {stop:.1f} s")
