"""Errors the CLI turns into exit codes: 2 for bad input, 1 for runtime failures."""

from __future__ import annotations

import re
from collections.abc import Callable


class Flux2KleinError(Exception):
    """A failure with a message meant for the user (exit code 1)."""

    exit_code = 1


class UserInputError(Flux2KleinError):
    """Bad usage or bad input: a readable one-line message, exit code 2."""

    exit_code = 2


class CheckpointError(UserInputError):
    """A checkpoint on disk is incomplete, corrupt or does not fit the model config."""


class NonFiniteError(Flux2KleinError):
    """A stage of the pipeline produced NaN or inf: nothing is written (exit code 1)."""


class FieldError(UserInputError):
    """Bad input in one named field of a request (`steps`, `height`, `references`): core names
    the field; the CLI prints its flag in its place (cli/flags.py), a server the field. Other
    fields the message mentions are written `{field:name}` in `detail`, and named the same way."""

    def __init__(self, field: str, detail: str):
        self.field, self.detail = field, detail
        super().__init__(self.named(lambda name: name))

    def named(self, name_of: Callable[[str], str]) -> str:
        """The message with every field called as `name_of` says (e.g. its command-line flag)."""
        return f"{name_of(self.field)} " + re.sub(r"\{field:([a-z_]+)\}", lambda m: name_of(m.group(1)), self.detail)
