"""One trace-options object decides the forms a program is traced in (core/models/trace.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.models import cpu_matmul, layers, trace
from flux2klein_cli.core.models.trace import TraceOptions


def test_each_platform_gets_its_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(trace.GPU_ATTENTION_ENV, raising=False)
    monkeypatch.setattr(cpu_matmul, "status", lambda: cpu_matmul.Status(None, "no AMX"))
    kinds = {p: TraceOptions.for_platform(p).attention for p in ("cpu", "gpu", "tpu", "rocm")}
    assert kinds == {"cpu": "blocked", "gpu": "cudnn", "tpu": "splash", "rocm": "xla"}
    assert not TraceOptions.for_platform("cpu").onemkl and "onemkl" not in TraceOptions.for_platform("cpu").as_key()
    monkeypatch.setattr(cpu_matmul, "status", lambda: cpu_matmul.Status("onemkl-amx-bf16:x", "test"))
    assert TraceOptions.for_platform("cpu").onemkl and TraceOptions.for_platform("cpu").as_key()["onemkl"]
    assert not TraceOptions.for_platform("tpu").onemkl
    monkeypatch.setenv(trace.GPU_ATTENTION_ENV, "xla")
    assert TraceOptions.for_platform("gpu").attention == "xla"
    assert TraceOptions.for_platform("tpu", convs_as_matmuls=True).as_key() == {
        "platform": "tpu", "attention": "splash", "convs_as_matmuls": True, "idle_axes": "auto"}
    with pytest.raises(ValueError, match="attention"):
        TraceOptions("cpu", "flash")
    monkeypatch.setenv(trace.IDLE_AXES_ENV, "replicate")
    assert TraceOptions.for_platform("tpu").idle_axes == "replicate"
    monkeypatch.setenv(trace.IDLE_AXES_ENV, "copies")
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
