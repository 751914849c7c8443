"""CPU matmul and per-image figures beside torch and diffusers, interleaved in one process.

On a loaded host absolute times drift; the forms are timed in turn, round after round (matmuls in
one process; whole images each in its own process), so their ratios hold. Needs torch and
diffusers (the [parity] extra).

    python benchmarks/cpu.py matmul
    python benchmarks/cpu.py image /tmp/medium --dtype bf16 --size 512 --steps 4
    python benchmarks/cpu.py step /tmp/4b/transformer --size 1024
`image` times ours with the CPU's kernel plugin and float32 accumulation and with XLA's forms as
written (FLUX2KLEIN_CPU_MATMUL=xla, core/models/kernels.py).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flux2klein_cli.core import settings
from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.models import kernels, trace


def interleave(forms: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Best seconds of each form; one warm-up call each, then `rounds` rounds in turn."""
    for f in forms.values():
        f()
    best = {k: float("inf") for k in forms}
    for _ in range(rounds):
        for k, f in forms.items():
            start = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - start)
    return best


def matmul(n: int, rounds: int) -> dict[str, Any]:
    import torch

    rng = np.random.default_rng(0)
    a32 = rng.standard_normal((n, n), np.float32)
    forms: dict[str, Callable[[], Any]] = {}
    for name, dt in (("bf16", jnp.bfloat16), ("fp32", jnp.float32)):
        a = jnp.asarray(a32, dt)
        plain = jax.jit(lambda x, y: jax.lax.dot_general(x, y, (((1,), (0,)), ((), ()))))
        hooked = jax.jit(lambda x, y: trace.dot_general(x, y, (((1,), (0,)), ((), ()))))
        t = torch.from_numpy(a32).to(torch.bfloat16 if name == "bf16" else torch.float32)
        forms[f"jax xla {name}"] = lambda f=plain, a=a: f(a, a).block_until_ready()
        if name == "bf16" and kernels.plugin_status().name:
            forms[f"jax onemkl {name}"] = lambda f=hooked, a=a: f(a, a).block_until_ready()
        forms[f"torch {name}"] = lambda t=t: t @ t
    best = interleave(forms, rounds)
    return {k: round(2 * n**3 / s / 1e9) for k, s in best.items()}


FORMS = ("flux2klein", "flux2klein-xla", "diffusers", "diffusers-latents")


def one_form(form: str, model: str, dtype: str, size: int, steps: int, calls: int) -> dict[str, Any]:
    """Best seconds of `calls` calls after a first one, in this process, of one form only: torch
    and XLA in one process slow each other (idle workers of one spin on the cores the other
    needs; diffusers' fp32 call took 3-4x longer beside a loaded JAX pipeline)."""
    prompt = "a red fox in snow"
    if form.startswith("flux2klein"):
        from flux2klein_cli.core.engine.engine import EngineOptions
        from flux2klein_cli.core.engine.opening import Opening
        from flux2klein_cli.core.engine.plan import RunFields, build_plan
        from flux2klein_cli.core.hub.snapshot import resolve_model

        request = RunFields(prompts=(prompt,), steps=steps, guidance=1.0, height=size, width=size)
        opening = Opening(EngineOptions(model=model, dtype=dtype, store=False), resolve_model,
                          lambda facts: build_plan(request, facts))
        plan = opening.admitted(print)  # refused as generate refuses what this host cannot hold
        engine = opening.load(print)
        phases: dict[str, float] = {}

        def call() -> None:
            for k, v in engine.run(plan).seconds.items():
                if k != "total":
                    phases[k] = min(v, phases.get(k, v))

        best = interleave({form: call}, calls)[form]
        return {"s": best, "phases": {k: round(v, 3) for k, v in phases.items() if v}}
    import diffusers
    import torch

    torch.set_num_threads(2)
    ref = diffusers.Flux2KleinPipeline.from_pretrained(model, dtype=torch.bfloat16 if dtype == "bf16"
                                                       else torch.float32)
    ref.set_progress_bar_config(disable=True)
    kind = "latent" if form.endswith("latents") else "pil"

    def theirs() -> Any:
        return ref(prompt=prompt, height=size, width=size, num_inference_steps=steps, guidance_scale=1.0,
                   generator=torch.Generator().manual_seed(0), output_type=kind)

    return {"s": interleave({form: theirs}, calls)[form]}


STEP_FORMS = ("flux2klein", "diffusers")


