"""Text-encoder LoRA keys (issue 19): kohya / musubi `lora_te_`, diffusers / PEFT `text_encoder.` and
LyCORIS LoKr forms merge into the Qwen3 text encoder at load, like the transformer's deltas.

diffusers' Flux2 LoRA loader loads the transformer only, so the references for the text encoder are
transformers' Qwen3 with the LoRA applied by peft (PEFT keys), and merged by hand in torch
(core/runs/parity_lora.py, which `parity --lora` uses; it is checked against peft here too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flux2klein_cli.core.engine.plan import RunFields
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.hub.random_checkpoint import write_random_checkpoint
from flux2klein_cli.core.lora.files import LoraSpec
from flux2klein_cli.core.lora.merge import LoraDeltas
from flux2klein_cli.core.lora.random_lora import text_encoder_lora_tensors, write_float32_safetensors, write_random_lora
from flux2klein_cli.core.models.qwen3 import load_qwen3
from tests.fixtures.engine import engine_on
from tests.fixtures.reference import lazy

torch = lazy("torch")

PROMPTS = ["A red fox in the snow", "An astronaut riding a horse across a desert of orange sand, cinematic"]
MAX_LEN = 64
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A whole random snapshot (the project's own writer: no torch)."""
    root = tmp_path_factory.mktemp("te-lora") / "tiny"
    write_random_checkpoint(root, "tiny")
    return root


def text_encoder(snapshot: Path, *specs: LoraSpec) -> dict[str, np.ndarray]:
    deltas = LoraDeltas.read(list(specs))
    model = load_qwen3(snapshot / "text_encoder", dtype=jnp.float32,
                       deltas=deltas.for_component("text_encoder") if deltas else None)
    return {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}


def test_text_encoder_keys_merge_into_the_text_encoder(snapshot: Path, tmp_path: Path) -> None:
    base = text_encoder(snapshot)
    te = snapshot / "text_encoder"
    results = {}
    for layout in ("kohya", "peft", "lokr-lycoris"):
        path = write_random_lora(tmp_path / f"{layout}.safetensors", None, layout, text_encoder_dir=te, rank=4,
                                 alpha=2.0)
        results[layout] = text_encoder(snapshot, LoraSpec(str(path), 0.5))
        # A text-encoder-only file leaves the transformer alone.
        assert LoraDeltas.read([LoraSpec(str(path))]).for_component("transformer") is None  # type: ignore[union-attr]
    for name in PROJECTIONS:
        key = f"layers.{'mlp' if name in PROJECTIONS[4:] else 'self_attn'}.{name}.kernel"
        assert not np.array_equal(base[key], results["kohya"][key]), key
        np.testing.assert_allclose(results["peft"][key], results["kohya"][key], rtol=0, atol=1e-6, err_msg=key)
    # 0.5 * alpha / rank * (up @ down), transposed into the kernel's (in, out) layout.
    tensors = text_encoder_lora_tensors(te, "kohya", rank=4, alpha=2.0)
    down, up = (tensors[f"lora_te_model_layers_2_mlp_up_proj.lora_{x}.weight"] for x in ("down", "up"))
    delta = results["kohya"]["layers.mlp.up_proj.kernel"][2] - base["layers.mlp.up_proj.kernel"][2]
    np.testing.assert_allclose(delta, 0.25 * (up @ down).T, atol=1e-6)
    tensors = text_encoder_lora_tensors(te, "lokr-lycoris", rank=4, alpha=2.0)
    name = "lora_te_model_layers_1_self_attn_o_proj"
    kron = np.kron(tensors[f"{name}.lokr_w1"], tensors[f"{name}.lokr_w2_a"] @ tensors[f"{name}.lokr_w2_b"])
    delta = results["lokr-lycoris"]["layers.self_attn.o_proj.kernel"][1] - base["layers.self_attn.o_proj.kernel"][1]
    np.testing.assert_allclose(delta, 0.25 * kron.T, atol=1e-6)


