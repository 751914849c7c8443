"""The names a user picks from: dtypes, compile efforts, converted layouts, bench phases, mesh axes.

One home for each list, importable without jax (the CLI builds its option types from them and must
stay light); the checks keep the messages scripts already see.
"""

from __future__ import annotations

from typing import Any

from flux2klein_cli.core.errors import UserInputError

# Our name -> the name numpy (with ml_dtypes), jax and torch all give the dtype.
DTYPES: dict[str, str] = {"bf16": "bfloat16", "fp32": "float32"}
EFFORTS = ("default", "fast")  # XLA optimisation effort; what each means is in compile/store.py
LAYOUTS = ("flat", "orbax")  # converted directories; see weights/converted.py
DEFAULT_LAYOUT = "flat"
QUANTIZE = ("none", "int8")  # `convert --quantize`: weight schemes; see models/quantized.py
PHASES = ("pipeline", "ttfi", "load", "transformer-compile", "steps")  # what `bench` times
MESH_AXES = ("data", "fsdp", "tensor", "context")


def check_dtype(name: str) -> str:
    if name not in DTYPES:
        raise UserInputError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return name


def check_effort(name: str) -> str:
    if name not in EFFORTS:
        raise UserInputError(f"--effort must be one of {', '.join(EFFORTS)}, got {name!r}")
    return name


def check_layout(name: str) -> str:
    if name not in LAYOUTS:
        raise UserInputError(f"unknown layout {name!r}: use one of {', '.join(LAYOUTS)}")
    return name


def check_quantize(name: str) -> str:
    if name not in QUANTIZE:
        raise UserInputError(f"unknown quantization {name!r}: use one of {', '.join(QUANTIZE)}")
    return name


def check_phase(name: str) -> str:
    if name not in PHASES:
        raise UserInputError(f"unknown phase {name!r}: use one of {', '.join(PHASES)}")
    return name


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
