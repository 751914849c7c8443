"""The float32 kernels: the AVX-512 bf16 plugin's float32 forms (core/models/avx512_bf16.py, the `*_f32`
targets) and the float32 plugins (core/models/float32_kernels.py: AVX-512's and AVX2's, the same handlers
from the shim's float32-only builds): attention (the transformer's and the text encoder's masked form), a
float32 VAE's 3x3 and 1x1 convolutions, the decoder's upsample convolution and the fused GroupNorm + SiLU +
convolution in float32 FMAs, checked against float64 from the same values and against XLA's forms; what
the float32-only builds hold; and which CPU takes which plugin."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flux2klein_cli.core.devices import cpu
from flux2klein_cli.core.models import avx512_bf16, cpu_matmul, cpu_shim, float32_kernels, kernels
from flux2klein_cli.core.models.layers import linear
from flux2klein_cli.core.models.trace import TraceOptions, traced_under
from flux2klein_cli.core.models.vae import Flux2VAE, VAEConfig
from tests.fixtures.tiny_configs import vae_config
from tests.test_cpu_matmul import (
    attention_under,
    conv_under,
    fresh_status,  # noqa: F401 (a fixture the detection test uses)
    hlo,
    norm_silu_conv_under,
    plugin_missing,
    plugin_options,
    qkv,
    text_attention_inputs,
    text_attention_under,
    upsampled_conv_exact,
    vae_conv,
    vae_resnet,
    vae_upsample,
)

pytestmark = pytest.mark.slow

F32 = avx512_bf16.F32

# The plugins with float32 kernels, each test skipped where this host cannot load it.
F32_PLUGINS = [pytest.param(name, marks=pytest.mark.skipif(plugin_missing(name) is not None,
                                                          reason=str(plugin_missing(name))))
               for name in ("avx512-bf16", "amx", *float32_kernels.BY_NAME)]


def f32_target(plugin: str, name: str) -> str:
    """The float32 target `plugin` registers for `name` (a *_TARGET of the plugin modules): the AMX
    plugin's are the AVX-512 bf16 plugin's."""
    if plugin in float32_kernels.BY_NAME:
        return getattr(float32_kernels.BY_NAME[plugin], name)
    return getattr(avx512_bf16, name) + F32


# The VAE modules of tests/test_cpu_matmul.py, in float32.
f32_conv = functools.partial(vae_conv, dtype=jnp.float32)
f32_upsample = functools.partial(vae_upsample, dtype=jnp.float32)
f32_resnet = functools.partial(vae_resnet, dtype=jnp.float32)


def conv_exact(module: nnx.Module, x: jax.Array) -> np.ndarray:
    """The 'same' convolution with bias in float64 from the same float32 values."""
    kernel, bias = (np.asarray(a, np.float64) for a in (module.kernel[...], module.bias[...]))
    size = kernel.shape[0]
    pad = size // 2
    padded = np.pad(np.asarray(x, np.float64), ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    h, w = x.shape[1:3]
    return sum(padded[:, dy : dy + h, dx : dx + w] @ kernel[dy, dx] for dy in range(size) for dx in range(size)) + bias


@pytest.mark.parametrize("plugin", ["avx512-bf16", "amx", *float32_kernels.BY_NAME])
def test_a_float32_vae_takes_the_float32_targets_and_its_narrow_convolutions_stay_xlas(plugin: str) -> None:
    """Lowering only (no CPU needed): which calls a float32 model's programs hold under the plugin."""
    options = plugin_options(plugin)

    def traced(module: nnx.Module, x: jax.Array, platform: str = "cpu") -> str:
        graphdef, state = nnx.split(module)
        return hlo(traced_under(lambda s, x: nnx.merge(graphdef, s)(x), options), state, x, platform=platform)

    x = jnp.ones((1, 8, 8, 16), jnp.float32)
    held = traced(f32_conv(16, 20), x)
    assert f"@{f32_target(plugin, 'CONV_TARGET')}(" in held and f"@{avx512_bf16.CONV_TARGET}(" not in held
    assert "custom_call" not in traced(f32_conv(16, 20), x, platform="tpu")
    assert "custom_call" not in traced(f32_conv(16, 3), x)  # the decoder's RGB output: XLA's was faster
    assert "custom_call" not in traced(f32_conv(3, 32), jnp.ones((1, 8, 8, 3), jnp.float32))  # the encoder's input
    assert f"@{f32_target(plugin, 'CONV1X1_TARGET')}(" in traced(f32_conv(16, 20, size=1), x)
    assert traced(f32_resnet(16, 16, 4), x).count(f"@{f32_target(plugin, 'NORM_CONV_TARGET')}(") == 2
    upsampled = traced(f32_upsample(16, 16), x)
    assert f"@{f32_target(plugin, 'UPSAMPLE_CONV_TARGET')}(" in upsampled and "conv3x3" not in upsampled.replace(
        f32_target(plugin, "UPSAMPLE_CONV_TARGET"), "")
    # XLA's float32 Linear products ran as fast as the shim's loop: they keep XLA's dot, but for oneMKL's
    # sgemm on the AMX plugin.
    wide = traced(linear(512, 640, dtype=jnp.float32, rngs=nnx.Rngs(0)), jax.ShapeDtypeStruct((2, 320, 512),
                                                                                                jnp.float32))
    if plugin == "amx":
        assert f"@{cpu_matmul.F32_TARGET}(" in wide
    else:
        assert "custom_call" not in wide
    if plugin == "amx":  # a bf16 module's convolutions keep the tiles' targets, at any width
        bf16_conv = traced(vae_conv(16, 3), x.astype(jnp.bfloat16))
        assert f"@{cpu_matmul.CONV_TARGET}(" in bf16_conv and F32 not in bf16_conv
        # and a bf16 upsample its upsampled copy and the tiles (the AVX-512 form was slower there)
        bf16_upsample = traced(vae_upsample(16, 16), x.astype(jnp.bfloat16))
        assert f"@{cpu_matmul.CONV_TARGET}(" in bf16_upsample and avx512_bf16.UPSAMPLE_CONV_TARGET not in bf16_upsample


