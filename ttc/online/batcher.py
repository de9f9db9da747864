"""Dynamic batching, as Triton's dynamic batcher and Ray Serve's @serve.batch do it: concurrent
requests wait in one bounded queue, and one model thread runs them joined into batches of up to
`max_batch_size` rows. What is queued runs as soon as the model is idle: a lone request waits for
nothing, and batches form from the requests that arrive while the model runs the last one (the
more load, the larger the batches). Before a batch leaves, the event loop gets a turn so that
requests arriving at the same moment join it, for as long as each turn brings more of them and
at most until its oldest row has waited `max_delay_s`: an upper bound, never a fixed wait. A
request of many rows is split across batches and its parts merged back in
order, and its batches take turns with newer requests: a batch takes the rows of requests not yet
started first, then the rest of those under way, so that a one-row request waits about one batch
behind a request of thousands, not all of it. The queue is bounded in requests (`max_queue`) and
in rows (`max_rows`). A request whose deadline passes while it waits, or whose caller is gone (a
shutdown cancelled it), is dropped from the queue, never run.

The batch runs on one thread of its own: encoding the rows of all its requests in one pass and
the model (ONNX Runtime releases the GIL, so the event loop keeps accepting requests meanwhile;
its intra-op threads are the cores it was given). The batcher only cuts and joins: `run` gets
each request's part of the batch and answers each part with its predictions or the error that
request alone gets.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

Result = tuple[np.ndarray, dict[str, np.ndarray]]  # probabilities, the method's extra values
# the batch's parts, each (a request's rows, the number of its first row) → each part's outcome
RunBatch = Callable[[list[tuple[Sequence, int]]], list["Result | Exception"]]


class QueueFull(Exception):
    """The queue holds `max_queue` requests, or the request's rows would take it past `max_rows`:
    the caller answers 429. `rows`: which of the two."""

    def __init__(self, rows: bool = False) -> None:
        super().__init__("rows" if rows else "requests")
        self.rows = rows


class DeadlineExceeded(Exception):
    """The request's deadline passed before it was answered: the caller answers 504."""


class BatcherClosed(Exception):
    """The batcher stopped (a reload replaced it and drained): the caller retries on the new one."""


@dataclass(slots=True)
class Pending:
    """One request in the queue: its rows, how many of them are taken, the parts predicted so
    far, and the future its caller awaits."""

    x: Sequence
    deadline: float
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)
    taken: int = 0
    parts: list = field(default_factory=list)  # (probabilities, extra) per batch, in order
    done_rows: int = 0


@dataclass
class BatchStats:
    """What a batch was, for the metrics: its rows and the time the model took."""

    rows: int
    seconds: float


