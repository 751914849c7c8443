"""`flux2klein parity`: flux2klein beside diffusers on the same checkpoint, prompt and noise."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flux2klein_cli.cli import options as o
from flux2klein_cli.cli.output import Table, emit_json, note, plain, show_table, user_errors
from flux2klein_cli.cli.params import float_option
from flux2klein_cli.core import choices
from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.hub.registry import DEFAULT_MODEL


def parity(
    model: Annotated[str, typer.Option("--model", "-m", help=o.model_help())] = DEFAULT_MODEL,
    prompt: Annotated[str, typer.Option("--prompt", help="The prompt both pipelines get.")
                      ] = "a red fox in snow, golden hour",
    image: Annotated[list[Path], typer.Option("--image", "-i", help="Reference image(s): compares an edit.")
                     ] = [],  # noqa: B006 (typer reads the default; it is never mutated)
    height: Annotated[int | None, typer.Option("--height", help=f"Output height \\[default: {DEFAULTS.side} or the "
                                               "first reference's].")] = None,
    width: Annotated[int | None, typer.Option("--width", help="Output width \\[default: as height].")] = None,
    steps: o.StepsOpt = None,
    guidance: o.GuidanceOpt = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the shared initial noise.")] = 0,
    dtype: Annotated[o.Dtype, o.choice_option(o.Dtype, choices.check_dtype, "--dtype", help="Both pipelines' "
                                              "dtype.")] = o.Dtype.fp32,
    threshold: Annotated[float, float_option("--threshold", help="Exit 1 when SSIM is below this.")] = 0.99,
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Where ours.png, diffusers.png, diff.png go.")
                       ] = Path("parity"),
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing files in --out-dir.")] = False,
    lora: o.LoraOpt = [],  # noqa: B006 (typer reads the default; it is never mutated)
    init_image: o.InitImageOpt = None,
    mask: o.MaskOpt = None,
    strength: o.StrengthOpt = None,
    padding_mask_crop: o.PaddingMaskCropOpt = None,
    transformer: o.TransformerOpt = None,
    vae: o.VaeOpt = None,
    as_json: o.JsonOpt = False,
) -> None:
    """Compare with diffusers' pipeline: SSIM, PSNR and max pixel difference.

    Needs the \\[parity] extra (torch, diffusers). With --init-image (and --mask, and
    --padding-mask-crop), against diffusers' Flux2KleinInpaintPipeline, the noise drawn by torch
    from --seed. Writes both images and a difference image; exits 1 when SSIM is below --threshold.

    Example: flux2klein parity --model 4b --steps 4 --height 512 --width 512 --json
    """
    from flux2klein_cli.core.devices.runtime import configure_jax
    from flux2klein_cli.core.hub.snapshot import resolve_model
    from flux2klein_cli.core.runs.parity import parity_check

    configure_jax()
    with user_errors():
        report = parity_check(
            model=model, resolve=resolve_model, prompt=prompt, references=list(image), height=height, width=width,
            steps=steps, guidance=guidance, seed=seed, dtype=dtype.value, out_dir=out_dir, force=force, lora=lora,
            init_image=init_image, mask=mask, strength=strength, padding_mask_crop=padding_mask_crop,
            transformer=transformer, vae=vae,
        )
    passed = report["ssim"] >= threshold
    report["threshold"], report["passed"] = threshold, passed
    if as_json:
        emit_json(report)
    else:
        table = Table(title=f"parity: {model}, {report['width']}x{report['height']}, {report['steps']} steps, {dtype}")
        for column in ("SSIM", "PSNR dB", "max diff /255", "verdict"):
            table.add_column(column, justify="right")
        verdict = plain("pass", "green") if passed else plain("FAIL", "red")
        psnr = "inf" if report["psnr"] is None else f"{report['psnr']:.2f}"
        table.add_row(f"{report['ssim']:.5f}", psnr, str(report["max_diff"]), verdict)
        show_table(table)
        note("images: " + ", ".join(report["files"].values()))
    if not passed:
        raise typer.Exit(1)
