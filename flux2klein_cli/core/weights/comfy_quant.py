"""ComfyUI-format quantized safetensors files: Black Forest Labs' FLUX.2-klein-*-fp8 and -nvfp4.

Each quantized layer `L` has `L.comfy_quant`, a uint8 tensor holding JSON such as
{"format": "nvfp4"} (or the file's `__metadata__["_quantization_metadata"]` lists the layers),
beside its weight and scales:

- "float8_e4m3fn": `L.weight` e4m3 (out, in), `L.weight_scale` one float32 for the tensor, an
  optional `L.input_scale` (for fp8 activations; weight-only compute does not need it).
  w = weight * weight_scale. Held as fp8 values with that scale (WEIGHT_FORMS["fp8"]).
- "nvfp4": `L.weight` uint8 (out, in / 2), two E2M1 values per byte, the even-indexed one in the
  high nibble (comfy-kitchen's packing, `hi_first`, which ComfyUI loads these files with);
  `L.weight_scale` e4m3, one per 16 values of a row, in cuBLAS's tiled layout (128 x 4 tiles of
  (row, block), see `_untile`) when its shape is the tiled one, else plain (out, in / 16);
  `L.weight_scale_2` one float32. w = e2m1 * (weight_scale_2 * block scale). Dequantized at load.

No library reads this without torch (comfy-kitchen, ComfyUI's own, imports torch and targets
CUDA), so the arithmetic is here, in numpy: a lookup table and a reshape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.weights.quantized_file import QuantizedCheckpoint, map_file
from flux2klein_cli.core.weights.safetensors_io import TensorInfo, read_header, read_metadata

FP8, NVFP4 = "float8_e4m3fn", "nvfp4"
FORMATS = (FP8, NVFP4)
_MARKER = ".comfy_quant"
_METADATA = "_quantization_metadata"
_SCALES = (".weight_scale", ".weight_scale_2", ".input_scale")
NVFP4_BLOCK = 16
# E2M1 codes: sign bit 3, then 2 exponent bits and 1 mantissa bit.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
_TILE_ROWS, _TILE_BLOCKS = 128, 4  # cuBLAS's block-scale tile: 128 rows x 4 blocks, stored as 32 x 16


def is_comfy_quant(tensors: dict[str, TensorInfo], metadata: dict[str, str]) -> bool:
    return _METADATA in metadata or any(key.endswith(_MARKER) for key in tensors)


@dataclass(frozen=True)
class _Stored:
    """A tensor of the file and its view in the file's mapping."""

    info: TensorInfo
    mapping: Any = field(repr=False, compare=False)

    def array(self) -> np.ndarray:
        count = int(np.prod(self.info.shape, dtype=np.int64))
        return np.frombuffer(self.mapping, self.info.dtype, count=count, offset=self.info.start).reshape(
            self.info.shape)


