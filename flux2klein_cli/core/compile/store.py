"""An on-disk store of serialized XLA executables, keyed by everything that makes one invalid.

A `ProgramSpec` names a jitted function and its abstract arguments (pytrees of
`jax.ShapeDtypeStruct`, with shardings where the real call has them). Its key is the sha256
of a canonical JSON of: the name, caller-supplied parts (model configs), the arguments' tree
structure, shapes, dtypes and shardings, the target (platform, device kind, devices, mesh,
topology), the jax / jaxlib / libtpu versions, a fingerprint of the model and pipeline
source, and the flags that change code generation.

Layout: `<root>/<key>/` holds `executable.bin` (jax's serialized executable), `trees.json`
(its output tree structure, plain JSON: core/compile/treedefs.py) and `meta.json` (the key
parts, sha256 and size of both files, compile seconds, `memory_analysis()`, creation time,
and an HMAC of all that with the store's key); `<root>/manifest.json` lists every entry.
Entries are written in a temporary folder and renamed into place, so a reader or a
concurrent writer never sees half an entry.

An executable is code: a store is used only when this user owns it and no one else can
write it, and an entry only when its files are this user's and its record carries the
store's HMAC (core/trust.py). A load checks ownership, the HMAC, the key parts and the
checksums before deserializing; any failure is one warning and a recompile, never a use of
the entry.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from flux2klein_cli.core import choices, trust
from flux2klein_cli.core.cache_paths import executables_dir
from flux2klein_cli.core.compile import treedefs
from flux2klein_cli.core.errors import Flux2KleinError
from flux2klein_cli.core.models import cpu_matmul
from flux2klein_cli.core.temporaries import partial_name, temporary_dir, temporary_file

FORMAT = 2  # bump when the entry layout or the key's meaning changes
EXECUTABLE, TREES, META, MANIFEST = "executable.bin", "trees.json", "meta.json", "manifest.json"
# Source whose edits change what a program computes without changing any config or shape.
_CODE_DIRS = ("core/models", "core/pipeline")
_CODE_FILES = ("core/compile/specs.py",)
# Environment that changes the compiled program (FLUX2KLEIN_GPU_ATTENTION: which attention a GPU
# program traces; the trace options in the key hold it too).
_FLAG_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "FLUX2KLEIN_GPU_ATTENTION")
_FLAG_CONFIG = ("jax_default_matmul_precision", "jax_enable_x64")


class StoreWarning(UserWarning):
    """A stored executable was not used (stale, corrupt or unloadable) and is being recompiled."""


# How hard XLA works on an executable's speed. "fast" trades run time for compile time
# (figures in docs/benchmarks.md); XLA reads -1.0 as its least effort. At "fast" for TPU targets
# the VAE's programs are also traced with their 3x3 convolutions as matmuls (specs.trace_options).
# The value is part of the store key.
_EFFORT_OPTIONS: dict[str, dict[str, Any]] = {"fast": {"exec_time_optimization_effort": -1.0}}
EFFORTS: dict[str, dict[str, Any]] = {name: _EFFORT_OPTIONS.get(name, {}) for name in choices.EFFORTS}
# More per platform. libtpu's multi-output fusion pass runs alone on one core, superlinear in the
# program's size, and dominates the HLO passes of large programs; skipping it costs little run time
# by XLA's cost model (docs/benchmarks.md).
PLATFORM_EFFORTS: dict[tuple[str, str], dict[str, Any]] = {
    ("tpu", "fast"): {"xla_disable_hlo_passes": "tpu_multi_output_fusion"},
}


@dataclass(frozen=True)
class Target:
    """Where a program runs: the devices of its mesh. `topology` names a libtpu topology
    description (e.g. "v6e:2x2") whose devices can compile but not run on this host;
    `effort` names XLA's optimisation effort (EFFORTS)."""

    mesh: Mesh
    topology: str | None = None
    effort: str = "default"

    @classmethod
    def local(cls) -> Target:
        from flux2klein_cli.core.mesh import default_mesh

        return cls(default_mesh())

    @property
    def devices(self) -> list[Any]:
        return list(self.mesh.devices.flat)

    @property
    def platform(self) -> str:
        return self.devices[0].platform

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind

    @property
    def compile_only(self) -> bool:
        return self.topology is not None

    @property
    def compiler_options(self) -> dict[str, Any]:
        return {**EFFORTS[self.effort], **PLATFORM_EFFORTS.get((self.platform, self.effort), {})}

    def describe(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "device_kind": self.device_kind,
            "device_count": len(self.devices),
            "mesh": _mesh_desc(self.mesh),
            "topology": self.topology,
            "effort": self.effort,
        }


