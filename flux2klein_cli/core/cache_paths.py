"""The one root of flux2klein's caches: `$XDG_CACHE_HOME/flux2klein`, else `~/.cache/flux2klein`.

Each cache (the generated checkpoints, the executable store, the XLA cache) is a folder under it
unless its own environment variable says otherwise; those variables are read where each cache lives.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "flux2klein"
