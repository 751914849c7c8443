"""A request, resolved once: `RunFields` (what a caller asks for) -> `build_plan` -> `RunPlan`.

`build_plan` is the one place a request's fields are checked and its defaults applied (the
model's steps, guidance and size from the registry and the snapshot's configs): the CLI,
`batch` and `serve` all come through it, and everything after it (the engine, the pipeline,
the executable keys) trusts the plan. Errors are `FieldError`s naming the field, never a flag.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flux2klein_cli.core import limits
from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.errors import FieldError
from flux2klein_cli.core.inputs.images import ReferenceSource, read_reference
from flux2klein_cli.core.pipeline.geometry import LatentGeometry
from flux2klein_cli.core.pipeline.step_cache import StepCache, resolve_cache


@dataclass(frozen=True)
class RunFields:
    """What one request asks for. None: the model's default."""

    prompts: tuple[str, ...]
    references: tuple[ReferenceSource, ...] = ()
    height: int | None = None
    width: int | None = None
    steps: int | None = None
    guidance: float | None = None
    negative_prompt: str = ""
    seed: int = 0
    num_images: int = 1  # images per prompt
    max_sequence_length: int = DEFAULTS.max_sequence_length
    kv: bool = False  # reference KV cache (KV-trained checkpoints only)
    latents: Path | None = None  # initial noise (.npy, diffusers' layout) instead of seeds
    # Image-to-image (init_image) and inpainting (init_image + mask), as Flux2KleinInpaintPipeline.
    init_image: ReferenceSource | None = None
    mask: ReferenceSource | None = None  # white: repaint, black: keep; the init image's size
    strength: float | None = None  # (0, 1]; None: DEFAULTS.strength with an init image
    reference_max_area: int | None = None  # references above this many pixels are scaled down (None: the default)
    # With a mask: inpaint the mask's box grown by this many pixels (and to the output's aspect),
    # resized to the output size, then pasted back into the init image (diffusers' padding_mask_crop).
    padding_mask_crop: int | None = None
    mask_alpha: bool = False  # a mask with transparency says it in alpha: transparent is repainted (serve)
    # Step caching (core/pipeline/step_cache.py): none, fbcache or dbcache; None fields: the mode's defaults.
    cache: str | None = None
    cache_threshold: float | None = None
    cache_warmup: int | None = None
    cache_max_skips: int | None = None
    cache_blocks: int | None = None
    cache_taylorseer: bool | None = None
    lora_set: str | None = None  # one of the engine's LoRA sets (EngineOptions.lora_sets); None: its base weights


@dataclass(frozen=True)
class ModelFacts:
    """What planning needs to know of a model, from its configs alone (no weights)."""

    name: str  # as the caller gave it (an alias, a repo id, a directory)
    geometry: LatentGeometry
    distilled: bool
    kv: bool
    pipeline_class: str
    transformer_config: dict[str, Any] = field(repr=False, compare=False)
    default_side: int = DEFAULTS.side

    @property
    def max_side(self) -> int:
        """The largest side in pixels its position encoding tells apart."""
        return max_side(self.transformer_config, self.geometry.pixels_per_token)

    @classmethod
    def of(cls, name: str, configs: Any) -> ModelFacts:
        """From a `compile.model_configs.ModelConfigs` (a snapshot's or the registry's)."""
        from flux2klein_cli.core.hub.registry import default_size

        return cls(name=name, geometry=configs.geometry, distilled=configs.distilled, kv=configs.kv,
                   pipeline_class="Flux2KleinKVPipeline" if configs.kv else "Flux2KleinPipeline",
                   transformer_config=configs.transformer, default_side=default_size(name))


