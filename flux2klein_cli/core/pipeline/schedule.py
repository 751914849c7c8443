"""The flow-matching sigma schedule of FLUX.2 [klein], as diffusers' Euler scheduler computes it.

Values are computed in float32 with the same operations in the same order as the reference,
so the sigmas (and the timesteps the transformer sees) are bit-identical to diffusers'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from flux2klein_cli.core.errors import CheckpointError


def empirical_mu(image_tokens: int, steps: int) -> float:
    """The resolution- and step-dependent shift, fitted by BFL on two step counts (10 and 200)."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_tokens > 4300:
        return float(a2 * image_tokens + b2)
    m200 = a2 * image_tokens + b2
    m10 = a1 * image_tokens + b1
    a = (m200 - m10) / 190.0
    return float(a * steps + (m200 - 200.0 * a))


@dataclass(frozen=True)
class SchedulerConfig:
    num_train_timesteps: int = 1000
    use_dynamic_shifting: bool = True
    time_shift_type: str = "exponential"
    shift: float = 3.0

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SchedulerConfig:
        unsupported = [k for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                                   "invert_sigmas", "stochastic_sampling", "shift_terminal") if config.get(k)]
        if unsupported:
            raise CheckpointError(f"scheduler_config.json: unsupported option(s) {', '.join(unsupported)}")
        shift_type = str(config.get("time_shift_type", "exponential"))
        if shift_type not in ("exponential", "linear"):
            raise CheckpointError(f"scheduler_config.json: unknown time_shift_type {shift_type!r}")
        return cls(
            num_train_timesteps=int(config.get("num_train_timesteps", 1000)),
            use_dynamic_shifting=bool(config.get("use_dynamic_shifting", False)),
            time_shift_type=shift_type,
            shift=float(config.get("shift", 1.0)),
        )


@dataclass(frozen=True)
class Schedule:
    timesteps: np.ndarray  # (steps,) float32: what the transformer gets (t / 1000)
    sigmas: np.ndarray  # (steps + 1,) float32, ending in 0: the Euler step uses sigma[i+1] - sigma[i]


def make_schedule(steps: int, image_tokens: int, config: SchedulerConfig) -> Schedule:
    sigmas = np.linspace(1.0, 1.0 / steps, steps).astype(np.float32)
    if config.use_dynamic_shifting:
        mu = empirical_mu(image_tokens, steps)
        scale = math.exp(mu) if config.time_shift_type == "exponential" else mu
        sigmas = scale / (scale + (1 / sigmas - 1))
    else:
        sigmas = config.shift * sigmas / (1 + (config.shift - 1) * sigmas)
    sigmas = sigmas.astype(np.float32)
    train = np.float32(config.num_train_timesteps)
    # The scheduler stores t = sigma * 1000 and the pipeline divides by 1000 again: keep both roundings.
    timesteps = (sigmas * train) / np.float32(1000)
    return Schedule(timesteps.astype(np.float32), np.append(sigmas, np.float32(0)).astype(np.float32))


def start_step(steps: int, strength: float) -> int:
    """The first step an init image of this strength runs from (diffusers' img2img `get_timesteps`):
    strength 1 runs every step from pure noise, lower strengths skip the noisiest ones."""
    first = min(steps * strength, steps)
    return int(max(steps - first, 0))


def from_step(schedule: Schedule, start: int) -> Schedule:
    """The schedule's steps from `start` on: the loop runs len(timesteps) steps."""
    return Schedule(schedule.timesteps[start:], schedule.sigmas[start:])