def assert_as_close_as_xla(ours: np.ndarray, xla: np.ndarray, exact: np.ndarray, times: float = 2,
                           reach: float = 1e-5) -> None:
    """float32 sums in another order: errors against float64 within `reach` of the largest output and
    within `times` XLA's on average (a wrong tap, panel, key or bias would be off by the size of the
    outputs)."""
    assert ours.shape == xla.shape == exact.shape
    ours_err, xla_err = np.abs(ours - exact), np.abs(xla - exact)
    assert ours_err.max() <= reach * np.abs(exact).max(), (ours_err.max(), np.abs(exact).max())
    assert ours_err.mean() <= times * xla_err.mean(), (ours_err.mean(), xla_err.mean())


def conv_bounds(h: int, w: int, c_in: int, c_out: int, size: int = 3) -> dict[str, float]:
    """assert_as_close_as_xla's bounds for a float32 convolution in the shim: Winograd's F(4x4, 3x3) (a 3x3
    convolution whose height and width are multiples of 4) multiplies by up to 8 in its transforms, and its
    error against float64 grows with the input channels: 4x XLA's on average at 64, 5x at 128, 8x at 344,
    9-10x at 512, at most 2e-5 of the largest output; the other forms stay at XLA's error."""
    f4 = size == 3 and h % 4 == 0 and w % 4 == 0
    return {"times": 12, "reach": 3e-5} if f4 else {}


@pytest.mark.parametrize("plugin", F32_PLUGINS)
@pytest.mark.parametrize("shape, size", [((1, 20, 13, 16, 20), 3), ((2, 9, 30, 48, 32), 3), ((1, 16, 16, 64, 128), 3),
                                         ((1, 5, 40, 17, 33), 3), ((2, 10, 14, 17, 33), 3), ((1, 34, 22, 48, 40), 3),
                                         ((2, 12, 20, 17, 33), 3), ((1, 8, 36, 48, 40), 3), ((1, 8, 12, 344, 352), 3),
                                         ((1, 32, 48, 344, 352), 3), ((1, 4, 256, 256, 256), 3), ((2, 7, 5, 24, 40), 1),
                                         ((1, 33, 12, 128, 64), 1)])
