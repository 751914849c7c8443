"""The AMX kernel plugin: bf16 work at the AMX rate on CPU, oneMKL's bf16 GEMM called from XLA as FFI custom calls.

XLA's CPU backend converts every bf16 dot to float32 before its own kernels (and before oneDNN's,
with `--xla_cpu_use_onednn`), so on an AMX CPU a bf16 linear layer runs at the float32 rate, far
below torch's (docs/benchmarks.md). oneMKL's `cblas_gemm_bf16bf16f32` uses the AMX tiles. The shim
(cpu_kernels.cc, built and opened by cpu_shim.py) builds kernels on it and on the tiles' intrinsics:
the Linear layers' dots (`dot_general`; a float32 model's on oneMKL's `cblas_sgemm`), unmasked
attention (`attention`), the text encoder's masked attention (`masked_attention`) and the VAE's 3x3
convolutions (`conv3x3`, `norm_silu_conv3x3`), each with the numerics of the XLA form it replaces.

The backend dispatch (core/models/trace.py) asks it through core/models/amx_plugin.py, imported
only where it applies (core/models/kernels.py: an AMX CPU with oneMKL installed,
FLUX2KLEIN_CPU_MATMUL not `xla`), and `load` then builds the shim on first use, opens oneMKL in it
and registers its targets. The trace options name the plugin (`TraceOptions.kernels`, part of every
program's key); the model code asks them. In a traced program each custom call sits in the CPU
branch of `lax.platform_dependent`: a program lowered for an accelerator never contains it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flux2klein_cli.core.models import cpu_shim

TARGET = "flux2klein_amx_bf16_gemm"
F32_TARGET = "flux2klein_amx_f32_gemm"
ATTENTION_TARGET = "flux2klein_amx_bf16_attention"
MASKED_ATTENTION_TARGET = "flux2klein_amx_bf16_masked_attention"
CONV_TARGET = "flux2klein_amx_bf16_conv3x3"
NORM_CONV_TARGET = "flux2klein_amx_bf16_norm_silu_conv3x3"


def load(mkl: str) -> str | None:
    """Build the shim (once), open it against oneMKL at `mkl` and register its targets: None when
    done, else why not (the programs then keep XLA's forms)."""
    lib, why = cpu_shim.open_shim()
    if lib is None:
        return why
    try:
        opened = lib.flux2klein_amx_open(mkl.encode())
    except AttributeError as e:  # an old shim: XLA's path
        return f"the CPU kernel shim does not load: {e}"
    if opened == 3:
        return "Linux does not let this process use the AMX tiles (it needs kernel 5.16 or later)"
    if opened != 0:
        return f"{mkl} has no cblas_gemm_bf16bf16f32, cblas_sgemm or MKL_Set_Num_Threads_Local"
    return cpu_shim.register({TARGET: "flux2klein_amx_gemm", F32_TARGET: "flux2klein_amx_sgemm",
                              ATTENTION_TARGET: "flux2klein_amx_attention",
                              MASKED_ATTENTION_TARGET: "flux2klein_amx_masked_attention",
                              CONV_TARGET: "flux2klein_amx_conv3x3",
                              NORM_CONV_TARGET: "flux2klein_amx_norm_silu_conv3x3"}, lib)


def single_cpu_device() -> bool:
    """The shim's kernels see whole arrays: only programs on one CPU device take them."""
    return len(jax.devices("cpu")) == 1


def _linear_product(lhs: Any, rhs: Any, dimension_numbers: Any, kwargs: dict) -> bool:
    """Whether a product is a Linear layer's (..., K) x (K, N) on one CPU device."""
    (lc, rc), (lb, rb) = dimension_numbers
    return (rhs.ndim == 2 and lhs.ndim >= 1 and tuple(lc) == (lhs.ndim - 1,) and tuple(rc) == (0,) and not lb
            and not rb and kwargs.get("out_sharding") is None and single_cpu_device())


def dot_eligible(lhs: Any, rhs: Any, dimension_numbers: Any, preferred_element_type: Any, kwargs: dict) -> bool:
    """Whether `dot_general` takes these: bf16 (..., K) x (K, N) on one CPU device."""
    return (lhs.dtype == jnp.bfloat16 and rhs.dtype == jnp.bfloat16
            and preferred_element_type in (None, jnp.bfloat16, jnp.float32)
            and _linear_product(lhs, rhs, dimension_numbers, kwargs))


def float32_dot_eligible(lhs: Any, rhs: Any, dimension_numbers: Any, preferred_element_type: Any,
                         kwargs: dict) -> bool:
    """Whether `dot_general` takes these: float32 (..., K) x (K, N) on one CPU device."""
    return (lhs.dtype == jnp.float32 and rhs.dtype == jnp.float32 and preferred_element_type in (None, jnp.float32)
            and _linear_product(lhs, rhs, dimension_numbers, kwargs))


def dot_general(lhs: jax.Array, rhs: jax.Array, preferred_element_type: Any, fallback: Any) -> jax.Array:
    """bf16 (..., K) x (K, N) through oneMKL (float32 sums), in `preferred_element_type` (else bf16);
    float32 on MKL's sgemm; `fallback(lhs, rhs)` on other platforms."""
    out_dtype = preferred_element_type or lhs.dtype
    target = F32_TARGET if lhs.dtype == jnp.float32 else TARGET

    def amx(x: jax.Array, w: jax.Array) -> jax.Array:
        lead, k, n = x.shape[:-1], w.shape[0], w.shape[1]
        rows = x.reshape(-1, k)
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32),
                                vmap_method="sequential")
        return call(rows, w).reshape(*lead, n).astype(out_dtype)

    return jax.lax.platform_dependent(lhs, rhs, cpu=amx, default=fallback)


