"""`flux2klein edit`: an image from a prompt and one or more reference images."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flux2klein_cli.cli import image_options
from flux2klein_cli.cli import options as o
from flux2klein_cli.cli.output import user_errors
from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.errors import FieldError
from flux2klein_cli.core.hub.registry import DEFAULT_KV_MODEL, DEFAULT_MODEL


def edit(
    ctx: typer.Context,
    image: Annotated[list[Path], typer.Option("--image", "-i", help="Reference image; repeat for several (up to 4).")
                     ] = [],  # noqa: B006 (typer reads the default; it is never mutated)
    prompt: Annotated[str | None, typer.Argument(help="The edit to make. Or use --prompt-file.")] = None,
    prompt_file: o.PromptFileOpt = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help=f"{o.model_help()} \\[default: {DEFAULT_MODEL}; {DEFAULT_KV_MODEL} with --kv]")] = None,
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
    init_image: o.InitImageOpt = None,
    mask: o.MaskOpt = None,
    strength: o.StrengthOpt = None,
    padding_mask_crop: o.PaddingMaskCropOpt = None,
    reference_max_area: o.ReferenceMaxAreaOpt = None,
    force: o.ForceOpt = False,
    max_sequence_length: o.MaxSequenceOpt = DEFAULTS.max_sequence_length,
    kv: Annotated[bool, typer.Option("--kv", help="Reference KV cache (KV-trained models: 9b-kv): the references "
                                     "run through the model once, every step reuses their keys and values.")] = False,
    kv_cache_dir: Annotated[Path | None, typer.Option(
        "--kv-cache-dir", help="With --kv: keep the references' KV cache here and reuse it in later runs with the "
        "same model and images.")] = None,
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
    """Edit or combine reference images following a prompt.

    References are checked (sides >= 64 px, aspect <= 8), scaled down to 1024x1024 area if
    larger, cropped to multiples of the model's pixels per token (16 for klein); the output
    takes the first reference's size unless --height/--width are given.

    Examples:

      flux2klein edit "put both cats on the sofa" --image a.png --image b.png -o cats.png

      flux2klein edit "make it night" -i day.png --model 9b --seed 3 --json

      flux2klein edit "put both cats on the sofa" -i a.png -i b.png --kv --kv-cache-dir ~/.cache/f2k-kv

      flux2klein edit "a red armchair" --init-image room.png --mask chair.png --strength 0.9

      flux2klein edit "make it a watercolour" --init-image photo.png --strength 0.6

      flux2klein edit "a small bird" --init-image tree.png --mask branch.png --padding-mask-crop 32

      flux2klein edit --from cats.png --steps 8 -o cats-8.png   (cats.png's parameters, more steps)
    """
    a = image_options.with_png(ctx, from_image, "edit", dict(
        references=list(image), prompt=prompt, model=model, height=height, width=width, steps=steps, guidance=guidance,
        negative_prompt=negative_prompt, seed=seed, dtype=dtype.value, latents=latents, init_image=init_image,
        mask=mask, strength=strength, padding_mask_crop=padding_mask_crop, reference_max_area=reference_max_area,
        max_sequence_length=max_sequence_length, kv=kv, lora=list(lora), transformer=transformer, vae=vae))
    if not a["references"] and a["init_image"] is None:
        with user_errors():
            raise FieldError("references", "is missing: give a reference image, or an --init-image to start from")
    image_options.run(
        prompt=a["prompt"], prompt_file=prompt_file, as_json=as_json, output=output, force=force,
        devices=dict(mesh=mesh, tpu=tpu, coordinator=coordinator, num_processes=num_processes, process_id=process_id),
        engine=dict(model=a["model"] or (DEFAULT_KV_MODEL if a["kv"] else DEFAULT_MODEL), dtype=a["dtype"],
                    compile_cache=compile_cache, save_executables=not no_save, effort=effort.value,
                    transformer=a["transformer"], vae=a["vae"], lora=tuple(a["lora"]), kv_cache_dir=kv_cache_dir),
        fields=dict(references=tuple(a["references"]), height=a["height"], width=a["width"], steps=a["steps"],
                    guidance=a["guidance"], negative_prompt=a["negative_prompt"], seed=a["seed"],
                    num_images=num_images, latents=a["latents"], max_sequence_length=a["max_sequence_length"],
                    kv=a["kv"], init_image=a["init_image"], mask=a["mask"], strength=a["strength"],
                    padding_mask_crop=a["padding_mask_crop"], reference_max_area=a["reference_max_area"]),
    )
