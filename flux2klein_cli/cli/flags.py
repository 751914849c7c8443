"""Core's field names as this CLI's flags: a FieldError names the field, the CLI prints its flag."""

from __future__ import annotations

from collections.abc import Mapping

from flux2klein_cli.core.errors import FieldError

# Fields whose flag is not `--` + the field with dashes.
_FLAGS = {
    "prompt": "PROMPT",
    "references": "--image",
    "reference": "--image",
    "latents": "--latents",
    "size": "--height/--width",
}

# `compile` and `bench` take a run's shape: its images are --bs (the batch), not --num-images, and
# its references --refs sizes, not --image files.
SHAPE_FLAGS = {"num_images": "--bs", "batch": "--bs", "references": "--refs"}


def flag(field: str) -> str:
    """The command-line spelling of a request field."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def message(error: Exception, flags: Mapping[str, str] | None = None) -> str:
    """An error's one line as this CLI says it: a field error names the flag (`flags`: a
    command's own spellings, e.g. SHAPE_FLAGS)."""
    if not isinstance(error, FieldError):
        return str(error)
    return error.named(lambda field: (flags or {}).get(field) or flag(field))