@dataclass(frozen=True)
class ProgramSpec:
    """One program: a jitted function, its abstract arguments, and what else identifies it.

    `key_parts` holds JSON-able facts the arguments do not show (model configs, dtypes of
    constants, options); shapes not in the arguments (an output's) go under `key_parts["shapes"]`:
    another shape is another program, never a stale entry. `model` names the component whose
    parameters the program reads, for memory accounting."""

    name: str
    fn: Any  # a jax.jit-wrapped function: .lower(*args)
    args: tuple[Any, ...]
    key_parts: dict[str, Any] = field(default_factory=dict)
    target: Target | None = None
    model: str | None = None

    def lower(self) -> jax.stages.Lowered:
        target = self.target or Target.local()
        # The pipeline calls its programs under `jax.set_mesh` when it has a mesh: the model's
        # sharding constraints and shard_maps (core/sharding.py) must see the same mesh here.
        mesh = jax.set_mesh(target.mesh) if target.mesh.size > 1 else contextlib.nullcontext()
        # The function carries its trace options (core/compile/specs.trace_options): a TPU
        # program lowered on a CPU host is traced in the TPU forms, nothing global is patched.
        with mesh:
            return self.fn.lower(*self.args)

    @property
    def in_tree(self) -> Any:
        # Compiled.args_info is (args, kwargs); ShapeDtypeStructs are leaves like the real arrays.
        return jax.tree_util.tree_structure((tuple(self.args), {}))


@dataclass
class LoadInfo:
    """What happened to one program: `hit` (loaded), `miss` (compiled: none stored) or
    `recompiled` (an entry existed but was stale or unusable; `warning` says why)."""

    name: str
    key: str
    status: str
    seconds: float  # load seconds for a hit, lower + compile for the others
    lower_s: float = 0.0
    compile_s: float = 0.0  # for a hit: the compile seconds recorded when it was stored
    memory: dict[str, int] = field(default_factory=dict)
    cost: dict[str, float] = field(default_factory=dict)  # XLA's cost analysis (cost_figures)
    saved: bool = False
    warning: str | None = None
    path: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# ----------------------------------------------------------------------------- key


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
    flags: dict[str, Any] = {name: os.environ.get(name) for name in _FLAG_ENV}
    for name in _FLAG_CONFIG:
        value = getattr(jax.config, name, None)
        flags[name] = None if value is None else str(value)
    return flags


@functools.cache
def code_fingerprint() -> str:
    """sha256 of the model and pipeline source: an edit there invalidates every executable."""
    package = Path(__file__).resolve().parents[2]
    files = [p for d in _CODE_DIRS for p in sorted((package / d).glob("*.py"))]
    files += [package / f for f in _CODE_FILES]
    digest = hashlib.sha256()
    for path in files:
        if path.is_file():
            digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _mesh_desc(mesh: Mesh) -> dict[str, Any]:
    return {"axes": {str(k): int(v) for k, v in mesh.shape.items()},
            "devices": [int(d.id) for d in mesh.devices.flat]}


def _sharding_desc(sharding: Any) -> Any:
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        return {"mesh": _mesh_desc(sharding.mesh), "spec": str(sharding.spec), "memory_kind": sharding.memory_kind}
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
    if target.platform == "cpu":  # which kernel a bf16 Linear's dot is (core/models/cpu_matmul.py)
        parts["flags"]["cpu_matmul"] = cpu_matmul.backend()
    return json.loads(_canonical(parts))  # the form it has after a round trip through meta.json


def key_of(parts: dict[str, Any]) -> str:
    return _sha(_canonical(parts))


