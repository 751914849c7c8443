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
    assert TraceOptions.for_platform("tpu", convs_as_matmuls=True).as_key() == {
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

    tpu = TraceOptions.for_platform("tpu", convs_as_matmuls=True)
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
