"""The executable store: hits across processes, and never a stale, corrupt or mismatched entry."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flux2klein_cli.core import trust
from flux2klein_cli.core.compile import keys as keys_mod
from flux2klein_cli.core.compile.compile_all import compile_all
from flux2klein_cli.core.compile.keys import key_of, key_parts
from flux2klein_cli.core.compile.store import EXECUTABLE, MANIFEST, META, ExecutableStore, StoreWarning
from flux2klein_cli.core.compile.target import ProgramSpec, Target
from flux2klein_cli.core.devices import cpu

ROOT = Path(__file__).resolve().parent.parent


def make_spec(scale: float = 2.0, name: str = "axpy", n: int = 8) -> ProgramSpec:
    """A small program whose `scale` is a config: it changes the code, not the shapes."""
    fn = jax.jit(lambda x, y: x * scale + y)
    args = (jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32))
    return ProgramSpec(name, fn, args, {"scale": scale})


def run(compiled: jax.stages.Compiled, n: int = 8) -> np.ndarray:
    return np.asarray(compiled(jnp.arange(n, dtype=jnp.float32), jnp.ones(n, jnp.float32)))


def entry_dirs(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.is_dir()]


def test_miss_then_hit_in_a_fresh_process(tmp_path: Path) -> None:
    store = ExecutableStore(tmp_path)
    compiled, info = store.load_or_compile(make_spec())
    assert info.status == "miss" and info.saved and info.warning is None
    np.testing.assert_allclose(run(compiled), np.arange(8) * 2.0 + 1)
    meta = json.loads((Path(info.path) / META).read_text())
    assert meta["files"][EXECUTABLE]["bytes"] == (Path(info.path) / EXECUTABLE).stat().st_size
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert [e["name"] for e in manifest["executables"]] == ["axpy"]
    assert {"argument", "output", "temp", "generated_code", "peak"} <= set(manifest["executables"][0]["memory"])

    code = (
        "import sys, numpy as np; from tests.test_compile_store import make_spec, run;"
        "from flux2klein_cli.core.compile.store import ExecutableStore;"
        "c, info = ExecutableStore(sys.argv[1]).load_or_compile(make_spec());"
        "print(info.status, info.key, run(c).tolist())"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-2000:]
    status, key, values = done.stdout.split(" ", 2)
    assert status == "hit" and key == info.key
    assert json.loads(values) == (np.arange(8) * 2.0 + 1).tolist()


def test_config_change_is_recompiled_with_a_warning(tmp_path: Path) -> None:
    store = ExecutableStore(tmp_path)
    store.load_or_compile(make_spec(2.0))
    with pytest.warns(StoreWarning, match=r"stale \(extra: scale 2.0 -> 3.0\)"):
        compiled, info = store.load_or_compile(make_spec(3.0))
    assert info.status == "recompiled"
    np.testing.assert_allclose(run(compiled), np.arange(8) * 3.0 + 1)  # the new code, not the stored one
    assert store.load_or_compile(make_spec(3.0))[1].status == "hit"


def test_effort_is_its_own_entry_and_reaches_the_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ExecutableStore(tmp_path)
    default = store.load_or_compile(make_spec())[1]
    mesh = Target.local().mesh
    fast_spec = dataclasses.replace(make_spec(), target=Target(mesh, effort="fast"))
    seen: list[Any] = []
    real_compile = jax.stages.Lowered.compile

    def spy(self: jax.stages.Lowered, *args: Any, **kwargs: Any) -> jax.stages.Compiled:
        seen.append(args[0] if args else kwargs.get("compiler_options"))
        return real_compile(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    compiled, fast = store.load_or_compile(fast_spec)  # a separate entry, not a stale one: no warning
    options = {"exec_time_optimization_effort": -1.0, **cpu.xla_options()}  # and this host's CPU options
    assert seen == [options]
    assert fast.status == "miss" and fast.warning is None and fast.key != default.key
    np.testing.assert_allclose(run(compiled), np.arange(8) * 2.0 + 1)
    meta = json.loads((Path(fast.path) / META).read_text())
    assert meta["key_parts"]["compiler_options"] == options
    assert store.load_or_compile(make_spec())[1].status == "hit"  # the default entry is untouched


def test_effort_a_backend_does_not_read_compiles_at_its_default(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """jaxlib's GPU compiler rejects exec_time_optimization_effort ("No such compile option"):
    the program is compiled without it, with a warning, and stored under its effort's key."""
    warnings: list[str] = []
    store = ExecutableStore(tmp_path, on_warning=warnings.append)
    fast_spec = dataclasses.replace(make_spec(), target=Target(Target.local().mesh, effort="fast"))
    real_compile = jax.stages.Lowered.compile

    def gpu_like(self: jax.stages.Lowered, *args: Any, **kwargs: Any) -> jax.stages.Compiled:
        if args and args[0]:
            raise RuntimeError("INVALID_ARGUMENT: No such compile option: 'exec_time_optimization_effort'")
        return real_compile(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", gpu_like)
    compiled, info = store.load_or_compile(fast_spec)
    assert info.status == "miss" and len(warnings) == 1 and "compiled with its defaults" in warnings[0]
    np.testing.assert_allclose(run(compiled), np.arange(8) * 2.0 + 1)
    assert store.load_or_compile(fast_spec)[1].status == "hit"
    store.load_or_compile(dataclasses.replace(fast_spec, name="second", key_parts={"scale": 3.0}))
    assert len(warnings) == 1  # once per platform, not once per program
    # Any other compile error is the caller's.
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda self, *a, **k: (_ for _ in ()).throw(ValueError("x")))
    with pytest.raises(ValueError):
        store.compile(dataclasses.replace(fast_spec, name="other"))


