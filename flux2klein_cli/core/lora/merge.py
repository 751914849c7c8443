"""The deltas of one or more LoRAs, merged into weights as the loader reads them.

The loader asks for the delta of one device slice of one checkpoint key, in JAX layout; it is
computed from the factors for just that slice (float32), added to the stored values in float32,
and cast once to the target dtype. Only the factors (megabytes) are held, never a second model.
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
    files: list[LoraFile]
    terms: dict[str, list[Term]] = field(default_factory=dict)  # checkpoint key -> terms, scales applied

    def __post_init__(self) -> None:
        for lora in self.files:
            for key, terms in lora.converted.terms.items():
                self.terms.setdefault(key, []).extend(t.scaled(lora.spec.scale) for t in terms)

    @classmethod
    def read(cls, specs: Sequence[LoraSpec]) -> LoraDeltas | None:
        return cls([read_lora(spec) for spec in specs]) if specs else None

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
            for key, terms in lora.converted.terms.items():
                if key not in shapes or len(shapes[key]) != 2:
                    missing.append(terms[0].source)
                elif any(t.shape != shapes[key] for t in terms):
                    wrong.append(f"{terms[0].source} gives {terms[0].shape}, the model's {key} is {shapes[key]}")
            where = f"--lora {lora.spec.source} ({lora.converted.layout})"
            if missing:
                names = sorted(set(missing))
                more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
                raise UserInputError(f"{where}: modules that match no weight of this model: "
                                     f"{', '.join(names[:5])}{more}")
            if wrong:
                more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
                raise UserInputError(f"{where}: wrong shapes for this model (a LoRA for another size?): "
                                     f"{'; '.join(wrong[:3])}{more}")

    def delta(self, key: str, linear: bool, index: tuple[slice, ...], shape: tuple[int, ...]) -> np.ndarray | None:
        """The summed float32 delta of the `index` slice of `key`, in JAX layout ((in, out) for a
        linear kernel, whose torch weight is (out, in)); None when no LoRA changes `key`."""
        terms = self.terms.get(key)
        if not terms:
            return None
        index = tuple(index) + (slice(None),) * (2 - len(index))
        if linear:  # JAX (in, out) = torch (out, in).T
            cols, rows = (slice(*s.indices(n)) for s, n in zip(index, shape, strict=True))
        else:
            rows, cols = (slice(*s.indices(n)) for s, n in zip(index, shape, strict=True))
        total = terms[0].block(rows, cols)
        for term in terms[1:]:
            total = total + term.block(rows, cols)
        return total.T if linear else total
