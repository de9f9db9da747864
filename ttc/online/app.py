"""serve.py's HTTP application (FastAPI on uvicorn): /predict and /predict/image, the Open
Inference Protocol's /v2 endpoints, /metrics, safe reloads and a graceful shutdown, around one
`Predictor` and its micro-batcher.

The request path: the body is parsed and its size bounded (413), its rows checked and queued
for the batch thread (429 when --max_queue requests wait), joined with other requests' rows into
a batch that is encoded in one pass and run (a bad row is 422 with the batch path's reason, and
touches no other request), and answered in order; a request not answered by --timeout_ms is
504. A failure of the model itself (not of the input) is 500 with its one line.
A reload builds and warms the new model beside the old one, which keeps serving until the new
one passed every check; a failed reload leaves the old one serving.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import signal
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, File, HTTPException, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from config import Config
from ttc.online.batcher import BatcherClosed, DeadlineExceeded, MicroBatcher, QueueFull
from ttc.online.server_metrics import MetricsMiddleware, ServerMetrics
from ttc.online.predictor import Predictor
from ttc.online.v2 import (ProtocolError, input_metadata, output_metadata, request_rows,
                           response, wanted_outputs)
from utils import LOG, DataError, PipelineError

SERVER_NAME = "ttc-serve"


# ----------------------------------------------------------------------------- typed bodies


class PredictRequest(BaseModel):
    instances: list[Any] = Field(description="rows: objects of the trained columns, as one "
                                 "line of an inference.py --input JSONL file; an image as "
                                 '{"image": "<base64 of the file bytes>"}')


class Prediction(BaseModel, extra="allow"):
    label: str
    confidence: float
    top: list[tuple[str, float]] = Field(description="the --top_k classes, most probable first")


class PredictResponse(BaseModel):
    predictions: list[Prediction]


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
    """The state behind the endpoints: the served model, its swap on reload, the limits."""

    def __init__(self, config: Config, predictor: Predictor) -> None:
        self.config = config
        self.name = config.name or predictor.paths.onnx.stem
        self.metrics = ServerMetrics()
        self.first = predictor
        self.served: LiveModel | None = None
        self.reloading = asyncio.Lock()
        self.draining = False

    # ------------------------------------------------------------------ lifecycle

    def _batcher(self, predictor: Predictor) -> MicroBatcher:
        config = self.config
        return MicroBatcher(predictor.predict_parts, max_batch_size=config.max_batch_size,
                            max_delay_s=config.max_queue_delay_ms / 1000,
                            max_queue=config.max_queue, on_batch=self._count_batch)

    def _count_batch(self, stats) -> None:
        self.metrics.batch_rows.observe(stats.rows)
        self.metrics.batch_seconds.observe(stats.seconds)

    async def start(self) -> None:
        self._serve(self.first)
        self.first = None

    def _serve(self, predictor: Predictor) -> LiveModel:
        served = LiveModel(predictor, self._batcher(predictor).start())
        previous, self.served = self.served, served
        self.metrics.watch_queue(lambda: served.batcher.depth)
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
                predictor = await loop.run_in_executor(None, warmed_predictor, self.config)
            except PipelineError as err:
                self.metrics.reloads.labels("failed").inc()
                LOG.error("reload failed, still serving version %s: %s",
                          self.served.predictor.version, err.one_line())
                return {"loaded": False, "version": self.served.predictor.version,
                        "error": err.one_line()}
            self._serve(predictor)
            self.metrics.reloads.labels("loaded").inc()
            LOG.info("reloaded %s: now serving version %s", predictor.paths.onnx,
                     predictor.version)
            return {"loaded": True, "version": predictor.version}

    # ------------------------------------------------------------------ predicting

    async def predict(self, rows: list) -> tuple[Predictor, Any, dict]:
        """Rows → (the predictor that answered, probabilities, extra values)."""
        if self.draining or self.served is None:
            raise ServerError(503, "the server is shutting down")
        deadline = time.monotonic() + self.config.timeout_ms / 1000
        while True:
            served = self.served
            try:
                served.predictor.reader.check(rows)
                probabilities, extra = await served.batcher.submit(rows, deadline)
                return served.predictor, probabilities, extra
            except DataError as err:  # RowError too: this request's rows, alone
                raise ServerError(422, request_reason(err)) from None
            except BatcherClosed:
                continue  # a reload swapped the model between encoding and queueing
            except QueueFull:
                raise ServerError(429, f"{self.config.max_queue} requests are waiting for the "
                                  "model (--max_queue); retry shortly",
                                  {"Retry-After": "1"}) from None
            except DeadlineExceeded:
                raise ServerError(504, f"not answered within --timeout_ms "
                                  f"{self.config.timeout_ms:g}") from None


def request_reason(err: DataError) -> str:
    """The batch path's one line for what is wrong with the rows, without a hint that names a
    command-line flag (an HTTP client has none to pass)."""
    return err.one_line() if err.hint and "--" not in err.hint else err.message.rstrip(".")


def warmed_predictor(config: Config) -> Predictor:
    """The bundle of config, opened with every check, and run once."""
    predictor = Predictor.from_config(config)
    predictor.run(predictor.warmup_rows())
    return predictor


# ----------------------------------------------------------------------------- the body limit


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than --max_body_mb "
                         f"({limit / 1e6:g} MB)")


class BodyLimit:
    """413 for a body over the limit: by its Content-Length before it is read, or as it
    streams in."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            error = BodyTooLarge(self.limit)
            key = "error" if scope["path"].startswith("/v2") else "detail"
            await JSONResponse({key: error.detail}, 413)(scope, receive, send)
            return
        received = 0

        async def bounded():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, bounded, send)


# ----------------------------------------------------------------------------- the application


