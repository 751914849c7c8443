"""`--lora PATH_OR_REPO[:SCALE]`: the argument, the file it names, and what is read from it."""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flux2klein_cli.core.errors import CheckpointError, FieldError
from flux2klein_cli.core.lora.layouts import Converted, convert
from flux2klein_cli.core.weights.safetensors_io import read_header

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What `fetch` downloads of a LoRA repo: the weights and their descriptions.
LORA_ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.md"]


@dataclass(frozen=True)
class LoraSpec:
    """One `--lora` argument: where the file is (a path or a hub repo id) and its strength."""

    source: str
    scale: float = 1.0

    @classmethod
    def parse(cls, text: str) -> LoraSpec:
        """`PATH_OR_REPO[:SCALE]`. A colon followed by something that is not a number belongs to
        the path (a Windows drive, a file name with a colon) unless what precedes it is a file
        there or a .safetensors name: then the tail was meant as a scale, and is a bad one."""
        source, colon, tail = text.rpartition(":")
        if colon and source:
            try:
                scale = float(tail)
            except ValueError:
                if not Path(text).exists() and (Path(source).exists() or source.endswith(".safetensors")):
                    raise FieldError("lora", f"{text}: the scale {tail!r} is not a number "
                                         "(PATH_OR_REPO[:SCALE], e.g. style.safetensors:0.8)") from None
                return cls(text)
            if not math.isfinite(scale):
                raise FieldError("lora", f"{text}: the scale must be a finite number")
            return cls(source, scale)
        if not text.strip():
            raise FieldError("lora", "needs a path or a hub repo id")
        return cls(text)


@dataclass(frozen=True)
class LoraFile:
    """A LoRA read and converted: where it came from, its content hash, its scale, its factors."""

    spec: LoraSpec
    path: Path
    sha256: str
    converted: Converted

    def record(self) -> dict[str, object]:
        """What PNG metadata and --json say about it."""
        return dict(path=self.spec.source, file=str(self.path), sha256=self.sha256, scale=self.spec.scale,
                    layout=self.converted.layout)


def _one_file(folder: Path, where: str) -> Path:
    files = sorted(folder.glob("*.safetensors"))
    if len(files) != 1:
        found = ", ".join(f.name for f in files) or "none"
        raise FieldError("lora", f"{where}: a LoRA folder must hold exactly one .safetensors file "
                             f"(found: {found}); name the file")
    return files[0]


def fetch_lora(repo_id: str, *, offline: bool = False, download: bool = False, tqdm_class: object = None) -> Path:
    """A hub LoRA repo's snapshot in the HF cache (downloaded when asked and not offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from flux2klein_cli.core.hub.snapshot import hub_offline

    try:
        return Path(snapshot_download(repo_id, allow_patterns=LORA_ALLOW_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    fetch = f"flux2klein fetch --lora {repo_id}"
    if offline or hub_offline():
        raise CheckpointError(f"LoRA {repo_id} is not in the Hugging Face cache and offline mode is on; "
                              f"with network access, run: {fetch}")
    if not download:
        raise CheckpointError(f"LoRA {repo_id} is not in the Hugging Face cache; download it with: {fetch}")
    from flux2klein_cli.core.hub.snapshot import _download

    return _download(repo_id, None, tqdm_class, LORA_ALLOW_PATTERNS)


def resolve_lora(spec: LoraSpec) -> Path:
    """The .safetensors file a spec names: a file, a folder holding one, or a cached hub repo."""
    local = Path(spec.source).expanduser()
    if local.is_file():
        if local.suffix != ".safetensors":
            raise FieldError("lora", f"{spec.source}: not a .safetensors file")
        return local
    if local.is_dir():
        return _one_file(local, spec.source)
    if _REPO_ID.match(spec.source):
        return _one_file(fetch_lora(spec.source), spec.source)
    raise FieldError("lora", f"{spec.source}: no such file or folder, and not a hub repo id (org/name)")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _metadata(path: Path) -> dict[str, str]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    meta = header.get("__metadata__") or {}
    return {str(k): str(v) for k, v in meta.items()}


def read_lora(spec: LoraSpec) -> LoraFile:
    """Resolve, hash, read (float32: LoRA factors are small) and convert one LoRA."""
    path = resolve_lora(spec)
    infos = read_header(path)
    tensors = {}
    with path.open("rb") as f:
        for key, info in infos.items():
            f.seek(info.start)
            raw = np.frombuffer(f.read(info.end - info.start), dtype=info.dtype).reshape(info.shape)
            tensors[key] = raw.astype(np.float32)
    converted = convert(tensors, _metadata(path), f"--lora {spec.source}")
    return LoraFile(spec, path, sha256_of(path), converted)