def test_version_change_is_recompiled_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ExecutableStore(tmp_path)
    first = store.load_or_compile(make_spec())[1]
    real = keys_mod.library_versions
    monkeypatch.setattr(keys_mod, "library_versions", lambda platform: {**real(platform), "jaxlib": "9.9.9"})
    with pytest.warns(StoreWarning, match=r"versions: jaxlib .* -> 9\.9\.9"):
        _, info = store.load_or_compile(make_spec())
    assert info.status == "recompiled" and info.key != first.key


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta", "garbage"])
def test_damaged_entry_is_recompiled_never_used(tmp_path: Path, damage: str) -> None:
    store = ExecutableStore(tmp_path)
    _, info = store.load_or_compile(make_spec())
    entry = Path(info.path)
    exe, meta_path = entry / EXECUTABLE, entry / META
    data = exe.read_bytes()
    meta = json.loads(meta_path.read_text())
    if damage == "truncate":
        exe.write_bytes(data[: len(data) // 2])
        reason = "truncated"
    elif damage == "flip":
        exe.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
        reason = "sha256"
    elif damage == "meta":  # signed again with the store's own key: the deeper checks still hold
        meta["key_parts"]["extra"]["scale"] = 5.0
        meta_path.write_text(json.dumps(trust.sign(meta, trust.store_key(tmp_path))))
        reason = "key parts differ"
    else:  # a well-formed entry whose executable does not deserialize
        junk = b"not an executable" * 10
        import hashlib

        meta["files"][EXECUTABLE] = {"bytes": len(junk), "sha256": hashlib.sha256(junk).hexdigest()}
        exe.write_bytes(junk)
        meta_path.write_text(json.dumps(trust.sign(meta, trust.store_key(tmp_path))))
        reason = "deserialization failed"
    with pytest.warns(StoreWarning, match=reason):
        compiled, again = store.load_or_compile(make_spec())
    assert again.status == "recompiled" and again.key == info.key
    np.testing.assert_allclose(run(compiled), np.arange(8) * 2.0 + 1)
    assert store.load_or_compile(make_spec())[1].status == "hit"  # the entry was replaced by a good one


def test_concurrent_writers_leave_one_valid_entry(tmp_path: Path) -> None:
    store = ExecutableStore(tmp_path)
    spec = make_spec()
    parts = key_parts(spec)
    compiled, _, _ = store.compile(spec)
    barrier = threading.Barrier(6)

    def write() -> None:
        barrier.wait()
        store.save(spec, compiled, parts, compile_s=0.0, lower_s=0.0)

    threads = [threading.Thread(target=write) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Two processes writing the same key at once, too.
    code = ("import sys; from tests.test_compile_store import make_spec;"
            "from flux2klein_cli.core.compile.store import ExecutableStore;"
            "from flux2klein_cli.core.compile.keys import key_parts;"
            "s = ExecutableStore(sys.argv[1]); spec = make_spec(); c, _, _ = s.compile(spec);"
            "[s.save(spec, c, key_parts(spec), compile_s=0.0, lower_s=0.0) for _ in range(5)]")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT))) for _ in range(2)]
    assert all(p.wait() == 0 for p in procs)
    assert [p.name for p in entry_dirs(tmp_path)] == [key_of(parts)]  # no temporaries or trash left
    loaded, info = store.load_or_compile(spec)
    assert info.status == "hit"
    np.testing.assert_allclose(run(loaded), np.arange(8) * 2.0 + 1)
    assert len(json.loads((tmp_path / MANIFEST).read_text())["executables"]) == 1


@pytest.mark.parametrize("parallel", [True, False])
def test_compile_all_then_all_hits(tmp_path: Path, parallel: bool) -> None:
    # Shapes of their own per case: XLA's CPU runtime can fail to find a fused kernel when one
    # process deserializes the same module again after compiling it (seen across the two cases).
    n = 16 if parallel else 40
    store = ExecutableStore(tmp_path)
    specs = [make_spec(2.0, "a", n=n - 8), make_spec(3.0, "b", n=n)]
    first = compile_all(specs, store, parallel=parallel)
    assert [info.status for _, info in first] == ["miss", "miss"]
    second = compile_all(specs, store, parallel=parallel)
    assert [(info.name, info.status) for _, info in second] == [("a", "hit"), ("b", "hit")]
    np.testing.assert_allclose(run(second[1][0], n), np.arange(n) * 3.0 + 1)


