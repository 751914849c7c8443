"""A batch manifest: JSONL, CSV or one prompt per line, read into numbered entries.

Each data line (a JSON object, a CSV row after the header, a non-blank text line) is one entry,
numbered from 0 in file order, bad lines included, so fixing a bad line later keeps every
other entry's index. An entry is either a request (`RunFields` with the command line's
defaults under the line's own fields, an output name template, optional explicit seeds) or
the reason its line is unusable. Checks against the model (sizes, steps, references) come
later, from the plan (core/engine/plan.py); this module checks the line's shape and types.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flux2klein_cli.core import limits
from flux2klein_cli.core.engine.plan import RunFields
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.fields import FIELDS, manifest_key, read

DEFAULT_OUTPUT = "{index:05d}-{seed}.png"
FORMATS = ("jsonl", "csv", "text")
LIST_SEPARATOR = ";"  # CSV cells holding lists (`images`, `seeds`)


@dataclass(frozen=True)
class Entry:
    """One data line of the manifest: a request, or `error` saying why not."""

    index: int  # 0-based, over every data line (bad ones too)
    line: int  # 1-based line number in the file (CSV: the row's first line)
    text: str  # the line as read, for the record's hash
    fields: RunFields | None = None
    seeds: tuple[int, ...] | None = None  # explicit per-image seeds (`seeds`), else fields.seed + i
    output: str = DEFAULT_OUTPUT
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Manifest:
    path: Path
    format: str
    entries: tuple[Entry, ...]

    @property
    def bad(self) -> tuple[Entry, ...]:
        return tuple(e for e in self.entries if not e.ok)


class LineError(Exception):
    """A line that is not a usable request (its message, without the line number)."""


# The fields a line may give (core/fields.py spells and reads them; CSV cells are converted first).
LINE_FIELDS = ("prompt", "negative_prompt", "seed", "seeds", "num_images", "height", "width", "steps", "guidance",
               "max_sequence_length", "references", "kv", "output", "init_image", "mask", "strength",
               "padding_mask_crop", "reference_max_area")
KEYS = {manifest_key(name): name for name in LINE_FIELDS}  # a line's key -> its field
FILE_FIELDS = ("init_image", "mask")  # one path each, relative to the manifest like `images`


def entry_from_object(obj: Any, *, index: int, line: int, text: str, defaults: RunFields, base: Path,
                      output: str) -> Entry:
    """An entry from one line's JSON object (or a CSV row converted to one)."""
    try:
        if not isinstance(obj, dict):
            raise LineError(f"must be a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(KEYS))
        if unknown:
            raise LineError(f"unknown field {unknown[0]!r} (fields: {', '.join(KEYS)})")
        values = {key: read(KEYS[key], value, key) for key, value in obj.items()}
        if "prompt" not in values:
            raise LineError("prompt is missing")
        seeds = values.pop("seeds", None)
        if seeds is not None:
            if "seed" in values:
                raise LineError("give seed or seeds, not both")
            if values.get("num_images", len(seeds)) != len(seeds):
                raise LineError(f"num_images is {values['num_images']} but seeds lists {len(seeds)}")
            for s in seeds:
                limits.check_seed(s)
            values.update(seed=seeds[0], num_images=len(seeds))
        template = values.pop("output", output)
        references = tuple(p if Path(p).is_absolute() else base / p for p in map(Path, values.pop("images", ())))
        for name in FILE_FIELDS:
            if name in values:
                if not values[name]:
                    raise LineError(f"{name} must be a file name, got \"\"")
                values[name] = Path(values[name]) if Path(values[name]).is_absolute() else base / values[name]
        fields = replace(defaults, prompts=(values.pop("prompt"),), references=references or defaults.references,
                         **values)
        return Entry(index, line, text, fields, seeds, template)
    except (LineError, UserInputError) as e:
        return Entry(index, line, text, error=str(e))


def _jsonl(text: str) -> Iterator[tuple[int, str, Any]]:
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        try:
            yield number, line, json.loads(line)
        except json.JSONDecodeError as e:
            yield number, line, LineError(f"is not JSON ({e.msg} at column {e.colno})")


def _csv_value(name: str, cell: str) -> Any:
    """A CSV cell as the JSON value its field takes."""
    if name in FILE_FIELDS:
        return cell.strip()
    if name in ("images",):
        return [part.strip() for part in cell.split(LIST_SEPARATOR) if part.strip()]
    if name == "seeds":
        return [_csv_number(name, part.strip(), int) for part in cell.split(LIST_SEPARATOR) if part.strip()]
    if name == "kv":
        lowered = cell.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise LineError(f"kv must be true or false, got {cell!r}")
    kind = FIELDS[KEYS[name]].kind if name in KEYS else None
    if kind == "whole":
        return _csv_number(name, cell.strip(), int)
    if kind == "number":
        return _csv_number(name, cell.strip(), float)
    return cell


def _csv_number(name: str, cell: str, kind: type) -> Any:
    try:
        return kind(cell)
    except ValueError:
        raise LineError(f"{name} must be a {'whole number' if kind is int else 'number'}, got {cell!r}") from None


def _csv(text: str) -> Iterator[tuple[int, str, Any]]:
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader)
    except StopIteration:
        return
    except csv.Error as e:
        raise UserInputError(f"its CSV header cannot be read: {e}") from None
    names = [h.strip() for h in header]
    if "prompt" not in names:
        raise UserInputError(f"its CSV header has no prompt column (columns: {', '.join(names)})")
    start = reader.line_num + 1
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            yield start, "", LineError(f"is not valid CSV: {e}")
            start = reader.line_num + 1
            continue
        line, start = start, reader.line_num + 1
        if not any(cell.strip() for cell in row):
            continue
        raw = ",".join(row)
        if len(row) != len(names):
            yield line, raw, LineError(f"has {len(row)} cells; the header has {len(names)}")
            continue
        try:
            yield line, raw, {n: _csv_value(n, c) for n, c in zip(names, row, strict=True) if c.strip()}
        except LineError as e:
            yield line, raw, e


def _text_lines(text: str) -> Iterator[tuple[int, str, Any]]:
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.strip():
            yield number, raw.strip(), {"prompt": raw.strip()}


def detect_format(path: Path, text: str) -> str:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if suffix == ".csv":
        return "csv"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return "jsonl" if first.startswith("{") else "text"


def read_manifest(path: Path, defaults: RunFields, *, output: str = DEFAULT_OUTPUT,
                  format: str | None = None) -> Manifest:
    """Every data line of `path` as an entry. An unreadable file (missing, too large, not UTF-8,
    a CSV without a prompt column) is a UserInputError; a bad line is an entry with its error."""
    text = limits.read_bounded_text(path, limits.LIMITS.manifest_bytes, "manifest")
    kind = format or detect_format(path, text)
    if kind not in FORMATS:
        raise UserInputError(f"manifest format {kind!r} is not one of {', '.join(FORMATS)}")
    lines = {"jsonl": _jsonl, "csv": _csv, "text": _text_lines}[kind]
    entries = []
    try:
        for index, (number, raw, value) in enumerate(lines(text)):
            if isinstance(value, LineError):
                entries.append(Entry(index, number, raw, error=str(value)))
            else:
                entries.append(entry_from_object(value, index=index, line=number, text=raw, defaults=defaults,
                                                 base=path.parent, output=output))
    except UserInputError as e:
        raise UserInputError(f"manifest {path}: {e}") from None
    if not entries:
        raise UserInputError(f"manifest {path} has no requests")
    return Manifest(path, kind, tuple(entries))
