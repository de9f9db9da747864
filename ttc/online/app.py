"""serve.py's HTTP application (FastAPI on uvicorn): /predict and /predict/image, the Open
Inference Protocol's /v2 endpoints, /metrics, safe reloads and a graceful shutdown, around one
`Predictor` and its micro-batcher. Every model type is served: a classifier answers its classes,
a detector its boxes, a segmenter its mask (the Predictor's served part says what).

The request path: the connection is one of at most --max_connections (503 beyond), its headers
and body arrive within --read_timeout_s each (408), the body's size is bounded (413) and so are
the bodies held at once (--max_inflight_mb, 429); it is parsed (off the event loop where it is
large), its rows checked (at most --max_request_rows, 413; no row with far more keys than the
model reads, 422), then queued for the batch thread (429 when --max_queue requests, or that many
full batches of rows, wait), joined with other requests' rows into a batch that is encoded in one
pass and run (a bad row is 422 with the batch path's reason, and touches no other request), and
answered in order; a request not answered by --timeout_ms is 504. A failure of the model itself
(not of the input) is 500 with its one line.
A reload builds and warms the new model beside the old one with every check start-up applies
(the same function), and the old one keeps serving until the new one passed them; a failed
reload leaves the old one serving. SIGTERM drains within --drain_s: what is still running then is
answered 503, and the last line says how many were.
"""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import gc
import json
import re
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from fastapi import FastAPI, File, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from ttc.online.batcher import BatcherClosed, DeadlineExceeded, MicroBatcher, QueueFull
from ttc.online.docs_page import docs_page
from ttc.online.guards import (MAX_HEADER_BYTES, SMALL_BODY, BodyLimit, BodyRefused,
                               LedgerMiddleware, RequestLedger, connection_cap, drain_wait_s,
                               guarded_http)
from ttc.online.server_metrics import MetricsMiddleware, ServerMetrics
from ttc.online.predictor import FlagCheck, Predictor
from ttc.online.v2 import ProtocolError, input_metadata, request_rows, response, wanted_outputs
from ttc.options.stages import ServeOptions
from ttc.testtime.shift_score import ShiftMonitor, served_monitor
from utils import LOG, ConfigError, DataError, PipelineError, first_line, quoted, quoted_sample

SERVER_NAME = "ttc-serve"
# Keys a row may have beyond the columns the model reads (ids, labels, what a client keeps with
# its rows); a row with more is refused before any table is made of it.
EXTRA_KEYS = 64
# Parsing large bodies (and building large answers): one thread, off the event loop (one parse at
# a time bounds the memory parsing takes; the loop answers small requests meanwhile)
PARSING = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="parse")
# How long a thread holds the interpreter lock while another waits for it: the event loop and
# the model thread take turns, and Python's 5 ms default made a batch wait that long for the
# lock while the loop parsed requests (the batch's own work a few hundred microseconds)
SWITCH_INTERVAL_S = 0.0005


# ----------------------------------------------------------------------------- typed bodies


class PredictRequest(BaseModel):
    instances: list[Any] = Field(description="rows: objects of the trained columns, as one "
                                 "line of an inference.py --input JSONL file; an image as "
                                 '{"image": "<base64 of the file bytes>"}')


class Prediction(BaseModel, extra="allow"):
    """A classifier's answer."""

    label: str
    confidence: float
    top: list[tuple[str, float]] = Field(description="the --top_k classes, most probable first")


class Box(BaseModel):
    label: str
    class_index: int
    score: float
    x1: float = Field(description="in the image's own pixels, as inference.py --input writes")
    y1: float
    x2: float
    y2: float


class Detection(BaseModel):
    """A detector's answer: the image's size and its boxes, best first."""

    height: int
    width: int
    boxes: list[Box]


class Segmentation(BaseModel):
    """A segmenter's answer: the mask at the image's size and each class's pixels."""

    height: int
    width: int
    mask: str = Field(description="a palette PNG of class indices, base64 (inference.py "
                      "--input's mask file)")
    pixels: dict[str, int] = Field(description="each class's pixel count")
    shares: dict[str, float] = Field(description="each class's share of the pixels")


