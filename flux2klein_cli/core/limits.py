"""The one table of limits every run obeys, whichever command or server builds it, and the checks
that apply them before any work.

Each bound keeps one input from exhausting memory or time, or from overflowing a type: steps
(the loop's length), sizes (tokens, so attention), prompts (bytes before tokenising, tokens
after), references (count and decoded pixels), images per run, seeds (a 32-bit noise key),
guidance (float32) and the size of every file read whole. A value past its bound is a
UserInputError that names the field and the bound; messages name fields ("steps", "height",
"reference image a.png"), not CLI flags, since a server reaches them too.

docs/cli.md ("Limits") shows `LIMITS.rows()`; tests/test_limits.py keeps the two equal.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from flux2klein_cli.core.errors import FieldError, UserInputError

KIB, MIB, GIB = 2**10, 2**20, 2**30


@dataclass(frozen=True)
class Limits:
    steps: int = 1000  # base models default to 50; 20x that is no sampler's useful range
    size_multiple: int = 16  # the published models' pixels per token (a model's own multiple applies)
    max_side: int = 16384  # px per side (the model's RoPE range is checked beside it: 125024 px for klein)
    max_pixels: int = 8192 * 8192  # px per image: 262144 tokens, attention's quadratic cost beyond reason
    prompt_bytes: int = 64 * KIB  # UTF-8 bytes of one prompt (a negative prompt too)
    prompt_tokens: int = 40960  # max_sequence_length: Qwen3's max_position_embeddings (the text encoder's)
    references: int = 4  # what FLUX.2 [klein] was trained with; diffusers warns above it
    reference_side: int = 16384  # px per side of a reference as read
    reference_pixels: int = 8192 * 8192  # decoded pixels of one reference (RGB: 192 MiB), a decompression-bomb bound
    images: int = 1024  # images per run (prompts x images per prompt)
    seed_end: int = 2**32  # seed + image index < this: the noise key is 32 bits
    guidance: float = 100.0  # scale: x a float32 noise difference stays far from overflow
    prompt_file_bytes: int = 1 * MIB  # a prompt file read whole
    manifest_bytes: int = 16 * MIB  # a batch or server manifest (JSON) read whole
    latents_bytes: int = 1 * GIB  # a latents .npy
    reference_bytes: int = 256 * MIB  # a reference image file
    metadata_bytes: int = 1 * MIB  # text chunks of one PNG written (Pillow reads none above 1 MiB back)

    def rows(self) -> list[tuple[str, str, str]]:
        """(field, bound, what it bounds): the table docs/cli.md shows."""
        return [
            ("steps", f"1 .. {self.steps}", "denoising steps"),
            ("height, width", f"{self.size_multiple} .. {self.max_side} px, a multiple of the model's "
                              f"pixels per token ({self.size_multiple})", "output size per side"),
            ("width x height", f"at most {self.max_pixels} px ({_square(self.max_pixels)})", "output pixels"),
            ("prompt", f"at most {self.prompt_bytes} bytes (UTF-8)", "each prompt and the negative prompt"),
            ("max_sequence_length", f"1 .. {self.prompt_tokens} tokens", "prompt tokens (padded and truncated)"),
            ("references", f"at most {self.references}", "reference images per edit"),
            ("reference image", f"at most {self.reference_side} px per side and {self.reference_pixels} px "
                                f"({_square(self.reference_pixels)}) as read", "decoded reference pixels"),
            ("num_images", f"prompts x images at most {self.images}", "images per run"),
            ("seed", f"0 .. {self.seed_end - 1}, seed + image index included", "noise seed (32 bits)"),
            ("guidance", f"finite, 0 .. {self.guidance:g}", "guidance scale"),
            ("prompt file", f"at most {_bytes(self.prompt_file_bytes)}", "file size"),
            ("manifest", f"at most {_bytes(self.manifest_bytes)}", "file size"),
            ("latents file", f"at most {_bytes(self.latents_bytes)}", "file size (.npy)"),
            ("reference image file", f"at most {_bytes(self.reference_bytes)}", "file size"),
            ("PNG metadata", f"at most {_bytes(self.metadata_bytes)}", "text chunks of each image written"),
        ]


def _square(pixels: int) -> str:
    side = math.isqrt(pixels)
    return f"{side}x{side}" if side * side == pixels else f"{pixels / 1e6:.0f} megapixels"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size and not n % size:
            return f"{n // size} {unit}"
    return f"{n} bytes"


LIMITS = Limits()


def markdown_table(limits: Limits = LIMITS) -> str:
    """The "Limits" table of docs/cli.md."""
    lines = ["| field | bound | bounds |", "|---|---|---|"]
    lines += [f"| {field} | {bound} | {what} |" for field, bound, what in limits.rows()]
    return "\n".join(lines)


# --- checks ------------------------------------------------------------------------------------


def check_int(field: str, value: int, low: int, high: int, unit: str = "") -> None:
    """`low <= value <= high`, else one line naming the field and the bound."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(field, f"must be a whole number, got {value!r}")
    suffix = f" {unit}" if unit else ""
    if value < low:
        raise FieldError(field, f"must be at least {low}{suffix}, got {value}")
    if value > high:
        raise FieldError(field, f"must be at most {high}{suffix}, got {value}")


