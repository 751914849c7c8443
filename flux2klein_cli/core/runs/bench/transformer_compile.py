"""`bench --phase transformer-compile`: lower and compile one transformer forward at a model's
real geometry from abstract shapes (no weights needed), every repetition cold."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.models.transformer import Flux2Transformer, TransformerConfig
from flux2klein_cli.core.runs.bench.stats import summarize


def bench_transformer_compile(model: str, *, height: int, width: int, batch: int, reps: int, unrolled: bool,
                              log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Lower and compile seconds (min, median) of `reps` cold compiles of `model`'s transformer."""
    from flux2klein_cli.core.compile.model_configs import configs_from_registry
    from flux2klein_cli.core.hub.registry import spec_for

    spec = spec_for(model)
    geometry = configs_from_registry(spec.alias).geometry
    runs = []
    for i in range(reps):
        runs.append(transformer_compile_seconds(spec.transformer, scan=not unrolled, batch=batch, height=height,
                                                width=width, pixels_per_token=geometry.pixels_per_token))
        if log is not None:
            log(f"rep {i + 1}/{reps}: {runs[-1]['total_s']:.2f} s")
    return dict(
        model=spec.alias, phase="transformer-compile", layers="unrolled" if unrolled else "scan", height=height,
        width=width, batch=batch,
        **{key: summarize([r[key] for r in runs]) for key in ("lower_s", "compile_s", "total_s")},
    )


def transformer_compile_seconds(
    config: dict[str, Any],
    *,
    scan: bool,
    batch: int = 1,
    height: int = DEFAULTS.side,
    width: int = DEFAULTS.side,
    text_tokens: int = DEFAULTS.max_sequence_length,
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
