"""Dynamic batching: a bounded queue of plans and one worker thread that runs them on the engine.

The worker takes the oldest plan, waits until `wait_s` after it arrived for more plans of its
batch key (RunPlan.batch_key) up to `max_batch` images, and runs them as one batch. The window is
only worth its wait when requests come together: once one closed with its plan alone, the next
plan starts at once, and the window opens again as soon as a plan arrives to find the worker busy
or others queued (a lone closed-loop client then pays no window; concurrent ones are gathered); a drain
ends a window at once, as no company can come. Batches are
padded up to the next power of two plans (copies of the last plan, whose images are dropped)
so a shape compiles for a few batch sizes, not every count from 1 to max_batch; where padding
would waste more than a quarter of the batch, the power of two below runs and the rest wait. Plans of other
keys wait their turn in arrival order: a new shape compiles while the queue holds, and is then
kept by the engine with the others. A failing batch fails its own tickets only.

Nothing here knows HTTP: tickets carry a `concurrent.futures.Future` that the server awaits.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from flux2klein_cli.core.engine.plan import RunPlan
from flux2klein_cli.core.errors import Flux2KleinError

RunBatch = Callable[[Sequence[RunPlan]], Sequence[Any]]


class QueueFull(Flux2KleinError):
    """The queue holds its bound: come back after `retry_after` seconds."""

    def __init__(self, depth: int, retry_after: int):
        self.depth, self.retry_after = depth, retry_after
        super().__init__(f"the queue is full ({depth} requests waiting); retry after {retry_after} s")


class Draining(Flux2KleinError):
    """The server is stopping: it takes no new work, and what it could not finish is refused."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down; send the request to another instance")


@dataclass(eq=False)
class Ticket:
    """One plan in the queue and its result to come (an ImageRun, or the batch's exception)."""

    plan: RunPlan
    key: tuple[Any, ...]
    enqueued: float = field(default_factory=time.monotonic)
    future: Future[Any] = field(default_factory=Future)
    state: str = "queued"  # queued, running, succeeded, failed, cancelled
    started: float | None = None

    def resolve(self, value: Any = None, error: BaseException | None = None) -> bool:
        """Set the result once; False when it was already set (cancelled, refused while draining)."""
        try:
            if error is None:
                self.future.set_result(value)
            else:
                self.future.set_exception(error)
        except InvalidStateError:
            return False
        self.state = "succeeded" if error is None else ("cancelled" if isinstance(error, Cancelled) else "failed")
        return True


class Cancelled(Flux2KleinError):
    def __init__(self) -> None:
        super().__init__("the job was cancelled before it ran")


@dataclass
class BatchReport:
    """What one batch did, for metrics: plans and images run (padding excluded), seconds, error."""

    plans: int
    images: int
    padded_images: int
    seconds: float
    waited: list[float]
    error: BaseException | None


MAX_PADDING = 0.25  # of a padded batch: more, and the batch runs the power of two below instead


class Clock:
    """Monotonic seconds and the timed wait of the batch window: real time here; the tests give a
    clock they move by hand, so the window is checked without sleeping."""

    def now(self) -> float:
        return time.monotonic()

    def wait(self, cond: threading.Condition, timeout: float) -> None:
        """Wait on `cond` (held) until notified or `timeout` seconds have passed."""
        cond.wait(timeout)


def batch_count(count: int, cap: int) -> int:
    """How many of `count` gathered plans run now: all when padding them to `padded_count`
    wastes at most MAX_PADDING of the batch, else the largest power of two below (the rest
    wait for the next batch, with whatever arrives meanwhile): a batch never computes more
    than a third more images than it returns, and every size run is one `warm` compiled."""
    padded = padded_count(count, cap)
    if padded - count <= MAX_PADDING * padded:
        return count
    return 1 << (count.bit_length() - 1)


def padded_count(count: int, cap: int) -> int:
    """`count` plans rounded up to a power of two, at most `cap` (and never below `count`)."""
    if count >= cap:
        return count
    return min(cap, 1 << (count - 1).bit_length())


