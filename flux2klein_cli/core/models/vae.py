"""The FLUX.2 VAE (diffusers' `AutoencoderKLFlux2`) in Flax NNX, images NHWC.

`encode` gives exactly what the pipeline feeds the transformer before packing to tokens:
the posterior mean, 2x2-patchified and normalised by the checkpoint's batch-norm running
statistics. `decode` undoes both and runs the decoder. The module tree mirrors the
diffusers checkpoint's key names, so the key plan is derived from the NNX paths.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from flux2klein_cli.core.models import trace
from flux2klein_cli.core.models.layers import ZEROS, ZeroInitRngs, abstract_module, dot_product_attention, linear
from flux2klein_cli.core.models.vae_config import VAEConfig
from flux2klein_cli.core.weights.configs import read_config
from flux2klein_cli.core.weights.loader import KeyPlan, load_module, plan_from_names

# diffusers hard-codes these for every norm inside the VAE (the config's batch_norm_eps is
# only for the latent statistics).
GROUP_NORM_EPS = 1e-6


# ----------------------------------------------------------------------------- layers


@contextlib.contextmanager
def convs_as_matmuls() -> Iterator[None]:
    """While tracing inside, the VAE's 3x3 convolutions are written as one matmul each (see
    `Conv.as_matmul`; the trace options' `convs_as_matmuls`, core/models/trace.py): libtpu
    compiles the 9B decoder in about 40% less time, and XLA's cost model puts the TPU decode
    about 30% slower. `--effort fast` programs for TPU are traced so."""
    with trace.tracing(dataclasses.replace(trace.current(), convs_as_matmuls=True)):
        yield


class Conv(nnx.Conv):
    """nnx.Conv (the same parameters), with a matmul form of the 3x3 'same' convolution."""

    def _same_3x3(self) -> bool:
        return self.kernel_size == (3, 3) and self.strides in (1, (1, 1)) and self.padding == ((1, 1), (1, 1))

    @property
    def call_dtype(self) -> Any:
        """What the plugin's call computes in: the module's activations' dtype (a bf16 module's are
        float32 on a CPU without a bf16 dot instruction)."""
        return trace.current().activation_dtype(self.dtype)

    def _plugin(self, x: jax.Array) -> Any:
        """The kernel plugin this call takes (bf16 on an AMX CPU; bf16 or float32 on AVX-512 bf16;
        float32 on AVX-512 without bf16), or None."""
        kernels = trace.plugin()
        eligible = kernels is not None and kernels.conv_eligible(x, self.call_dtype, self.bias is not None,
                                                                 self.out_features)
        return kernels if eligible else None

    def _call_weights(self) -> tuple[jax.Array, jax.Array]:
        """The kernel and bias in the dtype the plugin's call takes for all its buffers (call_dtype)."""
        return self.kernel[...].astype(self.call_dtype), self.bias[...].astype(self.call_dtype)

    def after_norm_silu(self, norm: GroupNorm, x: jax.Array) -> jax.Array:
        """self(norm(x, silu=True)); on the oneMKL path as one shim call that normalises and
        activates each tile of rows just before its products (XLA's pass over the padded
        activation was the decode's largest elementwise cost)."""
        kernels = self._plugin(x)
        if not (kernels and self._same_3x3() and not trace.current().convs_as_matmuls):
            return self(norm(x, silu=True))
        mean, scale = (a.reshape(x.shape[0], -1) for a in norm.statistics(x))
        kernel, bias = self._call_weights()
        return kernels.norm_silu_conv3x3(x.astype(self.call_dtype), mean, scale, norm.bias[...].astype(jnp.float32),
                                         kernel, bias, lambda x: self(norm(x, silu=True)))

    def __call__(self, x: jax.Array, out_sharding: Any = None) -> jax.Array:
        same_3x3 = self._same_3x3()
        if same_3x3 and trace.current().convs_as_matmuls:
            return self.as_matmul(x)
        kernels = self._plugin(x)
        if kernels and same_3x3:
            return kernels.conv3x3(x.astype(self.call_dtype), *self._call_weights(),
                                   lambda x: super(Conv, self).__call__(x, out_sharding=out_sharding))
        if kernels and self.kernel_size == (1, 1) and self.strides in (1, (1, 1)) and self.padding == ((0, 0),) * 2:
            return kernels.conv1x1(x.astype(self.call_dtype), *self._call_weights(),
                                   lambda x: super(Conv, self).__call__(x, out_sharding=out_sharding))
        return super().__call__(x, out_sharding=out_sharding)

    def as_matmul(self, x: jax.Array) -> jax.Array:
        """The three horizontal taps side by side as input channels, the three kernel rows side
        by side as output channels: one (3 C_in) x (3 C_out) matmul per pixel; each output row
        then sums row r-1's first, row r's second and row r+1's third group, float32 throughout."""
        if self.dtype is not None:
            x = x.astype(self.dtype)
        b, h, w, c_in = x.shape
        kernel = self.kernel[...]  # (row, column, C_in, C_out)
        padded = jnp.pad(x, ((0, 0), (0, 0), (1, 1), (0, 0)))
        taps = jnp.concatenate([padded[:, :, dx : dx + w] for dx in range(3)], axis=-1)  # (B, H, W, 3 C_in)
        rows = kernel.reshape(3, 3 * c_in, -1)  # (row, column-major taps, C_out)
        per_row = jnp.einsum("bhwc,rcd->bhwrd", taps, rows, preferred_element_type=jnp.float32)
        per_row = jnp.pad(per_row, ((0, 0), (1, 1), (0, 0), (0, 0), (0, 0)))
        out = sum(per_row[:, dy : dy + h, :, dy] for dy in range(3)) + self.bias[...].astype(jnp.float32)
        return out.astype(x.dtype)  # x is in the module's dtype by now