@dataclass(frozen=True)
class RunPlan:
    """One request, fully resolved and checked: every field has its final value."""

    model: str
    prompts: tuple[str, ...]
    negative_prompt: str
    seeds: tuple[int, ...]  # one per image, prompt-major (image i of prompt p is p * num_images + i)
    num_images: int
    height: int
    width: int
    steps: int
    guidance: float
    cfg: bool  # real classifier-free guidance (undistilled models with guidance > 1)
    max_sequence_length: int
    kv: bool
    geometry: LatentGeometry
    reference_names: tuple[str, ...] = ()
    reference_sizes: tuple[tuple[int, int], ...] = ()  # (height, width) of each reference, as processed
    # (H, W, 3) float32 in [-1, 1], as the VAE takes them; not compared (arrays), names are.
    references: tuple[np.ndarray, ...] = field(default=(), compare=False, repr=False)
    latents: np.ndarray | None = field(default=None, compare=False, repr=False)
    latents_name: str | None = None
    # With an init image: it (H, W, 3) in [-1, 1] at the output size, the mask on the token grid
    # (h, w) float32, and the strength; names are compared, arrays are not.
    init_image: np.ndarray | None = field(default=None, compare=False, repr=False)
    init_image_name: str | None = None
    mask: np.ndarray | None = field(default=None, compare=False, repr=False)
    mask_name: str | None = None
    strength: float | None = None
    reference_max_area: int = DEFAULTS.reference_max_area
    # A padding mask crop: its padding, the crop box (left, top, right, bottom) in the init image,
    # and what the paste back takes: the init image (H, W, 4) RGBA uint8 and the mask (H, W) uint8.
    padding_mask_crop: int | None = None
    crop_box: tuple[int, int, int, int] | None = None
    paste_image: np.ndarray | None = field(default=None, compare=False, repr=False)
    paste_mask: np.ndarray | None = field(default=None, compare=False, repr=False)
    cache: StepCache | None = None  # step caching; None: every block every step
    lora_set: str | None = None  # the weights it runs with (Engine: the same executables for every set)

    @property
    def loop_steps(self) -> int:
        """Steps the denoise loop runs: all, or from the init image's start step (its strength) on."""
        from flux2klein_cli.core.pipeline.schedule import start_step

        return self.steps if self.strength is None else self.steps - start_step(self.steps, self.strength)

    @property
    def batch(self) -> int:
        return len(self.prompts) * self.num_images

    def shape(self, dtype: Any, steps_per_call: int | None = None) -> Any:
        """The part of the plan that decides its programs: the executables' key. The one place a
        RunShape is built (`build_shape` builds a plan without pixels for it)."""
        from flux2klein_cli.core.pipeline.programs import RunShape

        init = ((self.height, self.width),) if self.init_image is not None else ()
        return RunShape(height=self.height, width=self.width, geometry=self.geometry, batch=self.batch,
                        prompts=len(self.prompts), steps=self.loop_steps, references=init + self.reference_sizes,
                        cfg=self.cfg, max_sequence_length=self.max_sequence_length, dtype=dtype, kv=self.kv,
                        steps_per_call=steps_per_call, init=bool(init), mask=self.mask is not None,
                        cache=None if self.cache is None else self.cache.form)

    def batch_key(self) -> tuple[Any, ...]:
        """Plans with equal keys run together as one batch (Engine.run_batch): the same programs
        per image, and what the batch shares (negative prompt, guidance, references, weights)."""
        return (self.height, self.width, self.steps, self.guidance, self.cfg, self.max_sequence_length, self.kv,
                self.num_images, self.negative_prompt if self.cfg else "", self.reference_names,
                self.latents is None, self.init_image_name, self.mask_name, self.strength, self.reference_max_area,
                self.padding_mask_crop, self.cache, self.lora_set)


def merge_plans(plans: Sequence[RunPlan]) -> RunPlan:
    """Plans of one batch key as one plan: their prompts and seeds in order."""
    first = plans[0]
    if any(p.batch_key() != first.batch_key() for p in plans):
        raise ValueError("plans of different batch keys cannot run as one batch")
    if len(plans) == 1:
        return first
    from dataclasses import replace

    return replace(first, prompts=tuple(p for plan in plans for p in plan.prompts),
                   seeds=tuple(s for plan in plans for s in plan.seeds))


# ----------------------------------------------------------------------------- checks


def check_prompts(prompts: Sequence[str], negative_prompt: str) -> tuple[str, ...]:
    if not prompts:
        raise FieldError("prompt", "is missing: give the image a description")
    for text, name in [*((p, "prompt") for p in prompts), (negative_prompt, "negative_prompt")]:
        if not isinstance(text, str):
            raise FieldError(name, f"must be text, got {type(text).__name__}")
        limits.check_prompt(text, name)
    if any(not p.strip() for p in prompts):
        raise FieldError("prompt", "is empty: give the image a description")
    return tuple(prompts)


