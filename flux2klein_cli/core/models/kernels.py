"""Which kernel plugin this host's CPU programs may use, and why (the backend dispatch,
core/models/trace.py, asks here).

Four plugins exist, all on the native shim cpu_kernels.cc (core/models/cpu_shim.py), which needs a C++
compiler on first use:
  * `amx` (core/models/amx_plugin.py): oneMKL's bf16 GEMM and the AMX tiles' intrinsics
    (core/models/cpu_matmul.py), for Intel CPUs with AMX: the Linear dots, attention and the VAE's 3x3
    convolutions, and a float32 model's attention and convolutions in the next plugin's float32
    forms. It applies where the CPU reports `amx_bf16`, `amx_tile` and `avx512_bf16` and oneMKL's
    runtime library is installed (`pip install 'flux2klein-cli[amx]'`: libmkl_rt in the environment's lib/);
  * `avx512-bf16` (core/models/avx512_bf16.py): attention and the VAE's 3x3 convolutions in
    VDPBF16PS, for other x86 CPUs with `avx512_bf16` (AMD Zen 4 and later, or an AMX CPU without
    oneMKL), where XLA runs bf16 Linear dots on the bf16 unit but widens convolutions to float32;
  * `avx512-f32` (core/models/float32_kernels.py): float32 attention and VAE convolutions in AVX-512
    FMAs, for x86 CPUs with AVX-512 and no bf16 (Intel Skylake-SP to Ice Lake), from the shim's
    float32-only build (benchmarks/cpu_as.py runs a command as on such a CPU, to measure it);
  * `avx2-f32` (the same module): those float32 kernels in AVX2 FMAs, for x86 CPUs with AVX2 and FMA
    and no AVX-512 (AMD Zen 2 and 3, Intel client CPUs), from the shim's AVX2 build.
None applies under FLUX2KLEIN_CPU_MATMUL=xla (core/settings.py), and a plugin is imported only where
it applies and used when its shim then builds and loads (the plugin's `load`). Everywhere else the
programs keep XLA's own forms, with bf16 dots accumulated in float32 (`cpu_bf16_compute`).
"""

from __future__ import annotations

import ctypes.util
import functools
import site
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from flux2klein_cli.core import settings
from flux2klein_cli.core.devices import cpu

PLUGINS = ("amx", "avx512-bf16", "avx512-f32", "avx2-f32")
_MKL_NAMES = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")


@dataclass(frozen=True)
class Status:
    """`name` is the plugin the CPU programs use (None: XLA's own forms); `reason` says why, for people."""

    name: str | None
    reason: str


def find_mkl() -> str | None:
    """libmkl_rt from the `mkl` wheel (it installs into the environment's lib/), else the loader's."""
    dirs = dict.fromkeys(Path(p) / "lib" for p in (sys.prefix, sys.base_prefix, site.getuserbase()))
    for d in dirs:
        for name in _MKL_NAMES:
            if (d / name).is_file():
                return str(d / name)
    return ctypes.util.find_library("mkl_rt")


def detect(flags: frozenset[str], build: bool = True) -> Status:
    """The plugin for a CPU with these feature flags; loads it (and builds its shim) when it applies.
    `build` False (a report, `flux2klein env`): a plugin whose shim is not built yet is named with
    what its first run will do, and nothing is built or loaded."""
    if settings.cpu_matmul() == "xla":
        return Status(None, f"{settings.CPU_MATMUL}=xla")
    if not cpu.is_x86() or not (cpu.has_bf16_dot(flags) or cpu.has_avx512(flags) or cpu.has_avx2(flags)):
        return Status(None, "the CPU has neither AVX-512 (avx512f, avx512bw, avx512vl, avx512dq) nor AVX2 with FMA")
    if not cpu.has_bf16_dot(flags):
        return _float32(build, "avx512-f32" if cpu.has_avx512(flags) else "avx2-f32")
    amx = _amx(flags, build)
    if amx.name is not None:
        return amx
    chosen = (f"{amx.reason}: bf16 attention, Linear layers and VAE convolutions in AVX-512 bf16 (VDPBF16PS), "
              "float32 attention and VAE convolutions in AVX-512 FMAs")
    unbuilt = None if build else _unbuilt("avx512-bf16", chosen, refused=f"{amx.reason}; ")
    if unbuilt is not None:
        return unbuilt
    from flux2klein_cli.core.models import avx512_bf16

    why = avx512_bf16.load()
    if why is not None:
        return Status(None, f"{amx.reason}; {why}")
    return Status("avx512-bf16", chosen)


