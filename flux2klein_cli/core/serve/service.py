"""Between HTTP and the engine: a request's fields -> RunFields -> a plan -> a ticket -> encoded
images, and every failure as OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`).

The Images API's fields (today's, gpt-image): those with a meaning here act (`size` with `auto`,
`n`, `quality` as steps on base models, `output_format` and `output_compression`, `partial_images`),
`background` is opaque (the model makes no alpha: `transparent` is refused), and `moderation`,
`user`, `safety_identifier` and `input_fidelity` are read and left alone. Anything else is a 400
naming its `param` (the request models in app.py forbid unknown fields).
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flux2klein_cli.core.engine.cost import Admission
from flux2klein_cli.core.engine.engine import Engine, ImageRun
from flux2klein_cli.core.engine.plan import ReferenceSource, RunFields, RunPlan
from flux2klein_cli.core.errors import FieldError, Flux2KleinError, UserInputError
from flux2klein_cli.core.fields import api_param
from flux2klein_cli.core.pipeline.step_cache import CACHE_FIELDS
from flux2klein_cli.core.serve.batcher import (
    Batcher,
    BatchReport,
    Cancelled,
    Draining,
    QueueFull,
    Ticket,
    stop_if_all_cancelled,
)
from flux2klein_cli.core.serve.jobs import JobStore
from flux2klein_cli.core.serve.options import ServeOptions, parse_size

log = logging.getLogger("flux2klein.serve")

RESPONSE_FORMATS = ("b64_json",)
BACKGROUNDS = ("opaque", "auto", "transparent")
QUALITY_CHOICES = ("low", "medium", "high", "auto")
INPUT_FIDELITIES = ("high", "low")
MAX_IMAGES = 10  # n, as the Images API bounds it
MAX_PARTIAL_IMAGES = 3
MODEL_SET_SEPARATOR = "+"  # `model: "4b+style"` picks LoRA set `style`
PROGRESS = ("progress",)  # a ticket mode: the loop in chunks that report steps (jobs)


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


def _choice(body: Mapping[str, Any], name: str, choices: Sequence[str], default: str) -> str:
    value = body.get(name)
    if value is None:
        return default
    if value not in choices:
        raise FieldError(name, f"must be one of {', '.join(choices)}; got {value!r}")
    return str(value)


def _bounded(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is not None and not low <= value <= high:
        raise FieldError(name, f"must be between {low} and {high}; got {value}")
    return value


@dataclass(frozen=True)
class Output:
    """How a request's images go back, and what the response says of them."""

    image_format: str  # png, jpeg, webp
    compression: int | None  # JPEG / WebP quality 0-100 (None: 100); PNG is lossless
    quality: str  # the tier of the steps run (registry.quality_of)
    size: str  # WIDTHxHEIGHT
    background: str = "opaque"  # the model has no alpha

    def fields(self) -> dict[str, str]:
        return {"background": self.background, "output_format": self.image_format, "quality": self.quality,
                "size": self.size}


@dataclass(frozen=True)
class ServeRequest:
    """One Images API request, checked: its plan, its output, its usage, and how it streams."""

    plan: RunPlan
    output: Output
    usage: dict[str, Any]
    stream: bool = False
    partial_images: int = 0
    edit: bool = False

    @property
    def event_prefix(self) -> str:
        return "image_edit" if self.edit else "image_generation"


