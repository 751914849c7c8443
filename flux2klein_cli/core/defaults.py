"""The one table of defaults: what a request and an engine take when nothing is given. The plan,
the engine and every door (the CLI's options, batch manifests, serve) read them here; a model's
own sampling defaults (steps and guidance of distilled and base models) are the registry's
(core/hub/registry.py: `sampling`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Defaults:
    max_sequence_length: int = 512  # prompt tokens, padded and truncated (diffusers' default)
    side: int = 1024  # output side with no size and no reference (the random-weight tiny models: tiny_side)
    tiny_side: int = 256  # `tiny` is for trying the tool in seconds
    strength: float = 0.8  # with an init image (diffusers' Flux2KleinInpaintPipeline)
    reference_max_area: int = 1024 * 1024  # larger references are scaled down to it (diffusers' rule)
    executable_shapes: int = 8  # run shapes whose executables an engine keeps loaded (an LRU)
    kv_memory: int = 1  # reference KV caches an engine keeps in memory (serve: 4)
    progress_calls: int = 50  # with a progress bar the denoising loop runs in about this many calls


DEFAULTS = Defaults()
