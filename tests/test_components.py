"""`--transformer` / `--vae`: component folders, single files in diffusers keys and in BFL's layout."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image
from safetensors.numpy import load_file, save_file

from flux2klein_cli.core.errors import CheckpointError, UserInputError
from flux2klein_cli.core.hub.components import compose, composed_sources, resolve_overrides
from flux2klein_cli.core.hub.layout import Snapshot
from flux2klein_cli.core.hub.random_checkpoint import preset, with_small_decoder, write_random_checkpoint
from flux2klein_cli.core.models.transformer import load_transformer
from flux2klein_cli.core.weights.safetensors_io import SafetensorsCheckpoint
from tests.fixtures.bfl import write_bfl_transformer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny")


@pytest.fixture(scope="module")
def bfl_file(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bfl_transformer(tiny, tmp_path_factory.mktemp("bfl") / "flux-2-klein-tiny.safetensors")


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path / "cache"))


def flat(module: nnx.Module) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module))}


def assert_same_parameters(a: nnx.Module, b: nnx.Module) -> None:
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for key in fa:
        assert fa[key].dtype == fb[key].dtype and np.array_equal(fa[key], fb[key]), key


def test_bfl_file_reads_as_diffusers_keys_by_byte_ranges(tiny: Path, bfl_file: Path) -> None:
    ours = SafetensorsCheckpoint.open(bfl_file)
    theirs = SafetensorsCheckpoint.open(tiny / "transformer")
    assert ours.layout == "bfl" and theirs.layout == "diffusers"
    assert ours.keys() == theirs.keys()
    for key in theirs.keys():
        assert np.array_equal(ours.view(key), theirs.view(key)), key
    # q, k and v are views into the fused tensor's bytes, not copies.
    q = ours.view("transformer_blocks.0.attn.to_q.weight")
    assert not q.flags.owndata and "rows 0:" in ours.describe("transformer_blocks.0.attn.to_q.weight")


@pytest.mark.parametrize("form", ["bfl-file", "diffusers-file", "folder"])
def test_transformer_override_loads_bit_identical_parameters(tiny: Path, bfl_file: Path, tmp_path: Path,
                                                             form: str) -> None:
    if form == "bfl-file":
        given = bfl_file
    elif form == "diffusers-file":
        tensors: dict[str, np.ndarray] = {}
        for path in (tiny / "transformer").glob("*.safetensors"):
            tensors.update(load_file(path))
        given = tmp_path / "transformer.safetensors"
        save_file(tensors, given)
    else:
        given = tiny / "transformer"
    composed = compose(tiny, resolve_overrides(transformer=str(given)))
    assert composed != tiny and Snapshot.open(composed).component("vae").resolve() == (tiny / "vae").resolve()
    assert composed_sources(composed)["transformer"]["source"] == str(given)
    assert compose(tiny, resolve_overrides(transformer=str(given))) == composed  # the same sources, the same dir
    got = load_transformer(composed / "transformer", dtype=jnp.float32)
    assert_same_parameters(got, load_transformer(tiny / "transformer", dtype=jnp.float32))


def test_shapes_that_disagree_with_the_model_config_name_the_key(tiny: Path, bfl_file: Path, tmp_path: Path) -> None:
    other = write_random_checkpoint(tmp_path / "medium", "medium", components=("transformer",))
    wrong = write_bfl_transformer(other, tmp_path / "medium.safetensors")
    composed = compose(tiny, resolve_overrides(transformer=str(wrong)))
    message = r"medium.safetensors: checkpoint does not match the model config; unexpected keys: single_transformer_"
    with pytest.raises(CheckpointError, match=message):
        load_transformer(composed / "transformer", dtype=jnp.float32)


def test_vae_override_with_a_small_decoder_folder(tiny: Path, tmp_path: Path) -> None:
    small = write_random_checkpoint(tmp_path / "small", with_small_decoder(preset("tiny")), components=("vae",))
    composed = compose(tiny, resolve_overrides(vae=str(small / "vae")))
    config = json.loads((composed / "vae" / "config.json").read_text())
    assert config["decoder_block_out_channels"] == [32, 32, 32, 64]
    assert (composed / "transformer").resolve() == (tiny / "transformer").resolve()


def test_bad_overrides_are_one_line_errors(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="no such file or folder"):
        resolve_overrides(transformer=str(tmp_path / "missing.safetensors"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UserInputError, match="expected a .safetensors or .gguf file"):
        resolve_overrides(vae=str(tmp_path / "notes.txt"))
    with pytest.raises(UserInputError, match="is a vae, not a transformer"):
        resolve_overrides(transformer="small-decoder")


# ----------------------------------------------------------------------------- through the CLI


def cli(*args: object):
    from typer.testing import CliRunner

    from flux2klein_cli.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.slow
def test_generate_with_overrides_names_them_and_draws_the_folder_image(tiny: Path, bfl_file: Path,
                                                                         tmp_path: Path) -> None:
    from PIL import Image

    from flux2klein_cli.core.runs.image_files import read_run_metadata

    small = write_random_checkpoint(tmp_path / "small", with_small_decoder(preset("tiny")), components=("vae",))
    common = ("--height", 32, "--width", 32, "--steps", 2, "--dtype", "fp32", "--no-save")
    plain = cli("generate", "a fox", "--model", tiny, "-o", tmp_path / "plain.png", *common)
    assert plain.exit_code == 0, plain.stderr
    bfl = cli("generate", "a fox", "--model", tiny, "--transformer", bfl_file, "-o", tmp_path / "bfl.png", *common,
              "--json")
    assert bfl.exit_code == 0, bfl.stderr
    assert json.loads(bfl.stdout)["transformer"] == str(bfl_file)
    assert read_run_metadata(tmp_path / "bfl.png")["transformer"] == str(bfl_file)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "bfl.png")), np.asarray(Image.open(tmp_path / "plain.png")))
    vae = cli("generate", "a fox", "--model", tiny, "--vae", small / "vae", "-o", tmp_path / "vae.png", *common)
    assert vae.exit_code == 0, vae.stderr
    assert read_run_metadata(tmp_path / "vae.png")["vae"] == str(small / "vae")


def test_inspect_and_convert_the_overridden_model(tiny: Path, bfl_file: Path, tmp_path: Path) -> None:
    small = write_random_checkpoint(tmp_path / "small", with_small_decoder(preset("tiny")), components=("vae",))
    report = cli("inspect", tiny, "--transformer", bfl_file, "--vae", small / "vae", "--json")
    assert report.exit_code == 0, report.stderr
    data = json.loads(report.stdout)
    assert data["sources"]["transformer"]["source"] == str(bfl_file) and data["sources"]["vae"]["kind"] == "folder"
    plain = json.loads(cli("inspect", tiny, "--json").stdout)
    assert data["components"]["vae"]["parameters"] < plain["components"]["vae"]["parameters"]
    out = tmp_path / "converted"
    converted = cli("convert", tiny, "--transformer", bfl_file, "--vae", small / "vae", "--out", out, "--json")
    assert converted.exit_code == 0, converted.stderr
    again = json.loads(cli("inspect", out, "--json").stdout)
    assert again["components"] == {**data["components"], **{n: {**data["components"][n], "load_seconds":
                                   again["components"][n]["load_seconds"]} for n in data["components"]}}
    manifest = json.loads((out / "flux2klein-manifest.json").read_text())
    assert manifest["source"]["components"]["transformer"]["source"] == str(bfl_file)


def test_mismatched_file_is_exit_2_with_one_line(tiny: Path, tmp_path: Path) -> None:
    other = write_random_checkpoint(tmp_path / "medium", "medium", components=("transformer",))
    wrong = write_bfl_transformer(other, tmp_path / "medium.safetensors")
    result = cli("inspect", tiny, "--transformer", wrong)
    assert result.exit_code == 2 and "medium.safetensors: checkpoint does not match" in result.stderr
    assert "Traceback" not in result.stderr
    missing = cli("inspect", tiny, "--vae", "small-decoder")  # not cached, and the test never downloads
    assert missing.exit_code == 2 and "flux2klein fetch small-decoder" in missing.stderr


@pytest.mark.slow
def test_bfl_file_equals_diffusers_from_single_file_and_the_folder(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Our read of a BFL single file against diffusers' own `from_single_file`: bit-identical
    parameters; and the image through --transformer equals the folder's."""
    import torch
    from diffusers import Flux2Transformer2DModel
    from PIL import Image

    # No key prefix: diffusers' converter (0.42) reads the reference repo's names, not ComfyUI's prefixed ones.
    bfl = write_bfl_transformer(tiny_checkpoint, tmp_path / "klein-tiny-bfl.safetensors", prefix="")
    theirs = Flux2Transformer2DModel.from_single_file(str(bfl), config=str(tiny_checkpoint), subfolder="transformer",
                                                      torch_dtype=torch.float32, local_files_only=True)
    composed = compose(tiny_checkpoint, resolve_overrides(transformer=str(bfl)))
    ours = load_transformer(composed / "transformer", dtype=jnp.float32)
    folder = load_transformer(tiny_checkpoint / "transformer", dtype=jnp.float32)
    assert_same_parameters(ours, folder)
    state = {k: v.numpy() for k, v in theirs.state_dict().items()}
    from flux2klein_cli.core.models.transformer import transformer_key_plan

    plan = transformer_key_plan(ours)
    for path, variable in nnx.to_flat_state(nnx.state(ours)):
        source, value = plan.sources[path], np.asarray(variable.get_value())
        for i, key in enumerate(source.keys):
            got = value[i] if source.stacked else value
            assert np.array_equal(got.T if source.layout == "linear" else got, state.pop(key)), key
    assert not state  # every diffusers parameter compared

    common = ("--height", 32, "--width", 48, "--steps", 2, "--dtype", "fp32", "--no-save")
    for name, extra in (("folder", ()), ("bfl", ("--transformer", bfl))):
        result = cli("generate", "a red fox", "--model", tiny_checkpoint, "-o", tmp_path / f"{name}.png", *extra,
                     *common)
        assert result.exit_code == 0, result.stderr
    assert np.array_equal(np.asarray(Image.open(tmp_path / "bfl.png")), np.asarray(Image.open(tmp_path / "folder.png")))


