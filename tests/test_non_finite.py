"""A checkpoint with one NaN weight: generate names the stage that went non-finite, exits 1 and
writes nothing; inspect counts the weight and exits 2."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.core.hub.random_checkpoint import write_random_checkpoint

NAN_BYTES = {"F32": struct.pack("<f", float("nan")), "BF16": b"\xc0\x7f", "F16": b"\x00\x7e"}


def poison(checkpoint: Path, component: str, key: str) -> None:
    """Set the first value of tensor `key` to NaN, in place, in whichever shard holds it."""
    for path in sorted((checkpoint / component).glob("*.safetensors")):
        data = bytearray(path.read_bytes())
        (size,) = struct.unpack("<Q", data[:8])
        entry = json.loads(data[8 : 8 + size]).get(key)
        if entry is None:
            continue
        start = 8 + size + entry["data_offsets"][0]
        nan = NAN_BYTES[entry["dtype"]]
        data[start : start + len(nan)] = nan
        path.write_bytes(bytes(data))
        return
    raise KeyError(key)


@pytest.fixture(scope="module")
def clean_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


def poisoned(clean: Path, tmp_path: Path, component: str, key: str) -> Path:
    import shutil

    copy = Path(shutil.copytree(clean, tmp_path / "poisoned"))
    poison(copy, component, key)
    return copy


CASES = {
    "text encoder": ("text_encoder", "model.layers.0.input_layernorm.weight", "the text encoder"),
    "transformer": ("transformer", "proj_out.weight", "the denoising loop"),
    "vae": ("vae", "decoder.conv_out.weight", "the VAE decode"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_nan_weight_is_exit_1_naming_the_stage_and_writes_no_png(clean_checkpoint: Path, tmp_path: Path,
                                                                  case: str) -> None:
    component, key, stage = CASES[case]
    model = poisoned(clean_checkpoint, tmp_path, component, key)
    out = tmp_path / "out.png"
    result = CliRunner().invoke(app, ["generate", "a red fox", "--model", str(model), "-o", str(out), "--height", "32",
                                      "--width", "32", "--steps", "2", "--dtype", "fp32", "-n", "2"])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and stage in lines[0] and "non-finite" in lines[0], result.stderr
    assert "Traceback" not in result.output and "RuntimeWarning" not in result.output
    assert list(tmp_path.glob("*.png")) == []


def test_inspect_counts_non_finite_weights(clean_checkpoint: Path, tmp_path: Path) -> None:
    clean = CliRunner().invoke(app, ["inspect", str(clean_checkpoint), "--json"])
    assert clean.exit_code == 0, clean.output
    assert all(c["non_finite"] == 0 for c in json.loads(clean.stdout)["components"].values())

    model = poisoned(clean_checkpoint, tmp_path, "transformer", "proj_out.weight")
    result = CliRunner().invoke(app, ["inspect", str(model), "--json"])
    assert result.exit_code == 2
    counts = {name: c["non_finite"] for name, c in json.loads(result.stdout)["components"].items()}
    assert counts == {"transformer": 1, "text_encoder": 0, "vae": 0}
    assert "transformer.proj_out.kernel (1)" in result.stderr
