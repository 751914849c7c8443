"""benchmarks/quantize_error.py: the per-layer error tool behind docs/models.md's table, on the medium
geometry (the real geometries are the same code at a larger width), and its velocity-per-step
measure on a tiny checkpoint."""

from __future__ import annotations

import pytest

from benchmarks.quantize_error import VARIANTS, measure


@pytest.mark.slow
def test_per_layer_errors_of_int8_and_bf16() -> None:
    report = measure("medium", 64, 64, 16)
    errors = report["errors"]
    assert set(errors) == {"double", "single", "final"}
    for name in ("double", "single"):
        row = errors[name]
        assert set(row) == {f"{v} {k}" for v in VARIANTS for k in ("output", "update")}
        # Weight rounding alone: well under 1% of what the block adds, and not nothing.
        assert 0 < row["int8 / fp32 act. update"] < 0.02, row
        assert row["int8 / fp32 act. output"] < row["bf16 output"], row
        # Rounding the activations too adds to the weights' rounding.
        assert row["int8 / fp32 act. update"] < row["int8 dynamic / fp32 update"] < 0.05, row
    # The final projection is kept in the model dtype: int8 changes nothing there.
    assert errors["final"]["int8 / fp32 act. output"] == 0.0
    assert errors["final"]["int8 / bf16 act. output"] == errors["final"]["bf16 output"] > 0


@pytest.mark.slow
def test_velocity_errors_per_step_on_a_tiny_checkpoint() -> None:
    from benchmarks.quantize_error import velocity_errors

    report = velocity_errors("tiny", 32, 32, steps=2)
    rows = report["velocity"]
    assert set(rows) == set(VARIANTS) and all(len(r) == 2 for r in rows.values())
    assert all(0 < e < 1e-3 for e in rows["int8 / fp32 act."]), rows  # the weights' rounding alone
    assert all(e > 1e-3 for e in rows["bf16"]), rows  # bf16 arithmetic costs more than int8 weights
