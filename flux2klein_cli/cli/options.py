"""Option types every command shares, declared once (as huggingface_hub's `hf` CLI does in _cli_utils.py).

Enums for the names a user picks from, built from core/choices.py; `Annotated` types for options
that mean the same in every command. Only light imports: `--help` must not load jax.
A bad choice raises the core check's UserInputError while parsing, so its message is the one the
command body would give (app.py prints it as one line, exit 2).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from flux2klein_cli.cli.params import float_option
from flux2klein_cli.core import choices
from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.hub.registry import aliases, sampling


def _enum(name: str, values: tuple[str, ...] | dict[str, str]) -> type[StrEnum]:
    return StrEnum(name, {v.replace("-", "_"): v for v in values})  # type: ignore[return-value]


Dtype = _enum("Dtype", choices.DTYPES)
Effort = _enum("Effort", choices.EFFORTS)
Layout = _enum("Layout", choices.LAYOUTS)
Quantize = _enum("Quantize", choices.QUANTIZE)
Phase = _enum("Phase", choices.PHASES)

E = TypeVar("E", bound=StrEnum)


def choice_option(enum: type[E], check: Callable[[str], str], *names: str, help: str) -> Any:
    """A typer.Option whose value is a member of `enum`; `check` (from core/choices.py) rejects the rest."""
    values = [member.value for member in enum]

    def parse(value: str | E) -> E:
        return value if isinstance(value, enum) else enum(check(value))

    return typer.Option(*names, parser=parse, metavar="[" + "|".join(values) + "]", help=help,
                        autocompletion=lambda incomplete: [v for v in values if v.startswith(incomplete)])


def model_help(extra: str = "") -> str:
    """--model's help, with the alias list from core/hub/registry.py."""
    return f"Alias ({aliases()}), hub repo id or directory{extra}."


MODEL_HELP_IMAGES = (
    f"Alias ({aliases(tiny=False)}), repo id or dir; tiny (tiny-kv for edit --kv) is a built-in random-weight "
    "model whose images are noise (for trying the tool)."
)

# Options that read the same in every command that has them.
DtypeOpt = Annotated[Dtype, choice_option(Dtype, choices.check_dtype, "--dtype", help="Parameter dtype.")]
EffortOpt = Annotated[Effort, choice_option(
    Effort, choices.check_effort, "--effort", help="XLA optimisation effort of compiled executables: fast is "
    "quicker to compile, possibly slower to run (keyed apart in the store).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Overwrite existing output files.")]
HeightOpt = Annotated[int | None, typer.Option(
    "--height", help="Output height in pixels, a multiple of the model's pixels per token (16 for klein) "
    f"\\[default: {DEFAULTS.side} (tiny: {DEFAULTS.tiny_side}), or the first reference's]")]
WidthOpt = Annotated[int | None, typer.Option("--width", help="Output width in pixels, as --height \\[default: as "
                                              "height]")]
_DISTILLED, _BASE = sampling(distilled=True), sampling(distilled=False)
StepsOpt = Annotated[int | None, typer.Option(
    "--steps", help=f"Denoising steps \\[default: the model's: {_DISTILLED.steps} distilled, {_BASE.steps} base]")]
