"""The AVX-512 bf16 kernel plugin: attention and the VAE's 3x3 convolutions in VDPBF16PS, on x86 CPUs
that have the instruction and no AMX (AMD Zen 4 and later).

On such a CPU XLA runs a bf16 dot with a float32 result on the bf16 unit, near its rate, but widens a
bf16 convolution to float32 first, and attention's blocked products (a head's 128-wide queries and
keys) run well below the rate: the VAE decoder and attention were most of a bf16 image
(docs/benchmarks.md, "A CPU with AVX-512 bf16"). The shim's `flux2klein_avx512_*` handlers
(cpu_kernels.cc) run them with the AMX plugin's kernels and numerics (core/models/cpu_matmul.py), their
products in VDPBF16PS instead of on the AMX tiles: pairs of bf16 products summed into float32 lanes.

It takes the VAE's 1x1 convolutions too (`conv1x1`), and the decoder's nearest 2x upsample with the
3x3 convolution after it (`upsample_conv3x3`), the transformer's SwiGLU with the join after the
single block's attention output (`swiglu`), and the larger Linear layers' products (`dot_general`:
XLA's ran at 83-87% of the unit's rate, then rounded its float32 result in a pass of its own).

A float32 model's attention and VAE convolutions take the same loops in float32 FMAs (the `*_f32`
targets): XLA ran float32 attention at 74% of the FMA rate, the decoder's upsample convolutions at
about 60%, its 1x1 shortcuts at 6-14%, and its GroupNorm and SiLU in passes of their own (its float32
Linear products and plain 3x3 convolutions were as fast as the shim's loops: they stay XLA's).

Chosen by the backend dispatch (core/models/kernels.py) and named `avx512-bf16` in the trace options,
so it is part of every program's key.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flux2klein_cli.core.models import cpu_matmul, cpu_shim

ATTENTION_TARGET = "flux2klein_avx512_bf16_attention"
MASKED_ATTENTION_TARGET = "flux2klein_avx512_bf16_masked_attention"
CONV_TARGET = "flux2klein_avx512_bf16_conv3x3"
NORM_CONV_TARGET = "flux2klein_avx512_bf16_norm_silu_conv3x3"
CONV1X1_TARGET = "flux2klein_avx512_bf16_conv1x1"
UPSAMPLE_CONV_TARGET = "flux2klein_avx512_bf16_upsample_conv3x3"
SWIGLU_TARGET = "flux2klein_avx512_bf16_swiglu"
GEMM_TARGET = "flux2klein_avx512_bf16_gemm"
QKV_HEADS_TARGET = "flux2klein_avx512_bf16_qkv_heads"
# The float32 forms of the products: each bf16 target's name with this suffix (and its handler's).
F32 = "_f32"
F32_FORMS = (ATTENTION_TARGET, MASKED_ATTENTION_TARGET, CONV_TARGET, NORM_CONV_TARGET, CONV1X1_TARGET,
             UPSAMPLE_CONV_TARGET)


# Each target's handler symbol in the shim (cpu_kernels.cc); a float32 form's is the same with F32.
HANDLERS = {ATTENTION_TARGET: "flux2klein_avx512_attention",
            MASKED_ATTENTION_TARGET: "flux2klein_avx512_masked_attention",
            CONV_TARGET: "flux2klein_avx512_conv3x3",
            NORM_CONV_TARGET: "flux2klein_avx512_norm_silu_conv3x3",
            CONV1X1_TARGET: "flux2klein_avx512_conv1x1",
            UPSAMPLE_CONV_TARGET: "flux2klein_avx512_upsample_conv3x3",
            SWIGLU_TARGET: "flux2klein_avx512_swiglu",
            GEMM_TARGET: "flux2klein_avx512_gemm",
            QKV_HEADS_TARGET: "flux2klein_avx512_qkv_heads"}


def load() -> str | None:
    """Build the shim (once), open it and register this plugin's targets: None when done, else why not."""
    lib, why = cpu_shim.open_shim()
    if lib is None:
        return why
    handlers = dict(HANDLERS)
    handlers.update({target + F32: HANDLERS[target] + F32 for target in F32_FORMS})
    return cpu_shim.register(handlers, lib)


def _target(name: str, dtype: Any) -> str:
    """A product's target for its operands' dtype: the bf16 one, or its float32 form."""
    return name + F32 if dtype == jnp.float32 else name


# Below this many multiply-adds XLA's dot was as fast or faster (512 x 512 x 512: 0.71 ms against 0.75 ms;
# even at 1024 x 512 x 512, 3-26% faster above; docs/benchmarks.md).
GEMM_MIN_PRODUCTS = 200_000_000


