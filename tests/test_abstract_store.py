"""The models' abstract builds kept in the executable store: a new process merges the stored graph
and shapes instead of building the model, gets the same model, and never unpickles an entry this
user's store did not sign."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

from flux2klein_cli.core import trust
from flux2klein_cli.core.compile import abstract_store
from flux2klein_cli.core.compile.abstract_store import PAYLOAD, RECORD, AbstractModelStore
from flux2klein_cli.core.models import layers
from flux2klein_cli.core.models.vae import abstract_vae
from flux2klein_cli.core.models.vae_config import VAEConfig

ROOT = Path(__file__).resolve().parents[1]
SMALL = VAEConfig(block_out_channels=(8, 16), decoder_block_out_channels=(8, 16), layers_per_block=1,
                  latent_channels=4, norm_num_groups=4)


class _Planted:
    """Unpickling it creates `path`: proof that planted code ran."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.path), "w")


@pytest.fixture
def backed(tmp_path: Path) -> Iterator[AbstractModelStore]:
    """This process's abstract builds backed by a fresh store, none of them in memory."""
    store = AbstractModelStore(tmp_path / "store")
    kept = dict(layers._ABSTRACT)
    layers._ABSTRACT.clear()
    layers.back_abstract_builds(store)
    try:
        yield store
    finally:
        layers.back_abstract_builds(None)
        layers._ABSTRACT.clear()
        layers._ABSTRACT.update(kept)


def shapes(module: nnx.Module) -> dict[tuple[object, ...], tuple[tuple[int, ...], str]]:
    return {path: (tuple(var.get_value().shape), str(var.get_value().dtype))
            for path, var in nnx.to_flat_state(nnx.state(module))}


def forget_in_memory() -> None:
    layers._ABSTRACT.clear()


def no_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(build: object) -> None:
        raise AssertionError("built the model: the stored build was not used")

    monkeypatch.setattr(layers.nnx, "eval_shape", refuse)


def entry_paths(store: AbstractModelStore) -> list[Path]:
    return sorted(store.directory.glob(f"*{RECORD}"))


def test_a_stored_build_comes_back_as_the_same_model_without_building(
        backed: AbstractModelStore, monkeypatch: pytest.MonkeyPatch) -> None:
    built = abstract_vae(SMALL, dtype=jnp.float32)
    assert len(entry_paths(backed)) == 1
    record = entry_paths(backed)[0]
    assert (record.stat().st_mode & 0o077) == 0 and (record.with_suffix(PAYLOAD).stat().st_mode & 0o077) == 0
    forget_in_memory()
    no_builds(monkeypatch)
    read = abstract_vae(SMALL, dtype=jnp.float32)
    assert nnx.graphdef(read) == nnx.graphdef(built)
    assert shapes(read) == shapes(built) and shapes(read)  # every parameter, same shape and dtype
    with pytest.raises(AssertionError, match="stored build was not used"):  # another dtype is another entry
        abstract_vae(SMALL, dtype=jnp.bfloat16)


