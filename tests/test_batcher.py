"""The serve batcher alone, with fake plans: no HTTP, no model (core/serve/batcher.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class FakePlan:
    """What the batcher reads of a plan: its key and its image count."""

    key: str
    batch: int = 1

    def batch_key(self) -> tuple[str]:
        return (self.key,)


def test_the_batcher_gathers_same_key_plans_and_a_failing_batch_fails_only_its_own() -> None:
    from flux2klein_cli.core.serve.batcher import Batcher, batch_count, padded_count

    runs: list[list[str]] = []

    def run_batch(plans: list[FakePlan], tickets: object) -> list[str]:
        runs.append([p.key for p in plans])
        if plans[0].key == "bad":
            raise RuntimeError("out of memory")
        return [f"{p.key}-result" for p in plans]

    batcher = Batcher(run_batch, max_batch=4, wait_s=0.3, queue_size=8)  # type: ignore[arg-type]
    tickets = [batcher.submit(FakePlan(key)) for key in ("a", "bad", "a", "a", "bad")]
    batcher.start()
    try:
        results = [t.future.exception(timeout=30) or t.future.result() for t in tickets]
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
    from flux2klein_cli.core.serve.batcher import Batcher, Cancelled, Draining, QueueFull

    batcher = Batcher(lambda plans, tickets: list(plans), max_batch=2, wait_s=0.0, queue_size=2)  # not started
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
    from flux2klein_cli.core.serve.batcher import Batcher, BatchReport

    wait_s = 1.0
    release, running = threading.Event(), threading.Event()
    runs: list[list[str]] = []
    reports: list[BatchReport] = []

    def run_batch(plans: list[FakePlan], tickets: object) -> list[str]:
        runs.append([p.key for p in plans])
        running.set()
        if plans[0].key == "held":
            assert release.wait(30)
        return [p.key for p in plans]

    batcher = Batcher(run_batch, max_batch=4, wait_s=wait_s, queue_size=8, pad=False,  # type: ignore[arg-type]
                      on_batch=reports.append)
    batcher.start()
    try:
        for key in ("first", "second"):  # one at a time, as a lone closed-loop client sends them
            assert batcher.submit(FakePlan(key)).future.result(timeout=30) == key  # type: ignore[arg-type]
        running.clear()
        held = batcher.submit(FakePlan("held"))  # type: ignore[arg-type]
        assert running.wait(30)
        together = [batcher.submit(FakePlan("a")) for _ in range(3)]  # type: ignore[arg-type]
        release.set()
        assert held.future.result(timeout=30) == "held"
        assert [t.future.result(timeout=30) for t in together] == ["a"] * 3
    finally:
        batcher.close()
    assert runs == [["first"], ["second"], ["held"], ["a", "a", "a"]]
    waited = [report.waited[0] for report in reports]
    assert waited[0] >= wait_s  # no evidence yet of company: the window is waited
    assert waited[1] < wait_s / 2 and waited[2] < wait_s / 2  # alone last time: at once
    assert len(reports[3].waited) == 3  # arrived while "held" ran: gathered


def test_answers_are_made_off_the_worker_and_a_running_batch_stops_once_all_its_tickets_are_cancelled() -> None:
    """With encoders, batch 2 runs while batch 1's answers are still being made (its `finish`
    waits for batch 2 to start: made on the worker, this would never end), and batch 1's answers
    go out together. A chunked run stops at its next chunk once every ticket of it is cancelled."""
    from flux2klein_cli.core.serve.batcher import Batcher, Cancelled, stop_if_all_cancelled

    second_runs, chunks, answered = threading.Event(), threading.Event(), []

    def run_batch(plans: list[FakePlan], tickets: list) -> list[str]:
        if plans[0].key == "second":
            second_runs.set()
        if plans[0].key == "chunked":
            for _ in range(100_000):  # a loop of many chunks: each asks whether anyone still waits
                chunks.set()
                stop_if_all_cancelled(tickets)
                threading.Event().wait(0.01)
        return [p.key for p in plans]

    def finish(result: str) -> str:
        assert second_runs.wait(30), "batch 2 did not run while batch 1 was being answered"
        answered.append(result)
        return result.upper()

    batcher = Batcher(run_batch, max_batch=2, wait_s=0.05, queue_size=8, pad=False, encoders=2)  # type: ignore[arg-type]
    batcher.start()
    try:
        first = [batcher.submit(FakePlan("first"), finish=finish) for _ in range(2)]  # type: ignore[arg-type]
        second = batcher.submit(FakePlan("second"))  # type: ignore[arg-type]
        assert [t.future.result(timeout=30) for t in first] == ["FIRST", "FIRST"]
        assert second.future.result(timeout=30) == "second"
        chunked = batcher.submit(FakePlan("chunked"))  # type: ignore[arg-type]
        assert chunks.wait(30) and chunked.state == "running"
        assert batcher.cancel(chunked) and not batcher.cancel(chunked)
        assert isinstance(chunked.future.exception(timeout=30), Cancelled) and chunked.state == "cancelled"
        assert batcher.wait_idle(30)  # the loop stopped, long before its 100000 chunks
    finally:
        batcher.close()
    assert answered == ["first", "first"]
