"""serve.py's flags: where the HTTP server listens, which graph of the bundle it serves, how the
micro-batcher joins requests, the limits that protect it (queue, deadline, body size, rows and
bytes in flight, slow clients, connections), how long a shutdown may drain, and the Ray Serve
replicas (--engine ray)."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ttc.options.batch import check_ray_address
from ttc.options.fields import bad, opt, positive
from utils import ConfigError

VARIANTS = ("fp32", "int8", "fp16", "pruned", "qat", "pruned_qat", "auto")


@dataclass
class ServeFlags:
    host: str = opt("127.0.0.1", "the address to listen on (0.0.0.0: every interface; behind a "
                    "proxy or in a container)", "serve", metavar="HOST", scripts="S")
    port: int = opt(8000, "the TCP port to listen on", "serve", type=int, metavar="PORT",
                    scripts="S")
    name: str | None = opt(None, "the model's name in the /v2 endpoints (default: the bundle "
                           "file's stem, e.g. model)", "serve", metavar="NAME", scripts="S")
    variant: str = opt("fp32", "the bundle's graph to run: fp32 (model.onnx), int8, fp16, a "
                       "compressed variant (pruned, qat, pruned_qat: --prune, --qat), or auto "
                       "(the fastest graph the gate passed: int8 or a compressed variant, else "
                       "fp32)", "serve", choices=VARIANTS, scripts="SI")
    max_batch_size: int = opt(32, "the most rows the micro-batcher joins into one model run",
                              "serve", type=int, metavar="N", scripts="S")
    max_queue_delay_ms: float = opt(2.0, "the most the oldest waiting row is held while requests "
                                    "arriving at the same moment join its batch, an upper bound: "
                                    "what is queued runs as soon as the model is idle, a lone "
                                    "request at once (0: never held)", "serve", type=float,
                                    metavar="MS", scripts="S")
    max_queue: int = opt(256, "requests that may wait for the model at once; more are refused "
                         "with 429 and Retry-After", "serve", type=int, metavar="N", scripts="S")
    timeout_ms: float = opt(10000.0, "a request's deadline: one not answered by then gets 504",
                            "serve", type=float, metavar="MS", scripts="S")
    max_body_mb: float = opt(16.0, "the largest request body accepted (413 beyond it)", "serve",
                             type=float, metavar="MB", scripts="S")
    max_request_rows: int = opt(4096, "the most rows one request may hold (413 beyond it); the "
                                "rows waiting for the model in all are at most --max_queue full "
                                "batches, or one such request (429 beyond)", "serve", type=int,
                                metavar="N", scripts="S")
    max_inflight_mb: float = opt(64.0, "request bodies over 64 KB held at once, in all, while "
                                 "they are read, parsed and answered (429 beyond; at least "
                                 "one body of --max_body_mb); smaller ones are always taken",
                                 "serve", type=float, metavar="MB", scripts="S")
    read_timeout_s: float = opt(30.0, "a client sends a request's headers within this many "
                                "seconds of connecting (or of its last answer), and its body "
                                "within as many again; else 408 and the connection is closed",
                                "serve", type=float, metavar="SECONDS", scripts="S")
    max_connections: int = opt(1000, "open connections at once (fewer where the process may "
                                "not open that many files, ulimit -n); one more is answered 503 "
                                "and closed", "serve", type=int, metavar="N", scripts="S")
    drain_s: float = opt(30.0, "on SIGTERM, stop accepting and answer the accepted requests "
                         "within this many seconds (what is still running then is answered "
                         "503), then exit 0", "serve", type=float, metavar="SECONDS",
                         scripts="S")
    num_replicas: int = opt(1, "--engine ray: Ray Serve replicas, each one ONNX Runtime session "
                            "with --num_threads threads", "serve", type=int, metavar="N",
                            scripts="S")

    def check_serve(self, online_ttt: bool) -> None:
        """The server's flags (serve.py only: the other scripts leave them at their defaults)."""
        if not 0 <= self.port <= 65535:
            bad("port", self.port, "use a port between 1 and 65535 (0: any free port)")
        if not valid_host(self.host):
            bad("host", self.host, "use an IP address or a host name, e.g. 127.0.0.1 or 0.0.0.0")
        for name in ("max_batch_size", "max_queue", "max_request_rows", "max_connections",
                     "num_replicas"):
            positive(name, getattr(self, name))
        for name in ("timeout_ms", "max_body_mb", "max_inflight_mb", "read_timeout_s"):
            if not 0 < getattr(self, name) < 1e7:  # inf and nan too: one line, not exit 5
                bad(name, getattr(self, name), "use a number greater than 0 and below 10000000")
        for name in ("max_queue_delay_ms", "drain_s"):
            if not 0 <= getattr(self, name) < 1e7:
                bad(name, getattr(self, name), "use a number of 0 or more, below 10000000")
        if self.max_queue_delay_ms >= self.timeout_ms:
            raise ConfigError(f"--max_queue_delay_ms {self.max_queue_delay_ms:g} holds a lone "
                              f"request longer than its deadline, --timeout_ms "
                              f"{self.timeout_ms:g}: every one would be 504",
                              "make --max_queue_delay_ms smaller than --timeout_ms")
        if self.name is not None and not (self.name and self.name.replace("-", "").replace(
                "_", "").replace(".", "").isalnum()):
            bad("name", self.name, "use letters, digits, '-', '_' and '.'")
        if self.engine == "ray":
            check_ray_address(self.ray_address)
            if online_ttt:
                raise ConfigError("--ttt_mode online carries the adaptation from one batch to "
                                  "the next, and Ray Serve replicas run batches in parallel",
                                  "use --ttt_mode episodic on Ray, or --engine local")
        elif self.ray_address is not None or self.num_replicas != 1:
            raise ConfigError("--ray_address and --num_replicas apply only to --engine ray",
                              "add --engine ray, or drop them")


def valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(host) and all(part.isalnum() or part.replace("-", "").isalnum()
                                  for part in host.split("."))