class MicroBatcher:
    """submit(x) → (probabilities, extra) of x's rows, run in batches with other requests."""

    def __init__(self, run: RunBatch, *, max_batch_size: int, max_delay_s: float,
                 max_queue: int, max_rows: int | None = None,
                 on_batch: Callable[[BatchStats], None] | None = None) -> None:
        self.run, self.on_batch = run, on_batch
        self.max_batch_size, self.max_delay_s, self.max_queue = (max_batch_size, max_delay_s,
                                                                 max_queue)
        self.max_rows = max_rows or max_queue * max_batch_size
        self.queue: deque[Pending] = deque()
        self.queued_rows = 0  # rows of the queue not yet taken into a batch
        self.wakeup = asyncio.Event()
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
        self.closing = False
        self.task: asyncio.Task | None = None
        self.in_flight = 0  # requests accepted and not yet answered

    def start(self) -> "MicroBatcher":
        self.task = asyncio.get_running_loop().create_task(self._loop())
        return self

    @property
    def depth(self) -> int:
        """Requests waiting for the model (not counting the batch it is running)."""
        return len(self.queue)

    async def submit(self, x: Sequence, deadline: float) -> Result:
        """Queue a request's rows; their predictions, or the request's own error (what `run`
        answered for it), QueueFull, DeadlineExceeded, BatcherClosed."""
        if self.closing:
            raise BatcherClosed()
        if not self._room_for(len(x)):
            self._drop_expired()  # their places are free
            if len(self.queue) >= self.max_queue:
                raise QueueFull()
            if not self._room_for(len(x)):
                raise QueueFull(rows=True)
        loop = asyncio.get_running_loop()
        pending = Pending(x, deadline, loop.create_future())
        self.queue.append(pending)
        self.queued_rows += len(x)
        self.in_flight += 1
        self.wakeup.set()
        # one timer, not wait_for(shield(...)): a task, a future and two callbacks fewer
        timer = loop.call_later(max(0.0, deadline - time.monotonic()), _expire, pending.future)
        try:
            return await pending.future
        except DeadlineExceeded:
            self._abandon(pending)
            raise DeadlineExceeded() from None
        except asyncio.CancelledError:  # the caller is gone (a shutdown past --drain_s)
            self._abandon(pending)
            raise
        finally:
            timer.cancel()
            self.in_flight -= 1

    def _room_for(self, rows: int) -> bool:
        return len(self.queue) < self.max_queue and self.queued_rows + rows <= self.max_rows

    def _abandon(self, pending: Pending) -> None:
        """No one awaits the request's outcome now: its rows still queued are not run."""
        pending.future.add_done_callback(_retrieved)
        if pending.taken == 0:
            self._forget(pending)  # its place in the queue is free at once
        pending.deadline = 0.0  # partly taken: the loop drops the rest; its answer is lost

    async def _loop(self) -> None:
        while True:
            await self._wait_for_work()
            if not self.queue:
                if self.closing:
                    return
                continue
            await self._wait_to_fill()
            batch = self._take_batch()
            if batch:
                await self._run(batch)

    async def _wait_for_work(self) -> None:
        while not self.queue and not self.closing:
            self.wakeup.clear()
            await self.wakeup.wait()

    async def _wait_to_fill(self) -> None:
        """Let requests arriving at this moment join the batch: one turn of the event loop at a
        time, while each turn queued more, the batch is not full, and the oldest row has waited
        less than max_delay_s. A lone request costs one turn (microseconds), not max_delay_s."""
        until = self.queue[0].arrived + self.max_delay_s
        while (self.queue and self.queued_rows < self.max_batch_size and not self.closing
               and time.monotonic() < until):
            queued = len(self.queue)
            await asyncio.sleep(0)
            if len(self.queue) <= queued:
                return

    def _take_batch(self) -> list[tuple[Pending, int, int]]:
        """Up to max_batch_size rows: (request, start, stop) each, the requests not yet started
        first (in arrival order), then those under way; requests past their deadline leave the
        queue unrun."""
        self._drop_expired()
        batch, rows = [], 0
        for pending in sorted(self.queue, key=lambda p: p.taken > 0):  # a stable sort
            if rows == self.max_batch_size:
                break
            stop = min(len(pending.x), pending.taken + self.max_batch_size - rows)
            batch.append((pending, pending.taken, stop))
            rows += stop - pending.taken
            self.queued_rows -= stop - pending.taken
            pending.taken = stop
            if stop == len(pending.x):
                self.queue.remove(pending)
        return batch

    def _drop_expired(self) -> None:
        now = time.monotonic()
        for pending in [p for p in self.queue if p.deadline <= now or p.future.done()]:
            self._remove(pending)

    def _remove(self, pending: Pending) -> None:
        self.queue.remove(pending)
        self.queued_rows -= len(pending.x) - pending.taken

    async def _run(self, batch: list[tuple[Pending, int, int]]) -> None:
        parts = [(p.x[start:stop], start + 1) for p, start, stop in batch]
        started = time.perf_counter()
        try:
            outcomes = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.run, parts)
        except Exception as err:  # noqa: BLE001 - the batch's requests get the error
            outcomes = [err] * len(batch)
        if self.on_batch is not None:
            rows = sum(len(o[0]) for o in outcomes if not isinstance(o, Exception))
            self.on_batch(BatchStats(rows, time.perf_counter() - started))
        for (pending, start, stop), outcome in zip(batch, outcomes):
            if isinstance(outcome, Exception):
                if not pending.future.done():
                    pending.future.set_exception(outcome)
                self._forget(pending)
                continue
            pending.parts.append(outcome)
            pending.done_rows += stop - start
            if pending.done_rows == len(pending.x) and not pending.future.done():
                pending.future.set_result(merged(pending.parts))

    def _forget(self, pending: Pending) -> None:
        """A failed request's rows still queued are not run."""
        try:
            self._remove(pending)
        except ValueError:
            pass

    async def close(self) -> None:
        """Answer everything queued (what no one awaits any more is dropped), then stop the loop
        and the model thread."""
        self.closing = True
        self._drop_expired()
        self.wakeup.set()
        if self.task is not None:
            await self.task
        self.executor.shutdown(wait=True)


def _expire(future: asyncio.Future) -> None:
    """The request's deadline passed before its answer: its caller raises DeadlineExceeded."""
    if not future.done():
        future.set_exception(DeadlineExceeded())


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def merged(parts: list[tuple[np.ndarray, dict]]) -> tuple[np.ndarray, dict]:
    if len(parts) == 1:
        return parts[0]
    probabilities = np.concatenate([p for p, _ in parts])
    extra = {k: np.concatenate([e[k] for _, e in parts]) for k in parts[0][1]}
    return probabilities, extra
