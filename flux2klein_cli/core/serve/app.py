"""The FastAPI app: OpenAI's Images API (generations, edits; answered whole, or streamed as
server-sent events with partial images), jobs, health, readiness, metrics.

The image routes answer under /v1 and without it (clients whose base URL lacks the /v1). A client
that goes away cancels its request (a queued one leaves the queue; a running one stops at its next
chunk of steps when nobody else waits for its batch). fastapi and pydantic (the [serve] extra) are
imported inside `create_app`, so this module imports on a base install. Requests are bounded before
any route reads them (`Guard`: body size, API key, draining); every error is OpenAI's shape
(service.ApiError). Logs carry no prompt or image bytes.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request), which
# are imported inside create_app.
import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from flux2klein_cli.core.limits import LIMITS
from flux2klein_cli.core.serve.batcher import Draining, Ticket
from flux2klein_cli.core.serve.jobs import job_view
from flux2klein_cli.core.serve.service import (
    ApiError,
    ServeRequest,
    Service,
    api_error,
    completed_events,
    encode,
    partial_events,
    response_body,
)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
OPEN_PATHS = ("/healthz", "/readyz")  # probes need no key
API_PATHS = ("/v1/", "/images/")  # refused while draining


class BodyTooLarge(Exception):
    pass


async def send_error(send: Send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """Plain ASGI in front of the app: the API key (constant-time), draining (503), the body bound (413)."""

    def __init__(self, app: Any, service: Service, max_body: int, api_key: str | None):
        self.app, self.service, self.max_body = app, service, max_body
        self.api_key = None if api_key is None else api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        refusal = None
        if path not in OPEN_PATHS and self.api_key is not None and not self._authorized(headers):
            refusal = ApiError(401, "a valid API key is needed: send it as 'Authorization: Bearer KEY'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        elif self.service.draining and path.startswith(API_PATHS):
            refusal = api_error(Draining())
        else:
            length = headers.get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body):
                refusal = ApiError(413, f"the request body is {length.decode(errors='replace')} bytes; the limit "
                                   f"is {self.max_body} bytes", code="body_too_large")
        if refusal is not None:
            self.service.count_error(refusal)
            return await send_error(send, refusal)
        started = False
        received = 0

        async def bounded_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise BodyTooLarge()
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracking_send)
        except BodyTooLarge:
            error = ApiError(413, f"the request body is over the limit of {self.max_body} bytes",
                             code="body_too_large")
            self.service.count_error(error)
            if not started:
                await send_error(send, error)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        value = headers.get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key or b"")


def _request_models() -> tuple[type, type]:
    from pydantic import BaseModel, ConfigDict

    class ImageRequest(BaseModel):
        """`POST /v1/images/generations` and `/v1/jobs`: OpenAI's fields (service.py says what each
        does here), then the extensions."""

        model_config = ConfigDict(extra="forbid")
        prompt: str
        model: str | None = None
        n: int = 1
        size: str | None = None
        quality: str | None = None
        background: str | None = None
        output_format: str | None = None
        output_compression: int | None = None
        response_format: str | None = None
        stream: bool = False
        partial_images: int | None = None
        moderation: str | None = None  # read, not used
        user: str | None = None  # read, not used
        safety_identifier: str | None = None  # read, not used
        seed: int = 0
        steps: int | None = None
        guidance: float | None = None
        negative_prompt: str = ""
        lora_set: str | None = None  # or model: MODEL+SET
        # Step caching (base models): core/pipeline/step_cache.py; None: the mode's defaults.
        cache: str | None = None
        cache_threshold: float | None = None
        cache_warmup: int | None = None
        cache_max_skips: int | None = None
        cache_blocks: int | None = None
        cache_taylorseer: bool | None = None

    class EditRequest(ImageRequest):
        """`POST /v1/images/edits`: the form fields beside the image files."""

        input_fidelity: str | None = None  # read, not used: references condition in full
        kv: bool = False
        strength: float | None = None  # image-to-image / inpainting: the first image is the init image
        padding_mask_crop: int | None = None

    return ImageRequest, EditRequest


def _validation_error(error: Any) -> ApiError:
    first = error.errors()[0]
    loc = [str(part) for part in first.get("loc", ())]
    param = loc[0] if loc else None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return ApiError(400, f"{param} is not a field of this request", param=param)
    if kind == "missing":
        return ApiError(400, f"{param} is missing", param=param)
    message = first.get("msg", "is not valid")
    return ApiError(400, f"{param} {message[:1].lower()}{message[1:]}", param=param)


def sse(data: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event, named as OpenAI names its image events (its `type`)."""
    return f"event: {event or data['type']}\ndata: {json.dumps(data)}\n\n".encode()


