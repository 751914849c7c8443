"""The deltas of one or more LoRAs, merged into weights as the loader reads them (the
transformer's, and the text encoder's when a file has text-encoder keys).

The loader reads one device slice of a changed key in bands of stored rows into a reused float32
scratch, asks for the delta to be added to each band in place (computed from the factors for just
that band), and casts the band once into the target. Only the factors (megabytes) and a few
band-sized buffers per thread are held, never a second model or a full-size temporary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.lora.files import LoraFile, LoraSpec, read_lora
from flux2klein_cli.core.lora.layouts import Term


@dataclass
class LoraDeltas:
    """The LoRAs' deltas for one model component: the transformer (the default) or the text encoder."""

    files: list[LoraFile]
    terms: dict[str, list[Term]] = field(default_factory=dict)  # checkpoint key -> terms, scales applied
    component: str = "transformer"

    def __post_init__(self) -> None:
        for lora in self.files:
            for key, terms in lora.converted.terms_for(self.component).items():
                self.terms.setdefault(key, []).extend(t.scaled(lora.spec.scale) for t in terms)

    @classmethod
    def read(cls, specs: Sequence[LoraSpec]) -> LoraDeltas | None:
        return cls([read_lora(spec) for spec in specs]) if specs else None

    def for_component(self, component: str) -> LoraDeltas | None:
        """The same LoRAs' deltas for another component; None when none of them changes it."""
        if not any(lora.converted.terms_for(component) for lora in self.files):
            return None
        return LoraDeltas(self.files, component=component)

    def records(self) -> list[dict[str, object]]:
        return [lora.record() for lora in self.files]

    def identity(self) -> str:
        """What distinguishes these merged weights from the plain ones (content hashes and scales)."""
        return ";".join(f"{lora.sha256}*{lora.spec.scale!r}" for lora in self.files)

    def check(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Every key a LoRA changes must be a 2-D weight of the model with the delta's shape:
        else exit 2 naming the first unmatched file modules and the layout."""
        for lora in self.files:
            missing, wrong = [], []
            for key, terms in lora.converted.terms_for(self.component).items():
                if key not in shapes or len(shapes[key]) != 2:
                    missing.append(terms[0].source)
                elif any(t.shape != shapes[key] for t in terms):
                    wrong.append(f"{terms[0].source} gives {terms[0].shape}, the model's {key} is {shapes[key]}")
            where = f"--lora {lora.spec.source} ({lora.converted.layout})"
            model = "this model's text encoder" if self.component == "text_encoder" else "this model"
            if missing:
                names = sorted(set(missing))
                more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
                raise UserInputError(f"{where}: modules that match no weight of {model}: "
                                     f"{', '.join(names[:5])}{more}")
            if wrong:
                more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
                raise UserInputError(f"{where}: wrong shapes for {model} (a LoRA for another size?): "
                                     f"{'; '.join(wrong[:3])}{more}")

    def changes(self, key: str) -> bool:
        return bool(self.terms.get(key))

    def add(self, key: str, block: np.ndarray, rows: slice, cols: slice, scratch: np.ndarray) -> None:
        """block += the summed delta of `key`'s (rows, cols) block, in torch layout (out, in),
        float32, in place; `scratch` (block's shape) holds each term's product."""
        for term in self.terms.get(key, ()):
            term.add_to(block, rows, cols, scratch)