def test_float32_convolutions_in_the_shim_are_as_close_to_float64_as_xlas(plugin: str, shape: tuple[int, ...],
                                                                           size: int) -> None:
    """A 3x3 convolution whose height and width are multiples of 4 runs in Winograd's F(4x4, 3x3) form, of
    other even sizes in F(2x2, 3x3) (its transforms only add, subtract and halve: the error stays XLA's), of
    odd ones in the nine taps: all three here, with channel counts off the panels' 32, blocks off whole groups
    of the products' rows, wide kernels (344 x 352: eleven panels, a 17 MB F(4x4) kernel packed on every
    core; at 8 x 12 too few blocks for a chunk per core, so F(2x2), at 32 x 48 on 2 cores enough for F(4x4))
    and a row of 64 blocks, more than one chunk (256 x 256: a 9 MB kernel, chunks of two groups)."""
    b, h, w, c_in, c_out = shape
    module = f32_conv(c_in, c_out, size=size)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((b, h, w, c_in)), jnp.float32)
    ours, xla = (np.asarray(conv_under(form)(module, x), np.float64) for form in (plugin, None))
    assert_as_close_as_xla(ours, xla, conv_exact(module, x), **conv_bounds(h, w, c_in, c_out, size))


@pytest.mark.parametrize("plugin", F32_PLUGINS)
@pytest.mark.parametrize("shape", [(1, 16, 12, 64, 32), (2, 8, 20, 24, 40), (1, 4, 128, 128, 128), (2, 9, 5, 16, 20),
                                   (1, 30, 33, 128, 128), (1, 10, 14, 48, 33)])
def test_the_float32_upsample_convolution_is_as_close_to_float64_as_xlas(plugin: str,
                                                                         shape: tuple[int, ...]) -> None:
    """A nearest 2x upsample then a 3x3 convolution whose input's height and width are multiples of 4 runs as
    four 3x3 convolutions of the input, one per output phase, in F(4x4, 3x3) (conv_bounds; Cout off the
    panels' 32 leaves each phase's last panel part empty; 128 x 128 at 128 wide spans chunks); other sizes as
    four merged-tap 2x2 convolutions, float32 sums at XLA's error."""
    b, h, w, c_in, c_out = shape
    module = f32_upsample(c_in, c_out)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((b, h, w, c_in)), jnp.float32)
    ours, xla = (np.asarray(conv_under(form)(module, x), np.float64) for form in (plugin, None))
    assert_as_close_as_xla(ours, xla, upsampled_conv_exact(module, x), **conv_bounds(h, w, c_in, c_out))


@pytest.mark.parametrize("plugin", F32_PLUGINS)
@pytest.mark.parametrize("shape", [(1, 40, 24, 32, 32, 8), (2, 17, 9, 16, 48, 4)])
def test_the_float32_fused_norm_silu_conv_matches_xlas_forms(plugin: str, shape: tuple[int, ...]) -> None:
    """GroupNorm, SiLU and the convolution in one float32 call: XLA's forms to float32 rounding."""
    b, h, w, c_in, c_out, groups = shape
    block = f32_resnet(c_in, c_out, groups)
    x = jnp.asarray(3 * np.random.default_rng(1).standard_normal((b, h, w, c_in)) + 1, jnp.float32)

    ours, xla = (np.asarray(norm_silu_conv_under(form)(block, x), np.float64) for form in (plugin, None))
    assert ours.shape == (b, h, w, c_out)
    np.testing.assert_allclose(ours, xla, rtol=1e-5, atol=1e-5 * np.abs(xla).max())
    whole = [np.asarray(conv_under(form)(block, x), np.float64) for form in (plugin, None)]
    np.testing.assert_allclose(whole[0], whole[1], rtol=1e-5, atol=1e-5 * np.abs(whole[1]).max())


