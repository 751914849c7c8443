"""flux2klein: FLUX.2 [klein] image models on JAX and Flax NNX."""

from __future__ import annotations


def __getattr__(name: str) -> str:
    # Looked up on first use, not at import: the console script installs its signal handlers
    # after this package is imported, and importlib.metadata takes a noticeable part of that.
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        value = version("flux2klein-cli")
    except PackageNotFoundError:  # running from a source tree without an install
        value = "0.0.0+local"
    globals()["__version__"] = value
    return value
