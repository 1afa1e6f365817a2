"""The `rollout:` section: how images are sampled (steps, guidance, noise, solver, SDE window)
and by which workers."""

from __future__ import annotations

from dataclasses import dataclass, field

from pixelrl.core.errors import ConfigError, check_choice, check_number, check_size


@dataclass
class GroupSamplingConfig:
    """What every trainer's `rollout:` section holds: samples per prompt and the sampling seed."""

    n: int = 8  # samples per prompt (the group size)
    seed: int = 42  # per-step rollout seed = seed + global_step - 1


@dataclass
class Oversample:
    """`rollout.oversample`: proxy-ranked oversampling (docs/algorithms/oversampling.md). Each
    prompt's pool of factor x rollout.n candidates is sampled cheaply (deterministic, num_steps
    steps) and scored by the run's reward; `keep` chooses rollout.n per prompt, which the training
    sampler samples again from the same seeds (so the same initial noise) and the step trains on."""

    factor: int = 1  # candidates per kept sample; 1: no pool
    num_steps: int = 0  # the pool's denoising steps; 0: rollout.num_steps
    # the pool's deterministic sampler: dpm2 (DPM-Solver++ 2M, the reference's) or euler (the ODE)
    solver: str = "dpm2"
    keep: str = "best_worst"  # best_worst | mean_deviation | extremes_random | random (sampling/oversampling.py)
    # false: train the kept pool samples themselves, not sampled again (a forward-process loss,
    # whose update reads only the clean sample; a loss that re-scores transitions needs them sampled)
    regenerate: bool = True

    @property
    def enabled(self) -> bool:
        return self.factor > 1

    def check(self, rollout: "RolloutConfig") -> None:
        from pixelrl.sampling.oversampling import KEEP_RULES

        check_number("rollout.oversample.factor", self.factor)
        if not self.enabled:
            return
        check_number("rollout.oversample.num_steps", self.num_steps, allow_zero=True)
        check_choice("rollout.oversample.solver", self.solver, ("dpm2", "euler"))
        KEEP_RULES.get(self.keep)
        if self.keep == "extremes_random" and rollout.n < 2:
            raise ConfigError("rollout.oversample.keep", self.keep, "keeps the best and the worst of each pool, "
                              "and rollout.n=1 keeps one: use rollout.n >= 2 or keep=best_worst")
        if rollout.same_noise_per_group:
            raise ConfigError("rollout.oversample.factor", self.factor, "ranks candidates that differ by their "
                              "initial noise, and rollout.same_noise_per_group gives a prompt's candidates one: set "
                              "same_noise_per_group=false or oversample.factor=1")
        if rollout.n_workers:
            raise ConfigError("rollout.oversample.factor", self.factor, "ranks the pool before the kept samples "
                              "are sampled, one step at a time, and a separate rollout pool (rollout.n_workers="
                              f"{rollout.n_workers}) samples ahead: set rollout.n_workers=0 or oversample.factor=1")