@dataclass(frozen=True)
class FloatTensor:
    """A tensor stored unquantized (norms, layers left in bf16): read as stored."""

    name: str
    file: Path
    shape: tuple[int, ...]
    kind: str
    byte_range: tuple[int, int]
    data: _Stored = field(repr=False)
    form: str | None = None

    def rows(self, start: int, stop: int) -> np.ndarray:
        array = self.data.array()
        return array[start:stop] if array.ndim > 1 else array

    def parts(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        raise AssertionError(f"{self.name} is not quantized")


@dataclass(frozen=True)
class Fp8Tensor:
    name: str
    file: Path
    shape: tuple[int, ...]
    byte_range: tuple[int, int]
    weight: _Stored = field(repr=False)
    scale: float = 1.0
    kind: str = "fp8"
    form: str | None = "fp8"

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self.weight.array()[start:stop].astype(np.float32) * np.float32(self.scale)

    def parts(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        return self.weight.array()[start:stop], np.full(stop - start, self.scale, np.float32)


@dataclass(frozen=True)
class Nvfp4Tensor:
    name: str
    file: Path
    shape: tuple[int, ...]  # (out, in): in = 2 x the packed bytes per row
    byte_range: tuple[int, int]
    weight: _Stored = field(repr=False)
    block_scales: _Stored = field(repr=False)
    scale: float = 1.0
    kind: str = "nvfp4"
    form: str | None = None

    def rows(self, start: int, stop: int) -> np.ndarray:
        packed = self.weight.array()[start:stop]
        codes = np.empty((stop - start, self.shape[1]), np.uint8)
        codes[:, 0::2] = packed >> 4  # the even-indexed value is in the high nibble
        codes[:, 1::2] = packed & 0x0F
        blocks = self.shape[1] // NVFP4_BLOCK
        scales = block_scales(self.block_scales.array(), self.shape[0], blocks)[start:stop].astype(np.float32)
        total = np.float32(self.scale) * scales  # (rows, blocks), as comfy-kitchen scales: per tensor x per block
        values = E2M1[codes].reshape(stop - start, blocks, NVFP4_BLOCK) * total[..., None]
        return values.reshape(stop - start, self.shape[1])

    def parts(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        raise AssertionError("nvfp4 is dequantized at load")


def tiled_shape(rows: int, blocks: int) -> tuple[int, int]:
    """The shape of the block scales of `rows` x `blocks` in cuBLAS's tiled layout (padded to whole tiles)."""
    return -(-rows // _TILE_ROWS) * _TILE_ROWS, -(-blocks // _TILE_BLOCKS) * _TILE_BLOCKS


def block_scales(stored: np.ndarray, rows: int, blocks: int) -> np.ndarray:
    """The (rows, blocks) block scales, from the plain layout or from cuBLAS's tiled one: tiles of
    128 rows x 4 blocks in row-major order of tiles, each tile stored as 32 x 16 where row
    r = 32 i + j and block c sit at [j, 4 i + c]."""
    if stored.shape == (rows, blocks) and tiled_shape(rows, blocks) != (rows, blocks):
        return stored
    tile_rows, tile_cols = (n // m for n, m in zip(tiled_shape(rows, blocks), (_TILE_ROWS, _TILE_BLOCKS),
                                                   strict=True))
    tiles = stored.reshape(tile_rows, tile_cols, 32, 4, 4)  # [tile row, tile col, j, i, c]
    plain = tiles.transpose(0, 3, 2, 1, 4).reshape(tile_rows * _TILE_ROWS, tile_cols * _TILE_BLOCKS)
    return plain[:rows, :blocks]


def open_comfy(path: Path) -> QuantizedCheckpoint:
    """A ComfyUI-format file as a checkpoint; a layer of a format not read, a bad `.comfy_quant`, or
    missing / wrongly typed scales are a CheckpointError naming the file and the layer."""
    path = Path(path)
    tensors = read_header(path)
    formats = _layer_formats(path, tensors, read_metadata(path))
    mapping = map_file(path)
    stored: dict[str, Any] = {}
    used: set[str] = set()
    for layer, fmt in formats.items():
        weight_key = f"{layer}.weight"
        if weight_key not in tensors:
            raise CheckpointError(f"{path}: {layer} is marked {fmt} but has no {weight_key}")
        parts = {suffix: tensors.get(layer + suffix) for suffix in _SCALES}
        used |= {weight_key, layer + _MARKER} | {layer + s for s, info in parts.items() if info is not None}
        stored[weight_key] = _quantized(path, weight_key, fmt, tensors[weight_key], parts, mapping)
    for key, info in tensors.items():
        if key not in used:
            span = (info.start, info.end)
            stored[key] = FloatTensor(key, path, info.shape, _kind(info), span, _Stored(info, mapping))
    return QuantizedCheckpoint(path, stored, "comfy", mapping)


def _kind(info: TensorInfo) -> str:
    return {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}.get(info.dtype.name, info.dtype.name)


def _layer_formats(path: Path, tensors: dict[str, TensorInfo], metadata: dict[str, str]) -> dict[str, str]:
    """Layer -> format, from the `.comfy_quant` tensors (or the header's quantization metadata)."""
    out: dict[str, str] = {}
    if _METADATA in metadata:
        try:
            layers = json.loads(metadata[_METADATA])["layers"]
            out.update({str(layer): str(conf["format"]) for layer, conf in layers.items()})
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{path}: corrupt {_METADATA} in the header (not the JSON ComfyUI writes)") from None
    mapping = None
    for key, info in tensors.items():
        if not key.endswith(_MARKER):
            continue
        layer = key.removesuffix(_MARKER)
        mapping = mapping or map_file(path)
        raw = _Stored(info, mapping).array().tobytes() if info.dtype == np.uint8 else b""
        try:
            out[layer] = str(json.loads(raw.decode())["format"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: {key} does not hold the JSON of a ComfyUI quantization "
                                  "(e.g. {\"format\": \"nvfp4\"})") from None
    unknown = sorted({fmt for fmt in out.values() if fmt not in FORMATS})
    if unknown:
        layer = next(layer for layer, fmt in out.items() if fmt == unknown[0])
        raise CheckpointError(f"{path}: {layer} is quantized as {unknown[0]}, a ComfyUI format flux2klein does not "
                              f"read (it reads {', '.join(FORMATS)})")
    return out


def _scalar(path: Path, key: str, info: TensorInfo | None, mapping: Any) -> float:
    if info is None:
        raise CheckpointError(f"{path}: {key} is missing")
    if info.dtype != np.float32 or int(np.prod(info.shape, dtype=np.int64)) != 1:
        raise CheckpointError(f"{path}: {key} is {info.dtype.name} {list(info.shape)}, expected one float32")
    value = float(_Stored(info, mapping).array().reshape(()))
    if not np.isfinite(value):
        raise CheckpointError(f"{path}: {key} is {value}, not a finite scale")
    return value


def _quantized(path: Path, key: str, fmt: str, info: TensorInfo, parts: dict[str, TensorInfo | None],
               mapping: Any) -> Fp8Tensor | Nvfp4Tensor:
    layer = key.removesuffix(".weight")
    span = (info.start, info.end)
    if info.shape and len(info.shape) != 2:
        raise CheckpointError(f"{path}: {key} is {list(info.shape)}, a quantized weight must be 2-D")
    if fmt == FP8:
        if info.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
            raise CheckpointError(f"{path}: {key} is {info.dtype.name}, float8_e4m3fn expected for {fmt}")
        scale = _scalar(path, f"{layer}.weight_scale", parts[".weight_scale"], mapping)
        return Fp8Tensor(key, path, info.shape, span, _Stored(info, mapping), scale)
    if info.dtype != np.uint8:
        raise CheckpointError(f"{path}: {key} is {info.dtype.name}, packed uint8 expected for {fmt}")
    rows, width = info.shape[0], info.shape[1] * 2
    if width % NVFP4_BLOCK:
        raise CheckpointError(f"{path}: {key} holds rows of {width} values, not whole blocks of {NVFP4_BLOCK}")
    scales = parts[".weight_scale"]
    blocks = width // NVFP4_BLOCK
    if scales is None or scales.dtype != np.dtype(ml_dtypes.float8_e4m3fn) or \
            tuple(scales.shape) not in ((rows, blocks), tiled_shape(rows, blocks)):
        shown = "missing" if scales is None else f"{scales.dtype.name} {list(scales.shape)}"
        raise CheckpointError(f"{path}: {layer}.weight_scale is {shown}; nvfp4 needs float8_e4m3fn block scales "
                              f"{list(tiled_shape(rows, blocks))} (tiled) or {[rows, blocks]}")
    scale = _scalar(path, f"{layer}.weight_scale_2", parts[".weight_scale_2"], mapping)
    return Nvfp4Tensor(key, path, (rows, width), span, _Stored(info, mapping), _Stored(scales, mapping), scale)
