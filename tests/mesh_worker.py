"""Runs in a subprocess with 8 virtual CPU devices (XLA_FLAGS set by the caller): the same
requests on one device and on each mesh; prints one JSON line per (mesh, request).

`CKPT KV_CKPT MESH...` runs text-to-image, a 2-reference edit and a KV edit;
`--cfg BASE_CKPT MESH...` runs classifier-free guidance on an undistilled checkpoint;
`--any-batch CKPT BASE_CKPT KV_CKPT MESH...` runs batches that do not fill data x fsdp:
text-to-image of 1 and 3 images, one guided image (a pair of 2 inside the program), and a
one-image 2-reference edit and KV edit (`--any-batch-64`: the same at 64 px, where the
image tokens split over the axes the batch leaves idle);
`--cfg-diffusers BASE_CKPT MESH...` runs one guided image on each mesh beside diffusers'
Flux2KleinPipeline on the same weights and initial noise (needs torch and diffusers).
A mesh written `MESH@NAME,NAME` runs only the requests of those names on it."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np
from jax.sharding import NamedSharding

from flux2klein_cli.core.devices import sharding
from flux2klein_cli.core.devices.mesh import MeshSpec, make_mesh
from flux2klein_cli.core.engine.engine import Engine
from flux2klein_cli.core.engine.plan import RunFields
from flux2klein_cli.core.models import transformer
from tests.fixtures.engine import engine_on, upload
from tests.test_pipeline_parity import synthetic_image

REFERENCES = tuple(upload(synthetic_image(w, h, i), f"r{i}.png") for i, (w, h) in enumerate([(64, 64), (96, 64)]))


def requests(kind: str, batch: int) -> dict[str, RunFields]:
    """Small requests (1 step, 32 px, 16 text tokens): the meshes, not the sizes, are under test."""
    prompts = ("a red fox", "a lighthouse", "two cats", "a bowl of fruit")[: max(1, batch // 2)]
    common = dict(prompts=prompts, num_images=batch // len(prompts), steps=1, height=32, width=32, seed=3,
                  max_sequence_length=16)
    if kind == "kv":
        return {"kv-edit": RunFields(**common, references=REFERENCES, kv=True)}
    if kind == "cfg":  # positive and negative branches as one batch of 2B inside the program
        return {"cfg": RunFields(**dict(common, guidance=4.0), negative_prompt="blurry")}
    return {"text-to-image": RunFields(**common), "edit-2-refs": RunFields(**common, references=REFERENCES)}


def images_of(engine: Engine, fields: RunFields) -> np.ndarray:
    return engine.run(engine.plan(fields)).images


def chosen(mesh: str, named: dict[str, RunFields]) -> tuple[str, dict[str, RunFields]]:
    """`MESH@NAME,NAME`: the mesh and those of `named`; a bare mesh: all of them."""
    text, _, names = mesh.partition("@")
    return text, {n: r for n, r in named.items() if not names or n in names.split(",")}


def main(runs: list[tuple[str, str]], meshes: list[str]) -> None:
    for path, kind in runs:
        single = engine_on(path)
        expected: dict[tuple[str, int], np.ndarray] = {}
        for entry in meshes:
            spec = MeshSpec.parse(entry.partition("@")[0])
            batch = spec.data * spec.fsdp
            text, named = chosen(entry, requests(kind, batch))
            if not named:
                continue
            for name, r in named.items():
                if (name, batch) not in expected:
                    expected[name, batch] = images_of(single, r)
            engine = engine_on(path, mesh=make_mesh(spec))
            models = engine.pipeline.models
            kernel = models.transformer.transformer_blocks.attn.to_q.kernel.get_value()
            qkv = models.transformer.single_transformer_blocks.attn.to_qkv_mlp_proj.kernel.get_value()
            out_kernel = models.transformer.transformer_blocks.attn.to_out[0].kernel.get_value()
            assert isinstance(kernel.sharding, NamedSharding)
            for name, fields in named.items():
                images = images_of(engine, fields)
                diff = int(np.abs(images.astype(int) - expected[name, batch].astype(int)).max())
                print(json.dumps(dict(mesh=text, request=name, max_diff=diff, std=float(images.std()),
                                      q_spec=[str(a) for a in kernel.sharding.spec],
                                      qkv_spec=[str(a) for a in qkv.sharding.spec],
                                      out_spec=[str(a) for a in out_kernel.sharding.spec],
                                      q_shards=len({str(s.index) for s in kernel.addressable_shards}))), flush=True)


def any_batch(plain: str, base: str, kv: str, meshes: list[str], size: int = 32) -> None:
    """At 32 px (4 image tokens) no idle axis divides the tokens, so the batch is copied there;
    at 64 px (16) the auto rule splits them over the idle axes (the sequence form). Each row
    names the token axes the transformer was traced with."""
    common = dict(steps=1, height=size, width=size, seed=3, max_sequence_length=16)
    cases = {
        plain: {"text-to-image-1": RunFields(prompts=("a red fox",), **common),
                "text-to-image-3": RunFields(prompts=("a red fox", "a lighthouse", "two cats"), **common),
                "edit-2-refs-1": RunFields(prompts=("a red fox",), references=REFERENCES, **common)},
        base: {"cfg-1": RunFields(prompts=("a red fox",), negative_prompt="blurry", **dict(common, guidance=4.0))},
        kv: {"kv-edit-1": RunFields(prompts=("a red fox",), references=REFERENCES, kv=True, **common)},
    }
    for path, requests_here in cases.items():
        on_meshes = [chosen(entry, requests_here) for entry in meshes]
        wanted = {name: r for _, named in on_meshes for name, r in named.items()}
        if not wanted:
            continue
        single = engine_on(path)
        expected = {name: images_of(single, r) for name, r in wanted.items()}
        for text, named in on_meshes:
            if not named:
                continue
            engine = engine_on(path, mesh=make_mesh(MeshSpec.parse(text)))
            kernel = engine.pipeline.models.transformer.transformer_blocks.attn.to_q.kernel.get_value()
            for name, fields in named.items():
                with recorded_token_axes() as seen:
                    images = images_of(engine, fields)
                diff = int(np.abs(images.astype(int) - expected[name].astype(int)).max())
                print(json.dumps(dict(mesh=text, request=name, max_diff=diff, std=float(images.std()),
                                      images=len(images), q_spec=[str(a) for a in kernel.sharding.spec],
                                      token_axes=sorted(seen))), flush=True)


@contextlib.contextmanager
def recorded_token_axes() -> Iterator[set[str]]:
    """The token axes the transformer asks for while tracing (sharding.token_axes), as text."""
    seen: set[str] = set()

    def recording(batch: int, form: str = "auto") -> Any:
        axes = sharding.token_axes(batch, form)
        seen.add(str(axes))
        return axes

    with mock.patch.object(transformer, "token_axes", recording):
        yield seen


def cfg_against_diffusers(base: str, meshes: list[str]) -> None:
    """The base model's guided image (its CFG pair a batch of 2 inside the program) on each mesh
    against diffusers' run of the same request and noise, computed once."""
    from flux2klein_cli.core.runs.parity import compare, reference_pipeline, run_reference

    fields = RunFields(prompts=("a red fox in snow",), negative_prompt="blurry, low quality", steps=4, guidance=4.0,
                       height=64, width=64, seed=1)
    reference: np.ndarray | None = None
    for text in meshes:
        engine = engine_on(base, mesh=make_mesh(MeshSpec.parse(text)))
        plan = engine.plan(fields)
        assert plan.cfg
        if reference is None:
            reference = run_reference(reference_pipeline(engine, "fp32"), plan, engine.initial_noise(plan), [])
        metrics = compare(engine.run(plan).images, reference)
        print(json.dumps(dict(mesh=text, ssim=metrics.ssim, max_diff=metrics.max_diff,
                              std=float(reference.std()))), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--cfg-diffusers":
        cfg_against_diffusers(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] in ("--any-batch", "--any-batch-64"):
        any_batch(*sys.argv[2:5], sys.argv[5:], size=64 if sys.argv[1] == "--any-batch-64" else 32)
    elif sys.argv[1] == "--cfg":
        main([(sys.argv[2], "cfg")], sys.argv[3:])
    else:
        main([(sys.argv[1], "plain"), (sys.argv[2], "kv")], sys.argv[3:])
