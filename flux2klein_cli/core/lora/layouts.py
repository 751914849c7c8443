"""LoRA / LoKr files in the layouts Klein users share -> per-weight factors keyed by diffusers' names.

Each weight a file changes becomes a list of terms keyed by the diffusers checkpoint key of that
weight (`transformer_blocks.0.attn.to_q.weight`); a term yields any block of its delta in torch's
(out, in) layout, so a device computes only its own slice. Layouts, detected from the keys:

- ai-toolkit / BFL: `diffusion_model.` (or `model.diffusion_model.`) + BFL module names (or
  diffusers' block names, as some exports have), `.lora_A.weight` / `.lora_B.weight`;
- kohya / musubi: `lora_unet_` + the BFL module path with `_` for `.`, `.lora_down.weight` /
  `.lora_up.weight` / `.alpha` (delta = up @ down * alpha / rank);
- diffusers / PEFT: `transformer.` + diffusers module names, or `base_model.model.` + BFL (or
  diffusers) names; `.alpha` keys or the file's PEFT metadata (`lora_alpha`) scale by alpha / rank;
- LoKr: `.lokr_w1` / `.lokr_w2` (each possibly a product `_a @ _b`), delta = kron(w1, w2), scaled by
  alpha / rank only when a factor is decomposed (LyCORIS' rule); BFL keys or LyCORIS' `lycoris_` +
  the diffusers module path with `_` for `.`.

Text-encoder keys (the klein text encoder is one Qwen3 causal LM, transformers' names) are read in
the layouts that have them: kohya / musubi `lora_te_` (or `lora_te1_`) + the module path with `_` for
`.`, and diffusers / PEFT `text_encoder.` + the module path; `model.` in front of `layers` is optional
(saved from Qwen3ForCausalLM or Qwen3Model). Their LoRA or LoKr factors become terms keyed by the text
encoder's checkpoint keys (`model.layers.0.self_attn.q_proj.weight`), merged like the transformer's.
Keys for a second text encoder (`lora_te2_`, `text_encoder_2.`) are an error: klein has one.

BFL names go through weights/bfl_names.py, the map single-file checkpoints use: a fused qkv LoRA
shares its A across q, k, v and splits its B (or its Kronecker product) in three, and
`final_layer.adaLN_modulation.1`'s delta has its two output halves swapped like the weight.
(diffusers' converters map that module without the swap; see tests/test_lora.py.)
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.weights.bfl_names import Part, bfl_modules, diffusers_modules, diffusers_parts

LORA_SUFFIXES = ("lora_A.weight", "lora_B.weight", "lora_down.weight", "lora_up.weight")
LOKR_SUFFIXES = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b")
SUFFIXES = (*LORA_SUFFIXES, *LOKR_SUFFIXES, "alpha")
_DOWN, _UP = ("lora_A.weight", "lora_down.weight"), ("lora_B.weight", "lora_up.weight")
TEXT_ENCODER_PREFIXES = ("lora_te_", "lora_te1_", "text_encoder.")
_SECOND_TEXT_ENCODER = ("lora_te2_", "text_encoder_2.")
_QWEN3_PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                      "mlp": ("gate_proj", "up_proj", "down_proj")}


def _rows(x: np.ndarray, part: Part) -> np.ndarray:
    """The rows of a BFL module's (out, ...) tensor that belong to one diffusers module."""
    n = x.shape[0] // part.of
    x = x[part.index * n:(part.index + 1) * n]
    if part.swap_halves:
        half = x.shape[0] // 2
        x = np.concatenate([x[half:], x[:half]])
    return x


@dataclass(frozen=True)
class LowRank:
    """delta = scale * up @ down; `up` already holds only this weight's rows."""

    down: np.ndarray  # (rank, in), float32
    up: np.ndarray  # (out, rank), float32
    scale: float
    source: str  # the file's module name, for messages

    @property
    def shape(self) -> tuple[int, int]:
        return (self.up.shape[0], self.down.shape[1])

    def block(self, rows: slice, cols: slice) -> np.ndarray:
        return self.scale * (self.up[rows] @ self.down[:, cols])

    def add_to(self, block: np.ndarray, rows: slice, cols: slice, scratch: np.ndarray) -> None:
        """block += this term's (rows, cols) block; the product goes into `scratch` (block's shape),
        the scale into the small factor, so nothing of the block's size is allocated."""
        np.matmul(self.up[rows] * np.float32(self.scale), self.down[:, cols], out=scratch)
        block += scratch

    def scaled(self, factor: float) -> LowRank:
        return LowRank(self.down, self.up, self.scale * factor, self.source)


