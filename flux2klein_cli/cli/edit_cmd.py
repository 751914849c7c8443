"""`flux2klein edit`: an image from a prompt and one or more reference images."""

from __future__ import annotations

from pathlib import Path

import typer

from flux2klein_cli.cli import image_options as o
from flux2klein_cli.core.distributed import DeviceOptions


def edit(
    prompt: str = typer.Argument(None, help="The edit to make. Or use --prompt-file."),
    image: list[Path] = typer.Option(..., "--image", "-i", help="Reference image; repeat for several (up to 4)."),
    prompt_file: Path = o.PROMPT_FILE,
    model: str = typer.Option(None, "--model", "-m", help="Alias (4b, 9b, 9b-kv, base-4b, base-9b), repo id or "
                              "dir [default: 4b; 9b-kv with --kv]"),
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
    kv: bool = typer.Option(False, "--kv", help="Reference KV cache (KV-trained models: 9b-kv): the references "
                            "run through the model once, every step reuses their keys and values."),
    kv_cache_dir: Path = typer.Option(None, "--kv-cache-dir", help="With --kv: keep the references' KV cache "
                                      "here and reuse it in later runs with the same model and images."),
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
    """Edit or combine reference images following a prompt.

    References are checked (sides >= 64 px, aspect <= 8), scaled down to 1024x1024 area if
    larger, cropped to multiples of the model's pixels per token (16 for klein); the output
    takes the first reference's size unless --height/--width are given.

    Examples:

      flux2klein edit "put both cats on the sofa" --image a.png --image b.png -o cats.png

      flux2klein edit "make it night" -i day.png --model 9b --seed 3 --json

      flux2klein edit "put both cats on the sofa" -i a.png -i b.png --kv --kv-cache-dir ~/.cache/f2k-kv
    """
    o.run(prompt, prompt_file, dict(
        model=model or ("9b-kv" if kv else "4b"), output=output, references=list(image), height=height, width=width,
        steps=steps,
        guidance=guidance, negative_prompt=negative_prompt, seed=seed, num_images=num_images, dtype=dtype,
        latents=latents, force=force,
        max_sequence_length=max_sequence_length, kv=kv, kv_cache_dir=kv_cache_dir,
        devices=DeviceOptions(mesh, tpu, coordinator, num_processes, process_id), compile_cache=compile_cache,
        save_executables=not no_save, effort=effort, lora=lora,
    ), as_json)
