"""The CPU kernel plugins: the AMX one (core/models/cpu_matmul.py: bf16 Linear dots, attention and the
VAE's convolutions through oneMKL on AMX CPUs) and the AVX-512 bf16 one (core/models/avx512_bf16.py:
attention and the VAE's convolutions in VDPBF16PS), chosen by the backend dispatch
(core/models/trace.py, kernels.py); XLA's forms elsewhere. Each numerics test runs for every plugin
this host can load."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flux2klein_cli.core.compile import keys as store_keys
from flux2klein_cli.core.compile import store, target
from flux2klein_cli.core.devices import cpu
from flux2klein_cli.core.models import (
    avx512_bf16,
    cpu_matmul,
    cpu_shim,
    float32_kernels,
    kernels,
    layers,
    trace,
)
from flux2klein_cli.core.models.layers import linear
from flux2klein_cli.core.models.trace import TraceOptions, traced_under

# Long for the fast tier (`-m "not slow"`, under 4 minutes); the full suite runs it.
pytestmark = pytest.mark.slow

CPUINFO_AMX = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n\nprocessor\t: 1\n"
CPUINFO_AVX512 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n"
DIMS = (((1,), (0,)), ((), ()))


@pytest.fixture
def fresh_status() -> Iterator[None]:
    """Each test detects again; the process's real choice comes back afterwards."""
    kernels.plugin_status.cache_clear()
    yield
    kernels.plugin_status.cache_clear()


def bf16_linear(seed: int = 0) -> nnx.Linear:
    layer = linear(64, 48, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), bias=True)
    rng = np.random.default_rng(seed)
    layer.kernel[...] = jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16)
    layer.bias[...] = jnp.asarray(rng.standard_normal(48), jnp.bfloat16)
    return layer


def hlo(fn, *args, platform: str = "cpu") -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def amx_options(on: bool = True) -> TraceOptions:
    """A CPU program's options with the AMX plugin on or off."""
    return plugin_options("amx" if on else None)


def plugin_options(plugin: str | None) -> TraceOptions:
    """A CPU program's options with the kernel plugin `plugin` (None: XLA's forms)."""
    return TraceOptions("cpu", "blocked", kernels=plugin)


@functools.cache
def plugin_missing(plugin: str) -> str | None:
    """Why this host cannot run `plugin`'s kernels (None: it can; loading it registers its targets)."""
    if plugin == "amx":
        status = kernels.plugin_status()
        return None if status.name == "amx" else f"no oneMKL AMX path: {status.reason}"
    if plugin in float32_kernels.BY_NAME:
        runs = cpu.has_avx512 if plugin == "avx512-f32" else cpu.has_avx2
        if not (cpu.is_x86() and runs(cpu.cpu_flags())):
            return f"the CPU cannot run {plugin}"
        return float32_kernels.BY_NAME[plugin].load()
    if not (cpu.is_x86() and "avx512_bf16" in cpu.cpu_flags()):
        return "the CPU has no AVX-512 bf16"
    return avx512_bf16.load()


# Every bf16 plugin, each test skipped where this host cannot load it (the float32 ones:
# tests/test_float32_kernels.py).
PLUGINS = [pytest.param(name, marks=pytest.mark.skipif(plugin_missing(name) is not None,
                                                      reason=str(plugin_missing(name))))
           for name in kernels.PLUGINS if name not in float32_kernels.BY_NAME]
# Tests of what only the AVX-512 bf16 plugin has (the bf16 upsample convolution, the bf16 GEMM).
avx512 = pytest.mark.skipif(plugin_missing("avx512-bf16") is not None, reason=str(plugin_missing("avx512-bf16")))


def test_cpu_flags_read_the_first_processor() -> None:
    assert cpu.has_amx_bf16(cpu.cpu_flags(CPUINFO_AMX))
    assert not cpu.has_amx_bf16(cpu.cpu_flags(CPUINFO_AVX512))
    assert cpu.has_bf16_dot(cpu.cpu_flags(CPUINFO_AVX512)) and not cpu.has_bf16_dot(frozenset({"avx2", "fma"}))
    assert cpu.cpu_flags("no flags here") == frozenset()


def test_a_cpu_without_amx_keeps_xlas_dot(monkeypatch: pytest.MonkeyPatch, fresh_status: None) -> None:
    """AVX-512 bf16 without AMX: the AVX-512 plugin on x86 (its shim builds here), which leaves the
    smaller Linear dots to XLA."""
    flags = cpu.cpu_flags(CPUINFO_AVX512)
    monkeypatch.setattr(kernels.cpu, "cpu_flags", lambda: flags)
    monkeypatch.delenv("FLUX2KLEIN_CPU_MATMUL", raising=False)
    expected = "avx512-bf16" if cpu.is_x86() else None
    assert kernels.plugin_status().name == expected and TraceOptions.for_platform("cpu").kernels == expected
    assert "AMX" in kernels.plugin_status().reason
    layer = bf16_linear()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 5, 64)), jnp.bfloat16)
    assert "custom_call" not in hlo(lambda x: layer(x), x)
    plain = jax.lax.dot_general(x, layer.kernel[...], (((2,), (0,)), ((), ()))) + layer.bias[...]
    np.testing.assert_array_equal(np.asarray(layer(x), np.float32), np.asarray(plain, np.float32))


def test_opt_out_and_missing_pieces_fall_back(monkeypatch: pytest.MonkeyPatch, fresh_status: None,
                                              tmp_path: Path) -> None:
    flags = cpu.cpu_flags(CPUINFO_AMX)
    monkeypatch.setattr(kernels.cpu, "is_x86", lambda: True)
    monkeypatch.setenv("FLUX2KLEIN_CPU_MATMUL", "xla")
    assert kernels.detect(flags).name is None
    monkeypatch.delenv("FLUX2KLEIN_CPU_MATMUL")
    monkeypatch.setattr(kernels, "find_mkl", lambda: None)
    assert "oneMKL is not installed" in kernels.detect(flags).reason
    monkeypatch.setattr(kernels, "find_mkl", lambda: "/nowhere/libmkl_rt.so.3")
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path))
    monkeypatch.delenv("FLUX2KLEIN_NATIVE_CACHE", raising=False)  # the suite's shared shim
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(cpu_shim.shutil, "which", lambda name: None)
    monkeypatch.setattr(cpu_shim, "_opened", {})  # as in a process that has not opened the shim yet
    status = kernels.detect(flags)
    assert status.name is None and "no C++ compiler" in status.reason
    assert not list((tmp_path / "native").iterdir())  # nothing half-built left


