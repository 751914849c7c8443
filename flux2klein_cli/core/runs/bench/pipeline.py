"""`bench --phase pipeline`: load, first call and steady-state phases of a text-to-image or edit
run through the pipeline, with the executable store or plain jit; a KV edit beside a plain one."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
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


def bench_pipeline(opening: Any, fields: Any, *, reps: int, kv: bool = False,
                   warn: Callable[[str], None] = lambda message: None,
                   cache: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load, first call and steady-state phases of the text-to-image (or edit) run `fields` asks
    for (`bench_fields`), on the engine `opening` (core/engine/opening.py) loads, planned as
    `generate` plans it.

    With a store (the default, as `generate` and `edit` run) the pipeline's programs come from
    the executable store: loaded when stored, compiled (and stored, unless the options say not
    to save) when not, in the first call's `executables` phase; each run reports what the store
    did per program. Without one every program is jit-compiled on first use.

    `compile_s` is the first call's extra time over the steady-state median of each phase:
    with a store, the executables phase plus whatever still traces or compiles on the first
    call; without, tracing and XLA compilation. Either way, what an operator waits for once
    per shape. `timed_compiles` lists the XLA programs built during the timed calls (empty
    when the steady state holds no compilation). With `kv` the same edit runs plain and with
    the reference KV cache (each timed request computes its cache: no reuse), and the
    speed-up is reported beside the token-count bound, with the saving of reusing one cache
    over four prompts. With `cache` (RunFields' step cache fields) the same run is timed with
    that step cache too: what it skipped and its speed-up, denoising and per image.
    """
    start = time.perf_counter()
    engine = opening.load(warn)
    load_s = time.perf_counter() - start
    options = engine.options
    stored = engine.executables.store
    store_info = None if stored is None else dict(root=str(stored.store.root), save=options.save_executables,
                                                  effort=options.effort)
    plan = engine.plan(fields)
    pipeline = engine.pipeline
    result = dict(load_s=load_s, load_components_s=pipeline.models.seconds, lora=engine.lora_records,
                  steps=plan.steps, batch=plan.batch, height=plan.height, width=plan.width,
                  references=[f"{w}x{h}" for h, w in plan.reference_sizes], store=store_info,
                  **_time_plan(engine, plan, reps), devices=device_memory(pipeline))
    if cache:
        cached = _time_plan(engine, engine.plan(dataclasses.replace(fields, **cache)), reps)
        result["cache"] = dict(cached, speedup=dict(
            denoise=result["phases"]["denoise"]["median"] / cached["phases"]["denoise"]["median"],
            per_image=result["per_image_s"] / cached["per_image_s"]))
    if not kv:
        return result
    kv_plan = engine.plan(dataclasses.replace(fields, kv=True))
    kv_run = _time_plan(engine, kv_plan, reps)
    plain_s = result["phases"]["denoise"]["median"]
    kv_s = kv_run["phases"]["denoise"]["median"] + kv_run["phases"]["reference_kv"]["median"]
    geometry = plan.geometry
    bound = kv_speedup_bound(pipeline.models.transformer.config, text=plan.max_sequence_length,
                             image=geometry.tokens(plan.height, plan.width),
                             refs=sum(geometry.tokens(h, w) for h, w in plan.reference_sizes), steps=plan.steps)
    return dict(
        result, kv=kv_run,
        kv_speedup=dict(transformer=plain_s / kv_s, run=result["run_s"]["median"] / kv_run["run_s"]["median"],
                        bound=bound, of_bound=plain_s / kv_s / bound),
        kv_reuse=_time_reuse(engine, fields, prompts=4),
    )


def bench_fields(batch: int, height: int, width: int, steps: int | None,
                 references: tuple[tuple[int, int], ...] = ()) -> Any:
    """The timed request: `batch` prompts of one image each, and random references of the given
    (height, width) sizes, as uploads (no file is written), kept at their size."""
    import io

    from PIL import Image

    from flux2klein_cli.core.defaults import DEFAULTS
    from flux2klein_cli.core.engine.plan import RunFields

    rng = np.random.default_rng(0)
    uploads = []
    for i, (h, w) in enumerate(references):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)).save(buffer, format="PNG", compress_level=1)
        uploads.append((f"reference-{i}.png", buffer.getvalue()))
    # References under the default area cap are kept at their size as they are; larger ones raise it.
    largest = max((h * w for h, w in references), default=0)
    return RunFields(prompts=("a red fox in snow",) * batch, references=tuple(uploads), height=height, width=width,
                     steps=steps, reference_max_area=largest if largest > DEFAULTS.reference_max_area else None)


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


def _time_plan(engine: Any, plan: Any, reps: int) -> dict[str, Any]:
    def call() -> Any:
        engine.forget_reference_kv()  # every timed KV request computes its cache
        run = engine.run(plan)
        return run, {phase: s for phase, s in run.seconds.items() if phase != "total"}

    result, first = call()
    executables = list(result.executables) if engine.executables.store is not None else None
    cache = {} if result.cache is None else {"report": result.cache}  # what a step cache skipped
    with xla_builds() as built:
        runs = [call()[1] for _ in range(reps)]
    phases = list(first)
    steady = {p: summarize([r[p] for r in runs]) for p in phases}
    compile_s = sum(max(first[p] - steady[p]["median"], 0.0) for p in phases)
    total = {"min": sum(steady[p]["min"] for p in phases), "median": sum(steady[p]["median"] for p in phases)}
    return dict(compile_s=compile_s, first_call_s=sum(first.values()), first_call=first, phases=steady, run_s=total,
                per_image_s=total["median"] / plan.batch, executables=executables, timed_compiles=built, **cache)


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


def _time_reuse(engine: Any, fields: Any, prompts: int) -> dict[str, Any]:
    """`prompts` single-prompt KV edits of the same references, one after another: each
    computing its own cache, then reusing the first one's (in memory)."""
    singles = [engine.plan(dataclasses.replace(fields, prompts=(f"prompt {i}",), kv=True)) for i in range(prompts)]

    def series(reuse: bool) -> float:
        engine.forget_reference_kv()
        start = time.perf_counter()
        for single in singles:
            if not reuse:
                engine.forget_reference_kv()
            engine.run(single)
        return time.perf_counter() - start

    series(True)  # compile for batch 1
    without, with_reuse = series(False), series(True)
    return dict(prompts=prompts, without_s=without, with_s=with_reuse, saving=1 - with_reuse / without)
