"""Session fixtures: tiny checkpoints in the exact Hugging Face diffusers layout, built once."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# Tests measure float32 parity: keep XLA from using reduced-precision matmuls.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# Most of the suite's time is compiles, which LLVM's -O0 shortens (README, "Test"). Every comparison
# here is between runs under the same flags (a subprocess inherits them, and they are part of every
# store key) or against diffusers within a tolerance. Flags a caller set are kept, this one added
# unless they name it.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
# jax's persistent XLA cache stays off whatever the caller exported (CI's base tier exports one for
# its commands): a hit there gives CPU executables the store refuses, and the store is under test.
# Tests that want it on set it themselves.
os.environ["FLUX2KLEIN_XLA_CACHE"] = "off"
if "FLUX2KLEIN_COMPILE_CACHE" not in os.environ:  # a private store for the session, removed at its end
    _SESSION_STORE = tempfile.mkdtemp(prefix="flux2klein-executables-")
    os.environ["FLUX2KLEIN_COMPILE_CACHE"] = _SESSION_STORE
    atexit.register(shutil.rmtree, _SESSION_STORE, ignore_errors=True)
# One build of the CPU kernel shim for the session (about 20 s of the compiler each): the tests that
# run on a cache root of their own would otherwise each build it. Tests of the first build unset it.
if "FLUX2KLEIN_NATIVE_CACHE" not in os.environ:
    _SESSION_NATIVE = tempfile.mkdtemp(prefix="flux2klein-native-")
    os.environ["FLUX2KLEIN_NATIVE_CACHE"] = _SESSION_NATIVE
    atexit.register(shutil.rmtree, _SESSION_NATIVE, ignore_errors=True)

import importlib.util  # noqa: E402

import pytest  # noqa: E402

# The server's tests need the [serve] extra; a base install (the base tier) does not collect them,
# as `-m "not reference"` leaves out the ones that need torch.
SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client", "httpx", "openai")
collect_ignore_glob = [] if all(importlib.util.find_spec(m) for m in SERVE_EXTRA) else ["test_serve*.py"]

from tests.fixtures.checkpoint import build_checkpoint  # noqa: E402
from tests.fixtures.reference import REFERENCE_FIXTURE_NAMES, needs_reference  # noqa: E402

# Fixtures built by diffusers and transformers (torch): every test using one is `reference`.
REFERENCE_FIXTURES = ("tiny_checkpoint", "tiny_kv_checkpoint", "tiny_base_checkpoint", "tiny_shallow_checkpoint",
                      "tiny_small_decoder_checkpoint")
REFERENCE_FIXTURE_NAMES.update(REFERENCE_FIXTURES)  # also when named in request.getfixturevalue


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `reference` every test that needs torch or diffusers (fixtures or source), so the
    base tier (`-m "not reference"`, no torch installed) runs all the others."""
    for item in items:
        function = getattr(item, "originalname", None) or item.name
        if needs_reference(Path(item.path), function, list(getattr(item, "fixturenames", ())), REFERENCE_FIXTURES):
            item.add_marker(pytest.mark.reference)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A distilled `Flux2KleinPipeline` snapshot (like `4b`)."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "flux2-klein-tiny")


@pytest.fixture(scope="session")
def tiny_kv_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `Flux2KleinKVPipeline` snapshot (like `9b-kv`), with weights of its own."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "flux2-klein-tiny-kv", kv=True, seed=1)


@pytest.fixture(scope="session")
def tiny_base_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An undistilled `Flux2KleinPipeline` snapshot (like `base-4b`): real classifier-free guidance."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "flux2-klein-tiny-base", distilled=False, seed=2)


@pytest.fixture(scope="session")
def tiny_shallow_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another latent geometry: a 3-level VAE with 8 latent channels, so 8 pixels and 32 channels
    per token (klein: 16 and 128); the transformer's in_channels is 32."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "flux2-klein-tiny-shallow", seed=3, vae_levels=3,
                            latent_channels=8)


@pytest.fixture(scope="session")
def tiny_small_decoder_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a narrower VAE decoder (like FLUX.2-small-decoder); the encoder is the tiny one."""
    from tests.fixtures.tiny_configs import NARROW_DECODER

    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "flux2-klein-tiny-small-decoder", seed=4,
                            decoder_block_out_channels=NARROW_DECODER)
