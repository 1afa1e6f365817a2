"""The rollout loop: denoise from per-sample noise, stochastic only inside the window.

Only the window is stored: latents x_start .. x_end (W + 1), the W log-probs, the W sigma
pairs and, when a loss needs them, the W step means. Everything a trainer needs to re-score a
transition later is in `SamplingSettings` plus those tensors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from pixelrl.core.seeding import sample_generators
from pixelrl.models.base import DiffusionModel, PromptEmbeds
from pixelrl.sampling.accelerators import ACCELERATORS
from pixelrl.sampling.multistep import DPMSolverPP2M
from pixelrl.sampling.sa_solver import SASolver, awm_tau, sa_solver_grid
from pixelrl.sampling.sde import StepOutput, sde_rule, sde_step
from pixelrl.sampling.windows import Window


@dataclass(frozen=True)
class SamplingSettings:
    noise_level: float = 0.7
    sde_type: str = "sde"
    guidance_scale: float = 4.5
    logprob_reduction: str = "mean"
    # euler: SDE steps in the window, Euler (the SDE step's ODE limit) elsewhere. dpm2: DPM-Solver++
    # 2M, deterministic. sa_solver: SA-Solver (AWM's), stochastic with noise_level as its tau. The
    # multistep solvers keep no transitions: they sample for the forward-process losses.
    solver: str = "euler"
    # a rollout accelerator (sampling/accelerators.py) and its params; validation samples without
    accelerator: str = "none"
    accelerator_params: dict = field(default_factory=dict)

    @property
    def stores_transitions(self) -> bool:
        return stores_transitions(self.noise_level, self.solver, self.sde_type)

    def as_dict(self) -> dict:
        return asdict(self)


def randn_tensor(shape: tuple, **kwargs) -> torch.Tensor:
    """diffusers' noise, row i from generator i as its pipelines draw it; imported on the first
    draw, since importing diffusers pulls in torch._dynamo, about a second of every command's start."""
    from diffusers.utils.torch_utils import randn_tensor as drawn_like_diffusers

    return drawn_like_diffusers(shape, **kwargs)


def stores_transitions(noise_level: float, solver: str, sde_type: str = "sde") -> bool:
    """Whether sampling stores the window's transitions for a loss to re-score: the Euler sampler
    with noise does (SDE steps), and with `sde_type: ode` (its deterministic steps, for a loss that
    compares step means only: on-policy distillation from ODE rollouts); otherwise the window is empty."""
    return solver == "euler" and (noise_level > 0 or sde_rule(sde_type).deterministic)


@dataclass
class RolloutOutput:
    images: torch.Tensor  # uint8 [B, H, W, 3]
    latents: torch.Tensor  # [B, W + 1, *latent]: x at window steps start .. end
    log_probs: torch.Tensor  # [B, W]
    sigmas: torch.Tensor  # [B, W]
    sigmas_next: torch.Tensor  # [B, W]
    means: torch.Tensor | None  # [B, W, *latent] when requested
    final_latents: torch.Tensor  # [B, *latent], the clean sample before decoding
    # the accelerator's counters over this call: denoiser forwards and how many it cut short
    accelerated: dict = field(default_factory=dict)


def step_with_log_prob(
    model: DiffusionModel,
    text: PromptEmbeds,
    negative: PromptEmbeds | None,
    x: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    settings: SamplingSettings,
    *,
    sigma_max_next: float,
    x_next: torch.Tensor | None = None,
    generators: list[torch.Generator] | None = None,
    noise_level: float | None = None,
) -> StepOutput:
    """Velocity forward plus one `sde_step`: samples x_next, or re-scores the given one.

    Rollout and training both call this, so a stored transition is re-scored with exactly
    the computation that produced it.
    """
    v = model.predict_velocity(
        x, sigma, text, guidance_scale=settings.guidance_scale, negative=negative
    )
    return sde_step(
        x, v, sigma, sigma_next,
        noise_level=settings.noise_level if noise_level is None else noise_level,
        sde_type=settings.sde_type,
        prev_sample=x_next,
        generator=generators,
        sigma_max_next=sigma_max_next,
        logprob_reduction=settings.logprob_reduction,
    )


