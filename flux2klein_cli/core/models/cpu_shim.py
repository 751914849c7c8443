"""The native shim the CPU kernel plugins load (cpu_kernels.cc): built on first use with the C++
compiler (`$CXX`, else g++ or c++) against jaxlib's FFI headers, into a private cache folder keyed by
its source, jaxlib and the build flags, then opened into this process.

It is built three ways (BUILDS): `bf16`, with AVX-512 bf16 and AMX on, which the AMX plugin
(cpu_matmul.py) and the AVX-512 bf16 plugin (avx512_bf16.py) register their targets from; `f32`, with
AVX-512 alone (Skylake-SP's F, BW, VL and DQ, and FMA), holding only the float32 handlers, for the
AVX-512 float32 plugin (float32_kernels.py) on CPUs without bf16; and `avx2`, the same float32 handlers
in AVX2 and FMA, for the AVX2 float32 plugin on CPUs without AVX-512. Only the CPUs a build applies on
ever load it (core/models/kernels.py)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import jax
import jaxlib

from flux2klein_cli.core import settings, temporaries, trust
from flux2klein_cli.core.cache_paths import native_dir

_COMMON_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w", "-pthread", "-fno-math-errno")
# bf16: AVX-512 with bf16, FMA and AMX on (the AMX instructions run only in the AMX plugin's handlers).
# f32: nothing past Skylake-SP's AVX-512, so the CPUs without bf16 can run all of it; cpu_kernels.cc
# leaves its bf16 and AMX code out of this build. avx2: nothing past AVX2 and FMA (cpu_kernels.cc's
# float32 loops on pairs of 8-lane registers).
BUILDS = {
    "bf16": (*_COMMON_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mamx-tile",
             "-mamx-bf16", "-mprefer-vector-width=512"),
    "f32": (*_COMMON_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
            "-mprefer-vector-width=512"),
    "avx2": (*_COMMON_FLAGS, "-mavx2", "-mfma"),
}
SOURCE = Path(__file__).with_name("cpu_kernels.cc")
NO_COMPILER = "no C++ compiler to build the CPU kernel shim"
DEFERRED = "its shim is built on the first run that uses it"


def shim_path(build: str = "bf16") -> Path:
    """Where `build` (one of BUILDS) of the shim is kept."""
    built_from = SOURCE.read_bytes() + jaxlib.version.__version__.encode() + " ".join(BUILDS[build]).encode()
    tag = hashlib.sha256(built_from).hexdigest()[:16]
    return native_dir() / f"cpu_kernels-{tag}.so"


def compiler() -> str | None:
    """The C++ compiler that builds the shim: `$CXX`, else g++ or c++ on the PATH."""
    return settings.cxx() or shutil.which("g++") or shutil.which("c++")


def unbuilt_reason(build: str = "bf16") -> str | None:
    """Without building anything: None when this process opened `build` of the shim or its file is
    there, else what the first run that needs it will do: build it (DEFERRED), or fall back to XLA's
    path, for want of a compiler or because its folder is one the build would refuse."""
    if build in _opened:
        return None
    shim = shim_path(build)
    refusal = _refusal(shim)
    if refusal is not None or shim.exists():
        return refusal
    return NO_COMPILER if compiler() is None else DEFERRED


def _refusal(shim: Path) -> str | None:
    """Why a run would not build or load `shim`: its folder or file (where they exist) is not private."""
    try:
        if shim.parent.exists():
            trust.check_private_dir(shim.parent, "native code folder")
        if shim.exists():
            trust.check_private_file(shim, "CPU kernel shim")  # it is loaded into the process
    except (trust.Untrusted, OSError) as e:
        return str(e)
    return None


def build_shim(out: Path, build: str = "bf16") -> str | None:
    """Compile `build` of cpu_kernels.cc to `out` unless it is there; None when done, else why not."""
    try:
        trust.make_private_dir(out.parent)
    except (trust.Untrusted, OSError) as e:
        return str(e)
    refusal = _refusal(out)
    if refusal is not None or out.exists():
        return refusal
    cxx = compiler()
    if not cxx:
        return NO_COMPILER
    with temporaries.temporary_file(out.parent, out.name, 0o700) as (fd, tmp):
        os.close(fd)
        cmd = [cxx, *BUILDS[build], "-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(tmp), "-ldl"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"the CPU kernel shim did not build: {e}"
        if done.returncode != 0:
            return f"the CPU kernel shim did not build: {done.stderr.strip()[-300:]}"
        os.chmod(tmp, 0o700)  # the linker writes with the umask; a group-writable shim is refused
        os.replace(tmp, out)
    return None


_opened: dict[str, ctypes.CDLL] = {}  # the builds this process opened, each at most once


def open_shim(build: str = "bf16") -> tuple[ctypes.CDLL | None, str | None]:
    """`build` of the shim opened in this process (built first when it is not there), or None and why
    not. Opened once: its FFI targets register process-wide, and a second copy (from another cache
    folder, after FLUX2KLEIN_CACHE changed) would register other addresses under the same names,
    which XLA refuses. (The two builds' plugins register under names of their own.)"""
    if build in _opened:
        return _opened[build], None
    shim = shim_path(build)
    why = build_shim(shim, build)
    if why is not None:
        return None, why
    try:
        trust.check_private_file(shim, "CPU kernel shim")
        _opened[build] = ctypes.CDLL(str(shim))
        return _opened[build], None
    except (trust.Untrusted, OSError) as e:  # a foreign or corrupt shim: XLA's path
        return None, f"the CPU kernel shim does not load: {e}"


def register(targets: dict[str, str], lib: ctypes.CDLL) -> str | None:
    """Register each FFI target (name: the shim's handler symbol) for the CPU; None when done, else why not."""
    try:
        symbols = {target: getattr(lib, symbol) for target, symbol in targets.items()}
    except AttributeError as e:  # an old shim without a handler
        return f"the CPU kernel shim does not load: {e}"
    for target, symbol in symbols.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
    return None


def transposer() -> ctypes._CFuncPtr | None:
    """The shim's transposing copy (`flux2klein_transpose_copy` in cpu_kernels.cc, in every build) when
    this process has opened the shim (a CPU whose kernel plugin loaded), else None: the loader then
    keeps numpy's path. ctypes releases the GIL for the call, so reader threads copy side by side."""
    if not _opened:
        return None
    copy = next(iter(_opened.values())).flux2klein_transpose_copy
    if copy.argtypes is None:
        copy.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                         ctypes.c_int64, ctypes.c_int]
        copy.restype = ctypes.c_int
    return copy