def create_app(server: ModelServer) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.start()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(server.reload()))
        yield
        await server.stop()

    app = FastAPI(title="ttc model server", lifespan=lifespan,
                  description="Predictions of one model bundle: /predict (rows as JSON), "
                  "/predict/image (one uploaded image), the Open Inference Protocol (/v2), "
                  "/metrics (Prometheus).")
    app.add_middleware(BodyLimit, limit=int(server.config.max_body_mb * 1e6))
    app.add_middleware(MetricsMiddleware, metrics=server.metrics)
    add_error_handlers(app)
    add_predict_routes(app, server)
    add_v2_routes(app, server)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        text, content_type = server.metrics.text()
        return Response(text, media_type=content_type)

    return app


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServerError)
    async def server_error(request: Request, err: ServerError) -> JSONResponse:
        body = ({"error": err.reason} if request.url.path.startswith("/v2")
                else {"detail": err.reason})
        return JSONResponse(body, err.status, headers=err.headers)

    @app.exception_handler(BodyTooLarge)  # over the limit as it streamed in: /v2 gets "error"
    async def too_large(request: Request, err: BodyTooLarge) -> JSONResponse:
        return await server_error(request, ServerError(413, err.detail))

    @app.exception_handler(PipelineError)  # the model failed, not the request: one line
    async def model_failure(request: Request, err: PipelineError) -> JSONResponse:
        LOG.error("a batch failed: %s", err.one_line())
        return await server_error(request, ServerError(500, err.one_line()))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        reason, status = validation_reason(err.errors())
        body = {"error": reason} if request.url.path.startswith("/v2") else {"detail": reason}
        return JSONResponse(body, status)


def validation_reason(errors) -> tuple[str, int]:
    """One line for FastAPI's validation errors; 400 for a body that is not JSON at all."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(), 400
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    message = first.get("msg", "invalid request")
    return (f"{where}: {message}" if where else message) + \
        ' (expected {"instances": [ROW, ...]})', 422


def add_predict_routes(app: FastAPI, server: ModelServer) -> None:
    @app.post("/predict", response_model=PredictResponse, responses=ERRORS,
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": PredictRequest.model_json_schema()}}}})
    async def predict(request: Request) -> Response:
        """Predict rows: each an object of the trained columns (images as base64). The body is
        read as JSON whatever its Content-Type says (`curl -d` sends a form's)."""
        body = await json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("instances"), list):
            raise ServerError(422, 'the body must be {"instances": [ROW, ...]}')
        predictor, probabilities, extra = await server.predict(body["instances"])
        return json_response({"predictions": predictor.predictions(probabilities, extra)})

    @app.post("/predict/image", response_model=PredictResponse, responses=ERRORS)
    async def predict_image(file: UploadFile = File(description="one image file")) -> Response:
        """Predict one uploaded image (multipart/form-data, field `file`)."""
        data = await file.read()
        row = {"image": base64.b64encode(data).decode("ascii")}
        predictor, probabilities, extra = await server.predict([row])
        return json_response({"predictions": predictor.predictions(probabilities, extra)})


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
                "outputs": output_metadata(predictor.manifest.classes, predictor.extra),
                "parameters": {k: about[k] for k in ("model_type", "classes", "variant",
                                                     "temperature", "test_time")}}

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request) -> Response:
        require_model(name)
        body = await json_body(request)
        predictor = server.served.predictor
        try:
            rows = request_rows(body, predictor.inputs)
            wanted = wanted_outputs(body, ["label", "probabilities", *predictor.extra])
        except ProtocolError as err:
            raise ServerError(400, str(err)) from None
        predictor, probabilities, extra = await server.predict(rows)
        return json_response(response(server.name, predictor.version, body.get("id"),
                                      predictor.manifest.labels, probabilities, extra, wanted))

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


def numeric_inputs(predictor: Predictor) -> set[str]:
    encoder = predictor.reader.encoder
    if encoder is None:
        return set()
    return {c["name"] for c in encoder.columns if c["type"] == "numeric"}


async def json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ServerError(400, f"the body is not valid JSON: {err}") from None
    except RecursionError:  # nested deeper than the parser goes
        raise ServerError(400, "the body is not valid JSON: nested too deeply") from None


def json_response(body: Any) -> Response:
    """JSON without FastAPI's response validation (the shapes are built above)."""
    return Response(json.dumps(body, ensure_ascii=False, allow_nan=False),
                    media_type="application/json")


# ----------------------------------------------------------------------------- running


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


def serve(config: Config) -> int:
    """Bind the port (one in use: exit 5), load and warm the bundle (a bad one fails here, exit
    3/4, before any connection is accepted), then serve until SIGTERM (exit 0 once the accepted
    requests are answered) or SIGINT (130)."""
    import uvicorn

    from utils import EXIT_INTERRUPTED, hand_stops_to_server

    sock = bound_socket(config.host, config.port)
    predictor = warmed_predictor(config)
    sock.listen(2048)
    server = ModelServer(config, predictor)
    uv = uvicorn.Server(uvicorn.Config(
        create_app(server), log_config=None, access_log=False, lifespan="on",
        timeout_graceful_shutdown=config.drain_s, timeout_keep_alive=30,
        log_level="debug" if config.log_level == "DEBUG" else "warning"))
    host, port = sock.getsockname()[:2]
    LOG.info("serving %s as %r on http://%s:%d (POST /predict, /v2/models/%s/infer; "
             "docs at /docs)", predictor.paths.onnx, server.name,
             f"[{host}]" if ":" in host else host, port, server.name)
    hand_stops_to_server()
    uv.run(sockets=[sock])
    stops = getattr(uv, "_captured_signals", [])
    LOG.info("stopped: every accepted request was answered")
    return EXIT_INTERRUPTED if signal.SIGINT in stops else 0
