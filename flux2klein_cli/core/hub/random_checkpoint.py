"""Random-weight FLUX.2 [klein] checkpoints of any geometry, in the exact Hugging Face diffusers layout.

For benchmarks, capacity tests and the `tiny` alias, without downloads and without torch.
The keys and torch-layout shapes come from our own models' key plans (the same plans the
loader checks), so a written checkpoint is what the loader expects by construction; the
configs are the JSON that diffusers / transformers write, so diffusers loads it too.

Every tensor is generated and written in chunks straight into its shard file, so writing
the real 4B or 9B geometry needs only a few MiB of memory. Values are uniform in
+-1/sqrt(fan_in) (torch's default init for Linear and Conv), norms near one, biases near
zero, from a seed per tensor: the same bytes on every machine.

    python -m flux2klein_cli.core.hub.random_checkpoint /tmp/medium --preset medium
    python -m flux2klein_cli.core.hub.random_checkpoint /tmp/t4b --preset 4b --components transformer
    python -m flux2klein_cli.core.hub.random_checkpoint /tmp/small-vae --preset 4b --components vae --small-decoder
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from flux2klein_cli.core import choices
from flux2klein_cli.core.choices import numpy_dtype
from flux2klein_cli.core.hub.registry import QWEN3_4B, QWEN3_8B, TRANSFORMER_4B, TRANSFORMER_9B, TRANSFORMER_COMMON
from flux2klein_cli.core.hub.tokenizer_builder import build_tokenizer

# The library versions whose on-disk format these files mirror.
DIFFUSERS_VERSION = "0.42.1"
TRANSFORMERS_VERSION = "5.24.0"
COMPONENTS = ("transformer", "text_encoder", "vae", "tokenizer", "scheduler")
_CHUNK_ELEMENTS = 1 << 22  # generate and write 4M values at a time (16 MiB of float32)
_ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int64): "I64"}
DTYPES = {name: numpy_dtype(name) for name in choices.DTYPES}

# The scheduler config the klein repos ship (dynamic, exponential time shift), as diffusers writes it.
SCHEDULER_CONFIG: dict[str, Any] = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": DIFFUSERS_VERSION,
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "shift_terminal": None,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}


@dataclass(frozen=True)
class Geometry:
    """The shapes of one checkpoint. `text_encoder["vocab_size"]` None means the tokenizer's size."""

    name: str
    transformer: dict[str, Any] = field(repr=False)
    text_encoder: dict[str, Any] = field(repr=False)
    vae: dict[str, Any] = field(repr=False)
    dtype: str = "bf16"
    max_shard_bytes: int = 5_000_000_000  # the split of the published 4B transformer (two shards)



_VAE_REAL = dict(block_out_channels=[128, 256, 512, 512], layers_per_block=2, latent_channels=32, norm_num_groups=32)
# FLUX.2-small-decoder's decoder widths; a narrower decoder for the tiny and medium geometries
# (their widths must stay multiples of the 32 norm groups).
SMALL_DECODERS: dict[str, list[int]] = {"tiny": [32, 32, 32, 64], "medium": [32, 32, 64, 96]}
SMALL_DECODER_REAL = [96, 192, 384, 384]


def _qwen3(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, *, layers: int = 28,
           vocab: int | None = None, tied: bool = True, max_positions: int = 1024) -> dict[str, Any]:
    return dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=max_positions,
                tie_word_embeddings=tied)


def _real_qwen3(spec: dict[str, Any]) -> dict[str, Any]:
    return _qwen3(spec["hidden_size"], spec["intermediate_size"], spec["num_attention_heads"],
                  spec["num_key_value_heads"], spec["head_dim"], layers=spec["num_hidden_layers"],
                  vocab=spec["vocab_size"], tied=spec["tie_word_embeddings"],
                  max_positions=spec["max_position_embeddings"])


def _real_transformer(spec: dict[str, Any]) -> dict[str, Any]:
    keep = ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim", "joint_attention_dim",
            "axes_dims_rope")
    return dict(TRANSFORMER_COMMON, **{k: spec[k] for k in keep})


