"""What a denoising progress bar costs: the loop as one call (no bar) against the forms a bar
runs it in (k steps a call, each call queued before the previous one is waited for).

Each form runs the same plan on the engine as `generate` does (stored executables,
loaded or compiled first), its `denoise` phase timed; the forms alternate within each
repetition so that a busy host slows them alike. Cost per step is the form's median over the
single call's, minus one.
"""

from __future__ import annotations

from typing import Any

from flux2klein_cli.core.runs.bench.stats import summarize


def bench_steps(engine: Any, plan: Any, *, reps: int, per_call: tuple[int, ...] = (1,)) -> dict[str, Any]:
    """`plan` on `engine` in each form, `reps` times (after a first call of each)."""
    from flux2klein_cli.core.pipeline.denoise import steps_per_call

    steps = plan.steps
    # k steps a call, or the divisor of the steps nearest below it (every call runs the same program)
    forms: dict[str, int | None] = {"one call": None,
                                    **{f"{k} step(s) a call": steps_per_call(steps, steps // k) for k in per_call}}

    def run(k: int | None) -> float:
        on_step = None if k is None else (lambda done, total: None)  # a bar's callback, drawing nothing
        return engine.run(plan, on_step, steps_per_call=k).seconds["denoise"]

    for k in forms.values():  # first calls: load or compile each form's programs
        run(k)
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(reps):
        for name, k in forms.items():
            times[name].append(run(k))
    base = summarize(times["one call"])
    result = {name: dict(summarize(t), per_step=summarize([x / steps for x in t]),
                         cost=summarize(t)["median"] / base["median"] - 1) for name, t in times.items()}
    return dict(steps=steps, height=plan.height, width=plan.width, batch=plan.batch, reps=reps, forms=result)
