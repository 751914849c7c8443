"""The one table of a request's fields: how each door spells them (the CLI's flags, a batch
manifest's keys, the Images API's parameters) and what kind of value each holds, with the one
set of readers that check a value given as JSON (a manifest line, a PNG's record).

Core names fields (`FieldError`, `{field:NAME}` in any message: core/errors.py); each door prints
an error with its own spelling from here. A field missing from the table is spelled as its name
by the manifest and the API, and `--` + the name with dashes by the CLI.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flux2klein_cli.core.errors import FieldError

SERVE_ONLY = ""  # a field no command-line option sets (the CLI then prints the field's name)


@dataclass(frozen=True)
class Field:
    kind: str | None = None  # the value's kind (READERS), for the fields a manifest line or a PNG record holds
    flag: str | None = None  # the CLI's; None: "--" + the field with dashes
    manifest: str | None = None  # a batch manifest line's key; None: the field
    api: str | None = None  # the Images API's parameter (serve); None: the field


FIELDS: dict[str, Field] = {
    "prompt": Field("text", flag="PROMPT"),
    "prompts": Field(flag="PROMPT", manifest="prompt", api="prompt"),
    "negative_prompt": Field("text"),
    "seed": Field("whole"),
    "seeds": Field("wholes"),
    "num_images": Field("whole", api="n"),
    "height": Field("whole", api="size"),
    "width": Field("whole", api="size"),
    "size": Field(flag="--height/--width", manifest="height/width"),
    "steps": Field("whole"),
    "guidance": Field("number"),
    "max_sequence_length": Field("whole"),
    "references": Field("names", flag="--image", manifest="images", api="image"),
    "kv": Field("flag"),
    "latents": Field("text"),
    "init_image": Field("text", api="image"),
    "mask": Field("text"),
    "strength": Field("number"),
    "padding_mask_crop": Field("whole"),
    "reference_max_area": Field("whole"),
    "output": Field("text"),
    "model": Field("text"),
    "dtype": Field("text"),
    "transformer": Field("text"),
    "vae": Field("text"),
    "from_image": Field(flag="--from"),
    "batch": Field(flag="--bs"),
    "batch_size": Field(flag="--bs"),
    "max_body_bytes": Field(flag="--max-body-mb"),
    "response_format": Field(flag=SERVE_ONLY),
    "jobs_kept": Field(flag=SERVE_ONLY),
}


def flag(field: str) -> str:
    """The command-line spelling of a field."""
    spelling = FIELDS.get(field)
    if spelling is None or spelling.flag is None:
        return "--" + field.replace("_", "-")
    return spelling.flag or field


def manifest_key(field: str) -> str:
    """A batch manifest's spelling of a field."""
    spelling = FIELDS.get(field)
    return spelling.manifest if spelling and spelling.manifest else field


def api_param(field: str) -> str:
    """The Images API's spelling of a field (serve's `param`)."""
    spelling = FIELDS.get(field)
    return spelling.api if spelling and spelling.api else field


# --- values given as JSON ----------------------------------------------------------------------


def _shown(value: Any) -> str:
    return json.dumps(value, default=str)


def read_text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise FieldError(name, f"must be text, got {_shown(value)}")
    return value


def read_whole(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(name, f"must be a whole number, got {_shown(value)}")
    return value


def read_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FieldError(name, f"must be a finite number, got {_shown(value)}")
    return float(value)


def read_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise FieldError(name, f"must be true or false, got {_shown(value)}")
    return value


def read_names(name: str, value: Any) -> tuple[str, ...]:
    """A file name or a list of them (none empty)."""
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise FieldError(name, f"must be a list of file names, got {_shown(value)}")
    return tuple(values)


def read_wholes(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise FieldError(name, f"must be a non-empty list of whole numbers, got {_shown(value)}")
    return tuple(read_whole(name, v) for v in value)


READERS: dict[str, Callable[[str, Any], Any]] = {
    "text": read_text, "whole": read_whole, "number": read_number, "flag": read_flag, "names": read_names,
    "wholes": read_wholes,
}


def read(field: str, value: Any, name: str | None = None) -> Any:
    """`value` checked as the field's kind; an error names it as `name` (default: the field)."""
    kind = FIELDS[field].kind
    assert kind is not None, f"{field} has no kind of value"
    return READERS[kind](name or field, value)
