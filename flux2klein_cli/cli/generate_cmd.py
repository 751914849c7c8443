"""`flux2klein generate`: text to image."""

from __future__ import annotations

from pathlib import Path

import typer

from flux2klein_cli.cli import image_options as o
from flux2klein_cli.core.distributed import DeviceOptions


def generate(
    prompt: str = typer.Argument(None, help="What to draw. Or use --prompt-file."),
    prompt_file: Path = o.PROMPT_FILE,
    model: str = o.MODEL,
    output: Path = o.OUTPUT,
    height: int = o.HEIGHT,
    width: int = o.WIDTH,
    steps: int = o.STEPS,
    guidance: float = o.GUIDANCE,
    negative_prompt: str = o.NEGATIVE,
    seed: int = o.SEED,
    num_images: int = o.NUM_IMAGES,
    dtype: str = o.DTYPE,
    latents: Path = o.LATENTS,
    force: bool = o.FORCE,
    max_sequence_length: int = o.MAX_SEQUENCE,
    mesh: str = o.MESH,
    tpu: str = o.TPU,
    coordinator: str = o.COORDINATOR,
    num_processes: int = o.NUM_PROCESSES,
    process_id: int = o.PROCESS_ID,
    compile_cache: Path = o.COMPILE_CACHE,
    no_save: bool = o.NO_SAVE,
    effort: str = o.EFFORT,
    lora: list[str] = o.LORA,
    as_json: bool = o.JSON,
) -> None:
    """Generate images from a text prompt.

    Examples:

      flux2klein generate "a lighthouse at dawn" --model 4b -o out.png

      flux2klein generate --prompt-file prompts.txt -n 2 --seed 7 -o batch.png --json

      flux2klein generate "a red fox in snow" --model tiny -o fox.png   (random weights: noise, for testing)
    """
    o.run(prompt, prompt_file, dict(
        model=model, output=output, height=height, width=width, steps=steps, guidance=guidance,
        negative_prompt=negative_prompt, seed=seed, num_images=num_images, dtype=dtype, latents=latents, force=force,
        max_sequence_length=max_sequence_length,
        devices=DeviceOptions(mesh, tpu, coordinator, num_processes, process_id), compile_cache=compile_cache,
        save_executables=not no_save, effort=effort, lora=lora,
    ), as_json)
