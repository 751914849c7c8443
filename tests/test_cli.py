"""The CLI as a user calls it: version, help, inspect on good and damaged checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from flux2klein_cli import __version__
from flux2klein_cli.cli.app import app

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def test_version_and_help() -> None:
    result = run("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"flux2klein {__version__}"
    result = run("--help")
    assert result.exit_code == 0
    assert "inspect" in result.stdout and "bench" in result.stdout
    # Square brackets in help text are rich markup unless escaped: they must reach the user.
    assert "FLUX.2 [klein] image models" in result.stdout
    # Examples first, the one that needs no download among them.
    assert "Examples:" in result.stdout and 'flux2klein generate "a red fox in snow" --model tiny' in result.stdout
    assert "[tpu] extra" in " ".join(run("compile", "--help").stdout.split())
    assert "[parity] extra" in " ".join(run("parity", "--help").stdout.split())
    # Rich keeps single line breaks: each paragraph of a command's help is one line, or the
    # source's wrapping prints as ragged half-lines.
    import typer

    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    assert {"generate", "edit", "convert", "bench", "compile", "fetch"} <= set(commands)
    for name, command in commands.items():
        paragraphs = (command.help or "").split("\n\n")
        assert len(paragraphs) > 1 and not any("\n" in p for p in paragraphs), name
    assert "scheduler), so it is a complete --model" in commands["convert"].help


def test_inspect_reports_every_component(tiny_checkpoint: Path, tiny_kv_checkpoint: Path) -> None:
    import torch
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    result = run("inspect", str(tiny_checkpoint), "--json", "--dtype", "fp32")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["pipeline"] == "Flux2KleinPipeline" and report["kv"] is False
    ref_t = Flux2Transformer2DModel.from_pretrained(tiny_checkpoint / "transformer", dtype=torch.float32)
    ref_v = AutoencoderKLFlux2.from_pretrained(tiny_checkpoint / "vae", dtype=torch.float32)
    assert report["components"]["transformer"]["parameters"] == sum(p.numel() for p in ref_t.parameters())
    assert report["components"]["transformer"]["bytes"] == 4 * report["components"]["transformer"]["parameters"]
    # The VAE also holds its 2 x 128 batch-norm statistics (buffers in torch).
    assert report["components"]["vae"]["parameters"] == sum(p.numel() for p in ref_v.parameters()) + 2 * 128

    kv = json.loads(run("inspect", str(tiny_kv_checkpoint), "--json").stdout)
    assert kv["pipeline"] == "Flux2KleinKVPipeline" and kv["kv"] is True and kv["dtype"] == "bf16"
    assert kv["components"]["transformer"]["bytes"] == 2 * kv["components"]["transformer"]["parameters"]


@pytest.fixture
def damaged(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "snapshot"
    shutil.copytree(tiny_checkpoint, copy)
    return copy


def shard_of(root: Path, key: str) -> Path:
    index = json.loads((root / "transformer" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    return root / "transformer" / index["weight_map"][key]


KEY = "single_transformer_blocks.1.attn.to_qkv_mlp_proj.weight"


def rewrite(path: Path, change) -> None:
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def truncate(root: Path) -> None:
    shard = shard_of(root, KEY)
    shard.write_bytes(shard.read_bytes()[:-1000])


def drop_shard(root: Path) -> None:
    shard_of(root, KEY).unlink()


def rename_key(root: Path) -> None:
    rewrite(shard_of(root, KEY), lambda t: t.__setitem__("renamed.weight", t.pop(KEY)))
    index_path = root / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["renamed.weight"] = index["weight_map"].pop(KEY)
    index_path.write_text(json.dumps(index))


def wrong_shape(root: Path) -> None:
    rewrite(shard_of(root, KEY), lambda t: t.__setitem__(KEY, t[KEY][:-1]))


def drop_config(root: Path) -> None:
    (root / "transformer" / "config.json").unlink()


@pytest.mark.parametrize(
    "damage, expected",
    [
        (truncate, ["truncated safetensors file"]),
        (drop_shard, ["missing", "diffusion_pytorch_model-0000"]),
        (rename_key, [f"missing keys: {KEY}", "unexpected keys: renamed.weight"]),
        (wrong_shape, [f"wrongly shaped keys: {KEY}", "model expects"]),
        (drop_config, ["config.json: missing"]),
    ],
    ids=["truncated", "missing-shard", "renamed-key", "wrong-shape", "missing-config"],
)
def test_damaged_checkpoint_is_exit_2_with_one_clear_line(damaged: Path, damage, expected: list[str]) -> None:
    damage(damaged)
    result = run("inspect", str(damaged), "--json")
    assert result.exit_code == 2
    assert result.stdout == ""  # nothing half-written for scripts to read
    message = " ".join(result.stderr.split())  # rich may wrap a long line on a narrow terminal
    assert message.startswith("error:") and "Traceback" not in result.stderr
    for fragment in expected:
        assert fragment in message


def test_bad_usage_is_exit_2(tiny_checkpoint: Path, tmp_path: Path) -> None:
    assert run("inspect", str(tmp_path / "nope")).exit_code == 2
    assert run("inspect", str(tiny_checkpoint), "--dtype", "fp8").exit_code == 2
    assert run("bench", "--model", "7b").exit_code == 2
    assert run("bench", "--height", "100").exit_code == 2
