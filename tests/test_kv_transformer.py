"""The transformer's reference-KV modes against diffusers' KV processors on the same weights.

Extract: [refs, img] with reference queries attending to reference keys only and reference
tokens modulated at timestep 0. Cached: img only, keys and values [txt, cached refs, img].
The references-only pass must give the extract step's K / V, and a cached step must give
the same velocity as recomputing the step with the references (extract).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flux2klein_cli.core.models.transformer import Flux2Transformer, ReferenceKV, load_transformer
from tests.fixtures.reference import lazy
from tests.test_transformer import image_ids, rel_err, text_ids

# Long for the fast tier (`-m "not slow"`, under 4 minutes); the full suite runs it.
pytestmark = pytest.mark.slow

# torch and diffusers on first use: the module collects on a base install (no torch).
torch = lazy("torch")

BATCH, TXT, H, W = 2, 12, 4, 6
REF_SIZES = [(2, 3), (3, 2), (4, 4)]


@pytest.fixture(scope="module")
def reference(tiny_kv_checkpoint: Path):
    from diffusers import Flux2Transformer2DModel
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2KVAttnProcessor,
        Flux2KVParallelSelfAttnProcessor,
    )

    model = Flux2Transformer2DModel.from_pretrained(tiny_kv_checkpoint / "transformer", dtype=torch.float32).eval()
    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    return model


@pytest.fixture(scope="module")
def ours(tiny_kv_checkpoint: Path) -> Flux2Transformer:
    return load_transformer(tiny_kv_checkpoint / "transformer", dtype=jnp.float32)


def make_inputs(n_refs: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = REF_SIZES[:n_refs]
    ref_ids = np.concatenate([image_ids(h, w, 10 + 10 * i) for i, (h, w) in enumerate(sizes)])
    return dict(
        refs=rng.standard_normal((BATCH, len(ref_ids), 128)).astype(np.float32),
        img=rng.standard_normal((BATCH, H * W, 128)).astype(np.float32),
        txt=rng.standard_normal((BATCH, TXT, 96)).astype(np.float32),
        ref_ids=ref_ids,
        img_ids=image_ids(H, W),
        txt_ids=text_ids(TXT),
        sigma=np.array([0.9, 0.4], np.float32),
    )


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def reference_extract(model, x: dict[str, np.ndarray]):
    with torch.no_grad():
        out, cache = model(
            hidden_states=t(np.concatenate([x["refs"], x["img"]], axis=1)), encoder_hidden_states=t(x["txt"]),
            timestep=t(x["sigma"]), img_ids=t(np.concatenate([x["ref_ids"], x["img_ids"]])), txt_ids=t(x["txt_ids"]),
            return_dict=False, kv_cache_mode="extract", num_ref_tokens=x["refs"].shape[1],
        )
    return out.numpy(), cache


def reference_cached(model, x: dict[str, np.ndarray], cache) -> np.ndarray:
    with torch.no_grad():
        out = model(
            hidden_states=t(x["img"]), encoder_hidden_states=t(x["txt"]), timestep=t(x["sigma"]),
            img_ids=t(x["img_ids"]), txt_ids=t(x["txt_ids"]), return_dict=False, kv_cache=cache,
            kv_cache_mode="cached",
        )[0]
    return out.numpy()


def reference_kv_arrays(cache) -> dict[str, np.ndarray]:
    def stack(layers) -> tuple[np.ndarray, np.ndarray]:
        return (np.stack([c.k_ref.numpy() for c in layers]), np.stack([c.v_ref.numpy() for c in layers]))

    (dk, dv), (sk, sv) = stack(cache.double_block_caches), stack(cache.single_block_caches)
    return dict(double_k=dk, double_v=dv, single_k=sk, single_v=sv)


def ours_refs_only(model: Flux2Transformer, x: dict[str, np.ndarray]) -> ReferenceKV:
    rope = model.rope(np.zeros((0, 4), np.float32), x["ref_ids"])
    return jax.jit(lambda m, r, rope: m.reference_kv(r, rope))(model, jnp.asarray(x["refs"][:1]), rope)


def ours_cached(model: Flux2Transformer, x: dict[str, np.ndarray], kv: ReferenceKV) -> np.ndarray:
    rope = model.rope(x["txt_ids"], x["img_ids"])
    out = jax.jit(lambda m, *a: m(*a))(
        model, jnp.asarray(x["img"]), jnp.asarray(x["txt"]), jnp.asarray(x["sigma"]), rope, kv
    )
    return np.asarray(out)


@pytest.mark.parametrize("n_refs", [1, 2, 3])
def test_references_only_pass_equals_diffusers_extract_kv(reference, ours, n_refs: int) -> None:
    x = make_inputs(n_refs)
    x["refs"][1] = x["refs"][0]  # one set of references for the batch, as in an edit
    _, cache = reference_extract(reference, x)
    expected = reference_kv_arrays(cache)
    kv = ours_refs_only(ours, x)
    for name, want in expected.items():
        got = np.asarray(getattr(kv, name))[:, 0]
        assert got.shape == want[:, 0].shape, name
        assert rel_err(got, want[:, 0]) < 1e-5, (name, rel_err(got, want[:, 0]))


@pytest.mark.parametrize("n_refs", [1, 3])
def test_extract_and_cached_velocities_match_diffusers(reference, ours, n_refs: int) -> None:
    x = make_inputs(n_refs, seed=1)
    want_extract, cache = reference_extract(reference, x)
    rope = ours.rope(x["txt_ids"], np.concatenate([x["ref_ids"], x["img_ids"]]))
    got_extract, kv = jax.jit(lambda m, *a: m.extract(*a))(
        ours, jnp.asarray(x["refs"]), jnp.asarray(x["img"]), jnp.asarray(x["txt"]), jnp.asarray(x["sigma"]), rope
    )
    assert rel_err(np.asarray(got_extract), want_extract) < 1e-5

    x_next = dict(x, sigma=np.array([0.3, 0.2], np.float32))
    want_cached = reference_cached(reference, x_next, cache)
    assert rel_err(ours_cached(ours, x_next, kv), want_cached) < 1e-5


def test_cached_step_equals_recomputing_the_step(ours) -> None:
    """A step in cached mode with the references-only cache gives the velocity of the same step
    run with the reference tokens in the input (the full recomputation)."""
    x = make_inputs(2, seed=2)
    x["refs"][1] = x["refs"][0]
    rope = ours.rope(x["txt_ids"], np.concatenate([x["ref_ids"], x["img_ids"]]))
    full, _ = jax.jit(lambda m, *a: m.extract(*a))(
        ours, jnp.asarray(x["refs"]), jnp.asarray(x["img"]), jnp.asarray(x["txt"]), jnp.asarray(x["sigma"]), rope
    )
    cached = ours_cached(ours, x, ours_refs_only(ours, x))
    assert rel_err(cached, np.asarray(full)) < 1e-5


def test_one_cache_serves_every_image_of_a_batch(ours) -> None:
    """The references-only cache is one (batch 1) for the whole batch: two images with it give
    the velocities each gives alone with it, and the cache of two copies of the references
    holds that one cache twice."""
    x = make_inputs(2, seed=4)
    kv = ours_refs_only(ours, x)
    assert all(leaf.shape[1] == 1 for leaf in jax.tree.leaves(kv))
    batch = ours_cached(ours, x, kv)
    for i in range(BATCH):
        one = {name: x[name][i : i + 1] for name in ("img", "txt", "sigma")}
        alone = ours_cached(ours, dict(x, **one), kv)
        assert rel_err(batch[i : i + 1], alone) < 1e-6, (i, rel_err(batch[i : i + 1], alone))
    rope = ours.rope(np.zeros((0, 4), np.float32), x["ref_ids"])
    twice = jax.jit(lambda m, r, rope: m.reference_kv(r, rope))(ours, jnp.asarray(x["refs"][[0, 0]]), rope)
    for once, both in zip(jax.tree.leaves(kv), jax.tree.leaves(twice), strict=True):
        assert both.shape[1] == 2
        for i in range(2):
            assert rel_err(np.asarray(both[:, i]), np.asarray(once[:, 0])) < 1e-6


def test_an_empty_cache_is_the_plain_forward_without_refs(ours) -> None:
    """An empty cache (no reference tokens) is the plain text-to-image forward."""
    x = make_inputs(1, seed=3)
    kv = ours_refs_only(ours, x)
    empty = jax.tree.map(lambda a: a[:, :, :0], kv)
    rope = ours.rope(x["txt_ids"], x["img_ids"])
    plain = jax.jit(lambda m, *a: m(*a))(ours, jnp.asarray(x["img"]), jnp.asarray(x["txt"]), jnp.asarray(x["sigma"]),
                                         rope)
    assert rel_err(ours_cached(ours, x, empty), np.asarray(plain)) < 1e-6