@pytest.mark.parametrize("problem", ["second-kohya", "second-peft", "foreign", "shape", "layer"])
def test_a_wrong_text_encoder_lora_is_one_readable_error(snapshot: Path, tmp_path: Path, problem: str) -> None:
    tensors = text_encoder_lora_tensors(snapshot / "text_encoder", "kohya", rank=2)
    pair = {".lora_down.weight": np.zeros((2, 8), np.float32), ".lora_up.weight": np.zeros((8, 2), np.float32)}
    module = {"second-kohya": "lora_te2_model_layers_0_self_attn_q_proj",
              "foreign": "lora_te_model_layers_0_self_attn_qkv_proj",
              "layer": "lora_te_model_layers_99_mlp_up_proj"}.get(problem)
    if module:
        tensors.update({module + suffix: value for suffix, value in pair.items()})
    elif problem == "second-peft":
        tensors["text_encoder_2.text_model.encoder.layers.0.mlp.fc1.lora_A.weight"] = np.zeros((2, 4), np.float32)
    else:  # a LoRA for a wider text encoder (an 8B one on the 4B)
        key = "lora_te_model_layers_0_mlp_down_proj.lora_down.weight"
        tensors[key] = np.zeros((2, tensors[key].shape[1] * 2), np.float32)
    write_float32_safetensors(tmp_path / "bad.safetensors", tensors)
    with pytest.raises(UserInputError) as error:
        text_encoder(snapshot, LoraSpec(str(tmp_path / "bad.safetensors")))
    message = str(error.value)
    assert "\n" not in message and "bad.safetensors" in message and "kohya" in message
    expected = {"second-kohya": "second text encoder", "second-peft": "text_encoder_2.text_model",
                "foreign": "qkv_proj", "shape": "wrong shapes for this model's text encoder",
                "layer": "lora_te_model_layers_99_mlp_up_proj"}[problem]
    assert expected in message, message


def test_cli_second_text_encoder_is_exit_2_in_one_line(snapshot: Path, tmp_path: Path) -> None:
    tensors = {"lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": np.zeros((2, 4), np.float32),
               "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": np.zeros((4, 2), np.float32)}
    write_float32_safetensors(tmp_path / "sdxl.safetensors", tensors)
    done = subprocess.run(
        [sys.executable, "-m", "flux2klein_cli", "generate", "a fox", "--model", str(snapshot), "--height", "32",
         "--width", "32", "--steps", "1", "--no-save", "-o", str(tmp_path / "x.png"),
         "--lora", str(tmp_path / "sdxl.safetensors")],
        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1 and "second text encoder" in done.stderr
    assert not (tmp_path / "x.png").exists()


# ---- against transformers' Qwen3 + peft, and diffusers' pipeline (reference tier) ---------------

def torch_text_encoder(checkpoint: Path):  # noqa: ANN201 (a torch module)
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(checkpoint / "text_encoder", dtype=torch.float32).eval()


def reference_embeds(model, checkpoint: Path) -> np.ndarray:  # noqa: ANN001
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint / "tokenizer")
    with torch.no_grad():
        return Flux2KleinPipeline._get_qwen3_prompt_embeds(text_encoder=model, tokenizer=tokenizer, prompt=PROMPTS,
                                                           max_sequence_length=MAX_LEN).float().numpy()


def ours_embeds(checkpoint: Path, spec: LoraSpec) -> np.ndarray:
    engine = engine_on(checkpoint, lora=(f"{spec.source}:{spec.scale}",))
    return np.asarray(engine.pipeline.encode_text(PROMPTS, MAX_LEN))