def max_side(transformer_config: dict[str, Any], pixels_per_token: int) -> int:
    """The largest side in pixels, a multiple of `pixels_per_token`, whose positions one RoPE axis
    tells apart: the wavelength of its slowest frequency, 2*pi*theta^((d-2)/d). Further apart than
    that, two tokens get the same rotation."""
    axes = [int(d) for d in transformer_config.get("axes_dims_rope", (32, 32, 32, 32))]
    dim = min(axes[1:3]) if len(axes) >= 3 else min(axes)
    theta = float(transformer_config.get("rope_theta", 2000))
    return int(2 * math.pi * theta ** ((dim - 2) / dim)) * pixels_per_token


def check_size(height: int, width: int, model: ModelFacts) -> None:
    """The size rule of a run (output and references) at this model's multiple and position range."""
    limits.check_size(height, width, model.geometry.pixels_per_token, model.max_side)


def check_paths(fields: RunFields) -> None:
    """Every file a request names fits the filesystem's name limits (before any is read)."""
    from flux2klein_cli.core.paths import check_name_length

    named = [*(("references", source) for source in fields.references), ("init_image", fields.init_image),
             ("mask", fields.mask), ("latents", fields.latents)]
    for name, source in named:
        if isinstance(source, Path):
            check_name_length(source, name)


def build_plan(fields: RunFields, model: ModelFacts) -> RunPlan:
    """Every check of a request, once, in the order that costs least; defaults applied."""
    from flux2klein_cli.core.inputs.images import preprocess_reference

    check_paths(fields)
    prompts = check_prompts(fields.prompts, fields.negative_prompt)
    if isinstance(fields.num_images, bool) or not isinstance(fields.num_images, int) or fields.num_images < 1:
        raise FieldError("num_images", f"must be a whole number of at least 1, got {fields.num_images!r}")
    batch = len(prompts) * fields.num_images
    limits.check_seed(fields.seed, batch)
    chosen = check_sampling(model, batch=batch, max_sequence_length=fields.max_sequence_length, steps=fields.steps,
                            guidance=fields.guidance, references=len(fields.references), kv=fields.kv)
    sized = fields.height is not None and fields.width is not None
    if sized:  # a size given whole fails before any image is read; else once it is known, below
        check_size(fields.height, fields.width, model)  # type: ignore[arg-type]
    conditioning = check_conditioning(fields)
    cache = check_cache(fields, model)
    max_area = check_max_area(fields.reference_max_area, model)
    multiple = model.geometry.pixels_per_token
    names, references = [], []
    for source in fields.references:
        name, image = read_reference(source)
        pixels = preprocess_reference(image, f"reference image {name}", multiple_of=multiple, max_area=max_area)
        check_size(*pixels.shape[:2], model)
        names.append(name)
        references.append(pixels)
    init = read_init_image(fields, model) if fields.init_image is not None else None
    crop = init[4] if init else None
    side = model.default_side
    first = init[1].shape[:2] if init else references[0].shape[:2] if references else (side, side)
    height = int(first[0]) if fields.height is None else fields.height
    width = int(first[1]) if fields.width is None else fields.width
    if init and (height, width) != tuple(first):
        raise FieldError("height" if height != first[0] else "width",
                         f"is set by the init image ({{field:init_image}}: {first[1]}x{first[0]}); drop it")
    if not sized:
        check_size(height, width, model)
    latents = None
    if fields.latents is not None:
        from flux2klein_cli.core.inputs.latents import load_latents

        latents = load_latents(fields.latents, model.geometry.latents_shape(batch, height, width))
    return RunPlan(
        model=model.name, prompts=prompts, negative_prompt=fields.negative_prompt,
        seeds=tuple(range(fields.seed, fields.seed + batch)), num_images=fields.num_images, height=height,
        width=width, steps=chosen.steps, guidance=float(chosen.guidance),
        cfg=chosen.cfg, max_sequence_length=fields.max_sequence_length, kv=fields.kv,
        geometry=model.geometry, reference_names=tuple(names),
        reference_sizes=tuple((int(r.shape[0]), int(r.shape[1])) for r in references), references=tuple(references),
        latents=latents,
        latents_name=None if fields.latents is None else str(fields.latents),
        init_image=None if init is None else init[1], init_image_name=None if init is None else init[0],
        mask=None if init is None else init[3], mask_name=None if init is None else init[2],
        strength=conditioning, reference_max_area=max_area, cache=cache, lora_set=fields.lora_set,
        **({} if crop is None else dict(zip(("padding_mask_crop", "crop_box", "paste_image", "paste_mask"), crop,
                                            strict=True))),
    )


