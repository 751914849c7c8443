"""Trust in what a store holds: only its owner may have written it.

A stored executable is machine code, and jax's executable payload is a pickle, so the
executable store and the reference KV store are as trusted as a `bin/` directory. Two checks
stand between a store and the code it would run:

- ownership and mode, as ssh checks `~/.ssh`: the store's directory and every file of an
  entry belong to this user and are writable by nobody else;
- an HMAC-SHA256 of each entry's record, with a 32-byte key in a 0600 file inside the store
  that only this user can read. An entry copied in by anyone else, or edited, fails it.

Neither check parses anything it has not authenticated: a record is JSON (no code), and the
executable's bytes are unpickled only after the record's HMAC and the bytes' sha256 match.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

KEY_FILE = ".flux2klein-hmac-key"
KEY_BYTES = 32
SIGNATURE_FIELD = "hmac_sha256"


class Untrusted(Exception):
    """A store, entry or key that another user could have written. The message says why
    and how to fix it."""


def _owner_and_mode(path: Path, what: str) -> os.stat_result:
    try:
        info = path.lstat()
    except OSError as e:
        raise Untrusted(f"{what} {path} cannot be read ({e.strerror or e})") from None
    if stat.S_ISLNK(info.st_mode):
        raise Untrusted(f"{what} {path} is a symbolic link")
    if info.st_uid != os.geteuid():
        raise Untrusted(f"{what} {path} belongs to another user (uid {info.st_uid})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Untrusted(f"{what} {path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}; "
                        f"chmod go-w it)")
    return info


def check_private_dir(path: Path, what: str = "directory") -> None:
    """A directory only this user can write (its root may be a symlink the user chose)."""
    info = _owner_and_mode(path.resolve(), what)
    if not stat.S_ISDIR(info.st_mode):
        raise Untrusted(f"{what} {path} is not a directory")


def check_private_file(path: Path, what: str = "file") -> None:
    """A regular file (not a link) of this user that no one else can write."""
    info = _owner_and_mode(path, what)
    if not stat.S_ISREG(info.st_mode):
        raise Untrusted(f"{what} {path} is not a regular file")


def make_private_dir(path: Path) -> None:
    """Create `path` (and its parents) if missing; a new leaf is 0700."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)


def open_store(root: Path, what: str, *, create: bool) -> bytes | None:
    """The HMAC key of the private store directory `root` (created 0700 when `create`); None
    when there is no such directory and `create` is False. Raises Untrusted, or OSError when
    the directory cannot be made."""
    if create:
        make_private_dir(root)
    elif not root.is_dir():
        return None
    check_private_dir(root, what)
    return store_key(root)


def store_key(root: Path) -> bytes:
    """The store's HMAC key, created (0600, exclusively) on first use. Refused when another
    user could read or write it."""
    path = root / KEY_FILE
    if not path.exists():
        _publish_key(path)
    check_private_file(path, "store key")
    info = path.lstat()
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise Untrusted(f"store key {path} is readable by other users (mode {stat.S_IMODE(info.st_mode):o}; "
                        f"chmod 600 it)")
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise Untrusted(f"store key {path} has {len(key)} bytes, not {KEY_BYTES} (remove it to start afresh)")
    return key


def _publish_key(path: Path) -> None:
    """Write a new key whole, then link it into place: a concurrent first use sees either no
    key or a complete one, and the first link wins (the loser reads the winner's key)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _canonical(record: dict[str, Any]) -> bytes:
    unsigned = {k: v for k, v in record.items() if k != SIGNATURE_FIELD}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"), default=str).encode()


def sign(record: dict[str, Any], key: bytes) -> dict[str, Any]:
    """The record with its HMAC added (over every other field, canonical JSON)."""
    return {**record, SIGNATURE_FIELD: hmac.new(key, _canonical(record), hashlib.sha256).hexdigest()}


def verify(record: dict[str, Any], key: bytes) -> None:
    """Raise Untrusted unless the record carries this store's HMAC of its other fields."""
    signature = record.get(SIGNATURE_FIELD)
    expected = hmac.new(key, _canonical(record), hashlib.sha256).hexdigest()
    if not isinstance(signature, str) or not hmac.compare_digest(signature, expected):
        raise Untrusted("its record is not signed with this store's key (written by someone else, or edited)")
