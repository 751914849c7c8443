"""Model aliases: hub repo ids, sampling defaults and the published geometries.

The geometries let compile-only work (benchmarks, TPU capacity checks) build the real
models abstractly without any weights on disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flux2klein_cli.core.errors import UserInputError

# What every FLUX.2 [klein] transformer config shares, the published ones and the random-weight
# geometries of core/hub/random_checkpoint.py alike: the one home of these values.
TRANSFORMER_COMMON = dict(
    patch_size=1, in_channels=128, out_channels=None, timestep_guidance_channels=256, mlp_ratio=3.0,
    rope_theta=2000, eps=1e-6, guidance_embeds=False,
)
_SHARED_TRANSFORMER = dict(TRANSFORMER_COMMON, attention_head_dim=128, axes_dims_rope=[32, 32, 32, 32])
TRANSFORMER_4B = dict(_SHARED_TRANSFORMER, num_layers=5, num_single_layers=20, num_attention_heads=24,
                      joint_attention_dim=7680)
TRANSFORMER_9B = dict(_SHARED_TRANSFORMER, num_layers=8, num_single_layers=24, num_attention_heads=32,
                      joint_attention_dim=12288)
_SHARED_QWEN3 = dict(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960)
QWEN3_4B = dict(_SHARED_QWEN3, hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True)
QWEN3_8B = dict(_SHARED_QWEN3, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)


@dataclass(frozen=True)
class ModelSpec:
    alias: str
    repo_id: str
    distilled: bool
    kv: bool
    transformer: dict[str, Any] = field(repr=False)
    text_encoder: dict[str, Any] = field(repr=False)
    geometry: str = "4b"  # its published geometry (core/hub/random_checkpoint.PRESETS), for compile-only work


@dataclass(frozen=True)
class Sampling:
    steps: int
    guidance: float
    cfg: bool = False  # real classifier-free guidance: a negative pass beside the positive one


# Distilled models sample in 4 steps without CFG; base models take diffusers' 50 steps at guidance 4.
_DISTILLED, _BASE = Sampling(4, 1.0), Sampling(50, 4.0)


def sampling(distilled: bool, steps: int | None = None, guidance: float | None = None) -> Sampling:
    """The steps and guidance of a run: those given, else the model's defaults; and whether it
    runs real classifier-free guidance: only undistilled models with guidance above 1, as the
    reference does (the one home of that rule)."""
    default = _DISTILLED if distilled else _BASE
    chosen = default.guidance if guidance is None else guidance
    return Sampling(steps or default.steps, chosen, not distilled and chosen > 1.0)


MODELS: dict[str, ModelSpec] = {
    spec.alias: spec
    for spec in (
        ModelSpec("4b", "black-forest-labs/FLUX.2-klein-4B", True, False, TRANSFORMER_4B, QWEN3_4B),
        ModelSpec("9b", "black-forest-labs/FLUX.2-klein-9B", True, False, TRANSFORMER_9B, QWEN3_8B, "9b"),
        ModelSpec("9b-kv", "black-forest-labs/FLUX.2-klein-9b-kv", True, True, TRANSFORMER_9B, QWEN3_8B, "9b"),
        ModelSpec("base-4b", "black-forest-labs/FLUX.2-klein-base-4B", False, False, TRANSFORMER_4B, QWEN3_4B),
        ModelSpec("base-9b", "black-forest-labs/FLUX.2-klein-base-9B", False, False, TRANSFORMER_9B, QWEN3_8B, "9b"),
    )
}


# Hub repos that hold one component, usable as `--vae ALIAS` (and `fetch ALIAS`): alias -> (component, repo).
COMPONENT_REPOS: dict[str, tuple[str, str]] = {
    "small-decoder": ("vae", "black-forest-labs/FLUX.2-small-decoder"),
}


def spec_for(alias: str) -> ModelSpec:
    try:
        return MODELS[alias.lower()]
    except KeyError:
        raise UserInputError(f"unknown model {alias!r}: known models are {', '.join(MODELS)}") from None


# Random-weight models written on first use, without network (core/hub/snapshot.py): for trying the tool.
DEFAULT_MODEL = "4b"  # every command's --model default
DEFAULT_KV_MODEL = "9b-kv"  # `edit --kv`'s, the one KV-trained model
TINY_ALIAS = "tiny"
TINY_KV_ALIAS = "tiny-kv"  # the same geometry as a Flux2KleinKVPipeline (like 9b-kv)


def aliases(*, tiny: bool = True) -> str:
    """The aliases `--model` takes, for help texts."""
    return ", ".join([*MODELS, *((TINY_ALIAS, TINY_KV_ALIAS) if tiny else ())])


def default_size(model: str) -> int:
    """The output side when none is given (core/defaults.py): the tiny models' is smaller."""
    from flux2klein_cli.core.defaults import DEFAULTS

    return DEFAULTS.tiny_side if model.lower() in (TINY_ALIAS, TINY_KV_ALIAS) else DEFAULTS.side
