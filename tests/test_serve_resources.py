"""serve.py's resources and lifecycle, from the outside (issue #61, round 4): a request cannot
hold the model, the memory or the connections for as long as it likes; flags that would make
every request fail are refused; SIGHUP while the server starts does not end it; a shutdown that
cuts requests short answers them 503 and says so.

Real servers in subprocesses on 127.0.0.1, real sockets; small numbers and bounded waits. One
server per limit configuration, started once for the module (the tabular bundle of conftest:
the cheapest to encode); helpers are test_serve.py's.
"""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from conftest import REPO, assert_clean_failure, run_cli
from test_serve import (GOOD, HOST, NAME, SERVER_ENV, START_TIMEOUT_S, STOP_TIMEOUT_S, TIMEOUT,
                        Server, assert_error, free_port, serving, start_server, v2_request)

ROWS_LIMIT = 50  # --max_request_rows of the limits server
SLOW_ROWS = 1500  # rows of a request that takes many batches of one row


# ----------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def rows_server(tabular_bundle, tmp_path_factory) -> Iterator[Server]:
    """Requests of at most 50 rows, bodies of 150 KB, 250 KB of large bodies held at once."""
    with serving(tabular_bundle["model"], "--max_request_rows", ROWS_LIMIT,
                 "--max_body_mb", 0.15, "--max_inflight_mb", 0.25,
                 logs=tmp_path_factory.mktemp("serve_rows")) as server:
        yield server


@pytest.fixture(scope="module")
def one_row_batches(tabular_bundle, tmp_path_factory) -> Iterator[Server]:
    """Batches of one row, run at once: a request of SLOW_ROWS rows takes SLOW_ROWS model
    runs, long enough for other requests to arrive while it is under way. Two requests wait at
    most, and 1,600 rows."""
    with serving(tabular_bundle["model"], "--max_batch_size", 1, "--max_queue_delay_ms", 0,
                 "--max_queue", 2, "--max_request_rows", SLOW_ROWS + 100, "--timeout_ms", 120000,
                 logs=tmp_path_factory.mktemp("serve_one_row")) as server:
        yield server


@pytest.fixture(scope="module")
def guarded_server(tabular_bundle, tmp_path_factory) -> Iterator[Server]:
    """Headers and bodies within 2 s, at most 6 connections."""
    with serving(tabular_bundle["model"], "--read_timeout_s", 2, "--max_connections", 6,
                 logs=tmp_path_factory.mktemp("serve_guarded")) as server:
        yield server


def metric(server: Server, name: str) -> float:
    return server.metrics().get((name, ()), 0.0)


def wait_until(condition, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def raw_connection(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def read_answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by the socket's
    timeout)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def status_and_detail(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["detail"]


# ----------------------------------------------------------------------------- D: rows and bytes


def test_more_rows_than_max_request_rows_is_413(rows_server):
    """A request of more rows than --max_request_rows: 413 naming the flag, /predict and /v2
    alike; a request of exactly that many is answered."""
    rows = [dict(GOOD, weight=str(k)) for k in range(ROWS_LIMIT + 1)]
    assert_error(rows_server.post("/predict", {"instances": rows}), 413,
                 f"{ROWS_LIMIT + 1} rows", f"--max_request_rows {ROWS_LIMIT}")
    request = v2_request(rows_server.metadata(), rows + rows)
    assert_error(rows_server.post(f"/v2/models/{NAME}/infer", request), 413,
                 "--max_request_rows", key="error")
    assert len(rows_server.predict(rows[:ROWS_LIMIT])) == ROWS_LIMIT


def test_a_row_of_far_more_keys_than_columns_is_422(rows_server):
    """A row with 300 keys for a model of 3 columns: 422 naming the row, before any table is
    made of it; a row with a few keys beside the columns (an id, a label) is fine."""
    wide = dict(GOOD, **{f"extra{k}": k for k in range(297)})
    assert_error(rows_server.post("/predict", {"instances": [GOOD, wide]}), 422,
                 "row 2 has 300 keys", "the model reads 3")
    kept = dict(GOOD, id="r-17", label="a", note="from the nightly export")
    assert len(rows_server.predict([kept])) == 1


def test_large_bodies_in_flight_are_bounded(rows_server):
    """A large body held half-sent keeps its bytes counted: another large body that would pass
    --max_inflight_mb is 429 with Retry-After, a small one is answered; once the first is gone,
    the large one is taken again."""
    large = {"instances": [dict(GOOD, note="x" * 2600) for _ in range(ROWS_LIMIT)]}
    body = json.dumps(large).encode()
    assert 125_000 < len(body) < 150_000  # one fits --max_inflight_mb 0.25, two do not
    held = raw_connection(rows_server)
    try:
        held.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:70_000])
        time.sleep(0.5)  # the server reads the headers and what was sent
        refused = rows_server.post("/predict", body)
        assert_error(refused, 429, "--max_inflight_mb")
        assert refused.headers["retry-after"] == "1"
        assert len(rows_server.predict([GOOD])) == 1
    finally:
        held.close()
    wait_until(lambda: rows_server.post("/predict", body).status_code == 200,
               "the half-sent body's bytes were never released", seconds=30)


