"""Small pieces shared by the three models: norms, attention, stacked blocks and the scan that runs them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flux2klein_cli.core.devices.sharding import STACKED
from flux2klein_cli.core.models import tpu_attention, trace

B = TypeVar("B", bound=nnx.Module)
Carry = TypeVar("Carry")


# Parameters always come from a checkpoint; the initialiser is only traced (by nnx.eval_shape)
# to learn shapes, and zeros trace far faster than random draws.
ZEROS = nnx.initializers.zeros_init()


_ABSTRACT: OrderedDict[Hashable, tuple[Any, Any]] = OrderedDict()
_ABSTRACT_KEPT = 8  # models (config, dtype, form) whose abstract build a process keeps


class AbstractBacking(Protocol):
    """Abstract builds kept beyond this process (core/compile/abstract_store.py)."""

    def get(self, key: Hashable) -> tuple[Any, Any] | None: ...

    def put(self, key: Hashable, built: tuple[Any, Any]) -> None: ...


_backing: list[AbstractBacking | None] = [None]


def back_abstract_builds(backing: AbstractBacking | None) -> None:
    """Where abstract_module looks for a build this process has not made, and keeps the ones it
    makes (None: nowhere). An engine opening with an executable store sets it (engine/opening.py)."""
    _backing[0] = backing


def abstract_module(build: Callable[[], B], key: Hashable) -> B:
    """`nnx.eval_shape(build)`, built once per `key` (everything the build depends on) in a
    process, or read from the backing store: a run builds each model abstractly three times (its
    cost check, its loader, its executables' specs), and a build checks every attribute it sets
    while a merge of the cached graph and shapes does not. Each call returns a new module
    (callers may swap its children)."""
    cached = _ABSTRACT.get(key)
    if cached is None:
        backing = _backing[0]
        cached = backing.get(key) if backing is not None else None
        if cached is None:
            cached = nnx.split(nnx.eval_shape(build))
            if backing is not None:
                backing.put(key, cached)
        _ABSTRACT[key] = cached
        while len(_ABSTRACT) > _ABSTRACT_KEPT:
            _ABSTRACT.popitem(last=False)
    _ABSTRACT.move_to_end(key)
    return nnx.merge(*cached)


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
    # The dot in the trace options' form (core/models/trace.py): on CPU float32 sums of bf16, on CPUs
    # with a kernel plugin the plugin's (the AVX-512 bf16 one's for the larger products only).
    return nnx.Linear(
        d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=dtype, kernel_init=ZEROS, bias_init=ZEROS, rngs=rngs,
        dot_general=trace.dot_general, promote_dtype=trace.promote_dtype,
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


def silu(x: jax.Array) -> jax.Array:
    """SiLU as torch computes it on bf16: in float32, rounded once. (jax.nn.silu on bf16 rounds after
    each of its five operations, and XLA's CPU backend runs that chain several times slower.)"""
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


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
    step: Callable[..., tuple[Carry, Any]],
    *,
    xs: Any = None,
    scan: bool = True,
    layers: tuple[int, int] | None = None,
) -> tuple[Carry, Any]:
    """Apply stacked blocks in order. With `scan` the body is traced and compiled once,
    so compile time does not grow with depth; without it the loop is unrolled (kept to
    measure the difference). `step(block, carry)` (or `step(block, carry, x)` with
    per-layer inputs `xs`, stacked on a leading layer axis) returns (new carry, per-layer
    output); the outputs come back stacked on a leading layer axis. `layers` (start, stop):
    only those blocks (and their rows of `xs`); None: all."""
    graphdef, state = nnx.split(blocks)
    # On CPU the stacked bf16 weights are sliced as raw 16-bit words (see `as_words`); words
    # not already given that way are made here, a copy for the call but not a float32 one.
    if trace.current().weights_as_words:
        state = jax.tree.map(_to_words, state)
    if layers is not None:  # sliced after the words are made, for the same reason
        state, xs = jax.tree.map(lambda a: a[layers[0]:layers[1]], (state, xs))

    def body(c: Carry, layer: tuple[nnx.State, Any]) -> tuple[Carry, Any]:
        layer_state, x = layer
        layer_state = jax.tree.map(_from_words, layer_state)
        block = nnx.merge(graphdef, layer_state)
        return step(block, c) if xs is None else step(block, c, x)

    if scan:
        return jax.lax.scan(body, carry, (state, xs))
    count = jax.tree.leaves(state)[0].shape[0]
    outputs = []
    for i in range(count):
        carry, out = body(carry, jax.tree.map(lambda a, i=i: a[i], (state, xs)))
        outputs.append(out)
    return carry, jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)


# XLA's CPU backend cannot slice bf16: it widens a bf16 operand to float32 first, and the
# widening of a stacked (scanned) weight then moves out of the loop, a float32 copy of every
# block's weights, twice their bytes, held for the whole call (and made again by every call).
# So on CPU the programs take the stacked bf16 weights as uint16 words (the same bytes, no
# parameter of the models is uint16) and each layer's slice becomes bf16 inside the loop.
# The stacked blocks are those devices/sharding.py keeps whole on their layer axis.