def test_only_cpu_programs_hold_the_custom_call() -> None:
    x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 16), jnp.bfloat16)
    dot = traced_under(lambda x, w: trace.dot_general(x, w, DIMS), amx_options())
    assert cpu_matmul.TARGET in hlo(dot, x, w)
    assert cpu_matmul.TARGET not in hlo(dot, x, w, platform="tpu")
    # float32 and batched dots are not its business.
    assert cpu_matmul.TARGET not in hlo(dot, x.astype(jnp.float32), w.astype(jnp.float32))
    batched = traced_under(lambda x, w: trace.dot_general(x, w, (((2,), (1,)), ((0,), (0,)))), amx_options())
    assert cpu_matmul.TARGET not in hlo(batched, jnp.ones((2, 4, 8), jnp.bfloat16), jnp.ones((2, 8, 3), jnp.bfloat16))
    assert cpu_matmul.TARGET not in hlo(traced_under(lambda x, w: trace.dot_general(x, w, DIMS), amx_options(False)),
                                        x, w)


def qkv(batch: int, queries: int, keys: int, heads: int, dim: int, seed: int = 0) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(2 * rng.standard_normal((batch, n, heads, dim)), jnp.bfloat16)
                 for n in (queries, keys, keys))


def cpu_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Attention as a CPU program of this process traces it."""
    return traced_under(layers.dot_product_attention, TraceOptions.for_platform("cpu"))(q, k, v)


def test_attention_takes_the_shim_only_on_the_onemkl_path(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = qkv(1, 8, 12, 2, 16)

    def traced(*args: jax.Array, platform: str = "cpu") -> str:  # a new function: no trace cached from before
        return hlo(lambda q, k, v: cpu_attention(q, k, v), *args, platform=platform)

    monkeypatch.setattr(kernels, "plugin_status", lambda: kernels.Status(None, "no AMX"))
    assert cpu_matmul.ATTENTION_TARGET not in traced(q, k, v)  # the fallback: XLA's blocked form
    monkeypatch.setattr(kernels, "plugin_status", lambda: kernels.Status("amx", "test"))
    assert cpu_matmul.ATTENTION_TARGET in traced(q, k, v)
    assert cpu_matmul.ATTENTION_TARGET not in traced(q, k, v, platform="tpu")
    assert cpu_matmul.ATTENTION_TARGET not in traced(*(a.astype(jnp.float32) for a in (q, k, v)))


def text_attention_inputs(batch: int, length: int, heads: int, kv_heads: int, dim: int) -> tuple[jax.Array, ...]:
    """Queries, keys, values and mask as the text encoder makes them: causal over real tokens, the
    first prompt padded on the right, the second (if any) on the left, so that its first queries
    see no key at all."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(2 * rng.standard_normal((batch, length, heads, dim)), jnp.bfloat16)
    k, v = (jnp.asarray(2 * rng.standard_normal((batch, length, kv_heads, dim)), jnp.bfloat16) for _ in range(2))
    real = np.ones((batch, length), bool)
    real[0, length - length // 3:] = False
    real[1:, :2] = False
    mask = np.tril(np.ones((length, length), bool))[None] & real[:, None, :]
    return q, k, v, jnp.asarray(mask)


def text_attention_under(onemkl: bool | str) -> object:
    """The text encoder's attention as a CPU program traced with the oneMKL kernels on or off, or
    with the plugin named."""
    from flux2klein_cli.core.models.qwen3 import _attention

    options = plugin_options(onemkl) if isinstance(onemkl, str) else amx_options(onemkl)
    return jax.jit(traced_under(lambda q, k, v, mask: _attention(q, k, v, mask, q.shape[-1] ** -0.5), options))


def test_the_text_encoders_attention_takes_the_shim_only_on_the_onemkl_path() -> None:
    args = text_attention_inputs(2, 9, 4, 2, 16)
    assert cpu_matmul.MASKED_ATTENTION_TARGET in text_attention_under(True).trace(*args).lower().as_text()
    assert cpu_matmul.MASKED_ATTENTION_TARGET not in text_attention_under(False).trace(*args).lower().as_text()
    f32 = [a.astype(jnp.float32) for a in args[:3]] + [args[3]]
    assert cpu_matmul.MASKED_ATTENTION_TARGET not in text_attention_under(True).trace(*f32).lower().as_text()


def vae_conv(c_in: int, c_out: int, seed: int = 0, size: int = 3, dtype: Any = jnp.bfloat16) -> nnx.Module:
    """The VAE's conv with random weights (bf16 unless `dtype` says otherwise)."""
    from flux2klein_cli.core.models.vae import conv

    module = conv(c_in, c_out, size, dtype=dtype, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(seed)
    module.kernel[...] = jnp.asarray(0.2 * rng.standard_normal((size, size, c_in, c_out)), dtype)
    module.bias[...] = jnp.asarray(rng.standard_normal(c_out), dtype)
    return module


def vae_upsample(c_in: int, c_out: int, seed: int = 0, dtype: Any = jnp.bfloat16) -> nnx.Module:
    """The decoder's Upsample (nearest 2x, then a 3x3 convolution) from c_in to c_out channels."""
    from flux2klein_cli.core.models.vae import Upsample

    module = Upsample(c_in, dtype=dtype, rngs=nnx.Rngs(0))
    module.conv = vae_conv(c_in, c_out, seed, dtype=dtype)
    return module


def conv_under(plugin: str | None) -> object:
    """The VAE's conv (or any module) as a CPU program traced with the plugin named (None: XLA's forms)."""
    return nnx.jit(traced_under(lambda m, x: m(x), plugin_options(plugin)))


def norm_silu_conv_under(plugin: str | None) -> object:
    """A VAE resnet's first GroupNorm, SiLU and 3x3 convolution as one CPU program, traced with the
    plugin named (None: XLA's forms)."""
    return nnx.jit(traced_under(lambda m, x: m.conv1.after_norm_silu(m.norm1, x), plugin_options(plugin)))


def test_the_vaes_3x3_convolutions_take_the_shim_only_on_the_onemkl_path() -> None:
    module, x = vae_conv(4, 6), jnp.ones((1, 8, 8, 4), jnp.bfloat16)

    def traced(onemkl: bool, module: nnx.Module = module, platform: str = "cpu") -> str:
        graphdef, state = nnx.split(module)
        fn = traced_under(lambda s, x: nnx.merge(graphdef, s)(x), amx_options(onemkl))
        return hlo(fn, state, x, platform=platform)

    assert cpu_matmul.CONV_TARGET not in traced(False)
    assert cpu_matmul.CONV_TARGET in traced(True)
    assert cpu_matmul.TARGET in traced(True, vae_conv(4, 6, size=1))  # 1x1: the Linear layers' dot
    assert cpu_matmul.TARGET not in traced(False, vae_conv(4, 6, size=1))
    assert cpu_matmul.CONV_TARGET not in traced(True, platform="tpu")
    in_float32 = vae_conv(4, 6)
    in_float32.dtype = jnp.float32  # an fp32 run's VAE
    assert cpu_matmul.CONV_TARGET not in traced(True, in_float32)


def vae_resnet(c_in: int, c_out: int, groups: int, seed: int = 0, dtype: Any = jnp.bfloat16) -> nnx.Module:
    from flux2klein_cli.core.models.vae import ResnetBlock

    block = ResnetBlock(c_in, c_out, groups, dtype=dtype, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(block)):
        offset = 1.0 if "norm" in str(path[0]) and path[-1] == "weight" else 0.0  # norm weights near one
        var.set_value(jnp.asarray(offset + 0.2 * rng.standard_normal(var.get_value().shape), dtype))
    return block


def test_the_vaes_norm_silu_conv_takes_one_shim_call_only_on_the_onemkl_path() -> None:
    block, x = vae_resnet(8, 8, 4), jnp.ones((1, 8, 8, 8), jnp.bfloat16)

    def traced(onemkl: bool, block: nnx.Module = block, platform: str = "cpu") -> str:
        graphdef, state = nnx.split(block)
        fn = traced_under(lambda s, x: nnx.merge(graphdef, s)(x), amx_options(onemkl))
        return hlo(fn, state, x, platform=platform)

    assert traced(True).count(f"@{cpu_matmul.NORM_CONV_TARGET}(") == 2  # conv1 and conv2, each with its norm
    assert f"@{cpu_matmul.CONV_TARGET}(" not in traced(True)
    assert cpu_matmul.NORM_CONV_TARGET not in traced(False)
    assert cpu_matmul.NORM_CONV_TARGET not in traced(True, platform="tpu")


def test_the_avx512_plugin_takes_attention_the_vaes_convolutions_and_the_larger_dots() -> None:
    """Lowering only (no CPU needed): which calls the AVX-512 bf16 plugin's programs hold."""
    options = plugin_options("avx512-bf16")

    def traced(module: nnx.Module, x: jax.Array, platform: str = "cpu") -> str:
        graphdef, state = nnx.split(module)
        return hlo(traced_under(lambda s, x: nnx.merge(graphdef, s)(x), options), state, x, platform=platform)

    x = jnp.ones((1, 8, 8, 4), jnp.bfloat16)
    assert f"@{avx512_bf16.CONV_TARGET}(" in traced(vae_conv(4, 6), x)
    assert avx512_bf16.CONV_TARGET not in traced(vae_conv(4, 6), x, platform="tpu")
    assert avx512_bf16.CONV_TARGET not in traced(vae_conv(3, 6), jnp.ones((1, 8, 8, 3), jnp.bfloat16))  # RGB in
    assert f"@{avx512_bf16.CONV1X1_TARGET}(" in traced(vae_conv(4, 6, size=1), x)  # the VAE's shortcuts
    assert traced(vae_resnet(8, 8, 4), jnp.ones((1, 8, 8, 8), jnp.bfloat16)).count(
        f"@{avx512_bf16.NORM_CONV_TARGET}(") == 2
    assert "custom_call" not in traced(bf16_linear(), jnp.ones((3, 64), jnp.bfloat16))  # too small to pay
    big = linear(512, 640, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), bias=True)  # 2 x 320 x 512 x 640 products
    tokens = jax.ShapeDtypeStruct((2, 320, 512), jnp.bfloat16)
    assert traced(big, tokens).count(f"@{avx512_bf16.GEMM_TARGET}(") == 1
    assert avx512_bf16.GEMM_TARGET not in traced(big, tokens, platform="tpu")
    assert avx512_bf16.GEMM_TARGET not in traced(big, jax.ShapeDtypeStruct((2, 100, 512), jnp.bfloat16))
    wide = linear(512, 640, dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert avx512_bf16.GEMM_TARGET not in traced(wide, jax.ShapeDtypeStruct((2, 320, 512), jnp.float32))
    odd = linear(511, 640, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))  # VDPBF16PS sums pairs of the inner dim
    assert avx512_bf16.GEMM_TARGET not in traced(odd, jax.ShapeDtypeStruct((2, 320, 511), jnp.bfloat16))
    from flux2klein_cli.core.models.transformer import swiglu

    proj, attended = jnp.ones((1, 5, 4 + 2 * 6), jnp.bfloat16), jnp.ones((1, 5, 3), jnp.bfloat16)
    joined = traced_under(lambda p, a: swiglu(p, start=4, after=a), options)
    assert f"@{avx512_bf16.SWIGLU_TARGET}(" in hlo(joined, proj, attended)
    assert avx512_bf16.SWIGLU_TARGET not in hlo(joined, proj, attended, platform="tpu")
    assert avx512_bf16.SWIGLU_TARGET not in hlo(joined, proj.astype(jnp.float32), attended.astype(jnp.float32))
    upsampled = traced(vae_upsample(4, 6), x)  # the decoder's upsample and its convolution: one call
    assert f"@{avx512_bf16.UPSAMPLE_CONV_TARGET}(" in upsampled and avx512_bf16.CONV_TARGET not in upsampled
    assert avx512_bf16.UPSAMPLE_CONV_TARGET not in traced(vae_upsample(4, 6), x, platform="tpu")
    q, k, v = qkv(1, 8, 12, 2, 16)
    assert avx512_bf16.ATTENTION_TARGET in hlo(traced_under(layers.dot_product_attention, options), q, k, v)
    masked = text_attention_under("avx512-bf16").trace(*text_attention_inputs(2, 9, 4, 2, 16)).lower().as_text()
    assert avx512_bf16.MASKED_ATTENTION_TARGET in masked


def test_an_avx512_bf16_cpu_takes_the_avx512_plugin(monkeypatch: pytest.MonkeyPatch, fresh_status: None,
                                                     tmp_path: Path) -> None:
    """AVX-512 bf16 without AMX (or AMX without oneMKL): the AVX-512 plugin, whose shim needs a compiler;
    no vector unit the shim is built for (SSE only): XLA's forms."""
    monkeypatch.setattr(kernels.cpu, "is_x86", lambda: True)
    monkeypatch.delenv("FLUX2KLEIN_CPU_MATMUL", raising=False)
    monkeypatch.setattr(kernels, "find_mkl", lambda: None)
    sse = kernels.detect(frozenset({"sse4_2"}))
    assert sse.name is None and "neither AVX-512" in sse.reason
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path))
    monkeypatch.delenv("FLUX2KLEIN_NATIVE_CACHE", raising=False)  # the suite's shared shim
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(cpu_shim.shutil, "which", lambda name: None)
    monkeypatch.setattr(cpu_shim, "_opened", {})  # as in a process that has not opened the shim yet
    for flags in (CPUINFO_AVX512, CPUINFO_AMX):
        status = kernels.detect(cpu.cpu_flags(flags))
        assert status.name is None and "no C++ compiler" in status.reason
    if plugin_missing("avx512-bf16") is None:  # this host builds and loads the shim
        monkeypatch.undo()
        monkeypatch.setattr(kernels.cpu, "is_x86", lambda: True)
        monkeypatch.delenv("FLUX2KLEIN_CPU_MATMUL", raising=False)
        monkeypatch.setattr(kernels, "find_mkl", lambda: None)
        for flags in (CPUINFO_AVX512, CPUINFO_AMX):
            assert kernels.detect(cpu.cpu_flags(flags)).name == "avx512-bf16"
        assert "oneMKL is not installed" in kernels.detect(cpu.cpu_flags(CPUINFO_AMX)).reason


