"""The limits table (core/limits.py): each check at its bound and one past it, the bounded
readers on a device file and the docs' table against the module."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from flux2klein_cli.core import limits
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.limits import LIMITS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_docs_table_matches_module() -> None:
    assert limits.markdown_table() in DOCS.read_text(encoding="utf-8")


def test_limits_are_frozen() -> None:
    with pytest.raises(AttributeError):
        LIMITS.steps = 5  # type: ignore[misc]


@pytest.mark.parametrize("check, good, bad, words", [
    (limits.check_steps, LIMITS.steps, LIMITS.steps + 1, "steps must be at most 1000"),
    (limits.check_steps, 1, 0, "steps must be at least 1"),
    (limits.check_max_sequence_length, LIMITS.prompt_tokens, LIMITS.prompt_tokens + 1, "max_sequence_length"),
    (limits.check_images, LIMITS.images, LIMITS.images + 1, "num_images must be at most 1024"),
    (limits.check_reference_count, LIMITS.references, LIMITS.references + 1, "at most 4 are supported"),
    (limits.check_guidance, LIMITS.guidance, math.nextafter(LIMITS.guidance, math.inf), "guidance must be between"),
    (limits.check_guidance, 0.0, -1e-9, "guidance must be between 0 and 100"),
    (limits.check_guidance, 1.0, 1e308, "guidance must be between"),
    (limits.check_guidance, 1.0, math.nan, "guidance must be a finite number"),
    (limits.check_seed, LIMITS.seed_end - 1, LIMITS.seed_end, "seed must be at most 4294967295"),
    (limits.check_seed, 0, -1, "seed must be at least 0"),
    (limits.check_prompt, "a" * LIMITS.prompt_bytes, "a" * (LIMITS.prompt_bytes + 1), "prompt is 65537 bytes"),
])
def test_bound_and_one_past(check, good, bad, words: str) -> None:
    check(good)
    with pytest.raises(UserInputError, match=words):
        check(bad)


def test_prompt_counts_utf8_bytes() -> None:
    with pytest.raises(UserInputError, match="negative_prompt is"):
        limits.check_prompt("é" * (LIMITS.prompt_bytes // 2 + 1), "negative_prompt")


def test_seed_counts_every_image() -> None:
    limits.check_seed(LIMITS.seed_end - 4, 4)
    with pytest.raises(UserInputError, match=r"seed \+ image index must stay below 2\*\*32"):
        limits.check_seed(LIMITS.seed_end - 4, 5)


def test_check_int_refuses_non_integers() -> None:
    with pytest.raises(UserInputError, match="steps must be a whole number"):
        limits.check_steps(2.5)  # type: ignore[arg-type]
    with pytest.raises(UserInputError, match="steps must be a whole number"):
        limits.check_steps(True)  # type: ignore[arg-type]


@pytest.mark.parametrize("height, width, model_side, words", [
    (0, 64, None, "height must be at least 16 px, got 0"),
    (64, 8, None, "width must be at least 16 px"),
    (LIMITS.max_side + 16, 64, None, "height must be at most 16384 px"),
    (65, 64, None, "height 65 is not a multiple of 16; use 64 or 80"),
    (LIMITS.max_side, LIMITS.max_side, None, "width x height is 16384x16384"),
    (64, 176, 160, r"width 176 is above this model's limit of 160 px \(its position encoding tells 10 tokens"),
    # A model whose position range reaches past the table's side: the table's side is the limit to name.
    (99_984, 64, 30_064, "height must be at most 16384 px, got 99984"),
])
def test_size(height: int, width: int, model_side: int | None, words: str) -> None:
    with pytest.raises(UserInputError, match=words):
        limits.check_size(height, width, model_side=model_side)


def test_size_bounds_pass() -> None:
    limits.check_size(16, 16)
    limits.check_size(LIMITS.max_side, LIMITS.max_pixels // LIMITS.max_side)
    limits.check_size(96, 96, multiple=32)
    with pytest.raises(UserInputError, match="not a multiple of 32"):
        limits.check_size(80, 96, multiple=32)


def test_reference_pixels() -> None:
    limits.check_reference_pixels("reference image a.png", 8192, 8192)
    with pytest.raises(UserInputError, match="reference image a.png is 8193x8192"):
        limits.check_reference_pixels("reference image a.png", 8193, 8192)
    with pytest.raises(UserInputError, match="16384 px per side"):
        limits.check_reference_pixels("reference image a.png", 16385, 16)


def test_read_bounded_text(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_bytes(b"\xef\xbb\xbfhello\n")
    assert limits.read_bounded_text(f, 9, "prompt file") == "hello\n"
    with pytest.raises(UserInputError, match=r"prompt file .*p.txt is larger than the limit of 8 bytes"):
        limits.read_bounded_text(f, 8, "prompt file")


def test_read_bounded_text_dev_zero() -> None:
    """A device without end is refused after limit + 1 bytes (not read to exhaustion)."""
    with pytest.raises(UserInputError, match="prompt file /dev/zero is larger than the limit of 1 MiB"):
        limits.read_bounded_text("/dev/zero", LIMITS.prompt_file_bytes, "prompt file")


def test_read_bounded_text_errors(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="does not exist"):
        limits.read_bounded_text(tmp_path / "none", 10, "prompt file")
    with pytest.raises(UserInputError, match="is a directory"):
        limits.read_bounded_text(tmp_path, 10, "prompt file")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\xff")
    with pytest.raises(UserInputError, match=r"is not UTF-8 text \(byte 2"):
        limits.read_bounded_text(bad, 10, "prompt file")


def test_check_file_size(tmp_path: Path) -> None:
    f = tmp_path / "x.npy"
    f.write_bytes(b"0" * 10)
    limits.check_file_size(f, 10, "latents file")
    with pytest.raises(UserInputError, match="latents file .*x.npy is 10 bytes; the limit is 9 bytes"):
        limits.check_file_size(f, 9, "latents file")


def test_reference_count_agrees_with_references_module() -> None:
    from flux2klein_cli.core.pipeline.references import MAX_REFERENCES

    assert LIMITS.references == MAX_REFERENCES
