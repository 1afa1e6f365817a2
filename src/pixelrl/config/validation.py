"""Check a run configuration before anything is built. Each section checks its own fields
(`check()` beside its owner: pixelrl.models.config, pixelrl.sampling.config, ...); this module
runs them and checks the rules that span sections, each failure one `ConfigError` naming the
field, the value and the fix. It sits above the components whose choices it checks.
"""

from __future__ import annotations

import json
from pathlib import Path

from pixelrl.algos.methods import METHODS, method_of
from pixelrl.config.parallel_rules import check_sequence_parallel
from pixelrl.config.rollout_rules import check_pool_and_accelerator
from pixelrl.config.sections import SEPARATE_TRAINERS, PixelRLConfig, merge_config
from pixelrl.core.errors import AUTO, ConfigError, check_choice
from pixelrl.core.plugins import import_plugins
from pixelrl.engine.config import images_per_step, mini_batches_per_epoch
from pixelrl.sampling.sde import sde_rule
from pixelrl.sampling.windows import window_span


def compose_config(config_name: str | None = None, overrides: list[str] | tuple = ()) -> PixelRLConfig:
    """The named config with `overrides` and its plugins imported, not yet validated (`pixelrl
    plan` checks a recipe whose folders are on another machine itself)."""
    cfg = merge_config(config_name, overrides)
    cfg.plugins = import_plugins(cfg.plugins)
    return cfg


def load_config(config_name: str | None = None, overrides: list[str] | tuple = ()) -> PixelRLConfig:
    """The named config with `overrides`, its plugins imported (they register names that the
    checks look up) and every field checked."""
    cfg = compose_config(config_name, overrides)
    validate(cfg)
    _check_gpus_here(cfg)  # a run's, on this machine; not a plan's for other GPUs (`validate`)
    if cfg.algorithm.trainer_type in METHODS:
        from pixelrl.config.auto_size import auto_fields, fit_to_memory

        if cfg.trainer.fit_to_memory_gb or auto_fields(cfg):
            cfg = fit_to_memory(cfg)
    return cfg


def _check_device(cfg: PixelRLConfig) -> None:
    """A device torch cannot name is refused; so is a CUDA device in a one-process run on a machine
    that has none (Ray workers may sit on other nodes with GPUs, so only the local backend knows)."""
    import torch

    device = cfg.model.device
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ConfigError("model.device", device, "not a torch device: use cpu, cuda or cuda:N") from None
    if kind == "cuda" and cfg.trainer.backend == "local" and not torch.cuda.is_available():
        raise ConfigError("model.device", device, "no CUDA device is visible here (torch.cuda.is_available() is "
                          "False): use model.device=cpu, or run on a machine with a GPU and a CUDA build of torch")


def _check_rollout_pool(cfg: PixelRLConfig) -> None:
    """Modes that sample ahead need a separate rollout pool, and only transition losses re-score
    (and so correct) a stale batch."""
    r, t = cfg.rollout, cfg.trainer
    if t.mode != "sync" and r.n_workers == 0:
        raise ConfigError("rollout.n_workers", 0, f"trainer.mode={t.mode} samples ahead on a separate rollout pool: "
                          "set rollout.n_workers=1 (or more)")
    if r.n_workers and (not method_of(cfg).rescores_transitions or cfg.algorithm.sample_source != "online"):
        raise ConfigError("rollout.n_workers", r.n_workers, "a separate rollout pool serves the policy-gradient "
                          "trainer; direct-preference and offline runs sample on the actor workers (rollout.n_workers=0)")
    if r.scores_teacher:
        from pixelrl.algos.losses import LOSSES

        loss = LOSSES.get(cfg.diffusion_loss.name)
        if not loss.reads_teacher(loss.bind(cfg.diffusion_loss)):
            raise ConfigError("rollout.scores_teacher", True, "there is no distillation teacher to replay (the loss is "
                              "not distill_kl and diffusion_loss.distill_coef is 0): leave it false")
        if r.n_workers == 0:
            raise ConfigError("rollout.scores_teacher", True, "the rollout pool replays the teacher on what it sampled, "
                              "and this run has none: set rollout.n_workers=1 (or more) with trainer.mode=one_step_off "
                              "or async, or leave it false (the actor replays the teacher)")
    if r.n_workers and (cfg.data.train_batch_size * r.n) % r.n_workers:
        raise ConfigError("rollout.n_workers", r.n_workers, f"the {cfg.data.train_batch_size * r.n} images of a step "
                          "must split evenly over the rollout workers")


