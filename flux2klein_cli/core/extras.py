"""Optional extras: what a feature needs beyond the base install, and the one line that says so.

The base install runs every command; torch and diffusers (the `[parity]` extra) are only for
comparing with diffusers. A feature that needs them checks first, so a base install gets exit 2
naming the extra instead of an ImportError traceback halfway through a run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from flux2klein_cli.core.errors import UserInputError

PACKAGE = "flux2klein-cli"
PARITY_MODULES = ("torch", "diffusers")


def missing_modules(modules: Sequence[str]) -> list[str]:
    """The modules that are not installed (found without importing them: torch takes seconds)."""
    return [name for name in modules if importlib.util.find_spec(name) is None]


def install_command(extra: str) -> str:
    return f"pip install '{PACKAGE}[{extra}]'"


def require_extra(extra: str, modules: Sequence[str], feature: str = "this command") -> None:
    """Raise a one-line UserInputError (exit 2) when any of `modules` is missing."""
    missing = missing_modules(modules)
    if missing:
        raise UserInputError(f"{feature} needs {' and '.join(missing)} (the [{extra}] extra): "
                             f"{install_command(extra)}")


def require_parity(feature: str) -> None:
    require_extra("parity", PARITY_MODULES, feature)


# The import names of the [serve] extra's packages (python-multipart is imported as multipart).
SERVE_MODULES = ("fastapi", "uvicorn", "multipart", "prometheus_client")


def require_serve() -> None:
    require_extra("serve", SERVE_MODULES, "serve")