@dataclass
class RolloutConfig(GroupSamplingConfig):
    """The diffusion trainers' `rollout:` section."""

    num_steps: int = 10
    # scheduler: the model's diffusers scheduler; linspace_shift: DanceGRPO / MixGRPO's own grid
    sigma_schedule: str = "scheduler"
    # the shift of the linspace_shift and dpm_flow grids; 0: the family scheduler's (SD3: 3).
    # DMD2's student grid is linspace_shift with shift 3 on every family (4 steps: [1, .9, .75, .5, 0])
    sigma_shift: float = 0.0
    resolution: int = 512
    # the side an edit family's condition images enter the VAE at (each row's source cropped to
    # the output's aspect); 0: the output's, rollout.resolution. Qwen-Image-Edit's pipeline: 1024
    condition_resolution: int = 0
    # square: every output rollout.resolution x rollout.resolution; source (edit families): each
    # edit in its source's aspect at about that many pixels, the source decoded in its own aspect
    # at the condition size (Flow-Factory's auto_resize); the loader batches each size apart
    output_aspect: str = "square"
    guidance_scale: float = 4.5
    negative_prompt: str = ""
    noise_level: float = 0.7
    # sde | cps | dance_sde; ode: the window's steps are deterministic Euler steps, stored for
    # on-policy distillation from ODE rollouts (DiffusionOPD's own point; noise_level 0)
    sde_type: str = "sde"
    # euler: SDE steps in the window with noise_level > 0, Euler ODE steps elsewhere; dpm2:
    # DPM-Solver++ 2M (DiffusionNFT's), deterministic (noise_level 0); sa_solver: SA-Solver (AWM's),
    # noise_level its tau for t in [0.3, 0.9]. The multistep solvers serve the forward-process losses.
    solver: str = "euler"
    sde_window_size: int = 0  # 0 = full window (steps 0 .. N-2)
    sde_window_range: list[int] | None = None  # [r0, r1) for the random window
    # random: Flow-GRPO-Fast (start drawn per step from the rollout seed);
    # mixgrpo_random / mixgrpo_progressive: MixGRPO's shared, scheduled window
    sde_window_schedule: str = "random"
    # the schedule's own params (its dataclass in pixelrl.sampling.windows checks them), e.g.
    # mixgrpo_progressive: {stride: 1, iters_per_group: 25, rollback: false}; mixgrpo_random: {seed: 0}
    sde_window_params: dict = field(default_factory=dict)
    logprob_reduction: str = "mean"  # mean over latent dims (reference) | sum (= mean x dims)
    same_noise_per_group: bool = False  # DanceGRPO: one initial noise shared by a prompt's n images
    micro_batch_size: int | str = 16  # samples per denoiser forward during rollout; auto: the largest that fits
    # 0 = colocated: the actor workers sample with their own weights. N > 0 = a separate pool of
    # N optimizer-free rollout workers that receive the actor's weights after every step
    # (needed by trainer.mode one_step_off and async).
    n_workers: int = 0
    num_cpus_per_worker: int = 1
    # On-policy distillation with a rollout pool: true = the pool's workers replay the teacher on
    # what they sampled (and hold the teacher; the actor does not), so that replay overlaps the
    # actor's update of the previous batch; false = the actor replays it before its update
    scores_teacher: bool = False
    oversample: Oversample = field(default_factory=Oversample)
    # none, or a registered rollout accelerator (sampling/accelerators.py): a lossy one
    # (first_block_cache) only for methods that do not re-score the rollout's steps; validation never
    accelerator: str = "none"
    accelerator_params: dict = field(default_factory=dict)  # e.g. first_block_cache: {threshold: 0.1}

    @property
    def condition_size(self) -> tuple[int, int]:
        """(height, width) the condition images are decoded at."""
        side = self.condition_resolution or self.resolution
        return side, side

    def check(self) -> None:
        from pixelrl.sampling.multistep import SOLVERS
        from pixelrl.sampling.schedule import SIGMA_SCHEDULES
        from pixelrl.sampling.sde import sde_rule
        from pixelrl.sampling.windows import WINDOW_SCHEDULES, check_window_args, window_params

        check_choice("rollout.logprob_reduction", self.logprob_reduction, ("mean", "sum"))
        check_choice("rollout.sigma_schedule", self.sigma_schedule, SIGMA_SCHEDULES)
        rule = sde_rule(self.sde_type)
        check_number("rollout.guidance_scale", self.guidance_scale, allow_zero=True)
        check_number("rollout.sigma_shift", self.sigma_shift, allow_zero=True)
        if self.sigma_shift and self.sigma_schedule == "scheduler":
            raise ConfigError("rollout.sigma_shift", self.sigma_shift, "shifts the linspace_shift and dpm_flow grids; "
                              "the family's scheduler applies its own shift: set rollout.sigma_schedule=linspace_shift "
                              "or leave sigma_shift at 0")
        check_number("rollout.n_workers", self.n_workers, allow_zero=True)
        check_number("rollout.condition_resolution", self.condition_resolution, allow_zero=True)
        check_choice("rollout.output_aspect", self.output_aspect, ("square", "source"))
        check_number("rollout.num_cpus_per_worker", self.num_cpus_per_worker)
        for name in ("n", "num_steps", "resolution"):
            check_number(f"rollout.{name}", getattr(self, name))
        check_size("rollout.micro_batch_size", self.micro_batch_size)
        check_number("rollout.noise_level", self.noise_level, allow_zero=True)
        check_choice("rollout.solver", self.solver, SOLVERS)
        if self.solver == "dpm2" and self.noise_level > 0:
            raise ConfigError("rollout.solver", self.solver, "DPM-Solver++ samples deterministically: set "
                              "rollout.noise_level=0, or rollout.solver=sa_solver (stochastic) or euler")
        if self.solver == "sa_solver" and self.num_steps < 2:
            raise ConfigError("rollout.num_steps", self.num_steps, "SA-Solver's second-order steps need at least 2")
        self.oversample.check(self)
        from pixelrl.sampling.accelerators import ACCELERATORS

        ACCELERATORS.get(self.accelerator).check(self.accelerator_params)
        rule.check(self.noise_level, self.solver)  # the rule's own: CPS's noise range, ODE's Euler steps
        from pixelrl.sampling.rollout import stores_transitions

        if stores_transitions(self.noise_level, self.solver, self.sde_type) and self.num_steps < 2:
            raise ConfigError("rollout.num_steps", self.num_steps, "needs at least 2 denoising steps: the last step "
                              "is never in the window, so one step leaves no transition to train")
        check_choice("rollout.sde_window_schedule", self.sde_window_schedule, WINDOW_SCHEDULES)
        window_params(self.sde_window_schedule, self.sde_window_params)
        if self.sde_window_size and self.sde_window_schedule == "random":
            check_window_args(self.num_steps, self.sde_window_size, self.sde_window_range)
        elif self.sde_window_size and self.sde_window_size > self.num_steps - 2:
            raise ConfigError("rollout.sde_window_size", self.sde_window_size,
                              f"a MixGRPO window needs sde_window_size <= num_steps - 2 = {self.num_steps - 2}")