def memory_figures(compiled: jax.stages.Compiled) -> dict[str, int]:
    """`memory_analysis()` per device in bytes, plus `peak`: what the program needs at once
    (arguments + outputs - aliased + temporaries + generated code)."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # some backends do not implement it
        return {}
    if stats is None:
        return {}
    names = {"argument": "argument_size_in_bytes", "output": "output_size_in_bytes",
             "alias": "alias_size_in_bytes", "temp": "temp_size_in_bytes",
             "generated_code": "generated_code_size_in_bytes"}
    figures = {k: int(getattr(stats, v, 0) or 0) for k, v in names.items()}
    figures["peak"] = (figures["argument"] + figures["output"] - figures["alias"] + figures["temp"]
                       + figures["generated_code"])
    return figures


COST_NAMES = {"flops": "flops", "bytes accessed": "bytes_accessed", "transcendentals": "transcendentals",
              "optimal_seconds": "optimal_seconds"}


def cost_figures(compiled: jax.stages.Compiled) -> dict[str, float]:
    """XLA's cost analysis of one program, per device: flops, bytes accessed, transcendentals
    and, where the backend estimates it, `optimal_seconds`. Static counts: a loop body is
    counted once, whatever its trip count. Empty where the backend gives none."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # some backends do not implement it
        return {}
    if isinstance(analysis, list | tuple):  # older jax: one dict per computation
        analysis = analysis[0] if analysis else None
    if not analysis:
        return {}
    return {ours: float(analysis[theirs]) for theirs, ours in COST_NAMES.items()
            if isinstance(analysis.get(theirs), int | float) and analysis[theirs] >= 0}


# ----------------------------------------------------------------------------- store


