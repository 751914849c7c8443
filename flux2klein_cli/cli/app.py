"""The `flux2klein` command line: one Typer app, one small module per command."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

import typer
from typer.completion import completion_init
from typer.core import TyperGroup

from flux2klein_cli import __version__
from flux2klein_cli.cli import (
    batch_cmd,
    bench_cmd,
    compile_cmd,
    convert_cmd,
    edit_cmd,
    env_cmd,
    fetch_cmd,
    generate_cmd,
    inspect_cmd,
    parity_cmd,
    serve_cmd,
)
from flux2klein_cli.cli.output import click_exceptions, error, usage_error
from flux2klein_cli.core.errors import Flux2KleinError

# add_completion=False skips this registration; the scripts in completions/ call back into the app.
completion_init()


class OneLineErrors(TyperGroup):
    """Usage errors (`--height 64.5`, an unknown option) print one `error:` line and exit 2, as every
    other error does; Typer's boxed form is kept for `--help` only."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_exceptions.ClickException as e:
            sys.exit(usage_error(e))
        except Flux2KleinError as e:  # an option's value failed its core check while parsing (cli/options.py)
            error(e)
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    name="flux2klein",
    cls=OneLineErrors,
    help=(
        "Run Black Forest Labs' FLUX.2 \\[klein] image models on JAX.\n\n"
        "Examples:\n\n"
        "  flux2klein generate \"a red fox in snow\" --model tiny -o fox.png   (random weights)\n\n"
        "  flux2klein fetch 9b-kv\n\n"
        "  flux2klein generate \"a lighthouse at dawn\" --model 4b -o out.png\n\n"
        "  flux2klein edit \"put both cats on the sofa\" --image a.png --image b.png --kv\n\n"
        "  flux2klein env   (what a run on this host uses)\n\n"
        "Each command's --help has more. "
        "Exit codes: 0 done, 1 runtime failure, 2 bad usage or bad input."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"flux2klein {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Run Black Forest Labs' FLUX.2 \\[klein] image models on JAX."""


def _help(command: Callable[..., Any]) -> str:
    """A command's docstring with each paragraph on one line. Rich help keeps single line
    breaks, so prose wrapped in the source would print as ragged half-lines; each example
    is a paragraph of its own and stays one."""
    paragraphs = inspect.cleandoc(command.__doc__ or "").split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


for name, command in (
    ("generate", generate_cmd.generate),
    ("edit", edit_cmd.edit),
    ("batch", batch_cmd.batch),
    ("inspect", inspect_cmd.inspect),
    ("parity", parity_cmd.parity),
    ("bench", bench_cmd.bench),
    ("fetch", fetch_cmd.fetch),
    ("convert", convert_cmd.convert),
    ("compile", compile_cmd.compile_programs),
    ("env", env_cmd.env),
    ("serve", serve_cmd.serve),
):
    app.command(name, help=_help(command))(command)


def main() -> None:
    app()
