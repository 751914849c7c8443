"""GGUF transformers (`--transformer FILE.gguf`): every tensor as the gguf package dequantizes it, Q8_0
held as int8 with its block scales, images equal to diffusers' GGUF path, and bad files as exit 2."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flux2klein_cli.core.hub.random_checkpoint import preset, write_random_checkpoint
from flux2klein_cli.core.weights.checkpoints import open_weights
from flux2klein_cli.core.weights.quantized_file import SCALES, VALUES
from tests.fixtures.bfl import to_bfl
from tests.fixtures.quantized_files import write_gguf

KINDS = ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "BF16")
_TINY = preset("tiny")
# The tiny geometry with a 256-wide transformer: most of its linears fit the K-quants' 256-value blocks
# (the others fall back as llama.cpp's converters do), so a Q4_K file is mostly Q4_K.
WIDE = replace(_TINY, name="tiny-wide", transformer=dict(_TINY.transformer, attention_head_dim=128,
                                                          axes_dims_rope=[32, 32, 32, 32]))


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny")


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "wide", WIDE)


@pytest.fixture(scope="module")
def wide_files(wide: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    return {kind: write_gguf(wide, folder / f"klein-wide-{kind}.gguf", kind) for kind in KINDS}


def cli(*args: object):
    from typer.testing import CliRunner

    from flux2klein_cli.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_every_tensor_dequantizes_as_the_gguf_package_does(wide_files: dict[str, Path]) -> None:
    import gguf

    for kind, file in wide_files.items():
        checkpoint = open_weights(file)
        assert checkpoint.kinds().get(kind, 0) >= 10, checkpoint.kinds()  # the file really is mostly `kind`
        ours = {key: np.asarray(checkpoint.view(key), np.float32) for key in checkpoint.keys() if "#" not in key}
        as_stored = to_bfl(ours, prefix="")  # back to BFL's tensors: fused qkv, swapped norm_out halves
        reader = gguf.GGUFReader(file)
        assert set(as_stored) == {t.name for t in reader.tensors}
        for tensor in reader.tensors:
            expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape)))
            assert np.array_equal(as_stored[tensor.name], expected), (kind, tensor.name)
        kept = [key for key in ours if checkpoint.form(key)]  # the Q8_0 tensors (a K-quant file's fallbacks too)
        assert {checkpoint.tensors[key].stored.kind for key in ours if key in kept} <= {"Q8_0"}
        assert len(kept) >= (20 if kind == "Q8_0" else 0)
        for key in kept:  # Q8_0's int8 values x their float16 block scales are the dequantized tensor
            values, scales = checkpoint.view(key + VALUES), checkpoint.view(key + SCALES)
            assert values.dtype == np.int8 and scales.dtype == np.float16
            product = values.reshape(values.shape[0], -1, 32).astype(np.float32) * scales[..., None].astype(np.float32)
            assert np.array_equal(product.reshape(values.shape), ours[key]), key


def test_inspect_reports_q8_0_held_as_int8(tiny: Path, tmp_path: Path) -> None:
    file = write_gguf(tiny, tmp_path / "klein-tiny-Q8_0.gguf", "Q8_0")
    quantized = cli("inspect", tiny, "--transformer", file, "--dtype", "fp32", "--json")
    assert quantized.exit_code == 0, quantized.stderr
    plain = json.loads(cli("inspect", tiny, "--dtype", "fp32", "--json").stdout)["components"]["transformer"]
    held = json.loads(quantized.stdout)["components"]["transformer"]
    assert held["parameters"] > plain["parameters"]  # values, plus a scale per 32 of them
    assert held["bytes"] < 0.5 * plain["bytes"]  # one byte and 1/16 of a scale per weight of the blocks
    assert held["weights"]["format"] == "gguf" and held["weights"]["kept"] == {"q8_0": 13}


def test_bad_gguf_files_are_exit_2_in_one_line(tiny: Path, wide_files: dict[str, Path], tmp_path: Path) -> None:
    import gguf

    good = write_gguf(tiny, tmp_path / "good.gguf", "Q8_0")
    truncated, magic, other_type = tmp_path / "truncated.gguf", tmp_path / "magic.gguf", tmp_path / "tq1.gguf"
    truncated.write_bytes(good.read_bytes()[:-1000])
    magic.write_bytes(b"GGUX" + good.read_bytes()[4:])
    writer = gguf.GGUFWriter(str(other_type), "flux")
    data = gguf.quants.quantize(np.ones((4, 256), np.float32), gguf.GGMLQuantizationType.TQ1_0)
    writer.add_tensor("img_in.weight", data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.TQ1_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cases = {truncated: "truncated", magic: "not a GGUF file",
             other_type: "TQ1_0, a GGUF type flux2klein does not read",
             wide_files["Q8_0"]: "checkpoint does not match the model config"}  # another geometry's file
    for file, message in cases.items():
        out = tmp_path / f"{file.stem}.png"
        result = cli("generate", "a fox", "--model", tiny, "--transformer", file, "--height", 32, "--width", 32,
                     "--steps", 1, "--no-save", "-o", out)
        assert result.exit_code == 2, (file, result.stderr)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
        assert len(errors) == 1 and message in errors[0] and str(file.name) in errors[0], result.stderr
        assert "Traceback" not in result.stderr and not out.exists()


# ----------------------------------------------------------------------------- images


def generate(model: Path, transformer: Path | None, noise: Path, out: Path, size: int = 32, steps: int = 2
             ) -> np.ndarray:
    extra = ("--transformer", transformer) if transformer else ()
    result = cli("generate", "a red fox in snow", "--model", model, *extra, "--latents", noise, "--height", size,
                 "--width", size, "--steps", steps, "--dtype", "fp32", "--no-save", "-o", out)
    assert result.exit_code == 0, result.stderr
    return np.asarray(Image.open(out).convert("RGB"))


def diffusers_image(model: Path, gguf_file: Path, noise: np.ndarray, size: int = 32, steps: int = 2) -> np.ndarray:
    """diffusers' own GGUF path: from_single_file with GGUFQuantizationConfig, float32 compute."""
    import torch
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel, GGUFQuantizationConfig

    from flux2klein_cli.core.pipeline.pixels import postprocess

    transformer = Flux2Transformer2DModel.from_single_file(
        str(gguf_file), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32), config=str(model),
        subfolder="transformer", torch_dtype=torch.float32, local_files_only=True)
    pipeline = Flux2KleinPipeline.from_pretrained(model, transformer=transformer, torch_dtype=torch.float32)
    images = pipeline(prompt=["a red fox in snow"], height=size, width=size, num_inference_steps=steps,
                      latents=torch.from_numpy(noise), guidance_scale=1.0, output_type="np").images
    return postprocess(images * 2 - 1)[0]


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    from skimage.metrics import structural_similarity

    return float(structural_similarity(a, b, channel_axis=-1, data_range=255, win_size=7))


