"""Inpainting in bf16 is as close to diffusers' fp32 as diffusers' own bf16 inpainting is: the same
tiny checkpoint, init image, mask and torch-drawn noise through our bf16 pipeline and diffusers'
Flux2KleinInpaintPipeline in bf16, both against that pipeline in fp32 (docs/models.md, parity)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flux2klein_cli.core.engine.plan import RunFields
from flux2klein_cli.core.runs.parity import compare, read_sources, reference_pipeline, run_parity, run_reference
from tests.fixtures.engine import engine_on, upload
from tests.test_inpaint import box_mask
from tests.test_pipeline_parity import synthetic_image

ERROR_MARGIN = 1.25  # our mean error over diffusers' bf16 mean error, both against diffusers' fp32 (measured: 0.93)
SSIM_MARGIN = 0.001  # our SSIM may be this much below diffusers' bf16 SSIM (measured: 0.0002 above)


@pytest.mark.slow
def test_bf16_inpainting_is_as_close_to_fp32_as_diffusers_own_bf16(tiny_checkpoint: Path) -> None:
    ours = engine_on(tiny_checkpoint, dtype="bf16")
    init, mask = synthetic_image(96, 64, 10), box_mask(96, 64, (24, 8, 72, 40))
    fields = RunFields(prompts=("a red ball",), steps=4, seed=3, strength=0.6, init_image=upload(init, "init.png"),
                       mask=upload(mask, "mask.png"))
    parity = run_parity(ours, fields, "fp32")  # ours in bf16 against diffusers' fp32
    references, images = read_sources(fields)
    theirs = run_reference(reference_pipeline(ours, "bf16", inpaint=True), parity.plan, parity.plan.latents,
                           references, images)
    fp32 = parity.reference.astype(np.float32)

    def error(run: np.ndarray) -> float:  # mean absolute difference from fp32, in 1/255 steps
        return float(np.abs(run.astype(np.float32) - fp32).mean())

    assert fp32.std() > 10 and error(theirs) > 0  # bf16 differs from fp32 at all: the comparison means something
    assert error(parity.ours) <= ERROR_MARGIN * error(theirs), (error(parity.ours), error(theirs))
    assert parity.metrics.ssim >= compare(theirs, parity.reference).ssim - SSIM_MARGIN, parity.metrics
