"""Reference KV caches kept across requests: in memory, and on disk with `--kv-cache-dir`.

The cached K / V depend only on the transformer weights, the compute dtype and the
processed reference pixels (with their sizes and order), so that is the key. On disk an
entry is `<key>.bin` (the four arrays back to back) and `<key>.json` (shapes, dtype, the
SHA-256 of the bytes and the key's inputs), the JSON written last as the commit mark, both
by atomic rename. A missing, corrupt or mismatched entry is recomputed, never used; a store
that cannot be written is a warning, not a failure.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from flux2klein_cli.core.models.transformer import ReferenceKV
from flux2klein_cli.core.temporaries import temporary_file

FORMAT = "flux2klein-reference-kv-1"
FIELDS = ("double_k", "double_v", "single_k", "single_v")
SAMPLE_BYTES = 1 << 16


def references_digest(references: list[np.ndarray]) -> str:
    """SHA-256 of the processed reference pixels, their sizes and their order."""
    digest = hashlib.sha256()
    for image in references:
        pixels = np.ascontiguousarray(image, np.float32)
        digest.update(repr(pixels.shape).encode())
        digest.update(pixels.tobytes())
    return digest.hexdigest()


def weights_identity(directory: Path) -> str:
    """A cheap content identity of a weights directory: every file's name and size, and
    samples of its bytes (start, middle, end). Two checkpoints of the same geometry differ
    in their bytes, not their headers, so sizes alone would not do."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(directory)}:{size}\n".encode())
        with path.open("rb") as f:
            for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


class ReferenceKVStore:
    """One directory of reference KV caches for one model (`identity`) and dtype."""

    def __init__(self, root: Path, identity: str, dtype: Any, warn: Callable[[str], None]):
        self.root, self.identity, self.dtype_name, self.warn = root, identity, jnp.dtype(dtype).name, warn

    def key(self, digest: str) -> str:
        return hashlib.sha256(f"{FORMAT}\n{self.identity}\n{self.dtype_name}\n{digest}".encode()).hexdigest()[:32]

    def load(self, digest: str) -> ReferenceKV | None:
        key = self.key(digest)
        meta_path, data_path = self.root / f"{key}.json", self.root / f"{key}.bin"
        if not meta_path.exists():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            expected = dict(format=FORMAT, identity=self.identity, dtype=self.dtype_name, references=digest)
            if any(meta.get(k) != v for k, v in expected.items()):
                raise ValueError("written for another model, dtype or reference set")
            data = data_path.read_bytes()
            if len(data) != meta["bytes"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
                raise ValueError("its data does not match its checksum")
            dtype = jnp.dtype(meta["dtype"])
            arrays, offset = [], 0
            for shape in meta["shapes"]:
                count = int(np.prod(shape))
                arrays.append(np.frombuffer(data, dtype, count, offset).reshape(shape))
                offset += count * dtype.itemsize
            return ReferenceKV(*(jnp.asarray(a) for a in arrays))
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.warn(f"reference KV cache entry {meta_path} is unusable ({e}); recomputing it")
            return None

    def save(self, digest: str, kv: ReferenceKV) -> None:
        key = self.key(digest)
        arrays = [np.asarray(getattr(kv, name)) for name in FIELDS]
        data = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
        meta = dict(
            format=FORMAT, identity=self.identity, dtype=self.dtype_name, references=digest,
            shapes=[list(a.shape) for a in arrays], fields=list(FIELDS), bytes=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
        )
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            _write_atomic(self.root / f"{key}.bin", data)
            _write_atomic(self.root / f"{key}.json", json.dumps(meta, indent=1).encode())
        except OSError as e:
            self.warn(f"cannot store the reference KV cache in {self.root} ({e.strerror or e}); continuing without")


def _write_atomic(path: Path, data: bytes) -> None:
    with temporary_file(path.parent, path.name) as (fd, tmp):
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

