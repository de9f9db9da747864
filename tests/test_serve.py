"""serve.py, the HTTP model server, from the outside: real servers in subprocesses, real HTTP on
127.0.0.1, no mocks. Predictions equal the batch path's (`inference.py --input rows.jsonl`) and
the Python API's, whether rows come alone, together or from concurrent requests joined into
batches; every bad request is a 4xx with a one-line reason that touches no other request; the
limits (queue, deadline, body size) answer 429, 504 and 413; a reload swaps the bundle without
failing a request (and a failed one keeps the old model serving); SIGTERM answers what was
accepted and exits 0; /metrics counts what happened; a bad bundle or a port in use is refused
before serving.

One server per bundle and configuration, started once per module (per xdist worker) and shared
by the tests; each is stopped with SIGTERM at teardown, where it must exit 0, without a
traceback in its log and without having answered a 500.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import csv
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import (CLI_ENV, REPO, assert_clean_failure, copy_bundle, digits_images,
                      feature_rows, run_cli, topic_texts)

HOST = "127.0.0.1"
TOP_K = 3  # every bundle here has 3 classes or more
TIMEOUT = httpx.Timeout(60.0)  # one request's limit: liveness, not speed
START_TIMEOUT_S = 90  # load + warm-up of a bundle, on a busy machine
STOP_TIMEOUT_S = 30
TOLERANCE = 1e-6 + 1e-12  # both sides round probabilities to 6 decimals
SERVER_ENV = dict(os.environ, **CLI_ENV)  # OMP_NUM_THREADS=1, unbuffered
NAME = "model"  # the /v2 name of a bundle's model.onnx


# ----------------------------------------------------------------------------- a server process


@dataclass
class Server:
    """A serve.py subprocess: its URL, a client, and its stderr log."""

    process: subprocess.Popen
    url: str
    log: Path
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.url, timeout=TIMEOUT)

    def get(self, path: str) -> httpx.Response:
        return checked(self.http.get(path))

    def post(self, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        """POST `body` as JSON (bytes as they are), or what kwargs say (files=...)."""
        return checked(self.http.post(path, **body_of(body), **kwargs))

    def predict(self, rows: list) -> list[dict]:
        """/predict's answer to rows, which must be 200."""
        response = self.post("/predict", {"instances": rows})
        assert response.status_code == 200, response.text
        return response.json()["predictions"]

    def metadata(self) -> dict:
        return self.get(f"/v2/models/{NAME}").json()

    def version(self) -> str:
        return self.metadata()["versions"][0]

    def metrics(self) -> dict[tuple, float]:
        """GET /metrics, parsed by prometheus_client: {(sample, ((label, value), ...)): value}."""
        text = self.get("/metrics").text
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples}

    def wait_ready(self) -> bool:
        """Poll /v2/health/ready until 200 (True), the process exits or time runs out (False)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.process.poll() is None:
            with contextlib.suppress(httpx.TransportError):
                if self.http.get("/v2/health/ready", timeout=5).status_code == 200:
                    return True
            time.sleep(0.05)
        self.stop()
        return False

    def stop(self) -> int:
        """SIGTERM (a kill if it does not end in time); its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT_S)
        self.http.close()
        return self.process.returncode

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def start_server(model: Path, *flags: object, logs: Path, cwd: Path = REPO) -> Server:
    """serve.py (the one in `cwd`: this repository, or a copy of it) on a free port, once
    /v2/health/ready answers 200."""
    for _ in range(3):  # another process may take the port between choosing and binding it
        port = free_port()
        log = logs / f"serve-{port}.stderr"
        with open(log, "wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, "serve.py", "--model", str(model), "--host", HOST,
                 "--port", str(port), "--log_level", "WARNING", *map(str, flags)],
                cwd=cwd, env=SERVER_ENV, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=stderr)
        server = Server(process, f"http://{HOST}:{port}", log)
        if server.wait_ready():
            return server
        if process.returncode != 5:  # 5: the port was in use
            break
    pytest.fail(f"serve.py did not become ready (exit {process.returncode}):\n"
                f"{log.read_text(errors='replace')[-3000:]}")


@contextlib.contextmanager
def serving(model: Path, *flags: object, logs: Path, cwd: Path = REPO) -> Iterator[Server]:
    """A server for the with block; on leaving it, the server must not have answered a 500,
    must exit 0 on SIGTERM and must have logged no traceback."""
    server = start_server(model, *flags, logs=logs, cwd=cwd)
    try:
        yield server
        errors = {key: n for key, n in server.metrics().items()
                  if key[0] == "ttc_requests_total" and ("status", "500") in key[1] and n}
    finally:
        code = server.stop()
    assert errors == {}, f"requests answered 500: {errors}\n{server.log_text()[-3000:]}"
    assert code == 0, server.log_text()[-3000:]
    assert "Traceback" not in server.log_text(), server.log_text()[-3000:]


def checked(response: httpx.Response) -> httpx.Response:
    """Any response: never a 500."""
    assert response.status_code != 500, (response.request.url, response.text)
    return response


def body_of(body: Any) -> dict:
    """httpx's arguments for a body: bytes as they are (a generator's chunked, without a
    Content-Length), anything else as JSON."""
    if body is None:
        return {}
    streamed = isinstance(body, (bytes, types.GeneratorType))
    return {"content": body} if streamed else {"json": body}


def post_concurrently(server: Server, requests: list[tuple[str, Any]]) -> list[httpx.Response]:
    """Every (path, body) POSTed at once, each on a connection of its own; the responses in
    order."""
    async def send_all() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=len(requests))
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT,
                                     limits=limits) as client:
            return await asyncio.gather(*(client.post(path, **body_of(body))
                                          for path, body in requests))

    return [checked(response) for response in asyncio.run(send_all())]


