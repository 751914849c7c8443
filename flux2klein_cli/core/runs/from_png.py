"""`generate --from IMAGE.png` / `edit --from IMAGE.png`: a run's parameters read back from the PNG it wrote
(core/runs/generate.py png_metadata), under the options given beside it (mflux's --config-from-metadata).

The parameters come back keyed by the command's own option names (`model`, `seed`, `image`, ...), as the
command takes them, so the command overlays them on its arguments: an option the user gave wins, every
other one takes the PNG's value. Files the PNG names (references, init image, mask, initial noise) must
still exist, or the rerun could not be the same image: one line naming them, exit 2.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from flux2klein_cli.core.choices import DTYPES
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.pipeline.step_cache import CACHE_FIELDS
from flux2klein_cli.core.runs.image_files import read_run_metadata

COMMANDS = ("generate", "edit")
LATENTS_PREFIX = "latents:"  # a seed written as latents:PATH: the run started from the noise in PATH
# Options that go together: giving one of a group takes none of the group from the PNG (a new prompt
# file replaces the prompt, a new --seed or --latents the noise, a new init image its mask).
GROUPS = (("prompt", "prompt_file"), ("seed", "latents"), ("init_image", "mask"))


def _bad(path: Path, key: str, value: Any, want: str) -> UserInputError:
    return UserInputError(f"{path}: its {key} {value!r} is not {want}; the PNG's parameters were altered")


def _text(meta: Mapping[str, Any], path: Path, key: str) -> str | None:
    value = meta.get(key)
    if value is not None and not isinstance(value, str):
        raise _bad(path, key, value, "text")
    return value


def _whole(meta: Mapping[str, Any], path: Path, key: str) -> int | None:
    value = meta.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise _bad(path, key, value, "a whole number")
    return value


def _number(meta: Mapping[str, Any], path: Path, key: str) -> float | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(path, key, value, "a finite number")
    return float(value)


def _size(meta: Mapping[str, Any], path: Path) -> dict[str, int]:
    size = meta.get("size")
    if size is None:
        return {}
    width, x, height = str(size).partition("x")
    if not (isinstance(size, str) and x and width.isdigit() and height.isdigit()):
        raise _bad(path, "size", size, "WIDTHxHEIGHT")
    return {"width": int(width), "height": int(height)}


def _seed(meta: Mapping[str, Any], path: Path) -> dict[str, Any]:
    seed = meta.get("seed")
    if isinstance(seed, str) and seed.startswith(LATENTS_PREFIX) and len(seed) > len(LATENTS_PREFIX):
        return {"latents": Path(seed[len(LATENTS_PREFIX):])}
    if seed is None:
        return {}
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise _bad(path, "seed", seed, f"a whole number or {LATENTS_PREFIX}PATH")
    return {"seed": seed}


def _lora(meta: Mapping[str, Any], path: Path) -> list[str]:
    records = meta.get("lora", [])
    if not isinstance(records, list):
        raise _bad(path, "lora", records, "a list of LoRAs")
    specs = []
    for record in records:
        source = record.get("path") if isinstance(record, dict) else None
        scale = record.get("scale", 1.0) if isinstance(record, dict) else None
        if not isinstance(source, str) or isinstance(scale, bool) or not isinstance(scale, int | float):
            raise _bad(path, "lora", record, "a LoRA's path and scale")
        specs.append(f"{source}:{scale!r}")
    return specs


def _paths(meta: Mapping[str, Any], path: Path, key: str) -> list[Path]:
    names = meta.get(key, [])
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise _bad(path, key, names, "a list of file names")
    return [Path(n) for n in names]


def _cache(meta: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """A step-cached run's settings (core/pipeline/step_cache.py), all of them as they were resolved."""
    taylorseer = meta.get("cache_taylorseer")
    if taylorseer is not None and not isinstance(taylorseer, bool):
        raise _bad(path, "cache_taylorseer", taylorseer, "true or false")
    return dict(cache=_text(meta, path, "cache"), cache_threshold=_number(meta, path, "cache_threshold"),
                cache_warmup=_whole(meta, path, "cache_warmup"), cache_max_skips=_whole(meta, path, "cache_max_skips"),
                cache_blocks=_whole(meta, path, "cache_blocks"), cache_taylorseer=taylorseer)


