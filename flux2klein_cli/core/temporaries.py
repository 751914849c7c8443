"""Temporary files and directories that become outputs by a rename: PNGs, the `tiny` checkpoint,
converted directories, executable-store entries, KV caches.

Each is named `.NAME.partial-HOST-PID-RANDOM` beside its final place (a NAME too long to fit in
255 bytes with the rest is cut and ends in a hash of the whole name, `stem`, so a temporary fits
whenever its final name does). The writer removes it on any
failure or interrupt (`finally`); the interrupt watchdog removes the live ones before a forced exit
(`remove_live`); and what a killed process left (SIGKILL, power loss) is removed by the next writer to
the same directory, once its PID is gone on this host (`remove_stale`). Another host's, or a live
process's, temporaries are never touched: they may be a concurrent writer's on a shared filesystem.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

MARK = ".partial-"
NAME_MAX = 255
# What a temporary adds to NAME, at most: ".", MARK, a 40-character host, a 10-digit PID, 8 hex digits
# and the dashes. Fixed, not this process's, so every process derives the same stem for a name.
_OVERHEAD = 1 + len(MARK) + 40 + 1 + 10 + 1 + 8
_HASH = 16
_live: set[Path] = set()
_lock = threading.Lock()


def _host() -> str:
    # Only characters that are safe in a file name; a long FQDN is cut (it only has to match itself).
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:40] or "host"


def stem(name: str, overhead: int = _OVERHEAD) -> str:
    """`name` as it appears in a temporary's name: itself when `overhead` more bytes still fit in
    NAME_MAX, else its first bytes (whole characters) + "~" + a hash of all of it."""
    raw = os.fsencode(name)
    if len(raw) + overhead <= NAME_MAX:
        return name
    keep = raw[: NAME_MAX - overhead - 1 - _HASH]
    # Whole characters only: drop the bytes of a character the cut went through.
    head = keep.decode("utf-8", "ignore") if _utf8(raw) else os.fsdecode(keep)
    return f"{head}~{hashlib.sha256(raw).hexdigest()[:_HASH]}"


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def partial_name(name: str) -> str:
    """The temporary name for `name`: `.NAME.partial-HOST-PID-RANDOM`, NAME shortened by `stem`."""
    return f".{stem(name)}{MARK}{_host()}-{os.getpid()}-{secrets.token_hex(4)}"


def _owner(entry: str) -> tuple[str, int] | None:
    """(host, pid) of a temporary's name, None when it is not one."""
    if not entry.startswith(".") or MARK not in entry:
        return None
    parts = entry[entry.rfind(MARK) + len(MARK):].rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
            path.unlink()


def remove_stale(directory: Path, name: str | None = None) -> list[Path]:
    """Remove the temporaries in `directory` (those of `name` only, when given) left by processes
    of this host that no longer run. Returns what was removed; unreadable directories are skipped."""
    prefix = f".{stem(name)}{MARK}" if name is not None else "."
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return []
    host = _host()
    for path in entries:
        owner = _owner(path.name)
        if owner is None or not path.name.startswith(prefix) or owner[0] != host:
            continue
        if owner[1] == os.getpid() or _alive(owner[1]):
            continue
        _remove(path)
        removed.append(path)
    return removed


def _register(path: Path) -> None:
    with _lock:
        _live.add(path)


def _release(path: Path) -> None:
    with _lock:
        _live.discard(path)
    _remove(path)


def remove_live() -> None:
    """Remove every temporary this process has open: the last act before a forced exit."""
    with _lock:
        paths = list(_live)
        _live.clear()
    for path in paths:
        _remove(path)


@contextlib.contextmanager
def temporary_dir(parent: Path, name: str, mode: int = 0o777) -> Iterator[Path]:
    """A new empty directory `parent/.NAME.partial-...` (`mode` & ~umask), removed on exit
    unless renamed away. Stale ones of `name` are removed first."""
    parent = Path(parent)
    remove_stale(parent, name)
    path = parent / partial_name(name)
    path.mkdir(mode)
    _register(path)
    try:
        yield path
    finally:
        _release(path)


@contextlib.contextmanager
def temporary_file(parent: Path, name: str, mode: int = 0o666) -> Iterator[tuple[int, Path]]:
    """A new file `parent/.NAME.partial-...` opened for writing: (fd, path). The fd is the caller's
    to close; the file is removed on exit unless renamed away. Stale ones of `name` are removed
    first. OSError from creating it (a missing or read-only directory) propagates."""
    parent = Path(parent)
    remove_stale(parent, name)
    while True:
        path = parent / partial_name(name)
        try:
            # mode & ~umask: the final file gets the permissions a plain open() would give it.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            break
        except FileExistsError:
            continue
    _register(path)
    try:
        yield fd, path
    finally:
        _release(path)


def write_private(path: Path, data: bytes) -> None:
    """`data` as the file `path`, whole or not at all (written beside it, then renamed over it), mode 0600
    whatever the umask: a store's file others could write is refused on load (core/trust.py)."""
    with temporary_file(path.parent, path.name, mode=0o600) as (fd, tmp):
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