def validate(cfg: PixelRLConfig) -> None:
    """Every section's own checks, then the rules that span sections; the model folder last (a
    config copied from another machine reports its field errors before its model path)."""
    check_choice("algorithm.trainer_type", cfg.algorithm.trainer_type,
                 tuple(METHODS.names()) + tuple(SEPARATE_TRAINERS.names()))
    if cfg.algorithm.trainer_type in SEPARATE_TRAINERS:  # checks the sections it reads itself
        SEPARATE_TRAINERS.get(cfg.algorithm.trainer_type).check(cfg)
        return
    cfg.model.check()
    _check_device(cfg)
    loss = cfg.diffusion_loss.check()
    _check_loss_timesteps(cfg, loss)  # before the rollout's window: the loss decides what a grid must hold
    cfg.rollout.check()
    cfg.algorithm.check()
    cfg.actor.check()
    cfg.data.check()
    cfg.val_kwargs.check()
    cfg.reward.check()
    cfg.reward.check_resources()
    cfg.trainer.check()
    _check_loss_against_run(cfg, loss)
    _check_offline_data(cfg)
    _check_reward_gpus(cfg)
    _check_rollout_pool(cfg)
    check_pool_and_accelerator(cfg)
    check_sequence_parallel(cfg)
    _check_hacking_stop(cfg)
    _check_batch_split(cfg)
    check_lr_schedule(cfg)
    _check_model_against_run(cfg)


def _check_hacking_stop(cfg: PixelRLConfig) -> None:
    """trainer.stop_when_hacking acts on the validations' flags: it needs the watch and validations."""
    if not cfg.trainer.stop_when_hacking:
        return
    if not cfg.val_kwargs.hacking.enabled:
        raise ConfigError("trainer.stop_when_hacking", True, "stops at a validation val_kwargs.hacking flags, and "
                          "val_kwargs.hacking.enabled=false flags none: enable it, or set stop_when_hacking=false")
    if cfg.trainer.test_freq == -1:
        raise ConfigError("trainer.stop_when_hacking", True, "trainer.test_freq=-1 never validates, so nothing is "
                          "ever flagged: set trainer.test_freq to how often (in steps) the run is checked")
    if not cfg.trainer.val_before_train:
        raise ConfigError("trainer.stop_when_hacking", True, "compares each validation with the untrained model's, "
                          "and trainer.val_before_train=false takes none: set trainer.val_before_train=true")


def _check_loss_timesteps(cfg: PixelRLConfig, bound) -> None:
    """A forward-process loss's timestep draws fit the sampling grid; group noise needs groups."""
    from pixelrl.algos.forward_process import check_strata

    r = cfg.rollout
    if hasattr(bound, "num_timesteps"):
        # with min_sigma the strata end where the family's (shifted) grid falls below it, known once the
        # model is loaded: here only that the whole grid holds them, the draw checks the rest
        top = r.num_steps - 1 if getattr(bound, "min_sigma", 0.0) else None
        check_strata(bound.timesteps, bound.num_timesteps, r.num_steps, getattr(bound, "timestep_fraction", 1.0),
                     getattr(bound, "max_timestep_index", None), top=top)
    if getattr(bound, "group_noise", False) and r.n < 2:
        raise ConfigError("diffusion_loss.params.group_noise", True, f"shares noise within a prompt's group, and "
                          f"rollout.n={r.n} makes groups of one: set rollout.n >= 2 or group_noise=false")


def _check_old_adapter_validation(cfg: PixelRLConfig, loss, bound) -> None:
    """val_kwargs.weights=old needs the old adapter (a LoRA run whose loss reads it or samples with
    it) and no second set of weights (an EMA) that validation would then never score."""
    from pixelrl.algos.forward_process import rollout_policy

    if cfg.model.lora_rank <= 0 or not ("v_old" in loss.step_keys_needed(bound) or rollout_policy(bound) == "old"):
        raise ConfigError("val_kwargs.weights", "old", "validates the old adapter, and this run keeps none (a LoRA run "
                          "whose loss reads one or samples rollouts with it: DiffusionNFT, AWM): use "
                          "val_kwargs.weights=auto")
    if cfg.actor.ema_decay > 0:
        raise ConfigError("val_kwargs.weights", "old", f"validates the old adapter, and actor.ema_decay="
                          f"{cfg.actor.ema_decay} keeps an EMA that checkpoints export but nothing would score: set "
                          "actor.ema_decay=0, or val_kwargs.weights=auto")


