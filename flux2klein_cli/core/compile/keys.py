"""The key of a stored executable: everything that makes one invalid, as JSON-able parts.

The key is the sha256 of a canonical JSON of: the name, caller-supplied parts (model configs),
the arguments' tree structure, shapes, dtypes and shardings, the target (platform, device kind,
devices, mesh, topology), the jax / jaxlib / libtpu versions, a fingerprint of the model and
pipeline source, and the flags that change code generation.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import jax
from jax.sharding import NamedSharding

from flux2klein_cli.core import settings
from flux2klein_cli.core.compile.target import ProgramSpec, Target, mesh_desc

FORMAT = 3  # bump when the entry layout or the key's meaning changes (3: CPU entries carry their kernels)
# The source a fingerprint covers: the whole package (a hand-kept list of the traced modules
# once missed core/devices/sharding.py, whose edits then served stale executables).
_CODE_SUFFIXES = (".py", ".cc")
_FLAG_CONFIG = ("jax_default_matmul_precision", "jax_enable_x64")


def library_versions(platform: str) -> dict[str, str | None]:
    """Versions that change generated code; libtpu only matters for TPU programs."""
    import jaxlib

    from flux2klein_cli import __version__

    versions: dict[str, str | None] = {"jax": jax.__version__, "jaxlib": jaxlib.version.__version__,
                                       "flux2klein": __version__}
    if platform == "tpu":
        from importlib.metadata import PackageNotFoundError, version

        try:
            versions["libtpu"] = version("libtpu")
        except PackageNotFoundError:
            versions["libtpu"] = None
    return versions


def compile_flags() -> dict[str, Any]:
    """The compiler's flags and the settings that change programs (core/settings.py's
    PROGRAM_VARIABLES; the trace options in each program's key hold their effect too)."""
    flags: dict[str, Any] = settings.program_variables()
    for name in _FLAG_CONFIG:
        value = getattr(jax.config, name, None)
        flags[name] = None if value is None else str(value)
    return flags


@functools.cache
def code_fingerprint() -> str:
    """sha256 of the package's source (every .py and the CPU kernel shim's .cc): any edit invalidates
    every executable, so none can be served stale by a module a trace uses that no list named."""
    return source_fingerprint(Path(__file__).resolve().parents[2])


def source_fingerprint(package: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in package.rglob("*") if p.suffix in _CODE_SUFFIXES and p.is_file()):
        if "__pycache__" in path.parts:
            continue
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _sharding_desc(sharding: Any) -> Any:
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        return {"mesh": mesh_desc(sharding.mesh), "spec": str(sharding.spec), "memory_kind": sharding.memory_kind}
    return repr(sharding)


def _leaf_desc(leaf: Any) -> list[Any]:
    return [list(leaf.shape), str(leaf.dtype), bool(getattr(leaf, "weak_type", False)),
            _sharding_desc(getattr(leaf, "sharding", None))]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def key_parts(spec: ProgramSpec) -> dict[str, Any]:
    """Everything that makes an executable invalid, as JSON-able data (arguments hashed: a
    real model's state has hundreds of leaves)."""
    target = spec.target or Target.local()
    leaves = [_leaf_desc(leaf) for leaf in jax.tree.leaves(spec.args)]
    parts = {
        "format": FORMAT,
        "name": spec.name,
        "extra": spec.key_parts,
        "args": {"tree_sha256": _sha(str(spec.in_tree)), "leaves_sha256": _sha(_canonical(leaves)),
                 "leaves": len(leaves)},
        "target": target.describe(),
        "versions": library_versions(target.platform),
        "code_sha256": code_fingerprint(),
        "flags": compile_flags(),
        "compiler_options": target.compiler_options,
    }
    return json.loads(_canonical(parts))  # the form it has after a round trip through meta.json


def key_of(parts: dict[str, Any]) -> str:
    return _sha(_canonical(parts))


def recorded_shapes(parts: dict[str, Any]) -> Any:
    extra = parts.get("extra")
    return extra.get("shapes") if isinstance(extra, dict) else None


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section), new.get(section)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            shown = ", ".join(f"{k} {_short(a.get(k))} -> {_short(b.get(k))}" for k in keys[:3])
            out.append(f"{section}: {shown}")
        else:
            out.append(f"{section} changed")
    return out


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 24 else text[:12] + "..."
