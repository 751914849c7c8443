"""What a server is built with, and the checks that run before any model loads."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field

from flux2klein_cli.core import limits, settings
from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.engine.engine import EngineOptions
from flux2klein_cli.core.errors import FieldError

API_KEY_VARIABLE = settings.API_KEY
MIB = 1024 * 1024
_SIZE = re.compile(r"\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*")


def default_encode_threads() -> int:
    """Threads that encode answers beside the device thread: a few, never all the host's cores."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


@dataclass(frozen=True)
class ServeOptions:
    engine: EngineOptions
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # Bearer token every /v1 and /metrics request must carry
    max_batch: int = 8  # images run as one batch
    batch_wait_ms: float = 20.0  # how long the oldest request waits for others of its shape
    queue: int = 64  # requests waiting at most; more are answered 429
    drain_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    max_body_bytes: int = 64 * MIB  # a request body (an edit's uploads included); larger: 413
    warm: tuple[tuple[int, int], ...] = ()  # (width, height) compiled before ready
    max_sequence_length: int = DEFAULTS.max_sequence_length  # prompt tokens of every request
    jobs_kept: int = 256  # finished jobs whose results stay readable
    pad_batches: bool = True  # pad batches to a power of two plans (few batch sizes to compile)
    encode_threads: int = field(default_factory=default_encode_threads)  # 0: the device thread encodes


def parse_size(text: str, field: str = "size") -> tuple[int, int]:
    """"WxH" as (width, height)."""
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if not match:
        raise FieldError(field, f"must be WIDTHxHEIGHT in pixels, e.g. 512x512; got {text!r}")
    return int(match.group(1)), int(match.group(2))


def parse_sizes(text: str, field: str = "warm") -> tuple[tuple[int, int], ...]:
    """A comma-separated list of "WxH"."""
    return tuple(parse_size(part, field) for part in text.split(",") if part.strip())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def api_key(given: str | None) -> str | None:
    """The key given, else FLUX2KLEIN_API_KEY, else None (an empty value counts as none)."""
    key = given if given is not None else settings.api_key()
    return key or None


def check_serve_options(options: ServeOptions) -> None:
    """Every rule of a server's own options (the engine's: core/engine/opening.py)."""
    limits.check_int("port", options.port, 0, 65535)
    limits.check_int("max_batch", options.max_batch, 1, limits.LIMITS.images)
    limits.check_int("queue", options.queue, 1, 1_000_000)
    limits.check_int("jobs_kept", options.jobs_kept, 0, 1_000_000)
    limits.check_int("encode_threads", options.encode_threads, 0, 64)
    limits.check_max_sequence_length(options.max_sequence_length)
    if not 0 <= options.batch_wait_ms <= 60_000:
        raise FieldError("batch_wait_ms", f"must be between 0 and 60000 ms; got {options.batch_wait_ms:g}")
    if not 0 <= options.drain_timeout <= 3600:
        raise FieldError("drain_timeout", f"must be between 0 and 3600 s; got {options.drain_timeout:g}")
    if options.max_body_bytes < 1024:
        raise FieldError("max_body_bytes", "must be at least 1 KiB")
    if not is_loopback(options.host) and not options.api_key:
        raise FieldError("host", f"{options.host} is not a loopback address: serving beyond this machine needs an "
                         f"API key ({{field:api_key}}, or {API_KEY_VARIABLE}), which every request must then carry")