def test_a_report_names_the_plugin_without_building_its_shim(monkeypatch: pytest.MonkeyPatch, fresh_status: None,
                                                             tmp_path: Path) -> None:
    """`flux2klein env` (detect with build False): a plugin whose shim is not built yet is named,
    with what its first run will do; nothing is built, written or loaded. Without a compiler it says
    what that run would: XLA's forms."""
    monkeypatch.setattr(kernels.cpu, "is_x86", lambda: True)
    monkeypatch.delenv("FLUX2KLEIN_CPU_MATMUL", raising=False)
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path))
    monkeypatch.delenv("FLUX2KLEIN_NATIVE_CACHE", raising=False)  # the suite's shared shim
    monkeypatch.setattr(cpu_shim, "_opened", {})  # as in a process that has not opened the shim yet
    monkeypatch.setattr(cpu_shim, "build_shim", lambda out: pytest.fail("a report built the shim"))
    monkeypatch.setattr(cpu_shim.ctypes, "CDLL", lambda path: pytest.fail("a report loaded the shim"))
    monkeypatch.setenv("CXX", "/usr/bin/true")  # a compiler on the PATH or not, this one is named
    monkeypatch.setattr(kernels, "find_mkl", lambda: None)
    avx512 = kernels.detect(cpu.cpu_flags(CPUINFO_AVX512), build=False)
    assert avx512.name == "avx512-bf16" and "built on the first run" in avx512.reason
    monkeypatch.setattr(kernels, "find_mkl", lambda: "/nowhere/libmkl_rt.so.3")
    amx = kernels.detect(cpu.cpu_flags(CPUINFO_AMX), build=False)
    assert amx.name == "amx" and "built on the first run" in amx.reason and "libmkl_rt" in amx.reason
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(cpu_shim.shutil, "which", lambda name: None)
    for flags in (CPUINFO_AVX512, CPUINFO_AMX):
        status = kernels.detect(cpu.cpu_flags(flags), build=False)
        assert status.name is None and "no C++ compiler" in status.reason
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_report_says_a_shim_folder_others_can_write_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                  fresh_status: None, tmp_path: Path) -> None:
    """FLUX2KLEIN_NATIVE_CACHE naming a folder other users can write, or holding a shim file they can:
    the run refuses to build or load a shim there and takes XLA's forms, so the report says that, not
    that the first run builds it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setattr(kernels.cpu, "is_x86", lambda: True)
    monkeypatch.delenv("FLUX2KLEIN_CPU_MATMUL", raising=False)
    monkeypatch.setenv("FLUX2KLEIN_NATIVE_CACHE", str(shared))
    monkeypatch.setattr(cpu_shim, "_opened", {})  # as in a process that has not opened the shim yet
    monkeypatch.setenv("CXX", "/usr/bin/true")
    monkeypatch.setattr(kernels, "find_mkl", lambda: None)
    report = kernels.detect(cpu.cpu_flags(CPUINFO_AVX512), build=False)
    assert report.name is None and "writable by other users" in report.reason, report
    assert "writable by other users" in cpu_shim.build_shim(cpu_shim.shim_path()) and not any(shared.iterdir())
    shared.chmod(0o700)
    report = kernels.detect(cpu.cpu_flags(CPUINFO_AVX512), build=False)
    assert report.name == "avx512-bf16" and "built on the first run" in report.reason, report
    planted = cpu_shim.shim_path()  # a shim file others can write is refused as the run refuses it
    planted.write_bytes(b"")
    planted.chmod(0o666)
    report = kernels.detect(cpu.cpu_flags(CPUINFO_AVX512), build=False)
    assert report.name is None and "writable by other users" in report.reason, report


@avx512
def test_a_process_opens_the_shim_once_whatever_the_cache_folder(monkeypatch: pytest.MonkeyPatch,
                                                                 fresh_status: None, tmp_path: Path) -> None:
    """The plugin detected again after FLUX2KLEIN_CACHE changed (a test's private cache, a serve
    worker's) keeps the shim this process opened: a second copy from the new folder would register
    other addresses under the same FFI names, which XLA refuses."""
    opened = cpu_shim.open_shim()[0]
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path / "another"))
    assert cpu_shim.open_shim()[0] is opened
    assert kernels.plugin_status().name in ("avx512-bf16", "amx")  # registered again, the same addresses
    assert not (tmp_path / "another").exists()  # nothing built there


def test_the_choice_is_part_of_a_cpu_executables_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin and the dot form are in the trace options each program's key holds; the setting
    that chooses them is in every key too."""
    forms = {TraceOptions("cpu", "blocked", kernels=k, bf16_compute=d).as_key()["kernels" if k else "bf16_compute"]
             for k, d in ((None, "f32"), ("amx", "bf16"), (None, "f32-accumulate"), ("avx512-bf16", "f32-accumulate"))}
    assert forms == {"f32", "amx", "f32-accumulate", "avx512-bf16"}
    spec = target.ProgramSpec("axpy", jax.jit(lambda x: x * 2), (jax.ShapeDtypeStruct((4,), jnp.float32),))
    keys = set()
    for value in ("auto", "xla"):
        monkeypatch.setenv("FLUX2KLEIN_CPU_MATMUL", value)
        keys.add(store_keys.key_of(store_keys.key_parts(spec)))
    assert len(keys) == 2


amx = pytest.mark.skipif(plugin_missing("amx") is not None, reason=str(plugin_missing("amx")))
# This host's own plugin, as every program of this process takes it.
host_plugin = pytest.mark.skipif(kernels.plugin_status().name is None,
                                 reason=f"no kernel plugin here: {kernels.plugin_status().reason}")


@amx
def test_on_amx_a_bf16_linear_runs_onemkl_and_agrees_with_xla() -> None:
    layer = bf16_linear()
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 37, 64)), jnp.bfloat16)
    assert cpu_matmul.TARGET in hlo(lambda x: layer(x), x)
    got = np.asarray(nnx.jit(lambda m, x: m(x))(layer, x), np.float32)
    exact = np.asarray(x, np.float32) @ np.asarray(layer.kernel[...], np.float32) + np.asarray(layer.bias[...],
                                                                                                np.float32)
    # One bf16 rounding of the product and one of the sum with the bias.
    np.testing.assert_allclose(got, exact, rtol=2e-2, atol=2e-2 * np.abs(exact).max())


