"""BFL's ComfyUI-format fp8 and nvfp4 transformer files (`--transformer FILE.safetensors`): every tensor by
its format's formula (nvfp4's block scales tiled or plain), fp8 held as e4m3 values, the same image as
the weights they stand for, and damaged files as exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from flux2klein_cli.core.hub.random_checkpoint import write_random_checkpoint
from flux2klein_cli.core.weights.checkpoints import open_weights
from flux2klein_cli.core.weights.comfy_quant import tiled_shape
from tests.fixtures.bfl import _save, to_bfl
from tests.fixtures.quantized_files import dequantize_nvfp4, transformer_tensors, write_comfy

FP8, NVFP4 = "float8_e4m3fn", "nvfp4"


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny")


def cli(*args: object):
    from typer.testing import CliRunner

    from flux2klein_cli.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def formula(fmt: str, record: dict) -> np.ndarray:
    """What a quantized weight stands for, from what the fixture stored."""
    if fmt == FP8:
        return record["values"].astype(np.float32) * record["scale"]
    return dequantize_nvfp4(record["packed"], record["plain_scales"], record["scale"])


@pytest.mark.parametrize("fmt, tiled", [(FP8, True), (NVFP4, True), (NVFP4, False)],
                         ids=["fp8", "nvfp4-tiled", "nvfp4-plain"])
def test_every_tensor_by_its_formula(tiny: Path, tmp_path: Path, fmt: str, tiled: bool) -> None:
    file, records = write_comfy(tiny, tmp_path / "klein.safetensors", fmt, tiled=tiled)
    checkpoint = open_weights(file)
    assert checkpoint.file_format == "comfy"
    ours = to_bfl({key: np.asarray(checkpoint.view(key), np.float32) for key in checkpoint.keys() if "#" not in key},
                  prefix="")
    source = transformer_tensors(tiny)
    assert set(ours) == set(source)
    checked = 0
    for name, value in ours.items():
        if name not in records:  # kept in bf16 (img_in) or a norm
            assert np.array_equal(value, source[name].astype(ml_dtypes.bfloat16).astype(np.float32)), name
            continue
        rows, blocks = records[name]["plain_scales"].shape if fmt == NVFP4 else (0, 0)
        if fmt == NVFP4 and not tiled and tiled_shape(rows, blocks) == (rows, blocks):
            continue  # a plain layout of a whole number of tiles reads as tiled, as ComfyUI writes them
        np.testing.assert_allclose(value, formula(fmt, records[name]), rtol=1e-6, atol=0, err_msg=name)
        checked += 1
    assert checked >= 10
    if fmt == FP8:  # held as stored: e4m3 values, one float32 scale per output channel
        key = "transformer_blocks.0.attn.to_q.weight"
        assert checkpoint.form(key) == "fp8" and checkpoint.view(key + "#values").dtype == ml_dtypes.float8_e4m3fn


def generate(model: Path, transformer: Path, out: Path) -> np.ndarray:
    result = cli("generate", "a red fox in snow", "--model", model, "--transformer", transformer, "--height", 32,
                 "--width", 32, "--steps", 2, "--seed", 3, "--dtype", "fp32", "--no-save", "-o", out)
    assert result.exit_code == 0, result.stderr
    return np.asarray(Image.open(out).convert("RGB"))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [FP8, NVFP4])
def test_image_equals_the_dequantized_weights_image(tiny: Path, tmp_path: Path, fmt: str) -> None:
    """The quantized file against a plain BFL file of the weights it stands for (computed here by the
    formula): fp8 runs with e4m3 kernels, nvfp4 is dequantized at load; both must draw that image."""
    from skimage.metrics import structural_similarity

    file, records = write_comfy(tiny, tmp_path / f"klein-{fmt}.safetensors", fmt)
    plain = transformer_tensors(tiny)
    plain.update({name: formula(fmt, record) for name, record in records.items()})
    plain.update({name: plain[name].astype(ml_dtypes.bfloat16).astype(np.float32) for name in plain
                  if name not in records})  # what the file keeps in bf16
    dequantized = tmp_path / "dequantized.safetensors"
    _save({key: value.astype(np.float32) for key, value in plain.items()}, dequantized)
    ours = generate(tiny, file, tmp_path / "quantized.png")
    reference = generate(tiny, dequantized, tmp_path / "reference.png")
    assert reference.std() > 10
    score = structural_similarity(ours, reference, channel_axis=-1, data_range=255, win_size=7)
    assert score >= 0.999, score
    if fmt == FP8:
        report = json.loads(cli("inspect", tiny, "--transformer", file, "--dtype", "fp32", "--json").stdout)
        assert report["components"]["transformer"]["weights"]["kept"] == {"fp8": 13}


def test_damaged_files_are_exit_2_in_one_line(tiny: Path, tmp_path: Path) -> None:
    good, _ = write_comfy(tiny, tmp_path / "good.safetensors", FP8)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-4096])
    bad_json, _ = write_comfy(tiny, tmp_path / "bad-json.safetensors", FP8, marker=b'{"format": nvfp4')
    other, _ = write_comfy(tiny, tmp_path / "int8.safetensors", FP8, marker=b'{"format": "int8_blockwise"}')
    cases = {truncated: "truncated", bad_json: "does not hold the JSON of a ComfyUI quantization",
             other: "int8_blockwise, a ComfyUI format flux2klein does not read"}
    for file, message in cases.items():
        out = tmp_path / f"{file.stem}.png"
        result = cli("generate", "a fox", "--model", tiny, "--transformer", file, "--height", 32, "--width", 32,
                     "--steps", 1, "--no-save", "-o", out)
        assert result.exit_code == 2, (file, result.stderr)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
        assert len(errors) == 1 and message in errors[0] and file.name in errors[0], result.stderr
        assert "Traceback" not in result.stderr and not out.exists()