PRESETS: dict[str, Geometry] = {
    # The test fixtures' geometry: tiny widths, real structure (28 Qwen3 layers for features 9/18/27).
    "tiny": Geometry(
        "tiny",
        dict(TRANSFORMER_COMMON, num_layers=2, num_single_layers=3, num_attention_heads=2, attention_head_dim=32,
             joint_attention_dim=96, axes_dims_rope=[8, 8, 8, 8]),
        _qwen3(32, 64, 4, 2, 8),
        dict(block_out_channels=[32, 32, 64, 64], layers_per_block=2, latent_channels=32, norm_num_groups=32),
        dtype="fp32",
        max_shard_bytes=400_000,  # several shards with an index, like the hub's large components
    ),
    # docs/benchmarks-method: D 512, 2 + 6 blocks, Qwen3 width 256 x 28 layers, VAE [32, 64, 128, 128].
    "medium": Geometry(
        "medium",
        dict(TRANSFORMER_COMMON, num_layers=2, num_single_layers=6, num_attention_heads=4, attention_head_dim=128,
             joint_attention_dim=768, axes_dims_rope=[32, 32, 32, 32]),
        _qwen3(256, 768, 4, 2, 64),
        dict(block_out_channels=[32, 64, 128, 128], layers_per_block=2, latent_channels=32, norm_num_groups=32),
        dtype="fp32",
        max_shard_bytes=100_000_000,
    ),
    "4b": Geometry("4b", _real_transformer(TRANSFORMER_4B), _real_qwen3(QWEN3_4B), dict(_VAE_REAL)),
    "9b": Geometry("9b", _real_transformer(TRANSFORMER_9B), _real_qwen3(QWEN3_8B), dict(_VAE_REAL)),
    # Accelerator benchmarks of denoising and decoding: the real transformer and VAE, and a text
    # encoder of the real width (the transformer's input) but 4 heads and a narrow MLP, 0.2-0.3 GB
    # instead of 8-16 GB to write and load. Its text-encoding times are not the real model's.
    "4b-bench": Geometry("4b-bench", _real_transformer(TRANSFORMER_4B),
                         _qwen3(QWEN3_4B["hidden_size"], 512, 4, 2, 128), dict(_VAE_REAL)),
    "9b-bench": Geometry("9b-bench", _real_transformer(TRANSFORMER_9B),
                         _qwen3(QWEN3_8B["hidden_size"], 512, 4, 2, 128), dict(_VAE_REAL)),
}


def preset(name: str) -> Geometry:
    from flux2klein_cli.core.errors import UserInputError

    try:
        return PRESETS[name]
    except KeyError:
        raise UserInputError(f"unknown geometry {name!r}: use one of {', '.join(PRESETS)}") from None


# ----------------------------------------------------------------------------- configs


def transformer_config_json(geometry: Geometry) -> dict[str, Any]:
    """`transformer/config.json` as diffusers' Flux2Transformer2DModel.save_pretrained writes it."""
    return {"_class_name": "Flux2Transformer2DModel", "_diffusers_version": DIFFUSERS_VERSION, **geometry.transformer}


def vae_config_json(geometry: Geometry) -> dict[str, Any]:
    """`vae/config.json` as diffusers' AutoencoderKLFlux2 writes it (every init argument)."""
    blocks = list(geometry.vae["block_out_channels"])
    return {
        "_class_name": "AutoencoderKLFlux2",
        "_diffusers_version": DIFFUSERS_VERSION,
        "act_fn": "silu",
        "batch_norm_eps": 1e-4,
        "batch_norm_momentum": 0.1,
        "block_out_channels": blocks,
        "decoder_block_out_channels": geometry.vae.get("decoder_block_out_channels"),
        "down_block_types": ["DownEncoderBlock2D"] * len(blocks),
        "in_channels": 3,
        "latent_channels": geometry.vae["latent_channels"],
        "layers_per_block": geometry.vae["layers_per_block"],
        "mid_block_add_attention": True,
        "norm_num_groups": geometry.vae["norm_num_groups"],
        "out_channels": 3,
        "patch_size": [2, 2],
        "sample_size": 1024,
        "up_block_types": ["UpDecoderBlock2D"] * len(blocks),
        "use_post_quant_conv": True,
        "use_quant_conv": True,
    }


