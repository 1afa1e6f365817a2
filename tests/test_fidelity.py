"""Fidelity to the reference implementations: update schedules of the paper configs, advantage
options, zero-advantage dropping, and the engine paths that must match the references."""

import math
from types import SimpleNamespace

import pytest
import torch

from pixelrl.algos import group_advantages
from pixelrl.algos.advantages import zero_advantage_keep
from pixelrl.core.batch import Batch
from conftest import paper_config
from pixelrl.config import load_config
from pixelrl.engine.config import optimizer_steps_per_rollout
from pixelrl.core.errors import ConfigError

# optimizer steps per rollout batch in each method's reference code
PAPER_SCHEDULES = {
    "flow_grpo_sd35": 2,       # flow_grpo config: gradient_accumulation_steps = num_batches_per_epoch // 2
    "flow_grpo_fast_sd35": 2,
    "grpo_guard_sd35": 2,
    "flow_dppo_sd35": 2,
    "dance_grpo_sd35": 2,      # 24 samples per GPU, accumulation 12
    "mixgrpo_sd35": 4,         # 12 samples per GPU, accumulation 3
    "nft_sd35": 1,             # DiffusionNFT: one optimizer step per epoch (GenEval)
    "sol_rl_sd35": 1,          # Sol-RL: DiffusionNFT's step on the kept samples, one per epoch
    "dpo_sd35": 1,             # verl-omni's DPO: one optimizer step per rollout batch of pairs
    "awm_sd35": 1,             # AWM: one step per rollout batch (its ratio is always 1)
    "dgpo_sd35": 4,            # DGPO: 2 sample batches x 4 timesteps, accumulation 2 (config/dgpo.py)
    "flow_grpo_flux": 2,       # the reference's FLUX recipe: accumulation = num_batches_per_epoch // 2
    "dance_grpo_flux": 2,
    "flow_grpo_qwen_image": 2,
    "dance_grpo_wan": 2,  # the reference's Qwen-Image recipe: accumulation = num_batches_per_epoch // 2
    "flow_grpo_qwen_image_edit": 2,  # verl-omni: 32 prompts x 16, ppo_mini_batch_size 16 prompts
    "flow_grpo_flux_kontext": 2,     # Flow-Factory: gradient_step_per_epoch 2
    "flow_grpo_counting_flux_kontext": 2,  # flow_grpo: 12 sample batches of 3 on 28 GPUs, accumulation 6
    "nft_qwen_image_edit": 2,        # Flow-Factory: gradient_step_per_epoch 2
}


