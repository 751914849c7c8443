"""Step caching (FBCache / DBCache) in the denoise loop, on the tiny base checkpoint with CFG:
the cached loop against the plain one, and its decisions against a numpy model of the rule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flux2klein_cli.core.errors import FieldError
from flux2klein_cli.core.models.transformer import Flux2Transformer, load_transformer
from flux2klein_cli.core.pipeline.denoise import CacheRule, DenoiseInputs, build_inputs, denoise_fn
from flux2klein_cli.core.pipeline.schedule import SchedulerConfig, make_schedule
from flux2klein_cli.core.pipeline.step_cache import CACHE_FIELDS, StepCache, resolve_cache

GRID, TEXT, STEPS = (4, 4), 8, 8


@pytest.fixture(scope="module")
def model(tiny_base_checkpoint: Path) -> Flux2Transformer:
    return load_transformer(tiny_base_checkpoint / "transformer", dtype=jnp.float32)


def inputs(model: Flux2Transformer, cache: StepCache | None, batch: int = 1, guidance: float = 4.0,
           reference: bool = False) -> DenoiseInputs:
    """A CFG run's inputs from random prompt features and noise (no text encoder: the loop alone)."""
    rng = np.random.default_rng(7)
    config = model.config
    text = rng.standard_normal((1, TEXT, config.joint_attention_dim)).astype(np.float32)
    negative = rng.standard_normal((1, TEXT, config.joint_attention_dim)).astype(np.float32)
    latents = rng.standard_normal((batch, *GRID, config.in_channels)).astype(np.float32)
    grids = [(2, 3)] if reference else []  # a plain edit: reference tokens beside the image's
    references = rng.standard_normal((1, 6, config.in_channels)).astype(np.float32) if reference else None
    return build_inputs(model.rope, GRID, latents=latents, text=text, negative_text=negative, references=references,
                        reference_grids=grids, reference_kv=None, guidance=guidance, init=False, noise=None, mask=None,
                        schedule=make_schedule(STEPS, GRID[0] * GRID[1], SchedulerConfig()),
                        cache_rule=None if cache is None else CacheRule.of(cache))


