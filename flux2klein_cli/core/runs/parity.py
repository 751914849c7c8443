"""flux2klein beside diffusers' own pipeline: same checkpoint, prompt and initial noise, image metrics.

torch and diffusers are imported only here (the `parity` extra), never on the model path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flux2klein_cli.core.engine.engine import Engine, EngineOptions
from flux2klein_cli.core.engine.plan import ModelFacts, RunFields, RunPlan
from flux2klein_cli.core.errors import Flux2KleinError
from flux2klein_cli.core.extras import require_parity
from flux2klein_cli.core.pipeline.pixels import postprocess


@dataclass
class ImageMetrics:
    ssim: float  # worst image of the batch
    psnr: float  # worst image; inf when identical
    max_diff: int  # largest absolute pixel difference, in 1/255 steps


def compare(ours: np.ndarray, reference: np.ndarray) -> ImageMetrics:
    """Metrics over (B, H, W, 3) uint8 batches; the worst image decides."""
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    if ours.shape != reference.shape:
        raise Flux2KleinError(f"image shapes differ: {ours.shape} vs {reference.shape}")
    ssim, psnr = [], []
    side = min(ours.shape[1], ours.shape[2], 7)
    window = side if side % 2 else side - 1  # odd and no larger than the image
    for a, b in zip(ours, reference, strict=True):
        ssim.append(structural_similarity(a, b, channel_axis=-1, data_range=255, win_size=window))
        psnr.append(math.inf if np.array_equal(a, b) else peak_signal_noise_ratio(a, b, data_range=255))
    diff = int(np.abs(ours.astype(np.int16) - reference.astype(np.int16)).max())
    return ImageMetrics(float(min(ssim)), float(min(psnr)), diff)


def difference_image(ours: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """|ours - reference| per pixel, stretched so the largest difference is white."""
    diff = np.abs(ours.astype(np.int16) - reference.astype(np.int16)).astype(np.float32)
    peak = max(float(diff.max()), 1.0)
    return (diff * (255.0 / peak)).round().astype(np.uint8)


def bfl_transformer_file(root: Path) -> Path | None:
    """The single file behind a composed model's transformer when its keys are BFL's, else None."""
    from flux2klein_cli.core.weights.safetensors_io import SafetensorsCheckpoint

    files = sorted((root / "transformer").glob("*.safetensors"))
    if len(files) != 1:
        return None
    return files[0].resolve() if SafetensorsCheckpoint.open(files[0]).layout == "bfl" else None


def single_file_transformer(path: Path, root: Path, dtype: Any) -> Any:
    """diffusers' `Flux2Transformer2DModel.from_single_file` on a BFL file, with the composed
    model's transformer config. diffusers' converter knows BFL's unprefixed names only, so a
    ComfyUI-style `model.diffusion_model.` prefix is taken off before it sees the keys."""
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import load_file

    prefixes = ("model.diffusion_model.", "diffusion_model.")
    state = {next((key[len(p):] for p in prefixes if key.startswith(p)), key): value
             for key, value in load_file(str(path)).items()}
    return Flux2Transformer2DModel.from_single_file(state, config=str(root), subfolder="transformer",
                                                    torch_dtype=dtype, local_files_only=True)


INPAINT_PIPELINE = "Flux2KleinInpaintPipeline"  # diffusers' pipeline of image-to-image and inpainting


def reference_pipeline(engine: Engine, torch_dtype: str, inpaint: bool = False) -> Any:
    """diffusers' pipeline class named by the engine's snapshot (`inpaint`: its inpaint pipeline),
    loaded from the same files, with the same LoRAs."""
    require_parity("parity")
    import diffusers
    import torch

    snapshot, lora = engine.pipeline.snapshot, engine.pipeline.lora
    cls = getattr(diffusers, INPAINT_PIPELINE if inpaint else snapshot.pipeline_class)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[torch_dtype]
    overrides: dict[str, Any] = {}
    bfl = bfl_transformer_file(Path(snapshot.root))
    if bfl is not None:  # from_pretrained reads diffusers keys only; BFL's go through diffusers' own converter
        overrides["transformer"] = single_file_transformer(bfl, Path(snapshot.root), dtype)
    reference = cls.from_pretrained(snapshot.root, dtype=dtype, **overrides)
    if lora:  # the same files, through diffusers' own LoRA loading (PEFT)
        from flux2klein_cli.core.extras import require_extra
        from flux2klein_cli.core.runs.parity_lora import merge_text_encoder_lora, split_text_encoder

        require_extra("parity", ("peft",), "parity --lora")
        names, scales = [], []
        for i, file in enumerate(lora.files):
            if not file.converted.text_terms:
                reference.load_lora_weights(str(file.path), adapter_name=f"lora{i}")
            else:  # diffusers loads a Flux2 LoRA's transformer keys only: the text encoder's are merged here
                transformer, text = split_text_encoder(file.path)
                merge_text_encoder_lora(reference.text_encoder, text, file.spec.scale)
                if not transformer:
                    continue
                reference.load_lora_weights(transformer, adapter_name=f"lora{i}")
            names.append(f"lora{i}")
            scales.append(file.spec.scale)
        if names:
            reference.set_adapters(names, adapter_weights=scales)
    return reference


@dataclass
class InitImages:
    """An init image and its mask (None: image-to-image) as read (PIL), for diffusers' inpaint pipeline."""

    init_image: Any
    mask: Any = None


