"""The FLUX.2 transformer (`Flux2Transformer2DModel`) in Flax NNX.

Shapes: B batch, T text tokens, N image tokens (output image, then any reference
tokens), S = T + N, D model width = heads x head_dim. Attribute names mirror the
diffusers checkpoint keys so the key plan is mechanical; the double and single
blocks are each stacked on a leading layer axis and run with a scan.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from flux2klein_cli.core.devices.sharding import BATCH_AXES, constrain, model_rule, token_axes
from flux2klein_cli.core.models import trace
from flux2klein_cli.core.models.layers import (
    RMSNorm,
    abstract_module,
    dot_product_attention,
    layer_norm,
    linear,
    run_blocks,
    silu,
    stack_blocks,
)
from flux2klein_cli.core.weights.configs import read_config
from flux2klein_cli.core.weights.loader import Deltas, KeyPlan, plan_from_names
from flux2klein_cli.core.weights.prequantized import load_module

Rope = tuple[jax.Array, jax.Array]  # cos, sin: (S, head_dim) float32


@dataclass(frozen=True)
class TransformerConfig:
    """Flux2Transformer2DModel's config; a field a config.json leaves out takes diffusers' default,
    which is the field's default here (from_dict reads every field through them)."""

    in_channels: int = 128
    out_channels: int = 128  # config.json's null or absent value means in_channels
    num_layers: int = 8
    num_single_layers: int = 48
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360
    timestep_channels: int = 256  # timestep_guidance_channels in config.json
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)
    rope_theta: float = 2000.0
    eps: float = 1e-6
    guidance_embeds: bool = True

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden(self) -> int:
        return int(self.dim * self.mlp_ratio)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> TransformerConfig:
        if config.get("patch_size", 1) != 1:
            raise ValueError("only patch_size 1 transformers exist for FLUX.2; got " + str(config["patch_size"]))
        defaults = cls()
        names = {"timestep_channels": "timestep_guidance_channels"}

        def read(field: str) -> Any:
            value = config.get(names.get(field, field))
            return getattr(defaults, field) if value is None else value

        in_channels = int(read("in_channels"))
        return cls(
            in_channels=in_channels,
            out_channels=int(config.get("out_channels") or in_channels),
            num_layers=int(read("num_layers")),
            num_single_layers=int(read("num_single_layers")),
            attention_head_dim=int(read("attention_head_dim")),
            num_attention_heads=int(read("num_attention_heads")),
            joint_attention_dim=int(read("joint_attention_dim")),
            timestep_channels=int(read("timestep_channels")),
            mlp_ratio=float(read("mlp_ratio")),
            axes_dims_rope=tuple(int(d) for d in read("axes_dims_rope")),
            rope_theta=float(read("rope_theta")),
            eps=float(read("eps")),
            guidance_embeds=bool(read("guidance_embeds")),
        )


