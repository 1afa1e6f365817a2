"""Configuration dataclasses: the single source of truth for every option and its default.

Leaf names follow verl / verl-omni where the meaning is the same (`rollout.n`,
`actor.ppo_mini_batch_size`, `diffusion_loss.clip_ratio`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    path: str = ""  # local diffusers pipeline folder
    type: str = "sd3"
    device: str = "cpu"
    dtype: str = "float32"  # denoiser compute dtype; scheduler / log-prob math is always float32
    max_sequence_length: int = 256  # T5 tokens (or zero tokens when the folder has no T5)
    num_frames: int = 1  # frames per sample: 1 for image families; video families (wan) 4k + 1, e.g. 33 or 81
    lora_rank: int = 32  # 0 = full fine-tuning of the denoiser
    lora_alpha: float = 64.0
    lora_target_modules: list[str] | None = None  # None = the adapter's defaults
    lora_init: str = "gaussian"  # gaussian | default (peft's kaiming A, zero B) | pissa | olora | orthogonal
    gradient_checkpointing: bool = False
    # torch.compile the denoiser's forward (sampling, reference and training): compiled once per
    # input shape and adapter state on the first steps, then reused
    compile: bool = False


@dataclass
class RolloutConfig:
    n: int = 8  # images per prompt (the group size)
    seed: int = 42  # per-step rollout seed = seed + global_step - 1
    num_steps: int = 10
    # scheduler: the model's diffusers scheduler; linspace_shift: DanceGRPO / MixGRPO's own grid
    sigma_schedule: str = "scheduler"
    resolution: int = 512
    guidance_scale: float = 4.5
    negative_prompt: str = ""
    noise_level: float = 0.7
    sde_type: str = "sde"  # sde | cps | dance_sde
    # deterministic sampler when noise_level = 0: euler | dpm2 (DPM-Solver++ 2M, DiffusionNFT's)
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
    micro_batch_size: int = 16  # samples per denoiser forward during rollout
    # 0 = colocated: the actor workers sample with their own weights. N > 0 = a separate pool of
    # N optimizer-free rollout workers that receive the actor's weights after every step
    # (needed by trainer.mode one_step_off and async).
    n_workers: int = 0
    num_cpus_per_worker: int = 1


@dataclass
class ActorConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    # after warm-up: constant (the diffusion references), or cosine (half a cosine from lr down to
    # min_lr_ratio x lr at the run's last optimizer step, verl's lr_scheduler_type: cosine)
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1
    # Images per optimizer step, counted over all workers: the step's train_batch_size x rollout.n
    # images make (images / ppo_mini_batch_size) optimizer steps per epoch; 0 = the whole batch.
    # Flow-GRPO's paper setting takes two steps per rollout batch, MixGRPO four.
    ppo_mini_batch_size: int = 0
    ppo_micro_batch_size: int = 4  # samples per forward/backward
    # Trained window steps of a micro-batch in one forward/backward (and in one no-grad forward
    # when scoring the reference or old policy); 0 = all. The same update up to float reordering,
    # fewer and larger calls, activation memory x this. Losses with batch statistics need 1.
    window_steps_per_forward: int = 1
    shuffle: bool = True
    # In order: train the first int(num_steps * fraction) window steps (Flow-GRPO). Permuted
    # (DanceGRPO): a random int(W * fraction) of the W window steps per sample.
    timestep_fraction: float = 1.0
    permute_timesteps: bool = False
    max_consecutive_nonfinite: int = 3  # skipped updates in a row before the run stops
    # > 0: keep an EMA of the trained weights, updated after every `ema_update_interval`-th
    # optimizer step s with decay min((1 + s) / (10 + s), ema_decay); validation, the checkpoints'
    # evaluation and `pixelrl export` use it (flow_grpo's and DiffusionNFT's train.ema: 0.9)
    ema_decay: float = 0.0
    ema_update_interval: int = 1


@dataclass
class DiffusionLossConfig:
    name: str = "flow_grpo"
    clip_ratio: float = 1e-4
    adv_clip_max: float = 5.0
    kl_coef: float = 0.0  # beta of the KL to the reference policy
    kl_type: str = "reference"  # reference | exact
    # Options of the chosen loss only (its params dataclass in pixelrl.algos), e.g. flow_dppo: {tau: 1e-5}
    params: dict = field(default_factory=dict)


# algorithm.trainer_type's names before 2026-11 -> the current ones (configs using them still run)
TRAINER_TYPE_ALIASES = {"policy_gradient": "transition", "direct_preference": "forward_process"}


@dataclass
class AlgorithmConfig:
    # How the update sees a sample. transition: re-scores the sampler's SDE transitions
    # (Flow-GRPO family); forward_process: re-noises the clean sample at drawn timesteps
    # (Diffusion-DPO, DiffusionNFT, AWM, DGPO). vlm_ppo: the vision-language trainer. The names before
    # 2026-11, policy_gradient and direct_preference, still load (TRAINER_TYPE_ALIASES).
    trainer_type: str = "transition"
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    global_std: bool = True  # std of the whole batch (Flow-GRPO) or of each group (DanceGRPO, MixGRPO)
    adv_std_unbiased: bool = False  # ddof 1 (DanceGRPO, MixGRPO) instead of the population std
    adv_eps: float = 1e-4  # A = (r - mean) / (std + adv_eps); DanceGRPO and MixGRPO use 1e-8
    # Flow-GRPO drops samples whose advantage is exactly 0 before training (re-adding random
    # dropped ones until the count splits into the mini-batches and workers); verl-omni keeps them,
    # which raises the effective KL weight by 1 / (1 - zero fraction). DiffusionNFT and AWM honour
    # it too (AWM's zero-advantage samples carry only its reference and EMA terms); DPO trains pairs.
    drop_zero_advantage: bool = True
    rollout_correction: str = "bypass"  # bypass | decoupled
    rollout_is_threshold: float = 2.0  # decoupled: truncate importance weights at this value
    rollout_is: str = "token"  # the weight of each sample-step (token) or of the sample's product (sequence)
    # decoupled: reject (weight 0) where the rollout_rs statistic leaves [lower, upper] (lower
    # defaults to 1 / upper, as verl): token (each step's ratio), sequence (the sample's product of
    # ratios), geometric (their geometric mean), any_step (the whole sample when any step leaves)
    rollout_rs: str = "token"
    rollout_rs_lower: float | None = None
    rollout_rs_upper: float | None = None
    # Several rewards: `sum_rewards` normalises sum_k w_k r_k; `sum_advantages` (MixGRPO's
    # advantage_aggr) normalises each reward separately and sums w_k A_k.
    reward_aggregation: str = "sum_rewards"
    # forward_process only: `online` samples and scores pairs each step; `offline` (Diffusion-DPO)
    # reads (prompt, chosen, rejected) rows from data.train_files (see pixelrl.data.preferences)
    sample_source: str = "online"


@dataclass
class EngineConfig:
    """Everything a `PolicyEngine` needs: one model, its sampler and its optimizer."""

    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    diffusion_loss: DiffusionLossConfig = field(default_factory=DiffusionLossConfig)
    seed: int = 0  # seeds LoRA init and mini-batch shuffling


@dataclass
class RewardConfig:
    # Each entry: {name: <registered reward>, weight: float, options: {...}}.
    functions: list[dict] = field(default_factory=lambda: [{"name": "jpeg_compressibility", "weight": 1.0}])
    placement: str = "colocated"  # colocated (shares the actor's resources) | pool (its own resources)
    num_workers: int = 1
    num_cpus: float = 1.0  # per reward worker when placement = pool
    num_gpus: float = 0.0  # per reward worker when placement = pool: a reward model's own GPU (Ray clusters)
    # A scorer that fails (raises, times out, returns non-finite scores): `stop` the run, or
    # `skip` the step (no update, `reward/error` = 1 in its row) until max_consecutive_errors in a row
    on_error: str = "stop"
    max_consecutive_errors: int = 3
    # the most seconds one reward function may take for one call (a step's or a validation's
    # images), in the process that scores: past it the call fails like a reward that raised
    # (on_error decides); 0 = no deadline. The call's thread is left to finish on its own.
    timeout_s: float = 900.0


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # jsonl / parquet / txt
    val_files: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)  # inline prompts, used when no train file is given
    prompt_key: str = "prompt"
    train_batch_size: int = 8  # prompts per step (each repeated rollout.n times)
    # {data_source: k}: every training row of that source appears k times per epoch (unlisted
    # sources once; 0 leaves a source out), to train more on what the model is weakest at
    source_weights: dict = field(default_factory=dict)
    val_batch_size: int = 0  # prompts per validation generation call; 0 = the whole set at once
    shuffle: bool = True
    seed: int = 1


@dataclass
class ValKwargs:
    n: int = 1  # images per validation prompt
    num_steps: int = 10
    noise_level: float = 0.0  # 0 = deterministic ODE sampling
    guidance_scale: float | None = None  # None = rollout.guidance_scale
    # gold rewards: scored on the validation images besides the training reward (same format as
    # reward.functions), logged as val-core/<source>/gold/<key>/mean@n, so a training reward
    # that rises while a stricter judge stays flat shows up as it happens
    rewards: list = field(default_factory=list)


@dataclass
class TrainerConfig:
    project_name: str = "pixelrl"
    experiment_name: str = "default"
    default_local_dir: str = "runs"  # the run folder is <default_local_dir>/<project>/<experiment>
    total_epochs: int = 1
    total_training_steps: int = 0  # 0 = len(train loader) x total_epochs
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # + tensorboard, wandb
    save_freq: int = 0  # 0 = only at the last step; -1 = never
    test_freq: int = 0  # 0 = only at the last step; -1 = never
    val_before_train: bool = False
    # stop after the step at which the summed step time of this process reaches this many
    # seconds, saving and validating as at the last step (0 = no budget)
    time_budget_s: float = 0.0
    resume_mode: str = "auto"  # auto | disable | <path to a global_step_N folder>
    # when a Ray worker's process dies (a native crash, the OOM killer, a lost node), start the
    # workers again and resume from the run's latest checkpoint, at most this many times (0 = stop)
    max_restarts: int = 0
    max_ckpt_to_keep: int = 0  # 0 = keep all
    # keep the checkpoint of the validation at which this metric was highest (saved even off
    # save_freq, never rotated away, named in <run>/checkpoints/best_checkpoint.json; `pixelrl demo`
    # evaluates it): a key of the validation row, e.g. val-aux/overall/shapes_strict/mean@4, the
    # mean over data sources. "" = off. Guards a long run against drifting past its peak.
    best_metric: str = ""
    rollout_data_dir: str = ""  # dump each step's rollouts (JSONL + images) here when set
    validation_data_dir: str = ""  # dump validation generations here when set ("" = <run>/validation)
    log_image_grid_every: int = 0  # write a sample grid every N steps (0 = at validation only)
    backend: str = "ray"  # ray | local (one in-process worker, no Ray: for debugging)
    n_workers: int = 1  # actor workers over all nodes (one per GPU; on CPU each takes num_cpus_per_worker cores)
    num_cpus_per_worker: int = 1
    strategy: str = "ddp"  # ddp | fsdp2
    ray_address: str = ""  # "" = $RAY_ADDRESS or a local cluster; "auto" joins a running one
    # sync: batch i is sampled with the weights after step i - 1. one_step_off: with those after
    # step i - 2, so sampling batch i + 1 overlaps training on batch i. async: after step
    # i - 1 - max_staleness. The schedule is fixed, so async runs are reproducible and resume exactly.
    mode: str = "sync"
    max_staleness: int = 2  # async only: how many steps older than on-policy a batch's weights are
    # per-device peak for perf/mfu, in TFLOP/s (e.g. 989 for an H100's dense bf16); 0 = measure a
    # matmul peak on each actor worker at start-up, in the model's dtype
    peak_tflops: float = 0.0
    # > 0: choose actor.ppo_micro_batch_size, model.gradient_checkpointing, rollout.micro_batch_size
    # and (several workers) trainer.strategy at start-up so that a step's estimated peak fits this
    # many GB per GPU, fastest first (what `pixelrl plan` prints); 0 = use them as written
    fit_to_memory_gb: float = 0.0
    # > 0: run this step under torch.profiler on every actor worker and write <run>/profile/
    # step_<N>_rank_<R>.txt (device time by kernel category and worker phase) and .json.gz (a
    # Chrome trace); 0 = off. Profiling slows the step it watches: its timing row is not the run's
    profile_step: int = 0


@dataclass
class VLMConfig:
    """algorithm.trainer_type = vlm_ppo: PPO / GRPO for a vision-language policy (token sequences).
    Samples per prompt are rollout.n; prompts per step data.train_batch_size; the optimizer is actor.*."""

    # the (image, question, answer) source: shapes_qa (built in) or files (data.train_files / val_files)
    task: str = "shapes_qa"
    # image size bounds in pixels for the model's image processor (0 = the folder's
    # preprocessor_config.json): an image is resized to keep its aspect within them, so max_pixels
    # caps the image tokens per prompt (max_pixels / (patch x merge)^2)
    min_pixels: int = 0
    max_pixels: int = 0
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    # group_norm (GRPO) | rloo | reinforce_baseline (sequence baselines, no critic) | reinforce | gae (critic)
    estimator: str = "group_norm"
    gamma: float = 1.0
    lam: float = 0.95
    advantage_clamp: float = 10.0  # |A| cap after whitening (the VL trainer's clamp)
    policy_loss: str = "ppo"  # ppo | gspo | cpg
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None  # c > 1 caps -A rho at -A c for A < 0
    aggregation: str = "seq-mean-token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    kl_coef: float = 0.0  # beta (initial value with kl_target)
    kl_estimator: str = "k3"  # k1 | k2 | k3 | low_var_kl
    kl_in_reward: bool = False  # per-token -beta * kl in the reward (else a loss term)
    kl_target: float | None = None  # set: adaptive KL controller
    kl_horizon: int = 10000
    entropy_mask_ratio: float = 0.0  # train the policy on the top fraction of highest-entropy tokens
    # > 0: subtract coef x the policy's token entropy (aggregated like the policy loss) from the
    # actor loss, to keep sampling diverse (verl's actor.entropy_coeff)
    entropy_coef: float = 0.0
    # PPO's old log-probs (and the logged entropy) by a separate no-grad forward of the sampled
    # sequences, as verl and LightRFT do (their samplers are other engines). false: reuse those the
    # sampler computed with the same weights (equal within float reordering, one forward less)
    recompute_old_logp: bool = True
    # > 0: a supervised loss (mean NLL of the answer) on rows of its own pretraining / SFT set,
    # ptx_files (.jsonl / .parquet with image, question and answer, as vlm.task=files), as LightRFT
    ptx_coef: float = 0.0
    ptx_files: list = field(default_factory=list)
    ema_decay: float = 0.0  # > 0: keep an EMA of the actor (0.992 in LightRFT), saved with checkpoints
    validate_ema: bool = False  # validation scores the EMA actor (the model LightRFT keeps) instead of the actor
    critic_lr: float = 1e-4
    value_clip: float | None = 0.2
    freezing_actor_steps: int = 0  # critic warm-up: only the critic trains for this many steps
    val_items: int = 300  # held-out items scored (greedy) at validation


@dataclass
class PixelRLConfig(EngineConfig):
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    vlm: VLMConfig = field(default_factory=VLMConfig)
    # Modules or .py files imported in every process before anything is built: your own
    # rewards, losses, advantage estimators (README "Extending")
    plugins: list = field(default_factory=list)


def images_per_step(cfg: "PixelRLConfig") -> int:
    return cfg.data.train_batch_size * cfg.rollout.n


def validation_guidance(cfg: "PixelRLConfig") -> float:
    """The guidance scale validation samples with: `val_kwargs.guidance_scale`, or the rollouts'."""
    guidance = cfg.val_kwargs.guidance_scale
    return cfg.rollout.guidance_scale if guidance is None else guidance


def mini_batches_per_epoch(cfg: "PixelRLConfig") -> int:
    """Optimizer steps per inner epoch: the step's images split into mini-batches."""
    images = images_per_step(cfg)
    return images // (cfg.actor.ppo_mini_batch_size or images)


def optimizer_steps_per_rollout(cfg: "PixelRLConfig") -> int:
    """Optimizer steps taken on one rollout batch (the reference update schedule)."""
    return cfg.actor.ppo_epochs * mini_batches_per_epoch(cfg)


def actor_optimizer_steps(cfg: "PixelRLConfig", frozen_steps: int = 0) -> int:
    """Optimizer steps the actor takes over the whole run (what a cosine lr decays over), when the
    first `frozen_steps` training steps update no actor (the vision-language critic warm-up)."""
    return optimizer_steps_per_rollout(cfg) * (cfg.trainer.total_training_steps - frozen_steps)