def dot_eligible(lhs: Any, rhs: Any, dimension_numbers: Any, preferred_element_type: Any, kwargs: dict) -> bool:
    """Whether `dot_general` takes these: a Linear layer's bf16 (..., K) x (K, N) with a bf16 result, K
    even (VDPBF16PS sums pairs), on one CPU device, big enough that the shim's call pays. (XLA's
    float32 Linear products ran as fast as the shim's float32 loop: they stay XLA's.)"""
    if preferred_element_type not in (None, jnp.bfloat16) or not cpu_matmul.dot_eligible(
            lhs, rhs, dimension_numbers, preferred_element_type, kwargs):
        return False
    k, n = rhs.shape
    return k % 2 == 0 and math.prod(lhs.shape[:-1]) * k * n >= GEMM_MIN_PRODUCTS


def dot_general(lhs: jax.Array, rhs: jax.Array, preferred_element_type: Any, fallback: Any) -> jax.Array:
    """bf16 (..., K) x (K, N) -> bf16 in the shim: float32 sums rounded once, the numerics of XLA's dot
    with a float32 result and the convert after it, without the float32 array between them;
    `fallback(lhs, rhs)` on other platforms."""

    def avx512(x: jax.Array, w: jax.Array) -> jax.Array:
        lead, k, n = x.shape[:-1], w.shape[0], w.shape[1]
        rows = x.reshape(math.prod(lead), k)
        call = jax.ffi.ffi_call(GEMM_TARGET, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.bfloat16),
                                vmap_method="sequential")
        return call(rows, w).reshape(*lead, n)

    return jax.lax.platform_dependent(lhs, rhs, cpu=avx512, default=fallback)


def _as_bf16(*arrays: Any) -> list[Any]:
    """float32 operands as bf16 shapes: the float32 forms take what the bf16 ones take."""
    if all(a.dtype == jnp.float32 for a in arrays):
        return [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in arrays]
    return list(arrays)


def attention_eligible(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """cpu_matmul.attention_eligible, bf16 or float32."""
    return cpu_matmul.attention_eligible(*_as_bf16(q, k, v))


def masked_attention_eligible(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> bool:
    """cpu_matmul.masked_attention_eligible, bf16 or float32."""
    return cpu_matmul.masked_attention_eligible(*_as_bf16(q, k, v), mask)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, fallback: Any) -> jax.Array:
    """cpu_matmul.attention, its products in VDPBF16PS (float32: in FMAs, the weights unrounded)."""
    return cpu_matmul.attention(q, k, v, fallback, target=_target(ATTENTION_TARGET, q.dtype))


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                     fallback: Any) -> jax.Array:
    """cpu_matmul.masked_attention, its products in VDPBF16PS (float32: in FMAs, the weights unrounded)."""
    return cpu_matmul.masked_attention(q, k, v, mask, scale, fallback,
                                       target=_target(MASKED_ATTENTION_TARGET, q.dtype))


# A float32 convolution's least width, in and out: the decoder's 3-channel output convolution ran 3x
# slower in the shim's 32-wide panels than in XLA's (docs/benchmarks.md).
F32_MIN_CHANNELS = 16


def conv_eligible(x: jax.Array, dtype: Any, has_bias: bool, c_out: int) -> bool:
    """cpu_matmul.conv_eligible, with input channels in pairs (VDPBF16PS sums two at a time; the
    encoder's RGB input is not); or a float32 module's at least F32_MIN_CHANNELS wide in and out."""
    if dtype == jnp.float32:
        return (has_bias and x.ndim == 4 and min(x.shape[-1], c_out) >= F32_MIN_CHANNELS
                and cpu_matmul.single_cpu_device())
    return cpu_matmul.conv_eligible(x, dtype, has_bias, c_out) and x.shape[-1] % 2 == 0


