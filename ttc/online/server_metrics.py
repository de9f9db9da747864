"""serve.py's Prometheus metrics (GET /metrics): requests by endpoint and status, request
latency, the batches the micro-batcher formed (rows and model time), the queue's depth, the
model being served, reloads, and the label-free shift score of the last rows served with its
threshold (ttc/testtime/shift_score.py). Each app has its own registry (tests start several)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

if TYPE_CHECKING:
    from ttc.testtime.shift_score import ShiftMonitor

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                   10.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("ttc_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("ttc_request_seconds", "time from a request's arrival to its "
                                 "response, by endpoint", ["endpoint"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.batch_rows = Histogram("ttc_batch_rows", "rows in each batch the model ran",
                                    buckets=ROW_BUCKETS, registry=self.registry)
        self.batch_seconds = Histogram("ttc_batch_seconds", "time of each batch: encoding its "
                                       "rows and running the model", buckets=LATENCY_BUCKETS,
                                       registry=self.registry)
        self.queue_depth = Gauge("ttc_queue_depth", "requests waiting for the model",
                                 registry=self.registry)
        self.model = Gauge("ttc_model_info", "the model being served (value 1)",
                           ["name", "version", "variant", "test_time"], registry=self.registry)
        self.reloads = Counter("ttc_reloads", "reloads of the bundle, by outcome", ["outcome"],
                               registry=self.registry)
        self.shift_score = Gauge("ttc_shift_score", "label-free shift score of the last rows "
                                 "served: the KS distance of their prediction entropies from "
                                 "the bundle's held-out ones (NaN: too few rows yet, or no "
                                 "reference)", registry=self.registry)
        self.shift_threshold = Gauge("ttc_shift_threshold", "the score above which those rows "
                                     "look shifted (1% false alarms on unshifted data; NaN: "
                                     "no reference)", registry=self.registry)

    def serving(self, name: str, version: str, variant: str, test_time: str) -> None:
        """The model now served (a reload replaces the previous one's labels)."""
        self.model.clear()
        self.model.labels(name, version, variant, test_time).set(1)

    def watch_queue(self, depth: Callable[[], int]) -> None:
        self.queue_depth.set_function(depth)

    def watch_shift(self, monitor: ShiftMonitor | None) -> None:
        """The served model's shift score (NaN where it has none: another model type, a
        test-time method's outputs, a bundle without a reference)."""
        nan = float("nan")
        self.shift_score.set_function(lambda: monitor.score if monitor else nan)
        self.shift_threshold.set(monitor.threshold if monitor else nan)

    def text(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Counts every HTTP response by its route's path template and status, and times it."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics
        # (endpoint, status) → its counter and histogram children: labels() takes a lock and
        # builds its key on every call
        self.children: dict[tuple[str, int], tuple] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unrouted"
            count, latency = self._children(endpoint, status["code"])
            count.inc()
            latency.observe(time.perf_counter() - started)

    def _children(self, endpoint: str, code: int) -> tuple:
        key = (endpoint, code)
        found = self.children.get(key)
        if found is None:
            found = self.children[key] = (self.metrics.requests.labels(endpoint, str(code)),
                                          self.metrics.latency.labels(endpoint))
        return found
