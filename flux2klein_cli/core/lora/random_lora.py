"""Random LoRA / LoKr files for a transformer (and text-encoder) checkpoint, in any layout and rank: for tests (the
same factors written in every layout, so layouts can be compared with each other and with
diffusers) and for `bench`-style timing of LoRA loading. Each layout is written by inverting the
mapping layouts.py reads."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from flux2klein_cli.core.lora.layouts import _rows
from flux2klein_cli.core.weights.bfl_names import bfl_modules, diffusers_parts
from flux2klein_cli.core.weights.safetensors_io import SafetensorsCheckpoint

LORA_LAYOUTS = ("bfl", "kohya", "peft", "lokr-bfl", "lokr-lycoris")


def bfl_shapes(transformer_dir: Path) -> dict[str, tuple[int, int]]:
    """(out, in) of every BFL linear module the checkpoint has (a fused qkv: its three parts' rows)."""
    shapes = {k: v.shape for k, v in SafetensorsCheckpoint.open(transformer_dir).tensors.items()}
    blocks = {kind: 1 + max((int(k.split(".")[1]) for k in shapes if k.startswith(prefix + ".")), default=-1)
              for kind, prefix in (("double_blocks", "transformer_blocks"),
                                   ("single_blocks", "single_transformer_blocks"))}
    glob, double, single = bfl_modules()
    names = [*glob, *(f"double_blocks.{i}.{m}" for i in range(blocks["double_blocks"]) for m in double),
             *(f"single_blocks.{i}.{m}" for i in range(blocks["single_blocks"]) for m in single)]
    out = {}
    for name in sorted(names):
        parts = diffusers_parts(name) or ()
        weights = [shapes.get(f"{p.module}.weight") for p in parts]
        if parts and all(w is not None and len(w) == 2 for w in weights):
            out[name] = (sum(w[0] for w in weights), weights[0][1])  # type: ignore[index]
    return out


def _factor(n: int) -> int:
    return 2 if n % 2 == 0 else 1


def lora_tensors(transformer_dir: Path, layout: str, *, rank: int = 4, seed: int = 0, alpha: float | None = None,
                 include: Callable[[str], bool] = lambda module: True, std: float = 0.05) -> dict[str, np.ndarray]:
    """Random factors for every linear module `include` accepts (BFL names), in `layout`. The LoRA
    layouts (bfl, kohya, peft) hold the same deltas for the same seed and alpha."""
    if layout not in LORA_LAYOUTS:
        raise ValueError(f"unknown LoRA layout {layout!r}")
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for module, (rows, cols) in bfl_shapes(transformer_dir).items():
        if not include(module):
            continue
        if layout == "lokr-lycoris":  # LyCORIS wraps diffusers' (unfused) modules
            for part in diffusers_parts(module) or ():
                name = "lycoris_" + part.module.replace(".", "_")
                tensors.update(_lokr(rng, name, rows // part.of, cols, rank, alpha, std))
            continue
        if layout == "lokr-bfl":
            tensors.update(_lokr(rng, f"diffusion_model.{module}", rows, cols, rank, alpha, std))
            continue
        down = rng.normal(0, std, (rank, cols)).astype(np.float32)
        up = rng.normal(0, std, (rows, rank)).astype(np.float32)
        extra = {} if alpha is None else {"alpha": np.array(alpha, np.float32)}
        if layout == "bfl":
            tensors.update({f"diffusion_model.{module}.lora_A.weight": down,
                            f"diffusion_model.{module}.lora_B.weight": up,
                            **{f"diffusion_model.{module}.{k}": v for k, v in extra.items()}})
        elif layout == "kohya":
            name = "lora_unet_" + module.replace(".", "_")
            tensors.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                            **{f"{name}.{k}": v for k, v in extra.items()}})
        else:  # peft: diffusers' names, a fused qkv's A shared and its B split (halves swapped back)
            for part in diffusers_parts(module) or ():
                name = f"transformer.{part.module}"
                tensors.update({f"{name}.lora_A.weight": down, f"{name}.lora_B.weight": _rows(up, part).copy(),
                                **{f"{name}.{k}": v for k, v in extra.items()}})
    return tensors


TEXT_ENCODER_LAYOUTS = ("kohya", "peft", "lokr-lycoris")  # the layouts that have text-encoder keys
_QWEN3_PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")


def text_encoder_lora_tensors(text_encoder_dir: Path, layout: str, *, rank: int = 4, seed: int = 0,
                              alpha: float | None = None, std: float = 0.05) -> dict[str, np.ndarray]:
    """Random factors for every attention and MLP projection of a Qwen3 text encoder, in the key
    form `layout` uses for text encoders: kohya and LyCORIS `lora_te_model_layers_N_...`, PEFT
    `text_encoder.model.layers.N....`."""
    if layout not in TEXT_ENCODER_LAYOUTS:
        raise ValueError(f"the {layout!r} layout has no text-encoder keys")
    rng = np.random.default_rng((seed, 1))  # not the transformer's stream: both can be in one file
    shapes = {k: v.shape for k, v in SafetensorsCheckpoint.open(text_encoder_dir).tensors.items()}
    tensors: dict[str, np.ndarray] = {}
    for key in sorted(k for k in shapes if _QWEN3_PROJECTION.fullmatch(k)):
        (rows, cols), module = shapes[key], key.removesuffix(".weight")
        name = f"text_encoder.{module}" if layout == "peft" else "lora_te_" + module.replace(".", "_")
        if layout == "lokr-lycoris":
            tensors.update(_lokr(rng, name, rows, cols, rank, alpha, std))
            continue
        down = rng.normal(0, std, (rank, cols)).astype(np.float32)
        up = rng.normal(0, std, (rows, rank)).astype(np.float32)
        a, b = ("lora_A", "lora_B") if layout == "peft" else ("lora_down", "lora_up")
        tensors.update({f"{name}.{a}.weight": down, f"{name}.{b}.weight": up})
        if alpha is not None:
            tensors[f"{name}.alpha"] = np.array(alpha, np.float32)
    return tensors


def _lokr(rng: np.random.Generator, name: str, rows: int, cols: int, rank: int, alpha: float | None,
          std: float) -> dict[str, np.ndarray]:
    a, b = _factor(rows), _factor(cols)
    w1 = rng.normal(0, 1, (a, b)).astype(np.float32)
    if alpha is None:  # full factors: no alpha scaling
        return {f"{name}.lokr_w1": w1, f"{name}.lokr_w2": rng.normal(0, std, (rows // a, cols // b)).astype(np.float32)}
    return {f"{name}.lokr_w1": w1,
            f"{name}.lokr_w2_a": rng.normal(0, std, (rows // a, rank)).astype(np.float32),
            f"{name}.lokr_w2_b": rng.normal(0, std, (rank, cols // b)).astype(np.float32),
            f"{name}.alpha": np.array(alpha, np.float32)}


def write_random_lora(path: Path, transformer_dir: Path | None, layout: str = "bfl", *,
                      text_encoder_dir: Path | None = None, **options: object) -> Path:
    """`lora_tensors` saved as one .safetensors file at `path` (bf16 factors stay float32 here:
    LoRA files are small); with `text_encoder_dir`, `text_encoder_lora_tensors` too (same rank,
    seed, alpha and std). A None `transformer_dir` writes text-encoder keys only."""
    tensors = {} if transformer_dir is None else lora_tensors(Path(transformer_dir), layout, **options)  # type: ignore[arg-type]
    if text_encoder_dir is not None:
        shared = {k: v for k, v in options.items() if k in ("rank", "seed", "alpha", "std")}
        tensors.update(text_encoder_lora_tensors(Path(text_encoder_dir), layout, **shared))  # type: ignore[arg-type]
    write_float32_safetensors(path, tensors)
    return path


def write_float32_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
                              ) -> None:
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset, blobs = 0, []
    for key, value in tensors.items():
        blob = np.ascontiguousarray(value, np.float32).tobytes()
        header[key] = {"dtype": "F32", "shape": list(value.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with Path(path).open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for blob in blobs:
            f.write(blob)
