"""`convert --quantize int8` (issue 21): what is stored, that it loads zero-copy, bytes on the
real geometries, and fidelity against diffusers' unquantized float32 pipeline."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.core.hub import random_checkpoint as rc
from flux2klein_cli.core.hub.random_checkpoint import write_random_checkpoint
from flux2klein_cli.core.models.quantized import QuantizedLinear, int8_dynamic_matmul, int8_matmul, quantize_weights
from flux2klein_cli.core.weights import flat_index
from flux2klein_cli.core.weights.convert import _stored_bytes, convert
from flux2klein_cli.core.weights.converted import abstract_component, load_component
from flux2klein_cli.core.weights.converted_manifest import read_manifest
from tests.test_convert import mapped_ranges

# Long for the fast tier (`-m "not slow"`, under 4 minutes); the full suite runs it.
pytestmark = pytest.mark.slow

MIN_SSIM = 0.995
runner = CliRunner()


def leaves(model: nnx.Module) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("src") / "snapshot", "tiny", seed=5)


@pytest.fixture(scope="module")
def pair(source: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same snapshot converted to bf16, and to bf16 with int8 block linears."""
    root = tmp_path_factory.mktemp("out")
    convert(source, root / "bf16", dtype="bf16")
    result = runner.invoke(app, ["convert", str(source), "--out", str(root / "int8"), "--quantize", "int8"])
    assert result.exit_code == 0, result.stderr
    return root / "bf16", root / "int8"


def test_int8_matmul_is_the_dequantized_product() -> None:
    rng = np.random.default_rng(0)
    w, x = rng.normal(size=(48, 40)).astype(np.float32), rng.normal(size=(3, 5, 48)).astype(np.float32)
    q, scale = quantize_weights(w)
    assert q.dtype == np.int8 and np.abs(q).max() == 127 and scale.shape == (40,)
    out = np.asarray(int8_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale)))
    np.testing.assert_allclose(out, x @ (q.astype(np.float32) * scale), rtol=1e-5, atol=1e-5)
    assert np.linalg.norm(out - x @ w) / np.linalg.norm(x @ w) < 0.01


def test_int8_dynamic_matmul_rounds_each_token_and_accumulates_in_int32() -> None:
    rng = np.random.default_rng(1)
    w, x = rng.normal(size=(48, 40)).astype(np.float32), rng.normal(size=(3, 5, 48)).astype(np.float32)
    x[0, 0] *= 100  # one loud token: per-token scales keep the others' resolution
    q, scale = quantize_weights(w)
    out = np.asarray(int8_dynamic_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale)))
    x_scale = np.abs(x).max(axis=-1, keepdims=True) / 127
    xq = np.clip(np.rint(x / x_scale), -127, 127)
    np.testing.assert_allclose(out, (xq @ q.astype(np.float32)) * x_scale * scale, rtol=1e-5, atol=1e-4)
    for i in np.ndindex(*x.shape[:-1]):  # every token within about 1% of its float product, the loud one too
        assert np.linalg.norm(out[i] - x[i] @ w) / np.linalg.norm(x[i] @ w) < 0.02, i


def test_dynamic_int8_compute_is_opt_in_traced_and_in_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    import jax

    from flux2klein_cli.core.errors import UserInputError
    from flux2klein_cli.core.models.trace import TraceOptions, tracing
    from flux2klein_cli.core.settings import INT8_COMPUTE as INT8_COMPUTE_ENV

    monkeypatch.delenv(INT8_COMPUTE_ENV, raising=False)
    plain = TraceOptions.for_platform("tpu")
    monkeypatch.setenv(INT8_COMPUTE_ENV, "dynamic")
    dynamic = TraceOptions.for_platform("tpu")
    assert (plain.int8_compute, dynamic.int8_compute) == ("weight-only", "dynamic")
    assert plain.as_key() != dynamic.as_key()  # part of every program's store key
    monkeypatch.setenv(INT8_COMPUTE_ENV, "int4")
    with pytest.raises(UserInputError, match=INT8_COMPUTE_ENV):
        TraceOptions.for_platform("cpu")
    q, scale = quantize_weights(np.ones((8, 4), np.float32))
    layer = QuantizedLinear(nnx.Param(jnp.asarray(q)), nnx.Param(jnp.asarray(scale)), None)
    x = jnp.ones((2, 8), jnp.bfloat16)
    for options, accumulate in ((plain, "bfloat16"), (dynamic, "int32")):
        with tracing(options):
            text = str(jax.make_jaxpr(lambda v: layer(v))(x))
        assert f"preferred_element_type={accumulate}" in text, text