def _check_loss_against_run(cfg: PixelRLConfig, bound) -> None:
    """The loss fits the method family, the sampler, the batch and the adapter; then the method's
    own checks (`MethodSpec.check`)."""
    from pixelrl.algos.advantages import ADVANTAGE_ESTIMATORS
    from pixelrl.algos.losses import LOSSES
    from pixelrl.sampling.rollout import stores_transitions

    r, m, name = cfg.rollout, cfg.model, cfg.diffusion_loss.name
    loss, method = LOSSES.get(name), method_of(cfg)
    if loss.objective != method.name:  # the family is the loss's objective
        fitting = [n for n in LOSSES.names() if LOSSES.get(n).objective == method.name]
        raise ConfigError("diffusion_loss.name", name, f"algorithm.trainer_type={method.name} trains {method.name} "
                          f"losses: {fitting}")
    if loss.whole_groups:
        _check_whole_groups(cfg)
    if cfg.val_kwargs.weights == "old":
        _check_old_adapter_validation(cfg, loss, bound)
    if r.solver == "sa_solver" and (method.rescores_transitions or not method.samples_through_producer):
        raise ConfigError("rollout.solver", r.solver, "SA-Solver's steps have no log-probability to re-score: it "
                          f"samples for forward-process losses (AWM's sampler), not `{name}`: use rollout.solver=euler")
    if sde_rule(r.sde_type).deterministic and (not method.rescores_transitions or "log_prob" in loss.step_keys_needed(bound)):
        raise ConfigError("rollout.sde_type", "ode", f"ODE steps have no log-probability, and `{name}` "
                          f"{'reads one' if method.rescores_transitions else 'trains on no stored transition'}: "
                          "the ODE window serves distill_kl (on-policy distillation compares step means); use "
                          "rollout.sde_type=sde with noise_level > 0")
    if method.rescores_transitions and not stores_transitions(r.noise_level, r.solver, r.sde_type):
        raise ConfigError("rollout.noise_level", r.noise_level, f"`{name}` trains on the rollout's stored SDE "
                          f"transitions, and noise_level 0 samples the ODE, which stores none: set "
                          f"rollout.noise_level > 0 (Flow-GRPO: 0.7)" + (
                              " or, for distill_kl, rollout.sde_type=ode" if "teacher_mean" in loss.step_keys else ""))
    if name == "grpo_guard" and r.sde_type == "cps":
        raise ConfigError("rollout.sde_type", r.sde_type, "grpo_guard rescales by the step's std, and the cps "
                          "log-prob has no variance term: use rollout.sde_type=sde with grpo_guard")
    if cfg.actor.window_steps_per_forward != 1 and not loss.steps_batchable:
        batchable = [n for n in LOSSES.names() if LOSSES.get(n).steps_batchable]
        raise ConfigError("actor.window_steps_per_forward", cfg.actor.window_steps_per_forward,
                          f"loss `{name}` takes statistics across the batch of one window step "
                          f"(or draws its own timesteps), so steps cannot share a forward: use 1 (batchable: {batchable})")
    # AWM with ema_beta 0 reads no old policy, so it can fine-tune the whole denoiser
    if "v_old" in loss.step_keys_needed(bound) and m.lora_rank == 0:
        raise ConfigError("model.lora_rank", 0, f"{name} keeps the old policy as a second LoRA "
                          "adapter: use LoRA (model.lora_rank > 0)")
    method.check(cfg)
    if loss.trains_on_pairs and cfg.algorithm.sample_source == "online":  # offline: _check_batch_split
        if cfg.data.train_batch_size % (cfg.trainer.data_workers * mini_batches_per_epoch(cfg)):
            raise ConfigError("data.train_batch_size", cfg.data.train_batch_size,
                              "online DPO trains one pair per prompt: the prompts per step must split into "
                              f"{cfg.trainer.data_workers_named} x mini-batches")
    if getattr(bound, "rollout_policy", "current") == "old" and m.lora_rank == 0:
        raise ConfigError("diffusion_loss.params.rollout_policy", "old", "the old policy is a second LoRA adapter, "
                          "which full fine-tuning (model.lora_rank=0) does not keep: sample with "
                          "rollout_policy=current or train a LoRA")
    if loss.reads_teacher(bound):
        _check_teachers(cfg, loss, method)
    estimator = ADVANTAGE_ESTIMATORS.get(cfg.algorithm.adv_estimator)
    if getattr(estimator, "needs_groups", False) and r.n < 2 and loss.reads_advantages:
        raise ConfigError("rollout.n", r.n, f"`{cfg.algorithm.adv_estimator}` normalises within groups of images of "
                          "one prompt: use rollout.n >= 2 (the paper uses 24 for SD3.5)")


