"""A transformer file whose tensors arrive quantized (GGUF, ComfyUI fp8 / nvfp4), read as a checkpoint.

The loader and convert read every checkpoint through one interface (SafetensorsCheckpoint's:
`tensors` with torch-layout shapes, `keys`, `view`, `release`, `describe`, `directory`). This
class gives it for quantized files, under diffusers' keys (the files use BFL's names, mapped by
bfl_names exactly as for BFL single files: a fused qkv is three row ranges of one stored tensor):

- `view(key)` is the tensor dequantized (float32, or a float tensor in its stored dtype), one
  tensor at a time and only the rows the key is, so a load never holds more than one
  dequantized tensor beside the model;
- a tensor stored in a form the model can hold as it is (core/models/quantized.py WEIGHT_FORMS:
  Q8_0, fp8) is also readable as its two parts, `KEY#values` and `KEY#scales`, which
  core/weights/prequantized.py plans instead of `KEY` for the linears it keeps quantized.

Each file format says how to read one stored tensor (`StoredTensor`: gguf_file.py, comfy_quant.py).
"""

from __future__ import annotations

import mmap
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.weights.bfl_names import diffusers_parameters

VALUES, SCALES = "#values", "#scales"  # the two parts of a key held in its stored form
Q8_0_BLOCK = 32  # values per GGUF Q8_0 block: a float16 scale, then 32 int8 values


class StoredTensor(Protocol):
    """One tensor as a quantized file stores it."""

    name: str  # the stored key
    file: Path
    shape: tuple[int, ...]  # logical, torch layout: (out, in) for a linear
    kind: str  # what the file calls its type: "Q8_0", "BF16", "fp8", "nvfp4", ...
    form: str | None  # the WEIGHT_FORMS name it can be held in as stored, None: dequantized
    byte_range: tuple[int, int]  # where its bytes (all of them) lie in the file

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows start:stop, dequantized (float32, or the stored float dtype for a float tensor)."""
        ...

    def parts(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows start:stop of a tensor with a `form`: its values (rows, in) and scales ((rows, in / block)
        for a block form, (rows,) for one scale per output channel)."""
        ...


@dataclass(frozen=True)
class Entry:
    """One key: rows `rows` of a stored tensor (or of one of its parts), halves swapped if asked."""

    stored: StoredTensor
    shape: tuple[int, ...]
    rows: tuple[int, int]
    swap_halves: bool = False
    part: str | None = None  # VALUES or SCALES

    @property
    def file(self) -> Path:
        return self.stored.file


