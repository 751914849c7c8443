"""Core's field names as this CLI's flags: a FieldError names the field, the CLI prints its flag."""

from __future__ import annotations

from flux2klein_cli.core.errors import FieldError

# Fields whose flag is not `--` + the field with dashes.
_FLAGS = {
    "prompt": "PROMPT",
    "references": "--image",
    "reference": "--image",
    "latents": "--latents",
}


def flag(field: str) -> str:
    """The command-line spelling of a request field."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def message(error: Exception) -> str:
    """An error's one line as this CLI says it: a field error names the flag."""
    return error.named(flag) if isinstance(error, FieldError) else str(error)