def relative(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def with_peft(model, tensors: dict[str, np.ndarray], rank: int, alpha: float, scale: float):  # noqa: ANN001, ANN201
    """peft's LoRA layers on the torch model, loaded from the file's `text_encoder.` keys."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(PROJECTIONS))
    model = inject_adapter_in_model(config, model)
    state = {k.removeprefix("text_encoder."): torch.from_numpy(v) for k, v in tensors.items()}
    result = set_peft_model_state_dict(model, state)
    assert not result.unexpected_keys, result.unexpected_keys
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.scale_layer(scale)
    return model


def test_peft_text_encoder_lora_embeds_equal_peft(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from flux2klein_cli.core.runs.parity_lora import merge_text_encoder_lora, split_text_encoder

    rank, alpha, scale = 4, 2.0, 0.7
    tensors = text_encoder_lora_tensors(tiny_checkpoint / "text_encoder", "peft", rank=rank, std=0.2)
    # diffusers' save_lora_weights keeps each component's lora_alpha in the header, prefixed.
    metadata = {"lora_adapter_metadata": json.dumps({"text_encoder.lora_alpha": alpha, "text_encoder.r": rank})}
    write_float32_safetensors(tmp_path / "peft.safetensors", tensors, metadata)
    ours = ours_embeds(tiny_checkpoint, LoraSpec(str(tmp_path / "peft.safetensors"), scale))
    reference = reference_embeds(with_peft(torch_text_encoder(tiny_checkpoint), tensors, rank, alpha, scale),
                                 tiny_checkpoint)
    plain = reference_embeds(torch_text_encoder(tiny_checkpoint), tiny_checkpoint)
    assert relative(plain, reference) > 1e-2  # the LoRA changes the embeddings
    assert relative(ours, reference) <= 1e-4, relative(ours, reference)
    # The hand merge `parity --lora` uses agrees with peft (it reads the alpha keys, not the header).
    write_float32_safetensors(tmp_path / "alpha.safetensors", {
        **tensors, **{k.replace("lora_A.weight", "alpha"): np.array(alpha, np.float32)
                      for k in tensors if k.endswith("lora_A.weight")}})
    merged = torch_text_encoder(tiny_checkpoint)
    merge_text_encoder_lora(merged, split_text_encoder(tmp_path / "alpha.safetensors")[1], scale)
    assert relative(reference_embeds(merged, tiny_checkpoint), reference) <= 1e-5


def test_kohya_text_encoder_lora_embeds_equal_a_torch_merge(tiny_checkpoint: Path, tmp_path: Path) -> None:
    rank, alpha, scale = 4, 2.0, 1.3
    tensors = text_encoder_lora_tensors(tiny_checkpoint / "text_encoder", "kohya", rank=rank, alpha=alpha, std=0.2)
    write_float32_safetensors(tmp_path / "kohya.safetensors", tensors)
    ours = ours_embeds(tiny_checkpoint, LoraSpec(str(tmp_path / "kohya.safetensors"), scale))
    model = torch_text_encoder(tiny_checkpoint)
    modules = dict(model.named_modules())
    with torch.no_grad():  # W += scale * alpha / rank * up @ down, for the module named with `_` for `.`
        for name, module in modules.items():
            key = "lora_te_" + name.replace(".", "_")
            if f"{key}.lora_down.weight" in tensors:
                up, down = (torch.from_numpy(tensors[f"{key}.lora_{x}.weight"]) for x in ("up", "down"))
                module.weight += scale * alpha / rank * (up @ down)
    assert sum(k.endswith("lora_down.weight") for k in tensors) == 7 * model.config.num_hidden_layers
    reference = reference_embeds(model, tiny_checkpoint)
    assert relative(ours, reference) <= 1e-4, relative(ours, reference)


def test_transformer_and_text_encoder_lora_image_equals_diffusers(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """One kohya file with both parts: diffusers' pipeline loads its transformer keys with
    load_lora_weights and has its text-encoder deltas merged in torch (core/runs/parity_lora.py)."""
    from tests.test_lora import KOHYA_DIFFUSERS, NORM_OUT, check_parity

    path = write_random_lora(tmp_path / "both.safetensors", tiny_checkpoint / "transformer", "kohya",
                             text_encoder_dir=tiny_checkpoint / "text_encoder", rank=4, alpha=2.0, std=0.2,
                             include=lambda m: m != NORM_OUT and m.startswith(KOHYA_DIFFUSERS))
    check_parity(tiny_checkpoint, [LoraSpec(str(path), 0.8)],
                 RunFields(prompts=("a red fox",), steps=2, height=64, width=64, seed=3))
