"""The Qwen3 text encoder of FLUX.2 [klein], as a feature extractor in Flax NNX.

FLUX.2 klein does not use Qwen3 as a language model: it runs the chat-templated prompt
through the decoder and concatenates the hidden states after layers 9, 18 and 27 on the
channel axis. So only the first 27 decoder layers are built (of 36 in Qwen3-4B / 8B);
the final norm and the LM head are never needed and their weights are never read.

Numerics follow transformers' `Qwen3ForCausalLM` with its default (SDPA) attention,
position for position, padding included, since the FLUX transformer attends to the
padded text tokens too:
  * position ids are 0..L-1 whatever the padding;
  * the mask is causal AND the key is not padding; a query whose row allows no key at
    all (only possible with left padding) gets a zero attention output, as torch's SDPA
    gives it;
  * RMSNorm statistics in float32; RoPE angles in float32, cos/sin cast to the model dtype;
  * SiLU in float32; attention scores and softmax in float32, the weights rounded to the
    model dtype before P @ V (jax.nn.dot_product_attention's form; on AMX CPUs the kernel
    plugin's, core/models/cpu_matmul.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.devices.sharding import model_rule
from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.models import trace
from flux2klein_cli.core.models.layers import ZEROS, RMSNorm, abstract_module, linear, run_blocks, silu, stack_blocks
from flux2klein_cli.core.weights.configs import pick, read_config
from flux2klein_cli.core.weights.loader import Deltas, KeyPlan, load_module, plan_from_names

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# hidden_states indices as transformers numbers them: 0 is the embedding output, k the output of layer k.
FEATURE_LAYERS: tuple[int, ...] = (9, 18, 27)

_DEFAULT_ROPE_THETA = 10_000.0  # transformers' default when a config names none


@dataclass(frozen=True)
class Qwen3Config:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "text_encoder config") -> Qwen3Config:
        """From a transformers config.json (4.x or 5.x layout); unsupported variants are errors."""
        hidden = int(pick(d, "hidden_size", where=where))
        heads = int(pick(d, "num_attention_heads", where=where))
        head_dim = d.get("head_dim") or hidden // heads
        if d.get("attention_bias"):
            raise CheckpointError(f"{where}: attention_bias=true is not supported (Qwen3 has no biases)")
        if d.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{where}: hidden_act {d['hidden_act']!r} is not supported (expected silu)")
        if d.get("use_sliding_window"):
            raise CheckpointError(f"{where}: sliding-window attention is not supported")
        odd = sorted({t for t in d.get("layer_types") or () if t != "full_attention"})
        if odd:
            raise CheckpointError(f"{where}: layer types {odd} are not supported (only full_attention)")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(pick(d, "intermediate_size", where=where)),
            num_hidden_layers=int(pick(d, "num_hidden_layers", where=where)),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(d, where),
            vocab_size=int(pick(d, "vocab_size", where=where)),
            max_position_embeddings=int(d.get("max_position_embeddings") or 32768),
        )


def _rope_theta(d: dict[str, Any], where: str) -> float:
    # transformers 5 writes {"rope_parameters": {"rope_type", "rope_theta"}}; 4.x writes a top-level
    # rope_theta and "rope_scaling": null (or a dict for scaled variants, which we do not support).
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"{where}: RoPE type {rope_type!r} is not supported (only default)")
    theta = params.get("rope_theta", d.get("rope_theta"))
    return float(theta if theta is not None else _DEFAULT_ROPE_THETA)


class Qwen3Attention(nnx.Module):
    def __init__(self, config: Qwen3Config, *, dtype: Any, rngs: nnx.Rngs):
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = linear(c.hidden_size, c.num_attention_heads * c.head_dim, dtype=dtype, rngs=rngs)
        self.k_proj = linear(c.hidden_size, c.num_key_value_heads * c.head_dim, dtype=dtype, rngs=rngs)
        self.v_proj = linear(c.hidden_size, c.num_key_value_heads * c.head_dim, dtype=dtype, rngs=rngs)
        self.o_proj = linear(c.num_attention_heads * c.head_dim, c.hidden_size, dtype=dtype, rngs=rngs)
        # Qwen3's per-head norms: one weight of head_dim, shared by all heads.
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, n, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(b, n, self.kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(b, n, self.kv_heads, self.head_dim)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        out = _attention(q, k, v, mask, self.head_dim**-0.5)
        return self.o_proj(out.reshape(b, n, self.heads * self.head_dim))


class Qwen3MLP(nnx.Module):
    def __init__(self, config: Qwen3Config, *, dtype: Any, rngs: nnx.Rngs):
        c = config
        self.gate_proj = linear(c.hidden_size, c.intermediate_size, dtype=dtype, rngs=rngs)
        self.up_proj = linear(c.hidden_size, c.intermediate_size, dtype=dtype, rngs=rngs)
        self.down_proj = linear(c.intermediate_size, c.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = self.gate_proj(x)
        # SiLU in float32 and one rounding, as torch's fused bf16 kernel computes it.
        return self.down_proj(silu(gate) * self.up_proj(x))


class Qwen3DecoderLayer(nnx.Module):
    def __init__(self, config: Qwen3Config, *, dtype: Any, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = Qwen3Attention(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = Qwen3MLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        # 1. Pre-norm self-attention, residual.
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        # 2. Pre-norm MLP, residual.
        return x + self.mlp(self.post_attention_layernorm(x))


def _rope_tables(length: int, head_dim: int, theta: float, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """cos and sin of shape (L, head_dim), both halves repeating the same frequencies (rotate-half RoPE).

    Positions are 0..L-1 whatever the prompt, so the tables are computed here, in float32 numpy,
    and enter the program as constants: libtpu does not compile cos and sin fusions for them."""
    inv_freq = np.float32(1.0) / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                                         / np.float32(head_dim)))
    angles = np.arange(length, dtype=np.float32)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return jnp.asarray(np.cos(angles), dtype), jnp.asarray(np.sin(angles), dtype)


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: (B, L, heads, head_dim); rotate-half convention (first half pairs with second half)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Grouped-query attention. q: (B, L, H, D); k, v: (B, L, Hkv, D); mask: (B, Lq, Lk) bool.
    Query head h uses KV head h // (H / Hkv), as transformers' repeat_kv does.

    XLA's fused attention, not an einsum-and-softmax spelled out (docs/benchmarks.md). A query row
    with no allowed key (only with left padding) gets a zero output, as torch's SDPA gives it."""
    def xla(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale)

    kernels = trace.plugin()
    if kernels is not None and kernels.masked_attention_eligible(q, k, v, mask):
        out = kernels.masked_attention(q, k, v, mask, scale, xla)  # AMX CPUs: the kernel plugin
    else:
        out = xla(q, k, v, mask)
    return jnp.where(jnp.any(mask, axis=-1)[:, :, None, None], out, 0).astype(v.dtype)


