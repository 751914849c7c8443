"""`flux2klein parity`: flux2klein beside diffusers on the same checkpoint, prompt and noise."""

from __future__ import annotations

from pathlib import Path

import typer

from flux2klein_cli.cli.image_options import LORA
from flux2klein_cli.cli.output import Table, emit_json, note, plain, show_table, user_errors
from flux2klein_cli.cli.params import float_option


def parity(
    model: str = typer.Option("4b", "--model", "-m", help="Alias, repo id or local dir."),
    prompt: str = typer.Option("a red fox in snow, golden hour", "--prompt", help="The prompt both pipelines get."),
    image: list[Path] = typer.Option([], "--image", "-i", help="Reference image(s): compares an edit."),
    height: int = typer.Option(None, "--height", help="Output height [default: 1024 or the first reference's]."),
    width: int = typer.Option(None, "--width", help="Output width [default: as height]."),
    steps: int = typer.Option(None, "--steps", help="Steps [default: the model's]."),
    guidance: float = float_option(None, "--guidance", help="Guidance [default: the model's]."),
    seed: int = typer.Option(0, "--seed", help="Seed of the shared initial noise."),
    dtype: str = typer.Option("fp32", "--dtype", help="Both pipelines' dtype: fp32 or bf16."),
    threshold: float = float_option(0.99, "--threshold", help="Exit 1 when SSIM is below this."),
    out_dir: Path = typer.Option(Path("parity"), "--out-dir", help="Where ours.png, diffusers.png, diff.png go."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing files in --out-dir."),
    lora: list[str] = LORA,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Compare with diffusers' pipeline: SSIM, PSNR and max pixel difference.

    Needs the \\[parity] extra (torch, diffusers). Writes both images and a difference image;
    exits 1 when SSIM is below --threshold.

    Example: flux2klein parity --model 4b --steps 4 --height 512 --width 512 --json
    """
    from flux2klein_cli.core.parity import parity_check
    from flux2klein_cli.core.runtime import configure_jax
    from flux2klein_cli.core.snapshot import resolve_model

    configure_jax()
    with user_errors():
        report = parity_check(
            model=model, resolve=resolve_model, prompt=prompt, references=list(image), height=height, width=width,
            steps=steps, guidance=guidance, seed=seed, dtype=dtype, out_dir=out_dir, force=force, lora=lora,
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