def test_edit_paper_configs_sample_as_their_references():
    """verl-omni's Qwen-Image-Edit-2511 script (12 steps, true CFG 4, noise 0.7 on 3 of the first 6
    steps, 512 px target beside a 1024 px source, LoRA r64 / alpha 128 with the MLPs) and
    Flow-Factory's FLUX.1 Kontext preset (10 steps, guidance 2.5, noise 0.9 on one of steps 1-3,
    384 px)."""
    edit = paper_config("flow_grpo_qwen_image_edit")
    r = edit.rollout
    assert (edit.model.type, r.num_steps, r.guidance_scale, r.noise_level) == ("qwen_image_edit", 12, 4.0, 0.7)
    assert (r.sde_window_size, r.sde_window_range, r.resolution, r.condition_resolution) == (3, [0, 6], 512, 1024)
    assert (edit.model.lora_rank, edit.model.lora_alpha, edit.val_kwargs.num_steps) == (64, 128, 40)
    assert "img_mlp.net.2" in edit.model.lora_target_modules and not edit.algorithm.global_std
    kontext = paper_config("flow_grpo_flux_kontext")
    r = kontext.rollout
    assert (kontext.model.type, r.num_steps, r.guidance_scale, r.noise_level) == ("flux_kontext", 10, 2.5, 0.9)
    assert (r.sde_window_size, r.sde_window_range, r.resolution, r.condition_resolution) == (1, [1, 4], 384, 0)
    counting = paper_config("flow_grpo_counting_flux_kontext")
    r = counting.rollout
    assert (r.num_steps, r.guidance_scale, r.noise_level, r.n, r.resolution) == (6, 2.5, 0.9, 21, 512)
    assert r.sde_window_size == 0 and counting.data.train_batch_size * r.n == 1008  # 12 x 3 x 28 GPUs
    assert (counting.data.condition_fit, counting.model.max_sequence_length, counting.val_kwargs.num_steps) == \
        ("stretch", 128, 28)
    assert "proj_mlp" in counting.model.lora_target_modules and counting.algorithm.global_std
    nft = paper_config("nft_qwen_image_edit")  # Flow-Factory's rational_rewards_edit.yaml for Qwen-Image-Edit-Plus
    r, params = nft.rollout, nft.diffusion_loss.params
    assert (nft.model.type, r.num_steps, r.guidance_scale, r.noise_level, r.solver) == ("qwen_image_edit", 30, 1.0, 0.0,
                                                                                      "euler")
    assert (r.n, nft.data.train_batch_size, r.resolution, nft.val_kwargs.num_steps) == (16, 32, 512, 40)
    assert r.output_aspect == "source"  # auto_resize: each edit in its source's aspect
    assert (params["timesteps"], params["num_timesteps"], params["min_sigma"]) == ("discrete", 5, 0.3)
    assert (params["beta"], params["ref_kl_coef"], params["rollout_policy"], params["old_policy_clock"]) == \
        (1.0, 2.0e-4, "old", "updates")
    assert nft.algorithm.reward_aggregation == "gdpo" and nft.val_kwargs.weights == "old" and nft.actor.ema_decay == 0
    assert (nft.actor.lr, nft.model.lora_rank, nft.diffusion_loss.adv_clip_max) == (2.0e-4, 64, 5.0)
    from pixelrl.config.validation import compose_config  # the rewards as written (no CLIP folder here)

    rewards = compose_config("flow_grpo_counting_flux_kontext", []).reward.functions
    assert [(f["name"], f["weight"]) for f in rewards] == [("clip_source_similarity", 0.5), ("remote", 0.5)]


@pytest.mark.parametrize("name", sorted(PAPER_SCHEDULES))
def test_paper_configs_take_the_reference_number_of_optimizer_steps_per_rollout(name):
    cfg = paper_config(name)
    assert optimizer_steps_per_rollout(cfg) == PAPER_SCHEDULES[name]


def test_awm_paper_config_shares_each_timestep_draw_over_three_samples_as_the_reference():
    """train_sd3_awm.py draws one grid index per `discrete_wo_init` stratum and repeats it over
    its `config.train.batch_size` samples (`repeat_interleave(t_indices, config.train.batch_size)`),
    3 in its SD3.5 GeneEval preset, whatever pixelrl's memory micro-batch is."""
    params = paper_config("awm_sd35").diffusion_loss.params
    assert (params["timesteps"], params["num_timesteps"], params["timestep_fraction"]) == ("discrete_wo_init", 6, 0.9)
    assert params["samples_per_timestep_draw"] == 3


def test_dgpo_paper_config_samples_trains_and_evaluates_as_the_reference():
    """Luo-Yihong/DGPO at its current config: DPM-Solver++ on the flow-sigma grid with shift 3 for
    sampling and training, evaluation with the same scheduler at 14 steps (`eval_num_steps`),
    beta_dpo 100 (`geneval_sd3_4gpu`), LoRA r64 / alpha 128 (train_sd3_dgpo.py's LoraConfig), and
    its EMA reference stepped after every optimizer step."""
    cfg = paper_config("dgpo_sd35")
    assert (cfg.rollout.solver, cfg.rollout.sigma_schedule, cfg.rollout.num_steps) == ("dpm2", "dpm_flow", 10)
    assert (cfg.val_kwargs.solver, cfg.val_kwargs.num_steps, cfg.val_kwargs.noise_level) == ("dpm2", 14, 0.0)
    from pixelrl.trainers.controller import validation_settings

    assert validation_settings(cfg).solver == "dpm2"
    assert (cfg.model.lora_rank, cfg.model.lora_alpha) == (64, 128)
    from pixelrl.algos import get_loss

    options = get_loss("dgpo").bind(cfg.diffusion_loss)
    assert (options.beta_dpo, options.old_policy_refresh, options.old_policy_schedule) == (100.0, "optimizer_step", "awm")


