"""Option parsers shared by the commands: one home for each rule about a typed value."""

from __future__ import annotations

import math
from typing import Any

import typer


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