class Qwen3TextEncoder(nnx.Module):
    """Embedding + the first max(feature_layers) decoder layers; returns the stacked features."""

    def __init__(
        self,
        config: Qwen3Config,
        *,
        feature_layers: Sequence[int] = FEATURE_LAYERS,
        dtype: Any = jnp.bfloat16,
        rngs: nnx.Rngs,
    ):
        feature_layers = tuple(int(i) for i in feature_layers)
        if not feature_layers or len(set(feature_layers)) != len(feature_layers):
            raise ValueError(f"feature_layers must be distinct and non-empty, got {feature_layers}")
        if min(feature_layers) < 0 or max(feature_layers) > config.num_hidden_layers:
            raise ValueError(
                f"feature_layers {feature_layers} out of range: hidden_states has indices 0..{config.num_hidden_layers}"
            )
        if max(feature_layers) < 1:
            raise ValueError("at least one feature layer must come after a decoder layer")
        self.config = config
        self.feature_layers = feature_layers
        self.dtype = dtype
        self.num_layers = max(feature_layers)  # layers past the deepest feature are never run
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype, embedding_init=ZEROS, rngs=rngs
        )
        self.layers = stack_blocks(lambda r: Qwen3DecoderLayer(config, dtype=dtype, rngs=r), self.num_layers, rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, *, scan: bool = True) -> jax.Array:
        """input_ids, attention_mask: (B, L). Returns (B, L, len(feature_layers) * hidden), each
        token's channels [h_a | h_b | ...] in the order of feature_layers, as the diffusers pipeline
        stacks and reshapes them."""
        b, n = input_ids.shape
        if n > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {n} tokens exceeds max_position_embeddings")
        count = len(self.feature_layers)
        dt = trace.current().activation_dtype(self.dtype)
        # 1. Token embeddings.
        h = self.embed_tokens(input_ids.astype(jnp.int32)).astype(dt)

        # 2. The causal mask over real (not padding) keys, and the RoPE tables.
        valid = attention_mask.astype(jnp.bool_)
        causal = jnp.tril(jnp.ones((n, n), jnp.bool_))
        mask = causal[None, :, :] & valid[:, None, :]  # keys must be real tokens; queries are all kept
        cos, sin = _rope_tables(n, self.config.head_dim, self.config.rope_theta, self.dtype)
        cos, sin = cos.astype(dt), sin.astype(dt)  # rounded as the reference rounds them, then widened

        # 3. A slot for each feature layer's output. The features live in the scan carry: one slot
        #    per feature layer plus a scratch slot that other layers write to, so each step is one
        #    in-place slice update instead of emitting every layer's output and picking three.
        slots = np.full((self.num_layers,), count, np.int32)
        for slot, index in enumerate(self.feature_layers):
            if index > 0:
                slots[index - 1] = slot  # hidden_states[k] is the output of decoder layer k - 1
        feats = jnp.zeros((count + 1, b, n, self.config.hidden_size), dt)
        if 0 in self.feature_layers:
            feats = feats.at[self.feature_layers.index(0)].set(h)
        slot_of = jnp.asarray(slots)

        def step(
            layer: Qwen3DecoderLayer, carry: tuple[jax.Array, jax.Array, jax.Array]
        ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], None]:
            x, f, i = carry
            x = layer(x, cos, sin, mask)
            f = jax.lax.dynamic_update_index_in_dim(f, x, slot_of[i], axis=0)
            return (x, f, i + 1), None

        # 4. The decoder layers, in one scan.
        (_, feats, _), _ = run_blocks(self.layers, (h, feats, jnp.int32(0)), step, scan=scan)
        # 5. The features side by side per token: (K, B, L, H) -> (B, L, K, H) -> (B, L, K*H), in the
        #    model dtype whatever the activations' (the program's output does not depend on the CPU).
        out = jnp.transpose(feats[:count], (1, 2, 0, 3)).reshape(b, n, count * self.config.hidden_size)
        return out.astype(self.dtype)

    def features_shape(self, batch: int, length: int) -> jax.ShapeDtypeStruct:
        """What `__call__` returns for (batch, length) ids, without tracing the model (the executables'
        specs ask it in every process: a trace of the whole encoder was 0.17 s of a cold start)."""
        return jax.ShapeDtypeStruct((batch, length, len(self.feature_layers) * self.config.hidden_size), self.dtype)


