"""KV edits end to end: parity with diffusers' Flux2KleinKVPipeline, and exact reuse of the cache."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from flux2klein_cli.core import trust
from flux2klein_cli.core.engine.engine import Engine
from flux2klein_cli.core.engine.plan import RunFields, RunPlan
from flux2klein_cli.core.hub.random_checkpoint import write_random_checkpoint
from flux2klein_cli.core.pipeline.kv_store import (
    ReferenceKVStore,
    cache_identity,
    references_digest,
    weights_identity,
)
from tests.fixtures.engine import engine_on, upload
from tests.test_pipeline_parity import check, synthetic_image

REFERENCES = [synthetic_image(96, 64, 1), synthetic_image(70, 140, 2), synthetic_image(200, 64, 3),
              synthetic_image(64, 64, 4)]


@pytest.fixture(scope="module")
def kv_engine(tiny_kv_checkpoint: Path) -> Engine:
    return engine_on(tiny_kv_checkpoint)


@pytest.mark.parametrize("n_refs", [1, pytest.param(2, marks=pytest.mark.slow), 4])
def test_kv_edit_matches_diffusers_kv_pipeline(kv_engine: Engine, n_refs: int) -> None:
    run = check(kv_engine, RunFields(prompts=("put them together",), steps=3, height=64, width=80, seed=n_refs),
                REFERENCES[:n_refs])
    assert run.plan.kv  # the parity run used the KV path


def edit(engine: Engine, prompts: list[str], references: int = 1, seed: int = 9, **kw: object
         ) -> tuple[np.ndarray, str, RunPlan]:
    """A KV edit of the first `references` REFERENCES: its images, where its cache came from, its plan."""
    plan = engine.plan(RunFields(prompts=tuple(prompts), steps=3, height=64, width=64, seed=seed, kv=True,
                                 references=tuple(upload(image, f"r{i}.png")
                                                  for i, image in enumerate(REFERENCES[:references])),
                                 **kw))  # type: ignore[arg-type]
    run = engine.run(plan)
    return run.images, run.kv_cache, plan  # type: ignore[return-value]


@pytest.mark.slow
def test_reuse_in_memory_and_on_disk_gives_the_same_image(tiny_kv_checkpoint: Path, tmp_path: Path) -> None:
    warnings: list[str] = []
    fresh = engine_on(tiny_kv_checkpoint, kv_cache_dir=tmp_path, warn=warnings.append)
    first, source, _ = edit(fresh, ["a red fox"], references=2)
    assert source == "computed"
    again, source, _ = edit(fresh, ["a red fox"], references=2)
    assert source == "memory"
    assert np.abs(first.astype(int) - again.astype(int)).max() <= 1

    other = engine_on(tiny_kv_checkpoint, kv_cache_dir=tmp_path, warn=warnings.append)  # a later run
    from_disk, source, _ = edit(other, ["a red fox"], references=2)
    assert source == "disk"
    assert np.abs(first.astype(int) - from_disk.astype(int)).max() <= 1
    assert not warnings


@pytest.mark.slow
def test_several_prompts_share_one_references_pass(kv_engine: Engine) -> None:
    """Two prompts x two images use one cache; each image equals the one from its own run."""
    kv_engine.forget_reference_kv()
    batch, source, _ = edit(kv_engine, ["a red fox", "a blue bird"], num_images=2)
    assert source == "computed" and batch.shape[0] == 4
    kv_engine.forget_reference_kv()
    alone, _, _ = edit(kv_engine, ["a blue bird"], seed=11)  # image 2 of the batch: prompt 2, seed 9 + 2
    assert np.abs(batch[2].astype(int) - alone[0].astype(int)).max() <= 1


@pytest.mark.slow
def test_a_corrupt_or_foreign_disk_entry_is_recomputed(tiny_kv_checkpoint: Path, tmp_path: Path) -> None:
    warnings: list[str] = []
    engine = engine_on(tiny_kv_checkpoint, kv_cache_dir=tmp_path, warn=warnings.append)
    good, _, plan = edit(engine, ["a red fox"])
    store = engine.reference_kv.store
    digest, shapes = references_digest(list(plan.references)), engine.pipeline.reference_kv_shapes(plan.references)
    data = tmp_path / f"{store.key(digest)}.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert store.load(digest, shapes) is None and "checksum" in warnings[-1]

    engine.forget_reference_kv()
    again, source, _ = edit(engine, ["a red fox"])
    assert source == "computed"
    assert np.abs(good.astype(int) - again.astype(int)).max() <= 1
    assert store.load(digest, shapes) is not None  # rewritten

    # Another model's store with the same directory never sees this entry.
    foreign = ReferenceKVStore(tmp_path, "another-model", jnp.float32, warnings.append)
    assert foreign.load(digest, shapes) is None
    # Nor does the same model in another dtype.
    assert ReferenceKVStore(tmp_path, store.identity, jnp.bfloat16, warnings.append).load(digest, shapes) is None


@pytest.mark.slow
def test_an_unwritable_store_warns_and_the_edit_runs(tiny_kv_checkpoint: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("x")
    warnings: list[str] = []
    engine = engine_on(tiny_kv_checkpoint, kv_cache_dir=blocked / "kv", warn=warnings.append)
    images, source, _ = edit(engine, ["a red fox"])
    assert source == "computed" and images.shape == (1, 64, 64, 3)
    assert len(warnings) == 1 and "cannot store" in warnings[0]


def test_weights_identity_tells_checkpoints_of_one_geometry_apart(tiny_checkpoint: Path,
                                                                   tiny_kv_checkpoint: Path) -> None:
    a = weights_identity(tiny_checkpoint / "transformer")
    assert a == weights_identity(tiny_checkpoint / "transformer")
    assert a != weights_identity(tiny_kv_checkpoint / "transformer")


def test_the_cache_key_covers_the_vae_and_the_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """References reach the transformer as VAE latents: another VAE (same transformer), another
    source fingerprint or another package version is another key, so never an old entry."""
    import flux2klein_cli

    a = write_random_checkpoint(tmp_path / "a", "tiny", components=("transformer", "vae"), seed=0)
    b = write_random_checkpoint(tmp_path / "b", "tiny", components=("vae",), seed=1)
    base = cache_identity(a / "transformer", a / "vae", "code-1")
    assert base == cache_identity(a / "transformer", a / "vae", "code-1")
    assert base != cache_identity(a / "transformer", b / "vae", "code-1")
    assert base != cache_identity(a / "transformer", a / "vae", "code-2")
    monkeypatch.setattr(flux2klein_cli, "__version__", "999.0", raising=False)
    assert base != cache_identity(a / "transformer", a / "vae", "code-1")
    digest = references_digest([np.zeros((16, 16, 3), np.float32)])
    stores = [ReferenceKVStore(tmp_path, i, jnp.float32, print) for i in (base, cache_identity(a / "transformer",
                                                                                                a / "vae", "code-1"))]
    assert stores[0].key(digest) != stores[1].key(digest)


@pytest.mark.parametrize("record", ["list", "number", "permuted shapes", "nan", "planted", "world-writable"])
def test_a_wrong_or_planted_record_is_recomputed_with_one_warning(kv_engine: Engine, tiny_kv_checkpoint: Path,
                                                                  tmp_path: Path, record: str) -> None:
    warnings: list[str] = []
    identity = weights_identity(tiny_kv_checkpoint / "transformer")
    kv_engine.forget_reference_kv()
    kv_engine.reference_kv.store = store = ReferenceKVStore(tmp_path, identity, jnp.float32, warnings.append)
    good, _, plan = edit(kv_engine, ["a red fox"])
    digest = references_digest(list(plan.references))
    meta_path, data_path = tmp_path / f"{store.key(digest)}.json", tmp_path / f"{store.key(digest)}.bin"
    meta, key = json.loads(meta_path.read_text()), trust.store_key(tmp_path)
    if record in ("list", "number"):  # valid JSON of the wrong kind
        meta_path.write_text("[]" if record == "list" else "42")
    elif record == "permuted shapes":  # signed by this user: only the schema can tell
        meta["shapes"] = [[s[0], s[3], s[2], s[1], s[4]] for s in meta["shapes"]]
        meta_path.write_text(json.dumps(trust.sign(meta, key)))
    elif record in ("nan", "planted"):  # a checksum that matches its data
        data = np.frombuffer(data_path.read_bytes(), np.float32).copy()
        data[7] = np.nan if record == "nan" else 1e3
        data_path.write_bytes(data.tobytes())
        meta["sha256"] = hashlib.sha256(data.tobytes()).hexdigest()
        unsigned = {k: v for k, v in meta.items() if k != trust.SIGNATURE_FIELD}
        meta_path.write_text(json.dumps(trust.sign(meta, key) if record == "nan" else unsigned))
    else:
        data_path.chmod(0o666)
    kv_engine.forget_reference_kv()
    again, source, _ = edit(kv_engine, ["a red fox"])
    assert source == "computed" and len(warnings) == 1 and "recomputing" in warnings[0]
    assert np.array_equal(good, again)
