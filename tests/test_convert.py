"""`flux2klein convert` and loading converted directories: bit-identical round trips, the manifest,
overwrite protection, interrupted converts, sharded restores, and damaged directories."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.core.checkpoint import Snapshot, load_models
from flux2klein_cli.core.errors import CheckpointError, UserInputError
from flux2klein_cli.core.random_checkpoint import write_random_checkpoint
from flux2klein_cli.core.snapshot import CONVERTED_MANIFEST
from flux2klein_cli.core.weights import orbax_convert
from flux2klein_cli.core.weights.orbax_convert import convert
from flux2klein_cli.core.weights.orbax_store import check_converted

runner = CliRunner()
CLI = "from flux2klein_cli.cli.app import main; main()"


def cli(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 snapshot in the hub layout, distilled = False to see it carried through."""
    return write_random_checkpoint(tmp_path_factory.mktemp("src") / "snapshot", "tiny", distilled=False, seed=3)


@pytest.fixture(scope="module")
def converted(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("out") / "klein-bf16"
    result = cli("convert", str(source), "--out", str(out), "--dtype", "bf16")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"{out}\n"  # only the path on stdout
    return out


def flat(module) -> dict:
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(module))}


def assert_identical(a, b) -> None:
    for name in ("transformer", "text_encoder", "vae"):
        x, y = flat(getattr(a, name)), flat(getattr(b, name))
        assert x.keys() == y.keys()
        for key in x:
            assert x[key].dtype == y[key].dtype and x[key].shape == y[key].shape, (name, key)
            assert np.array_equal(x[key].view(np.uint8), y[key].view(np.uint8)), (name, key)


def test_round_trip_is_bit_identical(source: Path, converted: Path, tmp_path: Path) -> None:
    snapshot = Snapshot.open(converted)
    assert snapshot.converted and snapshot.pipeline_class == "Flux2KleinPipeline" and not snapshot.is_distilled
    reference = load_models(Snapshot.open(source), dtype=jnp.bfloat16)
    assert_identical(load_models(snapshot, dtype=jnp.bfloat16), reference)
    # The VAE's latent statistics stay float32 in a bf16 checkpoint, as when loading safetensors.
    assert load_models(snapshot, dtype=jnp.bfloat16).vae.bn.running_mean[...].dtype == jnp.float32

    fp32 = tmp_path / "fp32"
    convert(source, fp32, dtype="fp32")
    assert_identical(load_models(Snapshot.open(fp32), dtype=jnp.float32),
                     load_models(Snapshot.open(source), dtype=jnp.float32))
    # Stored fp32, loaded bf16: the same rounding as converting the safetensors directly.
    assert_identical(load_models(Snapshot.open(fp32), dtype=jnp.bfloat16), reference)


