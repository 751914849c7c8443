"""bf16 inpainting against diffusers: our bf16 and diffusers' own bf16, each against diffusers' fp32
(docs/models.md, "Image-to-image and inpainting"). Needs the [parity] extra and a checkpoint in
diffusers' layout; the tests' tiny one:

    python -c "from tests.fixtures.checkpoint import build_checkpoint as b; b(__import__('pathlib').Path('/tmp/tiny'))"
    PYTHONPATH=. python scripts/inpaint_bf16_parity.py /tmp/tiny
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from flux2klein_cli.core.engine.plan import RunFields
from flux2klein_cli.core.runs.parity import compare, read_sources, reference_pipeline, run_parity, run_reference
from tests.fixtures.engine import engine_on, upload
from tests.test_inpaint import box_mask
from tests.test_pipeline_parity import synthetic_image

CASES = {  # the cases of tests/test_inpaint.py
    "inpaint 96x64, 4 steps, strength 0.6": (
        dict(prompts=("a red ball",), steps=4, guidance=1.0, seed=3, strength=0.6),
        synthetic_image(96, 64, 10), box_mask(96, 64, (24, 8, 72, 40)), []),
    "inpaint + 1 reference, 64x64, 3 steps, strength 1.0": (
        dict(prompts=("put the cat here",), steps=3, guidance=1.0, seed=5, strength=1.0),
        synthetic_image(64, 64, 11), box_mask(64, 64, (8, 8, 40, 56)), [synthetic_image(100, 75, 12)]),
    "image-to-image 80x64, 8 steps, strength 0.5": (
        dict(prompts=("make it night",), steps=8, guidance=1.0, seed=7, strength=0.5),
        synthetic_image(80, 64, 13), None, []),
}


def main(checkpoint: Path) -> None:
    ours = engine_on(checkpoint, dtype="bf16")
    print("| case | our bf16: SSIM / PSNR / max diff / mean | diffusers bf16: SSIM / PSNR / max diff / mean |")
    for name, (fields, init, mask, references) in CASES.items():
        request = RunFields(**fields, init_image=upload(init, "init.png"),
                            mask=None if mask is None else upload(mask, "mask.png"),
                            references=tuple(upload(image) for image in references))
        parity = run_parity(ours, request, "fp32")
        pil, images = read_sources(request)
        theirs = run_reference(reference_pipeline(ours, "bf16", inpaint=True), parity.plan, parity.plan.latents,
                               pil, images)
        fp32 = parity.reference.astype(np.float32)
        cells = []
        for run, metrics in ((parity.ours, parity.metrics), (theirs, compare(theirs, parity.reference))):
            mean = float(np.abs(run.astype(np.float32) - fp32).mean())
            cells.append(f"{metrics.ssim:.5f} / {metrics.psnr:.1f} dB / {metrics.max_diff} / {mean:.3f}")
        print(f"| {name} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
