"""Shared CLI plumbing: errors to exit codes, JSON on stdout, everything else on stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from flux2klein_cli.core.errors import Flux2KleinError

stderr = Console(stderr=True)
stdout = Console()


@contextmanager
def user_errors() -> Iterator[None]:
    """Known failures become one readable line on stderr and their exit code, never a traceback."""
    try:
        yield
    except Flux2KleinError as e:
        stderr.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)  # `[parity]` stays
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        stderr.print("interrupted")
        raise typer.Exit(130) from None


def emit_json(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, indent=None, sort_keys=False) + "\n")
    sys.stdout.flush()