def _part_shapes(stored: StoredTensor, count: int) -> dict[str, tuple[int, ...]]:
    """The shapes of `count` rows' parts: values (count, in), scales per block or per row."""
    from flux2klein_cli.core.models.quantized import WEIGHT_FORMS

    form = WEIGHT_FORMS[stored.form]
    width = stored.shape[1]
    scales = (count,) if form.block is None else (count, width // form.block)
    return {VALUES: (count, width), SCALES: scales}


def diffusers_entries(stored: Mapping[str, StoredTensor]) -> dict[str, Entry]:
    """The file's tensors under diffusers' keys (a key BFL's transformer does not have keeps its name,
    and the loader's key check reports it), with the parts of every tensor that has a form."""
    out: dict[str, Entry] = {}
    for key, tensor in stored.items():
        mapped = diffusers_parameters(key) or ((key, None),)
        for name, part in mapped:
            rows = tensor.shape[0] if tensor.shape else 0
            of = part.of if part is not None else 1
            if rows % of:
                raise CheckpointError(f"{tensor.file}: {key} has {rows} rows, not {of} equal parts")
            count = rows // of
            index = part.index if part is not None else 0
            span = (index * count, (index + 1) * count)
            swap = bool(part is not None and part.swap_halves)
            out[name] = Entry(tensor, (count, *tensor.shape[1:]), span, swap)
            if tensor.form is not None and len(tensor.shape) == 2 and not swap:
                for suffix, shape in _part_shapes(tensor, count).items():
                    out[name + suffix] = Entry(tensor, shape, span, part=suffix)
    return out


class QuantizedCheckpoint:
    """A quantized transformer file under diffusers' keys (see the module docstring)."""

    def __init__(self, file: Path, stored: Mapping[str, StoredTensor], file_format: str, mapping: mmap.mmap):
        self.directory = file  # what error messages name, as SafetensorsCheckpoint's
        self.file_format = file_format  # "gguf" or "comfy"
        self.stored = dict(stored)
        self.tensors = diffusers_entries(stored)
        self.mapping = mapping  # the file's one read-only mapping, which every stored tensor views
        self.deltas: Any = None  # LoRA deltas (loader.Deltas): a kept key they change is merged, then rounded again
        self._merged: tuple[str, tuple[np.ndarray, np.ndarray]] | None = None

    @property
    def layout(self) -> str:
        return "bfl" if any(diffusers_parameters(key) for key in self.stored) else "diffusers"

    def keys(self) -> set[str]:
        return set(self.tensors)

    def form(self, key: str) -> str | None:
        """The WEIGHT_FORMS name `key` can be held in as stored (None: it is dequantized)."""
        entry = self.tensors.get(key)
        return None if entry is None or entry.part or entry.swap_halves else entry.stored.form

    def describe(self, key: str) -> str:
        entry = self.tensors[key]
        rows = f" rows {entry.rows[0]}:{entry.rows[1]}" if entry.rows != (0, entry.stored.shape[0]) else ""
        return f"{entry.file.name} (as {entry.stored.name}{rows}, {entry.stored.kind})"

    def kinds(self) -> dict[str, int]:
        """How many stored tensors of each type the file holds, e.g. {"Q4_K": 80, "F32": 40}."""
        return dict(sorted(Counter(t.kind for t in self.stored.values()).items()))

    def view(self, key: str) -> np.ndarray:
        entry = self.tensors[key]
        start, stop = entry.rows
        if entry.part is not None:
            base = key.removesuffix(entry.part)
            if self.deltas is not None and self.deltas.changes(base):
                values, scales = self._merged_parts(base)
            else:
                values, scales = entry.stored.parts(start, stop)
            return values if entry.part == VALUES else scales
        array = entry.stored.rows(start, stop) if entry.stored.shape else entry.stored.rows(0, 0)
        if entry.swap_halves:  # norm_out's modulation: BFL stores shift, scale; diffusers scale, shift
            half = array.shape[0] // 2
            return np.concatenate((array[half:], array[:half]))
        return array

    def _merged_parts(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """Values and scales of `key` with its LoRA delta merged: dequantized to float32, the delta
        added, rounded to the stored form again (the values are read twice, once per part: the
        last key's result is kept). Each call returns the pair it found or made: parameters are read
        on several threads (loader.iter_arrays), and another key's may replace the kept one meanwhile."""
        merged = self._merged
        if merged is None or merged[0] != key:
            weight = np.array(self.view(key), np.float32)
            scratch = np.empty_like(weight)
            self.deltas.add(key, weight, slice(0, weight.shape[0]), slice(0, weight.shape[1]), scratch)
            merged = self._merged = (key, requantize(weight, self.tensors[key].stored.form))
        return merged[1]

    def release(self, key: str) -> None:
        """Drop the file's pages of a tensor read: they stay in the page cache, but no longer count in
        this process's resident memory (as SafetensorsCheckpoint.release)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start, end = self.tensors[key].stored.byte_range
        start -= start % mmap.PAGESIZE
        end = min(len(self.mapping), -(-end // mmap.PAGESIZE) * mmap.PAGESIZE)
        if end > start:
            self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def requantize(weight: np.ndarray, form: str) -> tuple[np.ndarray, np.ndarray]:
    """A float32 (out, in) weight rounded to a WEIGHT_FORMS form: (values, scales) as `parts` gives them.
    q8_0 through gguf's own quantizer (llama.cpp's rounding); fp8 with one scale for the tensor,
    max |w| / 448 (e4m3's largest value), as ComfyUI's fp8 files are made."""
    if form == "q8_0":
        import gguf

        blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
        blocks = blocks.reshape(weight.shape[0], -1, 2 + Q8_0_BLOCK)
        return (blocks[..., 2:].view(np.int8).reshape(weight.shape),
                np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0])
    if form == "fp8":
        import ml_dtypes

        absmax = float(np.abs(weight).max())
        scale = np.float32(absmax / 448.0 if absmax > 0 else 1.0)
        values = (weight / scale).astype(ml_dtypes.float8_e4m3fn)
        return values, np.full(weight.shape[0], scale, np.float32)
    raise AssertionError(form)


def map_file(path: Path) -> mmap.mmap:
    """The file mapped read-only (its tensors are views of it)."""
    try:
        with Path(path).open("rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: an empty file
        raise CheckpointError(f"{path}: cannot read the file ({getattr(e, 'strerror', None) or e})") from None
