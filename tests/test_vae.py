"""The Flax VAE against diffusers' AutoencoderKLFlux2 (and the pipeline's latent handling),
its key plan, and the loader's errors on damaged VAE checkpoints."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.models.vae import Flux2VAE, VAEConfig, load_vae, patchify, unpatchify, vae_key_plan
from tests.fixtures.reference import lazy
from tests.fixtures.tiny_configs import NARROW_DECODER, vae_config

torch = lazy("torch")
diffusers = lazy("diffusers")

WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def torch_vae_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    """A tiny diffusers VAE saved to disk. The batch-norm statistics and every norm's affine
    parameters are randomised: at their defaults (0, 1) a wrong mapping would go unnoticed."""
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLFlux2(**vae_config()).eval()
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(torch.rand_like(vae.bn.running_var) + 0.5)
        for module in vae.modules():
            if isinstance(module, torch.nn.GroupNorm):
                module.weight.add_(0.2 * torch.randn_like(module.weight))
                module.bias.add_(0.2 * torch.randn_like(module.bias))
    directory = tmp_path_factory.mktemp("vae")
    vae.save_pretrained(directory, safe_serialization=True)
    return vae, directory


@pytest.fixture(scope="module")
def fp32_model(torch_vae_dir: tuple[object, Path]) -> Flux2VAE:
    return load_vae(torch_vae_dir[1], dtype=jnp.float32)


@pytest.fixture(scope="module")
def bf16_model(torch_vae_dir: tuple[object, Path]) -> Flux2VAE:
    return load_vae(torch_vae_dir[1], dtype=jnp.bfloat16)


# ----------------------------------------------------------------------------- the reference


def _reference_encode(vae: object, image_nchw: np.ndarray) -> np.ndarray:
    """What Flux2KleinPipeline._encode_vae_image returns, as NHWC."""
    with torch.no_grad():
        x = torch.from_numpy(image_nchw)
        lat = vae.encode(x).latent_dist.mean
        b, c, h, w = lat.shape
        lat = lat.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        lat = (lat - mean) / std
    return lat.permute(0, 2, 3, 1).numpy()


def _reference_decode(vae: object, latents_nhwc: np.ndarray) -> np.ndarray:
    """The pipeline's decode path: denormalise, unpatchify, vae.decode; as NHWC."""
    with torch.no_grad():
        lat = torch.from_numpy(latents_nhwc).permute(0, 3, 1, 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        lat = lat * std + mean
        b, c4, h, w = lat.shape
        lat = lat.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, h * 2, w * 2)
        image = vae.decode(lat, return_dict=False)[0]
    return image.permute(0, 2, 3, 1).numpy()


def _rel_err(got: jax.Array | np.ndarray, want: np.ndarray) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32))
    assert got.shape == want.shape
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module")
def image() -> np.ndarray:
    """Two non-square NCHW images in [-1, 1]."""
    return np.random.default_rng(1).uniform(-1, 1, (2, 3, 64, 96)).astype(np.float32)


@pytest.fixture(scope="module")
def latents() -> np.ndarray:
    """Normalised patchified latents, NHWC, for a 64 x 96 image."""
    return np.random.default_rng(2).standard_normal((2, 4, 6, 128)).astype(np.float32)


