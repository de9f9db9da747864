"""What a connection and a request body may do on serve.py's server, checked before any
endpoint runs: at most --max_connections connections (503 beyond, within `ulimit -n`), a
request's line and headers within --read_timeout_s and MAX_HEADER_BYTES (408, 431), its body
within --max_body_mb (413) and --read_timeout_s (408), the large bodies held at once within
--max_inflight_mb (429); and the ledger of requests accepted and answered that a shutdown's
last line reports (one still running when --drain_s ends is answered 503)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from utils import LOG

SMALL_BODY = 64 * 1024  # bytes: a body this small is taken whatever --max_inflight_mb holds
MAX_HEADER_BYTES = 64 * 1024  # a request's line and headers (h11's default is 16 KB)
FD_HEADROOM = 32  # files kept free beside the connections (a refused connection's accept, ...)
# Set in a request's scope by guarded_http's protocol once its whole body is read off the
# connection: receive() then answers at once, and BodyLimit arms no read timer for it
BODY_IN = "ttc.body_in"


class BodyRefused(HTTPException):
    """A body the server does not take: its status, one line and headers."""


class BodyTooLarge(BodyRefused):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than --max_body_mb "
                         f"({limit / 1e6:g} MB)")


class BodiesInFlight(BodyRefused):
    def __init__(self, budget: int) -> None:
        super().__init__(429, f"the server holds --max_inflight_mb {budget / 1e6:g} MB of "
                         "request bodies already; retry shortly", {"Retry-After": "1"})


class BodyOverdue(BodyRefused):
    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"the request body did not arrive within --read_timeout_s "
                         f"{seconds:g} of its headers", {"Connection": "close"})


class ClientGone(BodyRefused):
    def __init__(self) -> None:  # 499, as nginx logs it: no one reads this answer
        super().__init__(499, "the client closed the connection before its body was sent")


@dataclass
class BodyCharge:
    """The bytes of one request's body counted against --max_inflight_mb."""

    charged: int = 0


class BodyLimit:
    """The request bodies: each at most --max_body_mb (413: by its Content-Length before it is
    read, or as it streams in), read within --read_timeout_s of its headers (408), and those
    over SMALL_BODY at most `budget` bytes in all (429), counted from their first byte until
    their answer is sent: the time their rows live in this process."""

    def __init__(self, app, limit: int, budget: int, read_timeout_s: float) -> None:
        self.app, self.limit, self.read_timeout_s = app, limit, read_timeout_s
        self.budget, self.held = max(budget, limit), 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        charge = BodyCharge()
        length = dict(scope["headers"]).get(b"content-length")
        try:
            if length is not None and length.isdigit():
                if int(length) > self.limit:
                    raise BodyTooLarge(self.limit)
                self._charge(charge, int(length))
        except BodyRefused as refused:
            await refusal(scope, refused)(scope, receive, send)
            return
        try:
            await self.app(scope, self._bounded(scope, receive, charge), send)
        finally:
            self.held -= charge.charged

    def _bounded(self, scope, receive, charge: BodyCharge):
        deadline = time.monotonic() + self.read_timeout_s
        received, complete = 0, False

        async def bounded():
            nonlocal received, complete
            if complete:  # the body is in: what comes now is the client's disconnect
                return await receive()
            if scope.get(BODY_IN):  # read off the connection already: receive() cannot wait
                message = await receive()
            else:
                message = await self._within(deadline, receive)
            if message["type"] == "http.disconnect":
                raise ClientGone()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise BodyTooLarge(self.limit)
            self._charge(charge, received)
            complete = not message.get("more_body", False)
            return message

        return bounded

    async def _within(self, deadline: float, receive) -> dict:
        """The next body message, by `deadline` (408 past it)."""
        try:
            async with asyncio.timeout(deadline - time.monotonic()):  # no task, unlike wait_for
                return await receive()
        except TimeoutError:
            raise BodyOverdue(self.read_timeout_s) from None

    def _charge(self, charge: BodyCharge, size: int) -> None:
        """Count a body of `size` bytes (so far) against the budget, or refuse it (429)."""
        if size <= SMALL_BODY or size <= charge.charged:
            return
        if self.held + size - charge.charged > self.budget:
            raise BodiesInFlight(self.budget)
        self.held += size - charge.charged
        charge.charged = size


def refusal(scope, refused: HTTPException) -> JSONResponse:
    key = "error" if scope["path"].startswith("/v2") else "detail"
    return JSONResponse({key: refused.detail}, refused.status_code, headers=refused.headers)