def qwen3_key_plan(model: Qwen3TextEncoder) -> KeyPlan:
    """Where each parameter comes from in a transformers Qwen3ForCausalLM checkpoint: the tree
    mirrors its `model.` module. The layers past the deepest feature layer, the final norm and
    the LM head (absent when tied) are known keys that are skipped without being read; any other
    extra key is still an error."""
    built, total = model.num_layers, model.config.num_hidden_layers
    sources = plan_from_names(nnx.state(model), {"layers": built}, prefix="model.")
    per_layer = [source.keys[0].removeprefix("model.layers.0.") for source in sources.values() if source.stacked]
    skipped = frozenset(
        {f"model.layers.{i}.{name}" for i in range(built, total) for name in per_layer}
        | {"model.norm.weight", "lm_head.weight"}
    )
    return KeyPlan(sources, ignore=skipped.__contains__)


def load_qwen3(
    directory: str | Path,
    *,
    dtype: Any = jnp.bfloat16,
    mesh: Mesh | None = None,
    feature_layers: Sequence[int] = FEATURE_LAYERS,
    deltas: Deltas | None = None,
) -> Qwen3TextEncoder:
    """Load a text_encoder/ folder (config.json + safetensors) straight into `dtype`, with `deltas`
    (text-encoder LoRA) merged on the way."""
    config = Qwen3Config.from_dict(read_config(directory), where=f"{directory}/config.json")
    return load_module(
        abstract_text_encoder(config, dtype=dtype, feature_layers=feature_layers),
        qwen3_key_plan,
        directory,
        mesh,
        sharding_rule=model_rule(mesh),
        deltas=deltas,
    )


def abstract_text_encoder(config: Qwen3Config, *, dtype: Any = jnp.bfloat16,
                          feature_layers: Sequence[int] = FEATURE_LAYERS) -> Qwen3TextEncoder:
    """Shapes and dtypes only, built once per config, dtype and feature layers in a process
    (layers.abstract_module)."""
    layers = tuple(int(i) for i in feature_layers)
    return abstract_module(lambda: Qwen3TextEncoder(config, feature_layers=layers, dtype=dtype, rngs=nnx.Rngs(0)),
                           ("text_encoder", config, jnp.dtype(dtype).name, layers))


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: str | Sequence[str], max_length: int = DEFAULTS.max_sequence_length
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask, (B, max_length) int32 each, made as the klein pipeline makes
    them: one user message through the chat template with a generation prompt and thinking
    disabled (an empty think block), then each prompt on its own padded to max_length and
    truncated, on the tokenizer's padding side (right for Qwen3)."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    ids, masks = [], []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        enc = tokenizer(text, padding="max_length", truncation=True, max_length=max_length, return_tensors="np")
        ids.append(enc["input_ids"])
        masks.append(enc["attention_mask"])
    return np.concatenate(ids).astype(np.int32), np.concatenate(masks).astype(np.int32)
