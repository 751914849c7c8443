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


def quantized_writers(key: str, source: TensorSource, shape: tuple[int, ...], checkpoint: SafetensorsCheckpoint,
                      deltas: Deltas | None) -> list[tuple[str, tuple[int, ...], np.dtype, Any]]:
    """The flat entries (name, shape, dtype, fill) of a quantized kernel `<module>.kernel`: the
    int8 kernel, then `<module>.scale` (written after it, so its scales are the ones already computed)."""
    writer = Int8Kernel(checkpoint, source, shape, deltas)
    module = key.removesuffix(".kernel")
    return [(key, shape, np.dtype(np.int8), writer.fill_kernel),
            (f"{module}.scale", writer.scale_shape, np.dtype(np.float32), writer.fill_scale)]
