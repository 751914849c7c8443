"""Many programs at once: load what is stored, compile the rest in threads, store it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from flux2klein_cli.core.compile.keys import key_parts
from flux2klein_cli.core.compile.store import ExecutableStore, LoadInfo, first_line
from flux2klein_cli.core.compile.target import ProgramSpec, Target
from flux2klein_cli.core.errors import Flux2KleinError


def compiles_serially(specs: Sequence[ProgramSpec]) -> bool:
    """TPU programs compile one at a time: libtpu is not safe compiling the Pallas attention
    kernels of two programs at once (it crashed in its MLIR translation), and threads gain
    nothing there anyway (its compiles in one process finish together)."""
    return any((spec.target or Target.local()).platform == "tpu" for spec in specs)


def compile_all(
    specs: Sequence[ProgramSpec],
    store: ExecutableStore,
    *,
    parallel: bool = True,
    save: bool = True,
    progress: Callable[[str], None] | None = None,
    on_done: Callable[[int, int], None] | None = None,
) -> list[tuple[jax.stages.Compiled | None, LoadInfo]]:
    """Load what is stored, compile the rest, store it; in threads when `parallel` (XLA's
    deserializer and compiler release the GIL). Tracing and lowering stay in this thread, one program at a
    time: tracing is not meant to run concurrently; each program's compile starts as soon as
    it is lowered. Results come back in `specs` order. `on_done(programs done, programs)` as
    each is loaded or compiled."""
    say = progress or (lambda message: None)
    results: list[tuple[jax.stages.Compiled | None, LoadInfo] | None] = [None] * len(specs)
    done_lock, done = threading.Lock(), [0]

    def finished() -> None:
        with done_lock:  # builds finish in the pool's threads
            done[0] += 1
            if on_done is not None:
                on_done(done[0], len(specs))

    def build(item: tuple[int, ProgramSpec, dict[str, Any], Any, float, list[str]]) -> None:
        i, spec, parts, lowered, lower_s, caught = item
        say(f"{spec.name}: compiling")
        try:
            compiled, _, compile_s = store.compile(spec, lowered)
        except Exception as e:  # libtpu refuses a program that cannot fit: one line, not a traceback
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise Flux2KleinError(
                f"{spec.name} does not fit the target's memory ({first_line(e)}); try a smaller {{field:batch}} or "
                "size, more chips, or an int8 model (flux2klein convert --quantize int8)") from None
        results[i] = compiled, store.finish(spec, parts, compiled, lower_s, compile_s, save, caught)
        say(f"{spec.name}: compiled in {compile_s:.2f} s")
        finished()

    def load(spec: ProgramSpec, parts: dict[str, Any], earlier: list[str]
             ) -> tuple[tuple[jax.stages.Compiled | None, LoadInfo] | None, list[str]]:
        with store.collecting_warnings() as caught:
            caught.extend(earlier)
            return store.load(spec, parts), caught

    # One worker when not parallel: programs still compile one at a time, each while this
    # thread lowers the next.
    workers = len(specs) if parallel and len(specs) > 1 and not compiles_serially(specs) else 1
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flux2klein-compile") as pool:
        keyed = [(spec, key_parts(spec)) for spec in specs]
        with store.collecting_warnings() as opening:  # the store's checks, once, before the loads start
            store.trusted_key(create=False)
        # The stored programs load side by side: XLA deserializes without the GIL, and one after
        # another they held up a first image on a host whose system calls are slow (benchmarks.md).
        loads = [pool.submit(load, spec, parts, opening if i == 0 else [])
                 for i, (spec, parts) in enumerate(keyed)]
        pending = []
        for i, ((spec, parts), stored) in enumerate(zip(keyed, loads, strict=True)):
            loaded, caught = stored.result()
            if loaded is not None:
                results[i] = loaded
                say(f"{spec.name}: loaded ({loaded[1].seconds:.2f} s)")
                finished()
                continue
            start = time.perf_counter()
            say(f"{spec.name}: lowering")
            lowered = spec.lower()
            # Compiling starts as soon as a program is lowered, while this thread lowers the next.
            pending.append(pool.submit(build, (i, spec, parts, lowered, time.perf_counter() - start, caught)))
        for future in pending:
            future.result()
    return [r for r in results if r is not None]
