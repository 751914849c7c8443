"""`convert --quantize int8`: the flat writers of quantized linears (core/models/quantized.py
says which linears and how they compute).

Each quantized kernel (L, in, out) is written as int8 with a float32 scale (L, out): scale =
max |w| over the input features / 127 per output channel, w / scale rounded to nearest and
clipped to +-127 (symmetric, no zero point). The source weights (with any LoRA deltas merged,
so LoRAs are merged before they are rounded) are read twice per layer, in blocks of input rows
converted to float32: once for the scale, once to round. Peak memory is one block (64 MiB), so
converting stays as lean as the plain flat writer, whatever the size of one layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flux2klein_cli.core.models.quantized import round_to_int8, scale_from_absmax
from flux2klein_cli.core.weights.loader import Deltas, TensorSource, read_into
from flux2klein_cli.core.weights.safetensors_io import SafetensorsCheckpoint

_BLOCK_ELEMENTS = 16 << 20  # float32 elements read at once: 64 MiB


class Int8Kernel:
    """The two flat entries of one quantized kernel: `fill_kernel` and `fill_scale`, with the
    flat writer's `fill(out, index)` signature (index: slices of the leading axes)."""

    def __init__(self, checkpoint: SafetensorsCheckpoint, source: TensorSource, shape: tuple[int, ...],
                 deltas: Deltas | None = None):
        self.checkpoint, self.source, self.shape, self.deltas = checkpoint, source, shape, deltas
        self.stacked = source.stacked
        self._scales: dict[int | None, np.ndarray] = {}

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-2], self.shape[-1])

    def _layers(self, index: tuple[slice, ...]) -> tuple[list[int | None], slice]:
        """The layers and the input rows one writer piece covers."""
        if not self.stacked:
            return [None], index[0] if index else slice(None)
        layers = list(range(self.shape[0])[index[0]]) if index else list(range(self.shape[0]))
        return layers, index[1] if len(index) > 1 else slice(None)

    def _read(self, layer: int | None, rows: slice) -> np.ndarray:
        """Input rows `rows` of one layer's kernel, (rows, out) float32."""
        start, stop, _ = rows.indices(self.shape[-2])
        out = np.empty((stop - start, self.shape[-1]), np.float32)
        if layer is None:
            read_into(out, self.checkpoint, self.source, (slice(start, stop),), self.deltas)
        else:
            read_into(out[None], self.checkpoint, self.source, (slice(layer, layer + 1), slice(start, stop)),
                      self.deltas)
        return out

    def _blocks(self, rows: slice) -> list[slice]:
        start, stop, _ = rows.indices(self.shape[-2])
        step = max(1, _BLOCK_ELEMENTS // max(self.shape[-1], 1))
        return [slice(a, min(a + step, stop)) for a in range(start, stop, step)]

    def layer_scale(self, layer: int | None) -> np.ndarray:
        if layer not in self._scales:
            absmax = np.zeros(self.shape[-1], np.float32)
            for rows in self._blocks(slice(None)):
                np.maximum(absmax, np.abs(self._read(layer, rows)).max(axis=0), out=absmax)
            self._scales[layer] = scale_from_absmax(absmax)
        return self._scales[layer]

    def fill_kernel(self, out: np.ndarray, index: tuple[slice, ...]) -> None:
        layers, rows = self._layers(index)
        start = rows.indices(self.shape[-2])[0]
        for slot, layer in enumerate(layers):
            dest = out if layer is None else out[slot]
            scale = self.layer_scale(layer)
            for block in self._blocks(rows):
                dest[block.start - start:block.stop - start] = round_to_int8(self._read(layer, block), scale)

    def fill_scale(self, out: np.ndarray, index: tuple[slice, ...]) -> None:
        layers = [None] if not self.stacked else (list(range(self.shape[0])[index[0]]) if index
                                                  else list(range(self.shape[0])))
        for slot, layer in enumerate(layers):
            (out if layer is None else out[slot])[...] = self.layer_scale(layer)
        if self.stacked:  # the kernel's writer read them all first; nothing more will ask for them
            for layer in layers:
                self._scales.pop(layer, None)


class Int8Rows:
    """A token table (V, D) as int8 with a float32 scale per row: each piece of rows is read once
    for its values and once more for its scales (the table is one tensor; reading it twice is cheap)."""

    def __init__(self, checkpoint: SafetensorsCheckpoint, source: TensorSource, shape: tuple[int, ...]):
        self.checkpoint, self.source, self.shape = checkpoint, source, shape

    def _rows(self, index: tuple[slice, ...]) -> tuple[np.ndarray, np.ndarray]:
        start, stop, _ = (index[0] if index else slice(None)).indices(self.shape[0])
        step = max(1, _BLOCK_ELEMENTS // max(self.shape[1], 1))
        q = np.empty((stop - start, self.shape[1]), np.int8)
        scale = np.empty(stop - start, np.float32)
        for a in range(start, stop, step):
            b = min(a + step, stop)
            w = np.empty((b - a, self.shape[1]), np.float32)
            read_into(w, self.checkpoint, self.source, (slice(a, b),))
            scale[a - start:b - start] = scale_from_absmax(np.abs(w).max(axis=1))
            q[a - start:b - start] = round_to_int8(w, scale[a - start:b - start, None])
        return q, scale

    def fill_table(self, out: np.ndarray, index: tuple[slice, ...]) -> None:
        out[...] = self._rows(index)[0]

    def fill_scale(self, out: np.ndarray, index: tuple[slice, ...]) -> None:
        out[...] = self._rows(index)[1]


def quantized_writers(key: str, source: TensorSource, shape: tuple[int, ...], checkpoint: SafetensorsCheckpoint,
                      deltas: Deltas | None) -> list[tuple[str, tuple[int, ...], np.dtype, Any]]:
    """The flat entries (name, shape, dtype, fill) of a quantized kernel `<module>.kernel`: the
    int8 kernel, then `<module>.scale` (written after it, so its scales are the ones already computed)."""
    if key.endswith(".embedding"):  # a token table: per row (LoRAs never touch it)
        rows = Int8Rows(checkpoint, source, shape)
        module = key.removesuffix(".embedding")
        return [(key, shape, np.dtype(np.int8), rows.fill_table),
                (f"{module}.scale", shape[:1], np.dtype(np.float32), rows.fill_scale)]
    writer = Int8Kernel(checkpoint, source, shape, deltas)
    module = key.removesuffix(".kernel")
    return [(key, shape, np.dtype(np.int8), writer.fill_kernel),
            (f"{module}.scale", writer.scale_shape, np.dtype(np.float32), writer.fill_scale)]
