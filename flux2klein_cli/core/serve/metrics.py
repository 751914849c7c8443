"""The server's Prometheus metrics, in a registry of its own (nothing of the process's default)."""

from __future__ import annotations

from typing import Any

from flux2klein_cli.core.serve.batcher import BatchReport, Cancelled

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class Metrics:
    def __init__(self, max_batch: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry()
        self.queue_depth = Gauge("flux2klein_queue_depth", "Requests waiting for a batch", registry=registry)
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, max_batch})
        self.batch_size = Histogram("flux2klein_batch_images", "Images per batch run (padding excluded)",
                                    buckets=sizes, registry=registry)
        self.batch_seconds = Histogram("flux2klein_batch_seconds", "Seconds per batch on the device",
                                       buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_seconds = Histogram("flux2klein_queue_wait_seconds", "Seconds a request waited for its batch",
                                       buckets=LATENCY_BUCKETS, registry=registry)
        self.request_seconds = Histogram("flux2klein_request_seconds", "Seconds per image request, end to end",
                                         ["endpoint"], buckets=LATENCY_BUCKETS, registry=registry)
        self.requests = Counter("flux2klein_requests", "Requests answered", ["endpoint", "status"], registry=registry)
        self.images = Counter("flux2klein_images", "Images generated", registry=registry)
        self.errors = Counter("flux2klein_errors", "Errors by kind", ["kind"], registry=registry)
        self.compiled = Gauge("flux2klein_programs_compiled", "Programs compiled by this process", registry=registry)
        self.loaded = Gauge("flux2klein_programs_loaded", "Programs loaded from the executable store",
                            registry=registry)
        self.shapes = Gauge("flux2klein_shapes_kept", "Run shapes whose executables are loaded", registry=registry)
        self.stopped = Counter("flux2klein_batches_stopped", "Batches stopped between chunks: every request in "
                               "them was cancelled or went away", registry=registry)
        self.ready = Gauge("flux2klein_ready", "1 when serving, 0 while warming or draining", registry=registry)

    def on_batch(self, report: BatchReport, stats: Any) -> None:
        self.batch_size.observe(report.images)
        self.batch_seconds.observe(report.seconds)
        for waited in report.waited:
            self.queue_seconds.observe(max(0.0, waited))
        if report.error is None:
            self.images.inc(report.images)
        elif isinstance(report.error, Cancelled):
            self.stopped.inc()
        else:
            self.errors.labels(kind="batch_failed").inc()
        self.compiled.set(stats.programs_compiled)
        self.loaded.set(stats.programs_loaded)
        self.shapes.set(stats.shapes_kept)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
