"""The manifest of a converted directory (converted.py), read and checked without jax or flax:
opening a `--model` checks it before a run's heavy imports, so a stale or incomplete directory
is refused at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flux2klein_cli.core.choices import LAYOUTS
from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.hub.snapshot import CONVERTED_MANIFEST
from flux2klein_cli.core.weights.configs import read_json
from flux2klein_cli.core.weights.flat_index import FLAT_DIR, read_index

FORMAT = "flux2klein-converted"
# Stored arrays are named by the models' parameter paths (`param_key`), so a change of a model's
# tree is a new version. 3: the transformer's tree mirrors diffusers' (`to_out.0`,
# `time_guidance_embed`, `*.linear`). Older directories (2, and 1 under the format name
# "flux2klein-orbax") are refused with a message to convert again.
FORMAT_VERSION = 3
_KNOWN_FORMATS = (FORMAT, "flux2klein-orbax")
MODEL_COMPONENTS = ("transformer", "text_encoder", "vae")
COPIED_COMPONENTS = ("tokenizer", "scheduler")


def quantize_scheme(manifest: dict[str, Any], name: str) -> str | None:
    """The quantization a component was written with (`convert --quantize`), None for none."""
    scheme = (manifest.get("components", {}).get(name) or {}).get("quantize")
    return None if scheme in (None, "none") else str(scheme)


def prequantized_forms(manifest: dict[str, Any], name: str) -> tuple[tuple[str, str], ...]:
    """The linears a component keeps in the form its quantized source file stored them in (convert of a
    GGUF / ComfyUI file: core/weights/prequantized.py), as sorted (dotted module path, form) pairs."""
    forms = (manifest.get("components", {}).get(name) or {}).get("prequantized") or {}
    return tuple(sorted((str(path), str(form)) for path, form in forms.items()))


def read_manifest(root: str | Path) -> dict[str, Any]:
    """The manifest of a converted directory, checked for format and version."""
    root = Path(root)
    manifest = read_json(root / CONVERTED_MANIFEST)
    fmt, version = manifest.get("format"), manifest.get("format_version")
    if fmt not in _KNOWN_FORMATS:
        raise CheckpointError(f"{root / CONVERTED_MANIFEST}: not a flux2klein convert manifest")
    if (fmt, version) != (FORMAT, FORMAT_VERSION):
        raise CheckpointError(
            f"{root}: converted with format version {version}, this flux2klein reads version {FORMAT_VERSION}; "
            "convert the source snapshot again"
        )
    return manifest


def component_layout(manifest: dict[str, Any], name: str) -> str:
    """The layout a component was written in ("flat" or "orbax")."""
    entry = manifest.get("components", {}).get(name) or {}
    layout = entry.get("layout")
    if layout not in LAYOUTS:
        raise CheckpointError(f"manifest: component {name!r} has unknown layout {layout!r}")
    return layout


def check_converted(root: str | Path) -> dict[str, Any]:
    """Raise a CheckpointError unless `root` is a complete converted directory; return its manifest.
    Cheap: reads the manifest, and for flat components their index and data file header."""
    root = Path(root)
    manifest = read_manifest(root)
    missing = [f"{name}/config.json" for name in MODEL_COMPONENTS if not (root / name / "config.json").is_file()]
    for name in MODEL_COMPONENTS:
        layout = component_layout(manifest, name)
        where = root / name / layout
        if layout == "orbax" and not (where / "_CHECKPOINT_METADATA").is_file():
            missing.append(f"{name}/orbax")
        elif layout == "flat" and not where.is_dir():
            missing.append(f"{name}/flat")
    missing += [f"{name}/" for name in COPIED_COMPONENTS if not (root / name).is_dir()]
    if not (root / "model_index.json").is_file():
        missing.append("model_index.json")
    if missing:
        raise CheckpointError(f"{root}: incomplete converted directory, missing {', '.join(missing)}")
    for name in MODEL_COMPONENTS:
        if component_layout(manifest, name) == "flat":
            read_index(root / name / FLAT_DIR)
    return manifest
