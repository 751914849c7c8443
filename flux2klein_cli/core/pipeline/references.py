"""How many references an edit may take, and `--refs`: the one spelling of a run's reference
sizes that `bench` and `compile` share."""

from __future__ import annotations

from flux2klein_cli.core import limits
from flux2klein_cli.core.errors import FieldError

MAX_REFERENCES = limits.LIMITS.references  # the limits table's: what FLUX.2 [klein] was trained with
check_reference_count = limits.check_reference_count  # one rule for edit's images and --refs


def parse_refs(text: str | None, height: int, width: int) -> tuple[tuple[int, int], ...]:
    """`--refs`: "2" -> two references of `height` x `width` (the output size); "512x512,768x1024"
    -> ((512, 512), (768, 1024)), height first as --height/--width; None or "" or "0" -> none."""
    if text is None or not text.strip():
        return ()
    text = text.strip()
    if text.isdigit():
        check_reference_count(int(text))  # before a tuple of that many is made
        sizes = ((height, width),) * int(text)
    else:
        parsed = []
        for item in text.split(","):
            parts = item.strip().lower().split("x")
            if len(parts) != 2 or not all(p.isdigit() for p in parts):
                raise FieldError("refs", f"{item.strip()!r} is neither a count nor HEIGHTxWIDTH "
                                 "(e.g. 2 or 512x512,768x1024)")
            parsed.append((int(parts[0]), int(parts[1])))
        sizes = tuple(parsed)
    check_reference_count(len(sizes))
    return sizes
