"""LoRA adapters (issue 19): every layout, several at once, exit 2 for foreign files, no recompiles.

The same random factors are written in each layout (core/lora/random_lora.py inverts the mapping
core/lora/layouts.py reads), so the LoRA layouts must give identical weights, and every layout's
images must equal diffusers' `load_lora_weights` + `set_adapters` on the same files.

One divergence from diffusers, on purpose: BFL's `final_layer.adaLN_modulation.1` is diffusers'
`norm_out.linear` with its two output halves swapped (the base weights are converted that way), and a
LoRA trained on BFL's layout changes BFL's rows, so we swap its delta's rows too. diffusers' Flux2 LoRA
converters map that module without the swap (shift and scale deltas land on each other's rows), so
the diffusers comparisons leave that one module out of their files and
`test_final_layer_delta_swaps_halves_like_the_weight` checks ours alone.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flux2klein_cli.core.engine.plan import RunFields
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.hub.random_checkpoint import write_random_checkpoint
from flux2klein_cli.core.lora.files import LoraSpec
from flux2klein_cli.core.lora.merge import LoraDeltas
from flux2klein_cli.core.lora.random_lora import lora_tensors, write_float32_safetensors, write_random_lora
from flux2klein_cli.core.models.transformer import load_transformer
from tests.fixtures.engine import engine_on

MIN_SSIM, MAX_DIFF = 0.999, 2
NORM_OUT = "final_layer.adaLN_modulation.1"
# What diffusers' kohya converter reads (it warns about, and drops, any other module); its LyCORIS
# converter reads block modules only. We read all of them (the tests above).
KOHYA_DIFFUSERS = ("double_blocks.", "single_blocks.", "img_in", "txt_in", "time_in.", "final_layer.linear")


@pytest.fixture(scope="module")
def transformer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-ckpt")
    write_random_checkpoint(root, "tiny", components=["transformer"])
    return root / "transformer"


def merged(transformer_dir: Path, *specs: LoraSpec) -> dict[str, np.ndarray]:
    model = load_transformer(transformer_dir, dtype=jnp.float32, deltas=LoraDeltas.read(list(specs)))
    return {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}


def test_lora_layouts_give_the_same_weights_and_change_them(transformer_dir: Path, tmp_path: Path) -> None:
    base = merged(transformer_dir)
    results = {}
    for layout in ("bfl", "kohya", "peft"):
        path = write_random_lora(tmp_path / f"{layout}.safetensors", transformer_dir, layout, rank=4, alpha=2.0)
        results[layout] = merged(transformer_dir, LoraSpec(str(path), 0.5))
    changed = [k for k in base if not np.array_equal(base[k], results["bfl"][k])]
    assert "transformer_blocks.attn.to_q.kernel" in changed and "norm_out.linear.kernel" in changed
    for layout in ("kohya", "peft"):
        for key in base:
            np.testing.assert_allclose(results[layout][key], results["bfl"][key], rtol=0, atol=1e-6, err_msg=key)
    # alpha / rank and the scale multiply the delta: 0.5 * 2 / 4 of (B @ A).
    tensors = lora_tensors(transformer_dir, "bfl", rank=4, alpha=2.0)
    a, b = (tensors[f"diffusion_model.single_blocks.1.linear2.lora_{x}.weight"] for x in "AB")
    delta = results["bfl"]["single_transformer_blocks.attn.to_out.kernel"][1] - base[
        "single_transformer_blocks.attn.to_out.kernel"][1]
    np.testing.assert_allclose(delta, 0.25 * (b @ a).T, atol=1e-6)


def test_final_layer_delta_swaps_halves_like_the_weight(transformer_dir: Path, tmp_path: Path) -> None:
    tensors = lora_tensors(transformer_dir, "bfl", rank=2, include=lambda m: m == NORM_OUT)
    write_float32_safetensors(tmp_path / "n.safetensors", tensors)
    base, ours = merged(transformer_dir), merged(transformer_dir, LoraSpec(str(tmp_path / "n.safetensors")))
    down, up = (tensors[f"diffusion_model.{NORM_OUT}.lora_{x}.weight"] for x in "AB")
    bfl_delta = up @ down
    half = bfl_delta.shape[0] // 2  # BFL rows: shift, scale; diffusers rows: scale, shift
    expected = np.concatenate([bfl_delta[half:], bfl_delta[:half]]).T
    np.testing.assert_allclose(ours["norm_out.linear.kernel"] - base["norm_out.linear.kernel"], expected, atol=1e-6)


def test_lokr_layouts_merge_kronecker_products(transformer_dir: Path, tmp_path: Path) -> None:
    base = merged(transformer_dir)
    for layout in ("lokr-bfl", "lokr-lycoris"):
        path = write_random_lora(tmp_path / f"{layout}.safetensors", transformer_dir, layout, rank=2, alpha=1.0)
        ours = merged(transformer_dir, LoraSpec(str(path)))
        tensors = lora_tensors(transformer_dir, layout, rank=2, alpha=1.0)
        name = ("diffusion_model.double_blocks.0.img_mlp.2" if layout == "lokr-bfl"
                else "lycoris_transformer_blocks_0_ff_linear_out")
        w2 = tensors[f"{name}.lokr_w2_a"] @ tensors[f"{name}.lokr_w2_b"]
        expected = np.kron(tensors[f"{name}.lokr_w1"], w2) * (1.0 / 2)  # alpha / rank of the decomposed factor
        got = ours["transformer_blocks.ff.linear_out.kernel"][0] - base["transformer_blocks.ff.linear_out.kernel"][0]
        np.testing.assert_allclose(got, expected.T, atol=1e-6, err_msg=layout)


@pytest.mark.parametrize("problem", ["foreign", "shape", "text-encoder", "unknown-suffix"])
def test_a_wrong_lora_is_one_readable_error(transformer_dir: Path, tmp_path: Path, problem: str) -> None:
    tensors = lora_tensors(transformer_dir, "bfl", rank=2, include=lambda m: m.startswith("double_blocks.0"))
    if problem == "foreign":
        tensors["diffusion_model.double_blocks.0.img_attn.qkvz.lora_A.weight"] = np.zeros((2, 4), np.float32)
        tensors["diffusion_model.double_blocks.0.img_attn.qkvz.lora_B.weight"] = np.zeros((4, 2), np.float32)
    elif problem == "shape":  # e.g. a 9B LoRA on 4B
        key = "diffusion_model.double_blocks.0.img_mlp.0.lora_A.weight"
        tensors[key] = np.zeros((2, tensors[key].shape[1] * 2), np.float32)
    elif problem == "text-encoder":
        tensors["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = np.zeros((2, 4), np.float32)
    else:
        tensors["diffusion_model.double_blocks.0.img_mlp.0.dora_scale"] = np.zeros((1, 4), np.float32)
    write_float32_safetensors(tmp_path / "bad.safetensors", tensors)
    with pytest.raises(UserInputError) as error:
        merged(transformer_dir, LoraSpec(str(tmp_path / "bad.safetensors")))
    message = str(error.value)
    assert "\n" not in message and "bad.safetensors" in message
    expected = {"foreign": "img_attn.qkvz", "shape": "wrong shapes", "text-encoder": "lora_te1_",
                "unknown-suffix": "dora_scale"}[problem]
    assert expected in message and ("ai-toolkit / BFL" in message or "kohya" in message)


def test_convert_merges_the_lora_and_records_it(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from flux2klein_cli.core.weights.convert import convert
    from flux2klein_cli.core.weights.converted import load_component

    path = write_random_lora(tmp_path / "l.safetensors", tiny_checkpoint / "transformer", "peft", rank=2, seed=3,
                             text_encoder_dir=tiny_checkpoint / "text_encoder")
    spec = LoraSpec(str(path), 0.5)
    manifest = convert(tiny_checkpoint, tmp_path / "conv", dtype="fp32", lora=LoraDeltas.read([spec]))
    from flux2klein_cli.core.models.qwen3 import load_qwen3

    text = load_component("text_encoder", tmp_path / "conv", dtype=jnp.float32)
    deltas = LoraDeltas.read([spec]).for_component("text_encoder")  # type: ignore[union-attr]
    expected_text = load_qwen3(tiny_checkpoint / "text_encoder", dtype=jnp.float32, deltas=deltas)
    plain_text = load_qwen3(tiny_checkpoint / "text_encoder", dtype=jnp.float32)
    got, want, plain = ([np.asarray(x) for x in jax.tree.leaves(nnx.state(m))]
                        for m in (text, expected_text, plain_text))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(b, c) for b, c in zip(want, plain, strict=True))  # the text encoder's LoRA is in
    assert manifest["lora"][0]["scale"] == 0.5
    converted = load_component("transformer", tmp_path / "conv", dtype=jnp.float32)
    ours = {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(converted))}
    expected = merged(tiny_checkpoint / "transformer", spec)
    assert not np.array_equal(expected["proj_out.kernel"], merged(tiny_checkpoint / "transformer")["proj_out.kernel"])
    for key, value in expected.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)
    with pytest.raises(UserInputError, match="converted"):
        engine_on(tmp_path / "conv", lora=(as_text(spec),))


def test_spec_parsing() -> None:
    assert LoraSpec.parse("a/b.safetensors:0.5") == LoraSpec("a/b.safetensors", 0.5)
    assert LoraSpec.parse("org/repo") == LoraSpec("org/repo", 1.0)
    assert LoraSpec.parse("C:/x/y.safetensors") == LoraSpec("C:/x/y.safetensors", 1.0)
    with pytest.raises(UserInputError):
        LoraSpec.parse("x.safetensors:nan")


@pytest.mark.slow
def test_cli_exit_2_in_one_line_and_json_records_the_lora(tiny_checkpoint: Path, tmp_path: Path) -> None:
    transformer = tiny_checkpoint / "transformer"
    bad = {"diffusion_model.double_blocks.0.img_attn.qkvz.lora_A.weight": np.zeros((2, 4), np.float32),
           "diffusion_model.double_blocks.0.img_attn.qkvz.lora_B.weight": np.zeros((4, 2), np.float32)}
    write_float32_safetensors(tmp_path / "bad.safetensors", bad)
    good = write_random_lora(tmp_path / "good.safetensors", transformer, "kohya", rank=2,
                             text_encoder_dir=tiny_checkpoint / "text_encoder")  # text-encoder keys are recorded alike
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    base = [sys.executable, "-m", "flux2klein_cli", "generate", "a fox", "--model", str(tiny_checkpoint),
            "--height", "32", "--width", "32", "--steps", "1", "--dtype", "fp32", "--no-save", "--json"]
    done = subprocess.run([*base, "-o", str(tmp_path / "bad.png"), "--lora", str(tmp_path / "bad.safetensors")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-2000:]
    # one error line (with --json the phases before it are plain progress lines: cli/progress.PhaseLines)
    errors = [line for line in done.stderr.strip().splitlines() if line not in ("loading model",)]
    assert len(errors) == 1 and errors[0].startswith("error:") and "qkvz" in errors[0], done.stderr
    assert not (tmp_path / "bad.png").exists()
    done = subprocess.run([*base, "-o", str(tmp_path / "good.png"), "--lora", f"{good}:0.75"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["lora"][0]["scale"] == 0.75 and len(report["lora"][0]["sha256"]) == 64
    assert report["lora"][0]["layout"] == "kohya / musubi"
    from PIL import Image

    assert json.loads(Image.open(tmp_path / "good.png").text["lora"])[0]["path"] == str(good)


# ---- against diffusers (reference tier) ------------------------------------------------------

def parity_lora(pipeline_dir: Path, tmp_path: Path, layouts: list[tuple[str, float]], seed: int = 0) -> list[LoraSpec]:
    specs = []
    for i, (layout, scale) in enumerate(layouts):
        prefixes = {"kohya": KOHYA_DIFFUSERS, "lokr-lycoris": ("double_blocks.", "single_blocks.")}.get(layout, ("",))
        include = lambda m, p=prefixes: m != NORM_OUT and m.startswith(p)  # noqa: E731
        alpha = None if layout in ("bfl", "peft") else 2.0  # diffusers reads no alpha in those two
        path = write_random_lora(tmp_path / f"{layout}-{i}.safetensors", pipeline_dir / "transformer", layout,
                                 rank=4, seed=seed + i, alpha=alpha, include=include, std=0.2)
        specs.append(LoraSpec(str(path), scale))
    return specs


def as_text(spec: LoraSpec) -> str:
    return f"{spec.source}:{spec.scale}"


def check_parity(model: Path, specs: list[LoraSpec], fields: RunFields, pil: list = ()) -> None:
    from tests.test_pipeline_parity import check

    run = check(engine_on(model, lora=tuple(map(as_text, specs))), fields, list(pil))
    plain = engine_on(model).run(run.plan).images  # the same plan and noise without the LoRA
    assert np.abs(plain.astype(int) - run.ours.astype(int)).max() > 6  # the LoRA does change the image


@pytest.mark.parametrize("layout", ["bfl", *(pytest.param(name, marks=pytest.mark.slow)
                                             for name in ("kohya", "peft", "lokr-bfl", "lokr-lycoris"))])
def test_each_layout_equals_diffusers(tiny_checkpoint: Path, tmp_path: Path, layout: str) -> None:
    specs = parity_lora(tiny_checkpoint, tmp_path, [(layout, 0.8)])
    check_parity(tiny_checkpoint, specs, RunFields(prompts=("a red fox",), steps=3, height=64, width=64, seed=3))


@pytest.mark.slow
def test_peft_header_alpha_pattern_and_rslora_equal_diffusers(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """diffusers builds the LoraConfig from the header a PEFT file carries: lora_alpha, a
    per-module alpha_pattern (regexes matched at a dotted suffix) and use_rslora."""
    tensors = lora_tensors(tiny_checkpoint / "transformer", "peft", rank=4, seed=7,
                           include=lambda m: m != NORM_OUT, std=0.2)
    targets = sorted({k.removeprefix("transformer.").split(".lora_")[0] for k in tensors})
    specs = []
    for i, rslora in enumerate((False, True)):
        config = {"r": 4, "lora_alpha": 8, "target_modules": targets, "use_rslora": rslora,
                  "alpha_pattern": {"transformer_blocks.0.attn.to_q": 1.0,
                                    r"single_transformer_blocks\.\d+\.attn\.to_out": 2.0}}
        header = {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()})}
        write_float32_safetensors(tmp_path / f"p{i}.safetensors", tensors, header)
        specs.append(LoraSpec(str(tmp_path / f"p{i}.safetensors"), 1.0))
    for spec in specs:
        check_parity(tiny_checkpoint, [spec], RunFields(prompts=("a red fox",), steps=3, height=64, width=64, seed=6))
    # The pattern changes the deltas: a header without it gives other weights.
    from flux2klein_cli.core.lora.layouts import PeftScaling

    peft = PeftScaling(8.0, (("transformer_blocks.0.attn.to_q", 1.0),), rslora=True)
    assert peft.alpha_for("transformer_blocks.0.attn.to_q") == 1.0
    assert peft.alpha_for("transformer_blocks.1.attn.to_q") == 8.0
    assert peft.alpha_for("single_transformer_blocks.0.attn.to_q") == 8.0
    assert peft.scale(8.0, 4) == 4.0


@pytest.mark.slow
def test_two_loras_at_once_equal_diffusers_set_adapters(tiny_checkpoint: Path, tmp_path: Path) -> None:
    specs = parity_lora(tiny_checkpoint, tmp_path, [("bfl", 0.6), ("kohya", 1.3)])
    check_parity(tiny_checkpoint, specs, RunFields(prompts=("a red fox",), steps=3, height=64, width=64, seed=4))


@pytest.mark.slow
def test_lora_on_a_kv_edit_equals_diffusers(tiny_kv_checkpoint: Path, tmp_path: Path) -> None:
    from tests.test_pipeline_parity import synthetic_image

    specs = parity_lora(tiny_kv_checkpoint, tmp_path, [("peft", 1.0)])
    check_parity(tiny_kv_checkpoint, specs, RunFields(prompts=("make it blue",), steps=3, height=64, width=64, seed=5),
                 [synthetic_image(64, 64, 0)])


# ---- no recompiles ----------------------------------------------------------------------------

@pytest.mark.slow
def test_switching_loras_or_scales_compiles_nothing(tiny_checkpoint: Path, tmp_path: Path) -> None:
    transformer = tiny_checkpoint / "transformer"
    first = write_random_lora(tmp_path / "a.safetensors", transformer, "bfl", rank=2, seed=1)
    second = write_random_lora(tmp_path / "b.safetensors", transformer, "lokr-bfl", rank=4, seed=2, alpha=1.0)
    text = write_random_lora(tmp_path / "t.safetensors", None, "peft", rank=2, seed=3, std=0.2,
                             text_encoder_dir=tiny_checkpoint / "text_encoder")  # the text encoder's weights change
    fields = RunFields(prompts=("a red fox",), steps=2, height=32, width=32, seed=1)

    def run(specs: list[LoraSpec]) -> np.ndarray:
        # As generate runs: executables from the store, which takes the weights as arguments.
        engine = engine_on(tiny_checkpoint, lora=tuple(map(as_text, specs)), store=True,
                           compile_cache=tmp_path / "store")
        return engine.run(engine.plan(fields)).images

    images = [run([LoraSpec(str(first))])]  # compiles and stores the programs
    from tests.compile_counter_worker import CompileLog

    log = CompileLog()
    logging.getLogger("jax").addHandler(log)
    jax.config.update("jax_log_compiles", True)
    try:
        for specs in ([LoraSpec(str(first), 0.3)], [LoraSpec(str(second)), LoraSpec(str(first), -1.0)],
                      [LoraSpec(str(first), 0.3), LoraSpec(str(text), 2.0)]):
            images.append(run(specs))
    finally:
        jax.config.update("jax_log_compiles", False)
        logging.getLogger("jax").removeHandler(log)
    assert log.compiled == []
    assert all(np.abs(images[i].astype(int) - images[j]).max() > 0 for i, j in ((0, 1), (1, 2), (1, 3)))


@pytest.mark.parametrize("layout", ["linear", "none"])
@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_merge_in_bands_equals_the_whole_delta(monkeypatch: pytest.MonkeyPatch, layout: str, dtype: object) -> None:
    """The loader merges a device slice band by band (several bands, on the worker threads): the
    result equals stored + every term's whole delta, for low-rank and Kronecker terms (a part of a
    fused tensor, swapped halves)."""
    import ml_dtypes

    from flux2klein_cli.core.lora.layouts import Kronecker, LowRank
    from flux2klein_cli.core.weights import loader
    from flux2klein_cli.core.weights.bfl_names import Part

    dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    stored = f32(96, 40).astype(dtype)  # torch layout (out, in)
    terms = [LowRank(f32(3, 40), f32(96, 3), 0.7, "lr"),
             Kronecker(f32(12, 5), f32(24, 8), 0.5, "fused", Part("qkv", index=1, of=3)),
             Kronecker(f32(12, 5), f32(8, 8), -1.5, "swapped", Part("mod", swap_halves=True))]
    deltas = LoraDeltas([], {"w": terms})
    monkeypatch.setattr(loader, "_MERGE_BAND_BYTES", 4 * 40 * 16)  # 16-row bands
    rows, cols = slice(8, 88), slice(0, 40)
    index = (cols, rows) if layout == "linear" else (rows, cols)
    out = np.full((80, 40)[::-1] if layout == "linear" else (80, 40), np.nan, dtype)
    loader._merge_key(out, stored, "w", layout, index, deltas)

    whole = stored.astype(np.float32)
    for term in terms:
        whole = whole + term.block(slice(None), slice(None))
    expected = whole[rows, cols].T if layout == "linear" else whole[rows, cols]
    tolerance = 1e-5 if dtype == np.float32 else 1e-2  # bf16: one rounding of (nearly) the same sum
    np.testing.assert_allclose(out.astype(np.float32), expected.astype(dtype).astype(np.float32),
                               rtol=tolerance, atol=tolerance)
