"""The sigma schedule against diffusers' FlowMatchEulerDiscreteScheduler and compute_empirical_mu,
set up as Flux2KleinPipeline sets them up (linspace sigmas, the empirical mu, timesteps / 1000)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from flux2klein_cli.core.hub.random_checkpoint import SCHEDULER_CONFIG
from flux2klein_cli.core.hub.registry import MODELS, sampling
from flux2klein_cli.core.pipeline.schedule import SchedulerConfig, empirical_mu, make_schedule
from tests.fixtures.reference import lazy

torch = lazy("torch")
diffusers = lazy("diffusers")
klein = lazy("diffusers.pipelines.flux2.pipeline_flux2_klein")  # where compute_empirical_mu lives

# Image tokens: 256x256, 1024x1024, the last token count of the fitted branch, the first past it
# (2048x1024 is 8192 tokens, where mu no longer depends on the steps), and a tall odd size.
TOKENS = [256, 4096, 4300, 4301, 8192, 62 * 33]
STEPS = [1, 4, 28, 50]


def diffusers_schedule(steps: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(timesteps the transformer gets, sigmas) exactly as Flux2KleinPipeline.__call__ makes them."""
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER_CONFIG)
    sigmas = np.linspace(1.0, 1 / steps, steps)
    mu = klein.compute_empirical_mu(image_seq_len=tokens, num_steps=steps)
    scheduler.set_timesteps(steps, device="cpu", sigmas=sigmas, mu=mu)
    timesteps = scheduler.timesteps.to(torch.float32) / 1000  # the pipeline's `timestep / 1000`, fp32 latents
    return timesteps.numpy(), scheduler.sigmas.numpy()


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("steps", STEPS)
def test_empirical_mu_is_diffusers(tokens: int, steps: int) -> None:
    assert empirical_mu(tokens, steps) == klein.compute_empirical_mu(tokens, steps)


def test_past_4300_tokens_mu_ignores_the_steps() -> None:
    # The branch itself, so a test of it cannot pass by both sides taking the fitted line.
    assert empirical_mu(4301, 4) == empirical_mu(4301, 50) != empirical_mu(4300, 4)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("steps", STEPS)
def test_schedule_is_diffusers_to_the_bit(tokens: int, steps: int) -> None:
    ours = make_schedule(steps, tokens, SchedulerConfig.from_dict(SCHEDULER_CONFIG))
    timesteps, sigmas = diffusers_schedule(steps, tokens)
    assert ours.sigmas.dtype == sigmas.dtype == np.float32 and sigmas[-1] == 0
    np.testing.assert_array_equal(ours.sigmas, sigmas)
    np.testing.assert_array_equal(ours.timesteps, timesteps)


def test_default_steps_and_guidance_are_the_pipelines() -> None:
    """Base (undistilled) models sample as Flux2KleinPipeline does by default: 50 steps, guidance 4."""
    defaults = inspect.signature(diffusers.Flux2KleinPipeline.__call__).parameters
    base = sampling(distilled=False)
    assert any(not spec.distilled for spec in MODELS.values())
    assert base.steps == defaults["num_inference_steps"].default == 50
    assert base.guidance == defaults["guidance_scale"].default == 4.0 and base.cfg