@pytest.mark.parametrize("plugin", F32_PLUGINS)
def test_in_the_float32_shim_non_finite_values_stay_non_finite(plugin: str) -> None:
    x = np.random.default_rng(2).standard_normal((1, 12, 10, 16)).astype(np.float32)
    x[0, 3, 4, 1], x[0, 8, 2, 5] = np.nan, np.inf
    x = jnp.asarray(x)
    odd = x[:, :11, :9]  # a 3x3 convolution of odd size takes the nine taps, of even size Winograd's form
    for module, values in ((f32_conv(16, 16), odd), (f32_conv(16, 16, size=1), x), (f32_resnet(16, 16, 4), x)):
        ours, xla = (np.asarray(conv_under(form)(module, values)) for form in (plugin, None))
        np.testing.assert_array_equal(np.isnan(ours), np.isnan(xla))
        np.testing.assert_array_equal(np.isinf(ours), np.isinf(xla))
        assert not np.isfinite(ours).all()
    # The merged taps turn inf * w1 + inf * w2 into inf * (w1 + w2), and Winograd's transforms turn an inf into
    # +inf and -inf terms of one sum (NaN where the taps give inf): the same outputs are non-finite.
    for module in (f32_upsample(16, 16), f32_conv(16, 16)):
        ours, xla = (np.asarray(conv_under(form)(module, x)) for form in (plugin, None))
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(xla))
        assert not np.isfinite(ours).all()
    # F(4x4, 3x3) (a width that is a multiple of 4) spreads them further: a non-finite value in one of its
    # blocks' inputs reaches every output of the block through the transforms, so every output XLA's
    # form makes non-finite is non-finite here too, and the others only in a block holding one of them.
    wide = jnp.pad(x, ((0, 0), (0, 0), (0, 2), (0, 0)))
    ours, xla = (np.asarray(conv_under(form)(f32_conv(16, 16), wide)) for form in (plugin, None))
    lost, spread = ~np.isfinite(xla), ~np.isfinite(ours)
    assert lost.any() and not (lost & ~spread).any()
    blocks = lost.reshape(1, 3, 4, 3, 4, 16).any(axis=(2, 4), keepdims=True)
    assert not (spread.reshape(1, 3, 4, 3, 4, 16) & ~blocks).any()


