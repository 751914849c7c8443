"""The measurement behind `bench --phase decode`: the VAE decoder alone, on random latents of an
image size, as the pipeline calls it (one jitted program, weights as arguments).

The first call's extra time over the steady state is compile; then --reps timed calls. Compare
the full decoder with the small one by running it on a model and with `--vae small-decoder`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def bench_decode(model_dir: Path, *, height: int, width: int, batch: int, reps: int, dtype: Any,
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`height` x `width`: checked by the plan's size rule (BenchOptions.planned)."""
    import jax
    import numpy as np
    from flax import nnx

    from flux2klein_cli.core.models.vae import load_vae
    from flux2klein_cli.core.pipeline.programs import decode_latents, jit_module_call
    from flux2klein_cli.core.runs.bench.stats import summarize

    start = time.perf_counter()
    vae = load_vae(Path(model_dir) / "vae", dtype=dtype)
    state = nnx.state(vae)
    jax.block_until_ready(state)
    load_s = time.perf_counter() - start
    factor = vae.config.spatial_factor  # pixels per latent (patchified) position
    shape = (batch, height // factor, width // factor, vae.config.patched_channels)
    latents = jax.numpy.asarray(np.random.default_rng(0).standard_normal(shape, np.float32))
    decode = jit_module_call(vae, decode_latents)

    def call() -> float:
        begin = time.perf_counter()
        jax.block_until_ready(decode(state, latents))
        return time.perf_counter() - begin

    first = call()
    runs = []
    for rep in range(reps):
        runs.append(call())
        if log:
            log(f"rep {rep + 1}/{reps}: {runs[-1]:.2f} s")
    timing = summarize(runs)
    widths = list(vae.config.decoder_block_out_channels)
    return dict(height=height, width=width, batch=batch, load_s=load_s, compile_s=max(first - timing["min"], 0.0),
                decode_s=timing, decoder_widths=widths,
                parameters=int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(vae.decoder)))))