def test_a_lone_request_is_answered_between_a_large_requests_batches(one_row_batches):
    """While a request of 1,500 rows is being run (one row a batch), a one-row request is
    answered next, not after all of them; the large one is then answered whole."""
    server = one_row_batches
    rows = [dict(GOOD, weight=str(k % 7)) for k in range(SLOW_ROWS)]

    async def large_then_lone() -> tuple[httpx.Response, httpx.Response, bool]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            started = metric(server, "ttc_batch_rows_count")
            large = asyncio.create_task(client.post("/predict", json={"instances": rows}))
            while metric(server, "ttc_batch_rows_count") < started + 5:  # under way
                assert not large.done(), large.result().text
                await asyncio.sleep(0.01)
            lone = await client.post("/predict", json={"instances": [GOOD]})
            still_running = not large.done()
            return await large, lone, still_running

    large, lone, still_running = asyncio.run(large_then_lone())
    assert lone.status_code == 200, lone.text
    assert still_running, "the one-row request waited for every row of the large one"
    assert large.status_code == 200, large.text
    assert len(large.json()["predictions"]) == SLOW_ROWS


def test_rows_waiting_in_all_are_bounded(one_row_batches):
    """Two requests may wait, and 1,600 rows: while 1,500 rows wait, a request of 200 more is
    429 saying so (not queued behind them), and one of 10 rows is answered."""
    server = one_row_batches
    rows = [dict(GOOD, weight=str(k % 7)) for k in range(SLOW_ROWS)]

    async def while_large_waits() -> tuple[httpx.Response, ...]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            large = asyncio.create_task(client.post("/predict", json={"instances": rows}))
            while metric(server, "ttc_queue_depth") < 1:
                assert not large.done(), large.result().text
                await asyncio.sleep(0.01)
            more = await client.post("/predict", json={"instances": rows[:200]})
            few = await client.post("/predict", json={"instances": rows[:10]})
            return more, few, await large

    more, few, large = asyncio.run(while_large_waits())
    assert_error(more, 429, "rows may wait for the model")
    assert few.status_code == 200 and large.status_code == 200, (few.text, large.text)


# ----------------------------------------------------------------------------- F: slow clients


def test_headers_sent_too_slowly_are_408_and_the_connection_closed(guarded_server):
    """Three connections that send half a request line and headers, then nothing: each gets a
    408 within --read_timeout_s (2 s here) and is closed; other clients are served."""
    slow = [raw_connection(guarded_server) for _ in range(3)]
    try:
        for sock in slow:
            sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-")
        assert len(guarded_server.predict([GOOD])) == 1
        for sock in slow:
            status, detail = status_and_detail(read_answer(sock))
            assert status == 408 and "--read_timeout_s 2" in detail, detail
    finally:
        for sock in slow:
            sock.close()


