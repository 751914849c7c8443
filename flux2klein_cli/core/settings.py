"""Every environment variable flux2klein reads, read here and nowhere else.

Each reader looks the variable up when called (a test's monkeypatch, or a subprocess's own
environment, takes effect at once) and checks it: a value outside its choices is one line naming
the variable. Nothing here writes the environment; the console entry (cli/main.py) is the one
writer, of defaults that libraries read when they load (`process_defaults` in devices/runtime.py).

The variables that change what a program computes (`PROGRAM_VARIABLES`) go into every stored
executable's key (core/compile/keys.py), besides the trace options that hold their effect.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from flux2klein_cli.core.errors import UserInputError

PREFIX = "FLUX2KLEIN_"
CACHE = "FLUX2KLEIN_CACHE"  # the cache root (core/cache_paths.py)
COMPILE_CACHE = "FLUX2KLEIN_COMPILE_CACHE"  # the executable store's folder
NATIVE_CACHE = "FLUX2KLEIN_NATIVE_CACHE"  # the built CPU kernel shim's folder
XLA_CACHE = "FLUX2KLEIN_XLA_CACHE"  # jax's persistent cache: off (default), on, or a folder (devices/runtime.py)
# auto: the kernel plugin where the CPU has one (AMX with oneMKL) and float32 accumulation of bf16
# dots; xla: XLA's own forms as the models write them (core/models/trace.py).
CPU_MATMUL = "FLUX2KLEIN_CPU_MATMUL"
CPU_MATMUL_CHOICES = ("auto", "xla")
GPU_ATTENTION = "FLUX2KLEIN_GPU_ATTENTION"  # xla: keep XLA's attention on NVIDIA GPUs instead of cuDNN's
GPU_ATTENTION_CHOICES = ("cudnn", "xla")
# What the mesh axes a batch leaves idle do (core/devices/sharding.py): the rule, or one form forced.
IDLE_AXES = "FLUX2KLEIN_IDLE_AXES"
IDLE_AXES_CHOICES = ("auto", "sequence", "replicate")
# dynamic: an int8 model's linears as int8 x int8 dots (core/models/quantized.py).
INT8_COMPUTE = "FLUX2KLEIN_INT8_COMPUTE"
INT8_COMPUTE_CHOICES = ("weight-only", "dynamic")
API_KEY = "FLUX2KLEIN_API_KEY"  # serve's key when --api-key is not given
TEST_EXIT_MARK = "FLUX2KLEIN_TEST_EXIT_MARK"  # a test hook of cli/main.py
# Other programs' variables that change generated code, so executables are keyed by them too.
COMPILER_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
PROGRAM_VARIABLES = (*COMPILER_VARIABLES, CPU_MATMUL, GPU_ATTENTION, IDLE_AXES, INT8_COMPUTE)
# Shown by `flux2klein env` when set.
JAX_VARIABLES = ("JAX_PLATFORMS", "XLA_FLAGS", "LIBTPU_INIT_ARGS", "CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS")


def _get(name: str) -> str | None:
    """The variable's value; an empty one counts as unset."""
    return os.environ.get(name) or None


def _choice(name: str, choices: tuple[str, ...]) -> str:
    value = _get(name) or choices[0]
    if value not in choices:
        raise UserInputError(f"{name}={value!r}: use one of {', '.join(choices)}")
    return value


def cache_root() -> str | None:
    return _get(CACHE)


def xdg_cache_home() -> str | None:
    return _get("XDG_CACHE_HOME")


def compile_cache() -> str | None:
    return _get(COMPILE_CACHE)


def native_cache() -> str | None:
    return _get(NATIVE_CACHE)


def xla_cache() -> str | None:
    """FLUX2KLEIN_XLA_CACHE as given; devices/runtime.py says what it means."""
    return _get(XLA_CACHE)


def cpu_matmul() -> str:
    """FLUX2KLEIN_CPU_MATMUL: `auto` (the default) or `xla`."""
    return _choice(CPU_MATMUL, CPU_MATMUL_CHOICES)


def gpu_attention() -> str:
    """FLUX2KLEIN_GPU_ATTENTION: `cudnn` (the default) or `xla`."""
    return _choice(GPU_ATTENTION, GPU_ATTENTION_CHOICES)


def idle_axes() -> str:
    """FLUX2KLEIN_IDLE_AXES: `auto` (the default), `sequence` or `replicate`."""
    return _choice(IDLE_AXES, IDLE_AXES_CHOICES)


def int8_compute() -> str:
    """FLUX2KLEIN_INT8_COMPUTE: `weight-only` (the default) or `dynamic`."""
    return _choice(INT8_COMPUTE, INT8_COMPUTE_CHOICES)


def api_key() -> str | None:
    return _get(API_KEY)


def test_exit_mark() -> str | None:
    return _get(TEST_EXIT_MARK)


def cxx() -> str | None:
    """The C++ compiler a user names for native code (the AMX plugin's shim)."""
    return _get("CXX")


def xla_flags() -> str:
    """XLA's own flags as the user set them ("" when unset)."""
    return _get("XLA_FLAGS") or ""


def tpu_worker_hostnames() -> str:
    """The hosts of a TPU slice, as the TPU VM sets them (empty off a slice)."""
    return os.environ.get("TPU_WORKER_HOSTNAMES", "")


def malloc_set_by_user(variable: str, tunable: str) -> bool:
    """Whether the user set one of glibc's malloc settings for this process: its MALLOC_* variable
    (`variable`), or `glibc.malloc.<tunable>` in GLIBC_TUNABLES."""
    return _get(variable) is not None or f"glibc.malloc.{tunable}=" in (_get("GLIBC_TUNABLES") or "")


def program_variables() -> dict[str, str | None]:
    """The variables that change compiled programs, as set now (None: unset), for executable keys."""
    return {name: os.environ.get(name) for name in PROGRAM_VARIABLES}


def ours() -> dict[str, str]:
    """Every FLUX2KLEIN_* variable set, sorted by name."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(PREFIX)}


def jax_environment() -> dict[str, str]:
    """The JAX_VARIABLES set."""
    return {k: os.environ[k] for k in JAX_VARIABLES if k in os.environ}


def child_environment(changes: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with `changes`, for a subprocess this one starts."""
    return {**os.environ, **(changes or {})}