class ExecutableStore:
    def __init__(self, root: str | Path | None = None, *, on_warning: Callable[[str], None] | None = None):
        self.root = Path(root).expanduser() if root is not None else executables_dir()
        self._on_warning = on_warning
        self._ignored_options: set[str] = set()  # platforms already warned about an unknown option
        self._key: bytes | None = None
        self._refused: str | None = None  # why this store is not used at all (warned once)

    def warn(self, message: str) -> None:
        if self._on_warning is not None:
            self._on_warning(message)
        else:
            warnings.warn(message, StoreWarning, stacklevel=3)

    def entry(self, key: str) -> Path:
        return self.root / key

    def trusted_key(self, *, create: bool) -> bytes | None:
        """The store's HMAC key once the store is known to be private; None when there is no
        store yet (and `create` is False) or it is refused (warned once)."""
        if self._key is not None or self._refused is not None:
            return self._key
        try:
            self._key = trust.open_store(self.root, "executable store", create=create)
        except trust.Untrusted as e:
            self._refused = str(e)
            self.warn(f"{e}: its executables are not used or written (see docs/cli.md, 'Trusting a store')")
        except OSError as e:
            self._refused = e.strerror or str(e)
            self.warn(f"cannot use the executable store {self.root}: {self._refused}")
        return self._key

    def check_writable(self) -> None:
        """Flux2KleinError (exit 1) unless entries can be stored here: for `compile`, whose only
        job is storing, an unusable store is a failure, not a warning."""
        if self.root.exists() and not self.root.is_dir():
            raise Flux2KleinError(f"executable store {self.root} is not a directory: nothing can be stored there")
        previous, self._on_warning = self._on_warning, lambda message: None  # the error says it once
        try:
            key = self.trusted_key(create=True)
        finally:
            self._on_warning = previous
        if key is None:
            raise Flux2KleinError(f"cannot store executables in {self.root}: {self._refused}")
        try:
            with temporary_file(self.root, "write-check") as (fd, _):
                os.close(fd)
        except OSError as e:
            raise Flux2KleinError(f"cannot store executables in {self.root}: {e.strerror or e}") from None

    # --- loading

    def load(self, spec: ProgramSpec, parts: dict[str, Any] | None = None
             ) -> tuple[jax.stages.Compiled | None, LoadInfo] | None:
        """The stored executable of `spec`, or None when there is none or it is unusable (with
        a warning, `LoadInfo` then carries it). A hit on a compile-only target (a TPU
        topology on a host without it) is verified but not deserialized: compiled is None."""
        parts = parts or key_parts(spec)
        key = key_of(parts)
        start = time.perf_counter()
        entry = self.entry(key)
        store_key = self.trusted_key(create=False)
        if store_key is None or not (entry / META).is_file():
            return None
        try:
            meta, payload, trees = self._read_verified(entry, parts, store_key)
            compiled = None
            if not (spec.target or Target.local()).compile_only:
                compiled = self._deserialize(spec, payload, trees)
        except _Unusable as e:
            self.warn(f"stored executable {spec.name} ({key[:12]}) is unusable: {e}; recompiling")
            return None
        info = LoadInfo(spec.name, key, "hit", time.perf_counter() - start, compile_s=meta.get("compile_s", 0.0),
                        memory=meta.get("memory", {}), cost=meta.get("cost", {}), path=str(entry))
        return compiled, info

    def _read_verified(self, entry: Path, parts: dict[str, Any], store_key: bytes
                       ) -> tuple[dict[str, Any], bytes, Any]:
        """(meta, executable bytes, output tree) of an entry this user wrote, checked before
        anything in it is parsed beyond JSON."""
        try:
            trust.check_private_dir(entry, "entry")
            for name in (META, EXECUTABLE, TREES):
                trust.check_private_file(entry / name)
            meta = json.loads((entry / META).read_text())
            if not isinstance(meta, dict):
                raise _Unusable(f"{META} is not a JSON object")
            trust.verify(meta, store_key)
            payload = (entry / EXECUTABLE).read_bytes()
            trees = (entry / TREES).read_bytes()
        except trust.Untrusted as e:
            raise _Unusable(str(e)) from None
        except (OSError, ValueError) as e:
            raise _Unusable(f"unreadable ({e})") from None
        if meta.get("key_parts") != parts:
            raise _Unusable("its recorded key parts differ from this program's")
        files = meta.get("files")
        for name, data in ((EXECUTABLE, payload), (TREES, trees)):
            want = files.get(name) if isinstance(files, dict) else None
            want = want if isinstance(want, dict) else {}
            if want.get("bytes") != len(data):
                raise _Unusable(f"{name} has {len(data)} bytes, {want.get('bytes')} recorded (truncated?)")
            if want.get("sha256") != hashlib.sha256(data).hexdigest():
                raise _Unusable(f"{name} does not match its recorded sha256 (corrupt)")
        try:
            out_tree = treedefs.decode(json.loads(trees))
        except ValueError as e:
            raise _Unusable(f"its tree structure does not load ({e})") from None
        return meta, payload, out_tree

    def _deserialize(self, spec: ProgramSpec, payload: bytes, out_tree: Any) -> jax.stages.Compiled:
        from jax.experimental.serialize_executable import deserialize_and_load

        target = spec.target or Target.local()
        try:
            # The payload is authenticated (HMAC of the record holding its sha256): only now
            # may jax unpickle it.
            return deserialize_and_load(payload, spec.in_tree, out_tree, backend=target.platform,
                                        execution_devices=target.devices)
        except Exception as e:  # XLA raises its own error types for a bad executable
            raise _Unusable(f"deserialization failed ({type(e).__name__}: {_first_line(e)})") from None

    # --- compiling and saving

    def compile(self, spec: ProgramSpec, lowered: jax.stages.Lowered | None = None
                ) -> tuple[jax.stages.Compiled, float, float]:
        """(compiled, lower seconds, compile seconds)."""
        start = time.perf_counter()
        lowered = lowered if lowered is not None else spec.lower()
        lowered_at = time.perf_counter()
        target = spec.target or Target.local()
        options = target.compiler_options
        try:
            with _no_persistent_cache():
                compiled = lowered.compile(options) if options else lowered.compile()
        except Exception as e:  # jaxlib's own error type
            # Not every backend reads every option: jaxlib's GPU compiler has no
            # exec_time_optimization_effort. Its default effort still gives the right program.
            if not options or "No such compile option" not in str(e):
                raise
            if target.platform not in self._ignored_options:
                self._ignored_options.add(target.platform)
                self.warn(f"--effort {target.effort}: the {target.platform} compiler has no option "
                          f"{', '.join(options)}; programs are compiled at its default effort")
            with _no_persistent_cache():
                compiled = lowered.compile()
        return compiled, lowered_at - start, time.perf_counter() - lowered_at

    def save(self, spec: ProgramSpec, compiled: jax.stages.Compiled, parts: dict[str, Any], *,
             compile_s: float, lower_s: float) -> Path | None:
        """Write an entry atomically; returns its path, or None (with a warning) when the
        executable cannot be serialized or the store is not writable."""
        from jax.experimental.serialize_executable import serialize

        key = key_of(parts)
        store_key = self.trusted_key(create=True)
        if store_key is None:
            return None
        try:
            payload, _, out_tree = serialize(compiled)
            trees = json.dumps(treedefs.encode(out_tree)).encode()
        except Exception as e:  # e.g. a backend without executable serialization
            self.warn(f"cannot store {spec.name}: serialization failed ({type(e).__name__}: {_first_line(e)})")
            return None
        meta = {
            "key": key, "name": spec.name, "key_parts": parts, "created": time.time(),
            "compile_s": compile_s, "lower_s": lower_s, "memory": memory_figures(compiled),
            "cost": cost_figures(compiled),
            "files": {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                      for name, data in ((EXECUTABLE, payload), (TREES, trees))},
        }
        meta = trust.sign(meta, store_key)
        try:
            with temporary_dir(self.root, key, mode=0o700) as tmp:  # private whatever the umask
                for name, data in ((EXECUTABLE, payload), (TREES, trees),
                                   (META, json.dumps(meta, indent=1, sort_keys=True).encode())):
                    _write_private(tmp / name, data)
                self._install(tmp, self.entry(key))
            self.write_manifest()
        except OSError as e:
            self.warn(f"cannot store {spec.name} under {self.root}: {e.strerror or e}")
            return None
        return self.entry(key)

    def _install(self, tmp: Path, final: Path) -> None:
        """Rename a complete entry into place. An existing entry (a concurrent writer's, or an
        unusable one being replaced) is moved aside first; losing that race is fine, since
        whichever complete entry ends up in place is valid."""
        try:
            tmp.rename(final)
            return
        except OSError:
            pass
        trash = final.with_name(partial_name(final.name))  # a temporary's name: stale ones are removed
        with contextlib.suppress(OSError):
            final.rename(trash)
        with contextlib.suppress(OSError):
            tmp.rename(final)
        shutil.rmtree(trash, ignore_errors=True)

    def load_or_compile(self, spec: ProgramSpec, *, save: bool = True
                        ) -> tuple[jax.stages.Compiled | None, LoadInfo]:
        """The stored executable, or a fresh compile (stored unless `save` is False)."""
        parts = key_parts(spec)
        with _warnings_to(self) as caught:
            loaded = self.load(spec, parts)
        if loaded is not None:
            return loaded
        compiled, lower_s, compile_s = self.compile(spec)
        return compiled, self._finish(spec, parts, compiled, lower_s, compile_s, save, caught)

    def _finish(self, spec: ProgramSpec, parts: dict[str, Any], compiled: jax.stages.Compiled, lower_s: float,
                compile_s: float, save: bool, caught: list[str]) -> LoadInfo:
        key = key_of(parts)
        stale = self.stale_reason(spec.name, parts)
        if stale:
            caught.append(f"stored executable {spec.name} is stale ({stale}); recompiled")
            self.warn(caught[-1])
        path = self.save(spec, compiled, parts, compile_s=compile_s, lower_s=lower_s) if save else None
        status = "recompiled" if caught else "miss"
        return LoadInfo(spec.name, key, status, lower_s + compile_s, lower_s, compile_s,
                        memory_figures(compiled), cost_figures(compiled), saved=path is not None,
                        warning="; ".join(caught) or None, path=str(path) if path else None)

    def stale_reason(self, name: str, parts: dict[str, Any]) -> str | None:
        """Why an entry for the same program (same name, arguments, shapes and target) does not
        apply: the differing versions, configs, code or flags. None when there is no such entry
        (or the store is refused: its manifest says nothing then)."""
        if self._refused is not None:
            return None
        shapes = _recorded_shapes(parts)
        for other in self.manifest().get("executables", []):
            old = other.get("key_parts", {})
            if other.get("name") != name or old.get("args") != parts["args"] or old.get("target") != parts["target"]:
                continue
            if _recorded_shapes(old) != shapes:  # a new output size: a new key, nothing stale
                continue
            if old == parts:
                continue
            return "; ".join(_differences(old, parts))
        return None

    # --- manifest

    def entries(self) -> Iterator[dict[str, Any]]:
        if not self.root.is_dir():
            return
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith(".") or not (entry / META).is_file():
                continue
            try:
                meta = json.loads((entry / META).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(meta, dict):
                yield meta

    def manifest(self) -> dict[str, Any]:
        """The manifest, or {} when it is missing or not of the expected form (it is only an
        index: entries are checked on their own)."""
        try:
            manifest = json.loads((self.root / MANIFEST).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(manifest, dict) or not isinstance(manifest.get("executables"), list):
            return {}
        manifest["executables"] = [e for e in manifest["executables"]
                                   if isinstance(e, dict) and isinstance(e.get("key_parts", {}), dict)]
        return manifest

    def write_manifest(self) -> None:
        """Rebuild manifest.json from every entry's meta.json, under a lock, atomically."""
        import fcntl

        with open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            executables = [
                {"name": m.get("name"), "key": m.get("key"), "compile_s": m.get("compile_s"),
                 "memory": m.get("memory", {}), "created": m.get("created"), "key_parts": m.get("key_parts", {})}
                for m in self.entries()
            ]
            with temporary_file(self.root, MANIFEST) as (fd, tmp):
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps({"format": FORMAT, "executables": executables}, indent=1))
                os.replace(tmp, self.root / MANIFEST)


class _Unusable(Exception):
    pass


def _no_persistent_cache() -> contextlib.AbstractContextManager[Any]:
    """Compile outside jax's persistent compilation cache (this thread only): on CPU an
    executable that went through it serializes without its fused kernels, and the entry then
    fails in the next process ("Function ..._fusion not found"). The store is the cache here."""
    from jax._src import config as jax_config

    return jax_config.enable_compilation_cache(False)


def _write_private(path: Path, data: bytes) -> None:
    """A new file only this user can write, whatever the umask (a group-writable entry would
    be refused on load)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


@contextlib.contextmanager
def _warnings_to(store: ExecutableStore) -> Iterator[list[str]]:
    """Collect the store's warnings during a load, still passing them on."""
    caught: list[str] = []
    previous = store._on_warning

    def record(message: str) -> None:
        caught.append(message)
        if previous is not None:
            previous(message)
        else:
            warnings.warn(message, StoreWarning, stacklevel=4)

    store._on_warning = record
    try:
        yield caught
    finally:
        store._on_warning = previous


def _recorded_shapes(parts: dict[str, Any]) -> Any:
    extra = parts.get("extra")
    return extra.get("shapes") if isinstance(extra, dict) else None


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
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


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]