@dataclass
class RequestLedger:
    """Requests accepted (their headers read), answered (their answer sent whole), and cut
    short by a shutdown (answered 503 here), for the line a shutdown ends with."""

    accepted: int = 0
    answered: int = 0
    cut_short: int = 0

    def summary(self, drain_s: float) -> str:
        lost = self.accepted - self.answered
        if not lost and not self.cut_short:
            return "every accepted request was answered"
        said = []
        if self.cut_short:
            said.append(f"{self.cut_short} of the {self.accepted} accepted requests were still "
                        f"running after --drain_s {drain_s:g} and were answered 503, not "
                        "predicted")
        if lost:
            said.append(f"{lost} of the {self.accepted} accepted requests got no answer (their "
                        "connections closed first)")
        return "; ".join(said)


class LedgerMiddleware:
    """Keeps the RequestLedger; a request still running when the shutdown's wait ends
    (uvicorn cancels it after --drain_s) is answered 503 instead of left unanswered."""

    def __init__(self, app, ledger: RequestLedger) -> None:
        self.app, self.ledger = app, ledger

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.ledger.accepted += 1
        state = {"started": False, "complete": False}

        async def sending(message) -> None:
            state["started"] |= message["type"] == "http.response.start"
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                state["complete"] = True

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:  # only a shutdown cancels a request: it ends here
            if state["started"]:
                raise
            self.ledger.cut_short += 1
            refused = HTTPException(503, "the server is shutting down, and this request was "
                                    "not answered within --drain_s")
            await refusal(scope, refused)(scope, receive, sending)
        finally:
            self.ledger.answered += state["complete"]


def connection_cap(wanted: int) -> int:
    """--max_connections, within the files this process may open (each connection is one): the
    soft limit raised to the hard one where that helps, less the files open now and
    FD_HEADROOM. Past the files, accept() fails and every client gets "connection reset"."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = 64
    need = wanted + used + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(hard, need)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted
    cap = max(1, soft - used - FD_HEADROOM)
    LOG.warning("--max_connections %d lowered to %d: this process may open %d files (ulimit -n) "
                "and has %d open", wanted, cap, soft, used)
    return cap


def guarded_http(read_timeout_s: float, max_connections: int) -> type:
    """uvicorn's HTTP protocol with the guards it lacks against slow or many clients: a
    connection past `max_connections` is answered 503 and closed at once; a request's line and
    headers must arrive within `read_timeout_s` of the connection (or of the last answer on
    it) and within MAX_HEADER_BYTES, else 408 (431) and the connection is closed (an idle
    connection is closed without a word). The body's own deadline is BodyLimit's."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTP(AutoHTTPProtocol):
        header_timer: asyncio.TimerHandle | None = None
        header_bytes = 0
        reading_headers = False  # between a request's first byte and its headers' end

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.connections.discard(self)
                refuse_connection(transport, 503, f"the server holds {max_connections} "
                                  "connections, its most (--max_connections, within ulimit "
                                  "-n); retry shortly")
                return
            self._expect_request()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.reading_headers and not self.transport.is_closing():
                self.header_bytes += len(data)
                if self.header_bytes > MAX_HEADER_BYTES:
                    refuse_connection(self.transport, 431, f"the request's line and headers "
                                      f"are longer than {MAX_HEADER_BYTES // 1024} KB")

        # httptools' parser callbacks (h11 has none: its own limit bounds the headers)
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.reading_headers, self.header_bytes = True, 0

        def on_headers_complete(self) -> None:
            self.reading_headers = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            cycle = getattr(self, "cycle", None)
            if cycle is not None and not cycle.more_body:
                cycle.scope[BODY_IN] = True

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._expect_request()

        def connection_lost(self, exc) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
            super().connection_lost(exc)

        def _awaiting_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _expect_request(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
            self.header_timer = asyncio.get_running_loop().call_later(read_timeout_s,
                                                                      self._headers_overdue)

        def _headers_overdue(self) -> None:
            if self.transport.is_closing() or not self._awaiting_headers():
                return  # its headers came in time (the body has BodyLimit's deadline)
            if self.reading_headers:
                refuse_connection(self.transport, 408, f"the request's headers did not "
                                  f"arrive within --read_timeout_s {read_timeout_s:g}")
            else:
                self.transport.close()

    return GuardedHTTP


def refuse_connection(transport, status: int, reason: str) -> None:
    """A one-line JSON answer written straight to the connection, which is then closed."""
    body = json.dumps({"detail": reason}).encode()
    phrase = {408: "Request Timeout", 431: "Request Header Fields Too Large",
              503: "Service Unavailable"}[status]
    headers = ["content-type: application/json", f"content-length: {len(body)}",
               "connection: close", *(["retry-after: 1"] if status == 503 else [])]
    head = f"HTTP/1.1 {status} {phrase}\r\n" + "".join(f"{h}\r\n" for h in headers) + "\r\n"
    transport.write(head.encode() + body)
    transport.close()


def drain_wait_s(drain_s: float) -> float:
    """How long uvicorn waits for the accepted requests after SIGTERM: --drain_s less the time
    the rest of the stop takes (answering what is left 503, the batch being run, the exit)."""
    return max(0.0, drain_s - min(1.0, drain_s / 4))
