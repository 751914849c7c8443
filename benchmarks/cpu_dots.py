"""XLA:CPU's dots and convolutions in each bf16 form and under each XLA flag set, beside torch's.

Every (flag set, form) pair runs in its own process per round (XLA reads XLA_FLAGS once, at start),
the processes in turn, round after round; each figure is the median over rounds of a process's best
of three calls after a warm-up, in GFLOP/s. torch (threads = the process's CPU count) runs in its own
process too. Shapes are the medium checkpoint's at 512x512 (docs/benchmarks.md) and one 4B Linear.

    python benchmarks/cpu_dots.py                  # every flag set, 5 rounds
    python benchmarks/cpu_dots.py --rounds 3 --flags default,onednn
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

# Candidate XLA flag sets (jax 0.10.2's XLA:CPU; `--xla_cpu_experimental_ynn_fusion_type=` turns
# YNNPACK's dot fusions off, which the other libraries' fusions need to see the dots).
FLAG_SETS = {
    "default": "",
    "onednn": "--xla_cpu_use_onednn=true",
    "no-ynn": "--xla_cpu_experimental_ynn_fusion_type=",
    "no-ynn+onednn": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_onednn=true",
    "no-ynn+onednn-fusion": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_experimental_onednn_fusion_type=dot",
    "no-ynn+xnn-fusion": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_experimental_xnn_fusion_type=dot",
    "xnn-graph": "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
}
# (M, K, N): the medium transformer's 1536 tokens (1024 image + 512 text) by its width 512, its MLP,
# and a 4B Linear (width 3072) at 512x512.
DOTS = ((1536, 512, 1536), (1536, 512, 3072), (1536, 3072, 3072))
# (side, channels): the medium VAE decoder's 3x3 convolutions at 512x512 out.
CONVS = ((512, 32), (256, 64), (128, 128))


def best(fn: Callable[[], Any], calls: int = 3) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def jax_forms() -> dict[str, float]:
    """GFLOP/s of each JAX form in this process (XLA_FLAGS as the parent set them)."""
    import jax
    import jax.numpy as jnp

    f32, bf16 = jnp.float32, jnp.bfloat16
    key = jax.random.key(0)
    dn = ("NHWC", "HWIO", "NHWC")

    def conv(x: Any, w: Any, result: Any = None) -> Any:
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn, preferred_element_type=result)

    # The bf16 forms of core/models/trace.py: as written (bf16 result), f32-result, f32-operands.
    forms: dict[str, Callable[..., Any]] = {
        "f32": lambda op, a, b: op(a, b),
        "bf16 native": lambda op, a, b: op(a.astype(bf16), b.astype(bf16)),
        "bf16 f32-result": lambda op, a, b: op(a.astype(bf16), b.astype(bf16), f32).astype(bf16),
        "bf16 f32-operands": lambda op, a, b: op(a.astype(bf16).astype(f32), b.astype(bf16).astype(f32)).astype(bf16),
    }

    def dot(a: Any, b: Any, result: Any = None) -> Any:
        return jnp.matmul(a, b, preferred_element_type=result)

    out = {}
    for m, k, n in DOTS:
        a, b = jax.random.normal(key, (m, k)), jax.random.normal(key, (k, n)) / k ** 0.5
        for name, form in forms.items():
            # The casts of the inputs are outside the timed program: operands arrive in their dtype.
            a_in, b_in = (a, b) if name == "f32" else (a.astype(bf16), b.astype(bf16))
            fn = jax.jit(lambda a, b, form=form: form(dot, a, b))
            seconds = best(lambda fn=fn, a=a_in, b=b_in: fn(a, b).block_until_ready())
            out[f"dot {m}x{k}x{n} {name}"] = 2 * m * k * n / seconds / 1e9
    for side, c in CONVS:
        x, w = jax.random.normal(key, (1, side, side, c)), jax.random.normal(key, (3, 3, c, c)) / (9 * c) ** 0.5
        for name, form in forms.items():
            x_in, w_in = (x, w) if name == "f32" else (x.astype(bf16), w.astype(bf16))
            fn = jax.jit(lambda x, w, form=form: form(conv, x, w))
            flops = 2 * side * side * 9 * c * c
            seconds = best(lambda fn=fn, x=x_in, w=w_in: fn(x, w).block_until_ready())
            out[f"conv {side}x{side}x{c} {name}"] = flops / seconds / 1e9
    return out


def torch_forms() -> dict[str, float]:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    out = {}
    with torch.inference_mode():
        for m, k, n in DOTS:
            for name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
                a, b = torch.randn(m, k).to(dt), (torch.randn(k, n) / k ** 0.5).to(dt)
                out[f"dot {m}x{k}x{n} {name}"] = 2 * m * k * n / best(lambda a=a, b=b: a @ b) / 1e9
        for side, c in CONVS:
            for name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
                x, w = torch.randn(1, c, side, side).to(dt), (torch.randn(c, c, 3, 3) / (9 * c) ** 0.5).to(dt)
                flops = 2 * side * side * 9 * c * c
                fn = torch.nn.functional.conv2d
                out[f"conv {side}x{side}x{c} {name}"] = flops / best(lambda fn=fn, x=x, w=w: fn(x, w, padding=1)) / 1e9
    return out


def child(what: str) -> None:
    print(json.dumps(torch_forms() if what == "torch" else jax_forms()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--flags", default=",".join(FLAG_SETS), help="flag sets to run, by name")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    runs = [name for name in args.flags.split(",") if name]
    unknown = set(runs) - set(FLAG_SETS)
    if unknown:
        parser.error(f"unknown flag sets {sorted(unknown)}; known: {', '.join(FLAG_SETS)}")
    if not args.no_torch:
        runs.append("torch")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name in runs:
            env = dict(os.environ)
            if name != "torch":
                env["XLA_FLAGS"] = " ".join(filter(None, (env.get("XLA_FLAGS", ""), FLAG_SETS[name])))
            done = subprocess.run([sys.executable, __file__, "--child", "torch" if name == "torch" else "jax"],
                                  env=env, capture_output=True, text=True, check=True)
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps({"round": len(results[name]), "flags": name, **results[name][-1]}), file=sys.stderr)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"cpu: {cpu}, {os.cpu_count()} CPUs; GFLOP/s, median of {args.rounds} rounds (each a process's best of 3)")
    for name, rs in results.items():
        medians = {form: round(statistics.median(r[form] for r in rs), 1) for form in rs[0]}
        print(json.dumps({"flags": name, **medians}))


if __name__ == "__main__":
    main()
