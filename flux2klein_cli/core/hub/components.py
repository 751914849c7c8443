"""`--transformer PATH` and `--vae PATH`: one component of `--model` taken from elsewhere.

PATH is a diffusers component folder, a single .safetensors file in diffusers keys, a single
file in BFL's transformer layout (recognised from its keys when it is read, see
core/weights/bfl_layout.py), a quantized transformer file (a .gguf file, or a ComfyUI-format
fp8 / nvfp4 .safetensors file: core/weights/checkpoints.py), or a component alias
(`small-decoder`, a hub repo). A file brings
no config: the `--model` snapshot's config of that component is used, and weights whose shapes
disagree with it are a CheckpointError naming the keys.

The overridden model is *composed*: a directory in the flux2klein cache holding
model_index.json and a link to each component folder, where an overridden component is a folder
of its config and links to its weight files. Every command that takes a snapshot directory
(load, compile, bench, parity, convert, inspect) takes a composed one unchanged; its name is a
hash of the sources, so the same overrides give the same directory (and the same executables).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flux2klein_cli.core.cache_paths import composed_dir
from flux2klein_cli.core.errors import CheckpointError, Flux2KleinError, UserInputError
from flux2klein_cli.core.hub.registry import COMPONENT_REPOS
from flux2klein_cli.core.hub.snapshot import (
    CONVERTED_MANIFEST,
    component_folder,
    resolve,
    resolve_model,
)

OVERRIDABLE = ("transformer", "vae")
_MANIFEST = "flux2klein-components.json"  # in a composed directory: what it was built from


@dataclass(frozen=True)
class ComponentSource:
    """One overridden component: what the user gave, and the weights (a folder or one file)."""

    name: str
    given: str
    weights: Path
    config: Path | None  # the folder's own config.json; None: the --model snapshot's

    def describe(self) -> dict[str, Any]:
        kind = "folder" if self.weights.is_dir() else "file"
        return {"source": self.given, "path": str(self.weights), "kind": kind}


def resolve_component(name: str, given: str, *, offline: bool | None = None, download: bool = False
                      ) -> ComponentSource:
    """The weights `given` for component `name` (a path or an alias), checked to exist."""
    if name not in OVERRIDABLE:
        raise AssertionError(name)
    flag = f"--{name}"
    alias = given.strip().lower()
    if alias in COMPONENT_REPOS:
        component, _ = COMPONENT_REPOS[alias]
        if component != name:
            raise UserInputError(f"{flag} {given}: {alias} is a {component}, not a {name}")

        folder = component_folder(resolve(alias, offline=offline, download=download).path)
        return ComponentSource(name, alias, folder, folder / "config.json")
    path = Path(given).expanduser()
    if path.is_dir():
        config = path / "config.json"
        weights = sorted(path.glob("*.safetensors"))
        if not weights:
            raise UserInputError(f"{flag} {given}: no .safetensors weights in this folder")
        for file in weights:
            _check_weights(flag, f"{given.rstrip('/')}/{file.name}", file)
        return ComponentSource(name, given, path.resolve(), config.resolve() if config.is_file() else None)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            if name != "transformer":
                raise UserInputError(f"{flag} {given}: a .gguf file holds a transformer, not a {name}")
            _check_gguf(flag, given, path)
            return ComponentSource(name, given, path.resolve(), None)
        if path.suffix != ".safetensors":
            raise UserInputError(f"{flag} {given}: expected a .safetensors or .gguf file or a component folder")
        _check_weights(flag, given, path)
        return ComponentSource(name, given, path.resolve(), None)
    aliases = ", ".join(a for a, (c, _) in COMPONENT_REPOS.items() if c == name)
    hint = f", or an alias ({aliases})" if aliases else ""
    raise UserInputError(f"{flag} {given}: no such file or folder (give a component folder, a .safetensors file{hint})")


def _check_weights(flag: str, given: str, file: Path) -> None:
    """A weight file's header read before anything is composed, so that a file that is not
    safetensors is named as the user gave it (not by its link in the cache) and nothing is written."""
    from flux2klein_cli.core.weights.safetensors_io import read_header

    try:
        tensors = read_header(file)
    except CheckpointError as e:
        reason = str(e).removeprefix(f"{file}: ")
        raise CheckpointError(f"{flag} {given}: not a usable .safetensors file: {reason}") from None
    except (AttributeError, TypeError, KeyError, ValueError):  # JSON of the wrong shape
        raise CheckpointError(f"{flag} {given}: not a usable .safetensors file: corrupt header") from None
    if not tensors:
        raise CheckpointError(f"{flag} {given}: the .safetensors file holds no tensors")
    from flux2klein_cli.core.weights.comfy_quant import is_comfy_quant, open_comfy
    from flux2klein_cli.core.weights.safetensors_io import read_metadata

    if is_comfy_quant(tensors, read_metadata(file)):
        try:
            open_comfy(file)  # its quantization records and scales, checked before anything is composed
        except CheckpointError as e:
            reason = str(e).removeprefix(f"{file}: ")
            raise CheckpointError(f"{flag} {given}: not a usable quantized file: {reason}") from None


def _check_gguf(flag: str, given: str, file: Path) -> None:
    """A GGUF file's header read before anything is composed (a damaged file or a type not read is
    named as the user gave it, and nothing is written)."""
    from flux2klein_cli.core.weights.gguf_file import open_gguf

    try:
        open_gguf(file)
    except CheckpointError as e:
        reason = str(e).removeprefix(f"{file}: ")
        raise CheckpointError(f"{flag} {given}: not a usable GGUF file: {reason}") from None


def resolve_overrides(transformer: str | None = None, vae: str | None = None, *, offline: bool | None = None,
                      download: bool = False) -> dict[str, ComponentSource]:
    given = {"transformer": transformer, "vae": vae}
    return {name: resolve_component(name, value, offline=offline, download=download)
            for name, value in given.items() if value}


def resolve_composed(model: str, transformer: str | None = None, vae: str | None = None, **resolve_options: Any
                     ) -> Path:
    """`snapshot.resolve_model(model)`, composed with the overrides: what a model command opens."""

    sources = resolve_overrides(transformer, vae, offline=resolve_options.get("offline"),
                                download=resolve_options.get("download", False))
    return compose(resolve_model(model, **resolve_options), sources)


def _identity(model_dir: Path, sources: dict[str, ComponentSource]) -> str:
    """The composed directory's name: the model and each source, with sizes and times, so a
    file replaced in place gives a new directory."""
    parts = [str(model_dir)]
    for name, source in sorted(sources.items()):
        files = sorted(source.weights.iterdir()) if source.weights.is_dir() else [source.weights]
        parts += [name, str(source.weights)] + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def compose(model_dir: Path, sources: dict[str, ComponentSource]) -> Path:
    """`model_dir` with `sources` in place of its components (itself when there are none)."""
    if not sources:
        return model_dir
    model_dir = Path(model_dir).resolve()
    if (model_dir / CONVERTED_MANIFEST).is_file():
        raise UserInputError(f"{model_dir} is a converted directory: {{field:transformer}} / {{field:vae}} apply to "
                             "a diffusers "
                             "snapshot (convert the overridden snapshot instead)")
    if not (model_dir / "model_index.json").is_file():
        raise UserInputError(f"{model_dir}: no model_index.json (not a FLUX.2 [klein] snapshot)")
    parent = composed_dir()
    final = parent / _identity(model_dir, sources)
    if (final / _MANIFEST).is_file():
        return final
    try:
        return _write_composed(model_dir, sources, parent, final)
    except OSError as e:  # a full or read-only cache: one line, exit 1
        raise Flux2KleinError(f"cannot compose the model in {parent}: {e.strerror or e}") from None


def _write_composed(model_dir: Path, sources: dict[str, ComponentSource], parent: Path, final: Path) -> Path:
    from flux2klein_cli.core.hub.layout import COMPONENTS
    from flux2klein_cli.core.temporaries import temporary_dir

    parent.mkdir(parents=True, exist_ok=True)
    with temporary_dir(parent, final.name) as tmp:
        shutil.copyfile(model_dir / "model_index.json", tmp / "model_index.json")
        for component in COMPONENTS:
            source = sources.get(component)
            if source is None:
                os.symlink(model_dir / component, tmp / component, target_is_directory=True)
                continue
            folder = tmp / component
            folder.mkdir()
            shutil.copyfile(source.config or model_dir / component / "config.json", folder / "config.json")
            if source.weights.is_dir():
                weights = [f for f in sorted(source.weights.iterdir()) if ".safetensors" in f.name]
            else:
                weights = [source.weights]
            if len(weights) == 1:
                # One file under diffusers' own name: diffusers (parity) reads a diffusers-key file too.
                suffix = ".gguf" if weights[0].suffix.lower() == ".gguf" else ".safetensors"
                os.symlink(weights[0], folder / f"diffusion_pytorch_model{suffix}")
            for file in weights if len(weights) > 1 else ():
                os.symlink(file, folder / file.name)
        manifest = {"model": str(model_dir), "components": {n: s.describe() for n, s in sources.items()}}
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1))
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / _MANIFEST).is_file():  # not a concurrent writer's identical result
                raise
    return final


def composed_sources(model_dir: Path) -> dict[str, Any]:
    """The component sources recorded in a composed directory ({} for any other)."""
    try:
        return json.loads((Path(model_dir) / _MANIFEST).read_text())["components"]
    except (OSError, ValueError, KeyError):
        return {}