def attention_exact(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None) -> np.ndarray:
    """Softmax attention in float64 from the same values: grouped keys and values repeated, masked keys
    left out, a query with no allowed key zero."""
    group = q.shape[2] // k.shape[2]
    qf, kf, vf = (np.asarray(a, np.float64) for a in (q, k, v))
    kf, vf = np.repeat(kf, group, axis=2), np.repeat(vf, group, axis=2)
    allowed = np.ones((q.shape[0], 1, q.shape[1], k.shape[1]), bool) if mask is None else np.asarray(mask)[:, None]
    scores = np.where(allowed, np.einsum("bqhd,bkhd->bhqk", qf, kf) * q.shape[-1] ** -0.5, -np.inf)
    top = scores.max(-1, keepdims=True)
    weights = np.where(allowed, np.exp(scores - np.where(np.isfinite(top), top, 0)), 0)
    weights /= np.maximum(weights.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhqk,bkhd->bqhd", weights, vf)


@pytest.mark.parametrize("plugin", F32_PLUGINS)
@pytest.mark.parametrize("shape", [(1, 300, 300, 4, 128), (2, 100, 260, 3, 64), (1, 1, 7, 1, 16)])
def test_float32_attention_in_the_shim_is_as_close_to_float64_as_xlas(plugin: str, shape: tuple[int, ...]) -> None:
    """float32 scores, weights and P @ V (nothing rounded to bf16), normalised after. The shim's exp
    (a degree-6 polynomial, relative error under 2e-7: about two float32 ulps) puts its error at 2-2.5x
    XLA's, still about 1e-7 of the outputs."""
    q, k, v = (a.astype(jnp.float32) for a in qkv(*shape))
    held = attention_under(plugin).trace(q, k, v).lower().as_text()
    assert f"@{f32_target(plugin, 'ATTENTION_TARGET')}(" in held
    ours, xla = (np.asarray(attention_under(form)(q, k, v), np.float64) for form in (plugin, None))
    assert_as_close_as_xla(ours, xla, attention_exact(q, k, v), times=3)


@pytest.mark.parametrize("plugin", F32_PLUGINS)
def test_kernel_calls_in_a_row_share_no_stale_scratch(plugin: str) -> None:
    """Each thread keeps its kernel scratch from call to call: an attention call with new values of the
    same shape packs its own keys and values (not the last call's of the same head), and a call after a
    longer one, or a masked one after it, reads nothing the longer one left behind."""
    forms = {"unmasked": (attention_under(plugin), attention_under(None)),
             "masked": (text_attention_under(plugin), text_attention_under(None))}
    # One head: every thread that ran a block of an earlier call holds that head packed.
    calls = [("unmasked", (1, 300, 300, 1, 64), 0), ("unmasked", (1, 300, 300, 1, 64), 1),
             ("unmasked", (1, 300, 300, 1, 64), 2), ("unmasked", (1, 40, 600, 2, 64), 3),
             ("unmasked", (1, 40, 70, 2, 64), 4), ("masked", (2, 64, 2, 2, 64), 0)]
    for form, shape, seed in calls:
        if form == "masked":
            q, k, v, mask = text_attention_inputs(*shape)
            args: tuple[jax.Array, ...] = (*(a.astype(jnp.float32) for a in (q, k, v)), mask)
        else:
            args = tuple(a.astype(jnp.float32) for a in qkv(*shape, seed=seed))
        ours, xla = (np.asarray(program(*args), np.float64) for program in forms[form])
        assert_as_close_as_xla(ours, xla, attention_exact(*args), times=3)
    # The same for the packed weight columns of the 1x1 products (new weights, the same shape) and the
    # convolutions' padded tiles (a wide image, then a narrow one).
    rng = np.random.default_rng(2)
    for c_in, c_out, size, h, w, seed in [(64, 48, 1, 9, 20, 0), (64, 48, 1, 9, 20, 1), (32, 32, 3, 40, 64, 0),
                                          (32, 32, 3, 6, 10, 1)]:
        module = f32_conv(c_in, c_out, seed=seed, size=size)
        x = jnp.asarray(rng.standard_normal((1, h, w, c_in)), jnp.float32)
        ours, xla = (np.asarray(conv_under(form)(module, x), np.float64) for form in (plugin, None))
        assert_as_close_as_xla(ours, xla, conv_exact(module, x), **conv_bounds(h, w, c_in, c_out, size))


@pytest.mark.parametrize("plugin", F32_PLUGINS)
@pytest.mark.parametrize("shape", [(2, 300, 8, 2, 64), (2, 37, 6, 3, 16), (2, 130, 4, 4, 128)])
def test_the_text_encoders_float32_attention_in_the_shim_is_as_close_to_float64_as_xlas(
        plugin: str, shape: tuple[int, ...]) -> None:
    """The masked, grouped-query form in float32: masked keys left out, a query with no allowed key
    zero (the second prompt's first two); the exp as above."""
    q, k, v, mask = text_attention_inputs(*shape)
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    held = text_attention_under(plugin).trace(q, k, v, mask).lower().as_text()
    assert f"@{f32_target(plugin, 'MASKED_ATTENTION_TARGET')}(" in held
    ours, xla = (np.asarray(text_attention_under(form)(q, k, v, mask), np.float64) for form in (plugin, None))
    assert not np.any(ours[1, :2])
    assert_as_close_as_xla(ours, xla, attention_exact(q, k, v, mask), times=3)


@pytest.mark.parametrize("plugin", float32_kernels.BY_NAME)
def test_a_bf16_model_on_a_cpu_without_bf16_takes_the_float32_kernels(plugin: str) -> None:
    """Such a CPU computes a bf16 model with float32 activations (bf16_compute `f32`): its VAE's
    convolutions take the float32 plugin's calls with the weights widened, as close to XLA's float32
    form of the same model as float32 sums in another order are. Where the CPU has bf16 (the plugin
    forced, bf16 activations) they keep XLA's forms."""
    widened = TraceOptions("cpu", "blocked", kernels=plugin, bf16_compute="f32")
    x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 12, 10, 16)), jnp.float32)
    modules = {"NORM_CONV_TARGET": vae_resnet(16, 16, 4, dtype=jnp.bfloat16),
               "UPSAMPLE_CONV_TARGET": vae_upsample(16, 16, dtype=jnp.bfloat16),
               "CONV1X1_TARGET": vae_conv(16, 20, size=1, dtype=jnp.bfloat16)}
    for target, module in modules.items():
        graphdef, state = nnx.split(module)
        held = hlo(traced_under(lambda s, x, g=graphdef: nnx.merge(g, s)(x), widened), state, x)
        assert f"@{f32_target(plugin, target)}(" in held
        bf16_cpu = TraceOptions("cpu", "blocked", kernels=plugin, bf16_compute="f32-accumulate")
        assert "custom_call" not in hlo(traced_under(lambda s, x, g=graphdef: nnx.merge(g, s)(x), bf16_cpu), state,
                                        x.astype(jnp.bfloat16))
        if plugin_missing(plugin) is None:  # this host runs the float32 kernels
            ours, xla = (np.asarray(nnx.jit(traced_under(lambda m, x: m(x), options))(module, x), np.float64)
                         for options in (widened, TraceOptions("cpu", "blocked", bf16_compute="f32")))
            assert ours.dtype == xla.dtype and ours.shape == xla.shape
            np.testing.assert_allclose(ours, xla, rtol=1e-5, atol=1e-5 * np.abs(xla).max())


