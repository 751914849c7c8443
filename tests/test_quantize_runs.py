"""An int8 model (`convert --quantize int8`) in the rest of the tool (issue 21, part 5): the KV
edit, meshes (scales sharded with their kernels), LoRA (merged before quantizing, refused at run
time) and the executable store (the scheme is in the key). Base tier: the project's own random
checkpoints, no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flux2klein_cli.core.hub.random_checkpoint import write_random_checkpoint
from flux2klein_cli.core.runs.parity import compare
from flux2klein_cli.core.weights.convert import convert
from tests.test_generate_cli import image_file, run
from tests.test_mesh import ROOT, env_with_devices
from tests.test_quantize import MIN_SSIM

QUANTIZED_MESHES = ["fsdp=2", "data=2,fsdp=2", "tensor=2,fsdp=2"]


@pytest.fixture(scope="module")
def kv_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny KV snapshot and its int8 conversion (everything else float32: the error is the
    quantization's alone)."""
    root = tmp_path_factory.mktemp("kv")
    source = write_random_checkpoint(root / "snapshot", "tiny", seed=11, kv=True)
    convert(source, root / "int8", dtype="fp32", quantize="int8")
    return source, root / "int8"


@pytest.fixture(scope="module")
def plain_int8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("plain")
    source = write_random_checkpoint(root / "snapshot", "tiny", seed=12)
    convert(source, root / "int8", dtype="fp32", quantize="int8")
    return source, root / "int8"


def kv_edit(model: Path, out: Path, refs: list[Path]) -> np.ndarray:
    result = run("edit", "put both on the sofa", *sum((["-i", r] for r in refs), []), "--kv", "--model", model,
                 "-o", out, "--steps", 2, "--dtype", "fp32", "--seed", 4, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["kv"] is True
    return np.asarray(Image.open(out).convert("RGB"))[None]


def test_kv_edit_on_an_int8_model_is_close_to_the_unquantized_one(kv_pair: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    refs = [image_file(tmp_path / "a.png", 96, 64), image_file(tmp_path / "b.png", 64, 80)]
    plain, quant = (kv_edit(model, tmp_path / f"{i}.png", refs) for i, model in enumerate(kv_pair))
    assert plain.std() > 10 and quant.std() > 10  # real images, not blanks
    assert not np.array_equal(plain, quant)  # the int8 weights were the ones used
    assert compare(quant, plain).ssim >= MIN_SSIM


@pytest.mark.slow
def test_int8_on_every_mesh_gives_the_single_device_images(plain_int8: tuple[Path, Path],
                                                            kv_pair: tuple[Path, Path]) -> None:
    done = subprocess.run([sys.executable, "-m", "tests.quantized_mesh_worker", str(plain_int8[1]), str(kv_pair[1]),
                           *QUANTIZED_MESHES], env=env_with_devices(4), cwd=ROOT, capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted((r["mesh"], r["request"]) for r in rows) == sorted(
        (m, r) for m in QUANTIZED_MESHES for r in ("text-to-image", "kv-edit"))
    for row in rows:
        assert row["max_diff"] <= 1 and row["std"] > 10, row
        assert min(row["quantized"]) > 0 and row["wrong"] == [], row  # both models hold int8 linears
        # to_out is row parallel: its outputs (and scales) over fsdp.
        assert row["out_scale_spec"] == ["None", "fsdp"], row
        assert row["out_scale_shards"] == 2, row


def test_convert_merges_the_lora_before_rounding(plain_int8: tuple[Path, Path], tmp_path: Path) -> None:
    """`convert --lora X --quantize int8`: the int8 kernels are the rounding of the merged
    float32 weights (the same as `convert --lora X` then quantized), not of the base ones."""
    from flux2klein_cli.core.lora.random_lora import write_random_lora
    from flux2klein_cli.core.models.quantized import quantize_weights
    from flux2klein_cli.core.weights.converted import load_component
    from flux2klein_cli.core.weights.converted_manifest import read_manifest
    from tests.test_quantize import leaves

    source, base = plain_int8
    lora = write_random_lora(tmp_path / "l.safetensors", source / "transformer", "peft", rank=2, seed=3)
    for args, out in ((["--quantize", "int8"], "merged-int8"), (["--dtype", "fp32"], "merged-fp32")):
        result = run("convert", source, "--out", tmp_path / out, "--lora", f"{lora}:0.5", *args)
        assert result.exit_code == 0, result.stderr
    assert read_manifest(tmp_path / "merged-int8")["lora"][0]["scale"] == 0.5
    merged, before = (leaves(load_component("transformer", d)) for d in (tmp_path / "merged-int8", base))
    reference = leaves(load_component("transformer", tmp_path / "merged-fp32", dtype=np.float32))
    kernels = [k for k, v in merged.items() if v.dtype == np.int8]
    assert kernels
    changed = 0
    for key in kernels:
        q, scale = quantize_weights(reference[key])
        assert np.array_equal(merged[key], q), key
        assert np.array_equal(merged[key.removesuffix("kernel") + "scale"], scale), key
        changed += not np.array_equal(merged[key], before[key])
    assert changed == len(kernels)  # the LoRA touches every block linear


def test_lora_on_an_int8_model_at_run_time_is_exit_2(plain_int8: tuple[Path, Path], tmp_path: Path) -> None:
    from flux2klein_cli.core.lora.random_lora import write_random_lora

    source, quant = plain_int8
    lora = write_random_lora(tmp_path / "l.safetensors", source / "transformer", "bfl", rank=2)
    out = tmp_path / "out"
    out.mkdir()
    result = run("generate", "a cat", "--model", quant, "--lora", lora, "-o", out / "x.png", "--height", 32,
                 "--width", 32, "--steps", 1)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "flux2klein convert --lora" in lines[0], lines
    assert list(out.iterdir()) == []


def test_bf16_and_int8_never_share_a_stored_executable(plain_int8: tuple[Path, Path]) -> None:
    """Same geometry, same run: every program that reads the transformer or the text encoder has
    its own store key per scheme; the VAE's and the noise's (never quantized) are shared."""
    from flux2klein_cli.core.compile.keys import key_of, key_parts
    from flux2klein_cli.core.compile.model_configs import configs_from_snapshot
    from flux2klein_cli.core.compile.specs import pipeline_programs
    from flux2klein_cli.core.pipeline.programs import RunShape

    keys = {}
    for name, path in zip(("plain", "int8"), plain_int8, strict=True):
        configs = configs_from_snapshot(path)
        shape = RunShape(height=64, width=64, geometry=configs.geometry, references=((64, 64),), kv=False)
        keys[name] = {spec.name: (spec.model, key_of(key_parts(spec)), spec.key_parts)
                      for spec in pipeline_programs(configs, shape)}
    assert keys["plain"].keys() == keys["int8"].keys()
    quantized = [n for n, (model, *_) in keys["int8"].items() if model in ("transformer", "text_encoder")]
    assert len(quantized) >= 2
    for name, (_, key, extra) in keys["int8"].items():
        _, plain_key, plain_extra = keys["plain"][name]
        if name in quantized:
            assert key != plain_key and extra["quantize"] == "int8" and "quantize" not in plain_extra, name
        else:
            assert key == plain_key, name
