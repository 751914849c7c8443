"""Reading a component's config.json (or any JSON file of a snapshot) with clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flux2klein_cli.core.errors import CheckpointError


def read_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (every checkpoint component needs its config)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def read_config(component_dir: str | Path) -> dict[str, Any]:
    """The `config.json` of one component folder (transformer/, vae/, text_encoder/)."""
    return read_json(Path(component_dir) / "config.json")


def pick(config: dict[str, Any], key: str, default: Any = None, *, where: str = "config") -> Any:
    """A config value; a missing required value (no default) is a CheckpointError."""
    if key in config:
        return config[key]
    if default is None:
        raise CheckpointError(f"{where}: required field {key!r} is missing")
    return default