def check_conditioning(fields: RunFields) -> float | None:
    """The strength of a run with an init image (None without one); what needs an init image
    or cannot take one fails here, before any image is read."""
    if fields.init_image is None:
        for name in ("mask", "strength", "padding_mask_crop"):
            if getattr(fields, name) is not None:
                raise FieldError(name, "needs an init image ({field:init_image})")
        return None
    if fields.padding_mask_crop is not None:
        if fields.mask is None:
            raise FieldError("padding_mask_crop", "needs a mask ({field:mask}): it crops to the mask's box")
        limits.check_int("padding_mask_crop", fields.padding_mask_crop, 0, limits.LIMITS.max_side, "px")
    if fields.kv:
        raise FieldError("kv", "cannot take an init image ({field:init_image}): no KV pipeline inpaints or starts "
                         "from an image; drop {field:kv} (the plain edit path takes the same references)")
    strength = DEFAULTS.strength if fields.strength is None else fields.strength
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0.0 < strength <= 1.0:
        raise FieldError("strength", f"must be a number in (0, 1], got {strength!r}")
    return float(strength)


def check_cache(fields: RunFields, model: ModelFacts) -> StepCache | None:
    """The request's step cache, its mode's defaults applied, checked against the model's blocks."""
    for name in ("cache_threshold", "cache_warmup", "cache_max_skips", "cache_blocks"):
        value = getattr(fields, name)
        want = float if name == "cache_threshold" else int
        if value is not None and (isinstance(value, bool) or not isinstance(value, (want, int))):
            raise FieldError(name, f"must be a {'number' if want is float else 'whole number'}, got {value!r}")
    if fields.cache_taylorseer is not None and not isinstance(fields.cache_taylorseer, bool):
        raise FieldError("cache_taylorseer", f"must be true or false, got {fields.cache_taylorseer!r}")
    if fields.cache is not None and not isinstance(fields.cache, str):
        raise FieldError("cache", f"must be text, got {fields.cache!r}")
    return resolve_cache(fields.cache, double_blocks=int(model.transformer_config.get("num_layers", 8)),
                         threshold=fields.cache_threshold, warmup=fields.cache_warmup,
                         max_skips=fields.cache_max_skips, blocks=fields.cache_blocks,
                         taylorseer=fields.cache_taylorseer)


def check_max_area(area: int | None, model: ModelFacts) -> int:
    """References above this many pixels are scaled down to it (diffusers' max-area rule)."""
    from flux2klein_cli.core.inputs.images import MIN_SIDE

    if area is None:
        return DEFAULTS.reference_max_area
    limits.check_int("reference_max_area", area, MIN_SIDE * MIN_SIDE, limits.LIMITS.reference_pixels)
    return int(area)


MaskCrop = tuple[int, tuple[int, int, int, int], np.ndarray, np.ndarray]  # RunPlan's padding_mask_crop .. paste_mask


def read_init_image(fields: RunFields, model: ModelFacts) -> tuple[str, np.ndarray, str | None, np.ndarray | None,
                                                                    MaskCrop | None]:
    """(name, pixels at the output size, mask name, mask on the token grid, padding mask crop) of an
    init image and its mask."""
    from flux2klein_cli.core.inputs import conditioning

    multiple = model.geometry.pixels_per_token
    name, image = read_reference(fields.init_image)  # type: ignore[arg-type]
    pixels = conditioning.preprocess_init_image(image, multiple_of=multiple)
    check_size(*pixels.shape[:2], model)
    if fields.mask is None:
        return name, pixels, None, None, None
    mask_name, mask_image = read_reference(fields.mask, keep_alpha=fields.mask_alpha)
    box = crop = None
    if fields.padding_mask_crop is not None:
        conditioning.check_mask_size(mask_image, image.size)
        conditioning.check_crop_size(image, multiple_of=multiple)
        levels = conditioning.mask_levels(mask_image, alpha=fields.mask_alpha)
        box = conditioning.crop_box(levels, image.width, image.height, fields.padding_mask_crop)
        pixels = conditioning.preprocess_init_image(image, multiple_of=multiple, box=box)
        crop = (fields.padding_mask_crop, box, np.asarray(image.convert("RGBA")), np.asarray(levels, np.uint8))
    mask = conditioning.preprocess_mask(mask_image, image.size, multiple_of=multiple, alpha=fields.mask_alpha, box=box)
    grid = conditioning.mask_to_grid(mask, model.geometry.grid(*pixels.shape[:2]))
    return name, pixels, mask_name, grid, crop