def attention_eligible(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Whether `attention` takes these: bf16 (B, S, H, D) on one CPU device."""
    return (q.dtype == k.dtype == v.dtype == jnp.bfloat16 and q.ndim == 4
            and k.shape == v.shape and k.ndim == 4 and q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:]
            and single_cpu_device())


def attention(q: jax.Array, k: jax.Array, v: jax.Array, fallback: Any, target: str = ATTENTION_TARGET) -> jax.Array:
    """Unmasked attention of bf16 (B, Sq, H, D) queries, already scaled, against (B, Sk, H, D) keys
    and values, in the shim: per (batch, head, block of queries) the scores, their softmax and
    P @ V, the products on oneMKL. The numerics of `fallback(q, k, v)`, the XLA form used
    everywhere else: float32 scores and softmax sum, bf16 weights for P @ V, normalised after."""

    def amx(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
        return call(q, k, v)

    return jax.lax.platform_dependent(q, k, v, cpu=amx, default=fallback)


def masked_attention_eligible(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> bool:
    """Whether `masked_attention` takes these: bf16 (B, Sq, H, D) queries, (B, Sk, Hkv, D) keys and
    values with H a multiple of Hkv, a bool (B, Sq, Sk) mask, on one CPU device."""
    return (q.dtype == k.dtype == v.dtype == jnp.bfloat16 and q.ndim == 4 and k.ndim == 4 and k.shape == v.shape
            and q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3] and q.shape[2] % k.shape[2] == 0
            and mask.dtype == jnp.bool_ and mask.shape == (q.shape[0], q.shape[1], k.shape[1])
            and single_cpu_device())


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                     fallback: Any, target: str = MASKED_ATTENTION_TARGET) -> jax.Array:
    """Grouped-query attention with a (B, Sq, Sk) mask of allowed keys, in the shim: the numerics of
    `jax.nn.dot_product_attention`'s XLA form (`fallback(q, k, v, mask)`): float32 scores scaled after
    the product, masked keys left out of the softmax, the weights normalised and rounded to bf16
    before P @ V. A query with no allowed key gets a zero output."""

    def amx(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
        return call(q, k, v, mask, scale=np.float32(scale))

    return jax.lax.platform_dependent(q, k, v, mask, cpu=amx, default=fallback)


def conv_eligible(x: jax.Array, dtype: Any, has_bias: bool, c_out: int) -> bool:
    """Whether the VAE's convolutions of module dtype `dtype` take the shim on `x`: bf16 NHWC with a
    bias (any `c_out`, its output width)."""
    return dtype == jnp.bfloat16 and has_bias and x.ndim == 4 and single_cpu_device()


def conv1x1(x: jax.Array, kernel: jax.Array, bias: jax.Array, fallback: Any) -> jax.Array:
    """A 1x1 convolution with bias, bf16 NHWC (B, H, W, Cin) x (1, 1, Cin, Cout) -> bf16: a Linear over
    channels (its dot on oneMKL), bf16 sums, then the bias, as nnx.Conv; `fallback(x)` on other platforms."""
    dims = (((3,), (0,)), ((), ()))

    def amx(x: jax.Array, w: jax.Array, bias: jax.Array) -> jax.Array:
        return dot_general(x, w, None, lambda x, w: jax.lax.dot_general(x, w, dims)) + bias

    return jax.lax.platform_dependent(x, kernel.reshape(kernel.shape[-2:]), bias, cpu=amx,
                                      default=lambda x, w, bias: fallback(x))


def conv3x3(x: jax.Array, kernel: jax.Array, bias: jax.Array, fallback: Any, target: str = CONV_TARGET) -> jax.Array:
    """A 3x3 'same' convolution with bias, bf16 NHWC (B, H, W, Cin) x (3, 3, Cin, Cout) -> bf16, in
    the shim, per tile of output rows: the nine taps accumulated on the AMX tiles (input widths of
    whole tiles, multiples of 32), else nine oneMKL products. The numerics of `fallback(x)`,
    nnx.Conv in bf16: float32 sums rounded to bf16, then the bias added."""

    def amx(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((*x.shape[:3], kernel.shape[-1]), x.dtype),
                                vmap_method="sequential")
        return call(x, kernel, bias)

    return jax.lax.platform_dependent(x, kernel, bias, cpu=amx, default=lambda x, kernel, bias: fallback(x))


def norm_silu_conv3x3(x: jax.Array, mean: jax.Array, scale: jax.Array, shift: jax.Array, kernel: jax.Array,
                      bias: jax.Array, fallback: Any, target: str = NORM_CONV_TARGET) -> jax.Array:
    """`conv3x3` of SiLU(GroupNorm(x)) in one shim call: each tile of input rows is normalised
    ((x - mean) * scale + shift per batch and channel, float32), activated and rounded to bf16 just
    before its products, instead of in a pass of XLA's over the whole padded activation. mean and
    scale are (B, Cin), shift (Cin,), all float32. The numerics of `fallback(x)`, the VAE's
    GroupNorm(x, silu=True) then its Conv."""

    def amx(x: jax.Array, mean: jax.Array, scale: jax.Array, shift: jax.Array, kernel: jax.Array,
            bias: jax.Array) -> jax.Array:
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((*x.shape[:3], kernel.shape[-1]), x.dtype),
                                vmap_method="sequential")
        return call(x, mean, scale, shift, kernel, bias)

    return jax.lax.platform_dependent(x, mean, scale, shift, kernel, bias, cpu=amx,
                                      default=lambda x, *_: fallback(x))