GuidanceOpt = Annotated[float | None, float_option(
    "--guidance", help="Guidance scale; real CFG on base models only "
    f"\\[default: the model's: {_DISTILLED.guidance} distilled, {_BASE.guidance} base]")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Noise seed; image i uses seed + i.")]
MaxSequenceOpt = Annotated[int, typer.Option("--max-sequence-length", help="Prompt tokens (padded and truncated "
                                             "to this).")]
MeshOpt = Annotated[str | None, typer.Option(
    "--mesh", help="Device mesh axis sizes over all devices of the run, e.g. data=2,fsdp=4 (axes "
    f"{', '.join(choices.MESH_AXES)}) \\[default: one device]")]
TpuOpt = Annotated[str | None, typer.Option("--tpu", help="On a TPU slice host: run FSDP over its chips, e.g. "
                                            "--tpu v6-4.")]
CompileCacheOpt = Annotated[Path | None, typer.Option(
    "--compile-cache", help="Store of compiled executables (see `flux2klein compile`) \\[default: "
    "FLUX2KLEIN_COMPILE_CACHE or ~/.cache/flux2klein/executables]")]
# compile's old name for --compile-cache, still accepted.
OldCacheDirOpt = Annotated[Path | None, typer.Option("--cache-dir", hidden=True)]
RefsOpt = Annotated[str | None, typer.Option(
    "--refs", help="The edit's references: a count, that many at the output size (e.g. 2), or their sizes, "
    "HEIGHTxWIDTH comma-separated, height first (e.g. 1024x1024,768x1024); reports print WIDTHxHEIGHT.")]
NoSaveOpt = Annotated[bool, typer.Option("--no-save", help="Use stored executables but store no new ones.")]
RevisionOpt = Annotated[str | None, typer.Option("--revision", help="Hub branch, tag or commit (default: main).")]
OfflineOpt = Annotated[bool, typer.Option("--offline", help="Use the local Hugging Face cache only (as "
                                          "HF_HUB_OFFLINE=1 does); never touch the network.")]

# generate and edit.
PromptFileOpt = Annotated[Path | None, typer.Option("--prompt-file", help="One prompt per line; each gets "
                                                    "--num-images images.")]
OutputOpt = Annotated[Path, typer.Option("--output", "-o", help="PNG path; several images become NAME-0.png, "
                                         "NAME-1.png, ...")]
NegativeOpt = Annotated[str, typer.Option("--negative-prompt", help="What to steer away from (base models with "
                                          "guidance > 1).")]
NumImagesOpt = Annotated[int, typer.Option("--num-images", "-n", help="Images per prompt.")]
FromOpt = Annotated[Path | None, typer.Option(
    "--from", help="Rerun an image from the parameters its PNG carries (prompt, seed, size, model, ...); options "
    "given beside it override them.", metavar="IMAGE.png")]
LatentsOpt = Annotated[Path | None, typer.Option(
    "--latents", help="Initial noise .npy in diffusers' latents= shape: (B, 128, H/16, W/16) for klein, from the "
    "model's latent geometry in general.")]
InitImageOpt = Annotated[Path | None, typer.Option(
    "--init-image", help="Start from this image (image-to-image; with --mask, inpainting): the output takes its "
    "size, whose sides must be multiples of 16 (scaled to 1024x1024 area if larger).")]
MaskOpt = Annotated[Path | None, typer.Option(
    "--mask", help="With --init-image: inpaint. A grayscale image of the init image's size; white is repainted, "
    "black kept (binarised at half gray).")]
StrengthOpt = Annotated[float | None, float_option(
    "--strength", help="With --init-image: how much of the schedule runs, in (0, 1]; 1 starts from pure noise "
    f"\\[default: {DEFAULTS.strength}]")]
PaddingMaskCropOpt = Annotated[int | None, typer.Option(
    "--padding-mask-crop", metavar="PIXELS", help="With --mask: inpaint only the mask's box grown by PIXELS on each "
    "side (and to the output's aspect), scaled up to the output size, then pasted back into the init image.")]
ReferenceMaxAreaOpt = Annotated[int | None, typer.Option(
    "--reference-max-area", metavar="PIXELS", help="References above this many pixels are scaled down to it, "
    f"keeping their aspect, before the crop to multiples of 16 \\[default: {DEFAULTS.reference_max_area}]")]
CoordinatorOpt = Annotated[str | None, typer.Option("--coordinator", help="Multi-process run: the coordinator "
                                                    "HOST:PORT (process 0's); TPU slices need no flag.")]
NumProcessesOpt = Annotated[int | None, typer.Option("--num-processes", help="Multi-process run: how many "
                                                     "processes.")]
ProcessIdOpt = Annotated[int | None, typer.Option("--process-id", help="Multi-process run: this process's index "
                                                  "(0 writes outputs).")]


TransformerOpt = Annotated[str | None, typer.Option(
    "--transformer", help="Take the transformer from PATH instead of --model: a diffusers component folder, one "
    ".safetensors file in diffusers or BFL keys, a .gguf file (BF16, Q8_0, Q4_K_M, ...) or BFL's fp8 / nvfp4 file "
    "(the config stays --model's).")]
VaeOpt = Annotated[str | None, typer.Option(
    "--vae", help="Take the VAE from PATH instead of --model: a component folder, one .safetensors file, or "
    "small-decoder (black-forest-labs/FLUX.2-small-decoder; `flux2klein fetch small-decoder` downloads it).")]


LoraOpt = Annotated[list[str], typer.Option(
    "--lora", metavar="PATH_OR_REPO[:SCALE]",
    help="A LoRA merged into the transformer (and text encoder) at load (repeatable): a .safetensors file, a folder "
    "holding one, or a hub repo fetched with `flux2klein fetch --lora`; SCALE defaults to 1.0. Layouts: ai-toolkit / "
    "BFL, kohya / musubi, diffusers / PEFT, LoKr.")]


def compile_cache(new: Path | None, old: Path | None) -> Path | None:
    """--compile-cache, or its old name --cache-dir."""
    if new is not None and old is not None and new != old:
        raise UserInputError("--cache-dir is the old name of --compile-cache: give one")
    return new if new is not None else old