class PredictResponse(BaseModel):
    predictions: list[Prediction | Detection | Segmentation]


class ErrorBody(BaseModel):
    detail: str


ERRORS = {status: {"model": ErrorBody} for status in (400, 413, 422, 429, 503, 504)}


# ----------------------------------------------------------------------------- the served model


@dataclass
class LiveModel:
    """A loaded model and the batcher feeding it."""

    predictor: Predictor
    batcher: MicroBatcher


class ServerError(Exception):
    """A request that cannot be answered: its status, reason and extra headers."""

    def __init__(self, status: int, reason: str, headers: dict | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.headers = status, reason, headers or {}


class ModelServer:
    """The state behind the endpoints: the served model, its swap on reload (its flags checked
    against the bundle's model type again by `check_flags`), the limits."""

    def __init__(self, options: ServeOptions, predictor: Predictor,
                 check_flags: FlagCheck | None = None) -> None:
        self.options, self.check_flags = options, check_flags
        self.name = options.name or predictor.paths.onnx.stem
        self.metrics = ServerMetrics()
        self.first = predictor
        self.served: LiveModel | None = None
        self.reloading = asyncio.Lock()
        self.draining = False
        self.ledger = RequestLedger()
        self.held_hangups: list[int] = []  # SIGHUPs that came before the server was up
        self.freeze_after_batch = False  # serve() froze start-up's objects: the first batch's too

    # ------------------------------------------------------------------ lifecycle

    def _batcher(self, predictor: Predictor, monitor: ShiftMonitor | None = None
                 ) -> MicroBatcher:
        options = self.options
        run = monitor.watching(predictor.predict_parts) if monitor else predictor.predict_parts
        return MicroBatcher(run, max_batch_size=options.max_batch_size,
                            max_delay_s=options.max_queue_delay_ms / 1000,
                            max_queue=options.max_queue, max_rows=self.max_queued_rows,
                            on_batch=self._count_batch)

    @property
    def max_queued_rows(self) -> int:
        """Rows that may wait for the model in all: --max_queue full batches, or one request
        of --max_request_rows."""
        options = self.options
        return max(options.max_queue * options.max_batch_size, options.max_request_rows)

    def _count_batch(self, stats) -> None:
        self.metrics.batch_rows.observe(stats.rows)
        self.metrics.batch_seconds.observe(stats.seconds)
        if self.freeze_after_batch:
            self.freeze_after_batch = False
            freeze_heap()

    async def start(self) -> None:
        self._serve(self.first)
        self.first = None

    def _serve(self, predictor: Predictor) -> LiveModel:
        monitor = served_monitor(predictor.manifest, predictor.test_time())  # the drift gauge
        served = LiveModel(predictor, self._batcher(predictor, monitor).start())
        previous, self.served = self.served, served
        self.metrics.watch_queue(lambda: served.batcher.depth)
        self.metrics.watch_shift(monitor)
        self.metrics.serving(self.name, predictor.version, predictor.variant_name,
                             predictor.test_time())
        if previous is not None:  # it answers what it holds, then stops
            asyncio.get_running_loop().create_task(previous.batcher.close())
        return served

    async def stop(self) -> None:
        self.draining = True
        if self.served is not None:
            await self.served.batcher.close()

    async def reload(self) -> dict:
        """Load the bundle from disk again; serve it only once it passed the checks and a
        warm-up run. Returns what happened (the old model keeps serving on failure)."""
        async with self.reloading:
            loop = asyncio.get_running_loop()
            try:
                predictor = await loop.run_in_executor(
                    None, warmed_predictor, self.options, self.check_flags,
                    self.served.predictor.manifest.model_type)
            except Exception as err:  # noqa: BLE001 - whatever it is, the old model serves on
                reason = err.one_line() if isinstance(err, PipelineError) else \
                    f"{type(err).__name__}: {first_line(err)}"
                self.metrics.reloads.labels("failed").inc()
                LOG.error("reload failed, still serving version %s: %s",
                          self.served.predictor.version, reason)
                return {"loaded": False, "version": self.served.predictor.version,
                        "error": reason}
            self._serve(predictor)
            self.metrics.reloads.labels("loaded").inc()
            LOG.info("reloaded %s: now serving version %s", predictor.paths.onnx,
                     predictor.version)
            return {"loaded": True, "version": predictor.version}

    # ------------------------------------------------------------------ predicting

    async def predict(self, rows: list) -> tuple[Predictor, Any, dict]:
        """Rows → (the predictor that answered, its outputs, extra values)."""
        if self.draining or self.served is None:
            raise ServerError(503, "the server is shutting down")
        deadline = time.monotonic() + self.options.timeout_ms / 1000
        while True:
            served = self.served
            try:
                self.admit(served.predictor, rows)
                probabilities, extra = await served.batcher.submit(rows, deadline)
                return served.predictor, probabilities, extra
            except DataError as err:  # RowError too: this request's rows, alone
                raise ServerError(422, request_reason(err)) from None
            except BatcherClosed:
                continue  # a reload swapped the model between encoding and queueing
            except QueueFull as full:
                raise ServerError(429, self.queue_full_reason(full), {"Retry-After": "1"}) \
                    from None
            except DeadlineExceeded:
                raise ServerError(504, f"not answered within --timeout_ms "
                                  f"{self.options.timeout_ms:g}") from None

    def admit(self, predictor: Predictor, rows: Sequence) -> None:
        """What a request's rows must be before they may wait for the model: at most
        --max_request_rows (413), no row with far more keys than the model reads (422, before
        a table is made of it), then the reader's own check."""
        limit = self.options.max_request_rows
        if len(rows) > limit:
            raise ServerError(413, f"the request holds {len(rows):,} rows, over "
                              f"--max_request_rows {limit}; send at most {limit} rows a "
                              "request")
        refuse_rows_of_many_keys(rows, predictor.inputs)
        predictor.reader.check(rows)

    def queue_full_reason(self, full: QueueFull) -> str:
        if full.rows:
            return (f"{self.max_queued_rows:,} rows may wait for the model at once, and this "
                    "request's would pass that; retry shortly, or send fewer rows a request")
        return (f"{self.options.max_queue} requests are waiting for the model (--max_queue); "
                "retry shortly")


def refuse_rows_of_many_keys(rows: Sequence, inputs: list[str]) -> None:
    """422 for a row with more keys than the model's columns and EXTRA_KEYS: a table of a
    million columns takes minutes and gigabytes to make, for one row."""
    limit = len(inputs) + EXTRA_KEYS
    for number, row in enumerate(rows, 1):
        if isinstance(row, Mapping) and len(row) > limit:
            raise ServerError(422, f"row {number} has {len(row):,} keys, and the model reads "
                              f"{len(inputs)} ({quoted_sample(inputs, 10)}) and takes at most "
                              f"{EXTRA_KEYS} more; send the columns the model reads")


async def off_loop(function: Callable, *args: Any, large: bool = True) -> Any:
    """function(*args) on the parsing thread where it is `large` (a body over SMALL_BODY, an
    answer of more than a batch), while the event loop answers others; small work at once (a
    small request never waits behind a large one's parse)."""
    if not large:
        return function(*args)
    return await asyncio.get_running_loop().run_in_executor(PARSING, function, *args)


def request_reason(err: DataError) -> str:
    """The batch path's one line for what is wrong with the rows, without a hint that names a
    command-line flag (an HTTP client has none to pass)."""
    return err.one_line() if err.hint and "--" not in err.hint else err.message.rstrip(".")


def warmed_predictor(options: ServeOptions, check_flags: FlagCheck | None,
                     model_type: str | None = None) -> Predictor:
    """The bundle of --model, opened with every check serve.py applies, at start-up and on every
    reload alike (this function is both): the bundle's own checks (inference.py's) and its
    model type's (`check_flags`: the flags it is served with), the model type served so far on
    a reload (`model_type`: its clients expect its answers), and one warm-up run answered as a
    request is."""
    predictor = Predictor.open(options, check_flags)
    refuse_another_model_type(predictor, model_type)
    predictor.warm_up()
    return predictor


def refuse_another_model_type(predictor: Predictor, model_type: str | None) -> None:
    """A reload onto a bundle of another model type than the one served (its answers have
    another shape than the clients read): one line, the old model serves on."""
    if model_type is not None and predictor.manifest.model_type != model_type:
        raise ConfigError(f"the bundle is now an {predictor.manifest.model_type}, and this "
                          f"server serves an {model_type}: a reload keeps the model type",
                          "restart serve.py to serve another model type")


# ----------------------------------------------------------------------------- the application


def create_app(server: ModelServer) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.start()
        loop = asyncio.get_running_loop()

        def reload_on_hangup() -> None:
            if not server.draining:
                loop.create_task(server.reload())

        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, reload_on_hangup)
        if server.held_hangups:  # a SIGHUP while the server started: the reload it asked for
            reload_on_hangup()
        yield
        await server.stop()

    app = FastAPI(title="ttc model server", lifespan=lifespan,
                  description="Predictions of one model bundle: /predict (rows as JSON), "
                  "/predict/image (one uploaded image), the Open Inference Protocol (/v2), "
                  "/metrics (Prometheus).",
                  docs_url=None, redoc_url=None)  # FastAPI's load Swagger UI from a CDN
    options = server.options
    app.add_middleware(PredictFastPath, server=server, routes=app.router.routes)  # innermost
    app.add_middleware(BodyLimit, limit=int(options.max_body_mb * 1e6),
                       budget=int(options.max_inflight_mb * 1e6),
                       read_timeout_s=options.read_timeout_s)
    app.add_middleware(LedgerMiddleware, ledger=server.ledger)
    app.add_middleware(MetricsMiddleware, metrics=server.metrics)
    add_error_handlers(app)
    add_predict_routes(app, server)
    add_v2_routes(app, server)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        text, content_type = server.metrics.text()
        return Response(text, media_type=content_type)

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        """The OpenAPI description as a page that needs no internet (docs_page.py)."""
        if not hasattr(app.state, "docs_page"):
            app.state.docs_page = docs_page(app.openapi())
        return HTMLResponse(app.state.docs_page)

    return app


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServerError)
    async def server_error(request: Request, err: ServerError) -> JSONResponse:
        return error_response(request.url.path, err)

    @app.exception_handler(BodyRefused)  # refused as it streamed in: /v2 gets "error"
    async def body_refused(request: Request, err: BodyRefused) -> JSONResponse:
        return error_response(request.url.path, refused_error(err))

    @app.exception_handler(PipelineError)  # the model failed, not the request: one line
    async def model_failure(request: Request, err: PipelineError) -> JSONResponse:
        return error_response(request.url.path, model_error(err))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        reason, status = validation_reason(err.errors(), request.url.path)
        body = {"error": reason} if request.url.path.startswith("/v2") else {"detail": reason}
        return JSONResponse(body, status)


