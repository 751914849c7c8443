"""`generate --from IMAGE.png` / `edit --from IMAGE.png`: a run's parameters read back from the PNG it wrote
(core/runs/run_record.py), under the options given beside it (mflux's --config-from-metadata).

The parameters come back by field (`model`, `seed`, `references`, ...), and the command overlays them
on its arguments (by field too): an option the user gave wins, every other one takes the PNG's value.
Files the PNG names (references, init image, mask, initial noise) must still exist, or the rerun could
not be the same image: one line naming them, exit 2.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.runs.image_files import read_run_metadata
from flux2klein_cli.core.runs.run_record import decode

COMMANDS = ("generate", "edit")
# Fields that go together: giving one of a group takes none of the group from the PNG (a new prompt
# file replaces the prompt, a new seed or latents file the noise, a new init image its mask).
GROUPS = (("prompt", "prompt_file"), ("seed", "latents"), ("init_image", "mask"))
EDIT_ONLY = ("references", "init_image", "mask", "strength", "padding_mask_crop", "kv", "reference_max_area")


def parameters(path: str | os.PathLike[str], command: str) -> dict[str, Any]:
    """The run a PNG records (run_record.decode), by field, as `command` takes them. A PNG without
    flux2klein parameters, from a newer format, or (for `generate`) an edit's PNG is a UserInputError."""
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}")
    p = Path(path).expanduser()
    values = decode(read_run_metadata(p), p)
    if command == "generate":
        if values["references"] or "init_image" in values:
            raise UserInputError(f"{p} was made by edit (it names reference or init images); rerun it with "
                                 f"flux2klein edit {{field:from_image}} {p}")
        values = {name: value for name, value in values.items() if name not in EDIT_ONLY}
    return values


def overlay(png: Mapping[str, Any], arguments: Mapping[str, Any], given: Collection[str], *,
            source: str | os.PathLike[str]) -> dict[str, Any]:
    """The command's arguments with every option the user did not give (`given`: their names) taken
    from the PNG's `parameters`. Files the PNG names must exist: else one line naming them."""
    taken = {name for name in png if name in arguments and name not in given}
    for group in GROUPS:
        if any(name in given for name in group):
            taken -= set(group)
    merged = dict(arguments)
    merged.update({name: png[name] for name in taken})
    named = [*(png["references"] if "references" in taken else ()),
             *(png[n] for n in ("init_image", "mask") if n in taken)]
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
    from flux2klein_cli.core.runs.image_files import is_png_file
    from flux2klein_cli.core.runs.outputs import PNG_SUFFIX

    p = Path(argument).expanduser()
    return is_png_file(p) or (p.suffix.lower() == PNG_SUFFIX and not p.is_dir())


def shown(value: Any) -> str:
    """One parameter as `inspect IMAGE.png` prints it: text as it is, anything else as JSON."""
    import json

    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
