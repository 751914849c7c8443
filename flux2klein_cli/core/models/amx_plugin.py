"""The AMX plugin as the backend dispatch asks it (kernels.plugin_module("amx")): a bf16 model's Linear
dots, attention and VAE convolutions on oneMKL and the AMX tiles (core/models/cpu_matmul.py), and a
float32 model's attention and VAE convolutions in the AVX-512 bf16 plugin's float32 forms
(core/models/avx512_bf16.py, the `*_f32` targets of the same shim build: AVX-512 FMAs, which every AMX
CPU has). The tiles hold no float32 product; before these forms a float32 model on an AMX CPU kept
XLA's, a third slower a medium image (docs/benchmarks.md). A float32 model's Linear dots take oneMKL's
sgemm (cpu_matmul.dot_general), faster than XLA's dot there. The transformer's elementwise passes that
avx512_bf16 fuses (SwiGLU with the single block's join, the single block's q/k norms and rotations) take
its kernels in bf16 too.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from flux2klein_cli.core.models import avx512_bf16, cpu_matmul

# The targets a bf16 model's programs hold (a float32 model's: avx512_bf16's names with avx512_bf16.F32).
TARGET = cpu_matmul.TARGET
ATTENTION_TARGET = cpu_matmul.ATTENTION_TARGET
MASKED_ATTENTION_TARGET = cpu_matmul.MASKED_ATTENTION_TARGET
CONV_TARGET = cpu_matmul.CONV_TARGET
NORM_CONV_TARGET = cpu_matmul.NORM_CONV_TARGET


def load(mkl: str) -> str | None:
    """Build the shim (once), open it against oneMKL at `mkl` and register the AMX targets and the
    float32 forms: None when done, else why not (the programs then keep XLA's forms)."""
    return cpu_matmul.load(mkl) or avx512_bf16.load()


def _float32(*arrays: Any) -> bool:
    return all(a.dtype == jnp.float32 for a in arrays)


def dot_eligible(lhs: Any, rhs: Any, dimension_numbers: Any, preferred_element_type: Any, kwargs: dict) -> bool:
    """A Linear layer's bf16 product (cpu_matmul.dot_eligible) or float32 one: oneMKL's sgemm ran the
    medium model's faster than XLA's dot, its float32 image 3-5% faster (docs/benchmarks.md)."""
    return (cpu_matmul.dot_eligible(lhs, rhs, dimension_numbers, preferred_element_type, kwargs)
            or cpu_matmul.float32_dot_eligible(lhs, rhs, dimension_numbers, preferred_element_type, kwargs))


dot_general = cpu_matmul.dot_general  # bf16 on oneMKL's bf16 GEMM, float32 on its sgemm


attention_eligible = avx512_bf16.attention_eligible  # bf16 or float32 shapes


def attention(q: jax.Array, k: jax.Array, v: jax.Array, fallback: Any) -> jax.Array:
    """bf16: cpu_matmul.attention (the products on the tiles); float32: avx512_bf16's float32 form."""
    return (avx512_bf16 if _float32(q) else cpu_matmul).attention(q, k, v, fallback)


masked_attention_eligible = avx512_bf16.masked_attention_eligible  # bf16 or float32 shapes


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                     fallback: Any) -> jax.Array:
    """bf16: cpu_matmul.masked_attention; float32: avx512_bf16's float32 form."""
    return (avx512_bf16 if _float32(q) else cpu_matmul).masked_attention(q, k, v, mask, scale, fallback)


def conv_eligible(x: jax.Array, dtype: Any, has_bias: bool, c_out: int) -> bool:
    """A bf16 module's convolutions as cpu_matmul takes them (any width: the tiles or oneMKL), a float32
    one's as avx512_bf16 does (at least avx512_bf16.F32_MIN_CHANNELS wide)."""
    if dtype == jnp.float32:
        return avx512_bf16.conv_eligible(x, dtype, has_bias, c_out)
    return cpu_matmul.conv_eligible(x, dtype, has_bias, c_out)


def conv1x1(x: jax.Array, kernel: jax.Array, bias: jax.Array, fallback: Any) -> jax.Array:
    """bf16: cpu_matmul.conv1x1 (a dot on oneMKL); float32: avx512_bf16's float32 form."""
    return (avx512_bf16 if _float32(x) else cpu_matmul).conv1x1(x, kernel, bias, fallback)


def conv3x3(x: jax.Array, kernel: jax.Array, bias: jax.Array, fallback: Any) -> jax.Array:
    """bf16: cpu_matmul.conv3x3 (the taps on the tiles); float32: avx512_bf16's float32 form."""
    return (avx512_bf16 if _float32(x) else cpu_matmul).conv3x3(x, kernel, bias, fallback)


def norm_silu_conv3x3(x: jax.Array, mean: jax.Array, scale: jax.Array, shift: jax.Array, kernel: jax.Array,
                      bias: jax.Array, fallback: Any) -> jax.Array:
    """bf16: cpu_matmul.norm_silu_conv3x3; float32: avx512_bf16's float32 form."""
    return (avx512_bf16 if _float32(x) else cpu_matmul).norm_silu_conv3x3(x, mean, scale, shift, kernel, bias,
                                                                          fallback)


# The transformer's SwiGLU with the single block's join, and the single block's q/k norms and rotations,
# each one AVX-512 pass (XLA's were several).
swiglu_eligible, swiglu = avx512_bf16.swiglu_eligible, avx512_bf16.swiglu
qkv_heads_eligible, qkv_heads = avx512_bf16.qkv_heads_eligible, avx512_bf16.qkv_heads


def upsample_conv3x3(x: jax.Array, kernel: jax.Array, bias: jax.Array, fallback: Any) -> jax.Array:
    """float32: avx512_bf16's float32 form (Winograd's F(4x4) where it applies); bf16: `fallback(x)`, the
    upsampled copy then cpu_matmul.conv3x3 on the tiles (avx512_bf16's bf16 form, a quarter of the
    products in VDPBF16PS, made the medium decode a quarter slower)."""
    if _float32(x):
        return avx512_bf16.upsample_conv3x3(x, kernel, bias, fallback)
    return fallback(x)