def _run_both(model: Flux2VAE, image_nchw: np.ndarray, latents_nhwc: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """encode(image) and decode(latents) as one compiled program: one compilation per dtype
    instead of two. XLA's backend optimisation level 0 saves about a third of the CPU compile
    time; the inputs are tiny, so run time does not matter, and the arithmetic is the same."""
    graphdef, state = nnx.split(model)

    def both(state: nnx.State, x: jax.Array, z: jax.Array) -> tuple[jax.Array, jax.Array]:
        m = nnx.merge(graphdef, state)
        return m.encode(x), m.decode(z)

    fn = jax.jit(both, compiler_options={"xla_backend_optimization_level": 0})
    return fn(state, jnp.asarray(image_nchw.transpose(0, 2, 3, 1)), jnp.asarray(latents_nhwc))


@pytest.fixture(scope="module")
def fp32_outputs(fp32_model: Flux2VAE, image: np.ndarray, latents: np.ndarray) -> tuple[jax.Array, jax.Array]:
    return _run_both(fp32_model, image, latents)


@pytest.fixture(scope="module")
def bf16_outputs(bf16_model: Flux2VAE, image: np.ndarray, latents: np.ndarray) -> tuple[jax.Array, jax.Array]:
    return _run_both(bf16_model, image, latents)


@pytest.fixture(scope="module")
def reference_outputs(
    torch_vae_dir: tuple[object, Path], image: np.ndarray, latents: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    vae = torch_vae_dir[0]
    return _reference_encode(vae, image), _reference_decode(vae, latents)


# ----------------------------------------------------------------------------- parity


def test_patchify_roundtrip_and_channel_order() -> None:
    z = jnp.arange(2 * 4 * 6 * 3, dtype=jnp.float32).reshape(2, 4, 6, 3)
    p = patchify(z)
    assert p.shape == (2, 2, 3, 12)
    # channel c*4 + ph*2 + pw of patch (i, j) is pixel (2i + ph, 2j + pw) of channel c
    assert p[1, 1, 2, 2 * 4 + 1 * 2 + 0] == z[1, 3, 4, 2]
    np.testing.assert_array_equal(unpatchify(p), z)


def test_encode_matches_diffusers_fp32(fp32_outputs, reference_outputs) -> None:
    got, want = fp32_outputs[0], reference_outputs[0]
    assert got.dtype == jnp.float32 and got.shape == (2, 4, 6, 128)
    # Measured: 8e-7 on CPU.
    assert _rel_err(got, want) <= 1e-4


def test_decode_matches_diffusers_fp32(fp32_outputs, reference_outputs) -> None:
    got, want = fp32_outputs[1], reference_outputs[1]
    assert got.dtype == jnp.float32 and got.shape == (2, 64, 96, 3)
    # Measured: 4e-6 on CPU (the decoder is deeper and its output smaller than its activations).
    assert _rel_err(got, want) <= 1e-4


# bf16 keeps 8 significant bits: 2^-8 = 0.0039 relative rounding per stored weight and per
# activation written back. Norm statistics, attention softmax and the latent statistics run in
# float32 here, so the error comes from rounding weights and activations through ~30 convs and
# a bf16 residual stream. Measured against the float32 torch model on CPU (these inputs, and 5
# other seeds): encode 0.0071 (0.006-0.009), decode 0.024 (0.018-0.029). diffusers' own model
# run in bf16 is no better: 0.020 for the encoder, 0.030 for the decoder. The bounds leave
# 2.5-4x margin and still catch real mistakes (a wrong mapping or missing op gives errors of
# order 1; the fp32 tests above catch the subtle ones).
BF16_ENCODE_BOUND = 0.025
BF16_DECODE_BOUND = 0.06


def test_encode_bf16_close_to_fp32_reference(bf16_outputs, reference_outputs) -> None:
    got, want = bf16_outputs[0], reference_outputs[0]
    assert got.dtype == jnp.float32  # the latent statistics are applied in float32
    assert _rel_err(got, want) <= BF16_ENCODE_BOUND


def test_decode_bf16_close_to_fp32_reference(bf16_outputs, reference_outputs) -> None:
    got, want = bf16_outputs[1], reference_outputs[1]
    assert _rel_err(got, want) <= BF16_DECODE_BOUND


def test_group_norm_statistics_of_bf16_the_same_with_a_convert_per_pass() -> None:
    """On CPU a bf16 GroupNorm converts its input to float32 once per pass (trace.convert_per_pass:
    XLA:CPU otherwise writes a float32 copy of the activation between the passes). The statistics
    are the single-convert form's bit for bit, and float64's to float32 rounding."""
    from flux2klein_cli.core.models.trace import TraceOptions, jit_program
    from flux2klein_cli.core.models.vae import GroupNorm

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 24, 16, 64)) * 4 + 3, jnp.bfloat16)
    norm = GroupNorm(64, 32, dtype=jnp.bfloat16)
    norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, 64), jnp.bfloat16)
    per_pass, once = TraceOptions("cpu", "blocked"), TraceOptions("gpu", "xla")
    assert per_pass.convert_per_pass and not once.convert_per_pass
    got = [jit_program(norm.statistics, options)(x) for options in (per_pass, once)]
    for a, b in zip(*got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    groups = np.asarray(x.astype(jnp.float32), np.float64).reshape(2, -1, 32, 2)
    mean = groups.mean(axis=(1, 3))
    var = groups.var(axis=(1, 3))
    weight = np.asarray(norm.weight[...].astype(jnp.float32), np.float64)
    want_mean = np.repeat(mean, 2, axis=1)[:, None]
    want_scale = (np.repeat(1 / np.sqrt(var + norm.eps), 2, axis=1) * weight)[:, None]
    np.testing.assert_allclose(np.asarray(got[0][0]), want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[0][1]), want_scale, rtol=1e-5)


