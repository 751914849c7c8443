"""Runs one plan on an engine with an executable store and prints, as JSON, the store's
statuses and everything JAX compiled during the run itself (and, apart, the pipeline's own
programs among them). `--edit` makes it an edit with two references (64x64 and 64x96),
`--inpaint` an inpainting run (a 64x64 init image, a mask, strength 0.75, one 64x96 reference);
`--mesh X` runs on the mesh `generate --mesh X` would use."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import jax
import numpy as np
from PIL import Image

from flux2klein_cli.core.compile.keys import code_fingerprint
from flux2klein_cli.core.devices.distributed import DeviceOptions, run_mesh
from flux2klein_cli.core.engine.engine import Engine, EngineOptions
from flux2klein_cli.core.engine.plan import RunFields
from tests.fixtures.engine import upload

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
    options = EngineOptions(model=model, dtype="fp32", compile_cache=Path(store_dir), store=use_store)
    engine = Engine.load(options, Path(model), mesh=mesh, warn=lambda message: print(message, file=sys.stderr))
    rng = np.random.default_rng(0)
    references = tuple(upload(Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)), f"r{i}.png")
                       for i, (h, w) in enumerate(((64, 64), (64, 96)))) if edit or inpaint else ()
    fields = RunFields(prompts=("a red fox",), steps=2, height=64, width=64, seed=1, references=references)
    if inpaint:
        mask = np.zeros((64, 64), np.uint8)
        mask[16:48, 16:64] = 255
        fields = RunFields(prompts=("a red fox",), steps=2, seed=1, references=references[1:], strength=0.75,
                           init_image=references[0], mask=upload(Image.fromarray(mask, "L"), "mask.png"))
    plan = engine.plan(fields)
    _, report = engine.executables.get(plan.shape(engine.pipeline.dtype))  # what the store did, before counting
    log = CompileLog()
    logging.getLogger("jax").addHandler(log)
    jax.config.update("jax_log_compiles", True)
    engine.run(plan)
    programs = [m for m in log.compiled if any(p in m for p in PROGRAMS)]
    print(json.dumps(dict(statuses={r["name"]: r["status"] for r in report}, program_compiles=programs,
                          all_compiles=log.compiled, mesh=None if mesh is None else dict(mesh.shape),
                          devices=None if mesh is None else [int(d.id) for d in mesh.devices.flat],
                          code=code_fingerprint())))


if __name__ == "__main__":
    flags = sys.argv[3:]
    main(sys.argv[1], sys.argv[2], "--no-store" not in flags, "--edit" in flags,
         flags[flags.index("--mesh") + 1] if "--mesh" in flags else None, "--inpaint" in flags)