def check_sampling(model: ModelFacts, *, batch: int, max_sequence_length: int, steps: int | None,
                   guidance: float | None, references: int, kv: bool) -> Any:
    """What a plan and a shape check alike, the model's sampling defaults applied (registry.sampling:
    steps, guidance, and whether it runs classifier-free guidance)."""
    from flux2klein_cli.core.hub.registry import sampling

    limits.check_images(batch)
    limits.check_max_sequence_length(max_sequence_length)
    if steps is not None:
        limits.check_steps(steps)
    chosen = sampling(model.distilled, steps, guidance)
    limits.check_guidance(chosen.guidance)
    limits.check_reference_count(references)
    check_kv_model(model, "kv" if kv else None)
    if kv and not references:
        raise FieldError("kv", "needs at least one reference image ({field:references})")
    return chosen


def check_kv_model(model: ModelFacts, field: str | None) -> None:
    """A reference KV cache (`kv`, `kv_cache_dir`: the field asking for one; None: none asked)
    holds what only a KV-trained checkpoint computes."""
    if field is not None and not model.kv:
        raise FieldError(field, f"needs a KV-trained checkpoint (Flux2KleinKVPipeline); {model.name} is "
                         f"{model.pipeline_class}: use a KV-trained model (9b-kv)")


def build_shape(model: ModelFacts, *, dtype: Any, steps_per_call: int | None = None, **fields: Any) -> Any:
    """A run's shape without its pixels (`compile`, `bench`): `shape_plan(model, **fields)`'s shape."""
    return shape_plan(model, **fields).shape(dtype, steps_per_call)


def shape_plan(model: ModelFacts, *, height: int | None = None, width: int | None = None, steps: int | None = None,
               guidance: float | None = None, batch: int = 1, prompts: int = 1,
               references: Sequence[tuple[int, int]] = (), max_sequence_length: int = DEFAULTS.max_sequence_length,
               kv: bool = False) -> RunPlan:
    """A plan without pixels (empty prompts, no images read): the checks of `build_plan` on the
    fields a shape has, and the same defaults."""
    limits.check_int("prompts", prompts, 1, limits.LIMITS.images)
    if batch % prompts:
        raise FieldError("batch", f"{batch} is not a multiple of the {prompts} prompts")
    chosen = check_sampling(model, batch=batch, max_sequence_length=max_sequence_length, steps=steps,
                            guidance=guidance, references=len(references), kv=kv)
    side = model.default_side
    height, width = side if height is None else height, side if width is None else width
    for size in ((height, width), *references):
        check_size(*size, model)
    return RunPlan(model=model.name, prompts=("",) * prompts, negative_prompt="", seeds=tuple(range(batch)),
                   num_images=batch // prompts, height=height, width=width, steps=chosen.steps,
                   guidance=float(chosen.guidance), cfg=chosen.cfg, max_sequence_length=max_sequence_length, kv=kv,
                   geometry=model.geometry, reference_sizes=tuple(references))


def model_facts(model: str, *, transformer: str | None = None, vae: str | None = None,
                model_dir: Path | None = None) -> ModelFacts | None:
    """The facts of `--model` from its configs when they are here (a local or cached snapshot,
    `tiny`, a published alias), or from `model_dir` once resolved; None when only a download
    would tell."""
    from flux2klein_cli.core.compile.model_configs import configs_from_snapshot, model_configs
    from flux2klein_cli.core.errors import Flux2KleinError

    if model_dir is not None:
        return ModelFacts.of(model, configs_from_snapshot(model_dir))
    if vae:  # a --vae from elsewhere decides the geometry: known once resolved
        return None
    try:
        return ModelFacts.of(model, model_configs(model, transformer=transformer))
    except Flux2KleinError:
        return None  # resolving the model says what is wrong, or downloads it
