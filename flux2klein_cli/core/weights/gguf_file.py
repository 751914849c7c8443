"""GGUF transformer files: llama.cpp's format, in which FLUX.2 [klein] is shared quantized
(unsloth's and leejet's BF16 / Q8_0 / Q6_K / Q5_K_M / Q4_K_M / Q4_0 files, Kijai's Q8_0).

Tensor names are BFL's (quantized_file.py maps them to diffusers'); shapes are in GGML order,
innermost first, so a linear's (out, in) is stored as [in, out] and read reversed. The `gguf`
package (llama.cpp's own reader) parses the header and dequantizes every block type; this module
only finds each tensor's bytes and, for Q8_0, splits a block into its int8 values and float16
scale, which the library does not expose (it dequantizes straight to float32) and which the
model holds as they are (core/models/quantized.py WEIGHT_FORMS["q8_0"]).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.weights.quantized_file import Q8_0_BLOCK, QuantizedCheckpoint, map_file

SUFFIX = ".gguf"
_MAGIC = b"GGUF"
# The GGML types read: floats, llama.cpp's legacy block types and its K-quants (every type the
# FLUX.2 [klein] GGUF files use, and those city96's and llama.cpp's converters write for image models).
READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_FLOATS = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its bytes in the file's mapping, read as its type says."""

    name: str
    file: Path
    shape: tuple[int, ...]
    kind: str
    byte_range: tuple[int, int]
    qtype: Any = field(repr=False)
    mapping: mmap.mmap = field(repr=False, compare=False)

    @property
    def form(self) -> str | None:
        return "q8_0" if self.kind == "Q8_0" and len(self.shape) == 2 else None

    def _bytes(self) -> np.ndarray:
        """The stored bytes as (rows, bytes per row); rows along the first (outermost) axis."""
        start, end = self.byte_range
        rows = self.shape[0] if len(self.shape) > 1 else 1
        return np.frombuffer(self.mapping, np.uint8, count=end - start, offset=start).reshape(rows, -1)

    def rows(self, start: int, stop: int) -> np.ndarray:
        data = self._bytes()
        if self.kind in _FLOATS:  # as stored: a bf16 tensor reaches a bf16 model without a float32 detour
            return data.view(_FLOATS[self.kind]).reshape(self.shape)[start:stop] if len(self.shape) > 1 \
                else data.view(_FLOATS[self.kind]).reshape(self.shape)
        import gguf

        if len(self.shape) < 2:
            return gguf.quants.dequantize(data, self.qtype).reshape(self.shape)
        return gguf.quants.dequantize(data[start:stop], self.qtype).reshape(stop - start, *self.shape[1:])

    def parts(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Q8_0 rows as (int8 values (rows, in), float16 scales (rows, in / 32)): each block is its
        scale (2 bytes) then its 32 values."""
        blocks = self._bytes()[start:stop].reshape(stop - start, -1, 2 + Q8_0_BLOCK)
        scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
        values = blocks[..., 2:].view(np.int8).reshape(stop - start, -1)
        return values, scales


def is_gguf(path: Path) -> bool:
    return Path(path).suffix.lower() == SUFFIX


def open_gguf(path: Path) -> QuantizedCheckpoint:
    """A GGUF file's tensors as a checkpoint; a damaged file, or a tensor of a type not read, is a
    CheckpointError (exit 2) naming the file."""
    path = Path(path)
    _check_magic(path)
    reader = _reader(path)
    from gguf import GGML_QUANT_SIZES

    size = path.stat().st_size
    mapping = map_file(path)
    stored: dict[str, GGUFTensor] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in READ_TYPES:
            raise CheckpointError(f"{path}: {tensor.name} is stored as {kind}, a GGUF type flux2klein does not read "
                                  f"(it reads {', '.join(READ_TYPES)})")
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        block, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
        start = int(tensor.data_offset)
        end = start + int(tensor.n_bytes)
        expected = int(np.prod(shape, dtype=np.int64)) // block * type_size
        if shape and shape[-1] % block or int(tensor.n_bytes) != expected:
            raise CheckpointError(f"{path}: {tensor.name} has {tensor.n_bytes} bytes, which {kind} {list(shape)} "
                                  "does not fill (a damaged file)")
        if end > size:
            raise CheckpointError(f"{path}: truncated GGUF file ({size} bytes on disk, {tensor.name} ends at {end})")
        stored[tensor.name] = GGUFTensor(tensor.name, path, shape, kind, (start, end), tensor.tensor_type, mapping)
    if not stored:
        raise CheckpointError(f"{path}: the GGUF file holds no tensors")
    return QuantizedCheckpoint(path, stored, "gguf", mapping)


def _check_magic(path: Path) -> None:
    try:
        with path.open("rb") as f:
            head = f.read(len(_MAGIC))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the file ({e.strerror or e})") from None
    if head != _MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (bad magic)")


def _reader(path: Path) -> Any:
    """gguf's reader over the file; its failures on a cut or corrupt header as one CheckpointError."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: damaged GGUF file (truncated or corrupt: {e})") from None