def text_encoder_config_json(geometry: Geometry, vocab_size: int) -> dict[str, Any]:
    """`text_encoder/config.json` as transformers 5 writes a Qwen3ForCausalLM config."""
    q = geometry.text_encoder
    layers = q["num_hidden_layers"]
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "dtype": "bfloat16" if geometry.dtype == "bf16" else "float32",
        "eos_token_id": None,
        "head_dim": q["head_dim"],
        "hidden_act": "silu",
        "hidden_size": q["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": q["intermediate_size"],
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": q["max_position_embeddings"],
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": q["num_attention_heads"],
        "num_hidden_layers": layers,
        "num_key_value_heads": q["num_key_value_heads"],
        "pad_token_id": None,
        "rms_norm_eps": q["rms_norm_eps"],
        "rope_parameters": {"rope_theta": q["rope_theta"], "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": q["tie_word_embeddings"],
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


GENERATION_CONFIG = {
    "_from_model_config": True,
    "output_attentions": False,
    "output_hidden_states": False,
    "transformers_version": TRANSFORMERS_VERSION,
    "use_cache": True,
}


def model_index_json(*, kv: bool, distilled: bool) -> dict[str, Any]:
    index: dict[str, Any] = {
        "_class_name": "Flux2KleinKVPipeline" if kv else "Flux2KleinPipeline",
        "_diffusers_version": DIFFUSERS_VERSION,
    }
    if not kv:  # the KV pipeline registers no is_distilled (it is always distilled)
        index["is_distilled"] = distilled
    index.update(
        scheduler=["diffusers", "FlowMatchEulerDiscreteScheduler"],
        text_encoder=["transformers", "Qwen3ForCausalLM"],
        tokenizer=["transformers", "Qwen2Tokenizer"],
        transformer=["diffusers", "Flux2Transformer2DModel"],
        vae=["diffusers", "AutoencoderKLFlux2"],
    )
    return index


def write_json(path: Path, data: dict[str, Any]) -> None:
    """As diffusers and transformers write configs: sorted keys, two-space indent, final newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: torch-layout shape, stored dtype, and how to draw its values."""

    key: str
    shape: tuple[int, ...]
    dtype: np.dtype
    kind: str  # "weight" (fan-in uniform), "norm", "bias", "embedding", "mean", "var", "zero"

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _torch_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The inverse of the loader's layout change: JAX (in, out) -> torch (out, in); HWIO -> OIHW."""
    if layout == "linear":
        return (shape[1], shape[0])
    if layout == "conv":
        return (shape[3], shape[2], shape[0], shape[1])
    return shape


def _kind(key: str, layout: str, ndim: int) -> str:
    if layout in ("linear", "conv"):
        return "weight"
    if key.endswith("running_mean"):
        return "mean"
    if key.endswith("running_var"):
        return "var"
    if ndim == 2:
        return "embedding"
    return "bias" if key.endswith(".bias") else "norm"


def specs_from_plan(abstract_model: Any, plan: Any, dtype: np.dtype) -> list[TensorSpec]:
    """Checkpoint keys and torch-layout shapes of every parameter a key plan reads."""
    from flax import nnx

    specs = []
    for path, var in nnx.to_flat_state(nnx.state(abstract_model)):
        value = var.get_value()
        source = plan.sources[tuple(path)]
        shape = tuple(value.shape[1:] if source.stacked else value.shape)
        # Parameters follow the checkpoint dtype; float32-only state (the VAE's latent statistics) stays float32.
        stored = np.dtype(np.float32) if np.dtype(value.dtype) == np.float32 else dtype
        for key in source.keys:
            specs.append(TensorSpec(key, _torch_shape(shape, source.layout), stored,
                                    _kind(key, source.layout, len(shape))))
    return specs


def transformer_specs(geometry: Geometry) -> list[TensorSpec]:
    from flax import nnx

    from flux2klein_cli.core.models.transformer import Flux2Transformer, TransformerConfig, transformer_key_plan

    cfg = TransformerConfig.from_dict(transformer_config_json(geometry))
    model = nnx.eval_shape(lambda: Flux2Transformer(cfg, dtype=_jnp_dtype(geometry), rngs=nnx.Rngs(0)))
    return specs_from_plan(model, transformer_key_plan(model), DTYPES[geometry.dtype])


def text_encoder_specs(geometry: Geometry, vocab_size: int) -> list[TensorSpec]:
    """Every tensor of a Qwen3ForCausalLM: all layers (ours stops at layer 27), the final norm and,
    when not tied, the LM head."""
    from flax import nnx

    from flux2klein_cli.core.models.qwen3 import Qwen3Config, Qwen3TextEncoder, qwen3_key_plan

    config = Qwen3Config.from_dict(text_encoder_config_json(geometry, vocab_size))
    dtype = DTYPES[geometry.dtype]
    model = nnx.eval_shape(lambda: Qwen3TextEncoder(
        config, feature_layers=(config.num_hidden_layers,), dtype=_jnp_dtype(geometry), rngs=nnx.Rngs(0)
    ))
    specs = specs_from_plan(model, qwen3_key_plan(model), dtype)
    specs.append(TensorSpec("model.norm.weight", (config.hidden_size,), dtype, "norm"))
    if not geometry.text_encoder["tie_word_embeddings"]:
        specs.append(TensorSpec("lm_head.weight", (config.vocab_size, config.hidden_size), dtype, "weight"))
    return specs


def vae_specs(geometry: Geometry) -> list[TensorSpec]:
    from flux2klein_cli.core.models.vae import VAEConfig, abstract_vae, vae_key_plan

    model = abstract_vae(VAEConfig.from_dict(vae_config_json(geometry)), dtype=_jnp_dtype(geometry))
    specs = specs_from_plan(model, vae_key_plan(model), DTYPES[geometry.dtype])
    # BatchNorm2d's step counter: training state, but part of every saved AutoencoderKLFlux2.
    return [*specs, TensorSpec("bn.num_batches_tracked", (), np.dtype(np.int64), "zero")]


def _jnp_dtype(geometry: Geometry) -> Any:
    import jax.numpy as jnp

    return jnp.bfloat16 if geometry.dtype == "bf16" else jnp.float32


def _natural(key: str) -> list[Any]:
    """Sort key with numbers compared as numbers: layer 2 before layer 10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def _values(spec: TensorSpec, seed: int) -> Iterable[np.ndarray]:
    """The tensor's values in C order, chunk by chunk, already in the stored dtype."""
    count = int(np.prod(spec.shape, dtype=np.int64))
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(spec.key.encode())])))
    fan_in = int(np.prod(spec.shape[1:], dtype=np.int64)) if len(spec.shape) > 1 else 1
    low, high = {
        "weight": (-(fan_in**-0.5), fan_in**-0.5),
        "embedding": (-0.05, 0.05),
        "norm": (0.9, 1.1),
        "bias": (-0.02, 0.02),
        "mean": (-0.5, 0.5),
        "var": (0.5, 2.0),
        "zero": (0.0, 0.0),
    }[spec.kind]
    for start in range(0, max(count, 1), _CHUNK_ELEMENTS):
        n = min(_CHUNK_ELEMENTS, count - start) if count else 1
        if spec.kind == "zero":
            yield np.zeros(n, spec.dtype)
            continue
        chunk = rng.random(n, dtype=np.float32)
        chunk *= high - low
        chunk += low
        yield chunk.astype(spec.dtype, copy=False)


