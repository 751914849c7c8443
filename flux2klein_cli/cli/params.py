"""Option parsers shared by the commands: one home for each rule about a typed value."""

from __future__ import annotations

import math
from typing import Any

import typer
from typer.core import TyperOption


def finite_float(value: str | float) -> float:
    """A float option's value: a number, and neither NaN nor infinite (`--guidance nan` would
    otherwise run and write an image of NaNs)."""
    if isinstance(value, float):  # a default, already parsed
        return value
    try:
        number = float(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a number") from None
    if not math.isfinite(number):
        raise typer.BadParameter(f"{value!r} is not a finite number")
    return number


def float_option(*names: str, help: str) -> Any:
    """A typer.Option for a float that must be finite (the default goes in the signature: `Annotated`)."""
    return typer.Option(*names, help=help, parser=finite_float, metavar="FLOAT")


def _no_type_for_flags() -> None:
    """A flag takes no value, so `--help` shows no type after it. Typer 0.29 labels every
    option with its annotation (`--force <bool>`, even `--help <bool>`), as if `--force true`
    were the spelling; the label of a value-taking option stays Typer's."""
    shown = TyperOption.display_type_rich
    if getattr(shown, "flux2klein_flags", False):
        return

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.flux2klein_flags = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_no_type_for_flags()  # every command's options come through this module (cli/options.py imports it)
