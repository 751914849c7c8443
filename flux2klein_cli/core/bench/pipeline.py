"""Measurements behind `flux2klein bench`."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flux2klein_cli.core.choices import DTYPES
from flux2klein_cli.core.models.transformer import Flux2Transformer, TransformerConfig


def transformer_compile_seconds(
    config: dict[str, Any],
    *,
    scan: bool,
    batch: int = 1,
    height: int = 1024,
    width: int = 1024,
    text_tokens: int = 512,
    dtype: Any = jnp.bfloat16,
    pixels_per_token: int,
) -> dict[str, float]:
    """Lower and compile one transformer forward from abstract shapes only (no weights);
    `pixels_per_token` is the model's (LatentGeometry).

    Returns trace+lower seconds and XLA compile seconds, separately."""
    jax.clear_caches()  # every repetition is a cold compile, as in a fresh process
    cfg = TransformerConfig.from_dict(config)
    model = nnx.eval_shape(lambda: Flux2Transformer(cfg, dtype=dtype, scan_layers=scan, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    n_img = (height // pixels_per_token) * (width // pixels_per_token)
    seq = text_tokens + n_img

    def forward(state: nnx.State, img: jax.Array, txt: jax.Array, sigma: jax.Array, cos: jax.Array,
                sin: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(img, txt, sigma, (cos, sin))

    args = (
        state,
        jax.ShapeDtypeStruct((batch, n_img, cfg.in_channels), dtype),
        jax.ShapeDtypeStruct((batch, text_tokens, cfg.joint_attention_dim), dtype),
        jax.ShapeDtypeStruct((batch,), jnp.float32),
        jax.ShapeDtypeStruct((seq, cfg.attention_head_dim), jnp.float32),
        jax.ShapeDtypeStruct((seq, cfg.attention_head_dim), jnp.float32),
    )
    start = time.perf_counter()
    lowered = jax.jit(forward).lower(*args)
    lowered_at = time.perf_counter()
    lowered.compile()
    done = time.perf_counter()
    return {"lower_s": lowered_at - start, "compile_s": done - lowered_at, "total_s": done - start}


def summarize(samples: list[float]) -> dict[str, float]:
    return {"min": float(np.min(samples)), "median": float(np.median(samples)), "n": len(samples)}


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


def _warn_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def bench_pipeline(
    model_dir: Any,
    *,
    height: int,
    width: int,
    batch: int,
    steps: int | None,
    reps: int,
    dtype: Any = jnp.bfloat16,
    references: int = 0,
    kv: bool = False,
    mesh: Any = None,
    store: bool = True,
    compile_cache: Path | None = None,
    save: bool = True,
    effort: str = "default",
    warn: Callable[[str], None] = _warn_stderr,
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

    pipeline = KleinPipeline.load(model_dir, dtype=dtype, mesh=mesh, lora=[LoraSpec.parse(t) for t in lora or ()])
    load_s = time.perf_counter() - start
    store_info = None
    if store:
        from flux2klein_cli.core.compile.attach import StoredExecutables
        from flux2klein_cli.core.compile.store import ExecutableStore

        executable_store = ExecutableStore(compile_cache, on_warning=warn)
        pipeline.warn = warn
        pipeline.executables = StoredExecutables(model_dir, executable_store, mesh=mesh, save=save,
                                                 effort=effort)
        store_info = dict(root=str(executable_store.root), save=save, effort=effort)
    from flux2klein_cli.core.registry import sampling

    chosen = sampling(pipeline.snapshot.is_distilled, steps)
    rng = np.random.default_rng(0)
    refs = [rng.uniform(-1, 1, (height, width, 3)).astype(np.float32) for _ in range(references)]
    request = Request(prompts=["a red fox in snow"] * batch, steps=chosen.steps, guidance=chosen.guidance,
                      height=height, width=width, references=refs)
    result = dict(load_s=load_s, load_components_s=pipeline.models.seconds,
                  lora=pipeline.lora.records() if pipeline.lora else [], steps=request.steps, batch=batch,
                  height=height, width=width, references=references, store=store_info,
                  **_time_request(pipeline, request, reps),
                  devices=device_memory(pipeline))
    if not kv:
        return result
    kv_request = dataclasses.replace(request, kv=True)
    kv_run = _time_request(pipeline, kv_request, reps)
    plain_s = result["phases"]["denoise"]["median"]
    kv_s = kv_run["phases"]["denoise"]["median"] + kv_run["phases"]["reference_kv"]["median"]
    n_img = pipeline.geometry.tokens(height, width)
    bound = kv_speedup_bound(pipeline.models.transformer.cfg, text=request.max_sequence_length, image=n_img,
                             refs=references * n_img, steps=request.steps)
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
    def call() -> dict[str, float]:
        pipeline._kv_memory.clear()  # every timed KV request computes its cache
        return pipeline(request).seconds

    if pipeline.executables is not None:
        pipeline.executables.report = []  # a failed load must not show an earlier run's report
    first = call()
    executables = list(pipeline.executables.report) if pipeline.executables is not None else None
    with xla_builds() as built:
        runs = [call() for _ in range(reps)]
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
        pipeline._kv_memory.clear()
        start = time.perf_counter()
        for single in singles:
            if not reuse:
                pipeline._kv_memory.clear()
            pipeline(single)
        return time.perf_counter() - start

    series(True)  # compile for batch 1
    without, with_reuse = series(False), series(True)
    return dict(prompts=prompts, without_s=without, with_s=with_reuse, saving=1 - with_reuse / without)


_DIFFUSERS_TTFI = """
import sys, torch, diffusers
torch.set_num_threads({threads})
pipe = getattr(diffusers, {cls!r}).from_pretrained({model!r}, dtype=getattr(torch, {dtype!r}))
out = pipe(prompt={prompt!r}, height={height}, width={width}, num_inference_steps={steps}, guidance_scale={guidance},
           generator=torch.Generator().manual_seed(0))
