"""Qwen3 text encoder: tokenizer fixture, parity with transformers and the diffusers klein
pipeline, scan vs unrolled, the key plan's skipped keys, and the real 4B / 8B geometries."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.hub.registry import QWEN3_4B, QWEN3_8B
from flux2klein_cli.core.models.qwen3 import (
    FEATURE_LAYERS,
    Qwen3Config,
    Qwen3TextEncoder,
    encode_prompts,
    load_qwen3,
    qwen3_key_plan,
)
from flux2klein_cli.core.weights.safetensors_io import SafetensorsCheckpoint
from tests.fixtures.reference import lazy
from tests.fixtures.tiny_configs import QWEN3_HIDDEN, qwen3_config
from tests.fixtures.tokenizer import build_tokenizer

# torch and diffusers on first use: the module collects on a base install (no torch).
torch = lazy("torch")
st_torch = lazy("safetensors.torch")

PROMPTS = [
    "A red fox in the snow",
    "An astronaut riding a horse across a desert of orange sand under two moons, cinematic",
]
MAX_LEN = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("qwen3")
    vocab = build_tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**qwen3_config(vocab))).eval()
    # A small shard size gives several shards and an index.json, the layout of the real checkpoints.
    model.save_pretrained(root / "text_encoder", max_shard_size="100KB")
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "tokenizer")
    return dict(root=root, vocab=vocab, torch_model=model, tokenizer=tokenizer)


@nnx.jit(static_argnames="scan")
def _features(model: Qwen3TextEncoder, ids: jax.Array, mask: jax.Array, scan: bool = True) -> jax.Array:
    return model(ids, mask, scan=scan)


def _rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(np.asarray(ours, np.float32) - ref).max() / np.abs(ref).max())


def _pipeline_embeds(text_encoder: torch.nn.Module, tokenizer) -> np.ndarray:
    """The klein pipeline's own prompt encoding (a static method), run on the torch model."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

    with torch.no_grad():
        out = Flux2KleinPipeline._get_qwen3_prompt_embeds(
            text_encoder=text_encoder, tokenizer=tokenizer, prompt=PROMPTS, max_sequence_length=MAX_LEN
        )
    return out.float().numpy()


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_fixture(tiny: dict, tmp_path: Path) -> None:
    tok = tiny["tokenizer"]
    assert isinstance(tok, transformers.Qwen2TokenizerFast)
    assert 500 <= tiny["vocab"] <= 1000 and len(tok) == tiny["vocab"]
    assert tok.pad_token == "<|endoftext|>" and tok.padding_side == "right"

    msgs = [{"role": "user", "content": "a cat"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    thinking = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert thinking == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    # Special tokens are single tokens, not split by the BPE.
    for special in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"):
        assert len(tok(special)["input_ids"]) == 1

    ids, mask = encode_prompts(tok, PROMPTS, max_length=MAX_LEN)
    assert ids.shape == mask.shape == (2, MAX_LEN) and ids.dtype == mask.dtype == np.int32
    lengths = mask.sum(axis=1)
    assert 0 < lengths[0] < lengths[1] < MAX_LEN
    for row, n in zip(range(2), lengths, strict=True):  # right padding: real tokens, then pads
        assert mask[row, :n].all() and not mask[row, n:].any()
        assert (ids[row, n:] == tok.pad_token_id).all()
    assert tok.decode(ids[0, : lengths[0]]).endswith("<think>\n\n</think>\n\n")
    # Truncation keeps max_length.
    long_ids, long_mask = encode_prompts(tok, " ".join(["snow"] * 200), max_length=16)
    assert long_ids.shape == (1, 16) and long_mask.all()

    # Deterministic: the same bytes on every build.
    build_tokenizer(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tiny["root"] / "tokenizer" / name).read_bytes()


# ---------------------------------------------------------------- config


def test_config_from_both_transformers_layouts(tiny: dict) -> None:
    saved = json.loads((tiny["root"] / "text_encoder" / "config.json").read_text())
    assert "rope_parameters" in saved  # transformers 5 writes the theta there
    new = Qwen3Config.from_dict(saved)
    old_layout = {k: v for k, v in saved.items() if k != "rope_parameters"}
    old_layout.update(rope_theta=1_000_000.0, rope_scaling=None)
    assert Qwen3Config.from_dict(old_layout) == new
    assert new.rope_theta == 1_000_000.0 and new.head_dim == 8 and new.num_key_value_heads == 2

    no_head_dim = {k: v for k, v in old_layout.items() if k != "head_dim"}
    assert Qwen3Config.from_dict(no_head_dim).head_dim == QWEN3_HIDDEN // 4
    with pytest.raises(CheckpointError, match="yarn"):
        Qwen3Config.from_dict({**saved, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}})
    with pytest.raises(CheckpointError, match="hidden_size"):
        Qwen3Config.from_dict({k: v for k, v in saved.items() if k != "hidden_size"})


# ---------------------------------------------------------------- parity


def test_parity_float32_with_pipeline(tiny: dict) -> None:
    ref = _pipeline_embeds(tiny["torch_model"], tiny["tokenizer"])
    ids, mask = encode_prompts(tiny["tokenizer"], PROMPTS, max_length=MAX_LEN)
    assert (mask == 0).any()  # padded positions are compared too

    model = load_qwen3(tiny["root"] / "text_encoder", dtype=jnp.float32)
    ours = np.asarray(_features(model, ids, mask))
    assert ours.shape == ref.shape == (2, MAX_LEN, 3 * QWEN3_HIDDEN) and ours.dtype == np.float32
    err = _rel(ours, ref)
    assert err <= 1e-4, err  # measured 5.6e-7

    # The layout, spelled out: per token [h9 | h18 | h27] on the channel axis.
    with torch.no_grad():
        hs = tiny["torch_model"](
            torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(), output_hidden_states=True
        ).hidden_states
    for slot, layer in enumerate(FEATURE_LAYERS):
        chunk = ours[..., slot * QWEN3_HIDDEN : (slot + 1) * QWEN3_HIDDEN]
        assert _rel(chunk, hs[layer].numpy()) <= 1e-4


def test_left_padding_matches_sdpa(tiny: dict) -> None:
    """Not what the pipeline does (Qwen pads right), but every position must still match:
    leading pads are rows with no key to attend to, which SDPA answers with zeros."""
    import copy

    tok = copy.deepcopy(tiny["tokenizer"])
    tok.padding_side = "left"
    ids, mask = encode_prompts(tok, PROMPTS, max_length=MAX_LEN)
    assert mask[0, 0] == 0 and mask[0, -1] == 1
    assert tiny["torch_model"].config._attn_implementation == "sdpa"
    with torch.no_grad():
        hs = tiny["torch_model"](
            torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(), output_hidden_states=True
        ).hidden_states
    ref = np.concatenate([hs[k].numpy() for k in FEATURE_LAYERS], axis=-1)
    model = load_qwen3(tiny["root"] / "text_encoder", dtype=jnp.float32)
    ours = np.asarray(_features(model, ids, mask))
    assert np.isfinite(ours).all()
    assert _rel(ours, ref) <= 1e-4


def test_bf16_error(tiny: dict) -> None:
    ref32 = _pipeline_embeds(tiny["torch_model"], tiny["tokenizer"])
    # As diffusers loads it: from_pretrained in bf16 keeps RoPE's inv_freq in float32
    # (a later `.to(torch.bfloat16)` would round that buffer too and add its own error).
    torch_bf16 = transformers.Qwen3ForCausalLM.from_pretrained(
        tiny["root"] / "text_encoder", dtype=torch.bfloat16
    ).eval()
    ref16 = _pipeline_embeds(torch_bf16, tiny["tokenizer"])

    ids, mask = encode_prompts(tiny["tokenizer"], PROMPTS, max_length=MAX_LEN)
    model = load_qwen3(tiny["root"] / "text_encoder", dtype=jnp.bfloat16)
    ours = _features(model, ids, mask)
    assert ours.dtype == jnp.bfloat16
    ours = np.asarray(ours.astype(jnp.float32))

    # Measured (seed 0, XLA's fused attention): ours vs torch bf16 2.1e-2; vs float32 ours 1.66e-2,
    # torch bf16 1.73e-2. bf16 keeps 8 bits (eps 3.9e-3); 27 layers of independent rounding drift
    # both runs apart by a few eps, in different directions. Bounds: about 1.5x the measured
    # distance to torch, and no worse than 1.5x torch's own bf16 error against float32.
    vs_torch16 = _rel(ours, ref16)
    ours_err, torch_err = _rel(ours, ref32), _rel(ref16, ref32)
    assert vs_torch16 <= 3e-2, vs_torch16
    assert ours_err <= 1.5 * torch_err, (ours_err, torch_err)


def test_scan_matches_unrolled_and_any_feature_layers(tiny: dict) -> None:
    # Few layers keep the unrolled compile short; the order (5, 0, 2) also checks that the
    # embedding output (index 0) and an arbitrary order land in the right channel slots.
    layers = (5, 0, 2)
    ids, mask = encode_prompts(tiny["tokenizer"], PROMPTS, max_length=MAX_LEN)
    model = load_qwen3(tiny["root"] / "text_encoder", dtype=jnp.float32, feature_layers=layers)
    assert model.num_layers == 5
    scanned = np.asarray(_features(model, ids, mask, scan=True))
    unrolled = np.asarray(_features(model, ids, mask, scan=False))
    assert np.abs(scanned - unrolled).max() <= 1e-6 * np.abs(scanned).max()

    with torch.no_grad():
        hs = tiny["torch_model"](
            torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(), output_hidden_states=True
        ).hidden_states
    ref = np.concatenate([hs[k].numpy() for k in layers], axis=-1)
    assert _rel(scanned, ref) <= 1e-4


# ---------------------------------------------------------------- key plan


def _record_reads(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    read: set[str] = set()
    original = SafetensorsCheckpoint.view

    def view(self: SafetensorsCheckpoint, key: str) -> np.ndarray:
        read.add(key)
        return original(self, key)

    monkeypatch.setattr(SafetensorsCheckpoint, "view", view)
    return read


def _single_file_checkpoint(tiny: dict, directory: Path, extra: dict[str, torch.Tensor]) -> Path:
    """The tiny model's full state dict (an untied lm_head included) plus `extra` keys."""
    directory.mkdir()
    state = {k: v.detach().clone().contiguous() for k, v in tiny["torch_model"].state_dict().items()}
    state.update(extra)
    st_torch.save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text((tiny["root"] / "text_encoder" / "config.json").read_text())
    return directory


def test_skipped_keys_are_not_read(tiny: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = _single_file_checkpoint(tiny, tmp_path / "te", {})
    have = SafetensorsCheckpoint.open(directory).keys()
    assert {"lm_head.weight", "model.norm.weight", "model.layers.27.mlp.up_proj.weight"} <= have

    read = _record_reads(monkeypatch)
    model = load_qwen3(directory, dtype=jnp.float32)
    skipped = {k for k in have if re.match(r"model\.layers\.27\.", k)} | {"lm_head.weight", "model.norm.weight"}
    assert read == have - skipped
    assert model.num_layers == 27

    # The sharded fixture (tied: no lm_head key) loads too, reading everything but layer 27 and the norm.
    read.clear()
    load_qwen3(tiny["root"] / "text_encoder", dtype=jnp.float32)
    assert not any(k.startswith("model.layers.27.") or k == "model.norm.weight" for k in read)


@pytest.mark.parametrize(
    "extra",
    [
        "model.layers.3.self_attn.q_proj.bias",  # a bias Qwen3 does not have
        "model.layers.28.mlp.up_proj.weight",  # a layer past num_hidden_layers
        "model.layers.27.mlp.extra.weight",  # an unknown parameter in a skipped layer
        "model.final_norm.weight",
    ],
)
def test_unexpected_key_is_an_error(tiny: dict, tmp_path: Path, extra: str) -> None:
    directory = _single_file_checkpoint(tiny, tmp_path / "te", {extra: torch.zeros(4)})
    with pytest.raises(CheckpointError, match=re.escape(extra)):
        load_qwen3(directory, dtype=jnp.float32)


# ---------------------------------------------------------------- real geometry


# The published geometries, as the registry records them for compile-only work.
REAL = {"Qwen3-4B": QWEN3_4B, "Qwen3-8B": QWEN3_8B}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_geometry(name: str) -> None:
    cfg = dict(hidden_act="silu", attention_bias=False, **REAL[name])
    ours = nnx.eval_shape(lambda: Qwen3TextEncoder(Qwen3Config.from_dict(cfg), dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    with torch.device("meta"):
        ref = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    ref_sizes = {k: v.numel() for k, v in ref.state_dict().items()}

    plan = qwen3_key_plan(ours)
    flat = dict(nnx.to_flat_state(nnx.state(ours, nnx.Param)))
    assert set(flat) == set(plan.sources)
    read: set[str] = set()
    total = 0
    for path, source in plan.sources.items():
        value = flat[path].get_value()
        shape = tuple(value.shape)
        assert value.dtype == jnp.bfloat16
        total += int(np.prod(shape))
        per_key = shape[1:] if source.stacked else shape
        assert not source.stacked or shape[0] == len(source.keys) == 27
        for key in source.keys:
            stored = ref_shapes[key]
            expect = stored[::-1] if source.layout == "linear" else stored
            assert per_key == expect, (path, key, per_key, stored)
            read.add(key)
    assert total == sum(ref_sizes[k] for k in read)

    deep = {k for k in ref_shapes if (m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m.group(1)) >= 27}
    assert {int(re.match(r"model\.layers\.(\d+)\.", k).group(1)) for k in deep} == set(range(27, 36))
    ignored = set(ref_shapes) - read
    assert ignored == deep | {"model.norm.weight", "lm_head.weight"}
    assert all(plan.ignore(k) for k in ignored)
    assert not any(plan.ignore(k) for k in read)


@pytest.mark.parametrize(("dtype", "feature_layers"), [(jnp.float32, FEATURE_LAYERS), (jnp.bfloat16, (0, 3)),
                                                       (jnp.bfloat16, (5,))])
def test_features_shape_is_what_the_call_returns(dtype: object, feature_layers: tuple[int, ...]) -> None:
    # The executables' specs take the text features' shape from features_shape instead of a trace.
    config = Qwen3Config.from_dict(qwen3_config(300))
    model = nnx.eval_shape(lambda: Qwen3TextEncoder(config, feature_layers=feature_layers, dtype=dtype,
                                                    rngs=nnx.Rngs(0)))
    for batch, length in ((1, 16), (3, 40)):
        ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)
        traced = jax.eval_shape(lambda m, i, a: m(i, a), model, ids, ids)
        stated = model.features_shape(batch, length)
        assert (stated.shape, stated.dtype) == (traced.shape, traced.dtype)
