"""A local FLUX.2 [klein] snapshot in the diffusers layout: what `model_index.json` and the
component folders say, read without jax (a bad `--model` fails before the heavy imports)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flux2klein_cli.core.errors import CheckpointError, UserInputError
from flux2klein_cli.core.weights.configs import read_json

PIPELINE_CLASSES = ("Flux2KleinPipeline", "Flux2KleinKVPipeline")
COMPONENTS = ("transformer", "text_encoder", "vae", "tokenizer", "scheduler")


@dataclass(frozen=True)
class Snapshot:
    """What `model_index.json` says about a snapshot directory. `converted` is True for a
    directory written by `flux2klein convert` (recognised by its manifest, checked complete)."""

    root: Path
    pipeline_class: str
    is_distilled: bool
    converted: bool = False

    @property
    def kv(self) -> bool:
        """Trained for the reference KV cache (9B-KV)."""
        return self.pipeline_class == "Flux2KleinKVPipeline"

    @classmethod
    def open(cls, root: str | Path) -> Snapshot:
        from flux2klein_cli.core.hub.snapshot import CONVERTED_MANIFEST

        root = Path(root)
        if not root.is_dir():
            raise UserInputError(f"{root}: no such model directory")
        converted = (root / CONVERTED_MANIFEST).is_file()
        if converted:
            from flux2klein_cli.core.weights.converted_manifest import check_converted

            check_converted(root)
        index = read_json(root / "model_index.json")
        name = index.get("_class_name")
        if name not in PIPELINE_CLASSES:
            raise CheckpointError(
                f"{root / 'model_index.json'}: pipeline {name!r} is not FLUX.2 [klein] "
                f"(expected one of {', '.join(PIPELINE_CLASSES)})"
            )
        missing = [c for c in COMPONENTS if not (root / c).is_dir()]
        if missing:
            raise CheckpointError(f"{root}: component folder(s) missing: {', '.join(missing)}")
        # The KV pipeline's default is distilled; the plain one's is not.
        return cls(root, name, bool(index.get("is_distilled", name == "Flux2KleinKVPipeline")), converted)

    def component(self, name: str) -> Path:
        return self.root / name
