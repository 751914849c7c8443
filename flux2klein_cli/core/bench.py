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