def test_awm_paper_config_evaluates_with_the_euler_ode_at_40_steps_as_the_reference():
    """train_sd3_awm.py trains on SA-Solver samples but evaluates with `pipeline_with_logprob(...,
    num_inference_steps=eval_num_steps (40), determistic=True)`, SA-Solver off: the Euler ODE step
    at the training guidance (1.0)."""
    from pixelrl.trainers.controller import validation_settings

    cfg = paper_config("awm_sd35")
    assert cfg.rollout.solver == "sa_solver"
    settings = validation_settings(cfg)
    assert (settings.solver, settings.noise_level, settings.guidance_scale) == ("euler", 0.0, 1.0)
    assert not settings.stores_transitions
    assert cfg.val_kwargs.num_steps == 40


def test_dance_and_mix_grpo_paper_configs_normalise_per_group_like_their_references():
    for name in ("dance_grpo_sd35", "mixgrpo_sd35"):
        a = paper_config(name).algorithm
        assert (a.global_std, a.adv_std_unbiased, a.adv_eps, a.drop_zero_advantage) == (False, True, 1e-8, False)
    assert paper_config("mixgrpo_sd35").algorithm.reward_aggregation == "sum_advantages"
    assert paper_config("mixgrpo_sd35").rollout.sde_window_params["rollback"]
    assert paper_config("flow_grpo_sd35").algorithm.drop_zero_advantage


def test_unbiased_group_std_and_eps_hand_computed():
    # group x: (1, 3): mean 2, sample std sqrt(2);  group y: (0, 0, 6): mean 2, sample std sqrt(12)
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.0, 6.0])
    adv = group_advantages(rewards, ["x", "x", "y", "y", "y"], global_std=False, unbiased=True, eps=1e-8)
    s2, s12 = math.sqrt(2) + 1e-8, math.sqrt(12) + 1e-8
    assert torch.allclose(adv, torch.tensor([-1 / s2, 1 / s2, -2 / s12, -2 / s12, 4 / s12]), atol=1e-6)
    # the population std of group x would be 1: a different number
    biased = group_advantages(rewards, ["x", "x", "y", "y", "y"], global_std=False)
    assert biased[1].item() == pytest.approx(1 / 1.0001, abs=1e-6)


def test_zero_advantage_samples_are_dropped_and_refilled_to_a_multiple():
    adv = torch.tensor([0.0, 1.0, -1.0, 0.0, 0.0, 2.0, 0.0, 0.0])
    keep = zero_advantage_keep(adv, 4, torch.Generator().manual_seed(0))
    assert len(keep) == 4 and {1, 2, 5} < set(keep.tolist())  # 3 non-zero + 1 zero re-added
    assert keep.tolist() == sorted(keep.tolist())
    four = zero_advantage_keep(adv, 2, torch.Generator().manual_seed(0))
    assert len(four) == 4 and {1, 2, 5} < set(four.tolist())
    # all zero: keep one multiple so the update still runs (its KL term, if any)
    assert len(zero_advantage_keep(torch.zeros(8), 4, torch.Generator().manual_seed(0))) == 4
    assert zero_advantage_keep(torch.ones(8), 4, torch.Generator().manual_seed(0)).tolist() == list(range(8))