out.images[0].save({out!r})
"""


def _timed_process(args: list[str], env: dict[str, str], output: Any) -> float:
    """Wall seconds from process start until it exits with the PNG on disk."""
    import subprocess

    Path(output).unlink(missing_ok=True)
    start = time.perf_counter()
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0 or not Path(output).is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(args[:4])} ... failed: {' / '.join(tail)}")
    return seconds


def bench_ttfi(
    model_dir: Any,
    *,
    height: int,
    width: int,
    steps: int,
    guidance: float,
    reps: int,
    dtype: str,
    diffusers: bool,
) -> dict[str, Any]:
    """Time to first image, process start to PNG on disk, each run a fresh process.

    Ours cold (no stored XLA programs: an empty persistent cache and executable store each
    run) and warm (both filled by a first run); with `diffusers`, the same image through
    diffusers' pipeline, torch threads = 2."""
    import os
    import tempfile

    from flux2klein_cli.core.checkpoint import Snapshot

    snapshot = Snapshot.open(model_dir)
    prompt = "a red fox in snow"
    work = Path(tempfile.mkdtemp(prefix="flux2klein-ttfi-"))
    out = work / "out.png"
    ours = [sys.executable, "-m", "flux2klein_cli", "generate", prompt, "--model", str(model_dir), "-o", str(out),
            "--height", str(height), "--width", str(width), "--steps", str(steps), "--guidance", str(guidance),
            "--dtype", dtype, "--force", "--json"]
    env = dict(os.environ)
    cold = [_timed_process(ours, dict(env, FLUX2KLEIN_XLA_CACHE=str(work / f"cold-{i}"),
                                      FLUX2KLEIN_COMPILE_CACHE=str(work / f"cold-{i}-executables")), out)
            for i in range(reps)]
    warm_env = dict(env, FLUX2KLEIN_XLA_CACHE=str(work / "warm"),
                    FLUX2KLEIN_COMPILE_CACHE=str(work / "warm-executables"))
    _timed_process(ours, warm_env, out)  # fills the cache
    warm = [_timed_process(ours, warm_env, out) for _ in range(reps)]
    result: dict[str, Any] = dict(ours_cold_s=summarize(cold), ours_warm_s=summarize(warm))
    if diffusers:
        code = _DIFFUSERS_TTFI.format(threads=2, cls=snapshot.pipeline_class, model=str(model_dir),
                                      dtype=DTYPES[dtype], prompt=prompt,
                                      height=height, width=width, steps=steps, guidance=guidance, out=str(out))
        ref = [_timed_process([sys.executable, "-c", code], env, out) for _ in range(reps)]
        result["diffusers_s"] = summarize(ref)
        result["cold_ratio"] = result["ours_cold_s"]["median"] / result["diffusers_s"]["median"]
        result["warm_ratio"] = result["ours_warm_s"]["median"] / result["diffusers_s"]["median"]
    return dict(height=height, width=width, steps=steps, dtype=dtype, reps=reps, **result)
