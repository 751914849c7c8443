"""What XLA says about a compiled program: its memory per device and its cost analysis."""

from __future__ import annotations

import jax


def memory_figures(compiled: jax.stages.Compiled) -> dict[str, int]:
    """`memory_analysis()` per device in bytes, plus `peak`: what the program needs at once
    (arguments + outputs - aliased + temporaries + generated code)."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # some backends do not implement it
        return {}
    if stats is None:
        return {}
    names = {"argument": "argument_size_in_bytes", "output": "output_size_in_bytes",
             "alias": "alias_size_in_bytes", "temp": "temp_size_in_bytes",
             "generated_code": "generated_code_size_in_bytes"}
    figures = {k: int(getattr(stats, v, 0) or 0) for k, v in names.items()}
    figures["peak"] = (figures["argument"] + figures["output"] - figures["alias"] + figures["temp"]
                       + figures["generated_code"])
    return figures


COST_NAMES = {"flops": "flops", "bytes accessed": "bytes_accessed", "transcendentals": "transcendentals",
              "optimal_seconds": "optimal_seconds"}


def cost_figures(compiled: jax.stages.Compiled) -> dict[str, float]:
    """XLA's cost analysis of one program, per device: flops, bytes accessed, transcendentals
    and, where the backend estimates it, `optimal_seconds`. Static counts: a loop body is
    counted once, whatever its trip count. Empty where the backend gives none."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # some backends do not implement it
        return {}
    if isinstance(analysis, list | tuple):  # older jax: one dict per computation
        analysis = analysis[0] if analysis else None
    if not analysis:
        return {}
    return {ours: float(analysis[theirs]) for theirs, ours in COST_NAMES.items()
            if isinstance(analysis.get(theirs), int | float) and analysis[theirs] >= 0}