def test_stored_programs_load_side_by_side_each_with_its_own_warnings(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_all deserializes every stored program at once (threads), and a load's warning stays
    with its own program: here the three loads wait for each other, which one after another they
    could not, and then the middle one's entry does not deserialize."""
    import hashlib

    specs = [make_spec(2.0, "a", n=24), make_spec(3.0, "b", n=32), make_spec(4.0, "c", n=48)]
    stored = compile_all(specs, ExecutableStore(tmp_path))
    entry = Path(stored[1][1].path or "")
    junk = b"not an executable" * 10
    meta = json.loads((entry / META).read_text())
    meta["files"][EXECUTABLE] = {"bytes": len(junk), "sha256": hashlib.sha256(junk).hexdigest()}
    (entry / EXECUTABLE).write_bytes(junk)
    (entry / META).write_text(json.dumps(trust.sign(meta, trust.store_key(tmp_path))))

    together, met = threading.Barrier(3, timeout=20), []
    deserialize = ExecutableStore._deserialize

    def meeting(self: ExecutableStore, spec: ProgramSpec, payload: bytes, out_tree: Any) -> Any:
        try:
            together.wait()
            met.append(spec.name)
        except threading.BrokenBarrierError:
            pass
        return deserialize(self, spec, payload, out_tree)

    monkeypatch.setattr(ExecutableStore, "_deserialize", meeting)
    with pytest.warns(StoreWarning, match="deserialization failed"):
        results = compile_all(specs, ExecutableStore(tmp_path))
    assert sorted(met) == ["a", "b", "c"]
    assert [(info.name, info.status) for _, info in results] == [("a", "hit"), ("b", "recompiled"), ("c", "hit")]
    assert results[0][1].warning is None and results[2][1].warning is None
    assert "deserialization failed" in (results[1][1].warning or "")
    for (compiled, _), (scale, n) in zip(results, ((2.0, 24), (3.0, 32), (4.0, 48)), strict=True):
        np.testing.assert_allclose(run(compiled, n), np.arange(n) * scale + 1)


def test_no_save_stores_nothing(tmp_path: Path) -> None:
    _, info = ExecutableStore(tmp_path / "s").load_or_compile(make_spec(), save=False)
    assert info.status == "miss" and not info.saved and not (tmp_path / "s").exists()


@pytest.mark.parametrize("parallel", [False, True], ids=["one-at-a-time", "parallel"])
def test_a_program_compiles_while_the_next_is_lowered(tmp_path: Path, parallel: bool) -> None:
    """Lowering stays on the caller's thread, but each compile starts as soon as its program is
    lowered: the second program's tracing waits here until the first one's compile has begun
    (before, nothing compiled until every program was lowered, and this waited in vain)."""
    first_compiling = threading.Event()
    seen_while_tracing: list[bool] = []

    def slow_to_trace(x: jax.Array, y: jax.Array) -> jax.Array:
        # Runs while tracing, on the lowering thread.
        seen_while_tracing.append(first_compiling.wait(timeout=20))
        return x - y

    second = ProgramSpec("second", jax.jit(slow_to_trace), make_spec().args, {"which": 2})

    def progress(message: str) -> None:
        if message == "axpy: compiling":
            first_compiling.set()

    results = compile_all([make_spec(), second], ExecutableStore(tmp_path), parallel=parallel, progress=progress)
    assert seen_while_tracing == [True] and [info.status for _, info in results] == ["miss", "miss"]
    np.testing.assert_allclose(run(results[1][0]), np.arange(8) - 1.0)


def test_environment_that_changes_the_program_is_in_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """XLA and libtpu flags and the GPU attention choice change what is compiled: each
    value is its own key."""
    keys = set()
    for name, value in (("XLA_FLAGS", None), ("XLA_FLAGS", "--xla_cpu_enable_fast_math=false"),
                        ("LIBTPU_INIT_ARGS", "--xla_jf_debug_level=0"), ("FLUX2KLEIN_GPU_ATTENTION", "xla")):
        for other in ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "FLUX2KLEIN_GPU_ATTENTION"):
            monkeypatch.delenv(other, raising=False)
        if value is not None:
            monkeypatch.setenv(name, value)
        keys.add(key_of(key_parts(make_spec())))
    assert len(keys) == 4


def test_a_program_the_compiler_cannot_fit_is_one_line_naming_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """libtpu refuses a program larger than the chip with RESOURCE_EXHAUSTED at compile time."""
    from flux2klein_cli.core.errors import Flux2KleinError

    store = ExecutableStore(tmp_path / "store")

    def exhausted(spec: ProgramSpec, lowered: Any = None) -> Any:
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of "
                                         "memory in memory space hbm.\n  details...")

    monkeypatch.setattr(store, "compile", exhausted)
    with pytest.raises(Flux2KleinError) as caught:
        compile_all([make_spec(name="denoise")], store, parallel=False)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("denoise does not fit the target's memory (RESOURCE_EXHAUSTED:")
    assert "convert --quantize int8" in message
