"""One trace-options object decides the forms a program is traced in (core/models/trace.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from flux2klein_cli.core import settings
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.models import kernels, layers, trace
from flux2klein_cli.core.models.trace import TraceOptions


def test_each_platform_gets_its_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (settings.GPU_ATTENTION, settings.CPU_MATMUL):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(kernels, "plugin_status", lambda: kernels.Status(None, "no AMX"))
    kinds = {p: TraceOptions.for_platform(p).attention for p in ("cpu", "gpu", "tpu", "rocm")}
    assert kinds == {"cpu": "blocked", "gpu": "cudnn", "tpu": "splash", "rocm": "xla"}
    cpu = TraceOptions.for_platform("cpu")
    assert cpu.kernels is None and "kernels" not in cpu.as_key()
    monkeypatch.setattr(kernels, "plugin_status", lambda: kernels.Status("amx", "test"))
    assert TraceOptions.for_platform("cpu").as_key()["kernels"] == "amx"
    assert TraceOptions.for_platform("tpu").kernels is None
    # bf16 dots accumulate in float32 on CPU only; FLUX2KLEIN_CPU_MATMUL=xla keeps the forms as written.
    assert TraceOptions.for_platform("cpu").bf16_compute in ("f32-accumulate", "f32")
    assert {TraceOptions.for_platform(p).bf16_compute for p in ("gpu", "tpu")} == {"bf16"}
    monkeypatch.setenv(settings.CPU_MATMUL, "xla")
    assert TraceOptions.for_platform("cpu").bf16_compute == "bf16"
    monkeypatch.setenv(settings.GPU_ATTENTION, "xla")
    assert TraceOptions.for_platform("gpu").attention == "xla"
    assert TraceOptions.for_platform("tpu", effort="fast").as_key() == {
        "platform": "tpu", "attention": "splash", "convs_as_matmuls": True, "idle_axes": "auto"}
    with pytest.raises(ValueError, match="attention"):
        TraceOptions("cpu", "flash")
    monkeypatch.setenv(settings.IDLE_AXES, "replicate")
    assert TraceOptions.for_platform("tpu").idle_axes == "replicate"
    monkeypatch.setenv(settings.IDLE_AXES, "copies")
    with pytest.raises(UserInputError, match="FLUX2KLEIN_IDLE_AXES"):
        TraceOptions.for_platform("tpu")


def test_a_program_traces_under_its_options_and_nothing_else_does() -> None:
    """The options travel with the function: inside its trace they hold, outside (and for
    jax.default_backend) nothing changed."""
    seen: list[TraceOptions] = []

    def record(x: jax.Array) -> jax.Array:
        seen.append(trace.current())
        return x + 1

    tpu = TraceOptions.for_platform("tpu", effort="fast")
    jax.jit(trace.traced_under(record, tpu)).lower(jnp.zeros(2))
    assert seen == [tpu]
    assert trace.current() == TraceOptions.local() and jax.default_backend() == "cpu"
    jax.jit(trace.traced_under(record, None)).lower(jnp.zeros(2))
    assert seen[-1] == TraceOptions.local()


def test_attention_follows_the_options() -> None:
    """Under a GPU's options the CPU host traces cuDNN's call; under the CPU's, the blocked form."""
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    with trace.tracing(TraceOptions("gpu", "cudnn")):
        assert layers.gpu_fused_attention(q)
    with trace.tracing(TraceOptions("gpu", "xla")):
        assert not layers.gpu_fused_attention(q)
    assert not layers.gpu_fused_attention(q)  # the local CPU


def test_a_bf16_linear_and_conv_compute_as_the_options_say() -> None:
    """bf16: the product rounded to bf16 (as written); f32-accumulate: bf16 operands, a float32
    product rounded once; f32: the activations stay float32, the bf16 weights widened exactly. Each
    form's output is the float32 product of the same bf16 values, rounded where the form rounds."""
    import numpy as np
    from flax import nnx

    from flux2klein_cli.core.models.vae import conv

    rng = np.random.default_rng(0)
    layer = layers.linear(32, 16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), bias=True)
    layer.kernel[...] = jnp.asarray(rng.standard_normal((32, 16)), jnp.bfloat16)
    layer.bias[...] = jnp.asarray(rng.standard_normal(16), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((3, 32)), jnp.bfloat16)
    exact = (np.asarray(x, np.float32) @ np.asarray(layer.kernel[...], np.float32)
             + np.asarray(layer.bias[...], np.float32))

    def run(form: str, module: nnx.Module, x: jax.Array) -> tuple[jax.Array, str]:
        fn = nnx.jit(trace.traced_under(lambda m, x: m(x), TraceOptions("cpu", "blocked", bf16_compute=form)))
        graphdef, state = nnx.split(module)
        text = jax.jit(trace.traced_under(lambda s, x: nnx.merge(graphdef, s)(x), TraceOptions(
            "cpu", "blocked", bf16_compute=form))).lower(state, x).as_text()
        return fn(module, x), text

    for form in ("bf16", "f32-accumulate"):
        y, text = run(form, layer, x)
        assert y.dtype == jnp.bfloat16
        assert ("-> tensor<3x16xf32>" in text) == (form == "f32-accumulate")  # the product's result
        np.testing.assert_allclose(np.asarray(y, np.float32), exact, rtol=2 ** -7, atol=2 ** -7 * np.abs(exact).max())
    y, text = run("f32", layer, x.astype(jnp.float32))  # an f32 model entry widens its activations
    assert y.dtype == jnp.float32 and "bf16" in text  # the weights enter as bf16, widened inside
    np.testing.assert_allclose(np.asarray(y), exact, rtol=1e-6, atol=1e-5)
    y, _ = run("f32", layer, x)  # a bf16 input is widened too: the module computes in float32
    assert y.dtype == jnp.float32

    c = conv(4, 6, 3, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    c.kernel[...] = jnp.asarray(0.2 * rng.standard_normal((3, 3, 4, 6)), jnp.bfloat16)
    image = jnp.asarray(rng.standard_normal((1, 8, 8, 4)), jnp.float32)
    ref = jax.lax.conv_general_dilated(image.astype(jnp.bfloat16).astype(jnp.float32),
                                       c.kernel[...].astype(jnp.float32), (1, 1), "SAME",
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"))
    for form, dtype in (("bf16", jnp.bfloat16), ("f32-accumulate", jnp.bfloat16), ("f32", jnp.float32)):
        out, _ = run(form, c, image.astype(jnp.bfloat16) if dtype == jnp.bfloat16 else image.astype(
            jnp.bfloat16).astype(jnp.float32))
        assert out.dtype == dtype
        tol = 1e-5 if dtype == jnp.float32 else 2 ** -7 * float(np.abs(np.asarray(ref)).max())
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=tol)