class _RecordingActor:
    """An actor that samples nothing: records what the producer asks of it."""

    size = 1

    def __init__(self, window_size):
        self.window_size = window_size
        self.updated = None

    def rollout(self, prompts, seeds, *, window, noise_seeds=None, policy="current", condition_images=None):
        b, w = len(prompts), window.size
        self.window = window
        return Batch({"images": torch.zeros(b, 4, 4, 3, dtype=torch.uint8), "latents": torch.zeros(b, w + 1, 1),
                      "log_probs": torch.zeros(b, w), "sigmas": torch.ones(b, w), "sigmas_next": torch.ones(b, w),
                      "step_indices": torch.tensor(window.steps()).expand(b, -1)},
                     {"prompts": list(prompts), "seeds": list(seeds)}, {"sampling": {}})

    def update(self, batch):
        self.updated = batch
        return {"pg_loss": 0.0}


def _producer_cfg(**overrides):
    from conftest import tiny_config

    cfg = tiny_config("unused", **overrides)
    cfg.data.train_batch_size = 2
    return cfg


def test_the_producer_drops_zero_advantage_samples_and_keeps_the_mini_batch_count():
    from pixelrl.testing import transition_step

    cfg = _producer_cfg(actor__ppo_mini_batch_size=4)
    actor = _RecordingActor(5)
    # prompt "a" gets equal rewards (A = 0 for its 4 images), prompt "b" differing ones
    rewards = {"a": [1.0] * 4, "b": [0.0, 1.0, 2.0, 3.0]}

    def reward_fn(images, prompts, metadata, **rows):  # groups= (the uids), as a run passes
        counters = {"a": iter(rewards["a"]), "b": iter(rewards["b"])}
        return {"overall": torch.tensor([next(counters[p]) for p in prompts])}

    _, metrics = transition_step(actor, reward_fn, ["a", "b"], [{}, {}], 1, cfg)
    assert metrics["critic/advantages/zero_frac"] == 0.5
    assert len(actor.updated) == 4 and actor.updated.info["num_mini_batches"] == 2
    assert actor.updated["prompts"] == ["b"] * 4 and metrics["training/trained_fraction"] == 0.5
    cfg.algorithm.drop_zero_advantage = False
    transition_step(actor, reward_fn, ["a", "b"], [{}, {}], 1, cfg)
    assert len(actor.updated) == 8 and actor.updated.info["num_mini_batches"] == 2


def test_awm_drops_zero_advantage_samples_too():
    from pixelrl.testing import forward_process_step

    class CleanSampleActor(_RecordingActor):
        def rollout(self, prompts, seeds, **kwargs):
            batch = super().rollout(prompts, seeds, **kwargs)
            batch["x0"] = torch.arange(len(prompts), dtype=torch.float32).reshape(-1, 1)
            return batch

    cfg = _producer_cfg(algorithm__trainer_type="forward_process", diffusion_loss__name="awm",
                        rollout__noise_level=0.0)
    rewards = {"a": [1.0] * 4, "b": [0.0, 1.0, 2.0, 3.0]}

    def reward_fn(images, prompts, metadata, **rows):  # groups= (the uids), as a run passes
        counters = {"a": iter(rewards["a"]), "b": iter(rewards["b"])}
        return {"overall": torch.tensor([next(counters[p]) for p in prompts])}

    actor = CleanSampleActor(0)
    _, metrics = forward_process_step(actor, reward_fn, ["a", "b"], [{}, {}], 1, cfg)
    assert actor.updated["prompts"] == ["b"] * 4 and actor.updated["x0"].flatten().tolist() == [4.0, 5.0, 6.0, 7.0]
    assert (actor.updated["advantages"] != 0).all() and metrics["training/trained_fraction"] == 0.5
    cfg.algorithm.drop_zero_advantage = False
    _, metrics = forward_process_step(actor, reward_fn, ["a", "b"], [{}, {}], 1, cfg)
    assert len(actor.updated) == 8 and metrics["training/trained_fraction"] == 1.0
    # the trained batch says which rows form a group (what `group_noise` shares its draws by)
    rows = list(zip(actor.updated["uids"], actor.updated["prompts"]))
    assert all((u1 == u2) == (p1 == p2) for u1, p1 in rows for u2, p2 in rows)


