"""The serve batcher alone, with fake plans and a clock moved by hand: no HTTP, no model, no
sleeping (core/serve/batcher.py)."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from flux2klein_cli.core.serve.batcher import Batcher

GUARD_S = 30  # a hung worker fails the test instead of hanging it; no timing is asserted


@dataclass(frozen=True)
class FakePlan:
    """What the batcher reads of a plan: its key and its image count."""

    key: str
    batch: int = 1

    def batch_key(self) -> tuple[str]:
        return (self.key,)


class ManualClock:
    """Time stands still until `advance`; a window waits until then (or a notify)."""

    def __init__(self) -> None:
        self.now_s, self.cond = 0.0, threading.Condition()
        self.waiting = threading.Event()  # set while the worker waits in a window

    def now(self) -> float:
        return self.now_s

    def wait(self, cond: threading.Condition, timeout: float) -> None:
        self.cond = cond
        self.waiting.set()
        cond.wait()
        self.waiting.clear()

    def advance(self, seconds: float) -> None:
        assert self.waiting.wait(GUARD_S), "the worker is not in a window"
        with self.cond:
            self.now_s += seconds
            self.cond.notify_all()


def started(run_batch: Any, clock: ManualClock, **options: Any) -> tuple[Batcher, queue.Queue]:
    reports: queue.Queue = queue.Queue()
    batcher = Batcher(run_batch, clock=clock, on_batch=reports.put, **options)
    batcher.start()
    return batcher, reports


def test_the_batcher_gathers_same_key_plans_and_a_failing_batch_fails_only_its_own() -> None:
    from flux2klein_cli.core.serve.batcher import batch_count, padded_count

    runs: list[list[str]] = []

    def run_batch(plans: list[FakePlan]) -> list[str]:
        runs.append([p.key for p in plans])
        if plans[0].key == "bad":
            raise RuntimeError("out of memory")
        return [f"{p.key}-result" for p in plans]

    clock = ManualClock()
    batcher = Batcher(run_batch, max_batch=4, wait_s=0.3, queue_size=8, clock=clock)  # type: ignore[arg-type]
    tickets = [batcher.submit(FakePlan(key)) for key in ("a", "bad", "a", "a", "bad")]  # type: ignore[arg-type]
    batcher.start()
    try:
        clock.advance(0.3)  # the a's window closes with three of four
        results = [t.future.exception(timeout=GUARD_S) or t.future.result() for t in tickets]
    finally:
        batcher.close()
    assert results[0] == results[2] == results[3] == "a-result"
    assert all(isinstance(results[i], RuntimeError) for i in (1, 4))
    assert runs[0] == ["a", "a", "a", "a"]  # three gathered, padded to four
    assert runs[1] == ["bad", "bad"]
    assert [t.state for t in tickets] == ["succeeded", "failed", "succeeded", "succeeded", "failed"]
    assert [padded_count(k, 8) for k in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 9]
    # padding 5 to 8 would waste 3 of 8 images: 4 run, 1 waits; 3 -> 4 and 7 -> 8 waste at most a quarter
    assert [batch_count(k, 8) for k in range(1, 10)] == [1, 2, 3, 4, 4, 6, 7, 8, 9]


def test_the_batcher_cancels_queued_tickets_and_bounds_its_queue() -> None:
    from flux2klein_cli.core.serve.batcher import Cancelled, Draining, QueueFull

    batcher = Batcher(lambda plans: list(plans), max_batch=2, wait_s=0.0, queue_size=2)  # not started
    first, second = batcher.submit(FakePlan("a")), batcher.submit(FakePlan("b"))  # type: ignore[arg-type]
    with pytest.raises(QueueFull) as full:
        batcher.submit(FakePlan("c"))  # type: ignore[arg-type]
    assert full.value.retry_after >= 1
    assert batcher.cancel(first) and isinstance(first.future.exception(), Cancelled)
    assert not batcher.cancel(first)
    batcher.stop_accepting()
    with pytest.raises(Draining):
        batcher.submit(FakePlan("d"))  # type: ignore[arg-type]
    assert batcher.refuse_pending(Draining()) == 1 and isinstance(second.future.exception(), Draining)


def test_the_window_is_waited_only_while_requests_come_together() -> None:
    """A lone request pays the window once; the next lone one starts at once; requests that arrive
    while a batch runs bring the window back, and are gathered into one batch."""
    release, running = threading.Event(), threading.Event()
    runs: list[list[str]] = []

    def run_batch(plans: list[FakePlan]) -> list[str]:
        runs.append([p.key for p in plans])
        running.set()
        if plans[0].key == "held":
            assert release.wait(GUARD_S)
        return [p.key for p in plans]

    clock = ManualClock()
    batcher, reports = started(run_batch, clock, max_batch=4, wait_s=1.0, queue_size=8, pad=False)
    try:
        first = batcher.submit(FakePlan("first"))  # type: ignore[arg-type]
        clock.advance(1.0)  # no evidence yet of company: the window is waited
        assert first.future.result(timeout=GUARD_S) == "first"
        waited = [reports.get(timeout=GUARD_S).waited]
        second = batcher.submit(FakePlan("second"))  # type: ignore[arg-type]
        assert second.future.result(timeout=GUARD_S) == "second"  # alone last time: at once
        waited.append(reports.get(timeout=GUARD_S).waited)
        running.clear()
        held = batcher.submit(FakePlan("held"))  # type: ignore[arg-type]
        assert running.wait(GUARD_S)
        together = [batcher.submit(FakePlan("a")) for _ in range(3)]  # type: ignore[arg-type]
        release.set()
        assert held.future.result(timeout=GUARD_S) == "held"
        clock.advance(1.0)  # they came while "held" ran: the window is back, and gathers them
        assert [t.future.result(timeout=GUARD_S) for t in together] == ["a"] * 3
        waited += [reports.get(timeout=GUARD_S).waited for _ in range(2)]
    finally:
        batcher.close()
    assert runs == [["first"], ["second"], ["held"], ["a", "a", "a"]]
    assert waited == [[1.0], [0.0], [0.0], [1.0, 1.0, 1.0]]


def test_a_full_queue_is_429_and_a_drain_runs_what_was_queued_at_once() -> None:
    """A queue of one whose request waits for company: another is 429 with Retry-After; the drain
    ends the window (no company can come), runs the queued request, refuses new ones with 503."""
    from flux2klein_cli.core.serve.batcher import Draining, QueueFull
    from flux2klein_cli.core.serve.server import drain
    from flux2klein_cli.core.serve.service import api_error

    clock = ManualClock()
    batcher, _ = started(lambda plans: [p.key for p in plans], clock, max_batch=2, wait_s=60.0, queue_size=1)
    queued = batcher.submit(FakePlan("queued"))  # type: ignore[arg-type]
    assert clock.waiting.wait(GUARD_S)  # in its window
    with pytest.raises(QueueFull) as full:
        batcher.submit(FakePlan("one too many"))  # type: ignore[arg-type]
    refused = api_error(full.value)
    assert (refused.status, refused.code) == (429, "queue_full") and int(refused.headers["Retry-After"]) >= 1
    service, notes, stopped = SimpleNamespace(batcher=batcher, draining=False), [], threading.Event()
    drain(service, GUARD_S, stopped.set, notes.append)
    assert service.draining and stopped.is_set() and queued.future.result(timeout=0) == "queued"
    assert notes == ["draining: 1 request(s) in flight, up to 30 s"] and clock.now() == 0.0
    with pytest.raises(Draining) as late:
        batcher.submit(FakePlan("late"))  # type: ignore[arg-type]
    assert (api_error(late.value).status, api_error(late.value).code) == (503, "draining")
