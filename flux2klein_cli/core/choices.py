"""The names a user picks from: dtypes, compile efforts, converted layouts, bench phases, mesh axes.

One home for each list, importable without jax (the CLI builds its option types from them and must
stay light); the checks keep the messages scripts already see.
"""

from __future__ import annotations

from typing import Any

from flux2klein_cli.core.errors import UserInputError

# Our name -> the name numpy (with ml_dtypes), jax and torch all give the dtype.
DTYPES: dict[str, str] = {"bf16": "bfloat16", "fp32": "float32"}
EFFORTS = ("default", "fast")  # XLA optimisation effort; what each means is in compile/target.py
LAYOUTS = ("flat", "orbax")  # converted directories; see weights/converted.py
DEFAULT_LAYOUT = "flat"
QUANTIZE = ("none", "int8")  # `convert --quantize`: weight schemes; see models/quantized.py
PHASES = ("pipeline", "ttfi", "load", "transformer-compile", "steps", "lora", "decode")  # what `bench` times
MESH_AXES = ("data", "fsdp", "tensor", "context")
CACHE_MODES = ("none", "fbcache", "dbcache")  # step caching; see pipeline/step_cache.py


def _one_of(name: str, allowed: tuple[str, ...] | dict[str, str], message: str) -> str:
    """`name` when it is one of `allowed`; else exit 2 with `message` (given {name} and {allowed})."""
    if name not in allowed:
        raise UserInputError(message.format(name=repr(name), allowed=", ".join(allowed)))
    return name


def check_dtype(name: str) -> str:
    return _one_of(name, DTYPES, "unknown dtype {name}: use one of {allowed}")


def check_effort(name: str) -> str:
    return _one_of(name, EFFORTS, "--effort must be one of {allowed}, got {name}")


def check_layout(name: str) -> str:
    return _one_of(name, LAYOUTS, "unknown layout {name}: use one of {allowed}")


def check_quantize(name: str) -> str:
    return _one_of(name, QUANTIZE, "unknown quantization {name}: use one of {allowed}")


def check_phase(name: str) -> str:
    return _one_of(name, PHASES, "unknown phase {name}: use one of {allowed}")


def check_cache_mode(name: str) -> str:
    return _one_of(name, CACHE_MODES, "--cache must be one of {allowed}, got {name}")


def jax_dtype(name: str) -> Any:
    """jnp.bfloat16 / jnp.float32."""
    import jax.numpy as jnp

    return getattr(jnp, DTYPES[check_dtype(name)])


def numpy_dtype(name: str) -> Any:
    import ml_dtypes
    import numpy as np

    full = DTYPES[check_dtype(name)]
    return np.dtype(getattr(ml_dtypes, full) if full == "bfloat16" else full)


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, DTYPES[check_dtype(name)])
