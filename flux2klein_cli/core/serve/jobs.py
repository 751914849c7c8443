"""Asynchronous jobs: `POST /v1/jobs` queues a request and answers its id at once; the id reads its
state, its progress while it runs (step i of n) and, once done, its images; a queued or running job
can be cancelled (a running one stops at its next chunk of steps). Finished jobs are kept up to a
bound (oldest dropped first), so a client that never reads its job costs bounded memory."""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from flux2klein_cli.core.serve.batcher import Ticket


@dataclass(eq=False)
class Job:
    id: str
    ticket: Ticket
    answer: dict[str, Any] = field(default_factory=dict)  # what the response says of the images (format, size...)
    created: int = field(default_factory=lambda: int(time.time()))
    data: list[dict[str, str]] | None = None  # the images, encoded once when first read
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def state(self) -> str:
        return self.ticket.state


class JobStore:
    def __init__(self, kept: int):
        self.kept = kept
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, ticket: Ticket, answer: dict[str, Any] | None = None) -> Job:
        job = Job("job-" + secrets.token_hex(12), ticket, answer or {})
        with self._lock:
            self._jobs[job.id] = job
            self._trim()
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def _trim(self) -> None:
        finished = [j for j in self._jobs.values() if j.ticket.future.done()]
        for job in finished[:max(0, len(finished) - self.kept)]:
            del self._jobs[job.id]

    def __len__(self) -> int:
        return len(self._jobs)


def job_view(job: Job, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A job as GET /v1/jobs/{id} shows it (without `data` until it succeeded)."""
    out: dict[str, Any] = {"id": job.id, "object": "image.job", "status": job.state, "created": job.created}
    progress = job.ticket.progress
    if job.state == "running" and progress is not None:
        out["progress"] = {"step": progress[0], "steps": progress[1]}
    if job.data is not None:
        out.update(data=job.data, **job.answer)
    if error is not None:
        out["error"] = error["error"]
    return out
