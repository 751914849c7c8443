"""A run's record in each PNG it writes, and back: the one codec between a `RunPlan` (with the
engine it ran on) and a PNG's text chunks. generate / edit, batch and parity write it; `--from`
and `inspect` read it.

Record 3 (written now, `record: 3`) names each value by its request field (RunFields) or engine
option (EngineOptions), as core/fields.py reads them: prompt, negative_prompt, seed (or latents,
the noise file), steps, guidance, height, width, references, init_image, mask, strength,
padding_mask_crop, kv, reference_max_area, max_sequence_length; model, transformer, vae, dtype,
lora; and version (flux2klein's). Record 2 (no `record` key, written before) held the same
values but `size` as WIDTHxHEIGHT and the noise file as seed `latents:PATH`: it reads as record 3.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flux2klein_cli import __version__
from flux2klein_cli.core.choices import DTYPES
from flux2klein_cli.core.errors import FieldError, UserInputError
from flux2klein_cli.core.fields import read

RECORD = 3
LATENTS_PREFIX = "latents:"  # record 2's seed of a run that started from a noise file
TEXTS = ("prompt", "negative_prompt", "model", "transformer", "vae", "dtype")
PATHS = ("latents", "init_image", "mask")
WHOLES = ("seed", "steps", "height", "width", "padding_mask_crop", "reference_max_area", "max_sequence_length")
NUMBERS = ("guidance", "strength")


def encode(plan: Any, index: int, options: Any, lora: list[dict[str, Any]]) -> dict[str, Any]:
    """Image `index` of a run of `plan` on an engine of `options` (EngineOptions), its LoRAs' records."""
    noise = {"latents": plan.latents_name} if plan.latents_name is not None else {"seed": plan.seeds[index]}
    init: dict[str, Any] = {}
    if plan.init_image_name is not None:
        init = {"init_image": plan.init_image_name, "strength": plan.strength}
        init.update({"mask": plan.mask_name} if plan.mask_name is not None else {})
        init.update({"padding_mask_crop": plan.padding_mask_crop} if plan.padding_mask_crop is not None else {})
    return dict(
        record=RECORD, prompt=plan.prompts[index // plan.num_images],
        negative_prompt=plan.negative_prompt if plan.cfg else "", **noise, steps=plan.steps, guidance=plan.guidance,
        height=plan.height, width=plan.width, references=list(plan.reference_names), **init,
        max_sequence_length=plan.max_sequence_length, **({"kv": True} if plan.kv else {}),
        **({"reference_max_area": plan.reference_max_area} if plan.reference_names else {}),
        model=options.model, **options.components, dtype=options.dtype, **({"lora": lora} if lora else {}),
        version=__version__,
    )


def _record_2(meta: Mapping[str, Any]) -> dict[str, Any]:
    """Record 2's `size` and `latents:PATH` seed as record 3 says them."""
    out = dict(meta)
    size = out.pop("size", None)
    if size is not None:
        width, x, height = str(size).partition("x")
        if not (isinstance(size, str) and x and width.isdigit() and height.isdigit()):
            raise FieldError("size", f"must be WIDTHxHEIGHT, got {size!r}")
        out.update(width=int(width), height=int(height))
    seed = out.get("seed")
    if isinstance(seed, str) and seed.startswith(LATENTS_PREFIX) and len(seed) > len(LATENTS_PREFIX):
        out["latents"] = out.pop("seed")[len(LATENTS_PREFIX):]
    return out


def _lora(records: Any) -> list[str]:
    """LoRA records as the engine option takes them (PATH_OR_REPO:SCALE)."""
    if not isinstance(records, list):
        raise FieldError("lora", f"must be a list of LoRAs, got {records!r}")
    specs = []
    for record in records:
        source = record.get("path") if isinstance(record, dict) else None
        scale = record.get("scale", 1.0) if isinstance(record, dict) else None
        if not isinstance(source, str) or isinstance(scale, bool) or not isinstance(scale, int | float):
            raise FieldError("lora", f"must give each LoRA's path and scale, got {record!r}")
        specs.append(f"{source}:{scale!r}")
    return specs


def decode(meta: Mapping[str, Any], where: str | Path) -> dict[str, Any]:
    """The fields and engine options a PNG's record gives (those it holds), each checked by its
    kind; a value of the wrong kind is a UserInputError naming the PNG."""
    version = meta.get("record", 2)
    if isinstance(version, bool) or not isinstance(version, int):
        raise UserInputError(f"{where}: its record {version!r} is not a version; the PNG's parameters were altered")
    if version > RECORD:
        raise UserInputError(f"{where} carries a record of version {version}, newer than this flux2klein reads "
                             f"({RECORD}); upgrade flux2klein")
    try:
        values = _record_2(meta) if version < 3 else dict(meta)
        out: dict[str, Any] = {}
        for name in (*TEXTS, *PATHS, *WHOLES, *NUMBERS):
            if values.get(name) is not None:
                out[name] = read(name, values[name])
        for name in PATHS:
            if name in out:
                out[name] = Path(out[name])
        out["references"] = [Path(n) for n in read("references", values.get("references", []))]
        out["kv"] = read("kv", values.get("kv", False))
        out["lora"] = _lora(values.get("lora", []))
        if out.get("dtype", "bf16") not in DTYPES:
            raise FieldError("dtype", f"must be one of {', '.join(DTYPES)}, got {out['dtype']!r}")
    except FieldError as e:
        raise UserInputError(f"{where}: its {e}; the PNG's parameters were altered") from None
    return out