def one_step(form: str, transformer_dir: str, size: int, text_tokens: int, calls: int) -> dict[str, Any]:
    """Best seconds of one bf16 transformer forward (one denoising step, batch 1) over `calls`
    calls after a first, at `size` x `size` with `text_tokens` prompt tokens, in this process."""
    from flux2klein_cli.core.pipeline.tokens import image_ids, text_ids

    grid = size // 16
    rng = np.random.default_rng(0)
    img = rng.standard_normal((1, grid * grid, 128)).astype(np.float32)
    if form == "flux2klein":
        from flax import nnx

        from flux2klein_cli.core.models.layers import as_words
        from flux2klein_cli.core.models.transformer import load_transformer
        from flux2klein_cli.core.pipeline.programs import jit_module_call

        model = load_transformer(transformer_dir, dtype=jnp.bfloat16)
        state = as_words(nnx.state(model))
        call = jit_module_call(model)
        txt = jnp.asarray(rng.standard_normal((1, text_tokens, model.config.joint_attention_dim)), jnp.bfloat16)
        rope = model.rope(text_ids(text_tokens), image_ids(grid, grid))
        x, sigma = jnp.asarray(img, jnp.bfloat16), jnp.full((1,), 0.5, jnp.float32)
        return {"s": interleave({form: lambda: call(state, x, txt, sigma, rope).block_until_ready()}, calls)[form]}
    import diffusers
    import torch

    torch.set_num_threads(2)
    ref = diffusers.Flux2Transformer2DModel.from_pretrained(transformer_dir, torch_dtype=torch.bfloat16).eval()
    joint = ref.config.joint_attention_dim
    txt_t = torch.from_numpy(rng.standard_normal((1, text_tokens, joint)).astype(np.float32)).to(torch.bfloat16)
    ids = torch.from_numpy(np.concatenate([text_ids(text_tokens), image_ids(grid, grid)]))
    x_t = torch.from_numpy(img).to(torch.bfloat16)

    def theirs() -> Any:
        with torch.inference_mode():
            return ref(hidden_states=x_t, encoder_hidden_states=txt_t, timestep=torch.full((1,), 0.5),
                       img_ids=ids[text_tokens:][None], txt_ids=ids[:text_tokens][None], return_dict=False)

    return {"s": interleave({form: theirs}, calls)[form]}


def step(transformer_dir: str, size: int, text_tokens: int, rounds: int, calls: int) -> dict[str, Any]:
    """One transformer step, ours (oneMKL path where the CPU has it) and diffusers', each form in
    its own process, the processes in turn for `rounds` rounds; the median of each one's best."""
    import statistics
    import subprocess
    import sys

    runs: dict[str, list[float]] = {f: [] for f in STEP_FORMS}
    for _ in range(rounds):
        for form in STEP_FORMS:
            cmd = [sys.executable, __file__, "one-step", form, transformer_dir,
                   "--size", str(size), "--text-tokens", str(text_tokens), "--calls", str(calls)]
            done = subprocess.run(cmd, env=settings.child_environment(), capture_output=True, text=True, check=True)
            runs[form].append(json.loads(done.stdout.strip().splitlines()[-1])["s"])
    median = {f: statistics.median(v) for f, v in runs.items()}
    return {"step_s": {f: round(v, 3) for f, v in median.items()},
            "ratio_to_diffusers": round(median["flux2klein"] / median["diffusers"], 3),
            "runs_s": {f: [round(x, 3) for x in v] for f, v in runs.items()}}


def image(model: str, dtype: str, size: int, steps: int, rounds: int, calls: int) -> dict[str, Any]:
    """Per-image seconds of each form, each in its own process, the processes in turn for
    `rounds` rounds; the median over rounds of each process's best call."""
    import statistics
    import subprocess
    import sys

    runs: dict[str, list[dict[str, Any]]] = {f: [] for f in FORMS}
    for _ in range(rounds):
        for form in FORMS:
            env = settings.child_environment()
            if form == "flux2klein-xla":
                env[settings.CPU_MATMUL] = "xla"
            cmd = [sys.executable, __file__, "one", form, model, "--dtype", dtype,
                   "--size", str(size), "--steps", str(steps), "--calls", str(calls)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[form].append(json.loads(done.stdout.strip().splitlines()[-1]))
    median = {f: statistics.median(r["s"] for r in rs) for f, rs in runs.items()}
    return {"per_image_s": {f: round(v, 3) for f, v in median.items()},
            "ratio_to_diffusers": {f: round(v / median["diffusers"], 3) for f, v in median.items()},
            "runs_s": {f: [round(r["s"], 3) for r in rs] for f, rs in runs.items()},
            "phases_s": {f: rs[-1].get("phases") for f, rs in runs.items() if f.startswith("flux2klein")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    m = sub.add_parser("matmul")
    m.add_argument("--n", type=int, default=2048)
    m.add_argument("--rounds", type=int, default=7)
    for name in ("image", "one", "step", "one-step"):
        sub_parser = sub.add_parser(name)
        if name.startswith("one"):
            sub_parser.add_argument("form", choices=FORMS if name == "one" else STEP_FORMS)
        image_run = name in ("image", "one")
        sub_parser.add_argument("model" if image_run else "transformer")
        sub_parser.add_argument("--size", type=int, default=512 if image_run else 1024)
        sub_parser.add_argument("--calls", type=int, default=3 if image_run else 2)
        if not name.startswith("one"):
            sub_parser.add_argument("--rounds", type=int, default=3 if image_run else 2)
        if image_run:
            sub_parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
            sub_parser.add_argument("--steps", type=int, default=4)
        else:
            sub_parser.add_argument("--text-tokens", type=int, default=DEFAULTS.max_sequence_length)
    args = parser.parse_args()
    status = kernels.plugin_status()
    out = {"cpu_matmul": status.name, "why": status.reason}
    if args.what == "matmul":
        out["gflops"] = matmul(args.n, args.rounds)
    elif args.what == "one":
        out.update(one_form(args.form, args.model, args.dtype, args.size, args.steps, args.calls))
    elif args.what == "one-step":
        out.update(one_step(args.form, args.transformer, args.size, args.text_tokens, args.calls))
    elif args.what == "step":
        out.update(step(args.transformer, args.size, args.text_tokens, args.rounds, args.calls))
    else:
        out.update(image(args.model, args.dtype, args.size, args.steps, args.rounds, args.calls))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
