"""The AVX-512 float32 kernel plugin: float32 attention and VAE convolutions in AVX-512 FMAs, on x86 CPUs
with AVX-512 and no bf16 dot instruction (Intel Skylake-SP, Cascade Lake and Ice Lake servers, where
XLA's own forms were all a CPU run had).

Its handlers are the AVX-512 bf16 plugin's float32 forms (core/models/avx512_bf16.py: the attention
and masked attention, the 3x3 convolution with or without the GroupNorm and SiLU before it, the
decoder's upsample with its convolution, the 1x1 shortcuts), from the shim's float32-only build
(core/models/cpu_shim.py: AVX-512 F, BW, VL and DQ with FMA, no bf16 or AMX instruction). On such a
CPU a bf16 model computes with float32 activations (trace.BF16_COMPUTE_FORMS `f32`), so its attention
and convolutions take these too, the bf16 weights widened where they are used. The Linear layers stay
XLA's: its float32 dot ran at 93% of the FMA rate, as fast as the shim's loop (docs/benchmarks.md).

Chosen by the backend dispatch (core/models/kernels.py) and named `avx512-f32` in the trace options, so
it is part of every program's key. Its targets have names of their own, so a process may hold both
builds (the tests do).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from flux2klein_cli.core.models import avx512_bf16, cpu_matmul, cpu_shim

PREFIX = "flux2klein_avx512f_"
ATTENTION_TARGET = PREFIX + "attention"
MASKED_ATTENTION_TARGET = PREFIX + "masked_attention"
CONV_TARGET = PREFIX + "conv3x3"
NORM_CONV_TARGET = PREFIX + "norm_silu_conv3x3"
CONV1X1_TARGET = PREFIX + "conv1x1"
UPSAMPLE_CONV_TARGET = PREFIX + "upsample_conv3x3"
# The AVX-512 bf16 plugin's float32 form each of these runs: the same handler, from the other build.
FORMS = {ATTENTION_TARGET: avx512_bf16.ATTENTION_TARGET, MASKED_ATTENTION_TARGET: avx512_bf16.MASKED_ATTENTION_TARGET,
         CONV_TARGET: avx512_bf16.CONV_TARGET, NORM_CONV_TARGET: avx512_bf16.NORM_CONV_TARGET,
         CONV1X1_TARGET: avx512_bf16.CONV1X1_TARGET, UPSAMPLE_CONV_TARGET: avx512_bf16.UPSAMPLE_CONV_TARGET}


def load() -> str | None:
    """Build the shim's float32 form (once), open it and register this plugin's targets: None when
    done, else why not."""
    lib, why = cpu_shim.open_shim("f32")
    if lib is None:
        return why
    return cpu_shim.register({ours: avx512_bf16.HANDLERS[theirs] + avx512_bf16.F32 for ours, theirs in FORMS.items()},
                             lib)


def _float32(*arrays: Any) -> bool:
    return all(a.dtype == jnp.float32 for a in arrays)


def dot_eligible(lhs: Any, rhs: Any, dimension_numbers: Any, preferred_element_type: Any, kwargs: dict) -> bool:
    """No Linear layer's product: XLA's float32 dot is as fast as the shim's loop."""
    return False


def attention_eligible(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """The AVX-512 bf16 plugin's attention shapes, in float32 only."""
    return _float32(q, k, v) and avx512_bf16.attention_eligible(q, k, v)


def masked_attention_eligible(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> bool:
    """The AVX-512 bf16 plugin's masked attention shapes, in float32 only."""
    return _float32(q, k, v) and avx512_bf16.masked_attention_eligible(q, k, v, mask)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, fallback: Any) -> jax.Array:
    """cpu_matmul.attention in float32 FMAs."""
    return cpu_matmul.attention(q, k, v, fallback, target=ATTENTION_TARGET)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                     fallback: Any) -> jax.Array:
    """cpu_matmul.masked_attention in float32 FMAs."""
    return cpu_matmul.masked_attention(q, k, v, mask, scale, fallback, target=MASKED_ATTENTION_TARGET)


def conv_eligible(x: jax.Array, dtype: Any, has_bias: bool, c_out: int) -> bool:
    """The AVX-512 bf16 plugin's float32 convolutions (`dtype`: what the call computes in)."""
    return dtype == jnp.float32 and avx512_bf16.conv_eligible(x, dtype, has_bias, c_out)


def conv3x3(x: jax.Array, kernel: jax.Array, bias: jax.Array, fallback: Any) -> jax.Array:
    """cpu_matmul.conv3x3 in float32 FMAs."""
    return cpu_matmul.conv3x3(x, kernel, bias, fallback, target=CONV_TARGET)


def norm_silu_conv3x3(x: jax.Array, mean: jax.Array, scale: jax.Array, shift: jax.Array, kernel: jax.Array,
                      bias: jax.Array, fallback: Any) -> jax.Array:
    """cpu_matmul.norm_silu_conv3x3 in float32 FMAs, nothing rounded."""
    return cpu_matmul.norm_silu_conv3x3(x, mean, scale, shift, kernel, bias, fallback, target=NORM_CONV_TARGET)


def conv1x1(x: jax.Array, kernel: jax.Array, bias: jax.Array, fallback: Any) -> jax.Array:
    """avx512_bf16.conv1x1's float32 form."""
    return avx512_bf16.conv1x1(x, kernel, bias, fallback, target=CONV1X1_TARGET)


def upsample_conv3x3(x: jax.Array, kernel: jax.Array, bias: jax.Array, fallback: Any) -> jax.Array:
    """avx512_bf16.upsample_conv3x3's float32 form (the merged taps float32 sums)."""
    return avx512_bf16.upsample_conv3x3(x, kernel, bias, fallback, target=UPSAMPLE_CONV_TARGET)