def test_manifest_stored_dtypes_and_kept_layers(pair: tuple[Path, Path]) -> None:
    bf16, int8 = pair
    manifest = read_manifest(int8)
    assert manifest["quantize"]["scheme"] == "int8"
    assert {n for n, c in manifest["components"].items() if c.get("quantize") == "int8"} == {"transformer",
                                                                                            "text_encoder"}
    for name in ("transformer", "text_encoder"):
        plain, quant = load_component(name, bf16), load_component(name, int8)
        a, b = leaves(plain), leaves(quant)
        scales = {k for k in b if k.endswith(".scale")}
        kernels = {k.removesuffix(".scale") + ".kernel" for k in scales} - {"embed_tokens.kernel"}
        assert scales and set(b) - scales == set(a)
        for key in a:
            if key in kernels:  # int8, its scale per output channel, within rounding of the bf16 weights
                assert b[key].dtype == np.int8 and b[key.removesuffix("kernel") + "scale"].dtype == np.float32
                dequant = b[key].astype(np.float32) * b[key.removesuffix("kernel") + "scale"][..., None, :]
                ref = a[key].astype(np.float32)
                assert np.linalg.norm(dequant - ref) / np.linalg.norm(ref) < 0.01, key
            elif key == "embed_tokens.embedding":  # int8 per row (token)
                dequant = b[key].astype(np.float32) * b["embed_tokens.scale"][:, None]
                ref = a[key].astype(np.float32)
                assert np.linalg.norm(dequant - ref) / np.linalg.norm(ref) < 0.01
            else:  # norms, modulation, embedders, final layers: the bf16 bits
                assert b[key].dtype == a[key].dtype and np.array_equal(b[key].view(np.uint8), a[key].view(np.uint8))
        if name == "transformer":  # by name: every block linear (to_out.0 too), no modulation or final layer
            assert "transformer_blocks.attn.to_out.0.scale" in scales
            assert not {k for k in scales if k.startswith(("double_stream_modulation", "norm_out", "proj_out"))}
        swapped = [m for p, m in nnx.iter_modules(quant) if p and p[-1] in ("to_q", "q_proj")]
        assert swapped and all(isinstance(m, QuantizedLinear) for m in swapped)


def test_int8_kernels_are_views_of_the_mapped_file(pair: tuple[Path, Path]) -> None:
    data = pair[1] / "transformer" / "flat" / "params.bin"
    index = flat_index.read_index(data.parent)
    model = load_component("transformer", pair[1])
    ranges = mapped_ranges(data)
    quantized = {k: v for k, v in leaves_arrays(model).items() if v.dtype == jnp.int8}
    assert quantized
    for key, array in quantized.items():
        pointer = array.unsafe_buffer_pointer()
        (start, _, file_offset), = [r for r in ranges if r[0] <= pointer < r[1]]
        assert pointer - start + file_offset == index.tensors[key].offset, key


def leaves_arrays(model: nnx.Module) -> dict:
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("size", ["4b", "9b"])
def test_int8_bytes_of_the_real_geometries(size: str) -> None:
    """On disk (what convert writes, from the same function): int8 at most 0.55x of bf16."""
    geometry = rc.preset(size)
    configs = {"transformer": rc.transformer_config_json(geometry),
               "text_encoder": rc.text_encoder_config_json(geometry, geometry.text_encoder["vocab_size"])}
    for name, config in configs.items():
        model = abstract_component(name, config, jnp.bfloat16)
        assert _stored_bytes(model, "int8") <= 0.55 * _stored_bytes(model, None), name


