"""BFL transformer names map onto diffusers' exactly as diffusers' own single-file converter does."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from flux2klein_cli.core.hub.random_checkpoint import write_random_checkpoint
from flux2klein_cli.core.weights.bfl_names import Part, diffusers_parameters, diffusers_parts, strip_prefix
from tests.fixtures.reference import lazy


def diffusers_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for path in (checkpoint / "transformer").glob("*.safetensors"):
        data = path.read_bytes()
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def bfl_names_for(keys: list[str], double: int, single: int) -> list[str]:
    """Every BFL parameter name of a transformer of this depth (klein: no biases, no guidance)."""
    names = ["img_in.weight", "txt_in.weight", "time_in.in_layer.weight", "time_in.out_layer.weight",
             "double_stream_modulation_img.lin.weight", "double_stream_modulation_txt.lin.weight",
             "single_stream_modulation.lin.weight", "final_layer.linear.weight",
             "final_layer.adaLN_modulation.1.weight"]
    for n in range(double):
        for stream in ("img", "txt"):
            names += [f"double_blocks.{n}.{stream}_attn.qkv.weight", f"double_blocks.{n}.{stream}_attn.proj.weight",
                      f"double_blocks.{n}.{stream}_mlp.0.weight", f"double_blocks.{n}.{stream}_mlp.2.weight",
                      f"double_blocks.{n}.{stream}_attn.norm.query_norm.scale",
                      f"double_blocks.{n}.{stream}_attn.norm.key_norm.scale"]
    for n in range(single):
        names += [f"single_blocks.{n}.linear1.weight", f"single_blocks.{n}.linear2.weight",
                  f"single_blocks.{n}.norm.query_norm.scale", f"single_blocks.{n}.norm.key_norm.scale"]
    return names


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny")


def depth(keys: list[str], prefix: str) -> int:
    return 1 + max(int(k.split(".")[1]) for k in keys if k.startswith(prefix))


def test_every_diffusers_parameter_comes_from_exactly_one_bfl_parameter(tiny: Path) -> None:
    shapes = diffusers_shapes(tiny)
    keys = sorted(shapes)
    bfl = bfl_names_for(keys, depth(keys, "transformer_blocks."), depth(keys, "single_transformer_blocks."))
    produced = [target for name in bfl for target, _ in diffusers_parameters("model.diffusion_model." + name)]
    assert sorted(produced) == keys


def test_fused_and_swapped_modules() -> None:
    assert diffusers_parts("double_blocks.2.txt_attn.qkv") == (
        Part("transformer_blocks.2.attn.add_q_proj", 0, 3), Part("transformer_blocks.2.attn.add_k_proj", 1, 3),
        Part("transformer_blocks.2.attn.add_v_proj", 2, 3))
    assert diffusers_parts("final_layer.adaLN_modulation.1") == (Part("norm_out.linear", swap_halves=True),)
    assert diffusers_parts("double_blocks.0.img_attn.nope") is None
    assert diffusers_parameters("diffusion_model.single_blocks.1.norm.key_norm.scale") == (
        ("single_transformer_blocks.1.attn.norm_k.weight", Part("single_transformer_blocks.1.attn.norm_k")),)
    assert diffusers_parameters("transformer_blocks.0.attn.to_q.weight") is None  # already diffusers
    assert strip_prefix("model.diffusion_model.img_in.weight") == "img_in.weight"


def test_agrees_with_diffusers_single_file_converter(tiny: Path) -> None:
    torch = lazy("torch")
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    shapes = diffusers_shapes(tiny)
    keys = sorted(shapes)
    rng = np.random.default_rng(0)
    bfl = {}
    for name in bfl_names_for(keys, depth(keys, "transformer_blocks."), depth(keys, "single_transformer_blocks.")):
        targets = diffusers_parameters(name)
        rows = sum(shapes[t][0] for t, _ in targets)
        bfl[name] = rng.standard_normal((rows, *shapes[targets[0][0]][1:])).astype(np.float32)
    theirs = convert_flux2_transformer_checkpoint_to_diffusers({k: torch.from_numpy(v.copy()) for k, v in bfl.items()})
    assert sorted(theirs) == keys
    for name, value in bfl.items():
        for target, part in diffusers_parameters(name):
            ours = np.split(value, part.of, axis=0)[part.index]
            if part.swap_halves:
                ours = np.concatenate(np.split(ours, 2, axis=0)[::-1])
            np.testing.assert_array_equal(ours, theirs[target].numpy(), err_msg=f"{name} -> {target}")
