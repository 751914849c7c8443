"""What a denoising progress bar costs: the loop as one call (no bar) against the forms a bar
runs it in (k steps a call, each call queued before the previous one is waited for).

Each form runs the same request through the pipeline as `generate` does (stored executables,
loaded or compiled first), its `denoise` phase timed; the forms alternate within each
repetition so that a busy host slows them alike. Cost per step is the form's median over the
single call's, minus one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp

from flux2klein_cli.core.runs.bench.stats import summarize


def bench_steps(model_dir: Path, *, height: int, width: int, steps: int, reps: int, dtype: Any = jnp.bfloat16,
                per_call: tuple[int, ...] = (1,), compile_cache: Path | None = None) -> dict[str, Any]:
    from flux2klein_cli.core.compile.attach import StoredExecutables
    from flux2klein_cli.core.compile.store import ExecutableStore
    from flux2klein_cli.core.pipeline.pipeline import KleinPipeline, Request

    pipeline = KleinPipeline.load(model_dir, dtype=dtype,
                                  executables=StoredExecutables(model_dir, ExecutableStore(compile_cache)))
    from flux2klein_cli.core.hub.registry import sampling

    request = Request(prompts=["a red fox in snow"], steps=steps,
                      guidance=sampling(pipeline.snapshot.is_distilled).guidance,
                      height=height, width=width)
    forms: dict[str, int | None] = {"one call": None, **{f"{k} step(s) a call": k for k in per_call}}

    def run(k: int | None) -> float:
        if k is None:
            return pipeline(request).seconds["denoise"]
        pipeline.progress_calls = steps // k  # steps_per_call then picks k (a divisor of steps)
        return pipeline(request, on_step=lambda done, total: None).seconds["denoise"]

    for k in forms.values():  # first calls: load or compile each form's programs
        run(k)
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(reps):
        for name, k in forms.items():
            times[name].append(run(k))
    base = summarize(times["one call"])
    result = {name: dict(summarize(t), per_step=summarize([x / steps for x in t]),
                         cost=summarize(t)["median"] / base["median"] - 1) for name, t in times.items()}
    return dict(steps=steps, height=height, width=width, reps=reps, forms=result)