def noise_file(folder: Path, size: int = 32) -> tuple[Path, np.ndarray]:
    noise = np.random.default_rng(7).standard_normal((1, 128, size // 16, size // 16)).astype(np.float32)
    np.save(folder / "noise.npy", noise)
    return folder / "noise.npy", noise


@pytest.mark.slow
def test_images_equal_diffusers_gguf_path_for_every_type(wide: Path, wide_files: dict[str, Path],
                                                          tmp_path: Path) -> None:
    path, noise = noise_file(tmp_path)
    for kind, file in wide_files.items():
        ours = generate(wide, file, path, tmp_path / f"{kind}.png")
        theirs = diffusers_image(wide, file, noise)
        assert theirs.std() > 10, kind  # not a blank image
        assert ssim(ours, theirs) >= 0.999, (kind, ssim(ours, theirs))


@pytest.mark.slow
def test_q8_0_image_is_close_to_the_unquantized_one(tiny: Path, tmp_path: Path) -> None:
    path, _ = noise_file(tmp_path)
    file = write_gguf(tiny, tmp_path / "klein-tiny-Q8_0.gguf", "Q8_0")
    plain = generate(tiny, None, path, tmp_path / "plain.png")
    quantized = generate(tiny, file, path, tmp_path / "q8.png")
    assert not np.array_equal(plain, quantized)  # the rounding is there, and small
    assert ssim(plain, quantized) >= 0.99


def test_convert_writes_q8_0_as_stored_and_loads_it_mapped(tiny: Path, tmp_path: Path) -> None:
    import jax.numpy as jnp
    from flax import nnx

    from flux2klein_cli.core.hub.components import compose, resolve_overrides
    from flux2klein_cli.core.models.transformer import load_transformer
    from flux2klein_cli.core.weights.converted import load_component

    file = write_gguf(tiny, tmp_path / "klein-tiny-Q8_0.gguf", "Q8_0")
    out = tmp_path / "converted"
    result = cli("convert", tiny, "--transformer", file, "--dtype", "fp32", "--out", out, "--json")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((out / "flux2klein-manifest.json").read_text())["components"]["transformer"]
    assert manifest["source_format"] == "gguf" and set(manifest["prequantized"].values()) == {"q8_0"}
    direct = load_transformer(compose(tiny, resolve_overrides(transformer=str(file))) / "transformer",
                              dtype=jnp.float32)
    mapped = load_component("transformer", out, dtype=jnp.float32)
    a, b = (dict(nnx.to_flat_state(nnx.state(m))) for m in (direct, mapped))
    assert a.keys() == b.keys()
    for path in a:
        x, y = np.asarray(a[path].get_value()), np.asarray(b[path].get_value())
        assert x.dtype == y.dtype and np.array_equal(x, y), path
    assert {np.asarray(v.get_value()).dtype.name for v in b.values()} >= {"int8", "float16"}


def test_a_lora_on_q8_0_linears_is_merged_then_rounded_again(tiny: Path, tmp_path: Path) -> None:
    import jax.numpy as jnp
    from flax import nnx

    from flux2klein_cli.core.hub.components import compose, resolve_overrides
    from flux2klein_cli.core.lora.files import LoraSpec
    from flux2klein_cli.core.lora.merge import LoraDeltas
    from flux2klein_cli.core.lora.random_lora import write_random_lora
    from flux2klein_cli.core.models.transformer import load_transformer

    file = write_gguf(tiny, tmp_path / "klein-tiny-Q8_0.gguf", "Q8_0")
    lora = write_random_lora(tmp_path / "lora.safetensors", tiny / "transformer", rank=4, std=0.05)
    deltas = LoraDeltas.read([LoraSpec.parse(str(lora))])
    folder = compose(tiny, resolve_overrides(transformer=str(file))) / "transformer"
    plain = dict(nnx.to_flat_state(nnx.state(load_transformer(tiny / "transformer", dtype=jnp.float32,
                                                                deltas=deltas))))
    bare = dict(nnx.to_flat_state(nnx.state(load_transformer(folder, dtype=jnp.float32))))
    merged = dict(nnx.to_flat_state(nnx.state(load_transformer(folder, dtype=jnp.float32, deltas=deltas))))
    path = ("transformer_blocks", "attn", "to_q")
    kernel, scale = (np.asarray(merged[(*path, leaf)].get_value()) for leaf in ("kernel", "scale"))
    assert kernel.dtype == np.int8 and scale.dtype == np.float16  # still held as Q8_0
    assert not np.array_equal(kernel, np.asarray(bare[(*path, "kernel")].get_value()))  # the LoRA is in
    layers, rows, out = kernel.shape
    weight = (kernel.reshape(layers, -1, 32, out) * scale[:, :, None, :].astype(np.float32)).reshape(kernel.shape)
    expected = np.asarray(plain[(*path, "kernel")].get_value())  # float weights + LoRA, unrounded
    # Two roundings at most: the file's and the merged weight's, each within half a block scale.
    assert np.abs(weight - expected).max() <= float(np.abs(scale).max())
