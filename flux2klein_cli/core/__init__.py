"""Everything the commands share; importable without Typer."""