class Batcher:
    def __init__(self, run_batch: RunBatch, *, max_batch: int, wait_s: float, queue_size: int,
                 pad: bool = True, on_batch: Callable[[BatchReport], None] = lambda report: None,
                 on_depth: Callable[[int], None] = lambda depth: None, before_first: Callable[[], None] | None = None,
                 finish: Callable[[Any], Any] = lambda result: result, clock: Clock | None = None):
        self.run_batch, self.max_batch, self.wait_s, self.queue_size = run_batch, max_batch, wait_s, queue_size
        self.clock = clock or Clock()
        self.pad, self.on_batch, self.on_depth, self.before_first = pad, on_batch, on_depth, before_first
        # Each answered plan's result as its ticket gets it, on the worker thread: a batch's answers
        # then go out together, so closed-loop clients come back within one batch window.
        self.finish = finish
        self._queue: deque[Ticket] = deque()
        self._running: list[Ticket] = []
        self._cond = threading.Condition()
        self._accepting = True
        self._closed = False
        self._batch_seconds = 1.0  # a running mean, for Retry-After
        self._company = True  # whether plans have been arriving together: the window is waited
        self._thread = threading.Thread(target=self._work, name="flux2klein-batcher", daemon=True)
        self.started = threading.Event()  # set once before_first (the warm-up) returned
        self.start_error: BaseException | None = None

    # --------------------------------------------------------------------- callers (any thread)

    def start(self) -> None:
        self._thread.start()

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._queue) + len(self._running)

    def retry_after(self) -> int:
        batches_ahead = max(1, math.ceil(len(self._queue) / self.max_batch))
        return max(1, math.ceil(batches_ahead * self._batch_seconds))

    def submit(self, plan: RunPlan) -> Ticket:
        with self._cond:
            if not self._accepting:
                raise Draining()
            if len(self._queue) >= self.queue_size:
                raise QueueFull(len(self._queue), self.retry_after())
            ticket = Ticket(plan, plan.batch_key(), enqueued=self.clock.now())
            if self._queue or self._running:
                self._company = True
            self._queue.append(ticket)
            self.on_depth(len(self._queue))
            self._cond.notify_all()
        return ticket

    def cancel(self, ticket: Ticket) -> bool:
        """Take a queued ticket out (True); one already running or done stays (False)."""
        with self._cond:
            if ticket not in self._queue:
                return False
            self._queue.remove(ticket)
            self.on_depth(len(self._queue))
        ticket.resolve(error=Cancelled())
        return True

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False
            self._cond.notify_all()  # no company can come now: a window waiting for it ends

    def wait_idle(self, timeout: float) -> bool:
        """Until the queue is empty and no batch runs (True), or `timeout` seconds (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._running, timeout)

    def refuse_pending(self, error: BaseException) -> int:
        """Resolve every queued and running ticket with `error` (draining past its time); how many."""
        with self._cond:
            pending = [*self._queue, *self._running]
            self._queue.clear()
            self._closed = True
            self.on_depth(0)
            self._cond.notify_all()
        return sum(ticket.resolve(error=error) for ticket in pending)

    def close(self) -> None:
        with self._cond:
            self._accepting, self._closed = False, True
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker to end after `close` (the batch it runs finishes); True once it has."""
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # --------------------------------------------------------------------- the worker thread

    def _take(self) -> list[Ticket] | None:
        """The next batch (oldest ticket and same-key ones after it), or None once closed."""
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            first = self._queue[0]
            deadline = first.enqueued + (self.wait_s if self._company else 0.0)
            while True:
                same = [t for t in self._queue if t.key == first.key]
                images = sum(t.plan.batch for t in same)
                remaining = deadline - self.clock.now()
                if images >= self.max_batch or remaining <= 0 or self._closed or not self._accepting:
                    break
                self.clock.wait(self._cond, remaining)
                if not self._queue or self._queue[0] is not first:  # cancelled meanwhile: start over
                    return []
            self._company = len(self._queue) > 1
            chosen, images = [], 0
            for ticket in self._queue:
                if ticket.key == first.key and (not chosen or images + ticket.plan.batch <= self.max_batch):
                    chosen.append(ticket)
                    images += ticket.plan.batch
            if self.pad:  # a size padding would waste more than a quarter of: the power of two below it
                cap = max(1, self.max_batch // max(1, first.plan.batch))
                chosen = chosen[:batch_count(len(chosen), cap)]
            for ticket in chosen:
                self._queue.remove(ticket)
                ticket.state, ticket.started = "running", self.clock.now()
            self._running = chosen
            self.on_depth(len(self._queue))
            return chosen

    def _work(self) -> None:
        if self.before_first is not None:
            try:
                self.before_first()
            except BaseException as e:  # noqa: BLE001 (reported by the server, which stops)
                self.start_error = e
                self.started.set()
                return
        self.started.set()
        while True:
            chosen = self._take()
            if chosen is None:
                return
            if chosen:
                self._run(chosen)

    def _run(self, chosen: list[Ticket]) -> None:
        plans = [t.plan for t in chosen]
        per_plan = max(1, plans[0].batch)
        if self.pad:
            target = padded_count(len(plans), max(1, self.max_batch // per_plan))
            plans += [plans[-1]] * (target - len(plans))
        start = self.clock.now()
        error: BaseException | None = None
        try:
            results = self.run_batch(plans)
        except BaseException as e:  # noqa: BLE001 (a failing batch fails its own tickets only)
            error = e
        answers: list[Any] = [None] * len(chosen)
        if error is None:
            try:
                answers = [self.finish(results[i]) for i in range(len(chosen))]
            except BaseException as e:  # noqa: BLE001 (as a failing run: its own tickets only)
                error = e
        seconds = self.clock.now() - start
        self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * seconds
        for ticket, answer in zip(chosen, answers, strict=True):
            ticket.resolve(None if error else answer, error)
        with self._cond:
            self._running = []
            self._cond.notify_all()
        self.on_batch(BatchReport(plans=len(chosen), images=sum(t.plan.batch for t in chosen),
                                  padded_images=sum(p.batch for p in plans), seconds=seconds,
                                  waited=[(t.started or 0) - t.enqueued for t in chosen], error=error))