# ----------------------------------------------------------------------------- many programs


def compiles_serially(specs: Sequence[ProgramSpec]) -> bool:
    """TPU programs compile one at a time: libtpu is not safe compiling the Pallas attention
    kernels of two programs at once (it crashed in its MLIR translation), and threads gain
    nothing there anyway (its compiles in one process finish together)."""
    return any((spec.target or Target.local()).platform == "tpu" for spec in specs)


def compile_all(
    specs: Sequence[ProgramSpec],
    store: ExecutableStore,
    *,
    parallel: bool = True,
    save: bool = True,
    progress: Callable[[str], None] | None = None,
    on_done: Callable[[int, int], None] | None = None,
) -> list[tuple[jax.stages.Compiled | None, LoadInfo]]:
    """Load what is stored, compile the rest (in threads when `parallel`: XLA's compiler
    releases the GIL), store it. Tracing and lowering stay in this thread, one program at a
    time: tracing is not meant to run concurrently; each program's compile starts as soon as
    it is lowered. Results come back in `specs` order. `on_done(programs done, programs)` as
    each is loaded or compiled."""
    say = progress or (lambda message: None)
    results: list[tuple[jax.stages.Compiled | None, LoadInfo] | None] = [None] * len(specs)
    done_lock, done = threading.Lock(), [0]

    def finished() -> None:
        with done_lock:  # builds finish in the pool's threads
            done[0] += 1
            if on_done is not None:
                on_done(done[0], len(specs))

    def build(item: tuple[int, ProgramSpec, dict[str, Any], Any, float, list[str]]) -> None:
        i, spec, parts, lowered, lower_s, caught = item
        say(f"{spec.name}: compiling")
        compiled, _, compile_s = store.compile(spec, lowered)
        results[i] = compiled, store._finish(spec, parts, compiled, lower_s, compile_s, save, caught)
        say(f"{spec.name}: compiled in {compile_s:.2f} s")
        finished()

    # One worker when not parallel: programs still compile one at a time, each while this
    # thread lowers the next.
    workers = len(specs) if parallel and len(specs) > 1 and not compiles_serially(specs) else 1
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flux2klein-compile") as pool:
        pending = []
        for i, spec in enumerate(specs):
            parts = key_parts(spec)
            with _warnings_to(store) as caught:
                loaded = store.load(spec, parts)
            if loaded is not None:
                results[i] = loaded
                say(f"{spec.name}: loaded ({loaded[1].seconds:.2f} s)")
                finished()
                continue
            start = time.perf_counter()
            say(f"{spec.name}: lowering")
            lowered = spec.lower()
            # Compiling starts as soon as a program is lowered, while this thread lowers the next.
            pending.append(pool.submit(build, (i, spec, parts, lowered, time.perf_counter() - start, caught)))
        for future in pending:
            future.result()
    return [r for r in results if r is not None]
