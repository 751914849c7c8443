"""Where `convert` may write, checked before it writes anything, and its write failures as sentences.

`--force` replaces only a directory that `convert` wrote: one with its manifest and nothing the
manifest does not account for. `--out` may not be, hold, or lie inside any input (symlinks
resolved), so a convert never deletes its own source or the user's files.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flux2klein_cli.core.errors import FieldError, Flux2KleinError, UserInputError
from flux2klein_cli.core.hub.snapshot import CONVERTED_MANIFEST, snapshot_files
from flux2klein_cli.core.paths import check_name_length
from flux2klein_cli.core.weights.converted_manifest import COPIED_COMPONENTS, FORMAT, MODEL_COMPONENTS

_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR)
_FULL = (errno.ENOSPC, errno.EDQUOT)


def size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def target_dir(source: Path, out: str | Path, *, force: bool) -> Path:
    """The directory to write for `--out out`: symlinks resolved (a linked --out is written where
    it points, the link kept). UserInputError when it overlaps an input, or exists and `force`
    is not given, or exists and is not something `convert` wrote."""
    check_name_length(out, "out")
    given = Path(out).expanduser().absolute()
    try:
        target = given.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise FieldError("out", f"{given}: cannot resolve it ({e})") from None
    _check_apart(source, given, target)
    if target.exists() or os.path.lexists(target):
        if not force:
            raise UserInputError(f"{given} exists; pass {{field:force}} to replace it")
        check_replaceable(target, given)
    return target


def _check_apart(source: Path, given: Path, target: Path) -> None:
    shown = given if given == target else f"{given} (-> {target})"
    if target == source:
        raise FieldError("out", f"{shown} is the source snapshot: convert would replace its own input")
    if source in target.parents:
        raise FieldError("out", f"{shown} is inside the source snapshot {source}")
    if target in source.parents:
        raise FieldError("out", f"{shown} holds the source snapshot {source}: choose a directory outside it")
    for rel, _ in snapshot_files(source):
        real = (source / rel).resolve()  # a hub snapshot links to blobs elsewhere: inputs too
        if real == target or target in real.parents:
            raise FieldError("out", f"{shown} holds an input of the conversion, {real}: "
                                 "choose a directory outside it")


def check_replaceable(target: Path, given: Path | None = None) -> None:
    """UserInputError unless `target` is a directory written by `convert`: its manifest, and no file
    the manifest does not account for (nothing of the user's is removed by --force)."""
    shown = given or target
    refuse = ("{field:force} replaces only a directory that convert wrote: remove it yourself or choose another "
              "{field:out}")
    if target.is_symlink() or not target.is_dir():
        raise UserInputError(f"{shown} exists and is not a directory; {refuse}")
    try:
        manifest = json.loads((target / CONVERTED_MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserInputError(f"{shown} exists and has no convert manifest ({CONVERTED_MANIFEST}); {refuse}")
    foreign = _foreign(target, manifest)
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise UserInputError(f"{shown} holds {target}/{foreign[0]}{more}, which convert did not write; {refuse}")


def _foreign(target: Path, manifest: dict[str, Any]) -> list[str]:
    """Files and links under `target` (relative, sorted) that a convert would not have written, and
    top-level directories it does not write."""
    copied = manifest.get("copied")
    copied = {c for c in copied if isinstance(c, str)} if isinstance(copied, list) else set()
    layouts = []  # "transformer/flat/": everything under it is the component's checkpoint
    for name, entry in (manifest.get("components") or {}).items():
        where = entry.get("checkpoint") if isinstance(entry, dict) else None
        if name in MODEL_COMPONENTS and isinstance(where, str) and where.startswith(f"{name}/") and \
                where.count("/") == 1 and not where.endswith("/"):
            layouts.append(f"{where}/")

    def written(rel: str) -> bool:
        top, _, rest = rel.partition("/")
        if rel in (CONVERTED_MANIFEST, "model_index.json") or rel in copied:
            return True
        if any(rel.startswith(prefix) for prefix in layouts):
            return True
        return top in MODEL_COMPONENTS and "/" not in rest and rest.endswith(".json")  # a component's configs

    foreign = []
    for root, dirs, files in os.walk(target):  # links are listed, never followed
        base = Path(root).relative_to(target)
        links = [d for d in dirs if (Path(root) / d).is_symlink()]
        foreign += [rel for rel in ((base / n).as_posix() for n in files + links) if not written(rel)]
        if base == Path("."):
            foreign += [f"{d}/" for d in dirs if d not in (*MODEL_COMPONENTS, *COPIED_COMPONENTS) and d not in links]
    return sorted(foreign)


def check_free_space(target: Path, needed: int) -> None:
    """Flux2KleinError (exit 1) when the filesystem of `target` has less than `needed` bytes free."""
    free = _free(target)
    if free is not None and free < needed:
        raise Flux2KleinError(f"not enough free space for {target}: the converted model needs about "
                              f"{size_text(needed)}, {size_text(free)} available")


def _free(target: Path) -> int | None:
    for path in (target, *target.parents):
        try:
            return shutil.disk_usage(path).free
        except OSError:
            continue
    return None


@contextmanager
def write_errors(target: Path, needed: int, *, user_out: bool) -> Iterator[None]:
    """OSErrors of writing `target` as one sentence: a full disk names the space needed and free
    (exit 1); an unwritable --out is exit 2 when the user gave it, else 1; anything else exit 1."""
    try:
        yield
    except OSError as e:
        raise _sentence(target, needed, e, e.errno, user_out) from None
    except (ValueError, RuntimeError) as e:  # tensorstore (Orbax) reports a full disk in its own types
        if "No space left on device" not in str(e):
            raise
        raise _sentence(target, needed, e, errno.ENOSPC, user_out) from None


def _sentence(target: Path, needed: int, e: BaseException, number: int | None, user_out: bool) -> Flux2KleinError:
    filename = getattr(e, "filename", None)
    reason = getattr(e, "strerror", None) or " ".join(str(e).split())
    if number in (errno.EEXIST, errno.ENOTDIR) and filename:
        # mkdir through a regular file: name the file that is in the way
        blocking = next((p for p in (Path(filename), *Path(filename).parents) if p.exists()), None)
        if blocking is not None and not blocking.is_dir():
            filename, reason = None, f"{blocking} is not a directory"
    if filename and Path(filename) != target:
        reason = f"{filename}: {reason}"
    if number in _FULL:
        free = _free(target)
        return Flux2KleinError(f"no space left on the device for {target}: the converted model needs about "
                               f"{size_text(needed)}, {size_text(free) if free is not None else 'unknown'} available")
    if number in _UNWRITABLE:
        kind = UserInputError if user_out else Flux2KleinError
        return kind(f"cannot write {{field:out}} {target}: {reason}")
    return Flux2KleinError(f"could not write {target}: {reason}")
