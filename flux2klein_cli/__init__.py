"""flux2klein: FLUX.2 [klein] image models on JAX and Flax NNX."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flux2klein-cli")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+local"
