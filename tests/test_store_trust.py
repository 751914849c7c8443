"""A store runs only what its owner wrote: planted, foreign or exposed entries are refused,
the planted code never runs, and the result is still right."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import stat
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flux2klein_cli.core import trust
from flux2klein_cli.core.compile import treedefs
from flux2klein_cli.core.compile.store import EXECUTABLE, META, TREES, ExecutableStore
from flux2klein_cli.core.compile.target import ProgramSpec
from flux2klein_cli.core.models.transformer import ReferenceKV

OTHER_UID = 65534  # nobody


def make_spec(scale: float = 2.0) -> ProgramSpec:
    fn = jax.jit(lambda x, y: x * scale + y)
    args = (jax.ShapeDtypeStruct((8,), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.float32))
    return ProgramSpec("axpy", fn, args, {"scale": scale})


def run(compiled: jax.stages.Compiled) -> np.ndarray:
    return np.asarray(compiled(jnp.arange(8, dtype=jnp.float32), jnp.ones(8, jnp.float32)))


class _Planted:
    """Unpickling it creates `path`: proof that planted code ran."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.path), "w")


def plant(entry: Path, payload: bytes, *, sign_with: bytes | None = None) -> None:
    """Replace an entry's executable and update its record to match, as an attacker would."""
    meta = json.loads((entry / META).read_text())
    meta["files"][EXECUTABLE] = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    meta.pop(trust.SIGNATURE_FIELD)
    if sign_with is not None:
        meta = trust.sign(meta, sign_with)
    (entry / EXECUTABLE).write_bytes(payload)
    (entry / META).write_text(json.dumps(meta))


