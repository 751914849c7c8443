"""Runs in a subprocess with 4 virtual CPU devices (XLA_FLAGS set by the caller): an int8 model
(`convert --quantize int8`) on one device and on each mesh. `INT8_CKPT INT8_KV_CKPT MESH...`:
text-to-image on the first, a KV edit on the second; one JSON line per (mesh, request) with the
largest pixel difference from the single-device image and every int8 scale whose sharding does
not follow its kernel's output axis."""

from __future__ import annotations

import json
import sys

import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from flux2klein_cli.core.devices.mesh import MeshSpec, make_mesh
from flux2klein_cli.core.models.quantized import QuantizedLinear
from tests.fixtures.engine import engine_on
from tests.mesh_worker import images_of, requests


def padded(spec: tuple, rank: int) -> tuple:
    return tuple(spec) + (None,) * (rank - len(spec))


def scale_mismatches(model: nnx.Module) -> tuple[int, list[str]]:
    """(quantized linears seen, those whose scale is not split as the kernel's output axis: a
    stacked kernel (L, in, out) spec (a, b, c) means a scale (L, out) spec (a, c))."""
    seen, wrong = 0, []
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, QuantizedLinear):
            continue
        seen += 1
        kernel, scale = module.kernel.get_value(), module.scale.get_value()
        k, s = kernel.sharding, scale.sharding
        assert isinstance(k, NamedSharding) and isinstance(s, NamedSharding)
        kspec, sspec = padded(k.spec, kernel.ndim), padded(s.spec, scale.ndim)
        if s.mesh != k.mesh or sspec != (*kspec[:-2], kspec[-1]):
            wrong.append(f"{'.'.join(map(str, path))}: kernel {kspec} scale {sspec}")
    return seen, wrong


def main(plain: str, kv: str, meshes: list[str]) -> None:
    for path, kind in ((plain, "plain"), (kv, "kv")):
        single = engine_on(path)
        expected: dict[tuple[str, int], np.ndarray] = {}
        for text in meshes:
            spec = MeshSpec.parse(text)
            batch = spec.data * spec.fsdp  # a batch over (data, fsdp), as tests/mesh_worker.py runs
            named = {k: r for k, r in requests(kind, batch).items() if k != "edit-2-refs"}  # plain + KV edit
            for name, r in named.items():
                if (name, batch) not in expected:
                    expected[name, batch] = images_of(single, r)
            engine = engine_on(path, mesh=make_mesh(spec))
            models = engine.pipeline.models
            seen, wrong = zip(*(scale_mismatches(m) for m in (models.transformer, models.text_encoder)), strict=True)
            scale = models.transformer.transformer_blocks.attn.to_out[0].scale.get_value()
            for name, fields in named.items():
                images = images_of(engine, fields)
                diff = int(np.abs(images.astype(int) - expected[name, batch].astype(int)).max())
                print(json.dumps(dict(mesh=text, request=name, max_diff=diff, std=float(images.std()),
                                      quantized=list(seen), wrong=sum(wrong, []),
                                      out_scale_spec=[str(a) for a in padded(scale.sharding.spec, scale.ndim)],
                                      out_scale_shards=len({str(s.index) for s in scale.addressable_shards}))),
                      flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