def assert_error(response: httpx.Response, status: int, *phrases: str,
                 key: str = "detail") -> str:
    """`status` with the body {key: one line} holding every phrase; that line."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert list(body) == [key], body
    message = body[key]
    assert isinstance(message, str) and message.strip() and "\n" not in message, body
    for phrase in phrases:
        assert phrase in message, message
    return message


def counted(samples: dict, endpoint: str, status: int) -> float:
    """ttc_requests_total{endpoint, status} in parsed /metrics."""
    return samples.get(("ttc_requests_total", (("endpoint", endpoint),
                                               ("status", str(status)))), 0.0)


# ----------------------------------------------------------------------------- predictions


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE


def same_predictions(got: dict, expected: dict) -> bool:
    """The same label and top-k classes, probabilities within rounding."""
    return (got["label"] == expected["label"] and close(got["confidence"], expected["confidence"])
            and [c for c, _ in got["top"]] == [c for c, _ in expected["top"]]
            and all(close(p, q) for (_, p), (_, q) in zip(got["top"], expected["top"])))


def assert_same_predictions(got: list[dict], expected: list[dict]) -> None:
    assert len(got) == len(expected), (len(got), len(expected))
    for number, (row, want) in enumerate(zip(got, expected), 1):
        assert same_predictions(row, want), f"row {number}: {row} != {want}"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def batch_predictions(model: Path, file_rows: list[dict], folder: Path) -> list[dict]:
    """`inference.py --model M --input rows.jsonl --output preds.jsonl --top_k K` on the rows,
    as /predict answers: [{"label", "confidence", "top": [[label, p], ...]}]."""
    rows, preds = write_jsonl(folder / "rows.jsonl", file_rows), folder / "preds.jsonl"
    run = run_cli("inference.py", "--model", model, "--input", rows, "--output", preds,
                  "--top_k", TOP_K)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in preds.read_text().splitlines()]
    assert [line["id"] for line in lines] == [str(k) for k in range(1, len(file_rows) + 1)]
    return [{"label": line["label"], "confidence": line["confidence"],
             "top": [[line["label"], line["confidence"]]]  # the top class once in the table
             + [[line[f"top{k}_label"], line[f"top{k}_probability"]]
                for k in range(2, TOP_K + 1)]} for line in lines]


def v2_request(metadata: dict, rows: list[dict]) -> dict:
    """An Open Inference Protocol request of rows: one tensor per input the metadata lists."""
    inputs = []
    for tensor in metadata["inputs"]:
        data = [row[tensor["name"]] for row in rows]
        if tensor["datatype"] == "FP64":
            data = [float(value) for value in data]
        inputs.append({"name": tensor["name"], "datatype": tensor["datatype"],
                       "shape": [len(rows)], "data": data})
    return {"id": "request-1", "inputs": inputs}


def assert_v2_answer(body: dict, expected: list[dict], classes: list[str]) -> None:
    """A V2 infer response: the expected labels, and each expected top-k probability at its
    class in `probabilities` [rows, classes]."""
    outputs = {output["name"]: output for output in body["outputs"]}
    assert outputs["label"]["data"] == [want["label"] for want in expected]
    probabilities = outputs["probabilities"]
    assert probabilities["shape"] == [len(expected), len(classes)]
    data = probabilities["data"]
    for number, want in enumerate(expected):
        row = data[number * len(classes):(number + 1) * len(classes)]
        for label, p in want["top"]:
            assert close(row[classes.index(label)], p), (number + 1, label, row, want)


# ----------------------------------------------------------------------------- the data


def tabular_rows() -> list[dict]:
    """12 rows of tabular_bundle's columns as a CSV holds them (strings), 3 of them with a
    missing height."""
    return [{k: v for k, v in row.items() if k != "kind"}
            for row in feature_rows(per_class=4, seed=3)]


def text_rows() -> list[dict]:
    """Texts of many lengths: one word, the usual 4 to 8, and two long ones."""
    texts = [text for text, _ in topic_texts(per_class=4, seed=5)]
    texts += ["rain", " ".join(texts[:5]), " ".join(texts)]
    return [{"text": text} for text in texts]


def digit_pngs() -> list[bytes]:
    """PNG files of 20 real handwritten digits, two of each."""
    pngs = []
    for _, _, image in digits_images(tuple(range(10)), per_class=2):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    return pngs


def image_row(data: bytes) -> dict:
    return {"image": base64.b64encode(data).decode("ascii")}


@dataclass
class Case:
    """A server of a bundle, rows for it, and the batch path's predictions of those rows."""

    server: Server
    model: Path
    rows: list[dict]  # as /predict takes them
    expected: list[dict]  # inference.py --input's predictions of the same rows


@pytest.fixture(scope="module")
def tabular_case(tabular_bundle, tmp_path_factory) -> Iterator[Case]:
    folder = tmp_path_factory.mktemp("serve_tabular")
    model, rows = tabular_bundle["model"], tabular_rows()
    expected = batch_predictions(model, rows, folder)
    with serving(model, "--top_k", TOP_K, logs=folder) as server:
        yield Case(server, model, rows, expected)


@pytest.fixture(scope="module")
def text_case(text_bundle, tmp_path_factory) -> Iterator[Case]:
    """Batches of at most 8 rows, held up to 500 ms for more: concurrent requests of texts of
    different lengths are joined, padded, into one batch."""
    folder = tmp_path_factory.mktemp("serve_text")
    model, rows = text_bundle["model"], text_rows()
    expected = batch_predictions(model, rows, folder)
    with serving(model, "--top_k", TOP_K, "--max_batch_size", 8, "--max_queue_delay_ms", 500,
                 logs=folder) as server:
        yield Case(server, model, rows, expected)


