"""Options shared by `generate` and `edit`, declared once, and the code that runs them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from flux2klein_cli.cli.output import emit_json, note, plain, result, status, user_errors, warn
from flux2klein_cli.cli.params import float_option
from flux2klein_cli.cli.progress import StepBar, wanted
from flux2klein_cli.core.distributed import native_stdout_to_stderr
from flux2klein_cli.core.errors import Flux2KleinError
from flux2klein_cli.core.generate import GenerateOptions, read_prompts, run_generate

PROMPT_FILE = typer.Option(None, "--prompt-file", help="One prompt per line; each gets --num-images images.")
MODEL = typer.Option("4b", "--model", "-m", help="Alias (4b, 9b, 9b-kv, base-4b, base-9b), repo id or dir; "
                     "tiny (tiny-kv for edit --kv) is a built-in random-weight model whose images are noise "
                     "(for trying the tool).")
OUTPUT = typer.Option(Path("out.png"), "--output", "-o",
                      help="PNG path; several images become NAME-0.png, NAME-1.png, ...")
HEIGHT = typer.Option(None, "--height", help="Output height in pixels, a multiple of the model's pixels per token "
                      "(16 for klein) [default: 1024 (tiny: 256), or the first reference's]")
WIDTH = typer.Option(None, "--width", help="Output width in pixels, as --height [default: as height]")
STEPS = typer.Option(None, "--steps", help="Denoising steps [default: 4 distilled, 50 base]")
GUIDANCE = float_option(None, "--guidance", help="Guidance scale; real CFG on base models only "
                        "[default: 1.0 distilled, 4.0 base]")
NEGATIVE = typer.Option("", "--negative-prompt", help="What to steer away from (base models with guidance > 1).")
SEED = typer.Option(0, "--seed", help="Noise seed; image i uses seed + i.")
NUM_IMAGES = typer.Option(1, "--num-images", "-n", help="Images per prompt.")
DTYPE = typer.Option("bf16", "--dtype", help="Parameter dtype: bf16 or fp32.")
LATENTS = typer.Option(None, "--latents", help="Initial noise .npy in diffusers' latents= shape: (B, 128, H/16, "
                       "W/16) for klein, from the model's latent geometry in general.")
FORCE = typer.Option(False, "--force", help="Overwrite existing output files.")
MAX_SEQUENCE = typer.Option(512, "--max-sequence-length", help="Prompt tokens (padded and truncated to this).")
MESH = typer.Option(None, "--mesh", help="Device mesh axis sizes over all devices of the run, e.g. data=2,fsdp=4 "
                    "(axes data, fsdp, tensor, context) [default: one device]")
TPU = typer.Option(None, "--tpu", help="On a TPU slice host: run FSDP over its chips, e.g. --tpu v6-4.")
COORDINATOR = typer.Option(None, "--coordinator", help="Multi-process run: the coordinator HOST:PORT "
                           "(process 0's); TPU slices need no flag.")
NUM_PROCESSES = typer.Option(None, "--num-processes", help="Multi-process run: how many processes.")
PROCESS_ID = typer.Option(None, "--process-id", help="Multi-process run: this process's index (0 writes outputs).")
COMPILE_CACHE = typer.Option(None, "--compile-cache", help="Store of compiled executables (see `flux2klein "
                             "compile`) [default: FLUX2KLEIN_COMPILE_CACHE or ~/.cache/flux2klein/executables]")
EFFORT = typer.Option("default", "--effort", help="XLA optimisation effort of compiled executables: default, "
                      "or fast (quicker to compile, possibly slower to run).")
NO_SAVE = typer.Option(False, "--no-save", help="Use stored executables but store no new ones.")
LORA = typer.Option([], "--lora", metavar="PATH_OR_REPO[:SCALE]",
                   help="A LoRA merged into the transformer at load (repeatable): a .safetensors file, a folder "
                   "holding one, or a hub repo fetched with `flux2klein fetch --lora`; SCALE defaults to 1.0. "
                   "Layouts: ai-toolkit / BFL, kohya / musubi, diffusers / PEFT, LoKr.")
JSON = typer.Option(False, "--json", help="Print one JSON object (paths, seeds, timings) on stdout.")


@contextmanager
def _written_on_failure(as_json: bool) -> Iterator[None]:
    """With --json, a batch that failed midway still prints one object: the error and the images
    already written (core/generate.py keeps them)."""
    try:
        yield
    except Flux2KleinError as e:
        if as_json and hasattr(e, "written"):
            emit_json({"error": str(e), "outputs": e.written})
        raise


def run(prompt: str | None, prompt_file: Path | None, options: dict, as_json: bool) -> None:
    """Build the options, run, and report: paths on stdout, or one JSON object (process 0 only)."""
    from flux2klein_cli.core.runtime import configure_jax
    from flux2klein_cli.core.snapshot import resolve_model

    configure_jax(warn)
    with user_errors(), _written_on_failure(as_json), native_stdout_to_stderr():
        opts = GenerateOptions(prompts=read_prompts(prompt, prompt_file), **options)
        if as_json:
            report = run_generate(opts, resolve_model, warn=warn)
        else:
            with status("starting") as spinner:
                bar = StepBar(pause=spinner.stop, resume=spinner.start) if wanted(as_json) else None
                try:
                    report = run_generate(opts, resolve_model, warn=warn, on_step=bar,
                                          on_phase=lambda phase: spinner.update(plain(phase)))
                finally:
                    if bar is not None:
                        bar.close()
    if not report.get("writer", True):
        return
    if as_json:
        emit_json(report)
        return
    seconds = report["seconds"]
    note(f"{len(report['outputs'])} image(s) {report['width']}x{report['height']}, {report['steps']} steps, "
                 f"in {seconds['total']:.1f} s (load {seconds['load']:.1f} s, denoise {seconds['denoise']:.1f} s)")
    for path in report["outputs"]:
        result(path)