def rope_tables(ids: np.ndarray, axes_dims: tuple[int, ...], theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin tables (S, sum(axes_dims)) for position ids (S, len(axes_dims)).

    Angles are computed in float64 on the host, as the reference does; ids depend only on
    shapes, so the tables are compile-time constants of the denoise program."""
    ids = np.asarray(ids, dtype=np.float64)
    cos, sin = [], []
    for axis, dim in enumerate(axes_dims):
        freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        angles = np.repeat(np.outer(ids[:, axis], freqs), 2, axis=1)  # interleaved pairs
        cos.append(np.cos(angles))
        sin.append(np.sin(angles))
    return np.concatenate(cos, -1).astype(np.float32), np.concatenate(sin, -1).astype(np.float32)


@functools.lru_cache(maxsize=16)
def _kept_rope_tables(ids: bytes, count: int, axes_dims: tuple[int, ...],
                      theta: float) -> tuple[np.ndarray, np.ndarray]:
    # Read-only: the same tables are handed to every run of a shape (a few ms each to build).
    cos, sin = rope_tables(np.frombuffer(ids, np.float64).reshape(count, len(axes_dims)), axes_dims, theta)
    cos.flags.writeable = sin.flags.writeable = False
    return cos, sin


def apply_rope(x: jax.Array, rope: Rope) -> jax.Array:
    """Rotate interleaved (even, odd) pairs of x (B, S, H, Dh) in float32."""
    cos, sin = (t[None, :, None, :] for t in rope)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Unmasked attention, (B, S, H, Dh) -> (B, S, H*Dh); padded text is attended to, as in the reference."""
    out = dot_product_attention(q, k, v)
    return out.reshape(*out.shape[:2], out.shape[2] * out.shape[3])


KV = tuple[jax.Array, jax.Array]  # one block's reference keys and values, (B or 1, R, H, Dh)


@dataclass(frozen=True)
class RefMode:
    """How reference tokens take part in a block's attention (the KV cache semantics).

    - plain (n_ref 0, cached None): full attention over the sequence as given;
    - extract (n_ref > 0): the sequence is [txt, ref, img]; text and image queries attend
      to every key, reference queries only to reference keys; the block hands back the
      reference K / V (after q/k-norm and RoPE);
    - cached: the sequence is [txt, img]; keys and values become [txt, cached ref, img].
    """

    n_txt: int = 0
    n_ref: int = 0
    cached: KV | None = None


@dataclass(frozen=True)
class ReferenceKV:
    """The reference KV cache: every block's reference keys and values after q/k-norm and
    RoPE, stacked on a leading block axis, (L, B, R, H, Dh). A pytree, so it passes through
    jit and scan; B is 1 when one cache serves a whole batch."""

    double_k: jax.Array
    double_v: jax.Array
    single_k: jax.Array
    single_v: jax.Array


jax.tree_util.register_dataclass(
    ReferenceKV, data_fields=["double_k", "double_v", "single_k", "single_v"], meta_fields=[]
)


Streams = tuple[jax.Array, jax.Array]  # the image stream (B, N, D) and the text stream (B, T, D)


@dataclass(frozen=True)
class BlockInputs:
    """What every block reads besides the token streams, made once per forward by `embed`.
    A pytree (the token counts are static), so it passes into scans and conds."""

    mod_img: list[jax.Array]  # the double blocks' image-stream (shift, scale, gate) x 2: (B, 1 or N, D)
    mod_txt: list[jax.Array]  # the same for the text stream, (B, 1, D)
    mod_single: list[jax.Array]  # the single blocks' (shift, scale, gate): (B, 1 or S, D)
    silu_temb: jax.Array  # (B, D) the SiLU'd time embedding (the output norm reads it)
    rope: Rope
    cache: ReferenceKV | None  # the references' cached K / V (KV edit), else None
    n_txt: int
    n_ref: int  # reference tokens ahead of the image tokens (extract only), else 0

    def rows(self, start: jax.Array | int, size: int) -> BlockInputs:
        """These inputs for the batch rows [start, start + size) (the rope and the batch-1
        reference cache serve any rows)."""
        def take(a: jax.Array) -> jax.Array:
            return jax.lax.dynamic_slice_in_dim(a, start, size, axis=0)

        mods = jax.tree.map(take, (self.mod_img, self.mod_txt, self.mod_single, self.silu_temb))
        return BlockInputs(*mods, self.rope, self.cache, self.n_txt, self.n_ref)


jax.tree_util.register_dataclass(
    BlockInputs, data_fields=["mod_img", "mod_txt", "mod_single", "silu_temb", "rope", "cache"],
    meta_fields=["n_txt", "n_ref"],
)


def _with_batch(x: jax.Array, batch: int) -> jax.Array:
    # One cache serves every image of a batch (and both CFG branches).
    return jnp.broadcast_to(x, (batch, *x.shape[1:]))


def tokens(batch: int) -> str | tuple[str, ...]:
    """The axes the token sequence is split over: `context`, plus the idle batch axes in the
    sequence form the trace options pick (sharding.token_axes)."""
    return token_axes(batch, trace.current().idle_axes)


def joint_attention(q: jax.Array, k: jax.Array, v: jax.Array, mode: RefMode) -> tuple[jax.Array, KV | None]:
    """Attention under `mode`; returns (B, S, H*Dh) and, when extracting, the reference K / V."""
    t, r = mode.n_txt, mode.n_ref
    # Queries keep their sequence shard (context parallel, and the idle batch axes in the
    # sequence form); keys and values are gathered.
    q = constrain(q, BATCH_AXES, tokens(q.shape[0]), "tensor", None)
    k, v = (constrain(a, BATCH_AXES, None, "tensor", None) for a in (k, v))
    if mode.cached is not None:
        k_ref, v_ref = (_with_batch(a, q.shape[0]) for a in mode.cached)
        k = jnp.concatenate([k[:, :t], k_ref.astype(k.dtype), k[:, t:]], axis=1)
        v = jnp.concatenate([v[:, :t], v_ref.astype(v.dtype), v[:, t:]], axis=1)
        return attention(q, k, v), None
    if r == 0:
        return attention(q, k, v), None
    ref_kv = (k[:, t : t + r], v[:, t : t + r])
    ref_out = attention(q[:, t : t + r], *ref_kv)
    q_rest = jnp.concatenate([q[:, :t], q[:, t + r :]], axis=1)
    if q_rest.shape[1] == 0:  # the references-only pass: no text or image queries
        return ref_out, ref_kv
    rest = attention(q_rest, k, v)
    return jnp.concatenate([rest[:, :t], ref_out, rest[:, t:]], axis=1), ref_kv


def timestep_embedding(t: jax.Array, channels: int) -> jax.Array:
    """Sinusoidal embedding, cos half first, frequencies exp(-ln(1e4) * i / half), in float32."""
    half = channels // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    args = t.astype(jnp.float32)[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    return (1 + scale) * layer_norm(x, eps) + shift


def swiglu(x: jax.Array, *, start: int = 0, after: jax.Array | None = None) -> jax.Array:
    """SiLU(gate) * value of x[..., start:]'s two halves, joined after `after` on the last axis when
    given (the single block's attention output, beside it for the output projection); in one pass of
    the kernel plugin where it has one (core/models/avx512_bf16.py)."""

    def xla(x: jax.Array) -> jax.Array:
        gate, value = jnp.split(x[..., start:], 2, axis=-1)
        out = silu(gate) * value
        return out if after is None else jnp.concatenate([after, out], axis=-1)

    kernels = trace.plugin()
    if kernels is not None and hasattr(kernels, "swiglu") and kernels.swiglu_eligible(x, after):
        return kernels.swiglu(x, start, after, xla)
    return xla(x)


class TimestepEmbedding(nnx.Module):
    """Two linears with an activation between, as diffusers' TimestepEmbedding."""

    def __init__(self, d_in: int, d: int, *, dtype: Any, rngs: nnx.Rngs):
        self.linear_1 = linear(d_in, d, dtype=dtype, rngs=rngs)
        self.linear_2 = linear(d, d, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(silu(self.linear_1(x)))


class TimestepGuidanceEmbeddings(nnx.Module):
    """diffusers' Flux2TimestepGuidanceEmbeddings without a guidance embedder (klein has none)."""

    def __init__(self, channels: int, d: int, *, dtype: Any, rngs: nnx.Rngs):
        self.channels, self.dtype = channels, dtype
        self.timestep_embedder = TimestepEmbedding(channels, d, dtype=dtype, rngs=rngs)

    def __call__(self, t: jax.Array) -> jax.Array:
        """t (B,) float32 timesteps in 0..1000 -> (B, D), before the SiLU the modulations apply."""
        return self.timestep_embedder(timestep_embedding(t, self.channels).astype(
            trace.current().activation_dtype(self.dtype)))


class Modulation(nnx.Module):
    """diffusers' Flux2Modulation: `sets` x (shift, scale, gate), each (B, 1, D), from the SiLU'd
    time embedding."""

    def __init__(self, d: int, sets: int, *, dtype: Any, rngs: nnx.Rngs):
        self.parts = 3 * sets
        self.linear = linear(d, self.parts * d, dtype=dtype, rngs=rngs)

    def __call__(self, silu_temb: jax.Array) -> list[jax.Array]:
        return jnp.split(self.linear(silu_temb)[:, None, :], self.parts, axis=-1)


class AdaLayerNormContinuous(nnx.Module):
    """diffusers' AdaLayerNormContinuous as FLUX.2 uses it: a LayerNorm without affine, then a
    scale and shift from the SiLU'd time embedding."""

    def __init__(self, d: int, eps: float, *, dtype: Any, rngs: nnx.Rngs):
        self.eps = eps
        self.linear = linear(d, 2 * d, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, silu_temb: jax.Array) -> jax.Array:
        scale, shift = jnp.split(self.linear(silu_temb)[:, None, :], 2, axis=-1)
        return layer_norm(x, self.eps) * (1 + scale) + shift


class FeedForward(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, dtype: Any, rngs: nnx.Rngs):
        self.linear_in = linear(dim, 2 * hidden, dtype=dtype, rngs=rngs)
        self.linear_out = linear(hidden, dim, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_out(swiglu(self.linear_in(x)))


class JointAttention(nnx.Module):
    """Projections of the double block: image stream (to_*) and text stream (add_*)."""

    def __init__(self, config: TransformerConfig, *, dtype: Any, rngs: nnx.Rngs):
        d, hd = config.dim, config.attention_head_dim
        self.heads = config.num_attention_heads
        self.to_q, self.to_k, self.to_v = (linear(d, d, dtype=dtype, rngs=rngs) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (linear(d, d, dtype=dtype, rngs=rngs) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(hd, config.eps, dtype=dtype), RMSNorm(hd, config.eps, dtype=dtype)
        self.norm_added_q = RMSNorm(hd, config.eps, dtype=dtype)
        self.norm_added_k = RMSNorm(hd, config.eps, dtype=dtype)
        # A list so the path reads to_out.0 like diffusers' (index 1 there is a dropout).
        self.to_out = nnx.List([linear(d, d, dtype=dtype, rngs=rngs)])
        self.to_add_out = linear(d, d, dtype=dtype, rngs=rngs)

    def heads_of(self, x: jax.Array) -> jax.Array:
        return x.reshape(*x.shape[:2], self.heads, x.shape[-1] // self.heads)

    def __call__(
        self, img: jax.Array, txt: jax.Array, rope: Rope, mode: RefMode
    ) -> tuple[jax.Array, jax.Array, KV | None]:
        q = jnp.concatenate([self.norm_added_q(self.heads_of(self.add_q_proj(txt))),
                             self.norm_q(self.heads_of(self.to_q(img)))], axis=1)
        k = jnp.concatenate([self.norm_added_k(self.heads_of(self.add_k_proj(txt))),
                             self.norm_k(self.heads_of(self.to_k(img)))], axis=1)
        v = jnp.concatenate([self.heads_of(self.add_v_proj(txt)), self.heads_of(self.to_v(img))], axis=1)
        out, ref_kv = joint_attention(apply_rope(q, rope), apply_rope(k, rope), v, mode)
        n_txt = txt.shape[1]
        return self.to_out[0](out[:, n_txt:]), self.to_add_out(out[:, :n_txt]), ref_kv


class DoubleBlock(nnx.Module):
    """Separate image and text weights, one joint attention over [txt, img]."""

    def __init__(self, config: TransformerConfig, *, dtype: Any, rngs: nnx.Rngs):
        self.eps = config.eps
        self.attn = JointAttention(config, dtype=dtype, rngs=rngs)
        self.ff = FeedForward(config.dim, config.mlp_hidden, dtype=dtype, rngs=rngs)
        self.ff_context = FeedForward(config.dim, config.mlp_hidden, dtype=dtype, rngs=rngs)

    def __call__(
        self, img: jax.Array, txt: jax.Array, mod_img: list[jax.Array], mod_txt: list[jax.Array], rope: Rope,
        mode: RefMode,
    ) -> tuple[jax.Array, jax.Array, KV | None]:
        """`img` is the image stream: [ref, img] tokens when extracting (with per-token `mod_img`)."""
        shift, scale, gate, shift2, scale2, gate2 = mod_img
        c_shift, c_scale, c_gate, c_shift2, c_scale2, c_gate2 = mod_txt
        # 1. Joint attention over [txt, img] of both modulated streams.
        img_attn, txt_attn, ref_kv = self.attn(
            modulate(img, shift, scale, self.eps), modulate(txt, c_shift, c_scale, self.eps), rope, mode
        )
        # 2. Image stream: gated attention residual, then the gated feed-forward residual.
        img = img + gate * img_attn
        img = img + gate2 * self.ff(modulate(img, shift2, scale2, self.eps))
        # 3. Text stream: the same with its own weights.
        txt = txt + c_gate * txt_attn
        txt = txt + c_gate2 * self.ff_context(modulate(txt, c_shift2, c_scale2, self.eps))
        return img, txt, ref_kv


class ParallelAttention(nnx.Module):
    """The single block's fused projection: qkv and the MLP input in one matmul, one output matmul."""

    def __init__(self, config: TransformerConfig, *, dtype: Any, rngs: nnx.Rngs):
        d, hd = config.dim, config.attention_head_dim
        self.heads, self.dim = config.num_attention_heads, d
        self.to_qkv_mlp_proj = linear(d, 3 * d + 2 * config.mlp_hidden, dtype=dtype, rngs=rngs)
        self.norm_q, self.norm_k = RMSNorm(hd, config.eps, dtype=dtype), RMSNorm(hd, config.eps, dtype=dtype)
        self.to_out = linear(d + config.mlp_hidden, d, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, rope: Rope, mode: RefMode) -> tuple[jax.Array, KV | None]:
        proj = self.to_qkv_mlp_proj(x)
        out, ref_kv = joint_attention(*self.qkv_heads(proj, rope), mode)
        return self.to_out(swiglu(proj, start=3 * self.dim, after=out)), ref_kv

    def qkv_heads(self, proj: jax.Array, rope: Rope) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(B, S, H, Dh) queries and keys (normed, then rotated) and values from the fused projection;
        in one pass of the kernel plugin where it has one (core/models/avx512_bf16.py)."""
        head_dim = self.dim // self.heads

        def xla(proj: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            head_shape = (*proj.shape[:2], self.heads, head_dim)
            q, k, v = (p.reshape(head_shape) for p in jnp.split(proj[..., : 3 * self.dim], 3, -1))
            return apply_rope(self.norm_q(q), rope), apply_rope(self.norm_k(k), rope), v

        kernels = trace.plugin()
        if (kernels is not None and hasattr(kernels, "qkv_heads") and kernels.qkv_heads_eligible(
                proj, self.heads, head_dim) and self.norm_q.eps == self.norm_k.eps
                and rope[0].shape == (proj.shape[1], head_dim)):
            return kernels.qkv_heads(proj, self.norm_q.weight[...], self.norm_k.weight[...], *rope, self.heads,
                                     self.norm_q.eps, xla)
        return xla(proj)


class SingleBlock(nnx.Module):
    def __init__(self, config: TransformerConfig, *, dtype: Any, rngs: nnx.Rngs):
        self.eps = config.eps
        self.attn = ParallelAttention(config, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, mod: list[jax.Array], rope: Rope, mode: RefMode) -> tuple[jax.Array, KV | None]:
        shift, scale, gate = mod
        # 1. Attention and MLP in parallel from one fused projection of the modulated tokens.
        out, ref_kv = self.attn(modulate(x, shift, scale, self.eps), rope, mode)
        # 2. The gated residual.
        return x + gate * out, ref_kv


def add_embedders(module: nnx.Module, config: TransformerConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
    """The modules around the blocks that make their inputs (time, modulation, token embedders)
    and the output norm, under diffusers' names: the transformer's, and quantize_error's
    stand-alone copy of them."""
    d = config.dim
    module.time_guidance_embed = TimestepGuidanceEmbeddings(config.timestep_channels, d, dtype=dtype, rngs=rngs)
    module.double_stream_modulation_img = Modulation(d, 2, dtype=dtype, rngs=rngs)
    module.double_stream_modulation_txt = Modulation(d, 2, dtype=dtype, rngs=rngs)
    module.single_stream_modulation = Modulation(d, 1, dtype=dtype, rngs=rngs)
    module.x_embedder = linear(config.in_channels, d, dtype=dtype, rngs=rngs)
    module.context_embedder = linear(config.joint_attention_dim, d, dtype=dtype, rngs=rngs)
    module.norm_out = AdaLayerNormContinuous(d, config.eps, dtype=dtype, rngs=rngs)


class Flux2Transformer(nnx.Module):
    def __init__(
        self, config: TransformerConfig, *, dtype: Any = jnp.bfloat16, scan_layers: bool = True, rngs: nnx.Rngs
    ):
        if config.guidance_embeds:
            raise ValueError("guidance-embedding transformers are FLUX.2 [dev], not [klein]")
        if sum(config.axes_dims_rope) != config.attention_head_dim:
            raise ValueError(f"axes_dims_rope {config.axes_dims_rope} must add up to {config.attention_head_dim}")
        self.config, self.dtype, self.scan_layers = config, dtype, scan_layers
        add_embedders(self, config, dtype=dtype, rngs=rngs)
        self.transformer_blocks = stack_blocks(
            lambda r: DoubleBlock(config, dtype=dtype, rngs=r), config.num_layers, rngs
        )
        self.single_transformer_blocks = stack_blocks(
            lambda r: SingleBlock(config, dtype=dtype, rngs=r), config.num_single_layers, rngs
        )
        self.proj_out = linear(config.dim, config.out_channels, dtype=dtype, rngs=rngs)

    def reference_kv_shapes(self, tokens: int) -> list[tuple[int, ...]]:
        """The shapes of a batch-1 ReferenceKV over `tokens` reference tokens, field by field."""
        config = self.config
        per_block = (1, tokens, config.num_attention_heads, config.attention_head_dim)
        double, single = (config.num_layers, *per_block), (config.num_single_layers, *per_block)
        return [double, double, single, single]

    def rope(self, txt_ids: np.ndarray, img_ids: np.ndarray) -> Rope:
        """RoPE tables for the joint sequence [txt, img] from (T, 4) and (N, 4) position ids."""
        ids = np.concatenate([txt_ids, img_ids]).astype(np.float64)
        cos, sin = _kept_rope_tables(ids.tobytes(), len(ids), tuple(self.config.axes_dims_rope),
                                     self.config.rope_theta)
        return jax.device_put(cos), jax.device_put(sin)  # jnp.asarray would compile a copy program

    def __call__(
        self, img: jax.Array, txt: jax.Array, sigma: jax.Array, rope: Rope, reference_kv: ReferenceKV | None = None
    ) -> jax.Array:
        """Velocity for the image tokens: img (B, N, in), txt (B, T, joint), sigma (B,) in [0, 1],
        rope over [txt, img]. With `reference_kv` (cached mode) every block's keys and values
        also hold the cached reference tokens; `img` is then the output image tokens only."""
        return self._forward(img, txt, sigma, rope, cache=reference_kv)[0]

    def extract(
        self, refs: jax.Array, img: jax.Array, txt: jax.Array, sigma: jax.Array, rope: Rope
    ) -> tuple[jax.Array, ReferenceKV]:
        """The reference pipeline's extract step: tokens [refs, img], rope over [txt, refs, img];
        returns the velocity of the image tokens and every block's reference K / V."""
        velocity, kv = self._forward(img, txt, sigma, rope, refs=refs)
        assert kv is not None
        return velocity, kv

    def reference_kv(self, refs: jax.Array, rope: Rope) -> ReferenceKV:
        """The references-only pass: refs (B, R, in), rope over the reference ids.

        Reference queries attend only to reference keys and are modulated with the fixed
        timestep 0, so their K / V do not depend on the prompt, the noise, the step or the
        output size: this is the extract step without text or image tokens."""
        batch = refs.shape[0]
        img = jnp.zeros((batch, 0, self.config.in_channels), refs.dtype)
        txt = jnp.zeros((batch, 0, self.config.joint_attention_dim), trace.current().activation_dtype(self.dtype))
        return self.extract(refs, img, txt, jnp.zeros((batch,), jnp.float32), rope)[1]

    @property
    def depth(self) -> int:
        """Blocks in order: the double blocks, then the single blocks."""
        return self.config.num_layers + self.config.num_single_layers

    def _embed_time(self, sigma: jax.Array) -> jax.Array:
        """The SiLU'd time embedding that every modulation reads."""
        # The reference casts sigma to the model dtype before scaling it to the 0..1000 range.
        t = sigma.astype(self.dtype).astype(jnp.float32) * 1000
        return silu(self.time_guidance_embed(t))

    def _forward(
        self, img: jax.Array, txt: jax.Array, sigma: jax.Array, rope: Rope, *,
        refs: jax.Array | None = None, cache: ReferenceKV | None = None,
    ) -> tuple[jax.Array, ReferenceKV | None]:
        streams, inputs = self.embed(img, txt, sigma, rope, refs=refs, cache=cache)
        (img, _), double_kv, single_kv = self.blocks(streams, inputs)
        # Cached K / V keep the model dtype whatever the activations' (trace.activation_dtype): the
        # cache's size and the stored caches' layout do not depend on the CPU that made them.
        kv = None if refs is None else ReferenceKV(*(a.astype(self.dtype) for a in (*double_kv, *single_kv)))
        return self.head(img, inputs), kv

    def embed(
        self, img: jax.Array, txt: jax.Array, sigma: jax.Array, rope: Rope, *,
        refs: jax.Array | None = None, cache: ReferenceKV | None = None,
    ) -> tuple[Streams, BlockInputs]:
        """The blocks' inputs: the embedded image stream (reference tokens first when
        extracting) and text stream, and what every block reads besides them."""
        dt = trace.current().activation_dtype(self.dtype)
        n_txt, n_img, n_ref = txt.shape[1], img.shape[1], 0 if refs is None else refs.shape[1]
        # 1. Timestep embedding and the modulation parameters of both streams and the single blocks.
        silu_temb = self._embed_time(sigma)
        mod_img = self.double_stream_modulation_img(silu_temb)
        mod_txt = self.double_stream_modulation_txt(silu_temb)
        mod_single = self.single_stream_modulation(silu_temb)
        # 2. Extract only: reference tokens go ahead of the image tokens, modulated with timestep 0.
        if refs is not None:
            ref_temb = self._embed_time(jnp.zeros_like(sigma))
            ref_img = self.double_stream_modulation_img(ref_temb)
            ref_single = self.single_stream_modulation(ref_temb)
            mod_img = [_per_token([(r, n_ref), (m, n_img)]) for r, m in zip(ref_img, mod_img, strict=True)]
            mod_single = [_per_token([(m, n_txt), (r, n_ref), (m, n_img)])
                          for r, m in zip(ref_single, mod_single, strict=True)]
            img = jnp.concatenate([refs.astype(img.dtype), img], axis=1)

        # 3. Input projections of the image (and reference) tokens and the text features.
        seq = tokens(img.shape[0])
        img = constrain(self.x_embedder(img.astype(dt)), BATCH_AXES, seq, None)
        txt = constrain(self.context_embedder(txt.astype(dt)), BATCH_AXES, None, None)
        return (img, txt), BlockInputs(mod_img, mod_txt, mod_single, silu_temb, rope, cache, n_txt, n_ref)

    def blocks(
        self, streams: Streams, inputs: BlockInputs, start: int = 0, stop: int | None = None
    ) -> tuple[Streams, KV | None, KV | None]:
        """Blocks [start, stop) of `depth` (None: to the end) on the streams; with each stack's
        reference K / V when extracting (None for a stack not run). A step cache runs the first
        blocks and the rest as two calls."""
        stop = self.depth if stop is None else stop
        n_double, n_single = self.config.num_layers, self.config.num_single_layers
        n_txt, n_ref, rope, cache = inputs.n_txt, inputs.n_ref, inputs.rope, inputs.cache
        img, txt = streams
        seq = tokens(img.shape[0])
        double_kv = single_kv = None

        # 4. Double-stream blocks: each stream its own weights, one joint attention (cached
        #    reference K / V enter per block as scan inputs).
        def double_step(block: DoubleBlock, carry: tuple[jax.Array, jax.Array], kv: KV | None = None) -> Any:
            img, txt, ref_kv = block(*carry, inputs.mod_img, inputs.mod_txt, rope, RefMode(n_txt, n_ref, kv))
            return (constrain(img, BATCH_AXES, seq, None), constrain(txt, BATCH_AXES, None, None)), ref_kv

        if start < n_double:
            xs = None if cache is None else (cache.double_k, cache.double_v)
            (img, txt), double_kv = run_blocks(
                self.transformer_blocks, (img, txt), double_step, xs=xs, scan=self.scan_layers,
                layers=_layer_range(start, min(stop, n_double), n_double),
            )

        # 5. Single-stream blocks over the joint sequence [txt, (ref,) img].
        def single_step(block: SingleBlock, x: jax.Array, kv: KV | None = None) -> Any:
            x, ref_kv = block(x, inputs.mod_single, rope, RefMode(n_txt, n_ref, kv))
            return constrain(x, BATCH_AXES, seq, None), ref_kv

        if stop > n_double:
            xs = None if cache is None else (cache.single_k, cache.single_v)
            x, single_kv = run_blocks(
                self.single_transformer_blocks, jnp.concatenate([txt, img], axis=1), single_step, xs=xs,
                scan=self.scan_layers, layers=_layer_range(max(start - n_double, 0), stop - n_double, n_single),
            )
            txt, img = x[:, :n_txt], x[:, n_txt:]
        return (img, txt), double_kv, single_kv

    def head(self, img: jax.Array, inputs: BlockInputs) -> jax.Array:
        """6. Output layers on the image tokens of the image stream (after any reference
        tokens): the modulated LayerNorm, then the projection."""
        return self.proj_out(self.norm_out(img[:, inputs.n_ref :], inputs.silu_temb))


def _layer_range(start: int, stop: int, count: int) -> tuple[int, int] | None:
    """run_blocks' `layers` for blocks [start, stop) of a stack of `count`; None for all of them."""
    return None if (start, stop) == (0, count) else (start, stop)


def _per_token(segments: list[tuple[jax.Array, int]]) -> jax.Array:
    """One modulation parameter per token from (B, 1, D) parameters and the lengths of the
    segments they apply to; a single segment stays broadcast (no per-token copy)."""
    live = [(m, n) for m, n in segments if n]
    if len(live) == 1:
        return live[0][0]
    return jnp.concatenate([jnp.broadcast_to(m, (m.shape[0], n, m.shape[-1])) for m, n in live], axis=1)


def transformer_key_plan(model: Flux2Transformer) -> KeyPlan:
    counts = {
        "transformer_blocks": model.config.num_layers,
        "single_transformer_blocks": model.config.num_single_layers,
    }
    return KeyPlan(plan_from_names(nnx.state(model), counts))


def load_transformer(
    directory: str | Path, *, dtype: Any = jnp.bfloat16, mesh: Mesh | None = None, scan_layers: bool = True,
    deltas: Deltas | None = None,
) -> Flux2Transformer:
    """Load a transformer/ folder straight into `dtype`, with `deltas` (LoRA) merged on the way; a
    folder holding a quantized file (GGUF, ComfyUI fp8 / nvfp4) keeps what it can quantized
    (core/weights/prequantized.py)."""
    config = TransformerConfig.from_dict(read_config(directory))
    return load_module(
        abstract_transformer(config, dtype=dtype, scan_layers=scan_layers),
        transformer_key_plan,
        directory,
        mesh,
        sharding_rule=model_rule(mesh),
        deltas=deltas,
    )


def abstract_transformer(config: TransformerConfig, *, dtype: Any = jnp.bfloat16,
                         scan_layers: bool = True) -> Flux2Transformer:
    """Shapes and dtypes only, built once per config, dtype and form in a process (layers.abstract_module)."""
    return abstract_module(lambda: Flux2Transformer(config, dtype=dtype, scan_layers=scan_layers, rngs=nnx.Rngs(0)),
                           ("transformer", config, jnp.dtype(dtype).name, scan_layers))
