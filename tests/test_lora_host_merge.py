"""The host LoRA merge's fast paths (weights/loader.py `_merge_key`, lora/layouts.py `Kronecker.add_to`)
give the very bits of the plain formulas: bf16 widened by moving bits, each band narrowed before it
is transposed, Kronecker blocks as broadcast products of row gathers."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from flux2klein_cli.core.lora.layouts import Kronecker, LowRank
from flux2klein_cli.core.lora.merge import LoraDeltas
from flux2klein_cli.core.weights import loader
from flux2klein_cli.core.weights.bfl_names import Part

BF16 = np.dtype(ml_dtypes.bfloat16)


def _f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def test_widening_bf16_by_its_bits_equals_the_cast() -> None:
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -3e-39, 3.4e38], np.float32)
    stored = np.concatenate([special, _f32(np.random.default_rng(0), 1000)]).astype(BF16).reshape(2, -1)
    block = np.empty(stored.shape, np.float32)
    loader._widen(block, stored)
    np.testing.assert_array_equal(block.view(np.uint32), stored.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("cols", [slice(0, 40), slice(8, 32), slice(3, 37)])  # all, whole w2 blocks, neither
def test_kronecker_block_equals_the_kron_product(cols: slice) -> None:
    rng = np.random.default_rng(1)
    for part in (Part("qkv", index=1, of=3), Part("mod", swap_halves=True)):
        term = Kronecker(_f32(rng, 12, 5), _f32(rng, 24 if part.of == 3 else 8, 8), -0.7, "k", part)
        rows = slice(5, 29)
        block = np.zeros((24, cols.stop - cols.start), np.float32)
        term.add_to(block, rows, cols, np.empty_like(block))
        np.testing.assert_array_equal(block, term.block(rows, cols))


@pytest.mark.parametrize("layout", ["linear", "none"])
def test_banded_bf16_merge_is_one_rounding_of_the_float32_sum(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    rng = np.random.default_rng(2)
    stored = _f32(rng, 96, 40).astype(BF16)
    terms = [LowRank(_f32(rng, 3, 40), _f32(rng, 96, 3), 0.7, "lr"),
             Kronecker(_f32(rng, 12, 5), _f32(rng, 24, 8), 0.5, "fused", Part("qkv", index=1, of=3))]
    monkeypatch.setattr(loader, "_MERGE_BAND_BYTES", 4 * 40 * 16)  # 16-row bands, on the worker threads
    out = np.empty((40, 96) if layout == "linear" else (96, 40), BF16)
    loader._merge_key(out, stored, "w", layout, (), LoraDeltas([], {"w": terms}))

    whole = stored.astype(np.float32)  # the same terms over the whole weight, in one piece
    for term in terms:
        term.add_to(whole, slice(None), slice(None), np.empty_like(whole))
    expected = whole.astype(BF16)
    np.testing.assert_array_equal(out.view(np.uint16), (expected.T if layout == "linear" else expected).view(np.uint16))