def test_orbax_and_unknown_schemes_are_refused(source: Path, tmp_path: Path) -> None:
    cases = ((["--layout", "orbax", "--quantize", "int8"], "--layout flat"), (["--quantize", "int4"], "int4"))
    for args, words in cases:
        result = runner.invoke(app, ["convert", str(source), "--out", str(tmp_path / "x"), *args])
        assert result.exit_code == 2 and words in result.stderr, result.stderr
        assert not (tmp_path / "x").exists()


def test_executable_key_and_shapes_carry_the_scheme(pair: tuple[Path, Path]) -> None:
    from flux2klein_cli.core.compile.model_configs import configs_from_snapshot
    from flux2klein_cli.core.compile.specs import AbstractModels

    plain, quant = (configs_from_snapshot(p) for p in pair)
    assert (plain.quantize, quant.quantize) == (None, "int8")
    models = AbstractModels.build(quant)
    expected = {k: v.dtype for k, v in leaves_arrays(load_component("transformer", pair[1])).items()}
    assert {k: v.dtype for k, v in leaves_arrays(models.transformer).items()} == expected


# ----------------------------------------------------------------------------- fidelity (reference tier)


@pytest.fixture(scope="module")
def int8_fp32(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference fixture with int8 block linears and everything else in float32: the error
    measured is the quantization's alone."""
    out = tmp_path_factory.mktemp("q") / "tiny-int8"
    convert(tiny_checkpoint, out, dtype="fp32", quantize="int8")
    return out


def _parity(tiny_checkpoint: Path, int8_fp32: Path, fields, references=()) -> float:
    from dataclasses import replace

    from flux2klein_cli.core.runs.parity import compare, reference_pipeline, run_reference
    from tests.fixtures.engine import engine_on, upload

    ours = engine_on(int8_fp32)
    uploads = tuple(upload(image, f"r{i}.png") for i, image in enumerate(references))
    plan = ours.plan(replace(fields, references=uploads))
    noise = ours.initial_noise(plan)
    image = ours.run(plan).images
    reference = run_reference(reference_pipeline(engine_on(tiny_checkpoint), "fp32"), plan, noise, list(references))
    assert reference.std() > 10
    return compare(image, reference).ssim


def test_int8_text_to_image_against_diffusers_fp32(tiny_checkpoint: Path, int8_fp32: Path) -> None:
    from flux2klein_cli.core.engine.plan import RunFields

    fields = RunFields(prompts=("a red fox in snow",), steps=4, height=64, width=64, seed=3)
    assert _parity(tiny_checkpoint, int8_fp32, fields) >= MIN_SSIM


def test_int8_two_reference_edit_against_diffusers_fp32(tiny_checkpoint: Path, int8_fp32: Path) -> None:
    from flux2klein_cli.core.engine.plan import RunFields
    from tests.test_pipeline_parity import synthetic_image

    fields = RunFields(prompts=("put them together",), steps=4, height=64, width=64, seed=7)
    refs = [synthetic_image(96, 64, 1), synthetic_image(64, 80, 2)]
    assert _parity(tiny_checkpoint, int8_fp32, fields, refs) >= MIN_SSIM


@pytest.mark.parametrize("references", [0, 2])
def test_int8_dynamic_compute_against_diffusers_fp32(tiny_checkpoint: Path, int8_fp32: Path, references: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """FLUX2KLEIN_INT8_COMPUTE=dynamic: activations rounded per token too; the same bound."""
    from flux2klein_cli.core.engine.plan import RunFields
    from flux2klein_cli.core.settings import INT8_COMPUTE as INT8_COMPUTE_ENV
    from tests.test_pipeline_parity import synthetic_image

    monkeypatch.setenv(INT8_COMPUTE_ENV, "dynamic")
    fields = RunFields(prompts=("put them together",), steps=4, height=64, width=64, seed=7)
    refs = [synthetic_image(96, 64, 1), synthetic_image(64, 80, 2)][:references]
    assert _parity(tiny_checkpoint, int8_fp32, fields, refs) >= MIN_SSIM
