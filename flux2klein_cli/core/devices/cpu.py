"""What the host CPU can do, from /proc/cpuinfo: the facts the backend dispatch
(core/models/trace.py) chooses the CPU programs' dot forms and kernel plugin by."""

from __future__ import annotations

import functools
import platform
from pathlib import Path


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


def has_bf16_dot(flags: frozenset[str]) -> bool:
    """A bf16 dot-product instruction (AVX-512 bf16, or Arm's bf16): XLA's bf16 x bf16 -> float32 dot
    runs on it faster than on widened operands; without one it runs slower (docs/benchmarks.md)."""
    return bool({"avx512_bf16", "bf16"} & flags)
