"""The float32 kernel plugins: float32 attention and VAE convolutions in FMAs, on x86 CPUs without a
bf16 dot instruction, where XLA's own forms were all a CPU run had:
  * `avx512-f32` (AVX512): CPUs with AVX-512 (Intel Skylake-SP, Cascade Lake and Ice Lake servers),
    from the shim's `f32` build (AVX-512 F, BW, VL and DQ with FMA);
  * `avx2-f32` (AVX2): CPUs with AVX2 and FMA and no AVX-512 (AMD Zen 2 and 3, Intel client CPUs), from
    the shim's `avx2` build, the same loops on pairs of 8-lane registers.

Their handlers are the AVX-512 bf16 plugin's float32 forms (core/models/avx512_bf16.py: the attention
and masked attention, the 3x3 convolution with or without the GroupNorm and SiLU before it, the
decoder's upsample with its convolution, the 1x1 shortcuts), from a build of the shim with nothing
past the plugin's instructions (core/models/cpu_shim.py). On such a CPU a bf16 model computes with
float32 activations (trace.BF16_COMPUTE_FORMS `f32`), so its attention and convolutions take these
too, the bf16 weights widened where they are used. The Linear layers stay XLA's: its float32 dot ran
at 93% of the FMA rate, as fast as the shim's loop (docs/benchmarks.md).

Chosen by the backend dispatch (core/models/kernels.py), which names one in the trace options, so it
is part of every program's key. Each plugin's targets have names of their own, so a process may hold
every build (the tests do).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from flux2klein_cli.core.models import avx512_bf16, cpu_matmul, cpu_shim


def _float32(*arrays: Any) -> bool:
    return all(a.dtype == jnp.float32 for a in arrays)


class Float32Kernels:
    """One float32 plugin: its name in the trace options, the shim build its handlers come from, and
    its targets (`prefix` + the handler's name). It answers the dispatch as a plugin module does."""

    def __init__(self, name: str, build: str, prefix: str) -> None:
        self.name, self.build, self.PREFIX = name, build, prefix
        self.ATTENTION_TARGET = prefix + "attention"
        self.MASKED_ATTENTION_TARGET = prefix + "masked_attention"
        self.CONV_TARGET = prefix + "conv3x3"
        self.NORM_CONV_TARGET = prefix + "norm_silu_conv3x3"
        self.CONV1X1_TARGET = prefix + "conv1x1"
        self.UPSAMPLE_CONV_TARGET = prefix + "upsample_conv3x3"
        # The AVX-512 bf16 plugin's float32 form each of these runs: the same handler, from another build.
        self.FORMS = {self.ATTENTION_TARGET: avx512_bf16.ATTENTION_TARGET,
                      self.MASKED_ATTENTION_TARGET: avx512_bf16.MASKED_ATTENTION_TARGET,
                      self.CONV_TARGET: avx512_bf16.CONV_TARGET, self.NORM_CONV_TARGET: avx512_bf16.NORM_CONV_TARGET,
                      self.CONV1X1_TARGET: avx512_bf16.CONV1X1_TARGET,
                      self.UPSAMPLE_CONV_TARGET: avx512_bf16.UPSAMPLE_CONV_TARGET}

    def __repr__(self) -> str:
        return f"Float32Kernels({self.name!r})"

    def load(self) -> str | None:
        """Build this plugin's shim (once), open it and register its targets: None when done, else why not."""
        lib, why = cpu_shim.open_shim(self.build)
        if lib is None:
            return why
        return cpu_shim.register(
            {ours: avx512_bf16.HANDLERS[theirs] + avx512_bf16.F32 for ours, theirs in self.FORMS.items()}, lib)

    def dot_eligible(self, lhs: Any, rhs: Any, dimension_numbers: Any, preferred_element_type: Any,
                     kwargs: dict) -> bool:
        """No Linear layer's product: XLA's float32 dot is as fast as the shim's loop."""
        return False

    def attention_eligible(self, q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
        """The AVX-512 bf16 plugin's attention shapes, in float32 only."""
        return _float32(q, k, v) and avx512_bf16.attention_eligible(q, k, v)

    def masked_attention_eligible(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> bool:
        """The AVX-512 bf16 plugin's masked attention shapes, in float32 only."""
        return _float32(q, k, v) and avx512_bf16.masked_attention_eligible(q, k, v, mask)

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, fallback: Any) -> jax.Array:
        """cpu_matmul.attention in float32 FMAs."""
        return cpu_matmul.attention(q, k, v, fallback, target=self.ATTENTION_TARGET)

    def masked_attention(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                         fallback: Any) -> jax.Array:
        """cpu_matmul.masked_attention in float32 FMAs."""
        return cpu_matmul.masked_attention(q, k, v, mask, scale, fallback, target=self.MASKED_ATTENTION_TARGET)

    def conv_eligible(self, x: jax.Array, dtype: Any, has_bias: bool, c_out: int) -> bool:
        """The AVX-512 bf16 plugin's float32 convolutions (`dtype`: what the call computes in)."""
        return dtype == jnp.float32 and avx512_bf16.conv_eligible(x, dtype, has_bias, c_out)

    def conv3x3(self, x: jax.Array, kernel: jax.Array, bias: jax.Array, fallback: Any) -> jax.Array:
        """cpu_matmul.conv3x3 in float32 FMAs."""
        return cpu_matmul.conv3x3(x, kernel, bias, fallback, target=self.CONV_TARGET)

    def norm_silu_conv3x3(self, x: jax.Array, mean: jax.Array, scale: jax.Array, shift: jax.Array,
                          kernel: jax.Array, bias: jax.Array, fallback: Any) -> jax.Array:
        """cpu_matmul.norm_silu_conv3x3 in float32 FMAs, nothing rounded."""
        return cpu_matmul.norm_silu_conv3x3(x, mean, scale, shift, kernel, bias, fallback,
                                            target=self.NORM_CONV_TARGET)

    def conv1x1(self, x: jax.Array, kernel: jax.Array, bias: jax.Array, fallback: Any) -> jax.Array:
        """avx512_bf16.conv1x1's float32 form."""
        return avx512_bf16.conv1x1(x, kernel, bias, fallback, target=self.CONV1X1_TARGET)

    def upsample_conv3x3(self, x: jax.Array, kernel: jax.Array, bias: jax.Array, fallback: Any) -> jax.Array:
        """avx512_bf16.upsample_conv3x3's float32 form (the merged taps float32 sums, or Winograd's F(4x4))."""
        return avx512_bf16.upsample_conv3x3(x, kernel, bias, fallback, target=self.UPSAMPLE_CONV_TARGET)


AVX512 = Float32Kernels("avx512-f32", "f32", "flux2klein_avx512f_")
AVX2 = Float32Kernels("avx2-f32", "avx2", "flux2klein_avx2_")
BY_NAME = {plugin.name: plugin for plugin in (AVX512, AVX2)}