def test_a_bf16_vae_computes_in_float32_under_the_avx512_bf16_plugin() -> None:
    """TraceOptions.for_vae: under the AVX-512 bf16 plugin (a CPU with a bf16 dot: bf16 operands elsewhere) a
    bf16 VAE's encode and decode trace with float32 activations, their convolutions the plugin's float32
    calls (Winograd's form) and none of its bf16 ones, and decode as XLA's float32-activation form of the
    same model does; the other plugins' and platforms' forms stay as they are."""
    bf16_cpu = TraceOptions("cpu", "blocked", kernels="avx512-bf16", bf16_compute="f32-accumulate")
    assert bf16_cpu.for_vae() == replace(bf16_cpu, bf16_compute="f32")
    for kept in (replace(bf16_cpu, kernels="amx"), replace(bf16_cpu, kernels=None), TraceOptions("tpu", "splash"),
                 TraceOptions("cpu", "blocked", kernels="avx512-f32", bf16_compute="f32")):
        assert kept.for_vae() == kept
    vae = Flux2VAE(VAEConfig.from_dict(vae_config(levels=3)), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(4)
    for _, var in nnx.to_flat_state(nnx.state(vae, nnx.Param)):
        value = var.get_value()
        var.set_value(jnp.asarray(0.1 * rng.standard_normal(value.shape), value.dtype))
    graphdef, state = nnx.split(vae)
    latents = jnp.asarray(rng.standard_normal((1, 4, 4, vae.config.patched_channels)), jnp.float32)
    pixels = jnp.asarray(rng.uniform(-1, 1, (1, 32, 32, 3)), jnp.bfloat16)
    decode = traced_under(lambda s, z: nnx.merge(graphdef, s).decode(z), bf16_cpu)
    encode = traced_under(lambda s, x: nnx.merge(graphdef, s).encode(x), bf16_cpu)
    for held in (hlo(decode, state, latents), hlo(encode, state, pixels)):
        assert f"@{avx512_bf16.NORM_CONV_TARGET}{F32}(" in held
        assert f"@{avx512_bf16.NORM_CONV_TARGET}(" not in held and f"@{avx512_bf16.CONV_TARGET}(" not in held
    if plugin_missing("avx512-bf16") is None:  # this host runs its float32 kernels
        widened_xla = TraceOptions("cpu", "blocked", bf16_compute="f32")
        xla = traced_under(lambda s, z: nnx.merge(graphdef, s).decode(z), widened_xla)
        ours, want = (np.asarray(jax.jit(fn)(state, latents), np.float64) for fn in (decode, xla))
        np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# Instructions past Skylake-SP's AVX-512 (F, CD, BW, DQ, VL): bf16, AMX, VNNI, VBMI and VBMI2, IFMA,
# BITALG and VPOPCNTDQ, VP2INTERSECT, GFNI, VAES, VPCLMULQDQ.
NEWER_THAN_SKYLAKE = re.compile(
    r"^(vdpbf16ps|vcvtne2?ps2bf16|tdp\w+|tile\w+|ldtilecfg|sttilecfg|vpdpbu?s[sd]s?|vpdpwss[sd]s?|vpermb|vpermi2b|"
    r"vpermt2b|vpmultishiftqb|vpcompress[bw]|vpexpand[bw]|vpsh[lr]dv?[wdq]|vpmadd52[lh]uq|vpopcnt[bwdq]|"
    r"vpshufbitqmb|vp2intersect[dq]|gf2p8\w+|vaes\w+|vpclmulqdq)$")


def mnemonics(shim: str) -> set[str]:
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", shim], capture_output=True, text=True,
                             check=True).stdout
    return {line.split("\t")[1].split()[0] for line in listing.splitlines() if line.count("\t") >= 1
            and re.match(r"^\s+[0-9a-f]+:\t\S", line)}


