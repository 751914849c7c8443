"""Shell completions: the committed scripts are what the generator writes now, and the app answers them."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from flux2klein_cli.cli.app import app

ROOT = Path(__file__).resolve().parent.parent


def generator():
    spec = importlib.util.spec_from_file_location("gen_completions", ROOT / "scripts" / "gen_completions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = generator()


@pytest.mark.parametrize("shell", GEN.SHELLS)
def test_committed_completions_are_current(shell: str) -> None:
    path = GEN.target(shell)
    assert path.exists(), f"{path} is missing: run python scripts/gen_completions.py"
    assert path.read_text() == GEN.render(shell), f"{path} is stale: run python scripts/gen_completions.py"


@pytest.mark.parametrize("shell", GEN.SHELLS)
def test_scripts_parse(shell: str) -> None:
    exe = shutil.which(shell)
    if exe is None:
        pytest.skip(f"{shell} is not installed")
    result = subprocess.run([exe, "-n", str(GEN.target(shell))], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def complete(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run the app the way the completion scripts do: as `flux2klein`, with the completion variables set."""
    code = "import sys; sys.argv[0] = 'flux2klein'; from flux2klein_cli.cli.app import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )


SHELL_ENV = {
    "bash": {"_FLUX2KLEIN_COMPLETE": "complete_bash", "COMP_WORDS": "flux2klein ", "COMP_CWORD": "1"},
    "zsh": {"_FLUX2KLEIN_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": "flux2klein "},
    "fish": {
        "_FLUX2KLEIN_COMPLETE": "complete_fish",
        "_TYPER_COMPLETE_FISH_ACTION": "get-args",
        "_TYPER_COMPLETE_ARGS": "flux2klein ",
    },
}


@pytest.mark.parametrize("shell", GEN.SHELLS)
def test_app_answers_completion_requests(shell: str) -> None:
    # The scripts only call back into the app; this checks the other half, for every registered command.
    result = complete(SHELL_ENV[shell])
    assert "not supported" not in result.stderr, (
        "the app does not answer completion requests: with add_completion=False Typer never registers its "
        "completion classes; call typer.completion.completion_init() in flux2klein_cli/cli/app.py"
    )
    assert result.returncode == 0, result.stderr
    commands = [name for name, cmd in typer.main.get_command(app).commands.items() if not cmd.hidden]
    for name in commands:
        assert name in result.stdout, f"{name!r} missing from {shell} completions: {result.stdout!r}"
