"""Latent geometries other than klein's: derived from the configs, run like diffusers, keyed in the store."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.core.compile import specs as P
from flux2klein_cli.core.compile.keys import key_of, key_parts
from flux2klein_cli.core.compile.model_configs import model_configs
from flux2klein_cli.core.engine.engine import Engine
from flux2klein_cli.core.engine.plan import RunFields
from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.pipeline.geometry import LatentGeometry
from tests.fixtures.engine import engine_on
from tests.fixtures.tiny_configs import transformer_config, vae_config
from tests.test_pipeline_parity import check, synthetic_image

SHALLOW = LatentGeometry(pixels_per_token=8, channels=32)
runner = CliRunner()


def test_geometry_follows_the_vae_depth_and_latent_width() -> None:
    assert LatentGeometry.from_configs(vae_config(), transformer_config()) == LatentGeometry(16, 128)
    shallow = LatentGeometry.from_configs(vae_config(levels=3, latent_channels=8), transformer_config(in_channels=32))
    assert shallow == SHALLOW
    assert shallow.latents_shape(2, 40, 48) == (2, 32, 5, 6)


def test_a_transformer_of_another_latent_width_is_refused_naming_the_field() -> None:
    with pytest.raises(CheckpointError, match=r"in_channels is 128.*8 x 4 = 32"):
        LatentGeometry.from_configs(vae_config(levels=3, latent_channels=8), transformer_config(in_channels=128))
    with pytest.raises(CheckpointError, match="out_channels is 64"):
        LatentGeometry.from_configs(vae_config(), dict(transformer_config(), out_channels=64))


@pytest.fixture(scope="module")
def shallow(tiny_shallow_checkpoint: Path) -> Engine:
    return engine_on(tiny_shallow_checkpoint)


@pytest.mark.slow
def test_text_to_image_matches_diffusers_at_8_pixels_per_token(shallow: Engine) -> None:
    assert shallow.pipeline.geometry == SHALLOW
    # 40x56 is no multiple of 16: only this geometry's 8 allows it.
    check(shallow, RunFields(prompts=("a red fox in snow",), steps=3, height=40, width=56, seed=3))


@pytest.mark.slow
def test_edit_matches_diffusers_at_8_pixels_per_token(shallow: Engine) -> None:
    # The reference is cropped to multiples of 8 (100x75 -> 96x72), and sets the output size.
    run = check(shallow, RunFields(prompts=("make it blue",), steps=2, seed=5), [synthetic_image(100, 75, 0)])
    assert (run.plan.height, run.plan.width) == (72, 96)


def test_store_keys_and_shapes_carry_the_geometry(tiny_shallow_checkpoint: Path, tiny_checkpoint: Path) -> None:
    configs = model_configs(str(tiny_shallow_checkpoint))
    assert configs.geometry == SHALLOW
    run = P.RunShape(40, 48, SHALLOW, max_sequence_length=16, dtype=jnp.float32)
    specs = {spec.name: spec for spec in P.pipeline_programs(configs, run)}
    for spec in specs.values():
        assert spec.key_parts["geometry"] == {"pixels_per_token": 8, "channels": 32}, spec.name
    assert jax.eval_shape(specs["noise"].fn, *specs["noise"].args).shape == (1, 5, 6, 32)
    assert specs["denoise"].args[1].latents.shape == (1, 5, 6, 32)
    # Same grid and batch on klein's geometry (80x96 px): the noise program is another entry.
    klein = model_configs(str(tiny_checkpoint))
    klein_noise = P.noise_program(P.Target.local(), P.RunShape(80, 96, klein.geometry, max_sequence_length=16))
    assert klein_noise.args[0].shape == specs["noise"].args[0].shape
    assert key_of(key_parts(klein_noise)) != key_of(key_parts(specs["noise"]))
    with pytest.raises(ValueError, match="geometry"):
        P.pipeline_programs(klein, run)


def test_generate_runs_the_geometry_with_its_latents_and_store(tiny_shallow_checkpoint: Path, tmp_path: Path) -> None:
    noise = np.random.default_rng(0).standard_normal((1, 32, 5, 7)).astype(np.float32)
    np.save(tmp_path / "noise.npy", noise)
    args = ["generate", "a fox", "--model", str(tiny_shallow_checkpoint), "--height", "40", "--width", "56",
            "--steps", "2", "--max-sequence-length", "16", "--dtype", "fp32", "--compile-cache", str(tmp_path / "exe"),
            "--latents", str(tmp_path / "noise.npy"), "--json"]
    for name in ("first", "second"):  # the second loads what the first stored
        result = runner.invoke(app, [*args, "-o", str(tmp_path / f"{name}.png")], catch_exceptions=False)
        assert result.exit_code == 0, result.stderr
        assert "warning" not in result.stderr
    report = json.loads(result.stdout)
    assert (report["height"], report["width"]) == (40, 56)
    assert any((tmp_path / "exe").rglob("*")), "nothing stored"

    # klein's --latents shape and a size that is no multiple of 8 are bad input for this model.
    np.save(tmp_path / "klein.npy", np.zeros((1, 128, 2, 3), np.float32))
    bad = runner.invoke(app, [*args[:-3], "--latents", str(tmp_path / "klein.npy"), "-o", str(tmp_path / "x.png")])
    assert bad.exit_code == 2 and "(1, 32, 5, 7)" in bad.stderr
    bad = runner.invoke(app, ["generate", "a fox", "--model", str(tiny_shallow_checkpoint), "--height", "44",
                              "-o", str(tmp_path / "y.png")])
    assert bad.exit_code == 2 and "multiple of 8" in bad.stderr
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "y.png").exists()


def test_a_checkpoint_the_pipeline_cannot_run_is_exit_2(tiny_shallow_checkpoint: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_shallow_checkpoint, broken)
    config_path = broken / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["in_channels"] = 128
    config_path.write_text(json.dumps(config))
    out = tmp_path / "out.png"
    result = runner.invoke(app, ["generate", "a fox", "--model", str(broken), "--height", "32", "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert "in_channels" in result.stderr and "Traceback" not in result.output
    assert not out.exists()