def check_float(field: str, value: float, low: float, high: float) -> None:
    """A finite `low <= value <= high`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FieldError(field, f"must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise FieldError(field, f"must be between {low:g} and {high:g}, got {value:g}")


def check_steps(steps: int) -> None:
    check_int("steps", steps, 1, LIMITS.steps)


def check_size(height: int, width: int, multiple: int = LIMITS.size_multiple, model_side: int | None = None) -> None:
    """The one size rule (an output, a reference, a compiled shape, a server's warm sizes): each side
    a positive multiple of the model's pixels per token (`multiple`) within what its position
    encoding tells apart (`model_side`, core/engine/cost.max_side) and the table's side, and the
    pair within the table's pixel count."""
    for field, value in (("height", height), ("width", width)):
        check_int(field, value, multiple, 2**31, "px")
        # The tighter of the two bounds names the refusal: a limit the user can reach.
        if model_side is not None and model_side < LIMITS.max_side and value > model_side:
            raise FieldError(field, f"{value} is above this model's limit of {model_side} px (its position encoding "
                             f"tells {model_side // multiple} tokens apart per side)")
        check_int(field, value, multiple, LIMITS.max_side, "px")
        if value % multiple:
            lower = value - value % multiple
            raise FieldError(field, f"{value} is not a multiple of {multiple}; use {lower} or {lower + multiple}")
    if height * width > LIMITS.max_pixels:
        raise FieldError("width", f"x {{field:height}} is {width}x{height} = {width * height} px; the limit is "
                             f"{LIMITS.max_pixels} px ({_square(LIMITS.max_pixels)})")


def check_guidance(guidance: float) -> None:
    check_float("guidance", guidance, 0.0, LIMITS.guidance)


def check_seed(seed: int, images: int = 1) -> None:
    """Image i draws from seed + i into a 32-bit key: every one of them must fit."""
    check_int("seed", seed, 0, LIMITS.seed_end - 1)
    last = seed + images - 1
    if last >= LIMITS.seed_end:
        raise FieldError("seed", f"+ image index must stay below 2**32 ({LIMITS.seed_end}), got {last} "
                             f"(seed {seed}, {images} images)")


def check_images(count: int) -> None:
    """Images in one run: prompts x images per prompt."""
    check_int("num_images", count, 1, LIMITS.images, "images per run (prompts x images)")


def check_max_sequence_length(tokens: int) -> None:
    check_int("max_sequence_length", tokens, 1, LIMITS.prompt_tokens, "tokens")


def check_prompt(text: str, field: str = "prompt") -> None:
    """One prompt's UTF-8 size (before the tokenizer sees it)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > LIMITS.prompt_bytes:
        raise FieldError(field, f"is {size} bytes; the limit is {LIMITS.prompt_bytes} bytes")


def check_reference_count(count: int) -> None:
    if count > LIMITS.references:
        raise FieldError("references", f"gives {count} reference images; at most {LIMITS.references} are supported")


def check_reference_pixels(name: str, width: int, height: int) -> None:
    """A reference's size from its header, before any pixel is decoded; `name` names it
    ("reference image a.png")."""
    pixels = width * height
    if max(width, height) > LIMITS.reference_side or pixels > LIMITS.reference_pixels:
        raise UserInputError(
            f"{name} is {width}x{height} ({pixels / 1e6:.0f} megapixels); the limit is "
            f"{LIMITS.reference_pixels / 1e6:.0f} megapixels and {LIMITS.reference_side} px per side: "
            "scale it down first"
        )


# --- files read whole ----------------------------------------------------------------------------


def check_file_size(path: str | os.PathLike[str], limit: int, what: str) -> None:
    """A regular file's size from stat, before it is opened for reading (a FIFO or device has no
    size to trust: use `read_bounded_bytes` for those)."""
    try:
        size = os.stat(path).st_size
    except OSError:
        return  # the reader that follows says why it cannot open it
    if size > limit:
        raise UserInputError(f"{what} {os.fspath(path)} is {size} bytes; the limit is {_bytes(limit)}")


def read_bounded_bytes(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """At most `limit` bytes of `path`: reads limit + 1 and refuses if they came, so /dev/zero or a
    FIFO costs limit + 1 bytes at most. `what` names the file in messages ("prompt file")."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = f.read(limit + 1)
    except IsADirectoryError:
        raise UserInputError(f"{what} {p} is a directory, not a file") from None
    except FileNotFoundError:
        raise UserInputError(f"{what} {p} does not exist") from None
    except PermissionError:
        raise UserInputError(f"cannot read {what} {p}: permission denied") from None
    except OSError as e:
        raise UserInputError(f"cannot read {what} {p}: {e.strerror or e}") from None
    if len(data) > limit:
        raise UserInputError(f"{what} {p} is larger than the limit of {_bytes(limit)}")
    return data


def read_bounded_text(path: str | os.PathLike[str], limit: int, what: str, encoding: str = "utf-8-sig") -> str:
    """`read_bounded_bytes` decoded (utf-8-sig by default: a BOM is not part of the text)."""
    data = read_bounded_bytes(path, limit, what)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise UserInputError(f"{what} {path} is not {encoding.removesuffix('-sig').upper()} text "
                             f"(byte {e.start}: {e.reason})") from None
