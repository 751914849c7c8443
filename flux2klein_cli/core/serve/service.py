"""Between HTTP and the engine: a request's fields -> RunFields -> a plan -> a ticket -> PNGs, and
every failure as OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`)."""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flux2klein_cli.core.engine.cost import Admission
from flux2klein_cli.core.engine.engine import Engine, ImageRun
from flux2klein_cli.core.engine.plan import ReferenceSource, RunFields, RunPlan
from flux2klein_cli.core.errors import FieldError, Flux2KleinError, UserInputError
from flux2klein_cli.core.fields import api_param
from flux2klein_cli.core.serve.batcher import Batcher, BatchReport, Cancelled, Draining, QueueFull, Ticket
from flux2klein_cli.core.serve.jobs import JobStore
from flux2klein_cli.core.serve.options import ServeOptions, parse_size

log = logging.getLogger("flux2klein.serve")

RESPONSE_FORMATS = ("b64_json",)


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def kind(self) -> str:
        """The errors-by-kind label of the metrics."""
        return self.code or {400: "bad_request", 401: "unauthorized", 404: "not_found", 413: "too_large",
                             429: "queue_full", 503: "unavailable"}.get(self.status, "server_error")


def api_error(error: BaseException) -> ApiError:
    """Any failure of a request as the error it answers."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, FieldError):
        return ApiError(400, error.named(api_param), param=api_param(error.field))
    if isinstance(error, QueueFull):
        return ApiError(429, str(error), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(error.retry_after)})
    if isinstance(error, Draining):
        return ApiError(503, str(error), type="server_error", code="draining")
    if isinstance(error, Cancelled):
        return ApiError(409, str(error), code="cancelled")
    if isinstance(error, UserInputError):
        text = error.named(api_param)
        return ApiError(400, text, param="image" if text.startswith("reference image") else None)
    if isinstance(error, Flux2KleinError):  # the run failed (out of memory, a non-finite image)
        return ApiError(500, error.named(api_param), type="server_error", code="run_failed")
    log.exception("request failed", exc_info=error)
    return ApiError(500, f"internal error ({type(error).__name__}); the server log has the details",
                    type="server_error", code="internal_error")


def run_fields(body: Mapping[str, Any], references: Sequence[ReferenceSource], max_sequence_length: int,
               init_image: ReferenceSource | None = None, mask: ReferenceSource | None = None) -> RunFields:
    """The fields of an Images API request (already typed by its pydantic model) as a RunFields. A
    mask is read by OpenAI's rule when it has transparency (transparent: repaint), else by its gray
    levels as the CLI reads one (white: repaint)."""
    response_format = body.get("response_format") or "b64_json"
    if response_format == "url":
        raise FieldError("response_format", "url is not supported: this server keeps no files; use b64_json")
    if response_format not in RESPONSE_FORMATS:
        raise FieldError("response_format", f"must be b64_json; got {response_format!r}")
    size = body.get("size")
    width = height = None
    if size is not None and size != "auto":
        width, height = parse_size(size)
    return RunFields(
        prompts=(body["prompt"],), references=tuple(references), height=height, width=width,
        steps=body.get("steps"), guidance=body.get("guidance"), negative_prompt=body.get("negative_prompt") or "",
        seed=body.get("seed", 0), num_images=body.get("n", 1), max_sequence_length=max_sequence_length,
        kv=bool(body.get("kv")), init_image=init_image, mask=mask, strength=body.get("strength"),
        padding_mask_crop=body.get("padding_mask_crop"), mask_alpha=True,
    )


def encode_png(image: np.ndarray) -> str:
    """One (H, W, 3) uint8 image as base64 PNG text."""
    from flux2klein_cli.core.runs.image_files import png_bytes

    return base64.b64encode(png_bytes(image)).decode("ascii")


def image_data(run: ImageRun) -> list[dict[str, str]]:
    return [{"b64_json": encode_png(image)} for image in run.images]


@dataclass
class Served:
    """A ticket's answer: its run and the run's images as the API returns them."""

    run: ImageRun
    data: list[dict[str, str]]


def served(run: ImageRun) -> Served:
    return Served(run, image_data(run))


class Service:
    """The engine, the batcher in front of it, the jobs and the metrics; HTTP-free."""

    def __init__(self, engine: Engine, options: ServeOptions, metrics: Any = None,
                 run_batch: Callable[[Sequence[RunPlan]], Sequence[ImageRun]] | None = None,
                 admission: Admission | None = None):
        """`run_batch`: how a batch runs (default: the engine's; on several processes, the
        lockstep one of core/serve/multihost.py, which first sends the batch to the others);
        `admission`: what the host holds (core/engine/opening.py), asked of every request."""
        self.engine, self.options, self.metrics, self.admission = engine, options, metrics, admission
        self.run_batch = run_batch or engine.run_batch
        self.batcher = Batcher(self.run_batch, max_batch=options.max_batch,
                               wait_s=options.batch_wait_ms / 1000, queue_size=options.queue,
                               pad=options.pad_batches, on_batch=self._on_batch, on_depth=self._on_depth,
                               before_first=self.warm, finish=served)
        self.jobs = JobStore(options.jobs_kept)
        self.draining = False
        self.started = time.time()

    @property
    def model(self) -> str:
        return self.engine.options.model

    @property
    def ready(self) -> bool:
        return self.batcher.started.is_set() and self.batcher.start_error is None and not self.draining

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise FieldError("model", f"is {name!r}; this server serves {self.model!r}")

    def plan(self, body: Mapping[str, Any], references: Sequence[ReferenceSource] = (),
             init_image: ReferenceSource | None = None, mask: ReferenceSource | None = None) -> RunPlan:
        """A request checked against the model (FieldError / UserInputError: 400). No device work."""
        self.check_model(body.get("model"))
        plan = self.engine.plan(run_fields(body, references, self.options.max_sequence_length, init_image, mask))
        if self.admission is not None:
            self.admission.check(plan)
        return plan

    def submit(self, plan: RunPlan) -> Ticket:
        try:
            return self.batcher.submit(plan)
        except (QueueFull, Draining) as e:
            self.count_error(api_error(e))
            raise

    def warm(self) -> None:
        """Compile (or load) each --warm size at every padded batch size, on the worker thread."""
        from flux2klein_cli.core.serve.batcher import padded_count

        counts = sorted({padded_count(k, self.options.max_batch) for k in range(1, self.options.max_batch + 1)}) \
            if self.options.pad_batches else [1]
        for width, height in self.options.warm:
            plan = self.engine.plan(RunFields(prompts=("warm-up",), height=height, width=width,
                                              max_sequence_length=self.options.max_sequence_length))
            for count in counts:
                log.info("warming %dx%d at batch %d", width, height, count)
                self.run_batch([plan] * count)
        self._on_depth(0)

    def count_error(self, error: ApiError) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(kind=error.kind).inc()

    def _on_batch(self, report: BatchReport) -> None:
        if report.error is not None:
            log.warning("a batch of %d request(s) failed: %s", report.plans, report.error)
        if self.metrics is not None:
            self.metrics.on_batch(report, self.engine.stats)

    def _on_depth(self, depth: int) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(depth)
