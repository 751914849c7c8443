"""Reference KV caches kept across requests: in memory, and on disk with `--kv-cache-dir`.

The cached K / V depend on the transformer weights, the VAE that encoded the references,
the code that computed them (package version and source fingerprint), the compute dtype and
the processed reference pixels (with their sizes and order), so that is the key. On disk an
entry is `<key>.bin` (the four arrays back to back) and `<key>.json` (shapes, dtype, the
SHA-256 of the bytes, the key's inputs, and an HMAC of all that with the directory's key),
the JSON written last as the commit mark, both by atomic rename.

The directory is trusted as the executable store is (core/trust.py): this user's, written
by no one else, each record signed. Every record is checked against a schema and against the
shapes the model expects before its bytes are used. A missing, foreign, corrupt or
mismatched entry is recomputed with one warning, never used; a directory that cannot be
written is a warning, not a failure.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from flux2klein_cli.core import trust
from flux2klein_cli.core.models.transformer import ReferenceKV
from flux2klein_cli.core.temporaries import write_private

FORMAT = "flux2klein-reference-kv-2"
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


def cache_identity(transformer: Path, vae: Path, code: str) -> str:
    """The model and code half of a cache's key: the transformer's and the VAE's weights, the
    package version and `code` (a fingerprint of the source), so another VAE or an upgrade
    never reads an old entry."""
    from flux2klein_cli import __version__

    parts = (f"transformer {weights_identity(transformer)}", f"vae {weights_identity(vae)}",
             f"version {__version__}", f"code {code}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class ReferenceKVStore:
    """One directory of reference KV caches for one model (`identity`) and dtype."""

    def __init__(self, root: Path, identity: str, dtype: Any, warn: Callable[[str], None]):
        self.root, self.identity, self.dtype_name, self.warn = root, identity, jnp.dtype(dtype).name, warn
        self._key: bytes | None = None
        self._refused = False

    def key(self, digest: str) -> str:
        return hashlib.sha256(f"{FORMAT}\n{self.identity}\n{self.dtype_name}\n{digest}".encode()).hexdigest()[:32]

    def _store_key(self, *, create: bool) -> bytes | None:
        """The directory's HMAC key once it is known to be private (warned once otherwise)."""
        if self._key is not None or self._refused:
            return self._key
        try:
            self._key = trust.open_store(self.root, "KV cache directory", create=create)
        except trust.Untrusted as e:
            self._refused = True
            self.warn(f"{e}: reference KV caches there are not used or written")
        except OSError as e:
            self._refused = True
            self.warn(f"cannot store the reference KV cache in {self.root} ({e.strerror or e}); continuing without")
        return self._key

    def load(self, digest: str, shapes: list[tuple[int, ...]]) -> ReferenceKV | None:
        """The cached KV of these references, or None. `shapes` are the four arrays' shapes
        the model expects: a record of any other shape is not used."""
        key = self.key(digest)
        meta_path, data_path = self.root / f"{key}.json", self.root / f"{key}.bin"
        store_key = self._store_key(create=False)
        if store_key is None or not meta_path.exists():
            return None
        try:
            for path in (meta_path, data_path):
                trust.check_private_file(path, "KV cache file")
            meta = json.loads(meta_path.read_text())
            if not isinstance(meta, dict):
                raise ValueError("its record is not a JSON object")
            trust.verify(meta, store_key)
            expected = dict(format=FORMAT, identity=self.identity, dtype=self.dtype_name, references=digest,
                            fields=list(FIELDS), shapes=[list(s) for s in shapes])
            wrong = [k for k, v in expected.items() if meta.get(k) != v]
            if wrong:
                raise ValueError(f"written for another model, dtype, reference set or shape ({', '.join(wrong)})")
            dtype = jnp.dtype(self.dtype_name)
            size = sum(int(np.prod(shape)) for shape in shapes) * dtype.itemsize
            data = data_path.read_bytes()
            if meta.get("bytes") != size or len(data) != size:
                raise ValueError(f"it holds {len(data)} bytes, {size} expected")
            if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
                raise ValueError("its data does not match its checksum")
            arrays, offset = [], 0
            for shape in shapes:
                count = int(np.prod(shape))
                arrays.append(np.frombuffer(data, dtype, count, offset).reshape(shape))
                offset += count * dtype.itemsize
            if not all(np.isfinite(a.astype(np.float32)).all() for a in arrays):
                raise ValueError("it holds non-finite values")
            return ReferenceKV(*(jnp.asarray(a) for a in arrays))
        except (trust.Untrusted, OSError, ValueError) as e:
            self.warn(f"reference KV cache entry {meta_path} is unusable ({e}); recomputing it")
            return None

    def save(self, digest: str, kv: ReferenceKV) -> None:
        store_key = self._store_key(create=True)
        if store_key is None:
            return
        key = self.key(digest)
        arrays = [np.asarray(getattr(kv, name)) for name in FIELDS]
        data = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
        meta = trust.sign(dict(
            format=FORMAT, identity=self.identity, dtype=self.dtype_name, references=digest,
            shapes=[list(a.shape) for a in arrays], fields=list(FIELDS), bytes=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
        ), store_key)
        try:
            write_private(self.root / f"{key}.bin", data)
            write_private(self.root / f"{key}.json", json.dumps(meta, indent=1).encode())
        except OSError as e:
            self.warn(f"cannot store the reference KV cache in {self.root} ({e.strerror or e}); continuing without")