def test_trained_timesteps_do_not_replay_the_window_draw():
    """The window and the per-sample timestep permutation are separate random decisions."""
    from pixelrl.sampling.windows import trained_step_indices
    from pixelrl.testing import transition_step
    from pixelrl.trainers.step import step_seed

    cfg = _producer_cfg(actor__timestep_fraction=0.6, actor__permute_timesteps=True,
                        algorithm__drop_zero_advantage=False)
    actor = _RecordingActor(5)
    reward_fn = lambda images, prompts, metadata, **rows: {"overall": torch.arange(len(prompts), dtype=torch.float32)}  # noqa: E731
    same = 0
    for step in range(1, 6):
        transition_step(actor, reward_fn, ["a", "b"], [{}, {}], step, cfg)
        shared_stream = trained_step_indices(actor.window.size, 8, num_steps=6, fraction=0.6, permute=True,
                                             seed=step_seed(cfg.rollout.seed, step))
        same += torch.equal(actor.updated["train_step_index"], shared_stream)
    assert same == 0


def test_grpo_guard_takes_old_log_prob_and_old_mean_from_the_same_forward(make_engine, tiny_pixel_path):
    """On the first (on-policy) mini-batch, a rollout-time mean that drifted from the training
    forward must not enter the guard bias: both old quantities come from the current forward."""
    from pixelrl.trainers.step import compute_advantages, expand_prompts

    engine, cfg = make_engine(tiny_pixel_path, diffusion_loss__name="grpo_guard", rollout__sde_window_size=2,
                              rollout__sde_window_range=[0, 4])
    samples = expand_prompts(["a cat", "a dog"], [{}, {}], 4, seed=1)
    batch = engine.rollout(samples["prompts"], samples["seeds"])
    batch["old_means"] = batch["old_means"] + 1e-3  # kernel drift between rollout and training
    batch["uids"] = samples["uids"]
    batch["advantages"] = compute_advantages(torch.arange(8.0), batch["uids"], cfg.algorithm)
    metrics = engine.update(batch)
    assert metrics["guard_bias"] == 0.0 and metrics["ratio_mean"] == 1.0


def test_grpo_guard_with_cps_is_rejected_at_start_up():
    with pytest.raises(ConfigError, match="rollout.sde_type"):
        load_config("grpo_guard_tiny", ["rollout.sde_type=cps", "rollout.noise_level=0.8"])


def test_the_timestep_reaches_a_bf16_transformer_in_float32(tiny_pixel_path):
    from pixelrl.models import load_model

    model = load_model("sd3", tiny_pixel_path, dtype="bfloat16", max_sequence_length=0)
    seen = {}
    model.transformer.register_forward_pre_hook(lambda mod, args, kwargs: seen.update(t=kwargs["timestep"]),
                                                with_kwargs=True)
    x = torch.zeros(1, *model.latent_shape(32, 32))
    model.predict_velocity(x, torch.tensor([0.91335]), model.encode_prompts(["a cat"]))
    assert seen["t"].dtype == torch.float32 and seen["t"].item() == pytest.approx(913.35, abs=1e-3)


def test_linspace_shift_schedule_hand_computed():
    from diffusers import FlowMatchEulerDiscreteScheduler

    from pixelrl.sampling.schedule import schedule_sigmas

    # s = 1, .75, .5, .25, 0 -> 3 s / (1 + 2 s)
    model = SimpleNamespace(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    sigmas = schedule_sigmas(model, 4, "linspace_shift", 32, 32)
    assert torch.allclose(sigmas, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]))
    assert paper_config("dance_grpo_sd35").rollout.sigma_schedule == "linspace_shift"
    assert paper_config("mixgrpo_sd35").rollout.sigma_schedule == "linspace_shift"