def run_fields(body: Mapping[str, Any], references: Sequence[ReferenceSource], max_sequence_length: int,
               init_image: ReferenceSource | None = None, mask: ReferenceSource | None = None, *,
               distilled: bool = True, lora_set: str | None = None) -> RunFields:
    """The fields of an Images API request (already typed by its pydantic model) as a RunFields. A
    mask is read by OpenAI's rule when it has transparency (transparent: repaint), else by its gray
    levels as the CLI reads one (white: repaint). `quality` sets a base model's steps."""
    from flux2klein_cli.core.hub.registry import quality_steps

    response_format = body.get("response_format") or "b64_json"
    if response_format == "url":
        raise FieldError("response_format", "url is not supported: this server keeps no files; use b64_json")
    if response_format not in RESPONSE_FORMATS:
        raise FieldError("response_format", f"must be b64_json; got {response_format!r}")
    if _choice(body, "background", BACKGROUNDS, "auto") == "transparent":
        raise FieldError("background", "transparent is not supported: FLUX.2 [klein] makes opaque images (no "
                         "alpha); use opaque or auto")
    _choice(body, "input_fidelity", INPUT_FIDELITIES, "low")  # references always condition in full
    quality = _choice(body, "quality", QUALITY_CHOICES, "auto")
    steps = body.get("steps")
    if quality != "auto" and steps is not None and not distilled:
        raise FieldError("quality", f"and steps both set the steps; give one (quality {quality} is "
                         f"{quality_steps(distilled, quality)} steps)")
    if steps is None:
        steps = quality_steps(distilled, quality)
    n = body.get("n", 1)
    if isinstance(n, int) and not isinstance(n, bool) and n > MAX_IMAGES:
        raise FieldError("num_images", f"must be at most {MAX_IMAGES} (images per request); got {n}")
    size = body.get("size")
    width = height = None
    if size is not None and size != "auto":
        width, height = parse_size(size)
    return RunFields(
        prompts=(body["prompt"],), references=tuple(references), height=height, width=width,
        steps=steps, guidance=body.get("guidance"), negative_prompt=body.get("negative_prompt") or "",
        seed=body.get("seed", 0), num_images=n, max_sequence_length=max_sequence_length,
        kv=bool(body.get("kv")), init_image=init_image, mask=mask, strength=body.get("strength"),
        padding_mask_crop=body.get("padding_mask_crop"), mask_alpha=True, lora_set=lora_set,
        **{name: body.get(name) for name in CACHE_FIELDS},
    )


def output_format(body: Mapping[str, Any]) -> tuple[str, int | None]:
    """The format a request's images go back in, and its compression (None for lossless PNG)."""
    from flux2klein_cli.core.runs.image_files import IMAGE_FORMATS

    image_format = _choice(body, "output_format", IMAGE_FORMATS, "png")
    compression = _bounded(body, "output_compression", 0, 100)
    return image_format, None if image_format == "png" else compression


def usage_of(plan: RunPlan, text_tokens: int) -> dict[str, Any]:
    """Tokens as the model sees them: the prompt's (its tokenizer's count, up to the sequence length),
    each input image's latent tokens, and the latent tokens of every image made."""
    geometry = plan.geometry
    inputs = [plan.init_image.shape[:2]] if plan.init_image is not None else []
    image_tokens = sum(geometry.tokens(h, w) for h, w in [*inputs, *plan.reference_sizes])
    output_tokens = plan.batch * geometry.tokens(plan.height, plan.width)
    return {"input_tokens": text_tokens + image_tokens, "output_tokens": output_tokens,
            "total_tokens": text_tokens + image_tokens + output_tokens,
            "input_tokens_details": {"text_tokens": text_tokens, "image_tokens": image_tokens}}


def encode(image: Any, output: Output) -> str:
    """One (H, W, 3) uint8 image in the request's format, as base64 text."""
    from flux2klein_cli.core.runs.image_files import encode_image

    return base64.b64encode(encode_image(image, output.image_format, quality=output.compression)).decode("ascii")


@dataclass
class Served:
    """A ticket's answer: its run and the run's images as the API returns them."""

    run: ImageRun
    data: list[dict[str, str]]


def partial_schedule(steps: int, count: int) -> tuple[int, tuple[int, ...]]:
    """Steps a call, and after which steps the `count` partial images come: evenly spread over the
    loop's chunk boundaries (each chunk the largest divisor of `steps` that leaves count + 1 calls)."""
    from flux2klein_cli.core.pipeline.denoise import steps_per_call

    per_call = steps_per_call(steps, count + 1)
    calls = steps // per_call
    count = min(count, calls - 1)
    return per_call, tuple(round(i * calls / (count + 1)) * per_call for i in range(1, count + 1))