def run(model: Flux2Transformer, cache: StepCache | None, batch: int = 1,
        reference: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(latents, differences (S, rows), cached (S, rows)); the last two empty without a cache."""
    graphdef, state = nnx.split(model)
    program = denoise_fn(graphdef, cache=None if cache is None else cache.form)
    out = program(state, inputs(model, cache, batch, reference=reference), np.int32(0))
    if cache is None:
        return np.asarray(out), np.zeros((0,)), np.zeros((0,))
    latents, record = out
    return np.asarray(latents), np.asarray(record.difference), np.asarray(record.cached)


def replay(differences: np.ndarray, cache: StepCache) -> np.ndarray:
    """The rule in numpy, from the differences the device measured: per row, cache step k when
    it is past the warm-up, moved less than the threshold, and the row has not yet been cached
    `max_skips` steps in a row."""
    cached = np.zeros(differences.shape, bool)
    in_a_row = np.zeros(differences.shape[1], int)
    for k, moved in enumerate(differences):
        cached[k] = (k >= cache.warmup) & (moved < cache.threshold) & (in_a_row < cache.max_skips)
        in_a_row = np.where(cached[k], in_a_row + 1, 0)
    return cached


# 2: every double block, with a plain edit's reference tokens in the image stream
@pytest.mark.parametrize("blocks, taylorseer, reference", [(1, False, False), (2, True, True)])
def test_threshold_zero_is_the_plain_loop_bit_for_bit(model: Flux2Transformer, blocks: int, taylorseer: bool,
                                                      reference: bool) -> None:
    plain, _, _ = run(model, None, reference=reference)
    cache = StepCache("dbcache", blocks, threshold=0.0, warmup=1, max_skips=100, taylorseer=taylorseer)
    cached_latents, differences, cached = run(model, cache, reference=reference)
    assert not cached.any()
    assert np.isinf(differences[0]).all() and np.isfinite(differences[1:]).all() and (differences[1:] > 0).all()
    np.testing.assert_array_equal(cached_latents, plain)


def test_huge_threshold_caches_every_step_after_the_warmup_up_to_the_cap(model: Flux2Transformer) -> None:
    plain, _, _ = run(model, None)
    cache = StepCache("fbcache", 1, threshold=1e30, warmup=2, max_skips=2)
    latents, _, cached = run(model, cache)
    expected = np.array([False, False, True, True, False, True, True, False])  # warm-up 2, then 2 cached, 1 full
    np.testing.assert_array_equal(cached, np.stack([expected, expected], axis=1))  # both CFG branches
    assert np.isfinite(latents).all() and not np.array_equal(latents, plain)


@pytest.mark.parametrize("taylorseer", [False, True])
def test_decisions_follow_the_numpy_rule_per_image_and_branch(model: Flux2Transformer, taylorseer: bool) -> None:
    # A threshold inside the measured range, so that rows differ: some steps cached, some not.
    _, full, _ = run(model, StepCache("dbcache", 2, 0.0, 1, 100, taylorseer), batch=2)
    threshold = float(np.median(full[1:]))
    cache = StepCache("dbcache", 2, threshold, warmup=2, max_skips=2, taylorseer=taylorseer)
    latents, differences, cached = run(model, cache, batch=2)
    np.testing.assert_array_equal(cached, replay(differences, cache))
    assert cached.any() and not cached[2:].all()
    assert np.isfinite(latents).all()


def test_settings_resolve_with_defaults_and_name_their_field() -> None:
    assert resolve_cache("none", double_blocks=2) is None
    fb = resolve_cache("fbcache", double_blocks=2, threshold=0.2)
    assert fb is not None and fb.blocks == 1 and fb.threshold == 0.2 and fb.warmup >= 1
    for kwargs, field in [({"mode": "dbcache", "blocks": 3}, "cache_blocks"),
                          ({"mode": "fbcache", "taylorseer": True}, "cache_taylorseer"),
                          ({"mode": "dbcache", "warmup": 0}, "cache_warmup"),
                          ({"mode": "none", "threshold": 0.1}, "cache_threshold"),
                          ({"mode": "teacache"}, "cache")]:
        with pytest.raises(FieldError) as error:
            resolve_cache(double_blocks=2, **kwargs)
        assert error.value.field == field


def test_cached_programs_are_keyed_apart() -> None:
    # The form is the program's key part and name; the numbers are inputs.
    form = StepCache("dbcache", 2, 0.1, 2, 3).form
    assert form == StepCache("dbcache", 2, 0.5, 4, 1).form
    assert form != StepCache("dbcache", 2, 0.1, 2, 3, taylorseer=True).form
    assert form.suffix != StepCache("fbcache", 1, 0.1, 2, 3).form.suffix


def test_plans_keep_cache_settings_apart(tiny_base_checkpoint: Path) -> None:
    from flux2klein_cli.core.engine.plan import RunFields, build_plan, model_facts

    facts = model_facts(str(tiny_base_checkpoint))
    assert facts is not None
    plain, fb, fb_other, db = (build_plan(RunFields(prompts=("a fox",), height=32, width=32, **cache), facts)
                               for cache in ({}, {"cache": "fbcache"}, {"cache": "fbcache", "cache_threshold": 0.3},
                                             {"cache": "dbcache", "cache_taylorseer": True}))
    assert plain.cache is None and fb.cache is not None and db.cache is not None and db.cache.blocks == 2
    assert len({p.batch_key() for p in (plain, fb, fb_other, db)}) == 4  # no batch mixes cache settings
    # One program per form: other numbers share it, the form names its own.
    assert fb.shape("float32") == fb_other.shape("float32") != db.shape("float32")
    names = [p.shape("float32").names() for p in (plain, fb, db)]
    assert "denoise" in names[0] and "denoise_cache_f1" in names[1] and "denoise_cache_f2_taylor" in names[2]
    with pytest.raises(FieldError) as error:
        build_plan(RunFields(prompts=("a fox",), cache="dbcache", cache_blocks=3), facts)  # 2 double blocks
    assert error.value.field == "cache_blocks"


@pytest.mark.slow
def test_generate_reports_skips_records_settings_and_reruns_from_png(tiny_base_checkpoint: Path,
                                                                     tmp_path: Path) -> None:
    from PIL import Image
    from typer.testing import CliRunner

    from flux2klein_cli.cli.app import app
    from flux2klein_cli.core.runs.image_files import read_run_metadata

    def generate(*args: object) -> Any:
        return CliRunner().invoke(app, ["generate", *map(str, args)], catch_exceptions=False)

    common = ("--height", 32, "--width", 48, "--steps", 4, "--max-sequence-length", 16, "--dtype", "fp32")
    first = tmp_path / "a.png"
    made = generate("a fox", "--model", tiny_base_checkpoint, *common, "--cache", "fbcache", "--cache-threshold",
                    1e9, "--cache-warmup", 1, "--cache-max-skips", 2, "--json", "-o", first)
    assert made.exit_code == 0, made.stderr
    report = json.loads(made.stdout)["cache"]
    # Steps 0 and 3 run in full, 1 and 2 cached (warm-up 1, at most 2 in a row), in both CFG branches.
    assert report["skipped_steps"] == [2, 2] and report["blocks_skipped"] == 2 * 2 * 4
    meta = read_run_metadata(first)
    assert {k: meta[k] for k in CACHE_FIELDS} == {"cache": "fbcache", "cache_threshold": 1e9, "cache_warmup": 1,
                                                  "cache_max_skips": 2, "cache_blocks": 1, "cache_taylorseer": False}
    again = generate("--from", first, "-o", tmp_path / "b.png")
    assert again.exit_code == 0, again.stderr
    assert np.array_equal(np.asarray(Image.open(first)), np.asarray(Image.open(tmp_path / "b.png")))
    plain = generate("--from", first, "--cache", "none", "-o", tmp_path / "c.png")
    assert plain.exit_code == 0, plain.stderr
    assert "cache" not in read_run_metadata(tmp_path / "c.png")
    assert not np.array_equal(np.asarray(Image.open(first)), np.asarray(Image.open(tmp_path / "c.png")))
    bad = generate("a fox", "--model", tiny_base_checkpoint, *common, "--cache-threshold", 0.1,
                   "-o", tmp_path / "d.png")
    assert bad.exit_code == 2 and "--cache-threshold" in bad.stderr and "--cache" in bad.stderr
    assert not (tmp_path / "d.png").exists()
