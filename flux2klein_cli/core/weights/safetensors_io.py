"""Memory-mapped reading of safetensors checkpoints, single-file or sharded with an index.

The format is an 8-byte little-endian header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the raw bytes. Reading it ourselves gives
numpy views straight onto the page cache in the stored dtype (bf16 included, through
ml_dtypes), so a tensor is converted once, to its target dtype, and never detours
through float32.
"""

from __future__ import annotations

import json
import mmap
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from flux2klein_cli.core.errors import CheckpointError

SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),  # ComfyUI's fp8 weights and nvfp4 block scales
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it looks like on disk."""

    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int
    # Set for a tensor read under another layout's key (core/weights/bfl_layout.py): the stored key,
    # the row range of it this tensor is (None: all rows), and whether its two row halves are swapped.
    stored_key: str | None = None
    rows: tuple[int, int] | None = None
    swap_halves: bool = False


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one .safetensors header; a truncated or corrupt file is a CheckpointError."""
    return _read(path)[0]


def read_metadata(path: Path) -> dict[str, str]:
    """The header's `__metadata__` (string keys and values; {} when it has none)."""
    metadata = _read(path)[1]
    return {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else {}


def _read(path: Path) -> tuple[dict[str, TensorInfo], object]:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path}: truncated or corrupt safetensors file (bad header length)")
            header = json.loads(f.read(header_len))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read safetensors file ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None

    data_start = 8 + header_len
    tensors: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {meta.get('dtype')!r}")
        begin, end = meta["data_offsets"]
        shape = tuple(int(d) for d in meta["shape"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} has a byte size that does not match its shape")
        tensors[name] = TensorInfo(path, dtype, shape, data_start + begin, data_start + end)
    data_end = max((t.end for t in tensors.values()), default=data_start)
    if data_end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file ({size} bytes on disk, header needs {data_end})"
        )
    return tensors, header.get("__metadata__")


class SafetensorsCheckpoint:
    """All tensors of one component directory (or one .safetensors file), memory-mapped lazily,
    file by file, under diffusers' keys: a file in BFL's transformer layout is read through
    `bfl_layout` (its parameters are byte ranges of the stored tensors, nothing is converted)."""

    def __init__(self, directory: Path, tensors: dict[str, TensorInfo]):
        self.directory = directory
        self.tensors = tensors
        self._maps: dict[Path, mmap.mmap] = {}
        self._mapping = threading.Lock()  # tensors are read on several threads (loader.iter_arrays)

    @classmethod
    def open(cls, directory: str | Path) -> SafetensorsCheckpoint:
        directory = Path(directory)
        if directory.is_file():
            return cls._from_tensors(directory, read_header(directory))
        files = _weight_files(directory)
        tensors: dict[str, TensorInfo] = {}
        for file in files:
            tensors.update(read_header(file))
        index = _read_index(directory)
        if index is not None:
            # The index names the file of every key; a key it names must really be there.
            wrong = [k for k, f in index.items() if k not in tensors or tensors[k].file.name != f]
            if wrong:
                raise CheckpointError(
                    f"{directory}: index lists keys not found in their shards: {_first(wrong)}"
                )
        # A composed model's component (core/hub/components.py) links to weights elsewhere: name those.
        if all(f.is_symlink() for f in files):
            targets = [f.resolve() for f in files]
            directory = targets[0] if len(targets) == 1 else targets[0].parent
        return cls._from_tensors(directory, tensors)

    @classmethod
    def _from_tensors(cls, where: Path, tensors: dict[str, TensorInfo]) -> SafetensorsCheckpoint:
        from flux2klein_cli.core.weights import bfl_layout

        return cls(where, bfl_layout.as_diffusers(tensors) if bfl_layout.is_bfl(tensors) else tensors)

    @property
    def layout(self) -> str:
        """"bfl" when the keys were mapped from BFL's layout, else "diffusers"."""
        return "bfl" if any(t.stored_key for t in self.tensors.values()) else "diffusers"

    def keys(self) -> set[str]:
        return set(self.tensors)

    def describe(self, key: str) -> str:
        """The file that holds a key (and the stored key it comes from), for error messages."""
        info = self.tensors[key]
        if info.stored_key is None:
            return info.file.name
        rows = f" rows {info.rows[0]}:{info.rows[1]}" if info.rows else ""
        return f"{info.file.name} (as {info.stored_key}{rows})"

    def release(self, key: str) -> None:
        """Unmap the pages of a tensor that has been copied: the bytes stay in the page cache, but
        no longer count in this process's resident memory (so a load peaks at one tensor over
        the model's size, not at twice it)."""
        info = self.tensors[key]
        buf = self._maps.get(info.file)
        if buf is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = info.start - info.start % mmap.PAGESIZE
        end = min(len(buf), -(-info.end // mmap.PAGESIZE) * mmap.PAGESIZE)
        if end > start:
            buf.madvise(mmap.MADV_DONTNEED, start, end - start)

    def view(self, key: str) -> np.ndarray:
        """A read-only view of the stored tensor, in its stored dtype; no bytes are copied."""
        info = self.tensors[key]
        buf = self._maps.get(info.file)
        if buf is None:
            with self._mapping:
                buf = self._maps.get(info.file)
                if buf is None:
                    with info.file.open("rb") as f:
                        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                    self._maps[info.file] = buf
        count = int(np.prod(info.shape, dtype=np.int64))
        array = np.frombuffer(buf, dtype=info.dtype, count=count, offset=info.start).reshape(info.shape)
        if info.swap_halves:
            # The only copy of the BFL read path: norm_out's modulation (D x 2D, a small tensor).
            half = info.shape[0] // 2
            return np.concatenate((array[half:], array[:half]))
        return array


def _first(names: list[str] | set[str], n: int = 10) -> str:
    names = sorted(names)
    more = f" (and {len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _index_path(directory: Path) -> Path | None:
    found = sorted(directory.glob("*.safetensors.index.json"))
    return found[0] if found else None


def _read_index(directory: Path) -> dict[str, str] | None:
    path = _index_path(directory)
    if path is None:
        return None
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path}: unreadable safetensors index (expected a 'weight_map')") from None
    return {str(k): str(v) for k, v in weight_map.items()}


def _weight_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: component directory not found")
    index = _read_index(directory)
    if index is not None:
        files = [directory / name for name in sorted(set(index.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{directory}: shard(s) listed in {_index_path(directory).name} are missing: {_first(missing)}"
            )
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no .safetensors weights found")
    return files