def read_sources(fields: RunFields) -> tuple[list[Any], InitImages | None]:
    """The request's references, init image and mask as read (PIL, before any preprocessing),
    as diffusers takes them: it preprocesses them itself."""
    from flux2klein_cli.core.inputs.images import read_reference

    references = [read_reference(source)[1] for source in fields.references]
    if fields.init_image is None:
        return references, None
    mask = None if fields.mask is None else read_reference(fields.mask)[1]
    return references, InitImages(read_reference(fields.init_image)[1], mask)


def torch_noise(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """The noise diffusers' pipelines draw from `torch.Generator().manual_seed(seed)` on the CPU."""
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).numpy()


def run_reference(reference: Any, plan: RunPlan, noise_nchw: np.ndarray, pil_references: list[Any],
                  init: InitImages | None = None) -> np.ndarray:
    """The diffusers pipeline on the same plan and noise; (B, H, W, 3) uint8. With `init`, its
    inpaint pipeline (an all-white mask without one): that pipeline takes `latents=` as the start,
    not as the noise it mixes with the init image, so it draws the noise itself from the plan's
    first seed, as `torch_noise` does."""
    import torch

    kwargs: dict[str, Any] = {}
    if init is not None:
        from PIL import Image

        mask = init.mask if init.mask is not None else Image.new("L", init.init_image.size, 255)
        kwargs.update(image=init.init_image, mask_image=mask, strength=plan.strength,
                      generator=torch.Generator().manual_seed(plan.seeds[0]))
        if plan.padding_mask_crop is not None:  # diffusers' output is then PIL only
            kwargs.update(padding_mask_crop=plan.padding_mask_crop, output_type="pil")
        if pil_references:
            kwargs["image_reference"] = pil_references[0] if len(pil_references) == 1 else pil_references
    elif pil_references:
        kwargs["image"] = pil_references
    if plan.cfg:
        # diffusers has no negative-prompt argument; its embeddings are the documented way in.
        negative, _ = reference.encode_prompt(
            prompt=[plan.negative_prompt] * len(plan.prompts), max_sequence_length=plan.max_sequence_length
        )
        kwargs["negative_prompt_embeds"] = negative
    if type(reference).__name__ != "Flux2KleinKVPipeline":  # distilled only: it takes no guidance argument
        kwargs["guidance_scale"] = plan.guidance
    if plan.padding_mask_crop is not None:
        # diffusers 0.42's paste back is broken: apply_overlay's "crop" resize is Flux2ImageProcessor's
        # override, a plain centre crop, so the box gets the middle of the made image at the wrong
        # scale. Compared with its intent instead: VaeImageProcessor's own resize (cover, centre crop).
        from diffusers.image_processor import VaeImageProcessor

        reference.image_processor.apply_overlay = VaeImageProcessor(vae_scale_factor=16).apply_overlay
    try:
        out = _call_reference(reference, plan, noise_nchw, init, kwargs)
    finally:
        reference.image_processor.__dict__.pop("apply_overlay", None)
    if isinstance(out, list):  # PIL images (padding_mask_crop): already rounded to uint8
        return np.stack([np.asarray(image.convert("RGB")) for image in out])
    return postprocess(out * 2 - 1)  # diffusers' [0, 1] floats back through the same rounding


def _call_reference(reference: Any, plan: RunPlan, noise_nchw: np.ndarray, init: InitImages | None,
                    kwargs: dict[str, Any]) -> Any:
    import torch

    return reference(
        prompt=list(plan.prompts),
        height=plan.height,
        width=plan.width,
        num_inference_steps=plan.steps,
        num_images_per_prompt=plan.num_images,
        **({} if init is not None else {"latents": torch.from_numpy(noise_nchw).to(reference.transformer.dtype)}),
        max_sequence_length=plan.max_sequence_length,
        **{"output_type": "np", **kwargs},
    ).images