def parameters(path: str | os.PathLike[str], command: str) -> dict[str, Any]:
    """The run a PNG records, as `command`'s options (None-valued ones left out). A PNG without
    flux2klein parameters, from a newer format, or (for `generate`) an edit's PNG is a UserInputError."""
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}")
    p = Path(path).expanduser()
    meta = read_run_metadata(p)
    references = _paths(meta, p, "references")
    init_image, mask = _text(meta, p, "init_image"), _text(meta, p, "mask")
    if command == "generate" and (references or init_image is not None):
        raise UserInputError(f"{p} was made by edit (it names reference or init images); rerun it with "
                             f"flux2klein edit {{field:from_image}} {p}")
    dtype = _text(meta, p, "dtype")
    if dtype is not None and dtype not in DTYPES:
        raise _bad(p, "dtype", dtype, f"one of {', '.join(DTYPES)}")
    values: dict[str, Any] = dict(
        prompt=_text(meta, p, "prompt"), negative_prompt=_text(meta, p, "negative_prompt"),
        steps=_whole(meta, p, "steps"), guidance=_number(meta, p, "guidance"), **_size(meta, p), **_seed(meta, p),
        model=_text(meta, p, "model"), dtype=dtype, transformer=_text(meta, p, "transformer"),
        vae=_text(meta, p, "vae"), lora=_lora(meta, p), max_sequence_length=_whole(meta, p, "max_sequence_length"),
        **_cache(meta, p),
    )
    if command == "edit":
        kv = meta.get("kv", False)
        if not isinstance(kv, bool):
            raise _bad(p, "kv", kv, "true or false")
        values.update(image=references, init_image=None if init_image is None else Path(init_image),
                      mask=None if mask is None else Path(mask), strength=_number(meta, p, "strength"),
                      padding_mask_crop=_whole(meta, p, "padding_mask_crop"), kv=kv,
                      reference_max_area=_whole(meta, p, "reference_max_area"))
    return {name: value for name, value in values.items() if value is not None}


def overlay(png: Mapping[str, Any], arguments: Mapping[str, Any], given: Collection[str], *,
            source: str | os.PathLike[str]) -> dict[str, Any]:
    """The command's arguments with every option the user did not give (`given`: their names) taken
    from the PNG's `parameters`. Files the PNG names must exist: else one line naming them."""
    taken = {name for name in png if name in arguments and name not in given}
    for group in GROUPS:
        if any(name in given for name in group):
            taken -= set(group)
    if "cache" in given:  # another mode (or none) takes its own defaults, not the PNG's settings
        taken -= set(CACHE_FIELDS)
    merged = dict(arguments)
    merged.update({name: png[name] for name in taken})
    named = [*(png["image"] if "image" in taken else ()), *(png[n] for n in ("init_image", "mask") if n in taken)]
    missing = [str(name) for name in named if not name.exists()]
    if missing:
        raise UserInputError(f"{source} names image(s) that no longer exist: {', '.join(missing)}; "
                             "restore them or give new ones ({field:references}, {field:init_image}, {field:mask})")
    if "latents" in taken and not png["latents"].is_file():
        raise UserInputError(f"{source} started from the initial noise in {png['latents']}, which no longer "
                             "exists; restore it, or give {field:seed} N or {field:latents} PATH")
    return merged


def names_image(argument: str) -> bool:
    """Whether `inspect`'s argument is an image (a file with the PNG signature, or a name ending in .png that
    is no directory) rather than a model."""
    from flux2klein_cli.core.runs.image_files import PNG_SUFFIX, is_png_file

    p = Path(argument).expanduser()
    return is_png_file(p) or (p.suffix.lower() == PNG_SUFFIX and not p.is_dir())


def shown(value: Any) -> str:
    """One parameter as `inspect IMAGE.png` prints it: text as it is, anything else as JSON."""
    import json

    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
