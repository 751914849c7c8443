"""What an engine keeps across runs: each run shape's executables (an LRU), and reference KV
caches (in memory, an LRU, and on disk with `kv_cache_dir`). The pipeline keeps nothing between
runs; the engine owns these with the lock that makes its runs one at a time."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flux2klein_cli.core.pipeline.kv_store import ReferenceKVStore, references_digest
from flux2klein_cli.core.pipeline.pipeline import Programs
from flux2klein_cli.core.pipeline.programs import RunShape


def _code_bytes(info: dict[str, Any]) -> int:
    """An executable's code as XLA reports it, else (the CPU reports none) its serialized size."""
    code = int(info.get("memory", {}).get("generated_code", 0))
    path = info.get("path")
    if not code and path and (Path(path) / "executable.bin").is_file():
        code = (Path(path) / "executable.bin").stat().st_size
    return code


class ExecutableCache:
    """Each run shape's executables from the store (core/compile/attach.py), loaded or compiled
    and stored on the shape's first run, kept for the last `size` shapes: a long-lived engine
    alternating shapes loads each once. Without a store (`store` None) every program is jitted."""

    def __init__(self, store: Any, size: int, warn: Callable[[str], None]):
        self.store, self.size, self.warn = store, size, warn
        # run shape -> (its executables, their generated code bytes as XLA reports them)
        self._by_shape: OrderedDict[RunShape, tuple[Programs, int]] = OrderedDict()
        # run shape -> the thread loading its executables ahead, and what it got
        self._ahead: dict[RunShape, tuple[threading.Thread, list[tuple[Programs, list[dict[str, Any]]]]]] = {}

    def prefetch(self, shape: RunShape) -> None:
        """Start loading (or compiling) the shape's executables on a thread of their own, while
        the caller goes on (an engine reads its weights meanwhile: the first image of a process
        waits for the longer of the two, not both); `get` takes them."""
        if self.store is None or shape in self._by_shape or shape in self._ahead:
            return
        got: list[tuple[Programs, list[dict[str, Any]]]] = []
        thread = threading.Thread(target=lambda: got.append(self._fetch(shape)), name="flux2klein-programs",
                                  daemon=True)
        self._ahead[shape] = (thread, got)
        thread.start()

    def ahead(self, shape: RunShape) -> bool:
        """Whether the shape's executables were started ahead (`prefetch`) and not taken yet."""
        return shape in self._ahead

    def pending(self, shape: RunShape) -> bool:
        """Whether the shape's executables are still loading ahead (`prefetch`)."""
        ahead = self._ahead.get(shape)
        return ahead is not None and ahead[0].is_alive()

    def _fetch(self, shape: RunShape) -> tuple[Programs, list[dict[str, Any]]]:
        try:
            compiled = self.store.for_run(shape)
            return compiled, self.store.report
        except Exception as e:  # the store is an optimisation: never the reason a run fails
            self.warn(f"stored executables unavailable ({type(e).__name__}: {str(e).splitlines()[0]}); "
                      "compiling as needed")
            return {}, []

    def get(self, shape: RunShape) -> tuple[Programs, list[dict[str, Any]]]:
        """The shape's executables and what the store did per program (empty when they were
        kept from an earlier run, or without a store)."""
        if self.store is None:
            return {}, []
        kept = self._by_shape.get(shape)
        if kept is not None:
            self._by_shape.move_to_end(shape)
            return kept[0], []
        ahead = self._ahead.pop(shape, None)
        if ahead is not None:
            ahead[0].join()
        compiled, report = ahead[1][0] if ahead is not None and ahead[1] else self._fetch(shape)
        self._by_shape[shape] = (compiled, sum(_code_bytes(info) for info in report))
        while len(self._by_shape) > self.size:
            self._by_shape.popitem(last=False)
        return compiled, report

    @property
    def shapes_kept(self) -> int:
        return len(self._by_shape)

    @property
    def executable_bytes(self) -> int:
        """Generated code of the kept shapes' executables (what the LRU holds, as XLA reports it)."""
        return sum(code for _, code in self._by_shape.values())


class ReferenceKVCache:
    """Reference KV caches by reference set (`kv_store.references_digest`): the last `size` in
    memory (a 9B cache is about 2 GiB per 1024x1024 reference), then the disk store when there
    is one, else computed by the pipeline (and saved to the store)."""

    def __init__(self, pipeline: Any, store: ReferenceKVStore | None, size: int):
        self.pipeline, self.store, self.size = pipeline, store, size
        self._memory: OrderedDict[str, Any] = OrderedDict()

    def get(self, references: Sequence[np.ndarray], seconds: dict[str, float],
            compiled: Programs | None = None, salt: str = "") -> tuple[Any, str]:
        """The cache of `references` (batch 1) and where it came from: memory, disk or computed.
        `salt` names the weights when they are not the engine's own (a LoRA set)."""
        digest = references_digest(list(references))
        if salt:
            digest = hashlib.sha256(f"{digest}+{salt}".encode()).hexdigest()
        if digest in self._memory:
            self._memory.move_to_end(digest)
            return self._memory[digest], "memory"
        kv, source = None, "disk"
        if self.store is not None:
            kv = self.store.load(digest, self.pipeline.reference_kv_shapes(references))
        if kv is None:
            kv, source = self.pipeline.reference_kv(references, seconds, compiled), "computed"
            if self.store is not None:
                self.store.save(digest, kv)
        self._memory[digest] = kv
        while len(self._memory) > self.size:
            self._memory.popitem(last=False)
        return kv, source

    def forget(self) -> None:
        """Drop the caches held in memory (the disk store keeps its own)."""
        self._memory.clear()
