"""Path names checked before any work: a name the filesystem cannot hold fails in a second as one
line, not after a run as an `Errno 36` traceback."""

from __future__ import annotations

import os
from pathlib import Path

from flux2klein_cli.core.errors import FieldError, UserInputError

NAME_MAX = 255  # bytes per name on Linux, macOS and Windows filesystems alike
PATH_MAX = 4096


def _name_max(path: Path) -> int:
    """The name limit of the nearest existing directory above `path` (255 where it cannot say)."""
    for parent in path.parents:
        try:
            return int(os.pathconf(parent, "PC_NAME_MAX"))
        except (OSError, ValueError):
            continue
    return NAME_MAX


def check_name_length(path: str | os.PathLike[str], field: str) -> None:
    """FieldError (ENAMETOOLONG) naming `field` ("output", "references") when a component of
    `path`, or the whole path, is longer than the filesystem allows."""
    text = os.fsencode(os.path.expanduser(os.fspath(path)))
    if len(text) > PATH_MAX:
        raise FieldError(field, f"is {len(text)} bytes long: file name too long (the limit is {PATH_MAX})")
    longest = max((part for part in text.split(b"/")), key=len, default=b"")
    limit = min(NAME_MAX, _name_max(Path(os.fsdecode(text)).absolute()))
    if len(longest) > limit:
        shown = os.fsdecode(longest)
        shown = shown if len(shown) <= 40 else f"{shown[:20]}...{shown[-12:]}"
        raise FieldError(field, f"{shown}: file name too long ({len(longest)} bytes; the limit is {limit})")


def check_input_file(path: Path, what: str, kind: str = "a file") -> None:
    """UserInputError unless `path` is there and is not a directory: `what` names it ("latents
    file"), `kind` what it should be ("an image file")."""
    if not path.exists():
        raise UserInputError(f"{what} {path} does not exist")
    if path.is_dir():
        raise UserInputError(f"{what} {path} is a directory, not {kind}")