def error_response(path: str, err: ServerError) -> JSONResponse:
    """A refused request's answer: its status, {"detail": reason} ({"error": reason} on /v2)."""
    body = {"error": err.reason} if path.startswith("/v2") else {"detail": err.reason}
    return JSONResponse(body, err.status, headers=err.headers)


def refused_error(err: BodyRefused) -> ServerError:
    return ServerError(err.status_code, err.detail, err.headers)


def model_error(err: PipelineError) -> ServerError:
    LOG.error("a batch failed: %s", err.one_line())
    return ServerError(500, err.one_line())


def validation_reason(errors, path: str = "/predict") -> tuple[str, int]:
    """One line for FastAPI's validation errors; 400 for a body that is not JSON at all."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(), 400
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    message = first.get("msg", "invalid request")
    expected = ('multipart/form-data with the image file in the field "file"'
                if path == "/predict/image" else '{"instances": [ROW, ...]}')
    return (f"{where}: {message}" if where else message) + f" (expected {expected})", 422


def add_predict_routes(app: FastAPI, server: ModelServer) -> None:
    @app.post("/predict", response_model=PredictResponse, responses=ERRORS,
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": PredictRequest.model_json_schema()}}}})
    async def predict(request: Request) -> Response:
        """Predict rows: each an object of the trained columns (images as base64). The body is
        read as JSON whatever its Content-Type says (`curl -d` sends a form's). A classifier
        answers its label and classes, a detector boxes, a segmenter a mask."""
        return await predict_body(server, await request.body())

    @app.post("/predict/image", response_model=PredictResponse, responses=ERRORS)
    async def predict_image(file: UploadFile = File(description="one image file")) -> Response:
        """Predict one uploaded image (multipart/form-data, field `file`), within --max_body_mb
        and --read_timeout_s as every body; one that does not decode is 422."""
        data = await file.read()
        row = {"image": base64.b64encode(data).decode("ascii")}
        predictor, outputs, extra = await server.predict([row])
        return await off_loop(prediction_response, predictor, outputs, extra,
                              large=len(data) > SMALL_BODY)


async def predict_body(server: ModelServer, raw: bytes) -> Response:
    """POST /predict's answer to a body of rows (both ways in: FastAPI's route and
    PredictFastPath)."""
    body = await off_loop(parsed_json, raw, large=len(raw) > SMALL_BODY)
    if not isinstance(body, dict) or not isinstance(body.get("instances"), list):
        raise ServerError(422, 'the body must be {"instances": [ROW, ...]}')
    predictor, outputs, extra = await server.predict(body["instances"])
    return await off_loop(prediction_response, predictor, outputs, extra,
                          large=len(outputs) > server.options.max_batch_size)


class PredictFastPath:
    """POST /predict straight to its handler (predict_body), inside serve.py's own middlewares
    and without FastAPI's routing, dependency solving and exception layers (profiled: about 45
    us of the ~180 us a single-row request took on the event loop): the same answers, errors
    (the handlers' functions) and metrics label (the route FastAPI would have matched). Every
    other request, and /predict under an ASGI root path, goes through FastAPI."""

    def __init__(self, app, server: ModelServer, routes: list) -> None:
        self.app, self.server, self.routes, self.route = app, server, routes, None

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or scope["path"] != "/predict" or scope["method"] != "POST"
                or scope.get("root_path")):
            await self.app(scope, receive, send)
            return
        if self.route is None:
            self.route = next(r for r in self.routes if getattr(r, "path", None) == "/predict"
                              and "POST" in getattr(r, "methods", ()))
        scope["route"] = self.route  # as FastAPI's router sets it (MetricsMiddleware's label)
        try:
            response = await predict_body(self.server, await body_of(receive))
        except ServerError as err:
            response = error_response("/predict", err)
        except BodyRefused as err:
            response = error_response("/predict", refused_error(err))
        except PipelineError as err:
            response = error_response("/predict", model_error(err))
        await response(scope, receive, send)


async def body_of(receive) -> bytes:
    """The request body, as Starlette's Request.body reads it."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        if message["type"] != "http.request":
            continue
        if not message.get("more_body", False):
            if not chunks:
                return message.get("body", b"")
            chunks.append(message.get("body", b""))
            return b"".join(chunks)
        chunks.append(message.get("body", b""))


def prediction_response(predictor: Predictor, outputs, extra) -> Response:
    return json_response({"predictions": predictor.predictions(outputs, extra)})


def add_v2_routes(app: FastAPI, server: ModelServer) -> None:
    def require_model(name: str) -> None:
        if name != server.name:
            raise ServerError(404, f"unknown model {name!r}; this server serves "
                              f"{server.name!r}")

    @app.get("/v2")
    async def server_metadata() -> dict:
        return {"name": SERVER_NAME, "version": "1", "extensions": ["model_repository"]}

    @app.get("/v2/health/live")
    async def live() -> dict:
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        ok = server.served is not None and not server.draining
        return JSONResponse({"ready": ok}, 200 if ok else 503)

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str) -> Response:
        require_model(name)
        return await ready()

    @app.get("/v2/models/{name}")
    async def model_metadata(name: str) -> dict:
        require_model(name)
        predictor = server.served.predictor
        about = predictor.describe()
        return {"name": server.name, "versions": [predictor.version],
                "platform": "onnxruntime_onnx",
                "inputs": input_metadata(predictor.inputs, numeric_inputs(predictor)),
                "outputs": predictor.output_metadata(),
                "parameters": {k: about[k] for k in ("model_type", "classes", "variant",
                                                     "temperature", "test_time")}}

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request) -> Response:
        require_model(name)
        body = await json_body(request)
        predictor = server.served.predictor
        try:
            rows = await off_loop(request_rows, body, predictor.inputs,
                                  numeric_inputs(predictor), large=request.state.large_body)
            wanted = wanted_outputs(body, [o["name"] for o in predictor.output_metadata()])
        except ProtocolError as err:
            raise ServerError(400, str(err)) from None
        predictor, outputs, extra = await server.predict(rows)
        answer = await off_loop(v2_answer, server.name, predictor, body.get("id"), outputs,
                                extra, wanted, large=len(outputs) > server.options.max_batch_size)
        return json_response(answer)

    @app.post("/v2/repository/index")
    async def repository_index() -> list:
        return [{"name": server.name, "version": server.served.predictor.version,
                 "state": "READY" if not server.draining else "UNAVAILABLE"}]

    @app.post("/v2/repository/models/{name}/load")
    async def load(name: str) -> Response:
        """Reload the bundle from disk: the new model serves only once it passed every check
        and a warm-up; otherwise the old one keeps serving (400 with the reason)."""
        require_model(name)
        outcome = await server.reload()
        return JSONResponse(outcome, 200 if outcome["loaded"] else 400)