def test_dtypes_and_latent_stats_in_state(bf16_model: Flux2VAE) -> None:
    flat = dict(nnx.to_flat_state(nnx.split(bf16_model)[1]))
    assert flat[("bn", "running_mean")].get_value().dtype == jnp.float32
    assert flat[("bn", "running_var")].get_value().dtype == jnp.float32
    assert flat[("encoder", "conv_in", "kernel")].get_value().dtype == jnp.bfloat16


# ----------------------------------------------------------------------------- config


def test_config_from_dict() -> None:
    cfg = VAEConfig.from_dict(vae_config())
    assert cfg.decoder_block_out_channels == cfg.block_out_channels == (32, 32, 64, 64)
    assert cfg.patched_channels == 128 and cfg.spatial_factor == 16
    small = VAEConfig.from_dict({**vae_config(), "decoder_block_out_channels": [96, 192, 384, 384]})
    assert small.decoder_block_out_channels == (96, 192, 384, 384)
    assert VAEConfig.from_dict({}) == VAEConfig()  # diffusers' defaults are the real VAE
    with pytest.raises(CheckpointError, match="patch_size"):
        VAEConfig.from_dict({**vae_config(), "patch_size": [1, 1]})
    with pytest.raises(CheckpointError, match="same length"):
        VAEConfig.from_dict({**vae_config(), "decoder_block_out_channels": [32, 64, 64]})


# ----------------------------------------------------------------------------- loader errors


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "vae"
    shutil.copytree(src, dst)
    return dst


def _rewrite(directory: Path, change) -> None:
    from safetensors.numpy import load_file, save_file

    path = directory / WEIGHTS
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def test_renamed_key_names_missing_and_unexpected(torch_vae_dir: tuple[object, Path], tmp_path: Path) -> None:
    d = _copy(torch_vae_dir[1], tmp_path)
    old, new = "decoder.conv_out.weight", "decoder.conv_outt.weight"
    _rewrite(d, lambda t: t.__setitem__(new, t.pop(old)))
    with pytest.raises(CheckpointError, match=rf"missing keys: {old}.*unexpected keys: {new}"):
        load_vae(d, dtype=jnp.float32)


def test_wrong_shape_names_key(torch_vae_dir: tuple[object, Path], tmp_path: Path) -> None:
    d = _copy(torch_vae_dir[1], tmp_path)
    key = "encoder.mid_block.attentions.0.to_q.weight"
    _rewrite(d, lambda t: t.__setitem__(key, t[key][:, :32].copy()))
    with pytest.raises(CheckpointError, match=rf"wrongly shaped keys: {key}"):
        load_vae(d, dtype=jnp.float32)


def test_missing_batch_norm_statistic(torch_vae_dir: tuple[object, Path], tmp_path: Path) -> None:
    d = _copy(torch_vae_dir[1], tmp_path)
    _rewrite(d, lambda t: t.pop("bn.running_var"))
    with pytest.raises(CheckpointError, match=r"missing keys: bn\.running_var"):
        load_vae(d, dtype=jnp.float32)


def test_truncated_file(torch_vae_dir: tuple[object, Path], tmp_path: Path) -> None:
    d = _copy(torch_vae_dir[1], tmp_path)
    path = d / WEIGHTS
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_vae(d, dtype=jnp.float32)


def test_missing_config(torch_vae_dir: tuple[object, Path], tmp_path: Path) -> None:
    d = _copy(torch_vae_dir[1], tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_vae(d, dtype=jnp.float32)


def test_config_that_does_not_fit_the_weights(torch_vae_dir: tuple[object, Path], tmp_path: Path) -> None:
    d = _copy(torch_vae_dir[1], tmp_path)
    config = json.loads((d / "config.json").read_text())
    config["layers_per_block"] = 3
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"missing keys: decoder\.up_blocks\.0\.resnets\.3\."):
        load_vae(d, dtype=jnp.float32)


# ----------------------------------------------------------------------------- real geometry