def _check_teachers(cfg: PixelRLConfig, loss, method) -> None:
    """On-policy distillation pulls samples toward teachers, each a LoRA of this very base (or the
    base itself) that the folder named holds; the whole loss trains every sample."""
    from pixelrl.algos.distillation import teacher_routes

    if cfg.diffusion_loss.distill_coef > 0 and not method.rescores_transitions:
        raise ConfigError("diffusion_loss.distill_coef", cfg.diffusion_loss.distill_coef, "the distillation term "
                          "replays stored SDE transitions: it sits beside transition losses (flow_grpo, ...), not "
                          f"`{loss.name}`: set distill_coef=0")
    if "teacher_mean" in loss.step_keys and cfg.algorithm.drop_zero_advantage:
        raise ConfigError("algorithm.drop_zero_advantage", True, f"{loss.name} trains every sample toward the "
                          "teacher (no reward or advantage enters its loss): set algorithm.drop_zero_advantage=false")
    if "teacher_mean" in loss.step_keys and all(_is_the_base(cfg, spec) for spec in
                                                 teacher_routes(cfg.diffusion_loss.teacher).values()):
        raise ConfigError("diffusion_loss.teacher", cfg.diffusion_loss.teacher, f"{loss.name} pulls the student "
                          "toward its teacher, and this one is the student's own base: the student starts equal to "
                          "it, so the loss and its gradient stay 0 at every step; name a fine-tuned teacher (an RL "
                          "run's global_step_N folder, a LoRA folder, or a pipeline folder of another fine-tune)")
    routed = hasattr(cfg.diffusion_loss.teacher, "keys")
    for source, spec in teacher_routes(cfg.diffusion_loss.teacher).items():
        _check_teacher(cfg, f"diffusion_loss.teacher.{source}" if routed else "diffusion_loss.teacher", spec)


def _is_the_base(cfg: PixelRLConfig, spec: str) -> bool:
    """`base`, or model.path's own folder named as a teacher."""
    from pixelrl.algos.distillation import BASE_TEACHER
    from pixelrl.core.assets import resolve

    if spec == BASE_TEACHER:
        return True
    return Path(resolve(str(spec))).resolve() == Path(resolve(str(cfg.model.path))).resolve()


