"""BFL's transformer names -> diffusers' names, for single-file checkpoints and LoRA files.

BFL's reference code, ComfyUI and ai-toolkit name the FLUX.2 transformer differently from
diffusers. A BFL module is one diffusers module, except:
- a double block's fused `qkv` is diffusers' three projections stacked on the output axis;
- `final_layer.adaLN_modulation.1` is `norm_out.linear` with its two output halves in the
  other order (BFL: shift, scale; diffusers: scale, shift).
Both single files (weights) and LoRA files (per-module A / B factors) are mapped through
`diffusers_parts`, so the two can never disagree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Prefixes that wrap BFL names in the files people share.
PREFIXES = ("model.diffusion_model.", "diffusion_model.")

_GLOBAL_MODULES = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
    "final_layer.linear": "proj_out",
}
_DOUBLE_MODULES = {
    "img_attn.proj": "attn.to_out.0",
    "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.linear_in",
    "img_mlp.2": "ff.linear_out",
    "txt_mlp.0": "ff_context.linear_in",
    "txt_mlp.2": "ff_context.linear_out",
    "img_attn.norm.query_norm": "attn.norm_q",
    "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q",
    "txt_attn.norm.key_norm": "attn.norm_added_k",
}
_DOUBLE_QKV = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_SINGLE_MODULES = {
    "linear1": "attn.to_qkv_mlp_proj",
    "linear2": "attn.to_out",
    "norm.query_norm": "attn.norm_q",
    "norm.key_norm": "attn.norm_k",
}
_BLOCK = re.compile(r"(double_blocks|single_blocks)\.(\d+)\.(.+)")
# BFL's RMSNorm calls its weight `scale`; diffusers calls it `weight`.
_PARAMETERS = {"weight": "weight", "bias": "bias", "scale": "weight"}


@dataclass(frozen=True)
class Part:
    """Where (a part of) a BFL module lives in diffusers: `module`, taking chunk `index` of `of`
    equal chunks of the BFL tensor's output axis; `swap_halves` when the two halves of that
    axis are stored in the other order."""

    module: str
    index: int = 0
    of: int = 1
    swap_halves: bool = False


def strip_prefix(key: str) -> str:
    for prefix in PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def diffusers_parts(module: str) -> tuple[Part, ...] | None:
    """The diffusers module(s) of a BFL module path (no prefix, no parameter name), or None
    for a name BFL's FLUX.2 transformer does not have."""
    if module in _GLOBAL_MODULES:
        return (Part(_GLOBAL_MODULES[module]),)
    if module == "final_layer.adaLN_modulation.1":
        return (Part("norm_out.linear", swap_halves=True),)
    match = _BLOCK.fullmatch(module)
    if match is None:
        return None
    kind, index, rest = match.groups()
    if kind == "double_blocks":
        block = f"transformer_blocks.{index}"
        if rest in _DOUBLE_QKV:
            return tuple(Part(f"{block}.{name}", i, 3) for i, name in enumerate(_DOUBLE_QKV[rest]))
        return (Part(f"{block}.{_DOUBLE_MODULES[rest]}"),) if rest in _DOUBLE_MODULES else None
    return (Part(f"single_transformer_blocks.{index}.{_SINGLE_MODULES[rest]}"),) if rest in _SINGLE_MODULES else None


def diffusers_parameters(key: str) -> tuple[tuple[str, Part], ...] | None:
    """(diffusers key, part) for each diffusers parameter a BFL parameter key holds (prefix
    allowed), or None when the key is not a BFL transformer parameter."""
    module, _, parameter = strip_prefix(key).rpartition(".")
    parts = diffusers_parts(module) if parameter in _PARAMETERS else None
    if parts is None:
        return None
    return tuple((f"{part.module}.{_PARAMETERS[parameter]}", part) for part in parts)


def bfl_modules() -> tuple[set[str], set[str], set[str]]:
    """BFL module names: (global ones, those inside a double block, those inside a single block)."""
    return ({*_GLOBAL_MODULES, "final_layer.adaLN_modulation.1"}, {*_DOUBLE_MODULES, *_DOUBLE_QKV},
            set(_SINGLE_MODULES))


def diffusers_modules() -> tuple[set[str], set[str], set[str]]:
    """diffusers module names, as `bfl_modules`: (global, inside `transformer_blocks.N`, inside
    `single_transformer_blocks.N`)."""
    return ({*_GLOBAL_MODULES.values(), "norm_out.linear"},
            {*_DOUBLE_MODULES.values(), *(name for names in _DOUBLE_QKV.values() for name in names)},
            set(_SINGLE_MODULES.values()))