def v2_answer(name: str, predictor: Predictor, request_id: Any, outputs, extra: dict,
              wanted: list[str] | None) -> dict:
    """The V2 infer response: the model type's output tensors, those the request named."""
    return response(name, predictor.version, request_id, predictor.v2_outputs(outputs, extra),
                    wanted)


def numeric_inputs(predictor: Predictor) -> set[str]:
    encoder = predictor.reader.encoder
    if encoder is None:
        return set()
    return {c["name"] for c in encoder.columns if c["type"] == "numeric"}


async def json_body(request: Request) -> Any:
    """The body parsed (off the event loop where it is large); anything the parser refuses is
    400 with its reason (no exception of a body's parsing is the server's failure)."""
    raw = await request.body()
    request.state.large_body = len(raw) > SMALL_BODY
    return await off_loop(parsed_json, raw, large=request.state.large_body)


def parsed_json(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except RecursionError:  # nested deeper than the parser goes
        raise ServerError(400, "the body is not valid JSON: nested too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ServerError(400, f"the body is not valid JSON: {first_line(err)}") from None
    except ValueError:  # valid JSON: an integer of more digits than int(str) converts
        raise ServerError(400, f"the body holds an integer of more than "
                          f"{sys.get_int_max_str_digits():,} digits (Python's limit for "
                          "reading one); send numbers that fit a feature (a float such as 1e30 "
                          "for a big one)") from None
    refuse_lone_surrogates(raw, body)
    return body


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how JSON text spells a surrogate


def refuse_lone_surrogates(raw: bytes, body: Any) -> None:
    """400 for a string (a key or a value) holding a lone UTF-16 surrogate, which JSON's \\uD800
    escape can spell and no UTF-8 text (a row's cells, the answer) can hold. Looked for only
    where the raw body spells a surrogate escape."""
    if not SURROGATE_ESCAPE.search(raw):
        return
    pending = [body]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending += [*value.keys(), *value.values()]
        elif isinstance(value, list):
            pending += value
        elif isinstance(value, str) and not utf8_text(value):
            raise ServerError(400, f"the body is not valid JSON text: the string "
                              f"{quoted(value)} holds a lone surrogate (a \\uD800-\\uDFFF escape "
                              "without its pair), which is no character; send text as valid "
                              "UTF-8")


def utf8_text(value: str) -> bool:
    try:
        value.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def json_response(body: Any) -> Response:
    """JSON without FastAPI's response validation (the shapes are built above)."""
    return Response(json.dumps(body, ensure_ascii=False, allow_nan=False),
                    media_type="application/json")


# ----------------------------------------------------------------------------- running


def freeze_heap() -> None:
    """The objects the first batch brought (the row readers' lazy imports, pandas: 36,000-39,000
    for the wine and digits bundles) out of the cycle collector's sweeps too: a full collection
    of them took 30-50 ms, paid by whichever request triggered it. Once, after the first batch
    (whose requests waited for the imports already); a reload's objects are left to the
    collector, so that an old model's cycles are still freed."""
    gc.collect()
    gc.freeze()


def bound_socket(host: str, port: int):
    """The server's socket, bound (not yet listening: connections are refused until the model
    is ready), so that a port in use fails before any model work is done."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        from utils import RuntimeFailure

        raise RuntimeFailure(f"cannot listen on {host}:{port}: {err.strerror or err}",
                             "choose another --port (or --host), or stop what uses it") from None
    return sock


def serve(options: ServeOptions, check_flags: FlagCheck,
          held_hangups: list[int] | None = None) -> int:
    """Bind the port (one in use: exit 5), load and warm the bundle (a bad one fails here, exit
    3/4, before any connection is accepted; `check_flags`: the flags against its model type, at
    start and on every reload), then serve until SIGTERM (exit 0 once the accepted requests are
    answered, or answered 503 after --drain_s) or SIGINT (130). `held_hangups`: the SIGHUPs
    serve.py held while it started (one reloads the bundle once the server is up)."""
    import uvicorn

    from utils import EXIT_INTERRUPTED, hand_stops_to_server

    sock = bound_socket(options.host, options.port)
    predictor = warmed_predictor(options, check_flags)
    # start-up's objects (the libraries, the model: ~165,000) out of the cycle collector's
    # sweeps: a full collection of them took ~80 ms, paid by whichever request triggered it
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    sock.listen(2048)
    server = ModelServer(options, predictor, check_flags)
    server.freeze_after_batch = True
    server.held_hangups = held_hangups if held_hangups is not None else []
    uv = uvicorn.Server(uvicorn.Config(
        create_app(server), log_config=None, access_log=False, lifespan="on",
        http=guarded_http(options.read_timeout_s, connection_cap(options.max_connections)),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,  # where httptools is not installed
        timeout_graceful_shutdown=drain_wait_s(options.drain_s), timeout_keep_alive=30,
        log_level="debug" if options.log_level == "DEBUG" else "warning"))
    host, port = sock.getsockname()[:2]
    LOG.info("serving %s as %r on http://%s:%d (POST /predict, /v2/models/%s/infer; "
             "docs at /docs)", predictor.paths.onnx, server.name,
             f"[{host}]" if ":" in host else host, port, server.name)
    hand_stops_to_server()
    uv.run(sockets=[sock])
    with contextlib.suppress(ValueError):  # the loop is gone: a SIGHUP now would end the exit
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    stops = getattr(uv, "_captured_signals", [])
    summary = server.ledger.summary(options.drain_s)
    (LOG.info if summary.startswith("every") else LOG.warning)("stopped: %s", summary)
    return EXIT_INTERRUPTED if signal.SIGINT in stops else 0