def test_the_directory_alone_is_a_complete_model(source: Path, converted: Path) -> None:
    manifest = json.loads((converted / CONVERTED_MANIFEST).read_text())
    assert manifest["dtype"] == "bf16" and manifest["format"] == "flux2klein-orbax"
    assert manifest["source"]["path"] == str(source) and manifest["source"]["kind"] == "local"
    files = manifest["source"]["files"]
    index = "transformer/diffusion_pytorch_model.safetensors.index.json"
    assert files[index]["bytes"] == (source / index).stat().st_size
    config = json.loads((source / "transformer" / "config.json").read_text())
    assert manifest["components"]["transformer"]["config"] == config
    assert manifest["components"]["vae"]["bytes"] > 0 and manifest["pipeline_class"] == "Flux2KleinPipeline"
    for rel in ("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "scheduler/scheduler_config.json",
                "model_index.json", "text_encoder/config.json", "text_encoder/generation_config.json"):
        assert (converted / rel).read_bytes() == (source / rel).read_bytes(), rel
    assert not list(converted.rglob("*.safetensors"))

    result = cli("fetch", str(converted), "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["kind"] == "converted"
    result = cli("inspect", str(converted), "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["components"]["transformer"]["parameters"] > 0


def test_refuses_to_overwrite_without_force(source: Path, converted: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = cli("convert", str(source), "--out", str(out))
    assert result.exit_code == 2 and "--force" in result.stderr and result.stdout == ""
    assert (out / "keep.txt").read_text() == "mine"

    result = cli("convert", str(source), "--out", str(out), "--force", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["path"] == str(out) and report["dtype"] == "bf16" and report["components"]["vae"]["parameters"] > 0
    assert not (out / "keep.txt").exists() and check_converted(out)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing left beside it

    for bad, message in ((converted, "already a converted"), (source, "outside the source")):
        result = cli("convert", str(bad), "--out", str(source / "inside") if bad == source else str(tmp_path / "x"))
        assert result.exit_code == 2 and message in result.stderr
    assert cli("convert", str(source), "--dtype", "fp16").exit_code == 2


def test_a_failure_midway_leaves_nothing(source: Path, tmp_path: Path, monkeypatch) -> None:
    real = orbax_convert.convert_component

    def fail_at_vae(name, *args, **kwargs):
        if name == "vae":
            raise OSError("disk full")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(orbax_convert, "convert_component", fail_at_vae)
    with pytest.raises(OSError, match="disk full"):
        convert(source, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_killed_convert_leaves_no_model(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", CLI, "convert", str(source), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        # Kill it as soon as the transformer's checkpoint is being written.
        while time.monotonic() < deadline and proc.poll() is None:
            if any(tmp_path.glob(".out.convert-*/transformer/orbax*")):
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "convert finished before it could be interrupted"
    assert not out.exists()
    (leftover,) = tmp_path.iterdir()
    for model in (leftover, out):
        with pytest.raises((CheckpointError, UserInputError)):
            Snapshot.open(model)
        assert cli("inspect", str(model)).exit_code == 2
    # The next convert to the same place cleans up after the dead one.
    convert(source, out)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_damaged_converted_directories_are_clear_errors(converted: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(converted, broken)
    shutil.rmtree(broken / "vae" / "orbax")
    with pytest.raises(CheckpointError, match="vae/orbax"):
        Snapshot.open(broken)
    manifest = json.loads((converted / CONVERTED_MANIFEST).read_text())
    shutil.copytree(converted / "vae", broken / "vae", dirs_exist_ok=True)
    (broken / CONVERTED_MANIFEST).write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(CheckpointError, match="format version 99"):
        Snapshot.open(broken)
    # A config that no longer matches the stored arrays: strict, like the safetensors loader.
    (broken / CONVERTED_MANIFEST).write_text(json.dumps(manifest))
    config = json.loads((broken / "transformer" / "config.json").read_text())
    (broken / "transformer" / "config.json").write_text(json.dumps({**config, "num_single_layers": 4}))
    result = cli("inspect", str(broken))
    assert result.exit_code == 2 and "single_transformer_blocks" in result.stderr


def test_sharded_convert_and_restore_on_four_devices(source: Path, tmp_path: Path) -> None:
    """Written laid out for one sharding, restored into another: each device gets its slice."""
    code = textwrap.dedent(f"""
        import numpy as np, jax, jax.numpy as jnp
        from flax import nnx
        from jax.sharding import Mesh, PartitionSpec
        from flux2klein_cli.core.mesh import MESH_AXES
        from flux2klein_cli.core.models.transformer import load_transformer
        from flux2klein_cli.core.weights.orbax_convert import convert
        from flux2klein_cli.core.weights.orbax_store import load_component
        mesh = Mesh(np.array(jax.devices()).reshape(1, 4, 1, 1), MESH_AXES)
        def rows(path, shape):
            return PartitionSpec("fsdp") if shape and shape[0] % 4 == 0 else PartitionSpec()
        def cols(path, shape):
            return PartitionSpec(None, "fsdp") if len(shape) > 1 and shape[1] % 4 == 0 else PartitionSpec()
        convert({str(source)!r}, {str(tmp_path / "c")!r}, dtype="fp32", mesh=mesh, sharding_rule=rows)
        ours = load_component("transformer", {str(tmp_path / "c")!r}, dtype=jnp.float32, mesh=mesh,
                              sharding_rule=cols)
        ref = load_transformer({str(source / "transformer")!r}, dtype=jnp.float32)
        a, b = nnx.to_flat_state(nnx.state(ours)), dict(nnx.to_flat_state(nnx.state(ref)))
        sharded = 0
        for path, var in a:
            x = var.get_value()
            assert np.array_equal(np.asarray(x), np.asarray(b[path].get_value())), path
            if x.sharding.spec == PartitionSpec(None, "fsdp"):
                sharded += 1
                assert len({{s.data.shape for s in x.addressable_shards}}) == 1
                assert x.addressable_shards[0].data.shape[1] == x.shape[1] // 4
        assert sharded > 10, sharded
        print("ok", sharded)
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")


def test_a_converted_directory_gives_the_same_image_as_its_source(source: Path, converted: Path) -> None:
    from flux2klein_cli.core.pipeline.pipeline import KleinPipeline, Request

    def image(model_dir: Path) -> np.ndarray:
        # base model (distilled = False) with guidance: the CFG branch runs too.
        request = Request(prompts=["a red fox in snow"], negative_prompt="blur", steps=2, guidance=3.0, height=32,
                          width=48, seed=4)
        return KleinPipeline.load(model_dir, dtype=jnp.bfloat16)(request).images

    from_source, from_converted = image(source), image(converted)
    assert from_source.shape == (1, 32, 48, 3) and from_source.std() > 0.01
    np.testing.assert_array_equal(from_converted, from_source)