@amx
def test_on_amx_a_float32_linear_runs_onemkls_sgemm_as_close_to_float64_as_xlas_dot() -> None:
    rng = np.random.default_rng(4)
    layer = linear(300, 70, dtype=jnp.float32, rngs=nnx.Rngs(0), bias=True)
    layer.kernel[...] = jnp.asarray(rng.standard_normal((300, 70)), jnp.float32)
    layer.bias[...] = jnp.asarray(rng.standard_normal(70), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 37, 300)), jnp.float32)
    ours_traced, xla_traced = (traced_under(lambda m, x: m(x), plugin_options(form)) for form in ("amx", None))
    assert f"@{cpu_matmul.F32_TARGET}(" in hlo(ours_traced, layer, x)
    assert cpu_matmul.F32_TARGET not in hlo(ours_traced, layer, x, platform="tpu")
    ours, xla = (np.asarray(nnx.jit(form)(layer, x)) for form in (ours_traced, xla_traced))
    exact = (np.asarray(x, np.float64) @ np.asarray(layer.kernel[...], np.float64)
             + np.asarray(layer.bias[...], np.float64))
    assert ours.dtype == np.float32 and ours.shape == exact.shape
    assert np.abs(ours - exact).max() <= 2 * max(np.abs(xla - exact).max(), 1e-6 * np.abs(exact).max())


