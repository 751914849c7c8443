"""`--transformer` and `--vae`, declared once for every model command (core/components.py does the work)."""

from __future__ import annotations

import typer

TRANSFORMER = typer.Option(None, "--transformer", help="Take the transformer from PATH instead of --model: a "
                           "diffusers component folder, or one .safetensors file in diffusers or BFL keys "
                           "(the config stays --model's).")
VAE = typer.Option(None, "--vae", help="Take the VAE from PATH instead of --model: a component folder, one "
                   ".safetensors file, or small-decoder (black-forest-labs/FLUX.2-small-decoder; "
                   "`flux2klein fetch small-decoder` downloads it).")