@dataclass
class ParityRun:
    ours: np.ndarray  # (B, H, W, 3) uint8
    reference: np.ndarray
    metrics: ImageMetrics
    plan: RunPlan


def parity_fields(fields: RunFields, facts: ModelFacts) -> RunFields:
    """The request as both pipelines run it: a KV checkpoint's reference pipeline always uses the
    reference KV cache, so ours does too."""
    from dataclasses import replace

    return replace(fields, kv=facts.kv and bool(fields.references) and fields.init_image is None)


def run_parity(engine: Engine, fields: RunFields, torch_dtype: str) -> ParityRun:
    """Both pipelines on one request and the same initial noise (drawn from its seeds; with an
    init image, torch's draw: see run_reference), as `parity_fields` plans it."""
    from dataclasses import replace

    plan = engine.plan(parity_fields(fields, engine.facts))
    references, init = read_sources(fields)
    if init is not None:
        noise = torch_noise(plan.geometry.latents_shape(plan.batch, plan.height, plan.width), plan.seeds[0])
        plan = replace(plan, latents=noise)
    else:
        noise = engine.initial_noise(plan)
    ours = engine.run(plan).images
    reference = run_reference(reference_pipeline(engine, torch_dtype, inpaint=init is not None), plan, noise,
                              references, init)
    return ParityRun(ours, reference, compare(ours, reference), plan)


def parity_check(
    *,
    model: str,
    resolve: Any,
    prompt: str,
    references: list[Any],
    height: int | None,
    width: int | None,
    steps: int | None,
    guidance: float | None,
    seed: int,
    dtype: str,
    out_dir: Any,
    force: bool,
    lora: list[str] | None = None,
    init_image: Path | None = None,
    mask: Path | None = None,
    strength: float | None = None,
    padding_mask_crop: int | None = None,
    transformer: str | None = None,
    vae: str | None = None,
    warn: Any = lambda message: None,
) -> dict[str, Any]:
    """What `flux2klein parity` does: both pipelines, metrics, and the three images on disk. With
    `init_image` (and `mask`), against diffusers' inpaint pipeline. The engine opens as
    `generate` opens one (core/engine/opening.py): the request planned and the outputs checked
    before anything loads, refused if this host cannot hold it."""

    from flux2klein_cli.core.engine.opening import Opening
    from flux2klein_cli.core.engine.plan import build_plan
    from flux2klein_cli.core.runs import run_record
    from flux2klein_cli.core.runs.image_files import write_png
    from flux2klein_cli.core.runs.outputs import plan_outputs

    require_parity("parity")  # before anything is loaded or written
    fields = RunFields(prompts=(prompt,), references=tuple(Path(p) for p in references), height=height, width=width,
                       steps=steps, guidance=guidance, seed=seed, init_image=init_image, mask=mask, strength=strength,
                       padding_mask_crop=padding_mask_crop)
    out_dir = Path(out_dir)

    def plan_run(facts: ModelFacts) -> tuple[RunPlan, dict[str, Path]]:
        plan = build_plan(parity_fields(fields, facts), facts)
        out_dir.mkdir(parents=True, exist_ok=True)
        return plan, {name: plan_outputs(out_dir / f"{name}.png", 1, force=force)[0]
                      for name in ("ours", "diffusers", "diff")}

    options = EngineOptions(model=model, dtype=dtype, lora=tuple(lora or ()), store=False, transformer=transformer,
                            vae=vae)
    opening = Opening(options, resolve, plan_run)
    _, targets = opening.admitted(warn, lambda planned: planned[0])
    engine = opening.load(warn)
    run = run_parity(engine, fields, dtype)
    plan = run.plan
    meta = run_record.encode(plan, 0, options, engine.lora_records)  # `generate --from` reruns it
    for name, image in (("ours", run.ours[0]), ("diffusers", run.reference[0]),
                        ("diff", difference_image(run.ours[0], run.reference[0]))):
        write_png(targets[name], image, meta, force=force)
    psnr = run.metrics.psnr
    return dict(
        model=model, height=plan.height, width=plan.width, steps=plan.steps, guidance=plan.guidance,
        seed=seed, dtype=dtype, references=[str(p) for p in references], ssim=run.metrics.ssim,
        psnr=psnr if math.isfinite(psnr) else None, max_diff=run.metrics.max_diff,
        files={name: str(path) for name, path in targets.items()},
        lora=engine.lora_records,
        **({} if init_image is None else {"init_image": str(init_image), "mask": None if mask is None else str(mask),
                                          "strength": plan.strength, "pipeline": INPAINT_PIPELINE,
                                          "padding_mask_crop": padding_mask_crop}),
    )