def give_away(paths: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `paths` another user's: chown as root; otherwise this process becomes another
    user in the store's eyes, which is the same mismatch seen from the other side."""
    if os.geteuid() == 0:
        for path in paths:
            os.chown(path, OTHER_UID, OTHER_UID)
    else:
        monkeypatch.setattr(trust.os, "geteuid", lambda: OTHER_UID)


def stored(tmp_path: Path) -> tuple[ExecutableStore, Path]:
    store = ExecutableStore(tmp_path / "store")
    _, info = store.load_or_compile(make_spec())
    assert info.saved
    return store, Path(info.path)


@pytest.mark.parametrize("signer", ["unsigned", "another store's key"])
def test_planted_pickle_never_runs(tmp_path: Path, signer: str) -> None:
    store, entry = stored(tmp_path)
    marker = tmp_path / "planted-code-ran"
    plant(entry, pickle.dumps(_Planted(marker)), sign_with=None if signer == "unsigned" else b"k" * 32)
    with pytest.warns(UserWarning, match="not signed with this store's key"):
        compiled, info = ExecutableStore(store.root).load_or_compile(make_spec())
    assert not marker.exists()
    assert info.status == "recompiled"
    np.testing.assert_allclose(run(compiled), np.arange(8) * 2.0 + 1)


def test_an_entry_copied_from_another_store_is_refused(tmp_path: Path) -> None:
    _, foreign = stored(tmp_path / "theirs")
    # Theirs computes x * 5 + y under our program's key: its own signature is valid for their key only.
    _, five = ExecutableStore(tmp_path / "five").load_or_compile(make_spec(5.0))
    ours = ExecutableStore(tmp_path / "ours")
    ours.load_or_compile(make_spec())
    target = Path(ours.entry(foreign.name))
    for name in (EXECUTABLE, TREES, META):
        (target / name).write_bytes((foreign / name).read_bytes())
    plant(target, (Path(five.path) / EXECUTABLE).read_bytes(),
          sign_with=trust.store_key(tmp_path / "theirs" / "store"))
    with pytest.warns(UserWarning, match="not signed"):
        compiled, info = ours.load_or_compile(make_spec())
    np.testing.assert_allclose(run(compiled), np.arange(8) * 2.0 + 1)


def test_entry_owned_by_another_user_is_refused_even_when_signed(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store, entry = stored(tmp_path)
    marker = tmp_path / "planted-code-ran"
    plant(entry, pickle.dumps(_Planted(marker)), sign_with=trust.store_key(store.root))  # the key leaked
    give_away([entry, *entry.iterdir()], monkeypatch)
    with pytest.warns(UserWarning, match="belongs to another user"):
        compiled, _ = ExecutableStore(store.root).load_or_compile(make_spec())
    assert not marker.exists()
    np.testing.assert_allclose(run(compiled), np.arange(8) * 2.0 + 1)


def test_world_writable_entry_is_refused_even_when_signed(tmp_path: Path) -> None:
    store, entry = stored(tmp_path)
    marker = tmp_path / "planted-code-ran"
    plant(entry, pickle.dumps(_Planted(marker)), sign_with=trust.store_key(store.root))
    (entry / EXECUTABLE).chmod(0o666)
    with pytest.warns(UserWarning, match="writable by other users"):
        compiled, _ = ExecutableStore(store.root).load_or_compile(make_spec())
    assert not marker.exists()
    np.testing.assert_allclose(run(compiled), np.arange(8) * 2.0 + 1)


def test_a_store_others_can_write_is_not_used_at_all(tmp_path: Path) -> None:
    store, entry = stored(tmp_path)
    store.root.chmod(0o777)
    messages: list[str] = []
    shared = ExecutableStore(store.root, on_warning=messages.append)
    compiled, info = shared.load_or_compile(make_spec(3.0))
    compiled_again, again = shared.load_or_compile(make_spec())
    assert "hit" not in (info.status, again.status) and not (info.saved or again.saved)  # not read, not written
    assert len(messages) == 1 and "writable by other users" in messages[0] and "chmod go-w" in messages[0]
    assert [p.name for p in store.root.iterdir() if p.is_dir()] == [entry.name]
    np.testing.assert_allclose(run(compiled_again), np.arange(8) * 2.0 + 1)


def test_a_key_others_can_read_is_refused(tmp_path: Path) -> None:
    store, _ = stored(tmp_path)
    (store.root / trust.KEY_FILE).chmod(0o644)
    messages: list[str] = []
    _, info = ExecutableStore(store.root, on_warning=messages.append).load_or_compile(make_spec())
    assert info.status != "hit" and not info.saved and "readable by other users" in messages[0]


def test_new_stores_and_entries_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        store, entry = stored(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(store.root.stat().st_mode) & 0o022 == 0
    assert stat.S_IMODE((store.root / trust.KEY_FILE).stat().st_mode) == 0o600
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o022 == 0 for p in entry.iterdir())
    assert ExecutableStore(store.root).load_or_compile(make_spec())[1].status == "hit"


def test_tree_structures_round_trip_without_pickle() -> None:
    x = jnp.zeros(2)
    tree = jax.tree_util.tree_structure(((x, [x, None], {"a": x, "b": (x,)}), ReferenceKV(x, x, x, x)))
    data = json.loads(json.dumps(treedefs.encode(tree)))
    assert treedefs.decode(data) == tree


@pytest.mark.parametrize("data", [{"node": "os.system", "children": []}, {"tuple": "*"}, [1, 2],
                                  {"dict": [[1, "*"]]}, "leaf"])
def test_tree_descriptions_name_no_other_types(data: object) -> None:
    with pytest.raises(ValueError):
        treedefs.decode(data)


def test_trees_of_unknown_node_types_are_not_stored() -> None:
    from collections import namedtuple

    pair = namedtuple("pair", "a b")
    with pytest.raises(ValueError, match="cannot be stored"):
        treedefs.encode(jax.tree_util.tree_structure(pair(1, 2)))


@pytest.mark.slow
def test_generate_with_planted_entries_runs_none_and_draws_the_same_image(tiny_checkpoint: Path,
                                                                          tmp_path: Path) -> None:
    from PIL import Image
    from typer.testing import CliRunner

    from flux2klein_cli.cli.app import app

    store = tmp_path / "store"

    def generate(name: str) -> np.ndarray:
        result = CliRunner().invoke(app, ["generate", "a red fox", "--model", str(tiny_checkpoint), "-o",
                                          str(tmp_path / name), "--height", "32", "--width", "32", "--steps", "2",
                                          "--dtype", "fp32", "--compile-cache", str(store)])
        assert result.exit_code == 0, result.output
        return np.asarray(Image.open(tmp_path / name))

    first = generate("first.png")
    marker = tmp_path / "planted-code-ran"
    entries = [p for p in store.iterdir() if (p / META).is_file()]
    assert entries
    for entry in entries:
        plant(entry, pickle.dumps(_Planted(marker)))
    assert np.array_equal(generate("second.png"), first)
    assert not marker.exists()


def test_an_xla_cache_others_can_write_stays_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flux2klein_cli.core.devices.runtime import configure_jax

    cache = tmp_path / "xla"
    cache.mkdir()
    cache.chmod(0o777)
    monkeypatch.setenv("FLUX2KLEIN_XLA_CACHE", str(cache))
    before = jax.config.jax_compilation_cache_dir
    messages: list[str] = []
    configure_jax(messages.append)
    assert jax.config.jax_compilation_cache_dir == before
    assert len(messages) == 1 and "writable by other users" in messages[0]


def test_concurrent_first_uses_agree_on_one_whole_key(tmp_path: Path) -> None:
    import threading

    barrier, keys = threading.Barrier(8), []

    def first_use() -> None:
        barrier.wait()
        keys.append(trust.store_key(tmp_path))

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(keys) == 8 and len(set(keys)) == 1 and len(keys[0]) == trust.KEY_BYTES
    assert sorted(p.name for p in tmp_path.iterdir()) == [trust.KEY_FILE]  # no temporaries left
