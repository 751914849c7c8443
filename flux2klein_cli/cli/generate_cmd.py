"""`flux2klein generate`: text to image."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flux2klein_cli.cli import image_options
from flux2klein_cli.cli import options as o
from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.hub.registry import DEFAULT_MODEL


def generate(
    ctx: typer.Context,
    prompt: Annotated[str | None, typer.Argument(help="What to draw. Or use --prompt-file.")] = None,
    prompt_file: o.PromptFileOpt = None,
    model: Annotated[str, typer.Option("--model", "-m", help=o.MODEL_HELP_IMAGES)] = DEFAULT_MODEL,
    output: o.OutputOpt = Path("out.png"),
    height: o.HeightOpt = None,
    width: o.WidthOpt = None,
    steps: o.StepsOpt = None,
    guidance: o.GuidanceOpt = None,
    negative_prompt: o.NegativeOpt = "",
    seed: o.SeedOpt = 0,
    num_images: o.NumImagesOpt = 1,
    dtype: o.DtypeOpt = o.Dtype.bf16,
    latents: o.LatentsOpt = None,
    force: o.ForceOpt = False,
    max_sequence_length: o.MaxSequenceOpt = DEFAULTS.max_sequence_length,
    mesh: o.MeshOpt = None,
    tpu: o.TpuOpt = None,
    coordinator: o.CoordinatorOpt = None,
    num_processes: o.NumProcessesOpt = None,
    process_id: o.ProcessIdOpt = None,
    compile_cache: o.CompileCacheOpt = None,
    no_save: o.NoSaveOpt = False,
    effort: o.EffortOpt = o.Effort.default,
    lora: o.LoraOpt = [],  # noqa: B006 (typer reads the default; it is never mutated)
    transformer: o.TransformerOpt = None,
    vae: o.VaeOpt = None,
    from_image: o.FromOpt = None,
    as_json: o.JsonOpt = False,
) -> None:
    """Generate images from a text prompt.

    Examples:

      flux2klein generate "a lighthouse at dawn" --model 4b -o out.png

      flux2klein generate --prompt-file prompts.txt -n 2 --seed 7 -o batch.png --json

      flux2klein generate "a red fox in snow" --model tiny -o fox.png   (random weights: noise, for testing)

      flux2klein generate --from fox.png --seed 5 -o fox-5.png   (fox.png's parameters, another seed)
    """
    a = image_options.with_png(ctx, from_image, "generate", dict(
        prompt=prompt, model=model, height=height, width=width, steps=steps, guidance=guidance,
        negative_prompt=negative_prompt, seed=seed, dtype=dtype.value, latents=latents,
        max_sequence_length=max_sequence_length, lora=list(lora), transformer=transformer, vae=vae))
    image_options.run(
        prompt=a["prompt"], prompt_file=prompt_file, as_json=as_json, output=output, force=force,
        devices=dict(mesh=mesh, tpu=tpu, coordinator=coordinator, num_processes=num_processes, process_id=process_id),
        engine=dict(model=a["model"], dtype=a["dtype"], compile_cache=compile_cache, save_executables=not no_save,
                    effort=effort.value, transformer=a["transformer"], vae=a["vae"], lora=tuple(a["lora"])),
        fields=dict(height=a["height"], width=a["width"], steps=a["steps"], guidance=a["guidance"],
                    negative_prompt=a["negative_prompt"], seed=a["seed"], num_images=num_images,
                    latents=a["latents"], max_sequence_length=a["max_sequence_length"]),
    )