def _check_teacher(cfg: PixelRLConfig, field: str, spec: str) -> None:
    from safetensors import safe_open

    from pixelrl.engine.checkpoint import LORA_FILE, TEACHER_FILE_FIX, teacher_files, teacher_weights

    weights = teacher_weights(spec)
    if weights is None:
        return
    if not weights.path.exists():
        raise ConfigError(field, spec, "no such folder: name an RL run's global_step_N checkpoint, a LoRA folder or "
                          "a pipeline folder of this model family, or `base`")
    if weights.kind == "full":
        if not (weights.path.is_file() or any(weights.path.glob("*.safetensors"))):
            raise ConfigError(field, spec, f"a pipeline folder's teacher is its transformer's weights, and {weights.path} "
                              "holds no .safetensors file")
        if weights.path.name == "transformer":  # a pipeline folder: its denoiser must be the base's shape
            _check_same_denoiser(cfg, field, spec, weights.path)
    elif cfg.model.lora_rank == 0:
        raise ConfigError(field, spec, "a teacher LoRA sits on the base model beside the student's adapter; full "
                          "fine-tuning (model.lora_rank=0) moves that base: train the student as a LoRA, distil "
                          "from teacher=base, or name a whole fine-tuned teacher (a full fine-tune's checkpoint, or "
                          "a pipeline folder with the LoRA merged: pixelrl export without --adapter-only)")
    elif not (weights.path / LORA_FILE).is_file():
        raise ConfigError(field, spec, f"no {LORA_FILE} there (nor in a checkpoint's actor/ema_adapter or "
                          "actor/adapter): name an RL run's global_step_N folder, a `pixelrl export --adapter-only` "
                          "folder, any diffusers LoRA folder of this model family, or a pipeline folder of it")
    for file in teacher_files(weights):  # the header says how long the file must be: a copy cut short shows here
        try:
            with safe_open(str(file), "pt"):
                pass
        except Exception as err:  # safetensors raises its own error type, or OSError
            raise ConfigError(field, spec, f"{file} cannot be read ({str(err).splitlines()[0][:160]}): "
                              f"{TEACHER_FILE_FIX}") from None
    saved = next((p / "config.yaml" for p in weights.path.parents if (p / "config.yaml").is_file()
                  and p.name.startswith("global_step_")), None)
    if saved is not None:  # a checkpoint says which base its weights were trained from
        from omegaconf import OmegaConf

        from pixelrl.core.assets import resolve

        base = OmegaConf.select(OmegaConf.load(saved), "model.path")
        if base is not None and Path(resolve(str(base))).resolve() != Path(resolve(str(cfg.model.path))).resolve():
            raise ConfigError(field, spec, f"that checkpoint was trained from model.path={base}, this run's base is "
                              f"{cfg.model.path}: a teacher is a fine-tune of the student's base (a LoRA applies to "
                              "the base it was trained on, a whole denoiser must have its shape); point model.path "
                              "at that base")


def _check_same_denoiser(cfg: PixelRLConfig, field: str, spec: str, transformer: Path) -> None:
    """A pipeline folder's transformer has the base's architecture (its config.json, leaving out
    the `_`-prefixed bookkeeping keys), so that its weights fit the copy they are loaded into."""
    from pixelrl.core.assets import resolve

    def architecture(folder: Path) -> dict | None:
        file = folder / "config.json"
        if not file.is_file():
            return None
        return {k: v for k, v in json.loads(file.read_text()).items() if not k.startswith("_")}

    theirs = architecture(transformer)
    ours = architecture(Path(resolve(str(cfg.model.path))) / "transformer")
    if theirs is not None and ours is not None and theirs != ours:
        differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        raise ConfigError(field, spec, f"its transformer is not model.path's architecture ({differ[0]}: "
                          f"{theirs.get(differ[0])} there, {ours.get(differ[0])} in {cfg.model.path}): a whole "
                          "teacher must be a fine-tune of the student's base")


def _check_offline_data(cfg: PixelRLConfig) -> None:
    """Where the prompts (or offline preference pairs) come from."""
    d = cfg.data
    if cfg.algorithm.sample_source == "offline" and d.source_weights:
        raise ConfigError("data.source_weights", dict(d.source_weights), "weights prompt rows by their data_source; "
                          "offline preference pairs are read as they are: remove it")
    if cfg.algorithm.sample_source == "offline":
        from pixelrl.algos.losses import LOSSES

        if not LOSSES.get(cfg.diffusion_loss.name).trains_on_pairs:
            raise ConfigError("algorithm.sample_source", "offline", "offline preference data trains Diffusion-DPO: "
                              "set algorithm.trainer_type=forward_process and diffusion_loss.name=diffusion_dpo")
        if not d.train_files:
            raise ConfigError("data.train_files", list(d.train_files), "offline DPO reads (prompt, chosen, rejected) "
                              "rows from a .jsonl or .parquet file: write one with `pixelrl make-preferences`")
    if not d.train_files and not d.prompts:
        raise ConfigError("data.train_files", d.train_files, "give a jsonl / parquet / txt prompt file (or data.prompts)")