@host_plugin
def test_bf16_pipeline_is_as_close_to_diffusers_float32_as_diffusers_bf16(tiny_checkpoint: Path) -> None:
    from flux2klein_cli.core.engine.plan import RunFields
    from flux2klein_cli.core.runs.parity import reference_pipeline, run_reference
    from tests.fixtures.engine import engine_on

    engine = engine_on(tiny_checkpoint, dtype="bf16")
    plan = engine.plan(RunFields(prompts=("a red fox in snow",), steps=4, height=64, width=64, seed=3))
    noise = engine.initial_noise(plan)
    ours = engine.run(plan).images.astype(np.float32)
    f32 = run_reference(reference_pipeline(engine, "fp32"), plan, noise, []).astype(np.float32)
    bf16 = run_reference(reference_pipeline(engine, "bf16"), plan, noise, []).astype(np.float32)
    ours_err, their_err = np.abs(ours - f32).mean(), np.abs(bf16 - f32).mean()
    assert their_err > 0  # bf16 does change diffusers' image, so the bound means something
    assert ours_err <= 1.25 * their_err, (ours_err, their_err)


def attention_under(plugin: str | None) -> object:
    """The transformer's attention as a CPU program traced with the plugin named (None: XLA's forms)."""
    return jax.jit(traced_under(layers.dot_product_attention, plugin_options(plugin)))


@pytest.mark.parametrize("plugin", PLUGINS)
@pytest.mark.parametrize("shape", [(1, 300, 300, 4, 128), (2, 100, 260, 3, 64), (1, 1, 7, 1, 16)])
def test_attention_in_the_shim_matches_xlas_blocked_form(plugin: str, shape: tuple[int, ...]) -> None:
    """The shim's numerics are the XLA form's: float32 scores and sum, bf16 weights for P @ V.
    Equal but for rare one-ulp roundings of the output (the products' summation order differs)."""
    q, k, v = qkv(*shape)
    assert kernels.plugin_module(plugin).ATTENTION_TARGET in attention_under(plugin).trace(q, k, v).lower().as_text()
    ours = np.asarray(attention_under(plugin)(q, k, v), np.float32)
    xla = np.asarray(jax.jit(layers._blocked_attention)(q, k, v), np.float32)
    exact = np.asarray(jax.nn.dot_product_attention(*(a.astype(jnp.float32) for a in (q, k, v))))
    assert np.mean(ours != xla) < 1e-3
    np.testing.assert_allclose(ours, xla, rtol=2 ** -7, atol=2 ** -7 * np.abs(xla).max())
    ours_err, xla_err = np.abs(ours - exact).mean(), np.abs(xla - exact).mean()
    assert ours_err <= 1.01 * xla_err, (ours_err, xla_err)


@pytest.mark.parametrize("plugin", PLUGINS)
def test_bf16_attention_calls_in_a_row_share_no_stale_scratch(plugin: str) -> None:
    """The bf16 form of tests/test_float32_kernels.py's test of kept scratch: new values of the same shape
    (each call packs its own keys and values), then a shorter call. One head: every thread that ran a
    block of an earlier call holds that head packed."""
    for shape, seed in [((1, 300, 300, 1, 64), 0), ((1, 300, 300, 1, 64), 1), ((1, 300, 300, 1, 64), 2),
                        ((1, 40, 70, 1, 64), 3)]:
        q, k, v = qkv(*shape, seed=seed)
        ours = np.asarray(attention_under(plugin)(q, k, v), np.float32)
        xla = np.asarray(jax.jit(layers._blocked_attention)(q, k, v), np.float32)
        np.testing.assert_allclose(ours, xla, rtol=2 ** -7, atol=2 ** -7 * np.abs(xla).max())


