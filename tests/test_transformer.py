"""The NNX FLUX.2 transformer against diffusers' Flux2Transformer2DModel on the same weights."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flux2klein_cli.core.models.transformer import (
    Flux2Transformer,
    TransformerConfig,
    load_transformer,
    transformer_key_plan,
)
from tests.fixtures.meta import assert_matches_reference, meta_state_shapes
from tests.fixtures.reference import lazy

# torch and diffusers on first use: the module collects on a base install (no torch).
torch = lazy("torch")
diffusers = lazy("diffusers")

BATCH, TXT, H, W = 2, 12, 4, 6
REF_SIZES = [(2, 3), (3, 2)]  # (h, w) in tokens of two reference images


def image_ids(h: int, w: int, t: int = 0) -> np.ndarray:
    hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return np.stack([np.full(h * w, t), hh.ravel(), ww.ravel(), np.zeros(h * w)], -1).astype(np.float32)


def text_ids(n: int) -> np.ndarray:
    ids = np.zeros((n, 4), np.float32)
    ids[:, 3] = np.arange(n)
    return ids


@pytest.fixture(scope="module")
def inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    # Output image tokens, then reference tokens with t = 10 + 10 * i, as in an edit.
    ids = np.concatenate([image_ids(H, W)] + [image_ids(h, w, 10 + 10 * i) for i, (h, w) in enumerate(REF_SIZES)])
    return dict(
        img=rng.standard_normal((BATCH, len(ids), 128)).astype(np.float32),
        txt=rng.standard_normal((BATCH, TXT, 96)).astype(np.float32),
        img_ids=ids,
        txt_ids=text_ids(TXT),
    )


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel.from_pretrained(tiny_checkpoint / "transformer", dtype=torch.float32).eval()


def run_reference(model, x: dict[str, np.ndarray], sigma: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(
            hidden_states=torch.from_numpy(x["img"]),
            encoder_hidden_states=torch.from_numpy(x["txt"]),
            timestep=torch.from_numpy(sigma),
            img_ids=torch.from_numpy(x["img_ids"]),
            txt_ids=torch.from_numpy(x["txt_ids"]),
            return_dict=False,
        )[0]
    return out.numpy()


def run_ours(model: Flux2Transformer, x: dict[str, np.ndarray], sigma: np.ndarray) -> np.ndarray:
    rope = model.rope(x["txt_ids"], x["img_ids"])
    out = jax.jit(lambda m, *a: m(*a))(model, jnp.asarray(x["img"]), jnp.asarray(x["txt"]), jnp.asarray(sigma), rope)
    return np.asarray(out, dtype=np.float32)


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


SIGMAS = [np.array([1.0, 0.35], np.float32), np.array([0.05, 0.8], np.float32)]


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_float32_matches_diffusers(tiny_checkpoint: Path, reference, inputs, scan: bool) -> None:
    model = load_transformer(tiny_checkpoint / "transformer", dtype=jnp.float32, scan_layers=scan)
    for sigma in SIGMAS:
        ref = run_reference(reference, inputs, sigma)
        ours = run_ours(model, inputs, sigma)
        assert ours.shape == ref.shape == (BATCH, H * W + sum(h * w for h, w in REF_SIZES), 128)
        assert rel_err(ours, ref) <= 1e-4


def test_bfloat16_within_measured_bound(tiny_checkpoint: Path, reference, inputs) -> None:
    # bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 0.002 per value); through 5 residual
    # blocks of matmuls, norms and attention the error against the float32 reference measured
    # 0.8-1.3% of the output's max abs value on these weights; 3% leaves room for other seeds
    # and still catches any real mistake (a wrong key or modulation is O(100%)).
    model = load_transformer(tiny_checkpoint / "transformer", dtype=jnp.bfloat16)
    assert model.x_embedder.kernel[...].dtype == jnp.bfloat16
    for sigma in SIGMAS:
        assert rel_err(run_ours(model, inputs, sigma), run_reference(reference, inputs, sigma)) <= 0.03


@pytest.mark.parametrize(
    "name, config, params",
    [
        ("4B", dict(num_attention_heads=24, num_layers=5, num_single_layers=20, joint_attention_dim=7680),
         3_875_544_576),
        ("9B", dict(num_attention_heads=32, num_layers=8, num_single_layers=24, joint_attention_dim=12288), None),
    ],
)
def test_real_geometry_matches_reference_modules(name: str, config: dict, params: int | None) -> None:
    from diffusers import Flux2Transformer2DModel

    full = dict(attention_head_dim=128, in_channels=128, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
                rope_theta=2000, guidance_embeds=False, **config)
    with torch.device("meta"):
        ref = Flux2Transformer2DModel(**full)
    shapes = meta_state_shapes(ref)
    cfg = TransformerConfig.from_dict(full)
    count = assert_matches_reference(
        lambda: Flux2Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
        transformer_key_plan,
        shapes,
    )
    assert count == sum(int(np.prod(s)) for s in shapes.values())
    if params is not None:
        assert count == params


@pytest.mark.parametrize("length, block", [(530, 512), (96, 32), (40, 512)], ids=["padded", "exact", "one-block"])
def test_blocked_cpu_attention_equals_full_attention(length: int, block: int) -> None:
    from flux2klein_cli.core.models.layers import _blocked_attention

    q, k, v = (jax.random.normal(jax.random.key(i), (2, length, 3, 16)) for i in range(3))
    full = jax.nn.dot_product_attention(q, k, v)
    blocked = _blocked_attention(q, k, v, block)
    assert blocked.shape == full.shape
    assert float(jnp.abs(blocked - full).max()) <= 1e-5 * float(jnp.abs(full).max())


def test_gpu_takes_cudnn_fused_attention_for_half_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, attention in bf16 / fp16 with heads up to 128 wide goes to cuDNN's fused kernel
    (XLA's form materialises every score); float32, wide heads, other backends and the
    FLUX2KLEIN_GPU_ATTENTION=xla escape keep XLA's. benchmarks/accelerator.sh checks the kernel's
    numbers on a GPU."""
    from flux2klein_cli.core.models import layers

    q = jnp.zeros((1, 8, 2, 128), jnp.bfloat16)
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("FLUX2KLEIN_GPU_ATTENTION", raising=False)
    assert layers.gpu_fused_attention(q) and layers.gpu_fused_attention(q.astype(jnp.float16))
    assert not layers.gpu_fused_attention(q.astype(jnp.float32))
    assert not layers.gpu_fused_attention(jnp.zeros((1, 8, 2, 256), jnp.bfloat16))
    monkeypatch.setenv("FLUX2KLEIN_GPU_ATTENTION", "xla")
    assert not layers.gpu_fused_attention(q)
    monkeypatch.delenv("FLUX2KLEIN_GPU_ATTENTION")
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "tpu")
    assert not layers.gpu_fused_attention(q)


def test_config_defaults_are_diffusers_and_from_dict_reads_through_them() -> None:
    """One config pattern: a field a config.json leaves out takes diffusers' default."""
    import inspect

    from flux2klein_cli.core.models.transformer import TransformerConfig

    reference = inspect.signature(diffusers.Flux2Transformer2DModel.__init__).parameters
    defaults = TransformerConfig()
    for field in TransformerConfig.__dataclass_fields__:
        if field == "out_channels":  # diffusers' None: in_channels
            assert reference["out_channels"].default is None
            assert defaults.out_channels == defaults.in_channels
            continue
        name = "timestep_guidance_channels" if field == "timestep_channels" else field
        expected = reference[name].default
        assert getattr(defaults, field) == (tuple(expected) if isinstance(expected, list) else expected), field
    assert TransformerConfig.from_dict({}) == defaults
    assert TransformerConfig.from_dict({"num_layers": 5, "out_channels": None}).num_layers == 5