def _to_words(a: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype == jnp.bfloat16 else a


def _from_words(a: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(a, jnp.bfloat16) if a.dtype == jnp.uint16 else a


def is_word_leaf(path: tuple[Any, ...], dtype: Any, platform: str) -> bool:
    """Whether a model state leaf travels into a CPU program as uint16 words."""
    return platform == "cpu" and dtype == jnp.bfloat16 and bool(path) and str(path[0]) in STACKED


def as_words(state: nnx.State) -> nnx.State:
    """`state` with its stacked bf16 weights on CPU devices as uint16 arrays over the same
    buffers (zero-copy views), for a CPU program's arguments; other leaves unchanged."""

    def view(path: tuple[Any, ...], var: Any) -> tuple[tuple[Any, ...], Any]:
        leaf = var.get_value()
        platform = next(iter(leaf.sharding.device_set)).platform if isinstance(leaf, jax.Array) else ""
        if not is_word_leaf(path, leaf.dtype, platform):
            return path, var
        shards = [jax.device_put(np.asarray(s.data).view(np.uint16), s.device) for s in leaf.addressable_shards]
        return path, var.replace(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards))

    return nnx.from_flat_state([view(tuple(path), var) for path, var in nnx.to_flat_state(state)])


CPU_QUERY_BLOCK = 512


def _blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int = CPU_QUERY_BLOCK) -> jax.Array:
    """Attention one head and one block of queries at a time, (B, S, H, Dh) -> (B, S, H, Dh).

    XLA's CPU attention materialises all S x S scores and is about 3x slower than torch's fused
    kernel at 1.5k tokens; one head's block of scores stays in cache, and its products are plain
    matrix products, which XLA runs at its GEMM rate (a block of every head at once spilled the
    cache at 4.6k tokens and ran at half that rate). Scores and the softmax sum are float32; the
    output is normalised after P @ V."""
    return _blocked_scaled(q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype), k, v, block)


def _blocked_scaled(q: jax.Array, k: jax.Array, v: jax.Array, block: int = CPU_QUERY_BLOCK) -> jax.Array:
    """_blocked_attention of queries already scaled by 1 / sqrt(Dh)."""
    b, s, h, d = q.shape
    block = min(block, s)
    padded = -(-s // block) * block
    qt = jnp.pad(q, ((0, 0), (0, padded - s), (0, 0), (0, 0)))
    qt = qt.transpose(0, 2, 1, 3).reshape(b * h, padded // block, block, d)
    kt = k.transpose(0, 2, 3, 1).reshape(b * h, d, k.shape[1])
    vt = v.transpose(0, 2, 1, 3).reshape(b * h, v.shape[1], d)

    def head(q_blocks: jax.Array, keys: jax.Array, values: jax.Array) -> jax.Array:
        def one(q_block: jax.Array) -> jax.Array:
            scores = jnp.matmul(q_block, keys, preferred_element_type=jnp.float32)
            weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
            out = jnp.matmul(weights.astype(v.dtype), values, preferred_element_type=jnp.float32)
            return (out / jnp.sum(weights, axis=-1, keepdims=True)).astype(v.dtype)

        return jax.lax.map(one, q_blocks)

    out = jax.lax.map(lambda args: head(*args), (qt, kt, vt))  # (B * H, blocks, block, Dh)
    return out.reshape(b, h, padded, d)[:, :, :s].transpose(0, 2, 1, 3)


def gpu_fused_attention(q: jax.Array) -> bool:
    """cuDNN's fused (flash) attention for these queries: the trace options name it (NVIDIA
    GPUs unless FLUX2KLEIN_GPU_ATTENTION=xla, core/models/trace.py) and the kernel takes them.

    `jax.nn.dot_product_attention` left to choose takes XLA's form, which materialises every
    score: 32 heads x 21k x 21k float32 scores (56 GB) per block for a 9B edit with four 1024^2
    references. cuDNN's kernel streams them; it takes half precision and head widths up to 128."""
    return (trace.current().attention == "cudnn"
            and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] <= 128 and q.shape[-1] % 8 == 0)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Unmasked attention (B, Sq, H, Dh) x (B, Sk, H, Dh) -> (B, Sq, H, Dh) in the form the trace
    options name: the Pallas splash kernel on TPU (core/models/tpu_attention.py), cuDNN's fused
    kernel on NVIDIA GPUs, the query-blocked form on the host CPU (in the kernel plugin where one loaded)."""
    options = trace.current()
    if options.attention.startswith("splash") and tpu_attention.supports(q, k, v):
        return tpu_attention.splash_attention(q, k, v)
    kernels = trace.plugin(options)
    if kernels is not None and kernels.attention_eligible(q, k, v):
        return kernels.attention(q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype), k, v, _blocked_scaled)
    if options.attention == "blocked":
        return _blocked_attention(q, k, v)
    if gpu_fused_attention(q):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    return jax.nn.dot_product_attention(q, k, v)