def conv(
    d_in: int, d_out: int, kernel: int, *, dtype: Any, rngs: nnx.Rngs, stride: int = 1, padding: Any = None
) -> Conv:
    """A torch-style Conv2d with bias on NHWC input; `padding` defaults to 'same' for odd kernels."""
    pad = padding if padding is not None else ((kernel // 2, kernel // 2),) * 2
    return Conv(
        d_in, d_out, (kernel, kernel), stride, padding=pad, use_bias=True, dtype=dtype, param_dtype=dtype,
        kernel_init=ZEROS, bias_init=ZEROS, rngs=rngs, conv_general_dilated=trace.conv_general_dilated,
        promote_dtype=trace.promote_dtype,
    )


class GroupNorm(nnx.Module):
    """torch.nn.GroupNorm over the last (channel) axis of NHWC, statistics in float32.

    With `silu` the activation that always follows is applied before casting back, so it is
    computed in float32 too and fuses into the same pass."""

    def __init__(self, channels: int, groups: int, *, dtype: Any, eps: float = GROUP_NORM_EPS):
        self.weight = nnx.Param(jnp.ones((channels,), dtype))
        self.bias = nnx.Param(jnp.zeros((channels,), dtype))
        self.groups = groups
        self.eps = eps

    def statistics(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each group's mean and the per-channel scale (its 1 / std times the weight), float32,
        (B, 1, C) each: the norm is (x - mean) * scale + bias."""
        b, *_, c = x.shape
        g = self.groups
        flat = x.reshape(b, -1, c)  # (B, positions, channels)
        count = flat.shape[1] * (c // g)

        def per_channel_group_mean(values: jax.Array) -> jax.Array:
            # Each group's mean, repeated over its channels: (B, 1, C). Summed over positions first,
            # then a group's channels, with every tensor kept (B, positions, C): XLA's CPU backend
            # ran the (B, positions, groups, C / groups) form 3-4x slower on a decoder activation.
            groups = jnp.sum(values, axis=1).reshape(b, g, c // g).sum(axis=2, keepdims=True) / count
            return jnp.broadcast_to(groups, (b, g, c // g)).reshape(b, 1, c)

        mean = per_channel_group_mean(flat.astype(jnp.float32))
        if x.dtype != jnp.float32 and trace.current().convert_per_pass:
            # A second convert of its own, fused into the variance's reduction: with one convert for
            # both passes, XLA:CPU wrote a bf16 activation's float32 copy to memory between them
            # (several times the two reductions' time; docs/benchmarks.md). The values are the same.
            flat = jax.lax.optimization_barrier(flat)
        # Two-pass variance: E[x^2] - E[x]^2 cancels badly for large activations.
        var = per_channel_group_mean(jnp.square(flat.astype(jnp.float32) - mean))
        # Fold the affine weight into the per-channel scale: one multiply-add per element.
        return mean, jax.lax.rsqrt(var + self.eps) * self.weight[...].astype(jnp.float32)

    def __call__(self, x: jax.Array, *, silu: bool = False) -> jax.Array:
        b, *_, c = x.shape
        mean, scale = self.statistics(x)
        y = (x.astype(jnp.float32).reshape(b, -1, c) - mean) * scale + self.bias[...].astype(jnp.float32)
        if silu:
            y = jax.nn.silu(y)
        return y.reshape(x.shape).astype(x.dtype)


class ResnetBlock(nnx.Module):
    """diffusers' ResnetBlock2D without a time embedding: norm-silu-conv twice, plus a skip."""

    def __init__(self, d_in: int, d_out: int, groups: int, *, dtype: Any, rngs: nnx.Rngs):
        self.norm1 = GroupNorm(d_in, groups, dtype=dtype)
        self.conv1 = conv(d_in, d_out, 3, dtype=dtype, rngs=rngs)
        self.norm2 = GroupNorm(d_out, groups, dtype=dtype)
        self.conv2 = conv(d_out, d_out, 3, dtype=dtype, rngs=rngs)
        # A 1x1 projection only when the width changes, as in the checkpoint.
        self.conv_shortcut = conv(d_in, d_out, 1, dtype=dtype, rngs=rngs) if d_in != d_out else None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.conv1.after_norm_silu(self.norm1, x)
        h = self.conv2.after_norm_silu(self.norm2, h)
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return skip + h


def run_resnets(resnets: Sequence[ResnetBlock], x: jax.Array) -> jax.Array:
    """Apply resnets in order; a run of two or more with the same widths goes through one
    `lax.scan` over their stacked parameters, so the compiler sees one body instead of
    several copies (libtpu spends seconds per convolution it compiles). Stacking copies a
    few MB of weights per call, nothing next to the activations."""
    i = 0
    while i < len(resnets):
        j = i + 1
        while j < len(resnets) and _widths(resnets[j]) == _widths(resnets[i]) == (x.shape[-1],) * 2:
            j += 1
        if j - i == 1:
            x = resnets[i](x)
        else:
            graphdef, *_ = nnx.split(resnets[i])
            stacked = jax.tree.map(lambda *a: jnp.stack(a), *(nnx.state(r) for r in resnets[i:j]))

            def body(h: jax.Array, state: nnx.State, graphdef: Any = graphdef) -> tuple[jax.Array, None]:
                return nnx.merge(graphdef, state)(h), None

            x, _ = jax.lax.scan(body, x, stacked)
        i = j
    return x


def _widths(block: ResnetBlock) -> tuple[int, int]:
    return block.norm1.weight.shape[0], block.conv2.out_features


class SpatialAttention(nnx.Module):
    """The mid-block attention: one head as wide as the channels, over all H*W positions,
    group-normed input, biased projections, residual add."""

    def __init__(self, channels: int, groups: int, *, dtype: Any, rngs: nnx.Rngs):
        self.group_norm = GroupNorm(channels, groups, dtype=dtype)
        self.to_q = linear(channels, channels, dtype=dtype, rngs=rngs, bias=True)
        self.to_k = linear(channels, channels, dtype=dtype, rngs=rngs, bias=True)
        self.to_v = linear(channels, channels, dtype=dtype, rngs=rngs, bias=True)
        # A list so the path reads to_out.0 like the checkpoint (index 1 there is a dropout).
        self.to_out = nnx.List([linear(channels, channels, dtype=dtype, rngs=rngs, bias=True)])

    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, c = x.shape
        seq = self.group_norm(x).reshape(b, h * w, 1, c)  # (B, T, heads=1, C)
        # Logits and softmax run in float32 whatever the dtype.
        out = dot_product_attention(self.to_q(seq), self.to_k(seq), self.to_v(seq))
        return x + self.to_out[0](out.reshape(b, h, w, c))


class Downsample(nnx.Module):
    def __init__(self, channels: int, *, dtype: Any, rngs: nnx.Rngs):
        # diffusers pads right and bottom by one, then a stride-2 unpadded conv; the same
        # numbers as a conv with asymmetric padding, without a separate pad op.
        self.conv = conv(channels, channels, 3, dtype=dtype, rngs=rngs, stride=2, padding=((0, 1), (0, 1)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.conv(x)


class Upsample(nnx.Module):
    def __init__(self, channels: int, *, dtype: Any, rngs: nnx.Rngs):
        self.conv = conv(channels, channels, 3, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        kernels = None if trace.current().convs_as_matmuls else self.conv._plugin(x)
        if kernels is not None and hasattr(kernels, "upsample_conv3x3"):  # the AVX-512 plugin's
            return kernels.upsample_conv3x3(x.astype(self.conv.call_dtype), *self.conv._call_weights(),
                                            self._upsampled_conv)
        return self._upsampled_conv(x)

    def _upsampled_conv(self, x: jax.Array) -> jax.Array:
        # Nearest 2x as broadcast + reshape: identical to an image resize, far cheaper to compile.
        b, h, w, c = x.shape
        x = jnp.broadcast_to(x[:, :, None, :, None, :], (b, h, 2, w, 2, c)).reshape(b, 2 * h, 2 * w, c)
        return self.conv(x)


class DownBlock(nnx.Module):
    def __init__(
        self, d_in: int, d_out: int, layers: int, groups: int, downsample: bool, *, dtype: Any, rngs: nnx.Rngs
    ):
        widths = [d_in] + [d_out] * (layers - 1)
        self.resnets = nnx.List([ResnetBlock(c, d_out, groups, dtype=dtype, rngs=rngs) for c in widths])
        self.downsamplers = nnx.List([Downsample(d_out, dtype=dtype, rngs=rngs)]) if downsample else None

    def __call__(self, x: jax.Array) -> jax.Array:
        x = run_resnets(self.resnets, x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
        return x


class UpBlock(nnx.Module):
    def __init__(self, d_in: int, d_out: int, layers: int, groups: int, upsample: bool, *, dtype: Any, rngs: nnx.Rngs):
        widths = [d_in] + [d_out] * (layers - 1)
        self.resnets = nnx.List([ResnetBlock(c, d_out, groups, dtype=dtype, rngs=rngs) for c in widths])
        self.upsamplers = nnx.List([Upsample(d_out, dtype=dtype, rngs=rngs)]) if upsample else None

    def __call__(self, x: jax.Array) -> jax.Array:
        x = run_resnets(self.resnets, x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x


class MidBlock(nnx.Module):
    """resnet, (attention, resnet): the optional attention sits between two resnets."""

    def __init__(self, channels: int, groups: int, attention: bool, *, dtype: Any, rngs: nnx.Rngs):
        self.resnets = nnx.List([ResnetBlock(channels, channels, groups, dtype=dtype, rngs=rngs) for _ in range(2)])
        self.attentions = nnx.List([SpatialAttention(channels, groups, dtype=dtype, rngs=rngs)]) if attention else None

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class Encoder(nnx.Module):
    def __init__(self, config: VAEConfig, *, dtype: Any, rngs: nnx.Rngs):
        widths, groups = config.block_out_channels, config.norm_num_groups
        self.conv_in = conv(config.in_channels, widths[0], 3, dtype=dtype, rngs=rngs)
        self.down_blocks = nnx.List(
            [
                DownBlock(
                    widths[max(i - 1, 0)], w, config.layers_per_block, groups, i < len(widths) - 1,
                    dtype=dtype, rngs=rngs,
                )
                for i, w in enumerate(widths)
            ]
        )
        self.mid_block = MidBlock(widths[-1], groups, config.mid_block_add_attention, dtype=dtype, rngs=rngs)
        self.conv_norm_out = GroupNorm(widths[-1], groups, dtype=dtype)
        # Mean and log-variance: twice the latent channels.
        self.conv_out = conv(widths[-1], 2 * config.latent_channels, 3, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out.after_norm_silu(self.conv_norm_out, x)


class Decoder(nnx.Module):
    def __init__(self, config: VAEConfig, *, dtype: Any, rngs: nnx.Rngs):
        widths, groups = config.decoder_block_out_channels[::-1], config.norm_num_groups
        self.conv_in = conv(config.latent_channels, widths[0], 3, dtype=dtype, rngs=rngs)
        self.mid_block = MidBlock(widths[0], groups, config.mid_block_add_attention, dtype=dtype, rngs=rngs)
        # The decoder has one more resnet per block than the encoder.
        self.up_blocks = nnx.List(
            [
                UpBlock(
                    widths[max(i - 1, 0)],
                    w,
                    config.layers_per_block + 1,
                    groups,
                    i < len(widths) - 1,
                    dtype=dtype,
                    rngs=rngs,
                )
                for i, w in enumerate(widths)
            ]
        )
        self.conv_norm_out = GroupNorm(widths[-1], groups, dtype=dtype)
        self.conv_out = conv(widths[-1], config.out_channels, 3, dtype=dtype, rngs=rngs)

    def __call__(self, z: jax.Array) -> jax.Array:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out.after_norm_silu(self.conv_norm_out, x)


class LatentStats(nnx.Module):
    """The checkpoint's `bn` (a BatchNorm2d without affine): only its running statistics are
    used, to normalise patchified latents. Always float32, whatever the model dtype."""

    def __init__(self, channels: int, eps: float):
        self.running_mean = nnx.BatchStat(jnp.zeros((channels,), jnp.float32))
        self.running_var = nnx.BatchStat(jnp.ones((channels,), jnp.float32))
        self.eps = eps

    def normalize(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        return (x - self.running_mean[...]) / jnp.sqrt(self.running_var[...] + self.eps)

    def denormalize(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        return x * jnp.sqrt(self.running_var[...] + self.eps) + self.running_mean[...]


def patchify(z: jax.Array) -> jax.Array:
    """(B, h, w, C) -> (B, h/2, w/2, 4C), channel c*4 + ph*2 + pw as in the pipeline's NCHW code."""
    b, h, w, c = z.shape
    z = z.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4)
    return z.reshape(b, h // 2, w // 2, c * 4)


def unpatchify(x: jax.Array) -> jax.Array:
    """The exact inverse of `patchify`."""
    b, h, w, c4 = x.shape
    x = x.reshape(b, h, w, c4 // 4, 2, 2).transpose(0, 1, 4, 2, 5, 3)
    return x.reshape(b, h * 2, w * 2, c4 // 4)


class Flux2VAE(nnx.Module):
    """AutoencoderKLFlux2 on NHWC images, with the pipeline's latent patchify and normalisation."""

    def __init__(self, config: VAEConfig, *, dtype: Any = jnp.bfloat16, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        self.encoder = Encoder(config, dtype=dtype, rngs=rngs)
        self.decoder = Decoder(config, dtype=dtype, rngs=rngs)
        lat = config.latent_channels
        self.quant_conv = conv(2 * lat, 2 * lat, 1, dtype=dtype, rngs=rngs) if config.use_quant_conv else None
        self.post_quant_conv = conv(lat, lat, 1, dtype=dtype, rngs=rngs) if config.use_post_quant_conv else None
        self.bn = LatentStats(config.patched_channels, config.batch_norm_eps)

    def encode(self, pixels: jax.Array) -> jax.Array:
        """(B, H, W, in_channels) in [-1, 1] -> normalised patchified latents
        (B, H/16, W/16, 4 * latent_channels), float32: the posterior mean, no sampling."""
        _, h, w, _ = pixels.shape
        f = self.config.spatial_factor
        if h % f or w % f:
            raise ValueError(f"VAE encode needs height and width divisible by {f}, got {h}x{w}")
        with trace.tracing(trace.current().for_vae()):  # the VAE's own forms (TraceOptions.for_vae)
            # 1. The encoder, then quant_conv: the posterior's mean and log-variance.
            moments = self.encoder(pixels.astype(trace.current().activation_dtype(self.dtype)))
            if self.quant_conv is not None:
                moments = self.quant_conv(moments)
            # 2. The mean alone (no sampling), 2x2-patchified and normalised by the latent statistics.
            mean = moments[..., : self.config.latent_channels]
            return self.bn.normalize(patchify(mean))

    def decode(self, latents: jax.Array) -> jax.Array:
        """Normalised patchified latents (B, h, w, 4 * latent_channels) -> images
        (B, 16h, 16w, out_channels), float32, roughly in [-1, 1] and not clipped."""
        if latents.shape[-1] != self.config.patched_channels:
            raise ValueError(
                f"VAE decode expects {self.config.patched_channels} latent channels, got {latents.shape[-1]}"
            )
        with trace.tracing(trace.current().for_vae()):  # the VAE's own forms (TraceOptions.for_vae)
            # 1. Undo the normalisation and the 2x2 patches.
            z = unpatchify(self.bn.denormalize(latents)).astype(trace.current().activation_dtype(self.dtype))
            # 2. post_quant_conv, then the decoder.
            if self.post_quant_conv is not None:
                z = self.post_quant_conv(z)
            return self.decoder(z).astype(jnp.float32)


# ----------------------------------------------------------------------------- weights


def vae_key_plan(model: Flux2VAE) -> KeyPlan:
    """Every parameter and running statistic of the model, under its diffusers key (the tree
    mirrors AutoencoderKLFlux2's)."""
    # The step counter of the batch norm is training state, meaningless here.
    return KeyPlan(plan_from_names(nnx.state(model)), ignore=lambda key: key == "bn.num_batches_tracked")


def load_vae(directory: str | Path, *, dtype: Any = jnp.bfloat16, mesh: Mesh | None = None) -> Flux2VAE:
    """Build the VAE of a `vae/` component folder abstractly and load its weights in `dtype`
    (the latent statistics stay float32)."""
    config = VAEConfig.from_dict(read_config(directory))
    return load_module(abstract_vae(config, dtype=dtype), vae_key_plan, directory, mesh)


def build_vae(config: VAEConfig, *, dtype: Any = jnp.bfloat16) -> Flux2VAE:
    """The VAE for `nnx.eval_shape` (a parameter-free build: weights come from a checkpoint)."""
    return Flux2VAE(config, dtype=dtype, rngs=ZeroInitRngs())  # type: ignore[arg-type]


def abstract_vae(config: VAEConfig, *, dtype: Any = jnp.bfloat16) -> Flux2VAE:
    """Shapes and dtypes only (ZeroInitRngs: a third of the time a real `nnx.Rngs` takes), built once
    per config and dtype in a process (layers.abstract_module)."""
    return abstract_module(lambda: build_vae(config, dtype=dtype), ("vae", config, jnp.dtype(dtype).name))
