"""Where a CPU image goes, each study in its own process (docs/benchmarks.md, "Again after the
ml_dtypes pin"):

    python benchmarks/cpu_where.py phases --model /tmp/cmp/medium      # diffusers' text / denoise / decode
    python benchmarks/cpu_where.py gemm --lib xla                      # GFLOP/s per product; also numpy, torch
    python benchmarks/cpu_where.py attention                           # query-blocked attention forms
    python benchmarks/cpu_where.py upsample                            # nearest x2 + 3x3 conv, two forms
    python benchmarks/cpu_where.py upsample-plugin                     # the same in the AVX-512 bf16 plugin
    python benchmarks/cpu_where.py first-touch                         # fresh memory, 256 MB
    python benchmarks/cpu_where.py ops --dtype bf16                    # our XLA ops' time, from a profile
    python benchmarks/cpu_where.py torch-ops                           # diffusers' ops' time, from a profile
    python benchmarks/cpu_where.py single-tail                         # the single block's SwiGLU + concat
    python benchmarks/cpu_where.py f32-plugin                          # float32 attention and decoder convolutions

Our own phases come from `flux2klein bench --json` on the same checkpoint. Each study prints one
line per figure; medians of interleaved rounds where forms are compared.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

SHAPES = ((1536, 512, 1536), (1536, 512, 3072), (1536, 3072, 3072), (16384, 1152, 128),
          (1536, 512, 4608), (1536, 2048, 512))  # the last two: the medium single block's in and out


def median_s(fn: Callable[[], Any], calls: int = 7) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def diffusers_call(model: str, size: int, steps: int, dtype: str) -> tuple[Any, Callable[[], None]]:
    """diffusers' Flux2KleinPipeline in `dtype` on every core, and one image's call of it."""
    import diffusers
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    pipe = diffusers.Flux2KleinPipeline.from_pretrained(model, dtype=torch_dtype)
    pipe.set_progress_bar_config(disable=True)

    def call() -> None:
        with torch.inference_mode():
            pipe(prompt="a red fox in snow", height=size, width=size, num_inference_steps=steps, guidance_scale=1.0,
                 generator=torch.Generator().manual_seed(0))

    return pipe, call


def phases(model: str, size: int, steps: int, calls: int, dtype: str) -> None:
    """diffusers' Flux2KleinPipeline in `dtype`, with its three phases wrapped in timers."""
    pipe, call = diffusers_call(model, size, steps, dtype)
    spent: dict[str, float] = {}

    def timed(owner: Any, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            spent[phase] = spent.get(phase, 0.0) + time.perf_counter() - start
            return out

        setattr(owner, name, wrapper)

    timed(pipe, "encode_prompt", "text")
    timed(pipe.transformer, "forward", "denoise")
    timed(pipe.vae, "decode", "decode")
    for _ in range(calls):
        spent.clear()
        call()
        print({phase: round(s, 2) for phase, s in spent.items()})


def torch_ops(model: str, size: int, steps: int, dtype: str, top: int) -> None:
    """diffusers' pipeline under torch's profiler: its ops by their summed self time over one call
    (after a first call), the counterpart of the `ops` study."""
    from torch.profiler import ProfilerActivity, profile

    _, call = diffusers_call(model, size, steps, dtype)
    call()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    print(f"one call under the profiler: {time.perf_counter() - start:.2f} s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def gemm(lib: str) -> None:
    """fp32 (M, K) x (K, N) products in one library, GFLOP/s."""
    import numpy as np

    rng = np.random.default_rng(0)
    for m, k, n in SHAPES:
        a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
        if lib == "torch":
            import torch

            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            seconds = median_s(lambda ta=ta, tb=tb: ta @ tb)
        elif lib == "xla":
            import jax

            product = jax.jit(lambda x, y: x @ y)
            ja, jb = jax.numpy.asarray(a), jax.numpy.asarray(b)
            seconds = median_s(lambda ja=ja, jb=jb, f=product: f(ja, jb).block_until_ready())
        else:
            seconds = median_s(lambda a=a, b=b: a @ b)
        print(f"{lib} {m}x{k}x{n} {2 * m * k * n / seconds / 1e9:.1f} GFLOP/s")


def _attention_form(q: Any, k: Any, v: Any, block: int, transposed_pv: bool) -> Any:
    """Query-blocked attention of scaled queries, P @ V as written or as V^T P^T."""
    import jax
    import jax.numpy as jnp

    b, s, h, d = q.shape
    block = min(block, s)
    padded = -(-s // block) * block
    qt = jnp.pad(q, ((0, 0), (0, padded - s), (0, 0), (0, 0)))
    qt = qt.transpose(0, 2, 1, 3).reshape(b, h, padded // block, block, d).transpose(2, 0, 1, 3, 4)
    kt = k.transpose(0, 2, 3, 1)
    vt = v.transpose(0, 2, 3, 1) if transposed_pv else v.transpose(0, 2, 1, 3)

    def one(q_block: Any) -> Any:
        scores = jnp.matmul(q_block, kt)
        weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
        total = jnp.sum(weights, axis=-1)
        if transposed_pv:
            return jnp.einsum("bhds,bhqs->bhdq", vt, weights) / total[:, :, None, :]
        return jnp.matmul(weights, vt) / total[..., None]

    out = jax.lax.map(one, qt)
    order = (1, 0, 4, 2, 3) if transposed_pv else (1, 0, 3, 2, 4)
    return out.transpose(*order).reshape(b, padded, h, d)[:, :s]


def attention(rounds: int) -> None:
    """The model's form (core/models/layers.py) against the other blockings, medium and 4B-like."""
    import jax
    import jax.numpy as jnp

    from flux2klein_cli.core.models.layers import _blocked_scaled

    forms = {"current": _blocked_scaled}
    for block in (256, 512, 768):
        forms[f"pvt-{block}"] = functools.partial(_attention_form, block=block, transposed_pv=True)
    # pv-512: the model's form before it went one head at a time (every head's block at once)
    forms["pv-512"] = functools.partial(_attention_form, block=512, transposed_pv=False)
    forms["pv-768"] = functools.partial(_attention_form, block=768, transposed_pv=False)
    for shape in ((1, 1536, 4, 128), (1, 4608, 8, 128)):
        key = jax.random.key(0)
        q, k, v = (jax.random.normal(jax.random.fold_in(key, i), shape) for i in range(3))
        compiled = {name: jax.jit(form) for name, form in forms.items()}
        reference = compiled["current"](q, k, v)
        times: dict[str, list[float]] = {name: [] for name in compiled}
        for name, fn in compiled.items():
            assert float(jnp.abs(fn(q, k, v) - reference).max()) < 1e-4, name
        for _ in range(rounds):
            for name, fn in compiled.items():
                start = time.perf_counter()
                fn(q, k, v).block_until_ready()
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["current"])
        for name, ts in times.items():
            print(f"{shape} {name} {statistics.median(ts) * 1e3:.1f} ms {statistics.median(ts) / base:.3f}x")


def upsample() -> None:
    """Nearest x2 then a 3x3 conv, against four 2x2 convs on the small input and an interleave."""
    import jax
    import jax.numpy as jnp

    numbers = ("NHWC", "HWIO", "NHWC")

    def conv(x: Any, w: Any, padding: str = "SAME") -> Any:
        return jax.lax.conv_general_dilated(x, w, (1, 1), padding, dimension_numbers=numbers)

    def plain(x: Any, w: Any) -> Any:
        return conv(jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2), w)

    def merged(w: Any, phase: int, axis: int) -> Any:
        taps = [jnp.take(w, i, axis=axis) for i in range(3)]
        pair = [taps[0], taps[1] + taps[2]] if phase == 0 else [taps[0] + taps[1], taps[2]]
        return jnp.stack(pair, axis=axis)

    def subpixel(x: Any, w: Any) -> Any:
        n, h, width, _ = x.shape
        padded = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
        rows = [jnp.stack([conv(padded[:, a:a + h + 1, b:b + width + 1], merged(merged(w, a, 0), b, 1), "VALID")
                           for b in (0, 1)], axis=3) for a in (0, 1)]
        return jnp.stack(rows, axis=2).reshape(n, 2 * h, 2 * width, -1)

    key = jax.random.key(0)
    for side, channels in ((64, 128), (128, 128), (256, 64)):
        x = jax.random.normal(key, (1, side, side, channels))
        w = jax.random.normal(key, (3, 3, channels, channels)) / (9 * channels) ** 0.5
        for name, form in (("plain", plain), ("subpixel", subpixel)):
            fn = jax.jit(form)
            seconds = median_s(lambda fn=fn, x=x, w=w: fn(x, w).block_until_ready())
            print(f"{side}x{side}x{channels} {name} {seconds * 1e3:.1f} ms")


def upsample_plugin(rounds: int) -> None:
    """The decoder's Upsample in bf16 with the AVX-512 bf16 plugin: one shim call (four 2x2 convolutions
    of the input) against XLA's upsample then the plugin's 3x3 convolution, interleaved, at the medium
    decoder's three upsamples and two of FLUX.2's (decoder widths 512 and 256)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from flux2klein_cli.core.models import kernels
    from flux2klein_cli.core.models.trace import TraceOptions, traced_under
    from flux2klein_cli.core.models.vae import Upsample

    if kernels.plugin_status().name != "avx512-bf16":
        raise SystemExit(f"the AVX-512 bf16 plugin does not run here: {kernels.plugin_status().reason}")
    options = TraceOptions("cpu", "blocked", kernels="avx512-bf16")
    forms = {"one call": nnx.jit(traced_under(lambda m, x: m(x), options)),
             "upsample, then conv": nnx.jit(traced_under(lambda m, x: m._upsampled_conv(x), options))}
    rng = np.random.default_rng(0)
    for side, channels in ((64, 128), (128, 128), (256, 64), (64, 512), (128, 256)):
        module = Upsample(channels, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        module.conv.kernel[...] = jnp.asarray(rng.standard_normal((3, 3, channels, channels)) / (9 * channels) ** 0.5,
                                              jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((1, side, side, channels)), jnp.bfloat16)
        times: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(rounds):  # interleaved
            for name, form in forms.items():
                times[name].append(median_s(lambda f=form, m=module, x=x: jax.block_until_ready(f(m, x)), calls=3))
        flops = 2 * 9 * channels * channels * (2 * side) ** 2  # the plain form's
        print(f"{side}x{side}x{channels} -> {2 * side}x{2 * side}: " + ", ".join(
            f"{name} {statistics.median(t) * 1e3:.1f} ms ({flops / statistics.median(t) / 1e9:.0f} GFLOP/s of the "
            f"plain form's work)" for name, t in times.items()))


def linear_plugin(rounds: int) -> None:
    """A Linear layer's bf16 product with the AVX-512 bf16 plugin's GEMM against XLA's (the dot with a
    float32 result, then the convert), interleaved, at the medium transformer's and text encoder's
    shapes and two of the 4B's. Each program runs 8 products against 8 different weights, as a model
    does, so the weights come from memory rather than from the cache of the call before."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from flux2klein_cli.core.models import avx512_bf16, kernels

    if kernels.plugin_status().name != "avx512-bf16":
        raise SystemExit(f"the AVX-512 bf16 plugin does not run here: {kernels.plugin_status().reason}")

    def xla(x: Any, w: Any) -> Any:
        return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    def plugin(x: Any, w: Any) -> Any:
        return avx512_bf16.dot_general(x, w, None, xla)

    def chained(dot: Callable[[Any, Any], Any]) -> Any:
        return jax.jit(lambda x, ws: [dot(x, w)[:1, :1] for w in ws])

    forms = {"XLA": chained(xla), "plugin": chained(plugin)}
    rng = np.random.default_rng(0)
    for m, k, n in ((1536, 512, 4608), (1536, 2048, 512), (1024, 512, 3072), (1024, 1536, 512), (1024, 512, 512),
                    (512, 512, 512), (512, 768, 2304), (1536, 3072, 9216), (1536, 12288, 3072)):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        ws = [jnp.asarray(rng.standard_normal((k, n)) / k ** 0.5, jnp.bfloat16) for _ in range(8)]
        times: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(rounds):  # interleaved
            for name, form in forms.items():
                run = functools.partial(lambda f, x, ws: jax.block_until_ready(f(x, ws)), form, x, ws)
                times[name].append(median_s(run, calls=3) / len(ws))
        flops = 2 * m * k * n
        best = {name: statistics.median(t) for name, t in times.items()}
        print(f"{m}x{k} @ {k}x{n}: " + ", ".join(f"{name} {t * 1e3:.2f} ms ({flops / t / 1e9:.0f} GFLOP/s)"
                                                 for name, t in best.items())
              + f"; plugin/XLA {best['plugin'] / best['XLA']:.2f}")


def first_touch() -> None:
    import numpy as np

    for _ in range(3):
        fresh = np.empty(64 << 20, np.float32)
        start = time.perf_counter()
        fresh.fill(1)
        print(f"first touch of 256 MB: {time.perf_counter() - start:.3f} s")
        del fresh


def ops(model: str, size: int, steps: int, dtype: str, top: int) -> None:
    """`flux2klein bench` (compiled in this process, so XLA traces each op) under jax's profiler:
    each program's ops by their summed time over the bench's three calls (the first and two reps).
    Run it where libtpu is not installed: with it, the profiler made the same image 1.7x slower."""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_enable_xprof_traceme=true".strip()
    import collections
    import glob
    import sys
    import tempfile

    import jax
    from jax.profiler import ProfileData

    from flux2klein_cli.cli.main import main as cli_main

    sys.argv = ["flux2klein", "bench", "--model", model, "--dtype", dtype, "--height", str(size), "--width",
                str(size), "--steps", str(steps), "--reps", "2", "--no-store", "--json"]
    with tempfile.TemporaryDirectory(prefix="flux2klein-ops-") as folder:
        jax.profiler.start_trace(folder)
        try:
            cli_main()
        except SystemExit as done:
            if done.code:
                raise
        finally:
            jax.profiler.stop_trace()
        profile = ProfileData.from_file(sorted(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True))[-1])
    total: collections.Counter[tuple[str, str]] = collections.Counter()
    count: collections.Counter[tuple[str, str]] = collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats or "program_id" in stats:
                    key = (str(stats.get("hlo_module", stats.get("program_id", "?"))), event.name)
                    total[key] += event.duration_ns
                    count[key] += 1
    print("ms over 3 calls, times run, program, op")
    for (program, op), ns in total.most_common(top):
        print(f"{ns / 1e6:9.1f} {count[program, op]:5d}  {program:12s} {op}")