def test_a_body_sent_too_slowly_is_408(guarded_server):
    """Headers promising 1,000 bytes, then 20 of them: 408 with a one-line reason within
    --read_timeout_s, and the connection closed."""
    sock = raw_connection(guarded_server)
    with sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"instances": [{"he')
        status, detail = status_and_detail(read_answer(sock))
    assert status == 408 and "did not arrive within --read_timeout_s 2" in detail, detail
    assert len(guarded_server.predict([GOOD])) == 1


def test_a_body_sent_in_parts_within_the_timeout_is_answered(guarded_server):
    """A body whose second half comes 0.3 s after its first (the read timer's path), then a
    whole request on the same keep-alive connection (the body already in when it is read):
    both answered 200, with one prediction each."""
    body = json.dumps({"instances": [GOOD]}).encode()
    head = (f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with raw_connection(guarded_server) as sock:
        sock.sendall(head + body[:10])
        time.sleep(0.3)
        sock.sendall(body[10:])
        first = read_response(sock)
        sock.sendall(head + body)
        second = read_response(sock)
    for status, answer in (first, second):
        assert status == 200 and len(answer["predictions"]) == 1, (status, answer)


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """One keep-alive answer: its status and JSON body (read by its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body)


def test_connections_past_max_connections_are_503(guarded_server):
    """--max_connections 6: of 8 connections opened at once and left idle, those past the
    cap are answered 503 at once and closed; once the idle ones are gone, clients are served."""
    idle = [raw_connection(guarded_server) for _ in range(8)]
    try:
        refused = []
        for sock in idle:
            sock.settimeout(0.5)
            try:
                answer = sock.recv(65536)
            except TimeoutError:
                continue
            if answer:
                refused.append(status_and_detail(answer))
        assert refused, "every connection past the cap was kept"
        assert all(status == 503 and "holds 6 connections" in detail
                   and "--max_connections" in detail
                   for status, detail in refused), refused
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: _served(guarded_server), "no client was served after the idle ones left")


def _served(server: Server) -> bool:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        try:
            return client.post("/predict", json={"instances": [GOOD]}).status_code == 200
        except httpx.TransportError:
            return False


# ----------------------------------------------------------------------------- G: the drain


def test_a_drain_past_drain_s_answers_503_and_says_so(tabular_bundle, tmp_path):
    """SIGTERM with --drain_s 1 while a request of 4,000 rows runs one row a batch: the request
    is answered 503 (not left without an answer), the process exits 0, and its last line counts
    the request cut short instead of claiming every one was answered."""
    server = start_server(tabular_bundle["model"], "--max_batch_size", 1,
                          "--max_queue_delay_ms", 0, "--timeout_ms", 120000, "--drain_s", 1,
                          logs=tmp_path)
    rows = [dict(GOOD, weight=str(k % 7)) for k in range(4000)]

    async def request_then_sigterm() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            started = metric(server, "ttc_batch_rows_count")
            sent = asyncio.create_task(client.post("/predict", json={"instances": rows}))
            while metric(server, "ttc_batch_rows_count") < started + 5:
                assert not sent.done(), sent.result().text
                await asyncio.sleep(0.01)
            server.process.send_signal(signal.SIGTERM)
            return await sent

    try:
        response = asyncio.run(request_then_sigterm())
        code = server.process.wait(STOP_TIMEOUT_S)
    finally:
        server.stop()
    assert_error(response, 503, "shutting down", "--drain_s")
    assert code == 0, server.log_text()[-3000:]
    log = server.log_text()
    assert "Traceback" not in log, log[-3000:]
    assert "every accepted request was answered" not in log
    assert "were still running after --drain_s 1 and were answered 503" in log, log[-3000:]


# ----------------------------------------------------------------------------- N: flags


@pytest.mark.parametrize("flags, phrase", [
    (["--max_body_mb", "inf"], "--max_body_mb inf"),
    (["--max_body_mb", "nan"], "--max_body_mb nan"),
    (["--timeout_ms", "inf"], "--timeout_ms inf"),
    (["--read_timeout_s", "0"], "--read_timeout_s 0"),
    (["--max_inflight_mb", "-1"], "--max_inflight_mb -1"),
    (["--max_request_rows", "0"], "--max_request_rows 0"),
    (["--max_connections", "0"], "--max_connections 0"),
    (["--max_queue_delay_ms", "500", "--timeout_ms", "400"], "longer than its deadline"),
    (["--max_queue_delay_ms", "250", "--timeout_ms", "250"], "longer than its deadline"),
], ids=["body-inf", "body-nan", "timeout-inf", "read-timeout-0", "inflight-negative",
        "rows-0", "connections-0", "delay-over-timeout", "delay-equal-timeout"])
def test_flags_that_would_fail_every_request_are_exit_2(flags, phrase, tmp_path):
    run = run_cli("serve.py", "--model", tmp_path / "model.onnx", "--port", "0", *flags)
    assert_clean_failure(run, 2, phrase)


# ----------------------------------------------------------------------------- P: SIGHUP


def test_sighup_while_starting_is_held_and_reloads_once_up(tabular_bundle, tmp_path):
    """SIGHUP sent while serve.py loads the bundle (after it logged its configuration, before it
    listens) neither ends it (exit 129 before) nor is lost: the server comes up, reloads once,
    and exits 0 on SIGTERM."""
    port, log = free_port(), tmp_path / "serve.stderr"
    with open(log, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "serve.py", "--model", str(tabular_bundle["model"]), "--host", HOST,
             "--port", str(port), "--log_level", "INFO"], cwd=REPO, env=SERVER_ENV,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
    server = Server(process, f"http://{HOST}:{port}", log)
    try:
        wait_until(lambda: "configuration" in server.log_text() or process.poll() is not None,
                   "serve.py logged no configuration", seconds=START_TIMEOUT_S)
        process.send_signal(signal.SIGHUP)
        assert server.wait_ready(), f"exit {process.returncode}: {server.log_text()[-2000:]}"
        loaded = ("ttc_reloads_total", (("outcome", "loaded"),))
        wait_until(lambda: server.metrics().get(loaded, 0) == 1, "the held SIGHUP did not reload")
        assert len(server.predict([GOOD])) == 1
    finally:
        code = server.stop()
    assert code == 0, server.log_text()[-3000:]
    assert "Traceback" not in server.log_text()
