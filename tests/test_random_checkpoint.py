"""The random-weight checkpoint writer: written without torch, read by diffusers and transformers
as the real layout (no missing or unexpected keys), and by our loaders with the right layouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from flux2klein_cli.core.hub.checkpoint import load_models
from flux2klein_cli.core.hub.layout import Snapshot
from flux2klein_cli.core.hub.random_checkpoint import (
    PRESETS,
    SCHEDULER_CONFIG,
    _shards,
    text_encoder_config_json,
    text_encoder_specs,
    transformer_config_json,
    transformer_specs,
    vae_config_json,
    vae_specs,
    write_random_checkpoint,
)
from flux2klein_cli.core.hub.snapshot import TINY_DIR_NAME, snapshot_problems


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` alias, written in a process where importing torch is impossible."""
    cache = tmp_path_factory.mktemp("flux2klein-cache")
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        "from flux2klein_cli.core.hub.snapshot import resolve_model\n"
        "print(resolve_model('tiny'))\n"
        "assert sys.modules['torch'] is None\n"
    )
    env = dict(os.environ, FLUX2KLEIN_CACHE=str(cache))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path == cache / TINY_DIR_NAME
    return path


def _weights(folder: Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def test_layout_is_the_hubs(tiny: Path) -> None:
    assert not snapshot_problems(tiny)
    assert json.loads((tiny / "model_index.json").read_text())["_class_name"] == "Flux2KleinPipeline"
    # Large components are sharded with an index, as on the hub; the VAE is one file.
    for folder, stem in (("transformer", "diffusion_pytorch_model"), ("text_encoder", "model")):
        index = json.loads((tiny / folder / f"{stem}.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and shards[0] == f"{stem}-00001-of-{len(shards):05d}.safetensors"
        assert index["metadata"]["total_size"] == sum(v.nbytes for v in _weights(tiny / folder).values())
    assert [p.name for p in (tiny / "vae").glob("*.safetensors")] == ["diffusion_pytorch_model.safetensors"]


def test_diffusers_and_transformers_load_it_completely(tiny: Path) -> None:
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen3ForCausalLM

    for cls, folder in ((Flux2Transformer2DModel, "transformer"), (AutoencoderKLFlux2, "vae"),
                        (Qwen3ForCausalLM, "text_encoder")):
        model, info = cls.from_pretrained(tiny / folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (folder, info)
        stored = _weights(tiny / folder)
        state = model.state_dict()
        for key in list(stored)[:5]:
            assert np.array_equal(state[key].numpy(), stored[key]), key

    pipe = Flux2KleinPipeline.from_pretrained(tiny)
    assert pipe.config.is_distilled and pipe.tokenizer.pad_token == "<|endoftext|>"
    assert pipe.scheduler.config.use_dynamic_shifting and pipe.scheduler.config.time_shift_type == "exponential"


def test_configs_are_what_the_libraries_write(tmp_path: Path) -> None:
    """Round trip each config through its library: what it writes back equals ours (but the
    version stamp, which is the installed library's: a newer one writes the same format)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config

    geometry = PRESETS["tiny"]
    for cls, ours in ((Flux2Transformer2DModel, transformer_config_json(geometry)),
                      (AutoencoderKLFlux2, vae_config_json(geometry)),
                      (FlowMatchEulerDiscreteScheduler, SCHEDULER_CONFIG)):
        cls.from_config(ours).save_config(tmp_path / cls.__name__)
        written = json.loads((tmp_path / cls.__name__ / "config.json").read_text()
                             if (tmp_path / cls.__name__ / "config.json").exists()
                             else (tmp_path / cls.__name__ / "scheduler_config.json").read_text())
        assert unstamped(written) == unstamped(ours), cls.__name__
    ours = text_encoder_config_json(geometry, vocab_size=645)
    theirs = json.loads(Qwen3Config(**ours).to_json_string())
    assert unstamped(theirs, "architectures") == unstamped(ours, "architectures")


def unstamped(config: dict, *more: str) -> dict:
    """A config without the writing library's version (and the `more` keys)."""
    return {k: v for k, v in config.items() if k not in ("_diffusers_version", "transformers_version", *more)}


def test_our_loaders_read_every_tensor_in_its_layout(tiny: Path) -> None:
    models = load_models(Snapshot.open(tiny), dtype=jnp.float32)
    t = _weights(tiny / "transformer")
    assert np.array_equal(np.asarray(models.transformer.x_embedder.kernel[...]), t["x_embedder.weight"].T)
    stacked = np.asarray(models.transformer.single_transformer_blocks.attn.to_qkv_mlp_proj.kernel[...])
    for i in range(stacked.shape[0]):
        assert np.array_equal(stacked[i], t[f"single_transformer_blocks.{i}.attn.to_qkv_mlp_proj.weight"].T)
    v = _weights(tiny / "vae")
    conv = np.asarray(models.vae.encoder.conv_in.kernel[...])
    assert np.array_equal(conv, v["encoder.conv_in.weight"].transpose(2, 3, 1, 0))
    assert np.array_equal(np.asarray(models.vae.bn.running_var[...]), v["bn.running_var"])
    q = _weights(tiny / "text_encoder")
    assert np.array_equal(np.asarray(models.text_encoder.embed_tokens.embedding[...]), q["model.embed_tokens.weight"])
    # Plausible values: weights within +-1/sqrt(fan_in), norms near one, latent variances positive.
    w = t["x_embedder.weight"]
    assert 0 < np.abs(w).max() <= 128**-0.5 and abs(float(w.mean())) < 0.01
    assert np.all((v["bn.running_var"] >= 0.5) & (v["bn.running_var"] <= 2.0))


def test_writing_is_deterministic_and_streams(tmp_path: Path, tiny: Path) -> None:
    write_random_checkpoint(tmp_path / "again", "tiny", components=("vae",))
    assert (tmp_path / "again" / "vae" / "diffusion_pytorch_model.safetensors").read_bytes() == \
        (tiny / "vae" / "diffusion_pytorch_model.safetensors").read_bytes()
    assert not (tmp_path / "again" / "transformer").exists() and (tmp_path / "again" / "model_index.json").exists()
    other = write_random_checkpoint(tmp_path / "seed1", "tiny", components=("vae",), seed=1, kv=True)
    assert json.loads((other / "model_index.json").read_text())["_class_name"] == "Flux2KleinKVPipeline"
    assert (other / "vae" / "diffusion_pytorch_model.safetensors").read_bytes() != \
        (tiny / "vae" / "diffusion_pytorch_model.safetensors").read_bytes()


def test_parallel_writing_gives_the_same_bytes(tmp_path: Path, tiny: Path) -> None:
    """Tensors drawn by several processes land at their own offsets: every shard and index
    is byte for byte the sequential writer's, and progress counts every byte once."""
    counted: list[int] = []
    again = write_random_checkpoint(tmp_path / "parallel", "tiny", components=("transformer", "vae"), workers=2,
                                    progress=counted.append)
    written = sorted(p.relative_to(again) for p in again.rglob("*.safetensors*"))
    assert len([p for p in written if p.parts[0] == "transformer"]) > 2  # shards and an index
    for rel in written:
        assert (again / rel).read_bytes() == (tiny / rel).read_bytes(), rel
    tensors = sum(p.stat().st_size for p in again.rglob("*.safetensors"))
    assert 0 < tensors - sum(counted) < 64 * 1024  # all but the headers


def test_real_and_medium_geometries_without_writing() -> None:
    t4 = transformer_specs(PRESETS["4b"])
    assert sum(int(np.prod(s.shape)) for s in t4) == 3_875_544_576  # FLUX.2-klein-4B
    assert sum(s.nbytes for s in t4) == 2 * 3_875_544_576 and {s.dtype.name for s in t4} == {"bfloat16"}
    assert len(_shards(sorted(t4, key=lambda s: s.key), PRESETS["4b"].max_shard_bytes)) == 2
    q8 = {s.key: s for s in text_encoder_specs(PRESETS["9b"], 151936)}
    assert q8["lm_head.weight"].shape == (151936, 4096) and "model.layers.35.mlp.down_proj.weight" in q8
    assert "lm_head.weight" not in {s.key for s in text_encoder_specs(PRESETS["4b"], 151936)}  # tied in Qwen3-4B
    medium = PRESETS["medium"]
    total = sum(s.nbytes for s in transformer_specs(medium) + text_encoder_specs(medium, 645) + vae_specs(medium))
    assert 250e6 < total < 290e6  # docs/benchmarks-method: about 268 MB in fp32


def test_small_decoder_vae(tmp_path: Path) -> None:
    """A narrower decoder: the config says so, our loader reads every tensor, the encoder is the plain one's."""
    from flux2klein_cli.core.hub.random_checkpoint import (
        SMALL_DECODER_REAL,
        preset,
        vae_config_json,
        with_small_decoder,
    )
    from flux2klein_cli.core.models.vae import load_vae

    assert vae_config_json(with_small_decoder(preset("4b")))["decoder_block_out_channels"] == SMALL_DECODER_REAL
    small = write_random_checkpoint(tmp_path / "small", with_small_decoder(preset("tiny")), components=("vae",))
    plain = write_random_checkpoint(tmp_path / "plain", "tiny", components=("vae",))
    vae = load_vae(small / "vae", dtype=jnp.float32)
    assert vae.config.decoder_block_out_channels == (32, 32, 32, 64) != vae.config.block_out_channels
    assert vae.decoder.conv_norm_out.weight.shape == (32,)
    assert vae.decoder.mid_block.resnets[0].conv1.kernel.shape[-1] == 64
    ours, theirs = _weights(small / "vae"), _weights(plain / "vae")
    assert ours["encoder.conv_in.weight"].shape == theirs["encoder.conv_in.weight"].shape
    key = "decoder.up_blocks.1.resnets.0.conv1.weight"
    assert ours[key].shape != theirs[key].shape
