"""Every line the CLI prints: errors to exit codes, JSON on stdout, everything else on stderr.

Text here is never read as rich markup: paths, prompts and messages may hold `[` and `]`
(`models/no[/]where`, `pip install 'flux2klein-cli[tpu]'`) and print exactly as given. Only the
fixed prefixes ("error:", "warning:") are styled, as separate spans.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.status import Status
from rich.table import Table as RichTable
from rich.text import Text

from flux2klein_cli.cli import interrupted_line
from flux2klein_cli.core.errors import Flux2KleinError

# The click Typer parses with (its own vendored copy in newer Typer): its exceptions module, found publicly.
click_exceptions = sys.modules[typer.BadParameter.__module__]

stderr = Console(stderr=True)
stdout = Console()


def plain(text: object, style: str = "") -> Text:
    """Text rich prints literally: for table titles and cells that hold paths or names."""
    return Text(str(text), style=style)


def _line(prefix: str, style: str, message: object) -> Text:
    return Text.assemble((prefix, style), " ", str(message))


def error(message: object) -> None:
    """One `error: ...` line on stderr."""
    stderr.print(_line("error:", "bold red", message), highlight=False, soft_wrap=True)


def warn(message: object) -> None:
    """One `warning: ...` line on stderr (none after `interrupted`)."""
    if interrupted_line.announced():
        return
    stderr.print(_line("warning:", "yellow", message), highlight=False, soft_wrap=True)


def note(message: object, style: str = "") -> None:
    """A progress or summary line on stderr (never on stdout, which scripts read); none after
    `interrupted`."""
    if interrupted_line.announced():
        return
    stderr.print(plain(message, style), highlight=False, soft_wrap=True)


def result(message: object, style: str = "") -> None:
    """A result line on stdout: a path, a summary under a table."""
    stdout.print(plain(message, style), highlight=False, soft_wrap=True)


class Table(RichTable):
    """A rich table whose title, headers and string cells print as given, never as markup."""

    def __init__(self, title: object = None, **kwargs: Any) -> None:
        super().__init__(title=None if title is None else plain(title), **kwargs)

    def add_column(self, header: object = "", *args: Any, **kwargs: Any) -> None:
        super().add_column(plain(header), *args, **kwargs)

    def add_row(self, *cells: Any, **kwargs: Any) -> None:
        super().add_row(*(plain(c) if isinstance(c, str) else c for c in cells), **kwargs)


def show_table(rendered: RichTable) -> None:
    """A table on stdout (results); build it with `Table`."""
    stdout.print(rendered)


def status(message: object) -> Status:
    """A spinner on stderr; `.update(plain(...))` keeps later messages literal too."""
    return stderr.status(plain(message))


@contextmanager
def user_errors(flags: Mapping[str, str] | None = None) -> Iterator[None]:
    """Known failures become one readable line on stderr and their exit code, never a traceback
    (`flags`: the command's own spellings of fields, cli/flags.py)."""
    try:
        yield
    except Flux2KleinError as e:
        from flux2klein_cli.cli.flags import message

        error(message(e, flags))
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        interrupted_line.announce()
        raise typer.Exit(130) from None


def usage_error(e: Exception) -> int:
    """A click / Typer usage error (`--height 64.5`, an unknown option) as one line; returns its exit code.

    `flux2klein` alone still shows its help: Typer printed it before raising NoArgsIsHelpError.
    """
    if type(e).__name__ == "NoArgsIsHelpError":  # as Typer tells it (older click lacks the class)
        return e.exit_code
    message = " ".join(e.format_message().split())
    ctx = getattr(e, "ctx", None)
    if isinstance(e, click_exceptions.UsageError) and ctx is not None:
        message = message.rstrip(".") + f"; see '{ctx.command_path} --help'"
    error(message)
    return e.exit_code


def emit_json(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, indent=None, sort_keys=False) + "\n")
    sys.stdout.flush()
