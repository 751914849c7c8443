"""Per-layer error of bf16 and int8 weights on the real 4B / 9B transformer geometries (issue 21).

One double-stream block, one single-stream block and the final layer (norm_out + proj_out) of
the real width, with random weights drawn as the random checkpoint writer draws them (uniform
within +-1/sqrt(fan in), norms near 1), so it needs no download and no whole model in memory
(the 9B transformer in float32 is 36 GB; one double block is 1.7 GB). Each layer gets the same
float32 inputs in every variant (the float32 outputs of the layer before), so each error is the
layer's own:

- bf16: weights and activations in bf16, as `--dtype bf16` runs;
- int8 / fp32 act.: int8 weights (weight-only, `convert --quantize int8`'s rule of which linears)
  with float32 activations: the rounding of the weights alone;
- int8 / bf16 act.: the same int8 weights in a bf16 model, as a bf16 run of an int8 model computes;
- int8 dynamic / fp32, / bf16: those two models with FLUX2KLEIN_INT8_COMPUTE=dynamic
  (activations rounded to int8 per token, int8 x int8 dots).

Errors are ||y - y_fp32|| / ||y_fp32|| of the layer's output, and of its update (output minus
input) for the residual blocks, whose output is mostly their input: with random weights the
update is about 1% of the residual stream, far less than in a trained model, so the output's
error understates what a layer adds and the update's overstates it for bf16, whose output is
rounded to bf16 as a whole (the residual stream's rounding, not the layer's arithmetic).

    python benchmarks/quantize_error.py --model 4b --height 512 --width 512 --text-tokens 512

`--velocity PRESET` measures the whole transformer instead, on a random checkpoint of that preset
(tiny, medium) converted to float32 with and without `--quantize int8`: at each step of the
float32 run's trajectory, the velocity of each variant from the same latents and the same
(float32) text features, against float32's.

    python benchmarks/quantize_error.py --velocity medium --height 256 --width 256 --steps 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.hub import random_checkpoint as rc
from flux2klein_cli.core.models.layers import layer_norm, linear, silu
from flux2klein_cli.core.models.quantized import QuantizedLinear, quantize_abstract, quantize_weights
from flux2klein_cli.core.models.trace import TraceOptions, traced_under
from flux2klein_cli.core.models.transformer import (
    DoubleBlock,
    RefMode,
    SingleBlock,
    TransformerConfig,
    add_embedders,
    rope_tables,
)
from flux2klein_cli.core.pipeline.tokens import image_ids, text_ids

# name: (model dtype, scheme, int8 compute)
VARIANTS = {"bf16": (jnp.bfloat16, None, "weight-only"), "int8 / fp32 act.": (jnp.float32, "int8", "weight-only"),
            "int8 / bf16 act.": (jnp.bfloat16, "int8", "weight-only"),
            "int8 dynamic / fp32": (jnp.float32, "int8", "dynamic"),
            "int8 dynamic / bf16": (jnp.bfloat16, "int8", "dynamic")}


class Embedders(nnx.Module):
    """What makes the layers' inputs (float32 only), under Flux2Transformer's names."""

    def __init__(self, cfg: TransformerConfig, *, dtype: Any, rngs: nnx.Rngs):
        add_embedders(self, cfg, dtype=dtype, rngs=rngs)


class Layers(nnx.Module):
    """One block of each kind (unstacked) and the final projection, under Flux2Transformer's
    names, so `quantize_abstract` picks the same linears as for the whole model."""

    def __init__(self, cfg: TransformerConfig, *, dtype: Any, rngs: nnx.Rngs):
        self.transformer_blocks = DoubleBlock(cfg, dtype=dtype, rngs=rngs)
        self.single_transformer_blocks = SingleBlock(cfg, dtype=dtype, rngs=rngs)
        self.proj_out = linear(cfg.dim, cfg.out_channels, dtype=dtype, rngs=rngs)


def random_weights(make: Callable[[], nnx.Module], seed: int) -> dict[tuple[str, ...], np.ndarray]:
    """float32 values of every parameter of `make()`, drawn as core/hub/random_checkpoint.py draws them."""
    abstract = nnx.eval_shape(make)
    rng = np.random.default_rng(seed)
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract)):
        shape, leaf = var.get_value().shape, str(path[-1])
        low, high = {"kernel": (-(shape[0] ** -0.5), shape[0] ** -0.5), "weight": (0.9, 1.1),
                     "bias": (-0.02, 0.02)}[leaf]
        out[tuple(map(str, path))] = rng.uniform(low, high, shape).astype(np.float32)
    return out


def build(make: Callable[[Any], nnx.Module], weights: dict[tuple[str, ...], np.ndarray], dtype: Any,
          scheme: str | None, quantized: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]]) -> nnx.Module:
    """`make(dtype)` from the float32 `weights`, its block linears int8 with `scheme` (their int8
    values and scales computed once into `quantized`)."""
    model = quantize_abstract(nnx.eval_shape(lambda: make(dtype)), scheme)
    modules = {tuple(map(str, p)) for p, m in nnx.iter_modules(model) if isinstance(m, QuantizedLinear)}
    graphdef, state = nnx.split(model)
    flat = []
    for path, var in nnx.to_flat_state(state):
        key = tuple(map(str, path))
        if key[:-1] in modules:
            if key[:-1] not in quantized:
                quantized[key[:-1]] = quantize_weights(weights[(*key[:-1], "kernel")])
            value = quantized[key[:-1]][0 if key[-1] == "kernel" else 1]
        else:
            value = weights[key]
        flat.append((path, var.replace(jnp.asarray(value, var.get_value().dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@dataclass
class Inputs:
    img: np.ndarray  # (1, N, D) float32: the image stream entering the double block
    txt: np.ndarray  # (1, T, D)
    mod_img: list[np.ndarray]
    mod_txt: list[np.ndarray]
    mod_single: list[np.ndarray]
    final: list[np.ndarray]  # norm_out's scale and shift
    rope: tuple[np.ndarray, np.ndarray]


def make_inputs(cfg: TransformerConfig, model: Embedders, tokens: tuple[int, int], text: int, seed: int,
                sigma: float) -> Inputs:
    """The float32 model's embedders and modulation on Gaussian latents and text features, as
    Flux2Transformer._forward computes them (timestep `sigma`)."""
    rng = np.random.default_rng(seed + 1)
    latents = rng.standard_normal((1, tokens[0] * tokens[1], cfg.in_channels), np.float32)
    features = rng.standard_normal((1, text, cfg.joint_attention_dim), np.float32)
    t = jnp.full((1,), sigma * 1000, jnp.float32)
    temb = silu(model.time_guidance_embed(t))

    def chunks(parts: list[jax.Array]) -> list[np.ndarray]:
        return [np.asarray(c) for c in parts]

    ids = np.concatenate([text_ids(text), image_ids(*tokens)])
    final = jnp.split(model.norm_out.linear(temb)[:, None, :], 2, axis=-1)
    return Inputs(np.asarray(model.x_embedder(jnp.asarray(latents))), np.asarray(model.context_embedder(
        jnp.asarray(features))), chunks(model.double_stream_modulation_img(temb)),
        chunks(model.double_stream_modulation_txt(temb)), chunks(model.single_stream_modulation(temb)),
        chunks(final), rope_tables(ids, cfg.axes_dims_rope, cfg.rope_theta))


def layer_functions(eps: float, text: int) -> dict[str, Callable[..., Any]]:
    """Each layer as f(model, its inputs in the model dtype) -> output (float32); `text` tokens
    lead the joint sequence."""
    def double(m: Layers, img: Any, txt: Any, mod_img: Any, mod_txt: Any, rope: Any) -> jax.Array:
        img, txt, _ = m.transformer_blocks(img, txt, mod_img, mod_txt, rope, RefMode(text, 0, None))
        return jnp.concatenate([txt, img], axis=1).astype(jnp.float32)

    def single(m: Layers, x: Any, mod: Any, rope: Any) -> jax.Array:
        return m.single_transformer_blocks(x, mod, rope, RefMode(text, 0, None))[0].astype(jnp.float32)

    def final(m: Layers, x: Any, scale_shift: Any) -> jax.Array:
        scale, shift = scale_shift  # as Flux2Transformer._forward's last lines
        return m.proj_out(layer_norm(x, eps) * (1 + scale) + shift).astype(jnp.float32)

    return {"double": double, "single": single, "final": final}


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm((a - b).ravel()) / np.linalg.norm(b.ravel()))


def measure(size: str, height: int, width: int, text: int, seed: int = 0, sigma: float = 0.5) -> dict[str, Any]:
    """Relative errors per layer and variant (see the module docstring)."""
    cfg = TransformerConfig.from_dict(rc.transformer_config_json(rc.preset(size)))
    tokens = (height // 16, width // 16)
    quantized: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}
    embedders = build(lambda dt: Embedders(cfg, dtype=dt, rngs=nnx.Rngs(0)),
                      random_weights(lambda: Embedders(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), seed + 2),
                      jnp.float32, None, quantized)
    inputs = make_inputs(cfg, embedders, tokens, text, seed, sigma)
    del embedders

    def make(dtype: Any) -> Layers:
        return Layers(cfg, dtype=dtype, rngs=nnx.Rngs(0))

    weights = random_weights(lambda: make(jnp.float32), seed)
    fns = layer_functions(cfg.eps, text)

    def run(model: nnx.Module, name: str, dtype: Any, args: tuple[Any, ...], compute: str = "weight-only"
            ) -> np.ndarray:
        graphdef, state = nnx.split(model)
        options = dataclasses.replace(TraceOptions.local(), int8_compute=compute)
        fn = jax.jit(traced_under(lambda s, *a: fns[name](nnx.merge(graphdef, s), *a), options))
        rope, rest = args[-1] if name != "final" else None, args[:-1] if name != "final" else args
        cast = jax.tree.map(lambda x: jnp.asarray(x, dtype), rest)
        # RoPE tables stay float32 in every variant (apply_rope computes in float32), as in a run.
        return np.asarray(fn(state, *cast, *(() if rope is None else (tuple(map(jnp.asarray, rope)),))))

    reference = build(make, weights, jnp.float32, None, quantized)
    args: dict[str, tuple[Any, ...]] = {
        "double": (inputs.img, inputs.txt, inputs.mod_img, inputs.mod_txt, inputs.rope)}
    fp32 = {"double": run(reference, "double", jnp.float32, args["double"])}
    args["single"] = (fp32["double"], inputs.mod_single, inputs.rope)  # each layer takes float32's outputs
    fp32["single"] = run(reference, "single", jnp.float32, args["single"])
    args["final"] = (fp32["single"][:, text:], inputs.final)
    fp32["final"] = run(reference, "final", jnp.float32, args["final"])
    residual_in = {"double": np.concatenate([inputs.txt, inputs.img], axis=1), "single": fp32["double"]}
    del reference
    rows: dict[str, dict[str, float]] = {name: {} for name in fp32}
    for variant, (dtype, scheme, compute) in VARIANTS.items():
        model = build(make, weights, dtype, scheme, quantized)
        for name, expected in fp32.items():
            out = run(model, name, dtype, args[name], compute)
            rows[name][f"{variant} output"] = relative(out, expected)
            if name in residual_in:
                # Against the variant's own (rounded) input: bf16's rounding of the input is not the layer's.
                x = residual_in[name]
                own = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
                rows[name][f"{variant} update"] = relative(out - own, expected - x)
        del model
    return {"model": size, "height": height, "width": width, "image_tokens": tokens[0] * tokens[1],
            "text_tokens": text, "seed": seed, "sigma": sigma, "dim": cfg.dim, "errors": rows}


def velocity_errors(preset: str, height: int, width: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """Per step, ||v - v_fp32|| / ||v_fp32|| of each VARIANTS model on float32's trajectory."""
    import tempfile
    from pathlib import Path

    from flux2klein_cli.core.engine.engine import Engine, EngineOptions
    from flux2klein_cli.core.engine.opening import Opening
    from flux2klein_cli.core.engine.plan import RunFields, build_plan
    from flux2klein_cli.core.hub.snapshot import resolve_model
    from flux2klein_cli.core.pipeline.denoise import denoise_fn
    from flux2klein_cli.core.weights.convert import convert

    request = RunFields(prompts=("a red fox in the snow",), steps=steps, guidance=1.0, height=height, width=width,
                        seed=seed)

    def engine(directory: Path, dtype: str) -> Engine:
        """Opened as generate opens one, the request checked against what this host holds."""
        opening = Opening(EngineOptions(model=str(directory), dtype=dtype, store=False), resolve_model,
                          lambda facts: build_plan(request, facts))
        opening.admitted(print)
        return opening.load(print)

    with tempfile.TemporaryDirectory(prefix="quantize-error-") as tmp:
        root = Path(tmp)
        rc.write_random_checkpoint(root / "src", preset, seed=seed)
        dirs = {None: root / "fp32", "int8": root / "int8"}
        for scheme, out in dirs.items():
            convert(root / "src", out, dtype="fp32", quantize=scheme)
        reference = engine(dirs[None], "fp32")
        captured: dict[str, Any] = {}
        run_loop = reference.pipeline.denoise

        def capture(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            captured["inputs"] = inputs
            return run_loop(inputs, *args, **kwargs)

        reference.pipeline.denoise = capture  # the loop's inputs: text features, noise, schedule
        reference.run(reference.plan(request))
        inputs = captured["inputs"]
        sigmas = np.asarray(inputs.sigmas)

        def velocities(run_on: Engine, compute: str, trajectory: list[Any]) -> list[np.ndarray]:
            """The velocity at each step from `trajectory[i]` (float32's latents; appended to
            while it is float32's own run)."""
            options = dataclasses.replace(TraceOptions.local(), int8_compute=compute)
            graphdef, state = nnx.split(run_on.pipeline.models.transformer)
            one_step = denoise_fn(graphdef, 1, options)
            out = []
            for i in range(steps):
                after = one_step(state, dataclasses.replace(inputs, latents=trajectory[i]), np.int32(i))
                out.append(np.asarray(after - trajectory[i]) / (sigmas[i + 1] - sigmas[i]))
                if len(trajectory) == i + 1:
                    trajectory.append(after)
            return out

        trajectory = [inputs.latents]
        expected = velocities(reference, "weight-only", trajectory)
        del reference
        rows: dict[str, list[float]] = {}
        for variant, (dtype, scheme, compute) in VARIANTS.items():
            variant_engine = engine(dirs[scheme], "bf16" if dtype == jnp.bfloat16 else "fp32")
            got = velocities(variant_engine, compute, trajectory)
            rows[variant] = [relative(g, e) for g, e in zip(got, expected, strict=True)]
            del variant_engine
    return {"preset": preset, "height": height, "width": width, "steps": steps, "seed": seed, "velocity": rows}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("4b", "9b"), default="4b")
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--text-tokens", type=int, default=DEFAULTS.max_sequence_length)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sigma", type=float, default=0.5, help="the timestep (noise level) of the modulation")
    parser.add_argument("--velocity", metavar="PRESET", help="the whole transformer's velocity per step on a "
                        "random checkpoint of this preset (tiny, medium) instead")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    if args.velocity:
        print(json.dumps(velocity_errors(args.velocity, args.height, args.width, args.steps, args.seed)))
        return
    print(json.dumps(measure(args.model, args.height, args.width, args.text_tokens, args.seed, args.sigma)))


if __name__ == "__main__":
    main()
