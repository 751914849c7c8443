"""The CPU compile options (core/devices/cpu.py): on more than 2 cores only lone dots go to
YNNPACK, the option reaches XLA through the executable store, and it is part of the key."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flux2klein_cli.core.compile.store import META, ExecutableStore
from flux2klein_cli.core.compile.target import ProgramSpec
from flux2klein_cli.core.devices import cpu
from flux2klein_cli.core.models.trace import TraceOptions, jit_program
from flux2klein_cli.core.pipeline.programs import jit_module_call

LONE_DOTS = {cpu.YNN_OPTION: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


@pytest.mark.parametrize(("cores", "xla_flags", "expected"), [
    (1, "", {}),
    (2, "", {}),
    (3, "", LONE_DOTS),
    (13, "--xla_force_host_platform_device_count=4", LONE_DOTS),
    (13, "--xla_cpu_experimental_ynn_fusion_type=dot", {}),  # the user's choice stays
])
def test_which_hosts_send_only_lone_dots_to_ynnpack(cores: int, xla_flags: str, expected: dict) -> None:
    assert cpu.xla_options(cores, xla_flags) == expected


def dot_tanh_sum() -> ProgramSpec:
    fn = jax.jit(lambda a, b: jnp.tanh(a @ b).sum(0))
    args = (jax.ShapeDtypeStruct((64, 64), jnp.float32),) * 2
    return ProgramSpec("dot_tanh_sum", fn, args)


def entry_lines(compiled: jax.stages.Compiled) -> list[str]:
    text = compiled.as_text()
    return text[text.index("ENTRY"):].splitlines()


def test_a_many_core_host_compiles_lone_dots_and_stores_them_apart(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    store = ExecutableStore(tmp_path)
    a = jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64) / 4096
    expected = np.tanh(np.asarray(a, np.float64) @ np.asarray(a, np.float64)).sum(0)

    monkeypatch.setattr(cpu, "core_count", lambda: 2)
    two, two_info = store.load_or_compile(dot_tanh_sum())
    # XLA's default: the dot, tanh and sum are one YNNPACK fusion.
    assert any(line.strip().startswith("ROOT") and "__ynn_fusion" in line for line in entry_lines(two))

    monkeypatch.setattr(cpu, "core_count", lambda: 13)
    many, many_info = store.load_or_compile(dot_tanh_sum())
    assert many_info.status == "miss" and many_info.warning is None and many_info.key != two_info.key
    lines = entry_lines(many)
    assert sum("__ynn_fusion" in line for line in lines) == 1  # the dot alone
    assert not any(line.strip().startswith("ROOT") and "__ynn_fusion" in line for line in lines)
    assert json.loads((Path(many_info.path) / META).read_text())["key_parts"]["compiler_options"] == LONE_DOTS
    for compiled in (two, many):
        np.testing.assert_allclose(np.asarray(compiled(a, a)), expected, rtol=1e-4)
    assert store.load_or_compile(dot_tanh_sum())[1].status == "hit"


def tanh_of_product(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.tanh(a @ b).sum(0)


@pytest.mark.parametrize(("cores", "platform", "lone"), [(13, None, True), (2, None, False), (13, "tpu", False)])
def test_programs_run_without_the_store_compile_with_the_hosts_options(cores: int, platform: str | None, lone: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench --no-store` and any program the store did not give jit their functions: they compile
    as a stored program would on this CPU, and a program traced for another platform takes none
    of this CPU's options."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(cpu, "core_count", lambda: cores)
    options = None if platform is None else TraceOptions(platform, "splash")
    fn = jit_program(tanh_of_product, options)
    a = jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64) / 4096
    lines = entry_lines(fn.lower(a, a).compile())
    assert any(line.strip().startswith("ROOT") and "__ynn_fusion" in line for line in lines) is not lone
    if lone:
        assert sum("__ynn_fusion" in line for line in lines) == 1
    expected = np.tanh(np.asarray(a, np.float64) @ np.asarray(a, np.float64)).sum(0)
    np.testing.assert_allclose(np.asarray(fn(a, a)), expected, rtol=1e-4)


def test_the_pipelines_module_programs_take_the_hosts_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(cpu, "core_count", lambda: 13)
    layer = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    call = jit_module_call(layer, lambda model, x: tanh_of_product(x, model.kernel[...]))
    lines = entry_lines(call.lower(nnx.state(layer), jnp.ones((64, 64), jnp.float32)).compile())
    assert sum("__ynn_fusion" in line for line in lines) == 1
    assert not any(line.strip().startswith("ROOT") and "__ynn_fusion" in line for line in lines)
