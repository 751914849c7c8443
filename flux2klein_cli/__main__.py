"""`python -m flux2klein_cli` runs the CLI (what `bench --phase ttfi` spawns)."""

from flux2klein_cli.cli.main import console

console()
