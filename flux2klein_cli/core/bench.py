"""Measurements behind `flux2klein bench`."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

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
) -> dict[str, float]:
    """Lower and compile one transformer forward from abstract shapes only (no weights).

    Returns trace+lower seconds and XLA compile seconds, separately."""
    jax.clear_caches()  # every repetition is a cold compile, as in a fresh process
    cfg = TransformerConfig.from_dict(config)
    model = nnx.eval_shape(lambda: Flux2Transformer(cfg, dtype=dtype, scan_layers=scan, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    n_img = (height // 16) * (width // 16)
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
) -> dict[str, Any]:
    """Load, first call and steady-state phases of a text-to-image (or edit) run.

    `compile` is the first call's extra time over the steady-state median of each phase:
    tracing and XLA compilation, what an operator waits for once per shape.
    """
    from flux2klein_cli.core.pipeline.pipeline import KleinPipeline, Request

    start = time.perf_counter()
    pipeline = KleinPipeline.load(model_dir, dtype=dtype)
    load_s = time.perf_counter() - start
    distilled = pipeline.snapshot.is_distilled
    rng = np.random.default_rng(0)
    refs = [rng.uniform(-1, 1, (height, width, 3)).astype(np.float32) for _ in range(references)]
    request = Request(prompts=["a red fox in snow"] * batch, steps=steps or (4 if distilled else 50),
                      guidance=1.0 if distilled else 4.0, height=height, width=width, references=refs)
    first = pipeline(request).seconds
    runs = [pipeline(request).seconds for _ in range(reps)]
    phases = list(first)
    steady = {p: summarize([r[p] for r in runs]) for p in phases}
    compile_s = sum(max(first[p] - steady[p]["median"], 0.0) for p in phases)
    total = {"min": sum(steady[p]["min"] for p in phases), "median": sum(steady[p]["median"] for p in phases)}
    return dict(
        load_s=load_s, load_components_s=pipeline.models.seconds, compile_s=compile_s, first_call_s=sum(first.values()),
        phases=steady, run_s=total, steps=request.steps, batch=batch, height=height, width=width,
        references=references, per_image_s=total["median"] / batch,
    )
