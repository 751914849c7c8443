"""Small pieces shared by the three models: norms, stacked blocks and the scan that runs them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

B = TypeVar("B", bound=nnx.Module)
Carry = TypeVar("Carry")


# Parameters always come from a checkpoint; the initialiser is only traced (by nnx.eval_shape)
# to learn shapes, and zeros trace far faster than random draws.
ZEROS = nnx.initializers.zeros_init()


class ZeroInitRngs:
    """Stands in for `nnx.Rngs` when a model is only built abstractly and every initialiser is ZEROS.

    Each draw from a real Rngs updates a traced counter, and flax checks every update in a way
    that rescans the whole trace: quadratic in the number of parameters, about 1 s for the VAE's
    ~250 small ones under `nnx.eval_shape`. A constant key costs nothing and is never used."""

    def params(self) -> jax.Array:
        return jax.random.key(0)

    __call__ = params


def linear(d_in: int, d_out: int, *, dtype: Any, rngs: nnx.Rngs, bias: bool = False) -> nnx.Linear:
    """A torch-style Linear; the kernel is (in, out), loaded from torch's (out, in)."""
    return nnx.Linear(
        d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=dtype, kernel_init=ZEROS, bias_init=ZEROS, rngs=rngs
    )


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm computed in float32, cast back to the input dtype before the weight."""
    x32 = x.astype(jnp.float32)
    y = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return y if weight is None else y * weight.astype(x.dtype)


def layer_norm(x: jax.Array, eps: float) -> jax.Array:
    """LayerNorm without scale or bias, statistics in float32."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype: Any):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def stack_blocks(make: Callable[[nnx.Rngs], B], count: int, rngs: nnx.Rngs) -> B:
    """`count` identical blocks as one module whose parameters carry a leading layer axis."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(r: nnx.Rngs) -> B:
        return make(r)

    return create(rngs)


def run_blocks(
    blocks: B,
    carry: Carry,
    step: Callable[[B, Carry], tuple[Carry, Any]],
    *,
    scan: bool = True,
) -> tuple[Carry, Any]:
    """Apply stacked blocks in order. With `scan` the body is traced and compiled once,
    so compile time does not grow with depth; without it the loop is unrolled (kept to
    measure the difference). `step` returns (new carry, per-layer output); the outputs
    come back stacked on a leading layer axis."""
    graphdef, state = nnx.split(blocks)

    def body(c: Carry, layer_state: nnx.State) -> tuple[Carry, Any]:
        return step(nnx.merge(graphdef, layer_state), c)

    if scan:
        return jax.lax.scan(body, carry, state)
    count = jax.tree.leaves(state)[0].shape[0]
    outputs = []
    for i in range(count):
        carry, out = body(carry, jax.tree.map(lambda a, i=i: a[i], state))
        outputs.append(out)
    return carry, jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)
