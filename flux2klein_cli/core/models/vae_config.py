"""The VAE's config.json, read and checked without jax: the latent geometry of a run is known
before anything heavy is imported (core/pipeline/geometry.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flux2klein_cli.core.errors import CheckpointError

_DOWN_BLOCK = "DownEncoderBlock2D"
_UP_BLOCK = "UpDecoderBlock2D"


def _ints(value: Any, field: str) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise CheckpointError(f"vae config: {field!r} must be a non-empty list of integers, got {value!r}")
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class VAEConfig:
    """The fields of the diffusers `AutoencoderKLFlux2` config.json that shape the model."""

    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    decoder_block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    latent_channels: int = 32
    norm_num_groups: int = 32
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True
    batch_norm_eps: float = 1e-4
    patch_size: tuple[int, int] = (2, 2)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> VAEConfig:
        """Read a diffusers config dict; missing fields take diffusers' defaults."""
        defaults = cls()
        blocks = _ints(d.get("block_out_channels", defaults.block_out_channels), "block_out_channels")
        dec = d.get("decoder_block_out_channels")
        dec_blocks = blocks if dec is None else _ints(dec, "decoder_block_out_channels")
        act = d.get("act_fn", "silu")
        if act not in ("silu", "swish"):
            raise CheckpointError(f"vae config: act_fn {act!r} is not supported (FLUX.2 uses 'silu')")
        if len(dec_blocks) != len(blocks):
            # Both sides must scale by the same factor or decode(encode(x)) changes size.
            raise CheckpointError(
                f"vae config: decoder_block_out_channels {list(dec_blocks)} and block_out_channels "
                f"{list(blocks)} must have the same length"
            )
        # Block types decide the block count in diffusers; only the plain KL blocks exist here.
        for field, kind, count in (
            ("down_block_types", _DOWN_BLOCK, len(blocks)),
            ("up_block_types", _UP_BLOCK, len(dec_blocks)),
        ):
            types = d.get(field)
            if types is not None and (list(types) != [kind] * count):
                raise CheckpointError(
                    f"vae config: {field} must be {count} x {kind!r} to match the block widths, got {types!r}"
                )
        patch = _ints(d.get("patch_size", defaults.patch_size), "patch_size")
        if patch != (2, 2):
            # The pipeline's patchify is hard-coded 2x2, whatever the config says.
            raise CheckpointError(f"vae config: patch_size must be [2, 2], got {list(patch)}")
        cfg = cls(
            in_channels=int(d.get("in_channels", defaults.in_channels)),
            out_channels=int(d.get("out_channels", defaults.out_channels)),
            block_out_channels=blocks,
            decoder_block_out_channels=dec_blocks,
            layers_per_block=int(d.get("layers_per_block", defaults.layers_per_block)),
            latent_channels=int(d.get("latent_channels", defaults.latent_channels)),
            norm_num_groups=int(d.get("norm_num_groups", defaults.norm_num_groups)),
            use_quant_conv=bool(d.get("use_quant_conv", defaults.use_quant_conv)),
            use_post_quant_conv=bool(d.get("use_post_quant_conv", defaults.use_post_quant_conv)),
            mid_block_add_attention=bool(d.get("mid_block_add_attention", defaults.mid_block_add_attention)),
            batch_norm_eps=float(d.get("batch_norm_eps", defaults.batch_norm_eps)),
            patch_size=(2, 2),
        )
        bad = [c for c in (*blocks, *dec_blocks) if c % cfg.norm_num_groups]
        if bad:
            raise CheckpointError(
                f"vae config: block widths {bad} are not divisible by norm_num_groups {cfg.norm_num_groups}"
            )
        return cfg

    @property
    def spatial_factor(self) -> int:
        """Pixels per latent token side: one halving per encoder block but the last, then the patch."""
        return 2 ** (len(self.block_out_channels) - 1) * self.patch_size[0]

    @property
    def patched_channels(self) -> int:
        return math.prod(self.patch_size) * self.latent_channels
