"""Rollout accelerators: the first-block cache on the shipped shapes model (6 blocks) computes the
plain sampler's output exactly while it computes, skips by its rule, reuses the span's residual
when it skips, leaves the model as it was, and is refused where a loss re-scores rollout steps."""

import pytest
import torch

from pixelrl.core.errors import ConfigError
from pixelrl.sampling.accelerators import ACCELERATORS, first_block_cache
from pixelrl.sampling.rollout import SamplingSettings, rollout
from pixelrl.sampling.schedule import schedule_sigmas
from pixelrl.sampling.windows import Window


@pytest.fixture(scope="module")
def shapes():
    from pixelrl.trainers.checkpointing import load_for_eval

    model = load_for_eval("builtin:shapes")
    prompts = ["a red circle", "two blue squares", "a green triangle above a yellow circle", "three white stars"]
    return model, prompts, schedule_sigmas(model, 10, "scheduler", 32, 32, 0.0)


def sample(model, prompts, sigmas, **accelerator):
    settings = SamplingSettings(noise_level=0.0, guidance_scale=1.0, **accelerator)
    return rollout(model, prompts, list(range(len(prompts))), sigmas=sigmas, window=Window(0, 0), settings=settings,
                   height=32, width=32)


def head_changes(model, prompts, sigmas) -> list[float]:
    """The first block's residual change between consecutive forwards of a plain sampling call."""
    residuals = []
    hook = model.transformer.transformer_blocks[0].register_forward_hook(
        lambda module, args, kwargs, out: residuals.append(out[1] - kwargs["hidden_states"]), with_kwargs=True)
    try:
        sample(model, prompts, sigmas)
    finally:
        hook.remove()
    return [float((b - a).abs().mean() / a.abs().mean()) for a, b in zip(residuals, residuals[1:])]


def test_a_cache_that_never_skips_samples_exactly_and_the_model_is_restored(shapes):
    model, prompts, sigmas = shapes
    exact = sample(model, prompts, sigmas)
    never = sample(model, prompts, sigmas, accelerator="first_block_cache", accelerator_params={"threshold": 1e-9})
    assert torch.equal(never.final_latents, exact.final_latents)
    assert never.accelerated == {"forwards": 10, "skipped": 0}
    always = sample(model, prompts, sigmas, accelerator="first_block_cache", accelerator_params={"threshold": 1e9})
    assert always.accelerated == {"forwards": 10, "skipped": 9}  # the first computes the residuals to reuse
    assert not torch.equal(always.final_latents, exact.final_latents)
    assert all("forward" not in block.__dict__ for block in model.transformer.transformer_blocks)
    assert torch.equal(sample(model, prompts, sigmas).final_latents, exact.final_latents)


def test_the_first_skip_is_where_the_head_residual_first_changes_less_than_the_threshold(shapes):
    model, prompts, sigmas = shapes
    changes = head_changes(model, prompts, sigmas)
    # forward 0 computes (nothing cached yet); forward j >= 1 follows the plain trajectory and
    # compares with forward j - 1 until the first change at or below the threshold
    ordered = sorted(changes)
    threshold = (ordered[2] + ordered[3]) / 2  # between two measured changes, never equal to one
    first = 1 + next(i for i, c in enumerate(changes) if c <= threshold)
    with first_block_cache(model.transformer, {"threshold": threshold}) as state:
        sample(model, prompts, sigmas)  # the outer cache's blocks run inside this call's forwards
    assert state.skipped_at[0] == first


def test_a_skipped_forward_adds_the_cached_span_residual(shapes):
    """The same input twice: the second forward's head residual does not change, so it skips, and
    head(x) + (span(x) - head(x)) gives back the computed velocity."""
    model, prompts, sigmas = shapes
    text = model.encode_conditions(prompts, None)
    x = torch.randn(len(prompts), *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    sigma = torch.full((len(prompts),), 0.7)
    with torch.no_grad(), first_block_cache(model.transformer, {"threshold": 0.05}) as state:
        computed = model.predict_velocity(x, sigma, text, guidance_scale=1.0)
        model.predict_velocity(x * 0.5, sigma, text, guidance_scale=1.0)  # a second computed forward
        again = model.predict_velocity(x * 0.5, sigma, text, guidance_scale=1.0)
    with torch.no_grad():
        plain_half = model.predict_velocity(x * 0.5, sigma, text, guidance_scale=1.0)
    assert state.skipped_at == [2]
    torch.testing.assert_close(again, plain_half, rtol=1e-5, atol=1e-5)
    assert not torch.equal(computed, plain_half)


def test_lossy_accelerators_are_refused_for_losses_that_rescore_rollout_steps():
    from pixelrl.config import load_config

    assert ACCELERATORS.get("none").lossless and not ACCELERATORS.get("first_block_cache").lossless
    with pytest.raises(ConfigError, match="rollout.accelerator.*re-scores"):
        load_config("shapes_flow_grpo", ["rollout.accelerator=first_block_cache"])
    cfg = load_config("shapes_nft", ["rollout.accelerator=first_block_cache", "rollout.accelerator_params={threshold: 0.2}"])
    assert cfg.rollout.accelerator == "first_block_cache"
    with pytest.raises(ConfigError, match="rollout.accelerator_params"):
        load_config("shapes_nft", ["rollout.accelerator_params={threshold: 0.2}"])