@pytest.fixture(scope="module")
def digits_case(digits_bundle, tmp_path_factory) -> Iterator[Case]:
    """Images: /predict sends the file's bytes base64-encoded, the batch path reads the file."""
    folder = tmp_path_factory.mktemp("serve_digits")
    (folder / "images").mkdir()
    paths = [folder / "images" / f"{number}.png" for number in range(len(digit_pngs()))]
    for path, png in zip(paths, digit_pngs()):
        path.write_bytes(png)
    model = digits_bundle["model"]
    expected = batch_predictions(model, [{"image": str(path)} for path in paths], folder)
    with serving(model, "--top_k", TOP_K, logs=folder) as server:
        yield Case(server, model, [image_row(path.read_bytes()) for path in paths], expected)


# A bundle of each input type. A test parametrized by `kind` goes to the xdist worker of
# conftest's `{kind}_bundle` (conftest.shared_setup), where that bundle is built once.
KINDS = ["tabular", "text", "digits"]


def case_of(request, kind: str) -> Case:
    return request.getfixturevalue(f"{kind}_case")


# ----------------------------------------------------------------------------- 1. the batch path


@pytest.mark.parametrize("kind", KINDS)
def test_predict_equals_the_batch_path(request, kind):
    """/predict of all rows in one request: the labels, confidences and top-k lists of
    `inference.py --input rows.jsonl` on the same rows."""
    case = case_of(request, kind)
    assert_same_predictions(case.server.predict(case.rows), case.expected)


@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_requests_equal_the_batch_path(request, kind):
    """Rows sent concurrently, alone and three at a time, so that the micro-batcher joins
    requests (and splits them): each answer is the batch path's for its rows."""
    case = case_of(request, kind)
    slices = [(k, k + 1) for k in range(len(case.rows))]
    slices += [(k, min(k + 3, len(case.rows))) for k in range(0, len(case.rows), 3)]
    responses = post_concurrently(case.server, [("/predict", {"instances": case.rows[a:b]})
                                                for a, b in slices])
    for (a, b), response in zip(slices, responses):
        assert response.status_code == 200, response.text
        assert_same_predictions(response.json()["predictions"], case.expected[a:b])


def test_texts_of_different_lengths_join_one_batch(text_case):
    """Concurrent one-row requests of texts of different lengths are run in shared batches
    (padded to the longest), and still answered as the batch path answers each."""
    server, rows = text_case.server, text_case.rows
    before = server.metrics()
    responses = post_concurrently(server, [("/predict", {"instances": [row]}) for row in rows])
    after = server.metrics()
    for response, want in zip(responses, text_case.expected):
        assert response.status_code == 200, response.text
        assert_same_predictions(response.json()["predictions"], [want])
    batches = after["ttc_batch_rows_count", ()] - before["ttc_batch_rows_count", ()]
    assert after["ttc_batch_rows_sum", ()] - before["ttc_batch_rows_sum", ()] == len(rows)
    assert 1 <= batches < len(rows)  # some batch held rows of several requests


@pytest.mark.parametrize("kind", KINDS)
def test_v2_infer_equals_the_batch_path(request, kind):
    """POST /v2/models/model/infer with one tensor per input the metadata lists (numbers as
    FP64, text and images as BYTES): the batch path's labels, and its top-k probabilities in
    `probabilities`. Rows with a missing number are left out: V2 tensors have no null."""
    case = case_of(request, kind)
    metadata = case.server.metadata()
    keep = [k for k, row in enumerate(case.rows) if all(value != "" for value in row.values())]
    assert len(keep) >= 6
    response = case.server.post(f"/v2/models/{NAME}/infer",
                                v2_request(metadata, [case.rows[k] for k in keep]))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model_name"] == NAME and body["model_version"] == metadata["versions"][0]
    assert body["id"] == "request-1"
    assert_v2_answer(body, [case.expected[k] for k in keep], metadata["parameters"]["classes"])


def test_v2_server_and_model_endpoints(tabular_case):
    """The Open Inference Protocol's server and model endpoints answer as documented."""
    server = tabular_case.server
    assert server.get("/v2").json()["extensions"] == ["model_repository"]
    assert server.get("/v2/health/live").json() == {"live": True}
    assert server.get("/v2/health/ready").json() == {"ready": True}
    assert server.get(f"/v2/models/{NAME}/ready").json() == {"ready": True}
    metadata = server.metadata()
    assert metadata["name"] == NAME and metadata["platform"] == "onnxruntime_onnx"
    assert {(t["name"], t["datatype"]) for t in metadata["inputs"]} == {
        ("height", "FP64"), ("weight", "FP64"), ("color", "BYTES")}
    assert metadata["parameters"]["classes"] == ["a", "b", "c"]
    index = server.post("/v2/repository/index").json()
    assert index == [{"name": NAME, "version": metadata["versions"][0], "state": "READY"}]