def text_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                             round_weights: bool) -> np.ndarray:
    """jax.nn.dot_product_attention's form as written, in float64 with the mask applied exactly: the
    weights normalised, then (with `round_weights`) rounded to bf16 before P @ V. XLA computes
    this form but at some sizes keeps the weights float32 (its excess-precision rule), so its own
    output is not the reference for the rounding."""
    import ml_dtypes

    group = q.shape[2] // k.shape[2]
    qf, kf, vf = (np.asarray(a, np.float64) for a in (q, k, v))
    kf, vf = np.repeat(kf, group, axis=2), np.repeat(vf, group, axis=2)
    allowed = np.asarray(mask)[:, None]
    scores = np.where(allowed, np.einsum("bqhd,bkhd->bhqk", qf, kf) * q.shape[-1] ** -0.5, -np.inf)
    top = scores.max(-1, keepdims=True)
    weights = np.where(allowed, np.exp(scores - np.where(np.isfinite(top), top, 0)), 0)
    weights /= np.maximum(weights.sum(-1, keepdims=True), 1e-300)
    if round_weights:
        weights = weights.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    out = np.einsum("bhqk,bkhd->bqhd", weights, vf).astype(np.float32)
    return out.astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("plugin", PLUGINS)
def test_the_text_encoders_attention_reads_no_key_past_the_last_one_a_block_may_see(plugin: str) -> None:
    """A prompt padded on the right (its 9 real tokens of 300, as the text encoder pads to 512): each
    block of queries stops its products at the panel of the last key it may see. The padding keys'
    values are then never read: NaN there changes no output bit (XLA's form, which multiplies them by
    zero weights, would turn every row NaN)."""
    q, k, v, _ = text_attention_inputs(1, 300, 4, 2, 32)
    real = np.arange(300) < 9
    mask = jnp.asarray(np.tril(np.ones((300, 300), bool))[None] & real[None, None, :])
    poisoned = v.at[:, 64:].set(jnp.nan)  # from the third panel of 32 keys on
    ours, with_nan = (np.asarray(text_attention_under(plugin)(q, k, values, mask), np.float32)
                      for values in (v, poisoned))
    np.testing.assert_array_equal(ours, with_nan)
    rounded = text_attention_reference(q, k, v, mask, round_weights=True)
    assert np.all(np.isfinite(ours)) and np.mean(ours != rounded) < 1e-3


@pytest.mark.parametrize("plugin", PLUGINS)
@pytest.mark.parametrize("shape", [(2, 300, 8, 2, 64), (2, 37, 6, 3, 16), (2, 130, 4, 4, 128)])
def test_the_text_encoders_attention_in_the_shim_matches_xlas_form(plugin: str, shape: tuple[int, ...]) -> None:
    """The masked, grouped-query form: jax.nn.dot_product_attention's numerics (scores scaled after
    the product, weights normalised and rounded to bf16 before P @ V), masked keys left out, a query
    with no allowed key zero. Equal to that form in float64 but for rare one-ulp roundings, and close
    to XLA's output (which at some sizes keeps the weights float32)."""
    q, k, v, mask = text_attention_inputs(*shape)
    ours, xla = (np.asarray(text_attention_under(form)(q, k, v, mask), np.float32) for form in (plugin, False))
    assert not np.any(ours[1, :2]) and np.all(np.isfinite(ours))
    rounded = text_attention_reference(q, k, v, mask, round_weights=True)
    assert np.mean(ours != rounded) < 1e-3
    np.testing.assert_allclose(ours, xla, rtol=2 ** -7, atol=2 ** -7 * np.abs(xla).max())
    exact = text_attention_reference(q, k, v, mask, round_weights=False)
    assert np.abs(ours - exact).mean() <= 1.01 * np.abs(rounded - exact).mean()


@pytest.mark.parametrize("plugin", PLUGINS)
@pytest.mark.parametrize("shape, size", [((1, 64, 48, 32, 32), 3), ((2, 17, 9, 5, 7), 3), ((1, 32, 32, 64, 128), 3),
                                         ((2, 9, 3, 32, 40), 3), ((1, 32, 16, 64, 32), 1), ((1, 11, 6, 6, 3), 3),
                                         ((2, 7, 5, 6, 20), 1)])
def test_the_vaes_conv_in_the_shim_matches_nnx_conv(plugin: str, shape: tuple[int, ...], size: int) -> None:
    """nnx.Conv's numerics in bf16 (float32 sums rounded, then the bias added): equal but for
    rare one-ulp roundings (the taps' summation order differs). On AMX, input widths of whole tiles
    (multiples of 32) take the shim's tile kernel, others MKL's products; in VDPBF16PS input
    channels go in pairs (an odd count keeps XLA's form) and any output width takes the kernel."""
    b, h, w, c_in, c_out = shape
    module = vae_conv(c_in, c_out, size=size)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((b, h, w, c_in)), jnp.bfloat16)
    ours, xla = (np.asarray(conv_under(form)(module, x), np.float32) for form in (plugin, None))
    assert ours.shape == (b, h, w, c_out)
    assert np.mean(ours != xla) < 1e-3
    np.testing.assert_allclose(ours, xla, rtol=2 ** -7, atol=2 ** -7 * np.abs(xla).max())


@pytest.mark.parametrize("plugin", PLUGINS)
@pytest.mark.parametrize("shape", [(1, 37, 24, 12, 8), (2, 5, 0, 20, 0), (1, 300, 96, 48, 32), (3, 1, 6, 17, 5)])
def test_the_transformers_swiglu_in_the_shim_matches_xlas_form(plugin: str, shape: tuple[int, ...]) -> None:
    """SwiGLU of x[..., start:] joined after the attention output (the single block's), or alone (the
    feed-forward's), in one shim pass: the XLA form's roundings (SiLU in float32 rounded to bf16, then
    the bf16 product), equal but for rare one-ulp differences of the two SiLUs."""
    from flux2klein_cli.core.models.transformer import swiglu

    b, s, start, hidden, joined = shape
    rng = np.random.default_rng(3)
    x = jnp.asarray(3 * rng.standard_normal((b, s, start + 2 * hidden)), jnp.bfloat16)
    after = jnp.asarray(rng.standard_normal((b, s, joined)), jnp.bfloat16) if joined else None
    ours_traced = traced_under(lambda x, a: swiglu(x, start=start, after=a), plugin_options(plugin))
    assert f"@{avx512_bf16.SWIGLU_TARGET}(" in hlo(ours_traced, x, after)  # the AMX plugin's too
    ours, xla = (np.asarray(jax.jit(traced_under(lambda x, a: swiglu(x, start=start, after=a),
                                                 plugin_options(form)))(x, after), np.float32)
                 for form in (plugin, None))
    assert ours.shape == (b, s, joined + hidden)
    assert np.mean(ours != xla) < 1e-3
    np.testing.assert_allclose(ours, xla, rtol=2 ** -7, atol=2 ** -7 * np.abs(xla).max())