# Legacy prefixes that may come before an instruction's VEX or EVEX prefix (operand and address size,
# segments, rep).
LEGACY_PREFIXES = {"66", "67", "f2", "f3", "2e", "3e", "26", "36", "64", "65"}


def evex_count(shim: str) -> int:
    """How many instructions of the shim are EVEX-encoded (AVX-512's encoding; 0x62 opens one in
    64-bit code), from objdump's bytes: any register, width or mask, not a list of mnemonics."""
    listing = subprocess.run(["objdump", "-d", "-w", shim], capture_output=True, text=True, check=True).stdout
    count = 0
    for line in listing.splitlines():
        fields = line.split("\t")
        if len(fields) < 3 or not re.match(r"^\s+[0-9a-f]+:$", fields[0]):
            continue
        opcode = [byte for byte in fields[1].split()]
        while opcode and opcode[0] in LEGACY_PREFIXES:
            opcode.pop(0)
        count += bool(opcode) and opcode[0] == "62"
    return count


def exported(shim: str) -> set[str]:
    table = subprocess.run(["nm", "-D", "--defined-only", shim], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in table.splitlines() if line.split()[-1].startswith("flux2klein_")}


@pytest.mark.skipif(cpu_shim.compiler() is None or shutil.which("objdump") is None or shutil.which("nm") is None,
                    reason="no C++ compiler or binutils")
def test_the_float32_builds_run_on_their_cpus_and_hold_only_float32_handlers() -> None:
    """The float32-only build holds no instruction a CPU with AVX-512 and no bf16 lacks, and only the
    float32 handlers (with the transposing copy); the bf16 build, checked the same way, holds bf16. The
    AVX2 build holds no AVX-512 instruction. (Each is built where the plugins keep it, once: compiling
    needs no such CPU.)"""
    shims = {build: cpu_shim.shim_path(build) for build in cpu_shim.BUILDS}
    for build, shim in shims.items():
        assert cpu_shim.build_shim(shim, build) is None
    f32 = mnemonics(str(shims["f32"]))
    assert "vfmadd231ps" in f32 and not {m for m in f32 if NEWER_THAN_SKYLAKE.match(m)}
    assert "vdpbf16ps" in {m for m in mnemonics(str(shims["bf16"])) if NEWER_THAN_SKYLAKE.match(m)}
    handlers = {"flux2klein_avx512_" + name + "_f32" for name in (
        "attention", "masked_attention", "conv3x3", "norm_silu_conv3x3", "conv1x1", "upsample_conv3x3")}
    assert exported(str(shims["f32"])) == handlers | {"flux2klein_transpose_copy"}
    assert handlers | {"flux2klein_avx512_gemm", "flux2klein_amx_attention"} <= exported(str(shims["bf16"]))
    # The AVX2 build: no AVX-512 instruction at all (the f32 build, checked the same way, is full of them),
    # the FMAs on 8-lane registers, and the same handlers.
    avx2 = str(shims["avx2"])
    assert evex_count(avx2) == 0 and evex_count(str(shims["f32"])) > 100
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", avx2], capture_output=True, text=True).stdout
    assert re.search(r"vfmadd231ps\s+.*%ymm", listing) and "%zmm" not in listing
    assert exported(avx2) == handlers | {"flux2klein_transpose_copy"}


