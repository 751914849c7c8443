"""Process-wide JAX settings every model command applies before its first compile."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path

from flux2klein_cli.core import settings
from flux2klein_cli.core.cache_paths import xla_dir
from flux2klein_cli.core.errors import UserInputError

CACHE_ENV = settings.XLA_CACHE


def xla_cache_dir() -> Path | None:
    """Where jax's own persistent compilation cache lives, when FLUX2KLEIN_XLA_CACHE names a
    folder (`on`: the default folder); off otherwise. Off by default: the executable store holds
    every program of a run, and on CPU an executable that jax also wrote to its cache was
    stored without its fused kernels (the next process recompiled it). A path that is (or lies
    under) something other than a folder is one line naming the variable, as the other
    FLUX2KLEIN_* variables are checked (core/settings.py)."""
    value = settings.xla_cache()
    if value is None or value.lower() in ("", "0", "off", "false", "no"):
        return None
    cache = xla_dir() if value.lower() in ("1", "on", "true", "yes") else Path(value).expanduser()
    for path in (cache, *cache.parents):  # the nearest part that exists must be a folder
        try:
            if not path.exists():
                continue
            is_dir = path.is_dir()
        except OSError:  # unreadable: configure_jax's own check decides (an unwritable cache only costs speed)
            break
        if not is_dir:
            where = "is not a folder" if path == cache else f"is under {path}, which is not a folder"
            raise UserInputError(f"{CACHE_ENV}={value!r}: {cache} {where}")
        break
    return cache


def configure_jax(warn: Callable[[str], None] | None = None) -> None:
    """Turn on JAX's persistent compilation cache, so the second run of a shape skips XLA.
    Its entries are executables jax runs unchecked, so it is used only when no other user
    can write it (core/trust.py); otherwise it stays off, with one warning to `warn`. Off (the
    default), jax is not imported here: a run with bad input fails before that import."""
    cache = xla_cache_dir()
    if cache is None:
        return
    import jax

    from flux2klein_cli.core import trust

    try:
        trust.make_private_dir(cache)
        trust.check_private_dir(cache, "XLA cache")
    except OSError:
        return  # an unwritable cache only costs speed
    except trust.Untrusted as e:
        if warn is not None:
            warn(f"{e}: the persistent XLA cache is off for this run")
        return
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# CPython's collector thresholds (700, 10, 10) are made for programs whose objects come and go. A
# model command first creates millions that live as long as the process (jax, flax, traced
# programs), and at those thresholds its full collections rescan them again and again while it
# imports, loads and traces. Every collection still happens here, only after more allocations.
COLLECTOR_THRESHOLDS = (10_000, 50, 100)


def tune_collector() -> None:
    """Set this process's garbage collector thresholds (COLLECTOR_THRESHOLDS); the console entry
    calls it first, before the heavy imports (figures in docs/benchmarks.md)."""
    gc.set_threshold(*COLLECTOR_THRESHOLDS)


# glibc's malloc gives a block over 32 MiB its own mapping and unmaps it when it is freed, and a
# thread other than the main one allocates from an arena of its own, whose heaps (64 MiB at most)
# fall back to such mappings. XLA's CPU runtime allocates each program call's temporaries from its
# threads, so every call (every image) faulted fresh zeroed pages in for them. With one arena, no
# mappings of their own for large blocks, and freed memory kept (up to mallopt's largest
# threshold, 2 GiB), the next call reuses the pages; all three are needed (docs/benchmarks.md).
# `compile` runs no program, and one arena serializes the allocations of its compiles' threads: it
# keeps glibc's own settings (docs/benchmarks.md).
ALLOCATOR_UNTUNED_COMMANDS = frozenset({"compile"})
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # <malloc.h>
# (mallopt option, value, the variable and the tunable that set it at start-up)
ALLOCATOR_SETTINGS = ((M_ARENA_MAX, 1, "MALLOC_ARENA_MAX", "arena_max"),
                      (M_MMAP_MAX, 0, "MALLOC_MMAP_MAX_", "mmap_max"),
                      (M_TRIM_THRESHOLD, 2**31 - 1, "MALLOC_TRIM_THRESHOLD_", "trim_threshold"))


def has_glibc_malloc() -> bool:
    """Whether this process's C library is glibc on Linux (the one whose malloc tune_allocator sets)."""
    return sys.platform == "linux" and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")


def tune_allocator() -> list[str]:
    """Set glibc's malloc for a model process (ALLOCATOR_SETTINGS), each one the user did not set
    (their MALLOC_* variable or GLIBC_TUNABLES wins); the variables it set (none on other C
    libraries). The console entry calls it first, before any other thread allocates: a thread
    that has an arena of its own keeps it."""
    if not has_glibc_malloc():
        return []
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return [variable for option, value, variable, tunable in ALLOCATOR_SETTINGS
            if not settings.malloc_set_by_user(variable, tunable) and mallopt(option, value) == 1]


def process_defaults() -> dict[str, str]:
    """Environment this process should have before jax and native libraries load, for the console
    entry (cli/main.py, the one writer of os.environ) to set where unset: libtpu's on a host
    without TPU chips (devices/tpu.py), and on an AMX CPU oneMKL's threads told to sleep at once
    after each product (they spin for 200 ms by default, holding the cores XLA's threads need for
    the work between products)."""
    from flux2klein_cli.core.devices import cpu
    from flux2klein_cli.core.devices.tpu import libtpu_defaults

    defaults = libtpu_defaults()
    if cpu.is_x86() and cpu.has_amx_bf16(cpu.cpu_flags()):
        defaults["KMP_BLOCKTIME"] = "0"
    return defaults

