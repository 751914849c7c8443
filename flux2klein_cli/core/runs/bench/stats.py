"""What every bench phase reports of repeated timings."""

from __future__ import annotations

import numpy as np


def summarize(samples: list[float]) -> dict[str, float]:
    return {"min": float(np.min(samples)), "median": float(np.median(samples)), "n": len(samples)}