def _check_batch_split(cfg: PixelRLConfig) -> None:
    """A step's images split evenly over the workers, the mini-batches and (FSDP2) the micro-batches."""
    a, t, d = cfg.actor, cfg.trainer, cfg.data
    samples = images_per_step(cfg)
    offline = cfg.algorithm.sample_source == "offline"
    rows = "preference pairs" if offline else "images"
    workers, named = t.data_workers, t.data_workers_named
    if samples % workers:
        raise ConfigError("data.train_batch_size", d.train_batch_size,
                          ("the" if offline else "train_batch_size x rollout.n =") + f" {samples} {rows} of a step "
                          f"must divide evenly across {named} = {workers}")
    mini = a.ppo_mini_batch_size or samples
    if mini > samples or samples % mini or mini % workers:
        raise ConfigError("actor.ppo_mini_batch_size", a.ppo_mini_batch_size,
                          f"must divide the {samples} {rows} of a step and be a multiple of {named} "
                          f"({workers}); 0 means the whole batch")
    if t.strategy == "fsdp2" and a.ppo_micro_batch_size != AUTO and \
            (mini // workers) % min(a.ppo_micro_batch_size, mini // workers):
        raise ConfigError("actor.ppo_micro_batch_size", a.ppo_micro_batch_size,
                          "with fsdp2 every worker must run the same number of forwards: make the per-worker "
                          f"mini-batch ({mini // workers}) a multiple of the micro-batch")


def _check_model_against_run(cfg: PixelRLConfig) -> None:
    """The family takes these options and this resolution; the folder exists and agrees; the
    step fits the machine (needs the model's shape: last)."""
    from pixelrl.core.assets import resolve
    from pixelrl.models.loader import check_image_side, model_family

    m, r = cfg.model, cfg.rollout
    if not m.path:
        raise ConfigError("model.path", m.path, "set it to a local diffusers pipeline folder")
    folder, family = Path(resolve(str(m.path))), model_family(m.type)
    family.check_options(m.max_sequence_length, m.num_frames, folder if folder.is_dir() else None)
    check_image_side(family, folder, r.resolution, "rollout.resolution")
    if r.condition_resolution:
        check_image_side(family, folder, r.condition_resolution, "rollout.condition_resolution",
                         "this model's condition images")
    m.check_folder()
    if method_of(cfg).rescores_transitions:  # its trained steps lie in the window range
        family.check_trained_steps(folder, m.trained_experts, r.num_steps,
                                   window_span(r.num_steps, r.sde_window_size, r.sde_window_range, r.sde_window_schedule))
    from pixelrl.config.step_size import check_step_size

    check_step_size(cfg)


def check_lr_schedule(cfg: PixelRLConfig, frozen_steps: int = 0) -> None:
    """A cosine lr (actor.lr_schedule) decays over the actor's optimizer steps of the whole run (after `frozen_steps` training steps without an actor update), which
    must outlast the warm-up."""
    from pixelrl.engine.config import actor_optimizer_steps, optimizer_steps_per_rollout

    a, t = cfg.actor, cfg.trainer
    actor_steps = actor_optimizer_steps(cfg, frozen_steps)
    if a.warmup_ratio and actor_steps <= 0:
        raise ConfigError("actor.warmup_ratio", a.warmup_ratio, "is a share of the run's optimizer steps, which "
                          "trainer.total_training_steps = 0 leaves uncounted: set the run's length in steps, or "
                          "use actor.warmup_steps")
    warmup = a.warmup_steps_of(actor_steps)
    if a.lr_schedule == "cosine" and actor_steps <= warmup:
        raise ConfigError("trainer.total_training_steps", t.total_training_steps,
                          f"a cosine lr decays over the actor's optimizer steps ({actor_steps} in this run: "
                          f"{optimizer_steps_per_rollout(cfg)} per training step"
                          + (f", none in the {frozen_steps} of vlm.freezing_actor_steps" if frozen_steps else "")
                          + f"), which must outnumber the warm-up's ({warmup}): train longer")


def _check_whole_groups(cfg: PixelRLConfig) -> None:
    """A loss that sums over each prompt group (DGPO) sees whole groups in every micro-batch: each
    worker's share, each mini-batch and each micro-batch hold whole groups of rollout.n images,
    and no sample is dropped from its group."""
    r, a, t, name = cfg.rollout, cfg.actor, cfg.trainer, cfg.diffusion_loss.name
    if r.n < 2:
        raise ConfigError("rollout.n", r.n, f"{name} compares the images of a prompt's group: use rollout.n >= 2")
    if cfg.algorithm.drop_zero_advantage:
        raise ConfigError("algorithm.drop_zero_advantage", True, f"{name} needs every image of a group (its "
                          "group sums); set algorithm.drop_zero_advantage=false, as the reference keeps them")
    workers, named = t.data_workers, t.data_workers_named
    if cfg.data.train_batch_size % workers:
        raise ConfigError("data.train_batch_size", cfg.data.train_batch_size, f"{name} keeps prompt groups whole on "
                          f"each worker: use a multiple of {named}={workers}")
    images = cfg.data.train_batch_size * r.n
    per_worker_mini = (a.ppo_mini_batch_size or images) // workers
    if per_worker_mini % r.n or per_worker_mini * workers != (a.ppo_mini_batch_size or images):
        raise ConfigError("actor.ppo_mini_batch_size", a.ppo_mini_batch_size, f"{name} needs whole prompt groups in "
                          f"each optimizer step on each worker: a multiple of rollout.n x {named} = "
                          f"{r.n * workers}")
    if a.ppo_micro_batch_size != AUTO and a.ppo_micro_batch_size % r.n:
        raise ConfigError("actor.ppo_micro_batch_size", a.ppo_micro_batch_size, f"{name} sums over whole prompt "
                          f"groups in each forward: use a multiple of rollout.n={r.n}")


def _check_reward_gpus(cfg) -> None:
    """Reward workers are Ray actors: several of them need Ray, and with their own GPUs the pool
    placement and GPUs to be had; otherwise Ray would wait forever for a GPU no node offers."""
    import os

    if cfg.reward.num_workers > 1 and cfg.trainer.backend != "ray":
        raise ConfigError("reward.num_workers", cfg.reward.num_workers, "trainer.backend=local scores the rewards "
                          "in this process, one batch at a time: set reward.num_workers=1, or trainer.backend=ray for "
                          "reward workers that score shards in parallel")
    gpus = cfg.reward.num_gpus
    if gpus == 0:
        return
    if cfg.reward.placement != "pool" or cfg.trainer.backend != "ray":
        raise ConfigError("reward.num_gpus", gpus, "GPUs of its own are for reward workers in their own pool: set "
                          "reward.placement=pool and trainer.backend=ray (or reward.num_gpus=0)")
    import torch

    if not (cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS")) and torch.cuda.device_count() == 0:
        raise ConfigError("reward.num_gpus", gpus, "this machine has no GPU and no Ray cluster is named: join one "
                          "(trainer.ray_address) or set reward.num_gpus=0")


def _check_gpus_here(cfg: PixelRLConfig) -> None:
    """Ray workers on a cluster this run starts on this machine (no trainer.ray_address or
    $RAY_ADDRESS) take this machine's GPUs, one each (the actors, and the diffusion trainers'
    rollout pool): more of them than GPUs is refused before the run folder exists, where Ray
    would wait forever for a placement no node offers."""
    import os

    import torch

    t = cfg.trainer
    if t.backend != "ray" or torch.device(cfg.model.device).type != "cuda" or t.ray_address \
            or os.environ.get("RAY_ADDRESS"):
        return
    rollout = cfg.rollout.n_workers if cfg.algorithm.trainer_type in METHODS else 0
    have = torch.cuda.device_count()
    if t.n_workers + rollout <= have:
        return
    pool = f" and {rollout} rollout worker(s)" if rollout else ""
    if have == 0:
        fix = ("join a Ray cluster with GPUs (trainer.ray_address), or train here on the CPU "
               "(model.device=cpu)")
    elif have > rollout:
        fix = (f"set trainer.n_workers={have - rollout} (`pixelrl plan --gpus {have - rollout}` keeps "
               "the recipe's batch through gradient accumulation)"
               + (", or trainer.backend=local for one GPU in this process" if have == 1 else "")
               + ", or join a Ray cluster with more GPUs (trainer.ray_address)")
    elif have > 1:
        fix = (f"the rollout pool leaves no GPU for the actor: set rollout.n_workers={have - 1} or fewer, or join a "
               "Ray cluster with more GPUs (trainer.ray_address)")
    else:
        fix = ("sampling ahead keeps a GPU for the rollout pool beside the actor's: on one GPU train with "
               "trainer.mode=sync and rollout.n_workers=0, or join a Ray cluster with more GPUs (trainer.ray_address)")
    raise ConfigError("trainer.n_workers", t.n_workers, f"each of the {t.n_workers} actor worker(s){pool} takes a "
                      f"GPU of its own (model.device=cuda), and this machine has {have} GPU(s) for the Ray cluster "
                      f"started here: {fix}")
