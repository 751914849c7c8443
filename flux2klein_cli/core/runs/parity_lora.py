"""LoRA files on diffusers' side of `parity`: the transformer's keys through diffusers' own loader,
the text encoder's merged by hand in torch.

diffusers' Flux2 LoRA loader loads the transformer only, so the reference text encoder (transformers'
Qwen3) gets its deltas here: delta = up @ down * alpha / rank (LoRA) or kron(w1, w2) (LoKr, alpha /
rank when a factor is a product), times the `--lora` scale, added to the weight. The module names come
from torch's own module tree (`lora_te_` + the path with `_` for `.`, or `text_encoder.` + the path),
not from core/lora/layouts.py, so the two sides do not share a mapping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flux2klein_cli.core.errors import Flux2KleinError
from flux2klein_cli.core.lora.layouts import TEXT_ENCODER_PREFIXES


def split_text_encoder(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A LoRA file's torch tensors: (transformer keys, text-encoder keys)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    text = {k: v for k, v in tensors.items() if k.startswith(TEXT_ENCODER_PREFIXES)}
    return {k: v for k, v in tensors.items() if k not in text}, text


def _product(factors: dict[str, Any], name: str) -> tuple[Any, bool]:
    if name in factors:
        return factors[name], False
    return factors[f"{name}_a"] @ factors[f"{name}_b"], True


def _delta(factors: dict[str, Any]) -> Any:
    import torch

    alpha = float(factors["alpha"]) if "alpha" in factors else None
    if "lokr_w1" in factors or "lokr_w1_a" in factors:
        (w1, a_product), (w2, b_product) = _product(factors, "lokr_w1"), _product(factors, "lokr_w2")
        rank = (factors["lokr_w2_b"] if b_product else factors["lokr_w1_b"]).shape[0] if a_product or b_product else 0
        return torch.kron(w1, w2) * (alpha / rank if alpha is not None and rank else 1.0)
    down = factors.get("lora_down.weight", factors.get("lora_A.weight"))
    up = factors.get("lora_up.weight", factors.get("lora_B.weight"))
    return up @ down * (alpha / down.shape[0] if alpha is not None else 1.0)


def merge_text_encoder_lora(text_encoder: Any, tensors: dict[str, Any], scale: float) -> None:
    """Add one file's text-encoder deltas, times `scale`, to a transformers Qwen3 model's weights."""
    import torch

    names = {}
    for name, module in text_encoder.named_modules():
        if isinstance(module, torch.nn.Linear):
            # Saved from Qwen3ForCausalLM (`model.layers...`) or from its inner Qwen3Model (`layers...`).
            for saved in {name, name.removeprefix("model.")}:
                names.update({"lora_te_" + saved.replace(".", "_"): name, "lora_te1_" + saved.replace(".", "_"): name,
                              f"text_encoder.{saved}": name})
    grouped: dict[str, dict[str, Any]] = {}
    longest_first = sorted(names, key=len, reverse=True)
    for key, value in tensors.items():
        module = next((m for m in longest_first if key.startswith(m + ".")), None)
        if module is None:
            raise Flux2KleinError(f"the reference text encoder has no module for LoRA key {key}")
        grouped.setdefault(module, {})[key[len(module) + 1:]] = value.float()
    linears = dict(text_encoder.named_modules())
    with torch.no_grad():
        for module, factors in grouped.items():
            weight = linears[names[module]].weight
            weight += (_delta(factors) * scale).to(weight.dtype)
