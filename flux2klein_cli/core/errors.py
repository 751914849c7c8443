"""Errors the CLI turns into exit codes: 2 for bad input, 1 for runtime failures."""


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
    the field; the CLI prints its flag in its place (cli/flags.py), a server the field."""

    def __init__(self, field: str, detail: str):
        self.field, self.detail = field, detail
        super().__init__(f"{field} {detail}")

    def named(self, name: str) -> str:
        """The message with the field called `name` (e.g. its command-line flag)."""
        return f"{name} {self.detail}"
