"""Where images go: the one naming module. One `-o` path for a run's images (`plan_outputs`),
a batch's name templates ({index}, {seed}, {slug}), and the two checks every name passes: a PNG
name, and nothing already there unless `force`.
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePath, PurePosixPath

from flux2klein_cli.core.errors import FieldError, UserInputError
from flux2klein_cli.core.paths import check_name_length
from flux2klein_cli.core.temporaries import temporary_file

PNG_SUFFIX = ".png"
TEMPLATE_FIELDS = ("index", "seed", "slug")


def check_png_name(path: PurePath) -> None:
    if path.suffix.lower() != PNG_SUFFIX:
        raise FieldError("output", f"{path} must end in {PNG_SUFFIX}")


def refuse_existing(paths: Iterable[str | os.PathLike[str]], why: str = "") -> None:
    """Names already taken (a link, even a broken one, counts) are refused: `force` overwrites them."""
    existing = [str(p) for p in paths if os.path.lexists(p)]
    if existing:
        shown = ", ".join(existing[:3])
        more = f" and {len(existing) - 3} more" if len(existing) > 3 else ""
        verb = "exists" if len(existing) == 1 else "exist"
        raise UserInputError(f"{shown}{more} {verb}{why}; pass {{field:force}} to overwrite")


def plan_outputs(output: str | os.PathLike[str], count: int, *, force: bool) -> list[Path]:
    """The file names for `count` images from one `-o` path, checked before any work is done.

    One image: `output` itself. Several: `stem-<i>.png` next to it, i from 0, zero-padded to the width of the
    last index so that they sort (out-0 ... out-9; out-00 ... out-11). The directory must exist and be writable;
    without `force` no target may exist.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    check_name_length(output, "output")
    output = Path(output).expanduser()
    if output.is_dir():
        raise FieldError("output", f"{output} is a directory; give a file name ending in {PNG_SUFFIX}")
    check_png_name(output)
    parent = output.parent
    if not parent.exists():
        raise UserInputError(f"output directory {parent} does not exist")
    if not parent.is_dir():
        raise UserInputError(f"{parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserInputError(f"output directory {parent} is not writable")
    try:  # os.access says yes to root anywhere (/proc too): a file made and removed says for sure
        with temporary_file(parent, "write-check") as (fd, _):
            os.close(fd)
    except OSError as e:
        raise UserInputError(f"output directory {parent} is not writable ({e.strerror or e})") from None

    if count == 1:
        paths = [output]
    else:
        width = len(str(count - 1))
        paths = [parent / f"{output.stem}-{i:0{width}d}{output.suffix}" for i in range(count)]

    for p in paths:
        check_name_length(p, "output")  # NAME-0.png is longer than NAME.png
        if p.is_dir():
            raise UserInputError(f"output {p} is a directory")
    if not force:
        refuse_existing(paths)
    return paths


def slug(prompt: str, length: int = 40) -> str:
    """The prompt as a file-name fragment: lower-case letters and digits joined by dashes."""
    words = re.findall(r"[a-z0-9]+", prompt.lower())
    text = "-".join(words)[:length].strip("-")
    return text or "image"


def check_template(template: str) -> None:
    """Only {index}, {seed} and {slug}, with format specs; a PNG name."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise UserInputError(f"output template {template!r} is malformed ({e})") from None
    for _, name, _, _ in parsed:
        if name is not None and name not in TEMPLATE_FIELDS:
            raise UserInputError(f"output template {template!r} names {{{name}}}; it may use "
                                 f"{', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)}")


def render_outputs(template: str, index: int, seeds: Sequence[int], prompt: str) -> tuple[str, ...]:
    """The item's output names, each a relative path inside the output directory."""
    check_template(template)
    names = []
    for seed in seeds:
        try:
            name = template.format(index=index, seed=seed, slug=slug(prompt))
        except (ValueError, IndexError, KeyError) as e:
            raise UserInputError(f"output template {template!r} cannot be filled ({e})") from None
        names.append(check_output_name(name))
    if len(set(names)) != len(names):
        raise UserInputError(f"output template {template!r} gives the item's {len(names)} images one name; "
                             "put {seed} in it")
    return tuple(names)


def check_output_name(name: str) -> str:
    """A name that stays inside the output directory and ends in .png (normalised)."""
    if not name or "\0" in name or "\\" in name:
        raise UserInputError(f"output {name!r} is not a usable file name")
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise UserInputError(f"output {name} would be written outside the output directory")
    check_png_name(path)
    normal = os.path.normpath(name)
    if normal.startswith("."):  # hidden files are the results' and temporaries' names
        raise UserInputError(f"output {name} must not start with a dot")
    check_name_length(normal, "output")
    return normal