def _amx(flags: frozenset[str], build: bool) -> Status:
    """The AMX plugin where it applies; else None and why not."""
    if not cpu.has_amx_bf16(flags):
        return Status(None, "the CPU has no AMX bf16 (amx_bf16, amx_tile)")
    mkl = find_mkl()
    if mkl is None:
        return Status(None, "oneMKL is not installed (pip install 'flux2klein-cli[amx]')")
    chosen = f"oneMKL bf16 and float32 GEMMs ({mkl}); float32 attention and VAE convolutions in AVX-512 FMAs"
    unbuilt = None if build else _unbuilt("amx", chosen)
    if unbuilt is not None:
        return unbuilt
    from flux2klein_cli.core.models import amx_plugin

    why = amx_plugin.load(mkl)
    return Status(None, why) if why is not None else Status("amx", chosen)


# Why a CPU takes each float32 plugin, and the unit its FMAs run on.
_FLOAT32_REASONS = {"avx512-f32": ("the CPU has no AVX-512 bf16 (avx512_bf16)", "AVX-512"),
                    "avx2-f32": ("the CPU has no AVX-512 (avx512f, avx512bw, avx512vl, avx512dq)", "AVX2")}


def _float32(build: bool, name: str) -> Status:
    """A float32 plugin (`name`), for a CPU without a bf16 dot: AVX-512's where it has AVX-512, else AVX2's."""
    from flux2klein_cli.core.models.float32_kernels import BY_NAME

    plugin = BY_NAME[name]
    why, unit = _FLOAT32_REASONS[name]
    chosen = (f"{why}: float32 attention and VAE convolutions in {unit} FMAs, which a bf16 model's float32 "
              "activations take too")
    unbuilt = None if build else _unbuilt(name, chosen, refused=f"{why}; ", shim_build=plugin.build)
    if unbuilt is not None:
        return unbuilt
    failed = plugin.load()
    return Status(None, f"{why}; {failed}") if failed is not None else Status(name, chosen)


def _unbuilt(name: str, chosen: str, refused: str = "", shim_build: str = "bf16") -> Status | None:
    """A report's status (nothing built) for a plugin whose shim (`shim_build` of it) is not built
    yet: what its first run will do, as that run would say it (`refused` before the reason it falls
    back); None when the shim is built or opened."""
    reason = _shim().unbuilt_reason(shim_build)
    if reason is None:
        return None
    if reason != _shim().DEFERRED:  # no compiler, or a folder the build refuses
        return Status(None, f"{refused}{reason}")
    return Status(name, f"{chosen}; {reason}")


def _shim() -> ModuleType:
    from flux2klein_cli.core.models import cpu_shim  # imports jax: only once a plugin applies

    return cpu_shim


@functools.cache
def plugin_status() -> Status:
    """Detects, builds and registers once per process."""
    return detect(cpu.cpu_flags())


def report_status() -> Status:
    """What a report says without building anything: the plugin the runs take, its shim built or
    not (plugin_status when this process has detected it already)."""
    if plugin_status.cache_info().currsize:
        return plugin_status()
    return detect(cpu.cpu_flags(), build=False)


def plugin_module(name: str) -> ModuleType | Any:
    """The module of a plugin named in trace options (see PLUGINS); a float32 plugin's is its
    Float32Kernels, which answers as a module does."""
    if name == "amx":
        from flux2klein_cli.core.models import amx_plugin

        return amx_plugin
    if name == "avx512-bf16":
        from flux2klein_cli.core.models import avx512_bf16

        return avx512_bf16
    if name in ("avx512-f32", "avx2-f32"):
        from flux2klein_cli.core.models.float32_kernels import BY_NAME

        return BY_NAME[name]
    raise ValueError(f"kernel plugin {name!r} is not one of {PLUGINS}")


def cpu_bf16_compute() -> str:
    """How this CPU's programs compute a bf16 model (trace.BF16_COMPUTE_FORMS): every dot
    accumulated in float32, with bf16 operands on a CPU with a bf16 dot instruction, and with
    float32 activations elsewhere; `bf16` (as the models write it) under FLUX2KLEIN_CPU_MATMUL=xla."""
    if settings.cpu_matmul() == "xla":
        return "bf16"
    return "f32-accumulate" if cpu.has_bf16_dot(cpu.cpu_flags()) else "f32"


def report(build: bool = True) -> dict[str, str | None]:
    """For a run's report: what this CPU's bf16 work runs on (`plugin`: the plugin's name, or null
    for XLA's own forms; `onemkl`: the same where it is the oneMKL one, as reports had it), why, and
    how a bf16 model computes. `build` False: nothing is built (report_status)."""
    chosen = plugin_status() if build else report_status()
    return {"plugin": chosen.name, "onemkl": chosen.name if chosen.name == "amx" else None, "why": chosen.reason,
            "bf16_compute": cpu_bf16_compute()}