def single_tail(rounds: int) -> None:
    """What follows the single block's fused projection in bf16, at the medium checkpoint's 512x512
    shapes: the projection rounded to bf16, SwiGLU of its MLP half, and the attention output joined
    to it for the output projection. As XLA runs the model's form (it joins in float32, then rounds),
    against the MLP half rounded on its own and a join of the bf16 bits as uint16, and, where the
    AVX-512 bf16 plugin runs, the model's form with its SwiGLU-and-join pass. Same bits."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from flux2klein_cli.core.models.layers import silu

    rng = np.random.default_rng(0)
    projection = jnp.asarray(rng.standard_normal((1536, 4608), np.float32))
    attended = jnp.asarray(rng.standard_normal((1536, 512), np.float32)).astype(jnp.bfloat16)

    def as_written(p: Any, a: Any) -> Any:
        rounded = p.astype(jnp.bfloat16)
        gate, value = jnp.split(rounded[:, 1536:], 2, -1)
        return jnp.concatenate([a, silu(gate) * value], -1), rounded[:, :1536] * 2

    def bits_joined(p: Any, a: Any) -> Any:
        gate, value = jnp.split(p[:, 1536:].astype(jnp.bfloat16), 2, -1)
        bits = [lax.bitcast_convert_type(x, jnp.uint16) for x in (a, silu(gate) * value)]
        joined = lax.bitcast_convert_type(jnp.concatenate(bits, -1), jnp.bfloat16)
        return joined, p[:, :1536].astype(jnp.bfloat16) * 2

    forms = {"as written": jax.jit(as_written), "bits joined": jax.jit(bits_joined)}
    from flux2klein_cli.core.models import kernels

    if kernels.plugin_status().name == "avx512-bf16":
        from flux2klein_cli.core.models.trace import TraceOptions, traced_under
        from flux2klein_cli.core.models.transformer import swiglu

        def plugin(p: Any, a: Any) -> Any:
            rounded = p.astype(jnp.bfloat16)
            return swiglu(rounded, start=1536, after=a), rounded[:, :1536] * 2

        options = TraceOptions("cpu", "blocked", kernels="avx512-bf16")
        forms["the plugin's pass"] = jax.jit(traced_under(plugin, options))
    results = [form(projection, attended) for form in forms.values()]
    same = all(bool(jnp.array_equal(x, y)) for other in results[1:] for x, y in zip(results[0], other, strict=True))
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(rounds):  # interleaved
        for name, form in forms.items():
            times[name].append(median_s(lambda f=form: jax.block_until_ready(f(projection, attended))))
    for name in forms:
        print(f"{name}: {statistics.median(times[name]) * 1e3:.2f} ms (same bits: {same})")


def f32_plugin(rounds: int) -> None:
    """float32 work in this host's plugin's float32 forms (avx512-bf16's, avx512-f32 or avx2-f32) against
    XLA's, interleaved, each compiled as the pipeline's programs are here: the medium transformer's
    attention (1536 tokens, 4 heads of 128), then the medium decoder's convolutions: 3x3, the fused
    GroupNorm + SiLU + 3x3 (a resnet's), the nearest 2x upsample and its convolution, the 1x1 shortcuts,
    and the 32 -> 3 output convolution (which stays XLA's). GFLOP/s count the plain form's products."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from flux2klein_cli.core.models import float32_kernels, kernels, layers
    from flux2klein_cli.core.models.trace import TraceOptions, jit_program
    from flux2klein_cli.core.models.vae import GroupNorm, Upsample, conv

    plugin = kernels.plugin_status().name
    if plugin not in ("avx512-bf16", *float32_kernels.BY_NAME):
        raise SystemExit(f"no plugin with float32 forms runs here: {kernels.plugin_status().reason}")
    plugins = (plugin, None)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 1536, 4, 128)), jnp.float32) for _ in range(3))
    # Compiled as the pipeline's programs are on this host (trace.jit_program: on more than 2 cores,
    # YNNPACK gets lone dots only), not with XLA's default fusions.
    attention = {name or "XLA": jit_program(layers.dot_product_attention, TraceOptions("cpu", "blocked", kernels=name))
                 for name in plugins}
    spent: dict[str, list[float]] = {name: [] for name in attention}
    for _ in range(rounds):
        for name, form in attention.items():
            spent[name].append(median_s(lambda f=form: jax.block_until_ready(f(q, k, v)), calls=3))
    medians = {name: statistics.median(t) for name, t in spent.items()}
    flops = 4 * 1536 * 1536 * 128 * 4
    print("attention 1536 x 4 x 128: " + ", ".join(f"{name} {t * 1e3:.2f} ms ({flops / t / 1e9:.0f} GFLOP/s)"
                                                   for name, t in medians.items())
          + f", plugin / XLA {medians[plugin] / medians['XLA']:.2f}")
    def module_program(plugin: str | None) -> Callable[[nnx.Module, Any], Any]:
        program = jit_program(lambda graphdef, state, x: nnx.merge(graphdef, state)(x),
                              TraceOptions("cpu", "blocked", kernels=plugin))
        return lambda module, x: program(*nnx.split(module), x)

    forms = {plugin or "XLA": module_program(plugin) for plugin in plugins}

    class NormConv(nnx.Module):
        def __init__(self, c_in: int, c_out: int) -> None:
            self.norm = GroupNorm(c_in, 32, dtype=jnp.float32)
            self.conv = conv(c_in, c_out, 3, dtype=jnp.float32, rngs=nnx.Rngs(0))

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.conv.after_norm_silu(self.norm, x)

    shapes = (("conv", 512, 32, 32), ("conv", 256, 64, 64), ("conv", 128, 128, 128), ("norm+conv", 512, 32, 32),
              ("norm+conv", 512, 64, 32), ("norm+conv", 256, 128, 64), ("norm+conv", 128, 128, 128),
              ("upsample", 256, 64, 64), ("upsample", 128, 128, 128), ("1x1", 512, 64, 32), ("1x1", 256, 128, 64),
              ("conv", 512, 32, 3))
    for kind, side, c_in, c_out in shapes:
        module: Any = (NormConv(c_in, c_out) if kind == "norm+conv" else Upsample(c_in, dtype=jnp.float32,
                       rngs=nnx.Rngs(0)) if kind == "upsample" else conv(c_in, c_out, 1 if kind == "1x1" else 3,
                                                                        dtype=jnp.float32, rngs=nnx.Rngs(0)))
        layer = module.conv if kind in ("norm+conv", "upsample") else module
        layer.kernel[...] = jnp.asarray(rng.standard_normal(layer.kernel[...].shape) * 0.05, jnp.float32)
        out_side = 2 * side if kind == "upsample" else side
        flops = 2 * (1 if kind == "1x1" else 9) * c_in * c_out * out_side ** 2
        x = jnp.asarray(rng.standard_normal((1, side, side, c_in)), jnp.float32)
        times: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(rounds):
            for name, form in forms.items():
                times[name].append(median_s(lambda f=form, m=module, x=x: jax.block_until_ready(f(m, x)), calls=3))
        medians = {name: statistics.median(t) for name, t in times.items()}
        print(f"{kind} {side}x{side} {c_in} -> {c_out}: " + ", ".join(
            f"{name} {t * 1e3:.2f} ms ({flops / t / 1e9:.0f} GFLOP/s)" for name, t in medians.items())
            + f", plugin / XLA {medians[plugin] / medians['XLA']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", choices=("phases", "gemm", "attention", "upsample", "upsample-plugin", "first-touch",
                                          "ops", "torch-ops", "single-tail", "linear-plugin", "f32-plugin"))
    parser.add_argument("--model", default="/tmp/cmp/medium", help="phases, ops: a diffusers checkpoint folder")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="phases, ops: the pipeline's dtype")
    parser.add_argument("--lib", choices=("xla", "numpy", "torch"), default="xla")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--top", type=int, default=25, help="ops: how many ops to list")
    args = parser.parse_args()
    if args.study == "phases":
        phases(args.model, args.size, args.steps, args.calls, args.dtype)
    elif args.study == "gemm":
        gemm(args.lib)
    elif args.study == "attention":
        attention(args.rounds)
    elif args.study == "upsample":
        upsample()
    elif args.study == "upsample-plugin":
        upsample_plugin(args.rounds)
    elif args.study == "ops":
        ops(args.model, args.size, args.steps, args.dtype, args.top)
    elif args.study == "torch-ops":
        torch_ops(args.model, args.size, args.steps, args.dtype, args.top)
    elif args.study == "single-tail":
        single_tail(args.rounds)
    elif args.study == "linear-plugin":
        linear_plugin(args.rounds)
    elif args.study == "f32-plugin":
        f32_plugin(args.rounds)
    else:
        first_touch()


if __name__ == "__main__":
    main()