def test_a_new_process_reads_the_build_the_first_one_stored(tmp_path: Path) -> None:
    program = """
import json, sys
import jax.numpy as jnp
from flux2klein_cli.core.compile.abstract_store import AbstractModelStore
from flux2klein_cli.core.models import layers
from flux2klein_cli.core.models.vae import abstract_vae
from flux2klein_cli.core.models.vae_config import VAEConfig
built = []
eval_shape = layers.nnx.eval_shape
layers.nnx.eval_shape = lambda build: built.append(1) or eval_shape(build)
layers.back_abstract_builds(AbstractModelStore(sys.argv[1]))
model = abstract_vae(VAEConfig.from_dict(json.loads(sys.argv[2])), dtype=jnp.float32)
print(json.dumps({"built": len(built), "kernel": list(model.decoder.conv_out.kernel.shape)}))
"""
    config = {"block_out_channels": [8, 16], "decoder_block_out_channels": [8, 16], "layers_per_block": 1,
              "latent_channels": 4, "norm_num_groups": 4}

    def run() -> dict[str, object]:
        done = subprocess.run([sys.executable, "-c", program, str(tmp_path / "store"), json.dumps(config)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first == {"built": 1, "kernel": [3, 3, 8, 3]}
    assert second == {"built": 0, "kernel": [3, 3, 8, 3]}


@pytest.mark.parametrize("signer", ["unsigned", "another store's key"])
def test_an_entry_this_store_did_not_sign_is_never_unpickled(
        backed: AbstractModelStore, tmp_path: Path, signer: str) -> None:
    abstract_vae(SMALL, dtype=jnp.float32)
    record_path = entry_paths(backed)[0]
    marker = tmp_path / "planted-code-ran"
    payload = pickle.dumps(_Planted(marker))
    record = json.loads(record_path.read_text())
    record.pop(trust.SIGNATURE_FIELD)
    record["sha256"] = hashlib.sha256(payload).hexdigest()
    if signer != "unsigned":
        record = trust.sign(record, b"k" * 32)
    record_path.with_suffix(PAYLOAD).write_bytes(payload)
    record_path.write_text(json.dumps(record))
    forget_in_memory()
    model = abstract_vae(SMALL, dtype=jnp.float32)  # built again, and stored again
    assert not marker.exists()
    assert model.decoder.conv_out.kernel.shape == (3, 3, 8, 3)
    assert backed.get(("vae", SMALL, "float32")) is not None  # the rebuild replaced the planted entry


def test_a_payload_that_is_not_the_signed_one_or_is_exposed_is_not_used(
        backed: AbstractModelStore, tmp_path: Path) -> None:
    key = ("vae", SMALL, "float32")
    abstract_vae(SMALL, dtype=jnp.float32)
    payload_path = entry_paths(backed)[0].with_suffix(PAYLOAD)
    original = payload_path.read_bytes()
    marker = tmp_path / "planted-code-ran"
    payload_path.write_bytes(pickle.dumps(_Planted(marker)))  # the signed record still names the old sha256
    assert backed.get(key) is None and not marker.exists()
    payload_path.write_bytes(original)
    assert backed.get(key) is not None
    payload_path.chmod(0o664)  # writable by the group: anyone in it could have planted it
    assert backed.get(key) is None
    payload_path.chmod(0o600)
    backed.directory.chmod(0o777)
    assert backed.get(key) is None


def test_an_edit_of_the_package_source_is_a_new_entry(
        backed: AbstractModelStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from flux2klein_cli.core.compile import keys

    key = ("vae", SMALL, "float32")
    abstract_vae(SMALL, dtype=jnp.float32)
    assert backed.get(key) is not None
    monkeypatch.setattr(keys, "code_fingerprint", lambda: "0" * 64)
    assert backed.get(key) is None


def test_a_store_that_saves_nothing_writes_nothing_and_old_entries_are_pruned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = nnx.split(abstract_vae(SMALL, dtype=jnp.float32))
    reading = AbstractModelStore(tmp_path / "store", save=False)
    reading.put(("vae", SMALL, "float32"), built)
    assert not reading.directory.exists()
    monkeypatch.setattr(abstract_store, "KEPT", 3)
    store = AbstractModelStore(tmp_path / "store")
    for i in range(5):
        key = ("vae", SMALL, f"form {i}")
        store.put(key, built)
        os.utime(store.directory / f"{store.entry_name(key)}{RECORD}", (1000 + i, 1000 + i))  # in order of writing
    names = {path.name for path in store.directory.iterdir()}
    assert len([n for n in names if n.endswith(RECORD)]) == 3 and len([n for n in names if n.endswith(PAYLOAD)]) == 3
    assert store.get(("vae", SMALL, "form 4")) is not None  # the newest stay