# ----------------------------------------------------------------------------- safetensors


def _header(specs: Sequence[TensorSpec]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.key] = {"dtype": _ST_DTYPES[spec.dtype], "shape": list(spec.shape),
                            "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned, as the safetensors library writes it
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: Path, specs: Sequence[TensorSpec], seed: int,
                      progress: Callable[[int], None] | None = None) -> None:
    """One .safetensors file, tensor by tensor and chunk by chunk (memory stays at one chunk)."""
    with path.open("wb") as f:
        f.write(_header(specs))
        for spec in specs:
            for chunk in _values(spec, seed):
                chunk.tofile(f)
                if progress:
                    progress(chunk.nbytes)


def _write_tensor(path: Path, offset: int, spec: TensorSpec, seed: int) -> int:
    """One tensor's bytes at its offset in an already sized file (a worker's task)."""
    with path.open("r+b") as f:
        f.seek(offset)
        for chunk in _values(spec, seed):
            chunk.tofile(f)
    return spec.nbytes


def write_safetensors_parallel(files: Sequence[tuple[Path, Sequence[TensorSpec]]], seed: int, workers: int,
                               progress: Callable[[int], None] | None = None) -> None:
    """The same bytes as `write_safetensors` for each file, every tensor drawn by one of
    `workers` processes: each tensor's values come from its own seed, so they need no order.
    Files are sized first; every worker writes its tensor in place."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    tasks = []
    for path, specs in files:
        header = _header(specs)
        with path.open("wb") as f:
            f.write(header)
            f.truncate(len(header) + sum(spec.nbytes for spec in specs))
        offset = len(header)
        for spec in specs:
            tasks.append((path, offset, spec))
            offset += spec.nbytes
    tasks.sort(key=lambda task: -task[2].nbytes)  # the largest first, so no worker finishes last with a big one
    # Spawned workers: the caller may hold threads (jax's) that a fork would copy in a bad state.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        for done in as_completed([pool.submit(_write_tensor, path, offset, spec, seed)
                                  for path, offset, spec in tasks]):
            written = done.result()
            if progress:
                progress(written)


def _shards(specs: Sequence[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Split in key order, as save_pretrained does: a new shard when the next tensor would overflow."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_weights(directory: Path, specs: Sequence[TensorSpec], *, stem: str, max_shard_bytes: int, seed: int,
                  extra_index_metadata: dict[str, Any] | None = None,
                  progress: Callable[[int], None] | None = None, workers: int = 1) -> list[Path]:
    """`<stem>.safetensors`, or `<stem>-0000i-of-0000n.safetensors` shards plus `<stem>.safetensors.index.json`."""
    directory.mkdir(parents=True, exist_ok=True)
    specs = sorted(specs, key=lambda s: _natural(s.key))
    shards = _shards(specs, max_shard_bytes)
    if len(shards) == 1:
        paths = [directory / f"{stem}.safetensors"]
    else:
        paths = [directory / f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    if workers > 1:
        write_safetensors_parallel(list(zip(paths, shards, strict=True)), seed, workers, progress)
    else:
        for path, shard in zip(paths, shards, strict=True):
            write_safetensors(path, shard, seed, progress)
    if len(shards) > 1:
        weight_map = {spec.key: path.name for path, shard in zip(paths, shards, strict=True) for spec in shard}
        metadata = {**(extra_index_metadata or {}), "total_size": sum(s.nbytes for s in specs)}
        write_json(directory / f"{stem}.safetensors.index.json", {"metadata": metadata, "weight_map": weight_map})
    return paths


# ----------------------------------------------------------------------------- the checkpoint


def write_random_checkpoint(
    root: str | Path,
    geometry: Geometry | str = "tiny",
    *,
    seed: int = 0,
    components: Sequence[str] = COMPONENTS,
    kv: bool = False,
    distilled: bool = True,
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
) -> Path:
    """Write a `Flux2KleinPipeline` (or, with `kv`, `Flux2KleinKVPipeline`) snapshot to `root`.

    `components` may leave out parts (e.g. only the transformer of the real 4B geometry, for a
    loading benchmark); model_index.json is always written. `progress` receives byte counts;
    `workers` > 1 draws tensors in that many processes (the same bytes)."""
    geometry = preset(geometry) if isinstance(geometry, str) else geometry
    if geometry.dtype not in DTYPES:
        raise ValueError(f"dtype {geometry.dtype!r}: use one of {', '.join(DTYPES)}")
    unknown = set(components) - set(COMPONENTS)
    if unknown:
        raise ValueError(f"unknown components {sorted(unknown)}: use {', '.join(COMPONENTS)}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)

    vocab = geometry.text_encoder["vocab_size"]
    if "tokenizer" in components or vocab is None:
        # The tokenizer is tiny and deterministic; its size is the vocabulary of the small geometries.
        tokenizer_size = build_tokenizer(root / "tokenizer")
        vocab = vocab or tokenizer_size
        if "tokenizer" not in components:
            import shutil

            shutil.rmtree(root / "tokenizer")
    if "scheduler" in components:
        write_json(root / "scheduler" / "scheduler_config.json", SCHEDULER_CONFIG)
    if "vae" in components:
        write_json(root / "vae" / "config.json", vae_config_json(geometry))
        write_weights(root / "vae", vae_specs(geometry), stem="diffusion_pytorch_model",
                      max_shard_bytes=5_000_000_000, seed=seed, progress=progress, workers=workers)
    if "text_encoder" in components:
        te = root / "text_encoder"
        write_json(te / "config.json", text_encoder_config_json(geometry, vocab))
        write_json(te / "generation_config.json", GENERATION_CONFIG)
        specs = text_encoder_specs(geometry, vocab)
        total = sum(int(np.prod(s.shape, dtype=np.int64)) for s in specs)
        write_weights(te, specs, stem="model", max_shard_bytes=geometry.max_shard_bytes, seed=seed,
                      extra_index_metadata={"total_parameters": total}, progress=progress,
                      workers=workers)
    if "transformer" in components:
        write_json(root / "transformer" / "config.json", transformer_config_json(geometry))
        write_weights(root / "transformer", transformer_specs(geometry), stem="diffusion_pytorch_model",
                      max_shard_bytes=geometry.max_shard_bytes, seed=seed, progress=progress, workers=workers)
    write_json(root / "model_index.json", model_index_json(kv=kv, distilled=distilled))
    return root


def with_dtype(geometry: Geometry, dtype: str) -> Geometry:
    return replace(geometry, dtype=dtype)


def with_small_decoder(geometry: Geometry) -> Geometry:
    """The same geometry with a narrower VAE decoder: FLUX.2-small-decoder's widths for the real
    VAE, a narrower one of the same kind for the small geometries. The encoder is unchanged."""
    widths = SMALL_DECODERS.get(geometry.name, SMALL_DECODER_REAL)
    vae = dict(geometry.vae, decoder_block_out_channels=list(widths))
    return replace(geometry, name=f"{geometry.name}-small-decoder", vae=vae)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write a random-weight FLUX.2 [klein] checkpoint (diffusers layout).")
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="Override the preset's stored dtype.")
    parser.add_argument("--components", default=",".join(COMPONENTS), help="Comma-separated subset to write.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv", action="store_true", help="Write a Flux2KleinKVPipeline model_index.json.")
    parser.add_argument("--small-decoder", action="store_true",
                        help="A narrower VAE decoder (FLUX.2-small-decoder's widths for the real VAE).")
    parser.add_argument("--workers", type=int, default=1,
                        help="Processes drawing tensors (the same bytes); e.g. the host's cores for the 9B geometry.")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} exists and is not empty")
    geometry = PRESETS[args.preset]
    if args.dtype:
        geometry = with_dtype(geometry, args.dtype)
    if args.small_decoder:
        geometry = with_small_decoder(geometry)
    print(write_random_checkpoint(args.out, geometry, seed=args.seed, components=args.components.split(","),
                                  kv=args.kv, workers=max(1, args.workers)))


if __name__ == "__main__":
    main()
