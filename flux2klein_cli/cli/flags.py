"""Core's field names as this CLI's flags: core names the field (core/errors.py), the CLI prints
its flag from the one table of spellings (core/fields.py)."""

from __future__ import annotations

from collections.abc import Mapping

from flux2klein_cli.core.errors import Flux2KleinError
from flux2klein_cli.core.fields import flag

# `compile` and `bench` take a run's shape: its images are --bs (the batch), not --num-images, and
# its references --refs sizes, not --image files.
SHAPE_FLAGS = {"num_images": "--bs", "batch": "--bs", "references": "--refs"}


def message(error: Exception, flags: Mapping[str, str] | None = None) -> str:
    """An error's one line as this CLI says it, every field it names as its flag (`flags`: a
    command's own spellings, e.g. SHAPE_FLAGS)."""
    if not isinstance(error, Flux2KleinError):
        return str(error)
    return error.named(lambda field: (flags or {}).get(field) or flag(field))