def conv1x1(x: jax.Array, kernel: jax.Array, bias: jax.Array, fallback: Any, target: str | None = None) -> jax.Array:
    """A 1x1 convolution with bias, NHWC (B, H, W, Cin) x (1, 1, Cin, Cout), bf16 or float32, in the
    shim, with nnx.Conv's numerics (XLA's dot ran the VAE's narrow shortcuts far below the unit's
    rate); `fallback(x)` on other platforms. `target`: another plugin's name for the handler."""

    def avx512(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
        call = jax.ffi.ffi_call(target or _target(CONV1X1_TARGET, x.dtype),
                                jax.ShapeDtypeStruct((*x.shape[:3], kernel.shape[-1]), x.dtype),
                                vmap_method="sequential")
        return call(x, kernel, bias)

    return jax.lax.platform_dependent(x, kernel, bias, cpu=avx512, default=lambda x, kernel, bias: fallback(x))


def conv3x3(x: jax.Array, kernel: jax.Array, bias: jax.Array, fallback: Any) -> jax.Array:
    """cpu_matmul.conv3x3, its products in VDPBF16PS (float32: in FMAs, a float32 result)."""
    return cpu_matmul.conv3x3(x, kernel, bias, fallback, target=_target(CONV_TARGET, x.dtype))


def norm_silu_conv3x3(x: jax.Array, mean: jax.Array, scale: jax.Array, shift: jax.Array, kernel: jax.Array,
                      bias: jax.Array, fallback: Any) -> jax.Array:
    """cpu_matmul.norm_silu_conv3x3, its products in VDPBF16PS (float32: in FMAs, nothing rounded)."""
    return cpu_matmul.norm_silu_conv3x3(x, mean, scale, shift, kernel, bias, fallback,
                                        target=_target(NORM_CONV_TARGET, x.dtype))


def upsample_conv3x3(x: jax.Array, kernel: jax.Array, bias: jax.Array, fallback: Any,
                     target: str | None = None) -> jax.Array:
    """A nearest 2x upsample then a 3x3 'same' convolution with bias, NHWC (B, H, W, Cin) x
    (3, 3, Cin, Cout) -> (B, 2H, 2W, Cout), bf16 or float32, in the shim: four 2x2 convolutions of the
    input, one per output phase, so 2.25x fewer products and no upsampled copy. A phase's taps that
    read the same input pixel are summed in float32 (in bf16: rounded to bf16 once, the one rounding
    this form adds to nnx.Conv's numerics: float32 sums rounded, then the bias). In float32, an input
    whose height and width are multiples of 4 takes the phases as four 3x3 convolutions in Winograd's
    F(4x4, 3x3) instead (cpu_kernels.cc: 1.8x fewer products again). `fallback(x)`
    (upsample, then the convolution) on other platforms. `target`: another plugin's name for the handler."""

    def avx512(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
        b, h, w, _ = x.shape
        out = jax.ShapeDtypeStruct((b, 2 * h, 2 * w, kernel.shape[-1]), x.dtype)
        call = jax.ffi.ffi_call(target or _target(UPSAMPLE_CONV_TARGET, x.dtype), out, vmap_method="sequential")
        return call(x, kernel, bias)

    return jax.lax.platform_dependent(x, kernel, bias, cpu=avx512, default=lambda x, kernel, bias: fallback(x))


def swiglu_eligible(x: jax.Array, after: jax.Array | None) -> bool:
    """Whether the transformer's SwiGLU of `x` (joined after `after`) takes the shim: bf16 on one CPU device."""
    return (x.dtype == jnp.bfloat16 and (after is None or after.dtype == jnp.bfloat16) and x.ndim >= 2
            and cpu_matmul.single_cpu_device())


def swiglu(x: jax.Array, start: int, after: jax.Array | None, fallback: Any) -> jax.Array:
    """The transformer's SwiGLU of x[..., start:] (gate, then value), joined after `after` on the last
    axis when given, in one shim pass with its numerics (SiLU in float32 rounded to bf16, then the bf16
    product); `fallback(x)` on other platforms. Taking `start` instead of a slice spares XLA a copy."""
    joined = jnp.zeros((*x.shape[:-1], 0), jnp.bfloat16) if after is None else after
    hidden = (x.shape[-1] - start) // 2

    def avx512(x: jax.Array, joined: jax.Array) -> jax.Array:
        out = jax.ShapeDtypeStruct((*x.shape[:-1], joined.shape[-1] + hidden), jnp.bfloat16)
        call = jax.ffi.ffi_call(SWIGLU_TARGET, out, vmap_method="sequential")
        return call(joined, x, start=np.int64(start))

    return jax.lax.platform_dependent(x, joined, cpu=avx512, default=lambda x, joined: fallback(x))


def qkv_heads_eligible(proj: jax.Array, heads: int, head_dim: int) -> bool:
    """Whether `qkv_heads` takes the single block's bf16 (B, S, W) projection on one CPU device."""
    return (proj.dtype == jnp.bfloat16 and proj.ndim == 3 and head_dim % 2 == 0
            and proj.shape[-1] >= 3 * heads * head_dim and cpu_matmul.single_cpu_device())


def qkv_heads(proj: jax.Array, q_weight: jax.Array, k_weight: jax.Array, cos: jax.Array, sin: jax.Array,
              heads: int, eps: float, fallback: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The single block's (B, S, H, D) queries and keys (RMSNorm, its weight, then the rotation) and
    values from its fused projection, in one shim pass with transformer.py's roundings;
    `fallback(proj)` on other platforms."""
    b, s = proj.shape[:2]
    head_dim = q_weight.shape[0]
    shape = jax.ShapeDtypeStruct((b, s, heads, head_dim), jnp.bfloat16)

    def avx512(proj: jax.Array, q_weight: jax.Array, k_weight: jax.Array, cos: jax.Array,
               sin: jax.Array) -> tuple[jax.Array, ...]:
        call = jax.ffi.ffi_call(QKV_HEADS_TARGET, (shape, shape, shape), vmap_method="sequential")
        return tuple(call(proj, q_weight, k_weight, cos, sin, eps=np.float32(eps)))

    def xla(proj: jax.Array, *_: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(fallback(proj))

    q, k, v = jax.lax.platform_dependent(proj, q_weight, k_weight, cos.astype(jnp.float32), sin.astype(jnp.float32),
                                         cpu=avx512, default=xla)
    return q, k, v
