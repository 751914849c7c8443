"""An on-disk store of serialized XLA executables, keyed by everything that makes one invalid.

A `ProgramSpec` (core/compile/target.py) names a jitted function and its abstract arguments;
its key (core/compile/keys.py) names the entry. Compiling many at once: compile_all.py.

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
import hashlib
import json
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from flux2klein_cli.core import trust
from flux2klein_cli.core.cache_paths import executables_dir
from flux2klein_cli.core.compile import treedefs
from flux2klein_cli.core.compile.figures import cost_figures, memory_figures
from flux2klein_cli.core.compile.keys import FORMAT, differences, key_of, key_parts, recorded_shapes
from flux2klein_cli.core.compile.target import ProgramSpec, Target
from flux2klein_cli.core.errors import Flux2KleinError
from flux2klein_cli.core.temporaries import partial_name, temporary_dir, temporary_file

EXECUTABLE, TREES, META, MANIFEST = "executable.bin", "trees.json", "meta.json", "manifest.json"


class StoreWarning(UserWarning):
    """A stored executable was not used (stale, corrupt or unloadable) and is being recompiled."""


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


class ExecutableStore:
    def __init__(self, root: str | Path | None = None, *, on_warning: Callable[[str], None] | None = None):
        self.root = Path(root).expanduser() if root is not None else executables_dir()
        self._on_warning = on_warning
        self._collecting = threading.local()  # each thread's `collecting_warnings` list (loads run in threads)
        self._ignored_options: set[str] = set()  # platforms already warned about an unknown option
        self._key: bytes | None = None
        self._refused: str | None = None  # why this store is not used at all (warned once)
        self._kernel_less_warned = False

    def warn(self, message: str) -> None:
        caught = getattr(self._collecting, "caught", None)
        if caught is not None:
            caught.append(message)
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
            raise _Unusable(f"deserialization failed ({type(e).__name__}: {first_line(e)})") from None

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
            compiled = lowered.compile(options) if options else lowered.compile()
        except Exception as e:  # jaxlib's own error type
            # Not every backend reads every option: jaxlib's GPU compiler has no
            # exec_time_optimization_effort. Its default effort still gives the right program.
            if not options or "No such compile option" not in str(e):
                raise
            if target.platform not in self._ignored_options:
                self._ignored_options.add(target.platform)
                self.warn(f"the {target.platform} compiler has no option {', '.join(options)} (--effort "
                          f"{target.effort}, or this host's CPU options); programs are compiled with its defaults")
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
            self.warn(f"cannot store {spec.name}: serialization failed ({type(e).__name__}: {first_line(e)})")
            return None
        if lacks_kernels((spec.target or Target.local()).platform, payload):
            if not self._kernel_less_warned:  # once: with jax's cache on, every program comes that way
                self._kernel_less_warned = True
                self.warn(f"{spec.name} came from jax's persistent XLA cache, whose CPU executables carry no "
                          "kernels to store: such programs are not stored (FLUX2KLEIN_XLA_CACHE serves them)")
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

    @contextlib.contextmanager
    def collecting_warnings(self) -> Iterator[list[str]]:
        """Collect the warnings of this thread's calls on the store (a load's), still passing them
        on; loads running in other threads at the same time collect their own."""
        previous = getattr(self._collecting, "caught", None)
        caught: list[str] = []
        self._collecting.caught = caught
        try:
            yield caught
        finally:
            self._collecting.caught = previous

    def load_or_compile(self, spec: ProgramSpec, *, save: bool = True
                        ) -> tuple[jax.stages.Compiled | None, LoadInfo]:
        """The stored executable, or a fresh compile (stored unless `save` is False)."""
        parts = key_parts(spec)
        with self.collecting_warnings() as caught:
            loaded = self.load(spec, parts)
        if loaded is not None:
            return loaded
        compiled, lower_s, compile_s = self.compile(spec)
        return compiled, self.finish(spec, parts, compiled, lower_s, compile_s, save, caught)

    def finish(self, spec: ProgramSpec, parts: dict[str, Any], compiled: jax.stages.Compiled, lower_s: float,
               compile_s: float, save: bool, caught: list[str]) -> LoadInfo:
        """The report of a program just compiled (a miss, or a recompile when `caught` holds the
        load's warnings or a stale entry is found); stored unless `save` is False."""
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
        shapes = recorded_shapes(parts)
        for other in self.manifest().get("executables", []):
            old = other.get("key_parts", {})
            if other.get("name") != name or old.get("args") != parts["args"] or old.get("target") != parts["target"]:
                continue
            if recorded_shapes(old) != shapes:  # a new output size: a new key, nothing stale
                continue
            if old == parts:
                continue
            return "; ".join(differences(old, parts))
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


def lacks_kernels(platform: str, payload: bytes) -> bool:
    """Whether a serialized executable cannot run where it is loaded: on CPU, XLA keeps a
    program's machine code (its object files) only on the executable it compiled; one rebuilt
    from bytes (a hit in jax's persistent cache, or a deserialized entry) serializes without
    them, and loads fine only to fail at its first kernel ("Function ..._fusion not found").
    Every CPU program has at least one kernel, so no object file in the payload is that case."""
    return platform == "cpu" and _ELF_MAGIC not in payload


_ELF_MAGIC = b"\x7fELF"  # the CPU compiler's object files


def _write_private(path: Path, data: bytes) -> None:
    """A new file only this user can write, whatever the umask (a group-writable entry would
    be refused on load)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def first_line(error: BaseException) -> str:
    """An error's first line, at most 200 characters: what a one-line message quotes of it."""
    return (str(error).strip().splitlines() or [""])[0][:200]
