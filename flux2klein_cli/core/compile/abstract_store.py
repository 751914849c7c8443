"""Abstract models kept across processes, inside the executable store.

A model's abstract build (`nnx.eval_shape` of its constructor: every module made, every attribute
flax checks) is about a fifth of a second of a warm `generate`'s start for the three models, on
one core while the other idles; unpickling the graph and shapes it gives takes milliseconds
(docs/benchmarks.md). A pickle is code, so these entries are trusted as the executables beside them
are (core/trust.py): a directory only this user can write, and a record carrying the store's HMAC
over the payload's sha256, checked before anything is unpickled. An entry's name is a digest of
everything a build depends on: its key (model, config, dtype, form: layers.abstract_module), the
package's source (code_fingerprint) and the versions of Python, jax and flax. Anything off is a
rebuild, never an error, and says nothing: the executable store warns about an untrusted store.

Layout: `<store>/abstract-models/<digest>.pickle` and `<digest>.json` (the signed record); the
newest KEPT entries are kept, older ones removed as new ones are written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle
import platform
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from flux2klein_cli.core import trust
from flux2klein_cli.core.cache_paths import executables_dir
from flux2klein_cli.core.temporaries import write_private

DIRECTORY = "abstract-models"
PAYLOAD, RECORD = ".pickle", ".json"
KEPT = 32  # entries (one per model, config, dtype and source): a few models' worth of edits


class AbstractModelStore:
    """`get` / `put` of (graphdef, abstract state) pairs by their abstract_module key; what
    layers.back_abstract_builds takes. `save` False: read, never write (a run told not to store)."""

    def __init__(self, root: str | Path | None = None, *, save: bool = True):
        self.root = Path(root).expanduser() if root is not None else executables_dir()
        self.directory = self.root / DIRECTORY
        self.save = save
        self._key: bytes | None = None

    def _store_key(self, *, create: bool) -> bytes | None:
        if self._key is None:
            with contextlib.suppress(trust.Untrusted, OSError):
                self._key = trust.open_store(self.root, "executable store", create=create)
        return self._key

    def entry_name(self, key: Hashable) -> str:
        import flax
        import jax

        from flux2klein_cli.core.compile.keys import code_fingerprint

        described = repr((key, code_fingerprint(), platform.python_version(), jax.__version__, flax.__version__))
        return hashlib.sha256(described.encode()).hexdigest()

    def get(self, key: Hashable) -> tuple[Any, Any] | None:
        """The stored build of `key`, or None (none stored, or not one this user's store signed)."""
        store_key = self._store_key(create=False)
        if store_key is None:
            return None
        name = self.entry_name(key)
        payload_path, record_path = self.directory / f"{name}{PAYLOAD}", self.directory / f"{name}{RECORD}"
        try:
            trust.check_private_dir(self.directory, "abstract-model directory")
            trust.check_private_file(record_path)
            trust.check_private_file(payload_path)
            record = json.loads(record_path.read_text())
            if not isinstance(record, dict) or record.get("entry") != name:
                return None
            trust.verify(record, store_key)
            payload = payload_path.read_bytes()
        except (trust.Untrusted, OSError, ValueError):
            return None
        if record.get("sha256") != hashlib.sha256(payload).hexdigest():
            return None
        try:
            # Authenticated above (the signed record holds this payload's sha256): only now unpickled.
            built = pickle.loads(payload)  # noqa: S301
        except Exception:  # a payload this Python cannot rebuild: build it again
            return None
        return built if isinstance(built, tuple) and len(built) == 2 else None

    def put(self, key: Hashable, built: tuple[Any, Any]) -> None:
        """Keep `built` for the next process; nothing when it cannot be pickled or the store refuses."""
        if not self.save:
            return
        try:
            payload = pickle.dumps(built, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # a build holding what pickle cannot (a lambda): built in each process
            return
        store_key = self._store_key(create=True)
        if store_key is None:
            return
        name = self.entry_name(key)
        record = trust.sign({"entry": name, "model": str(key[0]) if isinstance(key, tuple) and key else str(key),
                             "sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload),
                             "created": time.time()}, store_key)
        try:
            trust.make_private_dir(self.directory)
            # The payload first: a record found is never older than its payload (a reader of a
            # half-replaced pair sees a sha256 mismatch and builds).
            write_private(self.directory / f"{name}{PAYLOAD}", payload)
            write_private(self.directory / f"{name}{RECORD}", json.dumps(record, sort_keys=True).encode())
            self._prune()
        except OSError:
            return

    def _prune(self) -> None:
        """Remove all but the newest KEPT entries (an edited package leaves its old entries behind)."""
        records = sorted(self.directory.glob(f"*{RECORD}"), key=_mtime, reverse=True)
        for record in records[KEPT:]:
            for path in (record, record.with_suffix(PAYLOAD)):
                with contextlib.suppress(OSError):
                    path.unlink()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0

