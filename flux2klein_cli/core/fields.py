"""The one table of a request's fields as each door spells them: the CLI's flags, a batch
manifest's keys, the Images API's parameters.

Core names fields (`FieldError`, `{field:NAME}` in any message: core/errors.py); each door prints
an error with its own spelling from here. A field missing from the table is spelled as its name
by the manifest and the API, and `--` + the name with dashes by the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass

SERVE_ONLY = ""  # a field no command-line option sets (the CLI then prints the field's name)


@dataclass(frozen=True)
class Spelling:
    flag: str | None = None  # the CLI's; None: "--" + the field with dashes
    manifest: str | None = None  # a batch manifest line's key; None: the field
    api: str | None = None  # the Images API's parameter (serve); None: the field


FIELDS: dict[str, Spelling] = {
    "prompt": Spelling(flag="PROMPT"),
    "prompts": Spelling(flag="PROMPT", manifest="prompt", api="prompt"),
    "references": Spelling(flag="--image", manifest="images", api="image"),
    "reference": Spelling(flag="--image", manifest="images", api="image"),
    "num_images": Spelling(api="n"),
    "height": Spelling(api="size"),
    "width": Spelling(api="size"),
    "size": Spelling(flag="--height/--width", manifest="height/width"),
    "init_image": Spelling(api="image"),
    "from_image": Spelling(flag="--from"),
    "batch": Spelling(flag="--bs"),
    "batch_size": Spelling(flag="--bs"),
    "max_body_bytes": Spelling(flag="--max-body-mb"),
    "response_format": Spelling(flag=SERVE_ONLY),
    "jobs_kept": Spelling(flag=SERVE_ONLY),
}


def flag(field: str) -> str:
    """The command-line spelling of a field."""
    spelling = FIELDS.get(field)
    if spelling is None or spelling.flag is None:
        return "--" + field.replace("_", "-")
    return spelling.flag or field


def manifest_key(field: str) -> str:
    """A batch manifest's spelling of a field."""
    spelling = FIELDS.get(field)
    return spelling.manifest if spelling and spelling.manifest else field


def api_param(field: str) -> str:
    """The Images API's spelling of a field (serve's `param`)."""
    spelling = FIELDS.get(field)
    return spelling.api if spelling and spelling.api else field