@torch.no_grad()
def rollout(
    model: DiffusionModel,
    prompts: list[str],
    seeds: list[int],
    *,
    sigmas: torch.Tensor,
    window: Window,
    settings: SamplingSettings,
    height: int,
    width: int,
    negative_prompt: str = "",
    store_means: bool = False,
    noise_seeds: list[int] | None = None,
    condition_images: list | None = None,
) -> RolloutOutput:
    """Sample one image per (prompt, seed). Sample i's initial noise and SDE noise come from a
    generator seeded with seeds[i], so its image does not depend on its batch neighbours (a lossy
    accelerator that decides once per forward, `first_block_cache`, breaks this).
    With `noise_seeds` the initial noise comes from noise_seeds[i] instead (DanceGRPO shares one
    initial noise within a group; the SDE noise still differs per sample). A noise seed must not
    equal its sample's seed: the SDE noise would then replay the initial noise. An edit family
    takes row i's `condition_images[i]` (a tuple of uint8 [H, W, 3] tensors) in both guidance
    branches."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    if noise_seeds is not None and any(int(a) == int(b) for a, b in zip(noise_seeds, seeds)):
        raise ValueError("noise_seeds must differ from the sample seeds (derive them with "
                         "pixelrl.core.seeding.derive_seed), or the SDE noise repeats the initial noise")
    device = model.device
    num_steps = sigmas.shape[0] - 1
    if window.end > num_steps - 1:
        raise ValueError(f"window {window} reaches the final step of a {num_steps}-step schedule")
    batch = len(prompts)
    text = model.encode_conditions(prompts, condition_images)
    negative = model.negative_embeds(negative_prompt, batch, settings.guidance_scale, condition_images)
    generators = sample_generators(seeds, device=device)
    init_generators = generators if noise_seeds is None else sample_generators(noise_seeds, device=device)
    x = randn_tensor((batch, *model.latent_shape(height, width)), generator=init_generators, device=device,
                     dtype=torch.float32)

    if window.size and not settings.stores_transitions:
        raise ValueError(f"the {settings.solver} solver keeps no transitions: use an empty window")
    accelerator = ACCELERATORS.get(settings.accelerator)
    with accelerator.apply(model.transformer, settings.accelerator_params) as applied:
        out = _sample(model, text, negative, x, sigmas, window, settings, generators, store_means)
    out.accelerated = dict(applied.counts)
    return out


def _sample(model: DiffusionModel, text: PromptEmbeds, negative: PromptEmbeds | None, x: torch.Tensor,
            sigmas: torch.Tensor, window: Window, settings: SamplingSettings, generators: list,
            store_means: bool) -> RolloutOutput:
    """The denoising loop from the initial noise `x`: the solver's steps, the window's SDE steps
    stored."""
    device, batch, num_steps = x.device, x.shape[0], sigmas.shape[0] - 1
    sigma_max_next = float(sigmas[1])
    if settings.solver == "sa_solver":
        x = _sa_solver_sample(model, text, negative, x, sigmas, settings, generators)
        return _output(model, x, sigmas, window)
    multistep = DPMSolverPP2M() if settings.solver == "dpm2" else None

    latents, log_probs, means = [], [], []
    for i in range(num_steps):
        sigma = sigmas[i].to(device).expand(batch)
        sigma_next = sigmas[i + 1].to(device).expand(batch)
        if multistep is not None:
            v = model.predict_velocity(x, sigma, text, guidance_scale=settings.guidance_scale, negative=negative)
            x = multistep.step(x, v, float(sigmas[i]), float(sigmas[i + 1]))
            continue
        stochastic = i in window
        if i == window.start and window.size:
            latents.append(x)
        out = step_with_log_prob(
            model, text, negative, x, sigma, sigma_next, settings,
            sigma_max_next=sigma_max_next, generators=generators,
            noise_level=None if stochastic else 0.0,
        )
        x = out.prev_sample
        if stochastic:
            latents.append(x)
            log_probs.append(out.log_prob)
            if store_means:
                means.append(out.mean)
    if not window.size:
        return _output(model, x, sigmas, window)
    return _output(model, x, sigmas, window, torch.stack(latents, dim=1), torch.stack(log_probs, dim=1),
                   torch.stack(means, dim=1) if store_means and means else None)


def _output(model: DiffusionModel, x: torch.Tensor, sigmas: torch.Tensor, window: Window,
            latents: torch.Tensor | None = None, log_probs: torch.Tensor | None = None,
            means: torch.Tensor | None = None) -> RolloutOutput:
    """The decoded images, the final latents and the window's transitions (none for a sample
    without SDE steps)."""
    batch, steps = x.shape[0], torch.tensor(window.steps(), dtype=torch.long)
    return RolloutOutput(
        images=model.decode(x),
        latents=x.new_zeros(batch, 0, *x.shape[1:]) if latents is None else latents,
        log_probs=x.new_zeros(batch, 0) if log_probs is None else log_probs,
        sigmas=sigmas[steps].unsqueeze(0).expand(batch, -1).clone(),
        sigmas_next=sigmas[steps + 1].unsqueeze(0).expand(batch, -1).clone(),
        means=means,
        final_latents=x,
    )


def _sa_solver_sample(model: DiffusionModel, text: PromptEmbeds, negative: PromptEmbeds | None, x: torch.Tensor,
                      sigmas: torch.Tensor, settings: SamplingSettings, generators: list) -> torch.Tensor:
    """AWM's sampler: SA-Solver on its grid (`sa_solver_grid`), one model call per step, the
    injected noise of sample i from its own generator."""
    grid = sa_solver_grid(sigmas)
    solver = SASolver(x, grid, awm_tau(settings.noise_level))
    for i in range(len(grid) - 1):
        sigma = torch.full((x.shape[0],), grid[i], device=x.device)
        v = model.predict_velocity(solver.point, sigma, text, guidance_scale=settings.guidance_scale, negative=negative)
        noise = randn_tensor(tuple(x.shape), generator=generators, device=x.device, dtype=torch.float32)
        solver.step(i, v.float(), noise)
    return solver.point
