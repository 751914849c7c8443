"""Errors the CLI turns into exit codes: 2 for bad input, 1 for runtime failures.

Core speaks of fields, not flags (a server has none): a message names a field as `{field:NAME}`
(`seed`, `num_images`, `kv_cache_dir`), and each door spells it its own way when it prints the
error (`named`: the CLI's flags, a batch manifest's keys, the Images API's parameters, all from
core/fields.py). `str()` gives the fields' own names.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_FIELD = re.compile(r"\{field:([a-z_]+)\}")


def field(name: str) -> str:
    """A field named inside a message, for each door to spell its way."""
    return f"{{field:{name}}}"


class Flux2KleinError(Exception):
    """A failure with a message meant for the user (exit code 1)."""

    exit_code = 1

    def named(self, name_of: Callable[[str], str]) -> str:
        """The message with every field it names called as `name_of` says (e.g. its command-line flag)."""
        text = self.args[0] if self.args and isinstance(self.args[0], str) else super().__str__()
        return _FIELD.sub(lambda m: name_of(m.group(1)), text)

    def __str__(self) -> str:
        return self.named(lambda name: name)


class UserInputError(Flux2KleinError):
    """Bad usage or bad input: a readable one-line message, exit code 2."""

    exit_code = 2


class CheckpointError(UserInputError):
    """A checkpoint on disk is incomplete, corrupt or does not fit the model config."""


class NonFiniteError(Flux2KleinError):
    """A stage of the pipeline produced NaN or inf: nothing is written (exit code 1)."""


class FieldError(UserInputError):
    """Bad input in one named field of a request (`steps`, `height`, `references`): the message
    starts with the field, and may name others as `{field:name}` in `detail`."""

    def __init__(self, field_name: str, detail: str):
        self.field, self.detail = field_name, detail
        super().__init__(f"{field(field_name)} {detail}")
