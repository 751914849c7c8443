"""The latent geometry a checkpoint's configs describe: how many pixels one token covers and
how many channels it carries.

The VAE halves the image once per encoder level but the last, then the pipeline folds each
patch of latents into one token: pixels per token = 2 ** (levels - 1) x patch side, channels
= latent_channels x patch area (16 and 128 for the published klein models). The transformer
reads and writes tokens of exactly that width, so its `in_channels` must agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flux2klein_cli.core.errors import CheckpointError

if TYPE_CHECKING:
    from flux2klein_cli.core.models.vae_config import VAEConfig


@dataclass(frozen=True)
class LatentGeometry:
    pixels_per_token: int  # image pixels per token side (a size must be a multiple of it)
    channels: int  # latent channels per token, the transformer's in_channels

    @classmethod
    def from_configs(cls, vae: Mapping[str, Any], transformer: Mapping[str, Any]) -> LatentGeometry:
        """From the VAE's and the transformer's config.json; a pair the pipeline cannot run
        together is a CheckpointError naming the field."""
        from flux2klein_cli.core.models.vae_config import VAEConfig

        in_channels = int(transformer.get("in_channels", 128))  # diffusers' default, as TransformerConfig
        out_channels = int(transformer.get("out_channels") or in_channels)
        # VAEConfig.from_dict checks block widths and patch_size.
        return cls.of(VAEConfig.from_dict(vae), in_channels, out_channels)

    @classmethod
    def of(cls, vae_cfg: VAEConfig, in_channels: int, out_channels: int) -> LatentGeometry:
        """From a parsed VAEConfig and the transformer's channel counts."""
        channels = vae_cfg.patched_channels
        if in_channels != channels:
            raise CheckpointError(
                f"transformer config: in_channels is {in_channels}, but the VAE's latent_channels x patch area "
                f"is {vae_cfg.latent_channels} x {vae_cfg.patch_size[0] * vae_cfg.patch_size[1]} = {channels}"
            )
        if out_channels != channels:
            raise CheckpointError(
                f"transformer config: out_channels is {out_channels}, but the denoise loop needs the latent width "
                f"{channels} (in_channels)"
            )
        return cls(pixels_per_token=vae_cfg.spatial_factor, channels=channels)

    @classmethod
    def of_snapshot(cls, root: str | Path) -> LatentGeometry:
        """From a snapshot or converted directory's configs (no weights read)."""
        from flux2klein_cli.core.hub.layout import Snapshot
        from flux2klein_cli.core.weights.configs import read_config

        snapshot = Snapshot.open(root)
        return cls.from_configs(read_config(snapshot.component("vae")), read_config(snapshot.component("transformer")))

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The token grid (rows, columns) of an image of this size."""
        return height // self.pixels_per_token, width // self.pixels_per_token

    def tokens(self, height: int, width: int) -> int:
        h, w = self.grid(height, width)
        return h * w

    def latents_shape(self, batch: int, height: int, width: int) -> tuple[int, int, int, int]:
        """diffusers' `latents=` layout: (B, channels, H / pixels_per_token, W / pixels_per_token)."""
        return (batch, self.channels, *self.grid(height, width))

    def fits(self, height: int, width: int) -> bool:
        return height > 0 and width > 0 and not height % self.pixels_per_token and not width % self.pixels_per_token

    def as_key(self) -> dict[str, int]:
        return {"pixels_per_token": self.pixels_per_token, "channels": self.channels}