class Service:
    """The engine, the batcher in front of it, the jobs and the metrics; HTTP-free."""

    def __init__(self, engine: Engine, options: ServeOptions, metrics: Any = None,
                 run_batch: Callable[[Sequence[RunPlan]], Sequence[ImageRun]] | None = None,
                 admission: Admission | None = None):
        """`run_batch`: how a batch runs (default: the engine's; on several processes, the
        lockstep one of core/serve/multihost.py, which first sends the batch to the others: its
        batches run in one call, so no progress or partial images); `admission`: what the host
        holds (core/engine/opening.py), asked of every request."""
        self.engine, self.options, self.metrics, self.admission = engine, options, metrics, admission
        self.lockstep = run_batch is not None
        self.plain_batch = run_batch or engine.run_batch
        self.batcher = Batcher(self.run_batch, max_batch=options.max_batch,
                               wait_s=options.batch_wait_ms / 1000, queue_size=options.queue,
                               pad=options.pad_batches, on_batch=self._on_batch, on_depth=self._on_depth,
                               before_first=self.warm, encoders=options.encode_threads)
        self.jobs = JobStore(options.jobs_kept)
        self.draining = False
        self.started = time.time()

    @property
    def model(self) -> str:
        return self.engine.options.model

    @property
    def model_names(self) -> list[str]:
        """What `model` may be: the model, and the model + each LoRA set's name."""
        return [self.model, *(f"{self.model}{MODEL_SET_SEPARATOR}{name}" for name in self.engine.weight_sets if name)]

    @property
    def ready(self) -> bool:
        return self.batcher.started.is_set() and self.batcher.start_error is None and not self.draining

    def lora_set(self, body: Mapping[str, Any]) -> str | None:
        """The LoRA set a request picks: by `model` (MODEL+SET) or `lora_set`, the same one if both."""
        name, given = body.get("model"), body.get("lora_set")
        chosen = None
        if name is not None and name != self.model:
            base, plus, chosen = name.partition(MODEL_SET_SEPARATOR)
            if base != self.model or not plus:
                raise FieldError("model", f"is {name!r}; this server serves {', '.join(map(repr, self.model_names))}")
        if chosen and given is not None and given != chosen:
            raise FieldError("lora_set", f"is {given!r} but model {name!r} picks {chosen!r}; give one")
        return chosen or given

    def plan(self, body: Mapping[str, Any], references: Sequence[ReferenceSource] = (),
             init_image: ReferenceSource | None = None, mask: ReferenceSource | None = None, *,
             edit: bool = False) -> ServeRequest:
        """A request checked against the model (FieldError / UserInputError: 400). No device work."""
        from flux2klein_cli.core.hub.registry import quality_of

        distilled = self.engine.facts.distilled
        fields = run_fields(body, references, self.options.max_sequence_length, init_image, mask,
                            distilled=distilled, lora_set=self.lora_set(body))
        stream = bool(body.get("stream"))
        partial_images = _bounded(body, "partial_images", 0, MAX_PARTIAL_IMAGES) or 0
        if partial_images and not stream:
            raise FieldError("partial_images", "needs stream: true (partial images come as server-sent events)")
        if partial_images and self.lockstep:
            raise FieldError("partial_images", "is not available on a server of several processes; use 0")
        image_format, compression = output_format(body)  # before any image is read
        plan = self.engine.plan(fields)
        if partial_images and plan.cache is not None:
            raise FieldError("partial_images", "cannot come from a step-cached run (its loop runs in one call); "
                             "use 0, or no cache")
        output = Output(image_format, compression, quality_of(distilled, plan.steps), f"{plan.width}x{plan.height}")
        if self.admission is not None:
            self.admission.check(plan)
        _, mask_rows = self.engine.pipeline.tokenizer([plan.prompts[0]], plan.max_sequence_length)
        return ServeRequest(plan, output, usage_of(plan, int(mask_rows.sum())), stream, partial_images, edit)

    def submit(self, request: ServeRequest, *, job: bool = False,
               on_partial: Callable[[int, Any], None] | None = None) -> Ticket:
        """Queue a request: its answer is `Served` (images encoded off the device thread); a job
        runs in chunks that report progress, a streamed request with partial images in chunks
        that give them to `on_partial(index, images)`."""
        mode: tuple[Any, ...] = ()
        if request.partial_images:
            mode = ("partials", request.partial_images)
        elif job and not self.lockstep:
            mode = PROGRESS
        output = request.output

        def finish(run: ImageRun) -> Served:
            return Served(run, [{"b64_json": encode(image, output)} for image in run.images])

        try:
            return self.batcher.submit(request.plan, mode=mode, finish=finish, on_partial=on_partial)
        except (QueueFull, Draining) as e:
            self.count_error(api_error(e))
            raise

    def cancel(self, ticket: Ticket) -> bool:
        return self.batcher.cancel(ticket)

    def run_batch(self, plans: Sequence[RunPlan], tickets: Sequence[Ticket]) -> Sequence[ImageRun]:
        """One batch on the engine, run as its tickets' mode says (the batcher's RunBatch)."""
        mode = tickets[0].mode
        if not mode:
            return self.plain_batch(plans)

        def on_step(done: int, steps: int) -> None:
            for ticket in tickets:
                ticket.progress = (done, steps)
            stop_if_all_cancelled(tickets)

        if mode == PROGRESS:
            return self.engine.run_batch(plans, on_step)
        per_call, after = partial_schedule(plans[0].loop_steps, mode[1])

        def on_chunk(chunk: Any) -> None:
            if chunk.done not in after:
                return
            stop_if_all_cancelled(tickets)
            images, first = chunk.images(), 0
            for ticket in tickets:
                count = ticket.plan.batch
                if ticket.on_partial is not None and ticket.state != "cancelled":
                    ticket.on_partial(after.index(chunk.done), images[first:first + count])
                first += count

        return self.engine.run_batch(plans, on_step, steps_per_call=per_call, on_chunk=on_chunk)

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
                self.plain_batch([plan] * count)
        self._on_depth(0)

    def count_error(self, error: ApiError) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(kind=error.kind).inc()

    def _on_batch(self, report: BatchReport) -> None:
        if report.error is not None and not isinstance(report.error, Cancelled):
            log.warning("a batch of %d request(s) failed: %s", report.plans, report.error)
        if self.metrics is not None:
            self.metrics.on_batch(report, self.engine.stats)

    def _on_depth(self, depth: int) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(depth)


def response_body(request: ServeRequest, served: Served) -> dict[str, Any]:
    """The Images API's answer: the images and what they are."""
    cache = {} if served.run.cache is None else {"cache": served.run.cache}  # what a step cache skipped
    return {"created": int(time.time()), "data": served.data, **request.output.fields(), "usage": request.usage,
            **cache}


def partial_events(request: ServeRequest, index: int, images: Sequence[str]) -> list[dict[str, Any]]:
    """The `*.partial_image` events of one partial step: one per image, in order."""
    return [{"type": f"{request.event_prefix}.partial_image", "b64_json": data, "partial_image_index": index,
             "created_at": int(time.time()), **request.output.fields()} for data in images]


def completed_events(request: ServeRequest, served: Served) -> list[dict[str, Any]]:
    """The `*.completed` events: one per image, each with the usage of its own image."""
    count = max(1, len(served.data))
    usage = dict(request.usage, output_tokens=request.usage["output_tokens"] // count)
    usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
    return [{"type": f"{request.event_prefix}.completed", "b64_json": item["b64_json"],
             "created_at": int(time.time()), **request.output.fields(), "usage": usage} for item in served.data]