@pytest.mark.slow
def test_parity_with_a_bfl_transformer_file_reads_it_through_from_single_file(tiny_checkpoint: Path,
                                                                              tmp_path: Path) -> None:
    """`parity --transformer FILE` in BFL keys (ComfyUI's prefix): diffusers' side reads the file with
    `from_single_file` (from_pretrained cannot), and both images agree."""
    from flux2klein_cli.core.runs.parity import bfl_transformer_file

    bfl = write_bfl_transformer(tiny_checkpoint, tmp_path / "klein-tiny-comfy.safetensors")
    assert bfl_transformer_file(tiny_checkpoint) is None  # a diffusers folder goes through from_pretrained
    assert bfl_transformer_file(compose(tiny_checkpoint, resolve_overrides(transformer=str(bfl)))) == bfl.resolve()
    result = cli("parity", "--model", tiny_checkpoint, "--transformer", bfl, "--height", 32, "--width", 32,
                 "--steps", 2, "--out-dir", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ssim"] >= 0.999 and report["max_diff"] <= 2, report
    # Its PNGs carry generate's record: `--from` reruns ours, the transformer file included.
    again = cli("generate", "--from", tmp_path / "out" / "ours.png", "-o", tmp_path / "again.png")
    assert again.exit_code == 0, again.stderr
    ours, rerun = (np.asarray(Image.open(p)) for p in (tmp_path / "out" / "ours.png", tmp_path / "again.png"))
    assert np.array_equal(ours, rerun)