def _assert_geometry_matches(config: dict) -> None:
    """Every parameter shape of our model, through the key plan, equals diffusers' (built on
    the meta device: no memory), and the parameter counts agree."""
    from flux2klein_cli.core.weights.loader import _layout_shape

    cfg = VAEConfig.from_dict(config)
    model = nnx.eval_shape(lambda: Flux2VAE(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    plan = vae_key_plan(model)
    ours = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        source = plan.sources[path]
        ours[source.keys[0]] = (tuple(var.get_value().shape), source.layout)
    with torch.device("meta"):
        ref = diffusers.AutoencoderKLFlux2(**config)
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items() if not plan.ignore(k)}
    assert set(ours) == set(theirs)
    for key, (shape, layout) in ours.items():
        assert _layout_shape(theirs[key], layout) == shape, key
    assert sum(math.prod(s) for s, _ in ours.values()) == sum(math.prod(s) for s in theirs.values())


def test_real_geometry_matches_diffusers() -> None:
    real = dict(block_out_channels=[128, 256, 512, 512])  # everything else: the defaults
    _assert_geometry_matches(real)
    _assert_geometry_matches({**real, "decoder_block_out_channels": [96, 192, 384, 384]})


def test_pipeline_decode_is_per_image(bf16_model: Flux2VAE) -> None:
    """The pipeline's decode maps over the images: a batch of four needs about the
    temporaries of one (the decoder's activations are the pipeline's largest), and gives
    each image as decoded alone."""
    from flux2klein_cli.core.pipeline.programs import decode_latents, jit_module_call

    decode, state = jit_module_call(bf16_model, decode_latents), nnx.state(bf16_model)
    channels = bf16_model.config.patched_channels
    latents = jax.random.normal(jax.random.key(1), (4, 8, 8, channels), jnp.float32)

    def temp_bytes(batch: int) -> int:
        shape = jax.ShapeDtypeStruct((batch, 8, 8, channels), jnp.float32)
        return decode.lower(state, shape).compile().memory_analysis().temp_size_in_bytes

    one, four = temp_bytes(1), temp_bytes(4)
    assert four < 1.5 * one, (one, four)
    batch = np.asarray(decode(state, latents))
    alone = np.concatenate([np.asarray(decode(state, latents[i : i + 1])) for i in range(4)])
    # Each image runs through the same per-image program body: equal to the bit, not merely close.
    np.testing.assert_array_equal(batch, alone)


def test_convs_as_matmuls_match_diffusers(fp32_model: Flux2VAE, image: np.ndarray, latents: np.ndarray,
                                          reference_outputs) -> None:
    """The matmul form of the 3x3 convolutions (`--effort fast` programs) within the fp32
    convolutions' bounds."""
    from flux2klein_cli.core.models.vae import convs_as_matmuls

    with convs_as_matmuls():
        encoded, decoded = _run_both(fp32_model, image, latents)
    assert _rel_err(encoded, reference_outputs[0]) <= 1e-4 and _rel_err(decoded, reference_outputs[1]) <= 1e-4


# Other shapes of the diffusers config: a narrower decoder (FLUX.2-small-decoder's kind), and every
# other field that shapes the model moved off its default at once.
OTHER_CONFIGS = {
    "narrow-decoder": dict(decoder_block_out_channels=NARROW_DECODER),
    "other-fields": dict(block_out_channels=(16, 32, 32), decoder_block_out_channels=(16, 16, 48),
                         down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                         layers_per_block=1, latent_channels=8, norm_num_groups=8, use_quant_conv=False,
                         use_post_quant_conv=False, mid_block_add_attention=False, batch_norm_eps=1e-3,
                         in_channels=4, out_channels=2),
}


@pytest.mark.parametrize("name", list(OTHER_CONFIGS))
def test_other_configs_match_diffusers_fp32(name: str, tmp_path: Path) -> None:
    config = {**vae_config(), **OTHER_CONFIGS[name]}
    torch.manual_seed(5)
    vae = diffusers.AutoencoderKLFlux2(**config).eval()
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(torch.rand_like(vae.bn.running_var) + 0.5)
    vae.save_pretrained(tmp_path, safe_serialization=True)
    model = load_vae(tmp_path, dtype=jnp.float32)
    assert model.config.decoder_block_out_channels == tuple(config["decoder_block_out_channels"])
    rng = np.random.default_rng(3)
    f = model.config.spatial_factor
    image = rng.uniform(-1, 1, (1, config["in_channels"], 2 * f, 3 * f)).astype(np.float32)
    latents = rng.standard_normal((1, 2, 3, model.config.patched_channels)).astype(np.float32)
    encoded, decoded = _run_both(model, image, latents)
    assert _rel_err(decoded, _reference_decode(vae, latents)) <= 1e-4
    assert _rel_err(encoded, _reference_encode(vae, image)) <= 1e-4
