"""`flux2klein serve`: an HTTP image server (OpenAI Images API) over one loaded model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flux2klein_cli.cli import options as o
from flux2klein_cli.cli.output import note, user_errors, warn
from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.hub.registry import DEFAULT_MODEL


def serve(
    model: Annotated[str, typer.Option("--model", "-m", help=o.MODEL_HELP_IMAGES)] = DEFAULT_MODEL,
    host: Annotated[str, typer.Option("--host", help="Address to listen on; anything but loopback needs --api-key."
                                      )] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8000,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", help="Bearer token every /v1 and /metrics request must carry \\[default: FLUX2KLEIN_API_KEY]",
        show_default=False)] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", help="Images run as one batch at most.")] = 8,
    batch_wait_ms: Annotated[float, typer.Option("--batch-wait-ms", help="How long a request waits for others of "
                                                 "its shape to batch with, while requests come "
                                                 "together (a lone client waits none).")] = 20.0,
    queue: Annotated[int, typer.Option("--queue", help="Requests waiting at most; beyond it, 429 with Retry-After."
                                       )] = 64,
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", help="Seconds in-flight requests get after "
                                                 "SIGTERM; the rest are answered 503.")] = 30.0,
    max_body_mb: Annotated[float, typer.Option("--max-body-mb", help="Largest request body (uploads included), "
                                               "MiB; larger: 413.")] = 64.0,
    warm: Annotated[str | None, typer.Option("--warm", metavar="WxH[,WxH...]", help="Sizes compiled (or loaded) "
                                             "at every batch size before /readyz turns 200, e.g. 1024x1024,512x512."
                                             )] = None,
    max_sequence_length: o.MaxSequenceOpt = DEFAULTS.max_sequence_length,
    kv_memory: Annotated[int, typer.Option("--kv-memory", help="Reference KV caches kept in memory across edits "
                                           "(KV checkpoints).")] = 4,
    kv_cache_dir: Annotated[Path | None, typer.Option("--kv-cache-dir", help="Keep reference KV caches here too, "
                                                      "across restarts.")] = None,
    dtype: o.DtypeOpt = o.Dtype.bf16,
    mesh: o.MeshOpt = None,
    tpu: o.TpuOpt = None,
    coordinator: o.CoordinatorOpt = None,
    num_processes: o.NumProcessesOpt = None,
    process_id: o.ProcessIdOpt = None,
    compile_cache: o.CompileCacheOpt = None,
    no_save: o.NoSaveOpt = False,
    effort: o.EffortOpt = o.Effort.default,
    lora: o.LoraOpt = [],  # noqa: B006 (typer reads the default; it is never mutated)
    transformer: o.TransformerOpt = None,
    vae: o.VaeOpt = None,
) -> None:
    """Serve images over HTTP: OpenAI's Images API with dynamic batching, jobs and metrics.

    Needs the \\[serve] extra. Endpoints: POST /v1/images/generations, POST /v1/images/edits,
    POST /v1/jobs, GET and DELETE /v1/jobs/ID, GET /healthz, /readyz, /metrics. SIGTERM drains.

    On a multi-host TPU slice (or CPU processes given --coordinator, --num-processes and
    --process-id) every process runs this command: process 0 serves HTTP and sends each batch
    to the others, which run it with it.

    Example: flux2klein serve --model 4b --port 8000 --warm 1024x1024 --max-batch 8
    """
    from flux2klein_cli.core.devices.distributed import DeviceOptions
    from flux2klein_cli.core.engine.engine import EngineOptions
    from flux2klein_cli.core.extras import require_serve
    from flux2klein_cli.core.serve import options as s

    with user_errors():
        require_serve()
        from flux2klein_cli.core.devices.runtime import configure_jax
        from flux2klein_cli.core.hub.snapshot import resolve_model
        from flux2klein_cli.core.serve.server import serve as run_server

        engine = EngineOptions(model=model, dtype=dtype.value, devices=DeviceOptions(
                                   mesh=mesh, tpu=tpu, coordinator=coordinator, num_processes=num_processes,
                                   process_id=process_id),
                               compile_cache=compile_cache, save_executables=not no_save, effort=effort.value,
                               transformer=transformer, vae=vae, lora=tuple(lora), kv_cache_dir=kv_cache_dir,
                               kv_memory=kv_memory)
        options = s.ServeOptions(
            engine=engine, host=host, port=port, api_key=s.api_key(api_key), max_batch=max_batch,
            batch_wait_ms=batch_wait_ms, queue=queue, drain_timeout=drain_timeout,
            max_body_bytes=int(max_body_mb * s.MIB), warm=s.parse_sizes(warm) if warm else (),
            max_sequence_length=max_sequence_length)
        s.check_serve_options(options)  # before jax is configured or anything loads
        configure_jax(warn)
        run_server(options, resolve_model, warn=warn, note=note)
