"""On CPU the stacked bf16 weights reach the programs as uint16 words (models/layers.py): the
same bytes without a copy, the same outputs, and no float32 copy of the weights in the program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flux2klein_cli.core.models.layers import as_words
from flux2klein_cli.core.models.qwen3 import Qwen3Config, Qwen3TextEncoder
from flux2klein_cli.core.pipeline.programs import jit_module_call

# Wide layers and few tokens: the weights dwarf the activations, so a widened copy of them shows.
CONFIG = Qwen3Config(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=64,
                     max_position_embeddings=64)


def encoder() -> Qwen3TextEncoder:
    return Qwen3TextEncoder(CONFIG, feature_layers=(2, 5, 8), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))


def stacked_bytes(state: nnx.State) -> int:
    return sum(leaf.nbytes for path, leaf in nnx.to_flat_state(state) if path[0] == "layers")


def test_words_are_views_of_the_stacked_bf16_weights_and_nothing_else() -> None:
    state = nnx.state(encoder())
    words = as_words(state)
    changed = 0
    for (path, before), (_, after) in zip(nnx.to_flat_state(state), nnx.to_flat_state(words), strict=True):
        before, after = before.get_value(), after.get_value()
        if path[0] == "layers":
            changed += 1
            assert after.dtype == jnp.uint16, path
            assert after.unsafe_buffer_pointer() == before.unsafe_buffer_pointer(), f"{path} was copied"
        else:
            assert after is before, path
    assert changed > 0


def test_a_program_given_words_computes_the_same_features_without_widening_the_weights() -> None:
    model = encoder()
    call = jit_module_call(model)
    ids = np.arange(8, dtype=np.int32)[None]
    mask = np.ones((1, 8), np.int32)
    state = nnx.state(model)
    plain = call(state, ids, mask)
    worded = call(as_words(state), ids, mask)
    np.testing.assert_array_equal(np.asarray(worded, np.float32), np.asarray(plain, np.float32))

    temp = call.lower(as_words(state), ids, mask).compile().memory_analysis().temp_size_in_bytes
    # A float32 copy of the stacked weights would be twice their bytes; one layer widened at a
    # time is an eighth of them here.
    assert temp < stacked_bytes(state) / 2, (temp, stacked_bytes(state))
    assert jax.default_backend() == "cpu"
