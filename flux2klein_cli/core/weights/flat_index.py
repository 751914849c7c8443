"""The index of a flat component (flat_store.py) and its data file's header: the format, and
reading and checking them with numpy alone, so a converted directory is checked before jax loads.

    <component>/flat/index.json   {format, version, id, bytes, alignment,
                                   tensors: {name: {dtype, shape, offset, crc32}}}
    <component>/flat/params.bin   a 4 KiB header, then every parameter at a page-aligned offset

The header holds a magic string, the conversion's id (also in the index) and the SHA-256 of
index.json, and the file's size is in the index; every offset is checked to lie inside the
file, aligned and not overlapping another. So a truncated file, an edited index or a data file
from another conversion is a CheckpointError before anything is mapped.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from flux2klein_cli.core.errors import CheckpointError

FLAT_DIR = "flat"
INDEX_FILE = "index.json"
DATA_FILE = "params.bin"
FORMAT = "flux2klein-flat"
VERSION = 1
ALIGNMENT = 4096  # page-aligned: zero-copy needs 64 bytes, and whole pages can be released or read directly
MAGIC = b"flux2klein-flat\n"
HEADER = struct.Struct("<16sI16s32s")  # magic, version, conversion id, SHA-256 of index.json
HEADER_BYTES = ALIGNMENT
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(t) for name, t in (("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16),
                                      ("float32", np.float32), ("float64", np.float64), ("int8", np.int8),
                                      ("float8_e4m3fn", ml_dtypes.float8_e4m3fn),
                                      ("int32", np.int32), ("int64", np.int64), ("uint8", np.uint8), ("bool", np.bool_))
}


@dataclass(frozen=True)
class FlatTensor:
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    crc32: int | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True)
class FlatIndex:
    """A checked index: every tensor lies inside the data file, aligned, with no overlaps."""

    directory: Path
    id: str
    bytes: int
    tensors: dict[str, FlatTensor]

    @property
    def data_file(self) -> Path:
        return self.directory / DATA_FILE


def index_json(conversion_id: str, total: int, entries: dict[str, FlatTensor]) -> bytes:
    return (json.dumps({
        "format": FORMAT,
        "version": VERSION,
        "id": conversion_id,
        "bytes": total,
        "alignment": ALIGNMENT,
        "tensors": {key: {"dtype": e.dtype.name, "shape": list(e.shape), "offset": e.offset, "crc32": e.crc32}
                    for key, e in entries.items()},
    }, indent=1) + "\n").encode()


def read_index(directory: str | Path) -> FlatIndex:
    """The index of a flat component, checked against its data file's header, size and bounds.
    Reads the index and 4 KiB of the data file; any inconsistency is a CheckpointError."""
    directory = Path(directory)
    index_path, data_path = directory / INDEX_FILE, directory / DATA_FILE
    try:
        raw = index_path.read_bytes()
        with data_path.open("rb") as f:
            header = f.read(HEADER.size)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError as e:
        raise CheckpointError(f"{directory}: incomplete flat checkpoint, {Path(e.filename).name} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{directory}: cannot read flat checkpoint ({e.strerror or e})") from None
    try:
        index = json.loads(raw)
        if index.get("format") != FORMAT:
            raise ValueError("not a flat index")
        if index.get("version") != VERSION:
            raise CheckpointError(f"{index_path}: flat layout version {index.get('version')}, this flux2klein "
                                  f"reads version {VERSION}; convert the source snapshot again")
        conversion_id, total = str(index["id"]), int(index["bytes"])
        tensors = {str(k): FlatTensor(DTYPES[v["dtype"]], tuple(int(d) for d in v["shape"]), int(v["offset"]),
                                      None if v.get("crc32") is None else int(v["crc32"]))
                   for k, v in index["tensors"].items()}
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{index_path}: corrupt flat index") from None

    if len(header) < HEADER.size or header[:16] != MAGIC:
        raise CheckpointError(f"{data_path}: not a flux2klein flat data file (bad header)")
    _, version, header_id, index_hash = HEADER.unpack(header)
    if header_id.hex() != conversion_id:
        raise CheckpointError(f"{data_path}: belongs to another conversion than {INDEX_FILE}")
    if index_hash != hashlib.sha256(raw).digest():
        raise CheckpointError(f"{index_path}: modified after conversion (its hash does not match {DATA_FILE})")
    if size != total:
        raise CheckpointError(f"{data_path}: {'truncated' if size < total else 'wrong size'} "
                              f"({size} bytes on disk, the index says {total})")
    end = HEADER_BYTES
    for key, entry in sorted(tensors.items(), key=lambda item: item[1].offset):
        if entry.offset % ALIGNMENT or entry.offset < end or entry.offset + entry.nbytes > total or \
                any(d < 0 for d in entry.shape):
            raise CheckpointError(f"{index_path}: tensor {key!r} is misplaced (offset {entry.offset})")
        end = entry.offset + entry.nbytes
    return FlatIndex(directory, conversion_id, total, tensors)