def create_app(service: Service) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import ValidationError

    ImageRequest, EditRequest = _request_models()
    metrics = service.metrics
    app = FastAPI(title="flux2klein", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, error: ApiError) -> JSONResponse:
        service.count_error(error)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(404)
    @app.exception_handler(405)
    async def on_http_error(request: Request, error: Any) -> JSONResponse:  # unknown paths and methods
        status = getattr(error, "status_code", 404)
        return await on_api_error(request, ApiError(status, f"{request.method} {request.url.path}: "
                                                    f"{getattr(error, 'detail', 'not found')}",
                                                    code="not_found" if status == 404 else "method_not_allowed"))

    def validated(model: type, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            return model.model_validate(data).model_dump()
        except ValidationError as e:
            raise _validation_error(e) from None

    async def json_body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None
        return validated(ImageRequest, data)

    def count(endpoint: str, status: int, start: float | None = None) -> None:
        if metrics is not None:
            metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
            if start is not None:
                metrics.request_seconds.labels(endpoint=endpoint).observe(time.perf_counter() - start)

    async def images(request: Request, body: dict[str, Any], references: list[tuple[str, bytes]], endpoint: str,
                     init_image: tuple[str, bytes] | None = None, mask: tuple[str, bytes] | None = None) -> Any:
        start = time.perf_counter()
        try:
            asked = await asyncio.to_thread(service.plan, body, references, init_image, mask,
                                            edit=endpoint == "edits")
            if asked.stream:
                return await streamed(request, asked, endpoint, start)
            ticket = service.submit(asked)
            served = await until_done_or_gone(request, ticket)
        except Exception as e:
            count(endpoint, api_error(e).status)
            raise api_error(e) from None
        count(endpoint, 200, start)
        return response_body(asked, served)

    async def until_done_or_gone(request: Request, ticket: Ticket) -> Any:
        """The ticket's answer; a client that disconnects first cancels it."""
        answer = asyncio.ensure_future(asyncio.wrap_future(ticket.future))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not answer.done():
            service.cancel(ticket)
        return await answer

    async def disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def streamed(request: Request, asked: ServeRequest, endpoint: str, start: float) -> Any:
        """Server-sent events as OpenAI's: each partial image (`*.partial_image`), then each image
        (`*.completed`); an error after the stream began is an `error` event. Partial images are
        encoded off the device thread, and sent in order."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any, Any]] = asyncio.Queue()

        def on_partial(index: int, images: Any) -> None:  # on the device thread
            future = service.batcher.offload(lambda: [encode(image, asked.output) for image in images])
            loop.call_soon_threadsafe(events.put_nowait, ("partial", index, future))

        ticket = service.submit(asked, on_partial=on_partial)
        ticket.future.add_done_callback(lambda f: loop.call_soon_threadsafe(events.put_nowait, ("done", f, None)))

        async def stream() -> Any:
            try:
                while True:
                    kind, first, second = await events.get()
                    if kind == "partial":
                        for event in partial_events(asked, first, await asyncio.wrap_future(second)):
                            yield sse(event)
                        continue
                    try:
                        served = first.result()
                    except Exception as e:  # noqa: BLE001 (sent as the stream's error event)
                        error = api_error(e)
                        count(endpoint, error.status)
                        service.count_error(error)
                        yield sse(error.body(), "error")
                        return
                    for event in completed_events(asked, served):
                        yield sse(event)
                    count(endpoint, 200, start)
                    return
            finally:  # the client went away (or the stream ended): nobody waits for the images now
                service.cancel(ticket)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def generations(request: Request) -> Any:
        return await images(request, await json_body(request), [], "generations")

    async def edits(request: Request) -> Any:
        try:
            form = await request.form(max_files=LIMITS.references + 2, max_fields=64)
        except BodyTooLarge:
            raise
        except Exception as e:  # not multipart, or a malformed one
            raise ApiError(400, f"the request body must be multipart/form-data: {e}") from None
        fields: dict[str, Any] = {}
        references: list[tuple[str, bytes]] = []
        masks: list[tuple[str, bytes]] = []
        for key, value in form.multi_items():
            is_file = hasattr(value, "read")
            if key in ("image", "image[]"):
                if not is_file:
                    raise ApiError(400, f"{key} must be an uploaded image file", param="image")
                references.append((value.filename or "image", await value.read()))
            elif key in ("mask", "mask[]"):
                if not is_file:
                    raise ApiError(400, f"{key} must be an uploaded image file", param="mask")
                masks.append((value.filename or "mask", await value.read()))
            elif is_file:
                raise ApiError(400, f"{key} is not a file field of this request (image, image[], mask)", param=key)
            else:
                fields[key] = value
        await form.close()
        if not references:
            raise ApiError(400, "image is missing: upload at least one reference image", param="image")
        if len(masks) > 1:
            raise ApiError(400, f"mask: {len(masks)} were uploaded; give one (it applies to the first image)",
                           param="mask")
        body = validated(EditRequest, fields)
        if masks or body.get("strength") is not None:  # OpenAI's: the first image is the one edited
            return await images(request, body, references[1:], "edits", init_image=references[0],
                                mask=masks[0] if masks else None)
        if body.get("padding_mask_crop") is not None:
            raise ApiError(400, "padding_mask_crop needs a mask", param="padding_mask_crop")
        return await images(request, body, references, "edits")

    for prefix in ("/v1", ""):  # some clients' base URL has no /v1
        app.add_api_route(f"{prefix}/images/generations", generations, methods=["POST"])
        app.add_api_route(f"{prefix}/images/edits", edits, methods=["POST"])

    @app.post("/v1/jobs", status_code=202)
    async def create_job(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        try:
            asked = await asyncio.to_thread(service.plan, body, [])
            if asked.stream:
                raise ApiError(400, "a job is read back, not streamed: drop stream", param="stream")
            job = service.jobs.add(service.submit(asked, job=True), {**asked.output.fields(), "usage": asked.usage})
        except Exception as e:
            raise api_error(e) from None
        return job_view(job)

    def find_job(job_id: str) -> Any:
        job = service.jobs.get(job_id)
        if job is None:
            raise ApiError(404, f"no job {job_id!r} (unknown, or finished long ago)", param="id", code="not_found")
        return job

    @app.get("/v1/jobs/{job_id}")
    async def read_job(job_id: str) -> dict[str, Any]:
        job = find_job(job_id)
        future = job.ticket.future
        if job.state == "succeeded" and job.data is None:
            job.data = future.result().data
        error = api_error(future.exception()).body() if job.state in ("failed", "cancelled") else None
        return job_view(job, error)

    async def cancel_job(job_id: str) -> dict[str, Any]:
        job = find_job(job_id)
        if not service.cancel(job.ticket):
            raise ApiError(409, f"job {job_id} is {job.state}; only a queued or running job can be cancelled",
                           param="id", code="not_cancellable")
        return job_view(job, api_error(job.ticket.future.exception()).body())

    app.add_api_route("/v1/jobs/{job_id}/cancel", cancel_job, methods=["POST"])
    app.add_api_route("/v1/jobs/{job_id}", cancel_job, methods=["DELETE"])

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(service.started),
                                            "owned_by": "flux2klein"} for name in service.model_names]}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if service.ready:
            return JSONResponse({"status": "ready"})
        if service.batcher.start_error is not None:
            state = "failed"
        else:
            state = "draining" if service.draining else "warming"
        return JSONResponse({"status": state}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        if metrics is None:
            raise ApiError(404, "metrics are off", code="not_found")
        metrics.ready.set(1 if service.ready else 0)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return Guard(app, service, service.options.max_body_bytes, service.options.api_key)
