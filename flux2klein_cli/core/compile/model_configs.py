"""A `--model`'s three component configs and pipeline flags, read from its folder or the
registry without building or loading anything: what planning a run and checking its fields
need. Nothing heavy is imported here for a snapshot, a converted directory or an alias (jax and flax
only for a quantized file), so a bad field or model fails before the heavy imports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flux2klein_cli.core.errors import Flux2KleinError
from flux2klein_cli.core.pipeline.geometry import LatentGeometry


@dataclass(frozen=True)
class ModelConfigs:
    """The three component configs (as their config.json files hold them) and pipeline flags."""

    transformer: dict[str, Any]
    text_encoder: dict[str, Any]
    vae: dict[str, Any]
    distilled: bool
    kv: bool
    source: str  # the directory read, or "registry:<alias>" for a published geometry
    quantize: str | None = None  # `convert --quantize` scheme of the transformer and text encoder
    # The transformer's linears a quantized file keeps in its stored form: (dotted module path, form)
    # pairs (core/weights/prequantized.py), as the loader builds them.
    prequantized: tuple[tuple[str, str], ...] = ()

    @property
    def geometry(self) -> LatentGeometry:
        """Pixels per token and latent channels (a CheckpointError if the configs disagree)."""
        return LatentGeometry.from_configs(self.vae, self.transformer)


def model_configs(model: str, transformer: str | None = None, vae: str | None = None) -> ModelConfigs:
    """Configs of a `--model`: a local or converted directory, `tiny`, or a cached hub snapshot;
    an alias that is not cached (4b, 9b, ...) uses the registry's published geometry, so
    compiling for the real models needs no download. `transformer` / `vae`: --transformer /
    --vae (core/hub/components.py); their configs come with them, so the model must be here."""
    from flux2klein_cli.core.hub.registry import MODELS
    from flux2klein_cli.core.hub.snapshot import resolve

    if transformer or vae:
        from flux2klein_cli.core.hub.components import resolve_composed

        return configs_from_snapshot(resolve_composed(model, transformer, vae, offline=True))

    try:
        return configs_from_snapshot(resolve(model, offline=True).path)
    except Flux2KleinError:
        if model.strip().lower() not in MODELS:
            raise
    return configs_from_registry(model.strip().lower())


def configs_from_snapshot(root: str | Path) -> ModelConfigs:
    from flux2klein_cli.core.hub.layout import Snapshot
    from flux2klein_cli.core.weights.configs import read_config

    snapshot = Snapshot.open(root)
    configs = {name: read_config(snapshot.component(name)) for name in ("transformer", "text_encoder", "vae")}
    quantize = None
    if snapshot.converted:
        from flux2klein_cli.core.weights.converted_manifest import quantize_scheme, read_manifest

        quantize = quantize_scheme(read_manifest(snapshot.root), "transformer")
    return ModelConfigs(**configs, distilled=snapshot.is_distilled, kv=snapshot.kv, source=str(snapshot.root),
                        quantize=quantize, prequantized=_prequantized(snapshot.root, snapshot.converted))


def _prequantized(root: Path, converted: bool) -> tuple[tuple[str, str], ...]:
    """The linears the transformer keeps in a quantized file's stored form (core/weights/prequantized.py):
    from the file's header, or from the manifest of a directory `convert` wrote from one."""
    from flux2klein_cli.core.weights.checkpoints import quantized_file

    if converted:
        from flux2klein_cli.core.weights.converted_manifest import prequantized_forms, read_manifest

        return prequantized_forms(read_manifest(root), "transformer")
    if quantized_file(root / "transformer") is None:
        return ()  # a plain snapshot: nothing heavy imported
    import jax.numpy as jnp

    from flux2klein_cli.core.weights import converted as conv
    from flux2klein_cli.core.weights.configs import read_config
    from flux2klein_cli.core.weights.prequantized import component_forms

    model = conv.abstract_component("transformer", read_config(root / "transformer"), jnp.float32)
    return component_forms(root / "transformer", model, conv.components()["transformer"].plan_for)


def configs_from_registry(alias: str) -> ModelConfigs:
    from flux2klein_cli.core.hub import random_checkpoint as rc
    from flux2klein_cli.core.hub.registry import spec_for

    spec = spec_for(alias)
    geometry = rc.preset(spec.geometry)
    return ModelConfigs(
        transformer=rc.transformer_config_json(geometry),
        text_encoder=rc.text_encoder_config_json(geometry, geometry.text_encoder["vocab_size"]),
        vae=rc.vae_config_json(geometry), distilled=spec.distilled, kv=spec.kv, source=f"registry:{spec.alias}",
    )