def torch_rounded_norm_rope(proj: np.ndarray, weight: np.ndarray, cos: np.ndarray, sin: np.ndarray, part: int,
                            heads: int, eps: float) -> np.ndarray:
    """diffusers' RMSNorm then rotary embedding on bf16, each step rounded as torch rounds it: the norm in
    float32 rounded to bf16, times the weight in bf16, the rotation in float32 rounded to bf16."""
    import ml_dtypes

    def bf16(a: np.ndarray) -> np.ndarray:
        return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)

    dim = weight.shape[0]
    x = proj[..., part * heads * dim:(part + 1) * heads * dim].reshape(*proj.shape[:2], heads, dim)
    mean_square = (x.astype(np.float64) ** 2).mean(-1, keepdims=True).astype(np.float32)
    z = bf16(bf16(x * (np.float32(1) / np.sqrt(mean_square + np.float32(eps)))) * weight)
    rotated = np.stack([-z[..., 1::2], z[..., 0::2]], -1).reshape(z.shape)
    return bf16(z * cos[None, :, None, :] + rotated * sin[None, :, None, :])


@pytest.mark.parametrize("plugin", PLUGINS)
@pytest.mark.parametrize("shape", [(1, 300, 4, 128, 0), (2, 37, 3, 32, 64), (1, 5, 1, 18, 7)])
def test_the_single_blocks_queries_keys_and_values_in_one_shim_pass_round_as_torch_does(
        plugin: str, shape: tuple[int, ...]) -> None:
    """The single block's q and k (RMSNorm, its weight, the rotation) and v from its fused projection in
    one shim pass: every step rounded to bf16 as torch rounds it (XLA's form skips some of those
    roundings: its excess precision), equal to that form but for rare one-ulp differences of the
    norm's sum. v is the projection's slice, bit for bit."""
    from flux2klein_cli.core.models import transformer

    b, s, heads, head_dim, extra = shape
    config = transformer.TransformerConfig(num_attention_heads=heads, attention_head_dim=head_dim)
    module = transformer.ParallelAttention(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(6)
    module.norm_q.weight[...] = jnp.asarray(1 + 0.2 * rng.standard_normal(head_dim), jnp.bfloat16)
    module.norm_k.weight[...] = jnp.asarray(1 + 0.2 * rng.standard_normal(head_dim), jnp.bfloat16)
    angles = rng.uniform(0, 40, (s, head_dim // 2)).repeat(2, axis=1)
    rope = (jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32))
    proj = jnp.asarray(3 * rng.standard_normal((b, s, 3 * heads * head_dim + extra)), jnp.bfloat16)
    traced = traced_under(lambda p, r: module.qkv_heads(p, r), plugin_options(plugin))
    assert f"@{avx512_bf16.QKV_HEADS_TARGET}(" in hlo(traced, proj, rope)
    assert avx512_bf16.QKV_HEADS_TARGET not in hlo(traced, proj, rope, platform="tpu")
    q, k, v = (np.asarray(a, np.float32) for a in jax.jit(traced)(proj, rope))
    values = np.asarray(proj, np.float32)
    for part, (ours, norm) in enumerate(((q, module.norm_q), (k, module.norm_k))):
        expected = torch_rounded_norm_rope(values, np.asarray(norm.weight[...], np.float32), *map(np.asarray, rope),
                                           part, heads, config.eps)
        assert ours.shape == expected.shape == (b, s, heads, head_dim)
        assert np.mean(ours != expected) < 1e-3
        np.testing.assert_allclose(ours, expected, rtol=2 ** -7, atol=2 ** -7)
    np.testing.assert_array_equal(v, values[..., 2 * heads * head_dim:3 * heads * head_dim].reshape(q.shape))


def xla_linear_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """A Linear layer's product as XLA computes it on CPU: float32 sums, rounded to bf16."""
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def shim_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """The AVX-512 bf16 plugin's product, whatever the size (the Linear layers take it from 2e8 products)."""
    return jax.jit(lambda x, w: avx512_bf16.dot_general(x, w, None, xla_linear_dot))(x, w)


@avx512
@pytest.mark.parametrize("shape", [(37, 70, 45), (2, 197, 64, 103), (13, 2, 300), (200, 2048, 200), (1, 512, 33)])
def test_the_linear_layers_product_in_the_shim_matches_xlas(shape: tuple[int, ...]) -> None:
    """bf16 (..., K) x (K, N) rounded to bf16 once: XLA's numerics (float32 sums of the pairs), equal
    but for rare one-ulp roundings where the order of the sums differs, and no further from float64.
    The shapes cut the shim's blocks of 12 and 192 rows, 32-column panels and blocks of columns (64 of
    them at K = 2048) in odd places; a wrong block or panel would be off by the size of the outputs."""
    *lead, k, n = shape
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((*lead, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    ours, xla = np.asarray(shim_dot(x, w), np.float64), np.asarray(jax.jit(xla_linear_dot)(x, w), np.float64)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert ours.shape == (*lead, n)
    assert np.mean(ours != xla) < 1e-3
    np.testing.assert_allclose(ours, xla, rtol=2 ** -7, atol=2 ** -7 * np.abs(xla).max())
    assert np.abs(ours - exact).mean() <= 1.01 * np.abs(xla - exact).mean()


@avx512
def test_the_linear_layers_product_in_the_shim_keeps_nan_and_infinity_to_their_rows_and_sums_nothing_to_zero() -> None:
    rng = np.random.default_rng(5)
    x = np.asarray(rng.standard_normal((30, 64)), np.float32)
    w = jnp.asarray(rng.standard_normal((64, 40)), jnp.bfloat16)
    x[3, 5], x[17, 0] = np.nan, np.inf
    ours, xla = (np.asarray(f(jnp.asarray(x, jnp.bfloat16), w), np.float32)
                 for f in (shim_dot, jax.jit(xla_linear_dot)))
    assert np.isnan(ours[3]).all() and not np.isnan(np.delete(ours, [3, 17], axis=0)).any()
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(xla))
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(xla))
    empty = shim_dot(jnp.ones((5, 0), jnp.bfloat16), jnp.ones((0, 7), jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(empty, np.float32), np.zeros((5, 7), np.float32))


def upsampled_conv_exact(module: nnx.Module, x: jax.Array) -> np.ndarray:
    """Nearest 2x then the 3x3 'same' convolution with bias, in float64 from the same bf16 values."""
    up = np.repeat(np.repeat(np.asarray(x, np.float64), 2, axis=1), 2, axis=2)
    kernel, bias = (np.asarray(a, np.float64) for a in (module.conv.kernel[...], module.conv.bias[...]))
    padded = np.pad(up, ((0, 0), (1, 1), (1, 1), (0, 0)))
    h, w = up.shape[1:3]
    return sum(padded[:, dy : dy + h, dx : dx + w] @ kernel[dy, dx] for dy in range(3) for dx in range(3)) + bias


@avx512
@pytest.mark.parametrize("shape", [(1, 16, 12, 64, 32), (2, 9, 5, 6, 20), (1, 7, 3, 32, 40), (1, 30, 33, 128, 128)])
def test_the_decoders_upsample_and_conv_in_one_shim_call_stay_as_close_as_xlas_form(shape: tuple[int, ...]) -> None:
    """The AVX-512 bf16 plugin's nearest 2x upsample and 3x3 convolution, as four 2x2 convolutions of the
    input whose taps on the same input pixel are merged: each merged tap adds one bf16 rounding to
    nnx.Conv's numerics. Against float64 from the same bf16 values, its error stays within 1.6x of XLA's
    form (upsample, then the convolution; measured 1.4x), and no further than XLA's at its worst.
    A wrong phase or tap would be off by the size of the outputs themselves."""
    b, h, w, c_in, c_out = shape
    module = vae_upsample(c_in, c_out)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((b, h, w, c_in)), jnp.bfloat16)
    ours, xla = (np.asarray(conv_under(form)(module, x), np.float64) for form in ("avx512-bf16", None))
    exact = upsampled_conv_exact(module, x)
    assert ours.shape == xla.shape == (b, 2 * h, 2 * w, c_out)
    ours_err, xla_err = np.abs(ours - exact), np.abs(xla - exact)
    assert ours_err.mean() <= 1.6 * xla_err.mean(), (ours_err.mean(), xla_err.mean())
    assert ours_err.max() <= 1.5 * xla_err.max(), (ours_err.max(), xla_err.max())


@pytest.mark.parametrize("plugin", PLUGINS)
@pytest.mark.parametrize("shape", [(1, 40, 24, 32, 32, 8), (2, 17, 9, 16, 48, 4)])
def test_the_fused_norm_silu_conv_in_the_shim_matches_xlas_forms(plugin: str, shape: tuple[int, ...]) -> None:
    """GroupNorm, SiLU and the 3x3 convolution in one shim call: the XLA forms' numerics (float32
    norm and SiLU rounded to bf16, then nnx.Conv's), equal but for rare one-ulp roundings."""
    b, h, w, c_in, c_out, groups = shape
    block = vae_resnet(c_in, c_out, groups)
    x = jnp.asarray(3 * np.random.default_rng(1).standard_normal((b, h, w, c_in)) + 1, jnp.bfloat16)

    ours, xla = (np.asarray(norm_silu_conv_under(form)(block, x), np.float32) for form in (plugin, None))
    assert ours.shape == (b, h, w, c_out)
    assert np.mean(ours != xla) < 1e-3
    np.testing.assert_allclose(ours, xla, rtol=2 ** -7, atol=2 ** -7 * np.abs(xla).max())


@pytest.mark.parametrize("plugin", PLUGINS)
def test_in_the_shim_non_finite_values_stay_non_finite(plugin: str) -> None:
    """A NaN or an infinity in the input reaches the same outputs as in XLA's forms (the image
    checks then name the stage), never a finite value."""
    module = vae_conv(8, 8)
    x = np.random.default_rng(2).standard_normal((1, 12, 10, 8)).astype(np.float32)
    x[0, 3, 4, 1], x[0, 8, 2, 5] = np.nan, np.inf
    x = jnp.asarray(x, jnp.bfloat16)
    ours, xla = (np.asarray(conv_under(form)(module, x), np.float32) for form in (plugin, None))
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(xla))
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(xla))
    block = vae_resnet(8, 8, 4)
    resnet = [np.asarray(conv_under(form)(block, x), np.float32) for form in (plugin, None)]
    np.testing.assert_array_equal(np.isnan(resnet[0]), np.isnan(resnet[1]))
    assert np.isnan(resnet[0]).any()
    # The upsample's merged taps turn inf * w1 + inf * w2 into inf * (w1 + w2): the same outputs are
    # non-finite, though one may be an infinity where XLA's is a NaN.
    upsampled = [np.asarray(conv_under(form)(vae_upsample(8, 8), x), np.float32) for form in (plugin, None)]
    np.testing.assert_array_equal(np.isfinite(upsampled[0]), np.isfinite(upsampled[1]))
    assert not np.isfinite(upsampled[0]).all()
    q, k, v = qkv(1, 20, 30, 2, 16)
    k = k.at[0, 7, 1, 3].set(jnp.nan)
    attended = np.asarray(attention_under(plugin)(q, k, v), np.float32)
    np.testing.assert_array_equal(np.isnan(attended),
                                  np.isnan(np.asarray(jax.jit(layers._blocked_attention)(q, k, v), np.float32)))