@dataclass(frozen=True)
class Kronecker:
    """delta = scale * rows(kron(w1, w2)) of this weight's part of the file's module."""

    w1: np.ndarray
    w2: np.ndarray
    scale: float
    source: str
    part: Part = Part("")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.w1.shape[0] * self.w2.shape[0] // self.part.of, self.w1.shape[1] * self.w2.shape[1])

    def block(self, rows: slice, cols: slice) -> np.ndarray:
        return self.scale * _rows(np.kron(self.w1, self.w2), self.part)[rows, cols]

    def add_to(self, block: np.ndarray, rows: slice, cols: slice, scratch: np.ndarray) -> None:
        """block += this term's (rows, cols) block, computed for just those entries:
        kron(w1, w2)[R, C] = w1[R // m2, C // n2] * w2[R % m2, C % n2], R the rows `_rows` keeps."""
        count = self.shape[0]
        r = np.arange(count)[rows]
        if self.part.swap_halves:  # _rows' concatenate(x[half:], x[:half])
            r = (r + count // 2) % count
        r = r + self.part.index * count
        m2, n2 = self.w2.shape
        c0, c1, step = cols.indices(self.shape[1])
        if step == 1 and c0 % n2 == 0 and c1 % n2 == 0:
            # Whole blocks of w2's columns: a broadcast product of row gathers, written in place
            # (gathering every entry with np.ix_ was most of a Kronecker merge's time).
            np.multiply(self.w1[r // m2, c0 // n2:c1 // n2, None], self.w2[r % m2, None, :],
                        out=scratch.reshape(len(r), (c1 - c0) // n2, n2))
        else:
            c = np.arange(self.shape[1])[cols]
            np.multiply(self.w1[np.ix_(r // m2, c // n2)], self.w2[np.ix_(r % m2, c % n2)], out=scratch)
        scratch *= np.float32(self.scale)
        block += scratch

    def scaled(self, factor: float) -> Kronecker:
        return Kronecker(self.w1, self.w2, self.scale * factor, self.source, self.part)


Term = LowRank | Kronecker


@dataclass(frozen=True)
class Converted:
    layout: str
    terms: dict[str, list[Term]]  # diffusers transformer weight key -> terms
    text_terms: dict[str, list[Term]] = field(default_factory=dict)  # text-encoder weight key -> terms

    def terms_for(self, component: str) -> dict[str, list[Term]]:
        """The terms of one model component (none for the VAE)."""
        return {"transformer": self.terms, "text_encoder": self.text_terms}.get(component, {})


def _undotted(names: set[str]) -> dict[str, str]:
    return {name.replace(".", "_"): name for name in names}


def _from_underscores(name: str, modules: tuple[set[str], set[str], set[str]], blocks: tuple[str, str]) -> str | None:
    """`double_blocks_3_img_attn_qkv` -> `double_blocks.3.img_attn.qkv` (or None), given the module
    names of the model family and the names of its two block lists."""
    glob, double, single = modules
    if name in _undotted(glob):
        return _undotted(glob)[name]
    for block, inner in zip(blocks, (double, single), strict=True):
        match = re.fullmatch(rf"{block}_(\d+)_(.+)", name)
        if match and match.group(2) in _undotted(inner):
            return f"{block}.{match.group(1)}.{_undotted(inner)[match.group(2)]}"
    return None


def detect(keys: list[str]) -> str:
    """The layout of a file from its keys."""
    if any(".lokr_" in k for k in keys):
        return "LoKr (LyCORIS)" if any(k.startswith(("lycoris_", "lora_te")) for k in keys) else "LoKr (BFL)"
    if any(k.startswith(("lora_unet_", "lora_te")) for k in keys):
        return "kohya / musubi"
    if any(k.startswith(("diffusion_model.", "model.diffusion_model.")) for k in keys):
        return "ai-toolkit / BFL"
    if any(k.startswith(("transformer.", "base_model.model.", "text_encoder.")) for k in keys):
        return "diffusers / PEFT"
    return "unknown"


def _module_parts(module: str, layout: str) -> tuple[Part, ...] | None:
    """The diffusers module(s) a file's module name (suffix removed) stands for."""
    if module.startswith("lora_unet_"):
        bfl = _from_underscores(module.removeprefix("lora_unet_"), bfl_modules(), ("double_blocks", "single_blocks"))
        return diffusers_parts(bfl) if bfl else None
    if module.startswith("lycoris_"):
        name = _from_underscores(module.removeprefix("lycoris_"), diffusers_modules(),
                                 ("transformer_blocks", "single_transformer_blocks"))
        return (Part(name),) if name else None
    for prefix in ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "transformer."):
        if module.startswith(prefix):
            name = module.removeprefix(prefix)
            parts = diffusers_parts(name)
            if parts is not None:
                return parts
            # Already a diffusers name (some exports do this under `diffusion_model.`); the model's
            # key plan decides whether it exists.
            return (Part(name),) if _is_diffusers_name(name) else None
    return None


def _text_encoder_module(module: str) -> str | None:
    """`lora_te_model_layers_3_mlp_up_proj` or `text_encoder.model.layers.3.mlp.up_proj` ->
    `model.layers.3.mlp.up_proj` (the Qwen3 checkpoint's module name), or None."""
    prefix = next((p for p in TEXT_ENCODER_PREFIXES if module.startswith(p)), None)
    if prefix is None:
        return None
    name = module.removeprefix(prefix)
    dot = re.escape(prefix[-1])  # `_` (kohya) or `.` (PEFT)
    match = re.fullmatch(rf"(?:model{dot})?layers{dot}(\d+){dot}(self_attn|mlp){dot}(\w+)", name)
    if match and match.group(3) in _QWEN3_PROJECTIONS[match.group(2)]:
        return f"model.layers.{match.group(1)}.{match.group(2)}.{match.group(3)}"
    return "lm_head" if name == "lm_head" else None


def _is_diffusers_name(name: str) -> bool:
    glob, double, single = diffusers_modules()
    match = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.\d+\.(.+)", name)
    if match:
        return match.group(2) in (double if match.group(1) == "transformer_blocks" else single)
    return name in glob


def _split(key: str) -> tuple[str, str] | None:
    for suffix in SUFFIXES:
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], suffix
    return None


@dataclass(frozen=True)
class PeftScaling:
    """How PEFT scales a module's B @ A, from the config diffusers' `save_lora_weights` stores in
    the header (one config per component, its keys prefixed with the component's name):
    `lora_alpha`, per-module `alpha_pattern` (module-name regexes matched at a dotted suffix, as
    peft's `get_pattern_key` does) and `use_rslora` (alpha / sqrt(rank))."""

    alpha: float | None = None
    pattern: tuple[tuple[str, float], ...] = ()
    rslora: bool = False

    def alpha_for(self, module: str) -> float | None:
        for key, value in self.pattern:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return self.alpha

    def scale(self, alpha: float | None, rank: int) -> float:
        if alpha is None:
            return 1.0
        return alpha / math.sqrt(rank) if self.rslora else alpha / rank


def _peft_scaling(metadata: Mapping[str, str], component: str = "transformer") -> PeftScaling:
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return PeftScaling()
    try:
        config = json.loads(raw)
    except json.JSONDecodeError:
        return PeftScaling()

    def field(name: str) -> Any:  # the component's own first
        return config.get(f"{component}.{name}", config.get(name))

    alpha = field("lora_alpha")
    pattern = field("alpha_pattern")
    return PeftScaling(
        alpha=float(alpha) if isinstance(alpha, int | float) else None,
        pattern=tuple((str(k), float(v)) for k, v in pattern.items()) if isinstance(pattern, dict) else (),
        rslora=field("use_rslora") is True,
    )


def _first(names: list[str], n: int = 5) -> str:
    more = f" (and {len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def convert(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str], where: str) -> Converted:
    """A file's tensors (float32) -> diffusers weight key -> terms. Any key that is not understood
    is an error naming it: nothing is dropped."""
    keys = sorted(tensors)
    layout = detect(keys)
    second = [k for k in keys if k.startswith(_SECOND_TEXT_ENCODER)]
    if second:
        raise UserInputError(f"{where}: {layout} LoRA has keys for a second text encoder, which FLUX.2 [klein] "
                             f"does not have (it has one, Qwen3): {_first(second)}")
    modules: dict[str, dict[str, np.ndarray]] = {}
    unknown = []
    for key in keys:
        split = _split(key)
        if split is None:
            unknown.append(key)
            continue
        modules.setdefault(split[0], {})[split[1]] = tensors[key]
    if unknown:
        raise UserInputError(f"{where}: {layout} LoRA has keys flux2klein does not understand "
                             f"(not LoRA or LoKr factors): {_first(unknown)}")
    peft, text_peft = _peft_scaling(metadata), _peft_scaling(metadata, "text_encoder")
    terms: dict[str, list[Term]] = {}
    text_terms: dict[str, list[Term]] = {}
    unmatched, text_unmatched = [], []
    for module, factors in modules.items():
        if module.startswith(TEXT_ENCODER_PREFIXES):
            name = _text_encoder_module(module)
            if name is None:
                text_unmatched.append(module)
                continue
            for part, term in _terms(module, factors, (Part(name),), text_peft, where, layout):
                text_terms.setdefault(f"{part.module}.weight", []).append(term)
            continue
        parts = _module_parts(module, layout)
        if parts is None:
            unmatched.append(module)
            continue
        for part, term in _terms(module, factors, parts, peft, where, layout):
            terms.setdefault(f"{part.module}.weight", []).append(term)
    if unmatched:
        raise UserInputError(f"{where}: {layout} LoRA names modules the FLUX.2 [klein] transformer does not "
                             f"have: {_first(unmatched)}")
    if text_unmatched:
        raise UserInputError(f"{where}: {layout} LoRA names text-encoder modules the FLUX.2 [klein] text encoder "
                             f"(Qwen3) does not have: {_first(text_unmatched)}")
    if not terms and not text_terms:
        raise UserInputError(f"{where}: no LoRA or LoKr factors in this file (layout: {layout})")
    return Converted(layout, terms, text_terms)


def _matrix(factors: dict[str, np.ndarray], name: str) -> tuple[np.ndarray | None, int | None]:
    """A LoKr factor, full or as the product of its two halves (with the rank of that product)."""
    if name in factors:
        return factors[name], None
    if f"{name}_a" in factors and f"{name}_b" in factors:
        return factors[f"{name}_a"] @ factors[f"{name}_b"], factors[f"{name}_b"].shape[0]
    return None, None


def _terms(module: str, factors: dict[str, np.ndarray], parts: tuple[Part, ...], peft: PeftScaling,
           where: str, layout: str) -> list[tuple[Part, Term]]:
    alpha = float(factors["alpha"].reshape(())) if "alpha" in factors else None
    if any(s in factors for s in LOKR_SUFFIXES):
        w1, rank1 = _matrix(factors, "lokr_w1")
        w2, rank2 = _matrix(factors, "lokr_w2")
        if w1 is None or w2 is None or w1.ndim != 2 or w2.ndim != 2:
            raise UserInputError(f"{where}: {layout} module {module} lacks a 2-D lokr_w1 or lokr_w2")
        rank = rank2 or rank1
        scale = alpha / rank if alpha is not None and rank else 1.0
        return [(part, Kronecker(w1, w2, scale, module, part)) for part in parts]
    down = next((factors[s] for s in _DOWN if s in factors), None)
    up = next((factors[s] for s in _UP if s in factors), None)
    if down is None or up is None or down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]:
        raise UserInputError(f"{where}: {layout} module {module} lacks a matching 2-D down (A) and up (B) pair")
    rank = down.shape[0]
    if alpha is not None:  # an `.alpha` key (kohya, ai-toolkit): alpha / rank
        scale = alpha / rank
    else:  # PEFT's config, by the module's name in the model PEFT adapted
        scale = peft.scale(peft.alpha_for(parts[0].module), rank)
    return [(part, LowRank(down, _rows(up, part), scale, module)) for part in parts]
