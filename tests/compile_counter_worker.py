"""Runs one request through a pipeline attached to an executable store and prints, as JSON,
the store's statuses and everything JAX compiled during the request itself (and, apart, the
pipeline's own programs among them). `--edit` makes it an edit with two references,
`--inpaint` an inpainting run (an init image, a mask, strength 0.75, one reference);
`--mesh X` runs on the mesh `generate --mesh X` would use."""

from __future__ import annotations

import json
import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np

from flux2klein_cli.core.compile.attach import StoredExecutables
from flux2klein_cli.core.compile.keys import code_fingerprint
from flux2klein_cli.core.compile.store import ExecutableStore
from flux2klein_cli.core.devices.distributed import DeviceOptions, run_mesh
from flux2klein_cli.core.pipeline.pipeline import KleinPipeline, Request

PROGRAMS = ("jit(call)", "jit(run)", "jit(draw)")  # the pipeline's programs (pipeline.py, denoise.py)


class CompileLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.compiled: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Compiling") or "XLA compilation" in message:
            self.compiled.append(message.split(" with ")[0][:120])


def main(model: str, store_dir: str, use_store: bool, edit: bool, mesh_text: str | None = None,
         inpaint: bool = False) -> None:
    mesh = run_mesh(DeviceOptions(mesh=mesh_text)) if mesh_text else None  # as generate chooses it
    pipeline = KleinPipeline.load(model, dtype=jnp.float32, mesh=mesh)
    if use_store:
        pipeline.executables = StoredExecutables(model, ExecutableStore(store_dir), mesh=mesh)
    rng = np.random.default_rng(0)
    references = ([rng.uniform(-1, 1, (h, w, 3)).astype(np.float32) for h, w in ((64, 64), (32, 48))]
                  if edit or inpaint else [])
    request = Request(prompts=["a red fox"], steps=2, guidance=1.0, height=64, width=64, seed=1,
                      references=references)
    if inpaint:
        mask = np.zeros((4, 4), np.float32)
        mask[1:3, 1:4] = 1.0
        request.init_image, request.mask, request.strength = references[0], mask, 0.75
        request.references = references[1:]
    _, report = pipeline.prepare(request)
    log = CompileLog()
    logging.getLogger("jax").addHandler(log)
    jax.config.update("jax_log_compiles", True)
    pipeline(request)
    programs = [m for m in log.compiled if any(p in m for p in PROGRAMS)]
    print(json.dumps(dict(statuses={r["name"]: r["status"] for r in report}, program_compiles=programs,
                          all_compiles=log.compiled, mesh=None if mesh is None else dict(mesh.shape),
                          devices=None if mesh is None else [int(d.id) for d in mesh.devices.flat],
                          code=code_fingerprint())))


if __name__ == "__main__":
    flags = sys.argv[3:]
    main(sys.argv[1], sys.argv[2], "--no-store" not in flags, "--edit" in flags,
         flags[flags.index("--mesh") + 1] if "--mesh" in flags else None, "--inpaint" in flags)