def test_a_body_is_read_as_json_whatever_its_content_type(tabular_case):
    """`curl -d` sends a form's Content-Type: the body is JSON all the same."""
    response = tabular_case.server.post(
        "/predict", json.dumps({"instances": tabular_case.rows[:2]}).encode(),
        headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200, response.text
    assert_same_predictions(response.json()["predictions"], tabular_case.expected[:2])


# ----------------------------------------------------------------------------- 2. image upload


def test_image_upload_equals_base64_predict(digits_case):
    """POST /predict/image with a PNG (multipart field `file`) answers as /predict with the same
    file's bytes in base64, and as the batch path."""
    for number in (0, 7, 13):
        png = base64.b64decode(digits_case.rows[number]["image"])
        upload = digits_case.server.post("/predict/image",
                                         files={"file": ("digit.png", png, "image/png")})
        assert upload.status_code == 200, upload.text
        assert upload.json()["predictions"] == digits_case.server.predict([image_row(png)])
        assert_same_predictions(upload.json()["predictions"], [digits_case.expected[number]])


# ----------------------------------------------------------------------------- 3. bad requests


GOOD = {"height": "0.5", "weight": "4.8", "color": "red"}
INSTANCES = '{"instances": [ROW, ...]}'

BAD_PREDICT_BODIES = [
    pytest.param(b'{"instances": [', 400, "the body is not valid JSON", id="malformed-json"),
    pytest.param(b'\xff{"instances": []}', 400, "not valid JSON", id="not-utf-8"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, 400, "not valid JSON", id="nested-too-deep"),
    pytest.param([GOOD], 422, INSTANCES, id="a-bare-list"),
    pytest.param({"rows": [GOOD]}, 422, INSTANCES, id="no-instances"),
    pytest.param({"instances": GOOD}, 422, INSTANCES, id="instances-not-a-list"),
    pytest.param({"instances": []}, 422, "no rows", id="no-rows"),
    pytest.param({"instances": [{"height": "1.0", "color": "red"}]}, 422,
                 "lacks the feature columns ['weight']", id="a-missing-column"),
    pytest.param({"instances": [GOOD, {}]}, 422, "row 2 is empty", id="an-empty-row"),
    pytest.param({"instances": [GOOD, {"height": "", "weight": "", "color": ""}]}, 422,
                 "row 2 is empty", id="a-blank-row"),
    pytest.param({"instances": [GOOD, 7]}, 422, "row 2 is a JSON int", id="a-row-not-an-object"),
    pytest.param({"instances": [GOOD, dict(GOOD, weight="1e999")]}, 422,
                 "row 2: value inf in column 'weight' is out of range", id="an-infinite-number"),
    pytest.param({"instances": [dict(GOOD, weight=[1, 2])]}, 422, "nested values",
                 id="a-nested-cell"),
]


@pytest.mark.parametrize("body, status, phrase", BAD_PREDICT_BODIES)
def test_bad_predict_request(tabular_case, body, status, phrase):
    """Each class of bad /predict request: its status and a one-line {"detail"} saying why."""
    assert_error(tabular_case.server.post("/predict", body), status, phrase)


def test_a_non_numeric_feature_is_422_with_the_batch_paths_reason(tabular_case, tmp_path):
    """A non-number in a numeric column: 422 naming the row, with the reason
    `inference.py --errors` writes for the same row of a JSONL file."""
    rows = [tabular_case.rows[1], dict(tabular_case.rows[2], weight="heavy")]
    errors = tmp_path / "errors.csv"
    run = run_cli("inference.py", "--model", tabular_case.model, "--input",
                  write_jsonl(tmp_path / "rows.jsonl", rows), "--output", tmp_path / "p.jsonl",
                  "--errors", errors, "--allow_errors", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    with open(errors, newline="", encoding="utf-8") as handle:
        reasons = {row["id"]: row["reason"] for row in csv.DictReader(handle)}
    assert reasons == {"2": "non-numeric value 'heavy' in column 'weight'"}
    message = assert_error(tabular_case.server.post("/predict", {"instances": rows}), 422)
    assert message.startswith(f"row 2: {reasons['2']};"), message


@pytest.mark.parametrize("cell, phrase", [
    (base64.b64encode(b"these bytes are no image").decode(), "row 2: unreadable image"),
    ("*** not base64 ***", "row 2: the image is not base64"),
    ("", "row 2 is empty"),
], ids=["undecodable", "not-base64", "empty"])
def test_a_bad_image_row_is_422_naming_the_row(digits_case, cell, phrase):
    """An image row that cannot be read: 422 naming the row (the first row was fine)."""
    rows = [digits_case.rows[0], {"image": cell}]
    assert_error(digits_case.server.post("/predict", {"instances": rows}), 422, phrase)


def test_an_undecodable_upload_is_422(digits_case):
    upload = digits_case.server.post("/predict/image",
                                     files={"file": ("x.png", b"GIF89a? no", "image/png")})
    assert_error(upload, 422, "row 1: unreadable image")
    assert_error(digits_case.server.post("/predict/image"), 422, "file")


@pytest.mark.parametrize("method, path", [
    ("GET", "/v2/models/nope"), ("GET", "/v2/models/nope/ready"),
    ("POST", "/v2/models/nope/infer"), ("POST", "/v2/repository/models/nope/load")])
def test_an_unknown_model_name_is_404(tabular_case, method, path):
    response = checked(tabular_case.server.http.request(method, path, json={"inputs": []}))
    assert_error(response, 404, "unknown model 'nope'", f"'{NAME}'", key="error")


def test_bad_v2_requests_are_400(tabular_case):
    """V2 requests that break the protocol: 400 with a one-line {"error"}."""
    server, path = tabular_case.server, f"/v2/models/{NAME}/infer"
    good = v2_request(server.metadata(), [dict(GOOD)])
    missing = dict(good, inputs=[t for t in good["inputs"] if t["name"] != "weight"])
    assert_error(server.post(path, missing), 400, "lacks the input tensors ['weight']",
                 key="error")
    assert_error(server.post(path, b"{nope"), 400, "not valid JSON", key="error")
    assert_error(server.post(path, {"instances": [GOOD]}), 400, '"inputs"', key="error")
    shape = dict(good, inputs=[dict(t, shape=[2]) for t in good["inputs"]])
    assert_error(server.post(path, shape), 400, "1 values for shape [2]", key="error")
    text = dict(good, inputs=[dict(t, data=["x"]) if t["name"] == "height" else t
                              for t in good["inputs"]])
    assert_error(server.post(path, text), 400, "FP64 data must be numbers", key="error")
    nested = json.loads("[" * 500 + '"red"' + "]" * 500)
    deep = dict(good, inputs=[dict(t, data=nested) if t["name"] == "color" else t
                              for t in good["inputs"]])
    assert_error(server.post(path, deep), 400, "BYTES data must be strings", key="error")
    outputs = dict(good, outputs=[{"name": "logits"}])
    assert_error(server.post(path, outputs), 400, "unknown outputs", key="error")
    assert server.post(path, good).status_code == 200  # the server is unharmed


def test_a_bad_request_in_a_burst_leaves_the_others_alone(tabular_case):
    """Good and bad requests sent at once: every good one gets its right 200 answer, every bad
    one its own 4xx."""
    rows, expected = tabular_case.rows, tabular_case.expected
    bad = [(b'{"instances": [', 400), ({"instances": [GOOD, dict(GOOD, height="tall")]}, 422),
           ({"instances": [GOOD, {}]}, 422), ({"instances": [{"color": "red"}]}, 422)]
    requests, wanted = [], []
    for k in range(8):
        requests.append(("/predict", {"instances": rows[k:k + 2]}))
        wanted.append((200, expected[k:k + 2]))
        if k < len(bad):
            requests.append(("/predict", bad[k][0]))
            wanted.append((bad[k][1], None))
    for response, (status, want) in zip(post_concurrently(tabular_case.server, requests),
                                        wanted):
        if want is None:
            assert_error(response, status)
        else:
            assert response.status_code == 200, response.text
            assert_same_predictions(response.json()["predictions"], want)


# Written out by raw_json as 4,400 digits (Python's int(str), which json uses, takes 4,300)
HUGE_INTEGER = "<an integer of 4,400 digits>"


def raw_json(body: Any) -> bytes:
    """A body as JSON text with every non-ASCII character escaped: how a client spells a lone
    surrogate (\\udc80), which no UTF-8 encoder (httpx's json=) takes; HUGE_INTEGER written
    out."""
    return json.dumps(body).encode("ascii").replace(json.dumps(HUGE_INTEGER).encode(),
                                                    b"7" * 4400)


def v2_with(server: Server, changes: dict[str, dict], rows: list[dict] | None = None) -> dict:
    """A V2 request of GOOD (or `rows`) whose tensors take `changes` by name."""
    request = v2_request(server.metadata(), rows or [dict(GOOD)])
    request["inputs"] = [dict(t, **changes.get(t["name"], {})) for t in request["inputs"]]
    return request


def test_a_number_the_network_would_overflow_on_is_an_error_row_and_422(tabular_case, tmp_path):
    """A finite number far outside what the model was trained on (its standardisation in the
    graph would overflow float32: NaN probabilities): an error row in the batch path (exit 3,
    no NaN written), 422 with the same reason on /predict and V2, never a 500."""
    rows = [tabular_case.rows[1], dict(tabular_case.rows[2], weight="-2.5e36")]
    preds, errors = tmp_path / "p.jsonl", tmp_path / "errors.csv"
    run = run_cli("inference.py", "--model", tabular_case.model, "--input",
                  write_jsonl(tmp_path / "rows.jsonl", rows), "--output", preds,
                  "--errors", errors)
    assert_clean_failure(run, 3, "1 of 2 rows could not be predicted")
    with open(errors, newline="", encoding="utf-8") as handle:
        reasons = {row["id"]: row["reason"] for row in csv.DictReader(handle)}
    assert list(reasons) == ["2"]
    assert reasons["2"].startswith("value -2.5e+36 in column 'weight' is out of range ("), reasons
    assert "nan" not in preds.read_text().lower() and len(preds.read_text().splitlines()) == 1
    message = assert_error(tabular_case.server.post("/predict", {"instances": rows}), 422)
    assert message.startswith(f"row 2: {reasons['2']};"), message
    v2 = v2_with(tabular_case.server, {"height": {"data": [7e37]}})
    assert_error(tabular_case.server.post(f"/v2/models/{NAME}/infer", v2), 422,
                 "row 1: value 7e+37 in column 'height' is out of range", key="error")


@pytest.mark.parametrize("path, body, phrase", [
    ("/predict", {"instances": [dict(GOOD, height=HUGE_INTEGER)]}, "integer of more than 4,300 digits"),
    ("/predict", {"instances": [dict(GOOD, color="blue\udc80")]}, "lone surrogate"),
    ("/predict", {"instances": [{**GOOD, "\ud83d": "1"}]}, "lone surrogate"),
    ("v2", {"color": {"data": ["\udbff red"]}}, "lone surrogate"),
    ("v2", {"weight": {"data": [HUGE_INTEGER]}}, "integer of more than 4,300 digits"),
], ids=["huge-integer", "surrogate-value", "surrogate-key", "v2-surrogate-bytes",
        "v2-huge-integer"])
def test_a_body_no_parser_reads_whole_is_400(tabular_case, path, body, phrase):
    """Numbers with more digits than Python converts and lone UTF-16 surrogates (valid JSON
    escapes, but no text): 400 with one line, at the body, before any row is encoded."""
    server = tabular_case.server
    if path == "v2":
        path, body, key = f"/v2/models/{NAME}/infer", v2_with(server, body), "error"
    else:
        key = "detail"
    assert_error(server.post(path, raw_json(body)), 400, phrase, key=key)


@pytest.mark.parametrize("changes, phrase", [
    ({"height": {"datatype": "INT16", "data": [40000]}}, "40000 is outside INT16's range"),
    ({"weight": {"datatype": "UINT32", "data": [-1]}}, "-1 is outside UINT32's range"),
    ({"height": {"datatype": "INT8", "data": [1.5]}}, "INT8 data must be integers"),
    ({"height": {"datatype": "FP16", "data": [70000.0]}}, "outside FP16's range"),
    ({"weight": {"datatype": "FP64", "data": [10 ** 400]}}, "outside FP64's range"),
    ({"weight": {"datatype": "BYTES", "data": ["4.8"]}}, "'weight' takes numbers"),
    ({"height": {"datatype": "BOOL", "data": [True]}}, "not BOOL"),
    ({"height": {"data": [False]}}, "FP64 data must be numbers"),
    ({"color": {"datatype": "INT32", "data": [3]}}, "'color' takes BYTES"),
], ids=["int16-over", "uint32-negative", "int8-fraction", "fp16-over", "fp64-over",
        "bytes-for-fp64", "bool-for-fp64", "bool-in-fp64", "int-for-bytes"])
def test_v2_tensors_must_hold_what_their_datatype_and_input_take(tabular_case, changes, phrase):
    """A V2 tensor whose datatype the input does not take (its metadata's) or whose values its
    datatype cannot hold: 400 naming the input; the same numbers in a datatype that holds them
    are predicted."""
    server, path = tabular_case.server, f"/v2/models/{NAME}/infer"
    assert_error(server.post(path, v2_with(server, changes)), 400, phrase, key="error")
    fits = v2_with(server, {"height": {"datatype": "INT16", "data": [1]},
                            "weight": {"datatype": "UINT8", "data": [5]}})
    assert server.post(path, fits).status_code == 200


def test_bad_rows_of_every_kind_stay_with_their_request(tabular_case):
    """Requests sent at once, each bad in another way (an overflowing number, a huge integer,
    a lone surrogate in a value, a key or a V2 BYTES tensor, a UINT8 tensor out of range),
    between good ones: each bad one its own 4xx, every good one its right 200."""
    server, rows, expected = tabular_case.server, tabular_case.rows, tabular_case.expected
    infer = f"/v2/models/{NAME}/infer"
    bad = [("/predict", {"instances": [GOOD, dict(GOOD, height=-3.1e38)]}, 422),
           ("/predict", raw_json({"instances": [dict(GOOD, weight=HUGE_INTEGER)]}), 400),
           ("/predict", raw_json({"instances": [GOOD, dict(GOOD, color="\ud800 red")]}), 400),
           ("/predict", raw_json({"instances": [{**GOOD, "\udfff": 1}]}), 400),
           (infer, raw_json(v2_with(server, {"color": {"data": ["\ud800"]}})), 400),
           (infer, v2_with(server, {"weight": {"datatype": "UINT8", "data": [-300]}}), 400)]
    requests, wanted = [], []
    for k, (path, body, status) in enumerate(bad):
        requests += [("/predict", {"instances": rows[k:k + 2]}), (path, body)]
        wanted += [(200, expected[k:k + 2]), (status, path)]
    for response, (status, want) in zip(post_concurrently(server, requests), wanted):
        if status == 200:
            assert response.status_code == 200, response.text
            assert_same_predictions(response.json()["predictions"], want)
        else:
            assert_error(response, status, key="error" if want.startswith("/v2") else "detail")


# ----------------------------------------------------------------------------- 3-4. the limits


@pytest.fixture(scope="module")
def limits_server(tabular_bundle, tmp_path_factory) -> Iterator[Server]:
    """One request may wait for the model (held 1.5 s for others to join it); bodies of 1 kB."""
    with serving(tabular_bundle["model"], "--top_k", TOP_K, "--max_queue", 1,
                 "--max_queue_delay_ms", 1500, "--max_body_mb", 0.001,
                 logs=tmp_path_factory.mktemp("serve_limits")) as server:
        yield server


@pytest.fixture(scope="module")
def deadline_server(tabular_bundle, tmp_path_factory) -> Iterator[Server]:
    """Batches of one row, and a deadline of 200 ms: a request of 2,000 rows (2,000 model runs,
    each encoding its row) is not answered in time."""
    with serving(tabular_bundle["model"], "--max_batch_size", 1, "--max_queue_delay_ms", 0,
                 "--timeout_ms", 200, logs=tmp_path_factory.mktemp("serve_deadline")) as server:
        yield server


def test_a_full_queue_is_429_with_retry_after(limits_server, tabular_case):
    """A burst while one request waits in a queue of one: the others are refused with 429 and a
    Retry-After header; the accepted ones are answered right."""
    rows, expected = tabular_case.rows[:8], tabular_case.expected[:8]
    responses = post_concurrently(limits_server, [("/predict", {"instances": [row]})
                                                  for row in rows])
    statuses = [response.status_code for response in responses]
    assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses, statuses
    for response, want in zip(responses, expected):
        if response.status_code == 429:
            assert_error(response, 429, "--max_queue")
            assert int(response.headers["retry-after"]) >= 1
        else:
            assert_same_predictions(response.json()["predictions"], [want])


def test_a_body_over_max_body_mb_is_413(limits_server):
    """Over --max_body_mb: 413, whether the Content-Length says so or the body streams in."""
    big = {"instances": [GOOD] * 40}
    assert_error(limits_server.post("/predict", big), 413, "--max_body_mb")
    chunks = (json.dumps(GOOD).encode() for _ in range(40))  # chunked: no Content-Length
    assert_error(limits_server.post("/predict", chunks), 413, "--max_body_mb")
    assert_error(limits_server.post(f"/v2/models/{NAME}/infer", big), 413, "--max_body_mb",
                 key="error")
    upload = limits_server.post("/predict/image", files={"file": ("x.png", b"x" * 5000)})
    assert_error(upload, 413, "--max_body_mb")
    assert limits_server.post("/predict", {"instances": [GOOD]}).status_code == 200


def test_a_request_past_its_deadline_is_504(deadline_server):
    many = [GOOD] * 2000
    assert_error(deadline_server.post("/predict", {"instances": many}), 504, "--timeout_ms 200")
    request = v2_request(deadline_server.metadata(), many)
    assert_error(deadline_server.post(f"/v2/models/{NAME}/infer", request), 504, "--timeout_ms",
                 key="error")


# ----------------------------------------------------------------------------- 5. reloads


@dataclass
class Reloadable:
    """A server of a bundle folder whose files the tests replace with those of other bundles
    (`sources`), and what each of those bundles serves: (version, predictions of `rows`)."""

    server: Server
    folder: Path
    sources: dict[str, Path]
    expected: dict[str, tuple[str, list[dict]]]
    rows: list[dict]

    def install(self, name: str) -> None:
        """The source bundle's files over the served ones (each replaced atomically, as a
        deployment would, never rewritten in place under the running model)."""
        for path in self.sources[name].glob("model.*"):
            temporary = self.folder / f".{path.name}.new"
            shutil.copyfile(path, temporary)
            os.replace(temporary, self.folder / path.name)

    def load(self) -> httpx.Response:
        return self.server.post(f"/v2/repository/models/{NAME}/load")

    def switch_to(self, name: str) -> None:
        """Install a bundle and reload: 200 with its version."""
        self.install(name)
        response = self.load()
        assert response.status_code == 200, response.text
        assert response.json() == {"loaded": True, "version": self.expected[name][0]}

    def assert_serving(self, name: str) -> None:
        version, predictions = self.expected[name]
        assert self.server.version() == version
        assert_same_predictions(self.server.predict(self.rows), predictions)

    def which(self, predictions: list[dict]) -> str | None:
        """The bundle whose predictions these are."""
        for name, (_, expected) in self.expected.items():
            if len(predictions) == len(expected) and all(map(same_predictions, predictions,
                                                             expected)):
                return name
        return None


@pytest.fixture(scope="module")
def reloadable(digits_int8_bundle, tmp_path_factory) -> Iterator[Reloadable]:
    """Two bundles of the same image model whose int8 graphs differ: digits_int8_bundle's
    (static) and a copy that quantize.py re-quantized (dynamic; no training). The server serves
    --variant int8, so each has its own version; it starts on "static"."""
    root = tmp_path_factory.mktemp("serve_reload")
    static = copy_bundle(digits_int8_bundle, root / "static")
    dynamic = copy_bundle(digits_int8_bundle, root / "dynamic")
    run = run_cli("quantize.py", "--output_model", dynamic, "--quantize", "dynamic",
                  "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    from ttc.online.predictor import Predictor

    rows = [image_row(png) for png in digit_pngs()[::3]]
    expected = {}
    for name, model in (("static", static), ("dynamic", dynamic)):
        predictor = Predictor.load(model, variant="int8", top_k=TOP_K)
        expected[name] = (predictor.version, predictor.predict(rows))
    assert expected["static"][0] != expected["dynamic"][0]
    assert not all(map(same_predictions, expected["static"][1], expected["dynamic"][1]))
    served = copy_bundle(digits_int8_bundle, root / "served")
    with serving(served, "--variant", "int8", "--top_k", TOP_K, logs=root) as server:
        yield Reloadable(server, served.parent, {"static": static.parent,
                                                 "dynamic": dynamic.parent}, expected, rows)


def test_reload_serves_the_new_bundle(reloadable):
    """POST /v2/repository/models/model/load after the files changed: 200, the new version in
    the metadata, and the new bundle's predictions."""
    reloadable.switch_to("static")
    reloadable.assert_serving("static")
    reloadable.switch_to("dynamic")
    reloadable.assert_serving("dynamic")
    samples = reloadable.server.metrics()
    info = [labels for (name, labels), value in samples.items()
            if name == "ttc_model_info" and value == 1]
    assert [dict(labels)["version"] for labels in info] == [reloadable.expected["dynamic"][0]]


def test_a_failed_reload_keeps_the_old_model_serving(reloadable):
    """A truncated model.onnx: the reload is 400 with a one-line reason, and the old version
    is still served, ready, and predicting as before."""
    reloadable.switch_to("static")
    failed = ("ttc_reloads_total", (("outcome", "failed"),))
    before = reloadable.server.metrics().get(failed, 0)
    graph = reloadable.folder / "model.onnx"
    truncated = reloadable.folder / ".model.onnx.truncated"
    truncated.write_bytes(graph.read_bytes()[:graph.stat().st_size // 2])
    os.replace(truncated, graph)
    try:
        response = reloadable.load()
        assert response.status_code == 400, response.text
        body = response.json()
        assert body["loaded"] is False and body["version"] == reloadable.expected["static"][0]
        assert isinstance(body["error"], str) and body["error"] and "\n" not in body["error"]
        assert "model.onnx" in body["error"]
        reloadable.assert_serving("static")
        assert reloadable.server.get("/v2/health/ready").status_code == 200
        assert reloadable.server.metrics()[failed] == before + 1
    finally:
        reloadable.switch_to("static")


def test_sighup_reloads(reloadable):
    """SIGHUP reloads the bundle from disk, as the load endpoint does."""
    reloadable.switch_to("static")
    reloadable.install("dynamic")
    reloadable.server.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while reloadable.server.version() != reloadable.expected["dynamic"][0]:
        assert time.monotonic() < deadline, "SIGHUP did not reload the bundle"
        time.sleep(0.05)
    reloadable.assert_serving("dynamic")


def test_reloads_under_load_fail_no_request(reloadable):
    """Two clients predicting without pause while the bundle is reloaded 5 times (alternating
    two bundles): not one request fails, and every answer is one bundle's or the other's."""
    reloadable.switch_to("static")
    stop, lock = threading.Event(), threading.Lock()
    answers: list[str | None] = []
    failures: list[str] = []

    def client() -> None:
        with httpx.Client(base_url=reloadable.server.url, timeout=TIMEOUT) as http:
            for _ in range(20_000):  # bounded; the test stops it far sooner
                if stop.is_set():
                    return
                try:
                    response = http.post("/predict", json={"instances": reloadable.rows})
                except httpx.HTTPError as err:
                    with lock:
                        failures.append(repr(err))
                    continue
                with lock:
                    if response.status_code == 200:
                        answers.append(reloadable.which(response.json()["predictions"]))
                    else:
                        failures.append(f"{response.status_code} {response.text}")

    def wait_for_answers(count: int) -> None:
        deadline = time.monotonic() + 60
        while len(answers) < count:
            assert time.monotonic() < deadline and not failures, failures[:3]
            time.sleep(0.01)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        wait_for_answers(4)
        for name in ("dynamic", "static", "dynamic", "static", "dynamic"):
            reloadable.switch_to(name)
            wait_for_answers(len(answers) + 2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(STOP_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == [], failures[:5]
    assert None not in answers  # each answer is exactly one of the bundles'
    assert {"static", "dynamic"} <= set(answers)
    reloadable.assert_serving("dynamic")


# ----------------------------------------------------------------------------- 6. SIGTERM


def test_sigterm_answers_every_accepted_request_then_exits_0(tabular_bundle, tabular_case,
                                                             tmp_path):
    """SIGTERM while 4 requests wait for the model (each of 1,000 rows, run in batches of one
    row that take turns: they keep it busy for a while): all 4 are answered 200 and right, and
    the process exits 0 within --drain_s."""
    drain_s = 20
    rows, expected = tabular_case.rows[:4], tabular_case.expected[:4]
    server = start_server(tabular_bundle["model"], "--top_k", TOP_K, "--max_batch_size", 1,
                          "--drain_s", drain_s, logs=tmp_path)

    async def requests_then_sigterm() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=len(rows) + 1)
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT,
                                     limits=limits) as client:
            sent = [asyncio.create_task(client.post("/predict",
                                                    json={"instances": [row] + [GOOD] * 999}))
                    for row in rows]
            deadline = time.monotonic() + 30
            while True:  # until every request is accepted, waiting for the model
                text = (await client.get("/metrics")).text
                depth = next(sample.value for family in text_string_to_metric_families(text)
                             for sample in family.samples if sample.name == "ttc_queue_depth")
                if depth == len(rows):
                    break
                assert time.monotonic() < deadline, f"queue depth {depth}"
                await asyncio.sleep(0.005)
            server.process.send_signal(signal.SIGTERM)
            return await asyncio.gather(*sent)

    try:
        responses = asyncio.run(requests_then_sigterm())
        code = server.process.wait(drain_s)
    finally:
        server.stop()
    for response, want in zip(responses, expected):
        assert response.status_code == 200, response.text
        assert len(response.json()["predictions"]) == 1000
        assert_same_predictions(response.json()["predictions"][:1], [want])
    assert code == 0, server.log_text()[-3000:]
    assert "Traceback" not in server.log_text()


# ----------------------------------------------------------------------------- 7. metrics


def test_metrics_count_the_requests_made(tabular_case):
    """/metrics parses as Prometheus text; its request counter grew by exactly the requests
    made here, by endpoint and status; the batches ran the good rows."""
    server, rows = tabular_case.server, tabular_case.rows[:3]
    infer = f"/v2/models/{NAME}/infer"
    before = server.metrics()
    for _ in range(3):
        assert server.post("/predict", {"instances": rows}).status_code == 200
    assert server.post("/predict", {"instances": [{}]}).status_code == 422
    assert server.post("/predict", {"instances": [dict(GOOD, height="x")]}).status_code == 422
    assert server.post("/predict", b"{").status_code == 400
    request = v2_request(server.metadata(), [GOOD, GOOD])
    for _ in range(2):
        assert server.post(infer, request).status_code == 200
    assert server.post(infer, {"inputs": []}).status_code == 400
    assert server.get("/v2/models/nope").status_code == 404
    route = "/v2/models/{name}/infer"  # counted by the route's path template
    made = {("/predict", 200): 3, ("/predict", 422): 2, ("/predict", 400): 1, (route, 200): 2,
            (route, 400): 1, ("/v2/models/{name}", 404): 1}

    def grown(samples: dict) -> dict:
        return {key: counted(samples, *key) - counted(before, *key) for key in made}

    deadline = time.monotonic() + 10  # a count lands just after its response is sent
    after = server.metrics()
    while any(n < made[key] for key, n in grown(after).items()):
        assert time.monotonic() < deadline, grown(after)
        time.sleep(0.05)
        after = server.metrics()
    assert grown(after) == made
    assert after["ttc_batch_rows_count", ()] - before.get(("ttc_batch_rows_count", ()), 0) > 0
    assert after["ttc_batch_rows_sum", ()] - before["ttc_batch_rows_sum", ()] == 3 * 3 + 2 * 2
    latency = ("ttc_request_seconds_count", (("endpoint", "/predict"),))
    assert after[latency] - before.get(latency, 0) == 6
    assert after["ttc_queue_depth", ()] == 0
    info = {labels: value for (name, labels), value in after.items() if name == "ttc_model_info"}
    assert info == {(("name", NAME), ("test_time", "none"), ("variant", "fp32"),
                     ("version", server.version())): 1.0}


# ----------------------------------------------------------------------------- 8. refusals


def test_refuses_a_bundle_without_its_manifest(digits_bundle, tmp_path):
    """No model.json beside model.onnx: exit 4 with one line on stderr, no traceback."""
    model = copy_bundle(digits_bundle, tmp_path / "bundle")
    model.with_suffix(".json").unlink()
    run = run_cli("serve.py", "--model", model, "--port", free_port(), "--log_level",
                  "WARNING", timeout=120)
    assert_clean_failure(run, 4, "model.json")
    assert run.stderr.strip().splitlines() == run.error_lines()
    assert run.error_lines()[0].startswith("serve.py: error: ")


def test_refuses_a_port_in_use(digits_bundle):
    """A port another socket listens on: exit 5 with one line on stderr, no traceback."""
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = run_cli("serve.py", "--model", digits_bundle["model"], "--host", HOST, "--port",
                      port, "--log_level", "WARNING", timeout=120)
    assert_clean_failure(run, 5, f"{HOST}:{port}", "in use")
    assert run.stderr.strip().splitlines() == run.error_lines()
    assert run.error_lines()[0].startswith("serve.py: error: ")


# ----------------------------------------------------------------------------- 9. Python API


@pytest.mark.parametrize("kind", KINDS)
def test_python_api_equals_predict(request, kind):
    """`Predictor.load(bundle, top_k=K).predict(rows)` answers as /predict on the same rows."""
    from ttc.online.predictor import Predictor

    case = case_of(request, kind)
    predictor = Predictor.load(case.model, top_k=TOP_K)
    assert predictor.version == case.server.version()
    assert_same_predictions(predictor.predict(case.rows), case.server.predict(case.rows))