# A Skylake-SP server's flags (AVX-512 without bf16) and an AMD Zen 3 server's (AVX2 and FMA, no AVX-512).
CPUINFO_SKYLAKE = ("processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c avx512f avx512dq "
                   "avx512cd avx512bw avx512vl\n")
CPUINFO_ZEN3 = ("processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 sha_ni "
                "vaes vpclmulqdq\n")


@pytest.fixture
def first_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An x86 process that has opened no shim, its cache in tmp_path, no FLUX2KLEIN_CPU_MATMUL, and a
    compiler that is never run (`CXX=/usr/bin/true`)."""
    monkeypatch.setattr(kernels.cpu, "is_x86", lambda: True)
    monkeypatch.delenv("FLUX2KLEIN_CPU_MATMUL", raising=False)
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path))
    monkeypatch.delenv("FLUX2KLEIN_NATIVE_CACHE", raising=False)  # the suite's shared shim
    monkeypatch.setattr(cpu_shim, "_opened", {})
    monkeypatch.setenv("CXX", "/usr/bin/true")
    return tmp_path


@pytest.mark.usefixtures("fresh_status")
@pytest.mark.parametrize("cpuinfo, name, words", [
    (CPUINFO_SKYLAKE, "avx512-f32", ("no AVX-512 bf16", "AVX-512 FMAs", "float32 activations")),
    (CPUINFO_ZEN3, "avx2-f32", ("no AVX-512 (", "AVX2 FMAs", "float32 activations")),
], ids=["skylake", "zen3"])
def test_a_cpu_without_bf16_takes_its_float32_plugin(cpuinfo: str, name: str, words: tuple[str, ...],
                                                     monkeypatch: pytest.MonkeyPatch, first_run: Path) -> None:
    """AVX-512 without bf16 takes the AVX-512 float32 plugin, AVX2 and FMA without AVX-512 the AVX2 one:
    named in reports with what its first run will do (nothing built); without a compiler, XLA's forms and
    nothing half-built; none under FLUX2KLEIN_CPU_MATMUL=xla; where this host can run it, detection
    loads it."""
    flags = cpu.cpu_flags(cpuinfo)
    report = kernels.detect(flags, build=False)
    assert report.name == name and "built on the first run" in report.reason
    assert all(word in report.reason for word in words), report.reason
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(cpu_shim.shutil, "which", lambda name: None)
    status = kernels.detect(flags)
    assert status.name is None and "no C++ compiler" in status.reason
    assert not any((first_run / "native").iterdir())
    monkeypatch.setenv("FLUX2KLEIN_CPU_MATMUL", "xla")
    assert kernels.detect(flags).name is None
    if plugin_missing(name) is None:  # this host builds and runs it
        monkeypatch.undo()
        monkeypatch.setattr(kernels.cpu, "is_x86", lambda: True)
        monkeypatch.delenv("FLUX2KLEIN_CPU_MATMUL", raising=False)
        assert kernels.detect(flags).name == name


@pytest.mark.usefixtures("fresh_status", "first_run")
def test_cpus_between_the_float32_plugins_take_the_one_they_can_run() -> None:
    """AVX-512F without BW, VL and DQ (Knights Landing) takes AVX2's; AVX without AVX2, or AVX2 without
    FMA, keeps XLA's forms."""
    knights = kernels.detect(frozenset({"avx2", "fma", "avx512f", "avx512cd"}), build=False)
    assert knights.name == "avx2-f32" and "no AVX-512 (avx512f, avx512bw" in knights.reason
    for older in ({"avx", "sse4_2"}, {"avx", "avx2"}):  # Sandy Bridge; AVX2 without FMA
        status = kernels.detect(frozenset(older))
        assert status.name is None and "neither AVX-512 (avx512f" in status.reason
        assert "nor AVX2 with FMA" in status.reason
