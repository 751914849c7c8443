"""`bench --phase pipeline`: load, first call and steady-state phases of a text-to-image or edit
run through the pipeline, with the executable store or plain jit; a KV edit beside a plain one."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flux2klein_cli.core.models.transformer import TransformerConfig
from flux2klein_cli.core.runs.bench.stats import summarize


def kv_speedup_bound(cfg: TransformerConfig, *, text: int, image: int, refs: int, steps: int) -> float:
    """The transformer speed-up of a KV edit over a plain one that the token counts allow.

    Every block costs per token 2 * (4 D^2 + 3 D H) flops of projections and MLP (double and
    single blocks alike), and 4 * queries * keys * D of attention. A plain edit runs `steps`
    passes over T + N + R tokens; a KV edit one references-only pass (R queries, R keys) and
    `steps` cached passes (T + N queries, T + N + R keys)."""
    d, hidden, blocks = cfg.dim, cfg.mlp_hidden, cfg.num_layers + cfg.num_single_layers

    def flops(queries: int, keys: int) -> float:
        return blocks * (2.0 * queries * (4 * d * d + 3 * d * hidden) + 4.0 * queries * keys * d)

    n = text + image
    plain = steps * flops(n + refs, n + refs)
    return plain / (flops(refs, refs) + steps * flops(n, n + refs))


def bench_pipeline(
    model_dir: Any,
    *,
    height: int,
    width: int,
    batch: int,
    steps: int | None,
    reps: int,
    dtype: Any = jnp.bfloat16,
    references: tuple[tuple[int, int], ...] = (),
    kv: bool = False,
    mesh: Any = None,
    store: bool = True,
    compile_cache: Path | None = None,
    save: bool = True,
    effort: str = "default",
    warn: Callable[[str], None] | None = None,
    lora: list[str] | None = None,
) -> dict[str, Any]:
    """Load, first call and steady-state phases of a text-to-image (or edit) run.

    With `store` (the default, as `generate` and `edit` run) the pipeline's programs come from
    the executable store at `compile_cache` (None: the default store): loaded when stored,
    compiled (and stored, unless not `save`) when not, in the first call's `executables`
    phase; each run reports what the store did per program. Without it every program is
    jit-compiled on first use.

    `compile_s` is the first call's extra time over the steady-state median of each phase:
    with a store, the executables phase plus whatever still traces or compiles on the first
    call; without, tracing and XLA compilation. Either way, what an operator waits for once
    per shape. `timed_compiles` lists the XLA programs built during the timed calls (empty
    when the steady state holds no compilation). With `kv` the same edit runs plain and with
    the reference KV cache (each timed request computes its cache: no reuse), and the
    speed-up is reported beside the token-count bound, with the saving of reusing one cache
    over four prompts.
    """
    from flux2klein_cli.core.pipeline.pipeline import KleinPipeline, Request

    start = time.perf_counter()
    from flux2klein_cli.core.lora.files import LoraSpec

    executables, store_info = None, None
    if store:
        from flux2klein_cli.core.compile.attach import StoredExecutables
        from flux2klein_cli.core.compile.store import ExecutableStore

        executable_store = ExecutableStore(compile_cache, on_warning=warn)  # None: Python warnings
        executables = StoredExecutables(model_dir, executable_store, mesh=mesh, save=save, effort=effort)
        store_info = dict(root=str(executable_store.root), save=save, effort=effort)
    pipeline = KleinPipeline.load(model_dir, dtype=dtype, mesh=mesh, lora=[LoraSpec.parse(t) for t in lora or ()],
                                  executables=executables, warn=warn)
    load_s = time.perf_counter() - start
    from flux2klein_cli.core.hub.registry import sampling

    chosen = sampling(pipeline.snapshot.is_distilled, steps)
    rng = np.random.default_rng(0)
    refs = [rng.uniform(-1, 1, (h, w, 3)).astype(np.float32) for h, w in references]
    request = Request(prompts=["a red fox in snow"] * batch, steps=chosen.steps, guidance=chosen.guidance,
                      height=height, width=width, references=refs)
    result = dict(load_s=load_s, load_components_s=pipeline.models.seconds,
                  lora=pipeline.lora.records() if pipeline.lora else [], steps=request.steps, batch=batch,
                  height=height, width=width, references=[f"{w}x{h}" for h, w in references], store=store_info,
                  **_time_request(pipeline, request, reps),
                  devices=device_memory(pipeline))
    if not kv:
        return result
    kv_request = dataclasses.replace(request, kv=True)
    kv_run = _time_request(pipeline, kv_request, reps)
    plain_s = result["phases"]["denoise"]["median"]
    kv_s = kv_run["phases"]["denoise"]["median"] + kv_run["phases"]["reference_kv"]["median"]
    geometry = pipeline.geometry
    bound = kv_speedup_bound(pipeline.models.transformer.config, text=request.max_sequence_length,
                             image=geometry.tokens(height, width),
                             refs=sum(geometry.tokens(h, w) for h, w in references), steps=request.steps)
    return dict(
        result, kv=kv_run,
        kv_speedup=dict(transformer=plain_s / kv_s, run=result["run_s"]["median"] / kv_run["run_s"]["median"],
                        bound=bound, of_bound=plain_s / kv_s / bound),
        kv_reuse=_time_reuse(pipeline, kv_request, prompts=4),
    )


def device_memory(pipeline: Any) -> dict[str, Any]:
    """Per device: the bytes of model parameters it holds and, where the runtime reports it,
    its peak memory in use."""
    params: dict[str, int] = {}
    for leaf in jax.tree.leaves((pipeline.transformer_state, pipeline.text_state, pipeline.vae_state)):
        for shard in leaf.addressable_shards:
            key = str(shard.device.id)
            params[key] = params.get(key, 0) + int(shard.data.nbytes)
    peaks = {}
    for device in jax.local_devices():
        stats = device.memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            peaks[str(device.id)] = int(stats["peak_bytes_in_use"])
    mesh = pipeline.mesh
    return dict(count=len(params), mesh=None if mesh is None else dict(mesh.shape), parameter_bytes=params,
                peak_bytes=peaks or None)


def _time_request(pipeline: Any, request: Any, reps: int) -> dict[str, Any]:
    def call() -> Any:
        pipeline.forget_reference_kv()  # every timed KV request computes its cache
        return pipeline(request)

    result = call()
    first = result.seconds
    executables = list(result.executables) if pipeline.executables is not None else None
    with xla_builds() as built:
        runs = [call().seconds for _ in range(reps)]
    phases = list(first)
    steady = {p: summarize([r[p] for r in runs]) for p in phases}
    compile_s = sum(max(first[p] - steady[p]["median"], 0.0) for p in phases)
    total = {"min": sum(steady[p]["min"] for p in phases), "median": sum(steady[p]["median"] for p in phases)}
    return dict(compile_s=compile_s, first_call_s=sum(first.values()), first_call=first, phases=steady, run_s=total,
                per_image_s=total["median"] / request.batch, executables=executables, timed_compiles=built)


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax's dispatch.BACKEND_COMPILE_EVENT


@contextlib.contextmanager
def xla_builds() -> Iterator[list[str]]:
    """The names of the XLA programs JAX builds (compiles, or reads from its persistent cache)
    while inside: a deserialized stored executable is not one."""
    names: list[str] = []

    def listener(event: str, seconds: float, **kwargs: Any) -> None:
        if event == _BACKEND_COMPILE:
            names.append(str(kwargs.get("fun_name", "?")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _time_reuse(pipeline: Any, request: Any, prompts: int) -> dict[str, Any]:
    """`prompts` single-prompt KV edits of the same references, one after another: each
    computing its own cache, then reusing the first one's (in memory)."""
    singles = [dataclasses.replace(request, prompts=[f"prompt {i}"]) for i in range(prompts)]

    def series(reuse: bool) -> float:
        pipeline.forget_reference_kv()
        start = time.perf_counter()
        for single in singles:
            if not reuse:
                pipeline.forget_reference_kv()
            pipeline(single)
        return time.perf_counter() - start

    series(True)  # compile for batch 1
    without, with_reuse = series(False), series(True)
    return dict(prompts=prompts, without_s=without, with_s=with_reuse, saving=1 - with_reuse / without)
