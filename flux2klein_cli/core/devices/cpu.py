"""What the host CPU can do, from /proc/cpuinfo and the process's cores: the facts the backend
dispatch (core/models/trace.py) chooses the CPU programs' dot forms and kernel plugin by, and the
options their compiles take (core/compile/target.py)."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

from flux2klein_cli.core import settings


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (or of `cpuinfo`; empty where there is
    none): x86 calls them `flags`, Arm `Features`."""
    if cpuinfo is None:
        return _host_flags()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def _host_flags() -> frozenset[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return frozenset()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def has_amx_bf16(flags: frozenset[str]) -> bool:
    """AMX tiles with bf16 (Intel Sapphire Rapids and later). Every AMX CPU has AVX-512 bf16
    too; the AMX plugin's softmax rounds with it."""
    return {"amx_bf16", "amx_tile", "avx512_bf16"} <= flags


# The AVX-512 the shim's float32 build is compiled for (core/models/cpu_shim.py): Skylake-SP's set.
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"})


def has_avx512(flags: frozenset[str]) -> bool:
    """AVX-512 F, BW, VL and DQ with FMA: Intel Skylake-SP and later servers, AMD Zen 4 and later."""
    return AVX512_FLAGS <= flags


# What the shim's AVX2 build is compiled for (core/models/cpu_shim.py).
AVX2_FLAGS = frozenset({"avx2", "fma"})


def has_avx2(flags: frozenset[str]) -> bool:
    """AVX2 with FMA: Intel Haswell and later, AMD Zen and later."""
    return AVX2_FLAGS <= flags


def has_bf16_dot(flags: frozenset[str]) -> bool:
    """A bf16 dot-product instruction (AVX-512 bf16, or Arm's bf16): XLA's bf16 x bf16 -> float32 dot
    runs on it faster than on widened operands; without one it runs slower (docs/benchmarks.md)."""
    return bool({"avx512_bf16", "bf16"} & flags)


def core_count() -> int:
    """The cores this process may run on (its affinity), as XLA's CPU thread pool counts them."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


# XLA:CPU hands parts of a program to the YNNPACK library by kind (its
# xla_cpu_experimental_ynn_fusion_type option). By default it takes dots with the elementwise work
# around them, reductions, elementwise chains and convolutions, and many of those fusions run on one
# thread: on many cores they leave most of them idle, and lone dots alone were far faster there. On
# 2 cores the two forms ran alike, so hosts of up to 2 cores keep XLA's default (docs/benchmarks.md,
# "Many cores").
YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"
LONE_DOTS_FROM_CORES = 3


def xla_options(cores: int | None = None, xla_flags: str | None = None) -> dict[str, str]:
    """Compile options for programs on this host's CPU: on more than 2 cores, only lone dots go to
    YNNPACK. None where the user's XLA_FLAGS names that option (theirs is kept)."""
    flags = settings.xla_flags() if xla_flags is None else xla_flags
    cores = core_count() if cores is None else cores
    if YNN_OPTION in flags or cores < LONE_DOTS_FROM_CORES:
        return {}
    return {YNN_OPTION: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