def conv_spec() -> target.ProgramSpec:
    """A bf16 3x3 convolution as a stored program of this host (its kernel an argument, as the
    pipeline's are): it holds this host's plugin's custom call, and a fused kernel of XLA's (a
    program of custom calls alone has no machine code to store)."""
    module = vae_conv(32, 32)
    graphdef, _ = nnx.split(module)
    fn = jax.jit(lambda state, x: jnp.tanh(nnx.merge(graphdef, state)(x).astype(jnp.float32)))
    args = (jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.state(module)),
            jax.ShapeDtypeStruct((1, 8, 8, 32), jnp.bfloat16))
    return target.ProgramSpec("plugin_conv", fn, args)


@host_plugin
def test_a_stored_executable_with_the_custom_call_loads_in_a_new_process(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    spec = conv_spec()
    compiled, info = store.ExecutableStore(tmp_path).load_or_compile(spec)
    assert info.status == "miss"
    assert kernels.plugin_module(kernels.plugin_status().name).CONV_TARGET in compiled.as_text()
    code = (
        "import sys, numpy as np, jax.numpy as jnp; from flax import nnx;"
        "from tests.test_cpu_matmul import conv_spec, vae_conv;"
        "from flux2klein_cli.core.compile.store import ExecutableStore;"
        "c, info = ExecutableStore(sys.argv[1]).load_or_compile(conv_spec());"
        "x = jnp.ones((1, 8, 8, 32), jnp.bfloat16);"
        "print(info.status, info.key, float(np.asarray(c(nnx.state(vae_conv(32, 32)), x), np.float32).sum()))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=root, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(root)), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    status, key, total = done.stdout.split()
    x = jnp.ones((1, 8, 8, 32), jnp.bfloat16)
    expected = float(np.asarray(compiled(nnx.state(vae_conv(32, 32)), x), np.float32).sum())
    assert status == "hit" and key == info.key and float(total) == expected
