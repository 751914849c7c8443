"""Every printer prints exactly what it is given: no rich markup read from paths or messages."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from flux2klein_cli.cli import output
from flux2klein_cli.core.errors import UserInputError

TRICKY = ["models/no[/]where", "models/[bold]x[/bold]", "pip install 'flux2klein-cli[tpu]'", "a [red]b[/] c"]


@pytest.fixture
def consoles(monkeypatch: pytest.MonkeyPatch) -> tuple[io.StringIO, io.StringIO]:
    err, out = io.StringIO(), io.StringIO()
    monkeypatch.setattr(output, "stderr", Console(file=err, width=200, color_system=None))
    monkeypatch.setattr(output, "stdout", Console(file=out, width=200, color_system=None))
    return err, out


@pytest.mark.parametrize("text", TRICKY)
def test_each_printer_prints_brackets_literally(text: str, consoles: tuple[io.StringIO, io.StringIO]) -> None:
    err, out = consoles
    output.error(text)
    output.warn(text)
    output.note(text)
    with output.status(text) as spinner:
        spinner.update(output.plain(text))
    assert err.getvalue().splitlines() == [f"error: {text}", f"warning: {text}", text]
    output.result(text, style="green")
    table = output.Table(title=text)
    table.add_column(text)
    table.add_row(text)
    output.show_table(table)
    printed = out.getvalue()
    assert printed.splitlines()[0] == text
    assert printed.count(text) == 4  # the line, the title, the header, the cell


def test_user_errors_prints_the_message_as_given(consoles: tuple[io.StringIO, io.StringIO]) -> None:
    import typer

    err, _ = consoles
    with pytest.raises(typer.Exit) as exit_info, output.user_errors():
        raise UserInputError("libtpu is missing: pip install 'flux2klein-cli[tpu]'")
    assert exit_info.value.exit_code == 2
    assert err.getvalue() == "error: libtpu is missing: pip install 'flux2klein-cli[tpu]'\n"


def test_prompt_file_utf8_bom_is_not_part_of_the_prompt(tmp_path: Path) -> None:
    from flux2klein_cli.core.runs.generate import read_prompts

    path = tmp_path / "prompts.txt"
    path.write_bytes("\ufeffa red fox\r\nsecond\n".encode())
    assert read_prompts(None, path) == ["a red fox", "second"]


def test_long_runs_are_announced_with_the_estimate() -> None:
    from flux2klein_cli.core.engine import cost as run_cost

    small = run_cost.RunCost(parameter_bytes=2**30, activation_bytes_per_image=2**20, batch=1, token_steps=4 * 4096)
    assert run_cost.describe_long_run(small) is None
    long = run_cost.RunCost(parameter_bytes=2**30, activation_bytes_per_image=2**20, batch=1,
                            token_steps=10000 * 4096)
    line = run_cost.describe_long_run(long)
    assert line is not None and "\n" not in line and "40,960,000 token-steps" in line and "GiB" in line


def test_a_new_output_shape_is_a_new_key_not_a_stale_entry(tmp_path: Path) -> None:
    import warnings

    import jax
    import jax.numpy as jnp

    from flux2klein_cli.core.compile.store import ExecutableStore
    from flux2klein_cli.core.compile.target import ProgramSpec

    def spec(shape: tuple[int, int], scale: float = 1.0) -> ProgramSpec:
        fn = jax.jit(lambda x: jnp.zeros(shape) + x * scale)
        return ProgramSpec("noise", fn, (jax.ShapeDtypeStruct((), jnp.float32),),
                           {"scale": scale, "shapes": {"grid": list(shape)}})

    store = ExecutableStore(tmp_path)
    store.load_or_compile(spec((2, 2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any StoreWarning fails the test
        _, info = store.load_or_compile(spec((4, 2)))
    assert info.status == "miss" and info.warning is None
    _, info = store.load_or_compile(spec((4, 2), scale=2.0))  # same shape, other config: stale
    assert info.status == "recompiled" and "stale" in (info.warning or "")


def test_every_field_core_names_is_spelled_as_a_real_flag() -> None:
    """Core names fields, never flags (a server has none): every field its messages name is, through
    the one table (core/fields.py), an option of some command, or marked as the server's alone."""
    import re

    import typer

    from flux2klein_cli.cli.app import app
    from flux2klein_cli.core.fields import FIELDS, SERVE_ONLY, flag

    options = {"PROMPT"} | {o for command in typer.main.get_command(app).commands.values()  # type: ignore[attr-defined]
                            for param in command.params for o in param.opts}
    core = Path(__file__).resolve().parents[1] / "flux2klein_cli" / "core"
    named: dict[str, str] = {}
    for path in core.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"raise \w+\(f?[\"'][^\"']*--[a-z]", text), f"{path.name} names a flag in an error"
        patterns = (r"\{field:([a-z_]+)\}", r'FieldError\(\s*"([a-z_]+)"', r'check_int\(\s*"([a-z_]+)"',
                    r'check_(?:int|float|name_length)\([^,()]*,\s*"([a-z_]+)"')
        for pattern in patterns:
            named.update((name, path.name) for name in re.findall(pattern, text) if path.name != "errors.py")
    assert {"steps", "num_images", "kv_cache_dir", "force", "mesh"} <= set(named)  # the scan finds them
    serve_only = {name for name, spelling in FIELDS.items() if spelling.flag == SERVE_ONLY}
    unknown = {name: where for name, where in named.items()
               if name not in serve_only and not set(flag(name).split("/")) <= options}
    assert unknown == {}
