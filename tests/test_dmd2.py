"""DMD2 (`distribution_matching`, loss `dmd2`): its formulas by hand, the two trained roles on one
base (disjoint, each with its own optimizer and counters), the cycle, the config's checks, exact
resume, and a tiny run whose 4-step student lands closer to the teacher than the base's 4 steps."""

import pytest
import torch
from conftest import assert_learned, tiny_config

from pixelrl.algos.distribution_matching import (DMD2Params, draw_score_sigmas, fake_score_loss, guided_velocity,
                                                 student_loss, update_cycle)
from pixelrl.core.batch import Batch
from pixelrl.core.errors import ConfigError


def test_student_loss_by_hand_and_its_gradient_is_g():
    """Z = max(mean_nonbatch |x_g - x_real|, 1e-6); g = (x_fake - x_real) / Z; L = 0.5 mean(g^2) in
    value, and dL/dx_g = g / numel."""
    gen = torch.Generator().manual_seed(0)
    x_g = torch.randn(3, 4, 2, 2, generator=gen).requires_grad_(True)
    x_real, x_fake = torch.randn(3, 4, 2, 2, generator=gen), torch.randn(3, 4, 2, 2, generator=gen)
    loss, metrics = student_loss(x_g, x_real, x_fake)
    g = torch.stack([(x_fake[i] - x_real[i]) / (x_g[i].detach() - x_real[i]).abs().mean() for i in range(3)])
    assert float(loss.detach()) == pytest.approx(0.5 * float((g ** 2).mean()), rel=1e-6)
    loss.backward()
    assert torch.allclose(x_g.grad * x_g.numel(), g, rtol=1e-5, atol=1e-6)
    # a sample equal to the teacher's x0 divides by the floor, not by zero
    same = x_real.clone().requires_grad_(True)
    loss, _ = student_loss(same, x_real, x_real + 1e-3)
    assert torch.isfinite(loss) and float(loss.detach()) == pytest.approx(0.5 * (1e-3 / 1e-6) ** 2, rel=1e-3)


def test_fake_score_loss_is_flow_matching_on_the_detached_sample():
    gen = torch.Generator().manual_seed(1)
    v, eps = torch.randn(2, 3, 4, generator=gen).requires_grad_(True), torch.randn(2, 3, 4, generator=gen)
    x_g = torch.randn(2, 3, 4, generator=gen).requires_grad_(True)
    loss = fake_score_loss(v, eps, x_g)
    assert float(loss.detach()) == pytest.approx(float(((v - (eps - x_g)) ** 2).mean()), rel=1e-6)
    loss.backward()
    assert x_g.grad is None and torch.allclose(v.grad, 2 * (v - (eps - x_g)).detach() / v.numel())


def test_teacher_guidance_and_its_layer_norm_rescale():
    """v = v_neg + w (v_pos - v_neg); layer_norm scales each channel vector to |v_pos| (verl-omni),
    channels last for packed tokens, axis 1 for [B, C, H, W]."""
    v_pos = torch.tensor([[[3.0, 4.0]]])  # [B=1, L=1, C=2], |v_pos| = 5
    v_neg = torch.tensor([[[1.0, 0.0]]])
    plain = guided_velocity(v_pos, v_neg, 2.0, "none")
    assert plain.tolist() == [[[5.0, 8.0]]]
    scaled = guided_velocity(v_pos, v_neg, 2.0, "layer_norm")
    assert torch.allclose(scaled, plain * 5.0 / (25.0 + 64.0) ** 0.5)
    image = guided_velocity(v_pos.reshape(1, 2, 1, 1), v_neg.reshape(1, 2, 1, 1), 2.0, "layer_norm")
    assert torch.allclose(image.flatten(), scaled.flatten())
    assert guided_velocity(v_pos, None, 4.0, "layer_norm") is v_pos  # a family without a negative branch


def _standard_cfg_transcribed(cond, uncond, scale):
    """verl-omni's `standard_cfg` with cfg_norm=layer_norm, on packed tokens [B, L, D]."""
    cond, uncond = cond.float(), uncond.float()
    guided = uncond + scale * (cond - uncond)
    return guided * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(guided, dim=-1, keepdim=True).clamp_min(1e-12))


def test_layer_norm_rescale_acts_on_qwen_images_packed_tokens_as_verl_omni():
    """Qwen-Image's denoiser sees 2 x 2 x 16 = 64-value tokens: the rescale on pixelrl's unpacked
    [B, 16, h, w] latents equals verl-omni's on the pipeline's packed tokens, and differs from a
    per-latent-cell rescale on correlated velocities."""
    from diffusers import QwenImagePipeline

    from pixelrl.models.qwen_image.model import QwenImageModel

    gen = torch.Generator().manual_seed(3)
    shared = torch.randn(2, 16, 6, 8, generator=gen)
    v_pos = shared + 0.3 * torch.randn(2, 16, 6, 8, generator=gen)
    v_neg = shared + 0.3 * torch.randn(2, 16, 6, 8, generator=gen)

    def pack(v):
        return QwenImagePipeline._pack_latents(v, 2, 16, 6, 8)

    reference = _standard_cfg_transcribed(pack(v_pos), pack(v_neg), 4.0)
    ours = guided_velocity(v_pos, v_neg, 4.0, "layer_norm", QwenImageModel.guidance_token_patch)
    assert torch.allclose(pack(ours), reference, rtol=1e-5, atol=1e-6)
    per_cell = guided_velocity(v_pos, v_neg, 4.0, "layer_norm")
    assert float((per_cell - ours).abs().max()) > 1e-2
    with pytest.raises(ValueError, match="divisible by 2"):
        guided_velocity(v_pos[:, :, :5], v_neg[:, :, :5], 4.0, "layer_norm", 2)


def _leaked_index_bits(sigma, eps, shift):
    """How often a row's score-sigma index mod 8 is read back from its noise: on one Mersenne-Twister
    stream the index is the first 32-bit draw mod 1000, whose low 3 bits are the low bits of the first
    uniform that Box-Muller turned into the noise values 0 and 8 (torch's 16-wide normal fill)."""
    s = sigma.double()
    index = (s / (shift - (shift - 1) * s) * 1000).round().long()
    first_uniform = 1 - torch.exp(-(eps[:, 0].double() ** 2 + eps[:, 8].double() ** 2) / 2)
    return float(((first_uniform * 2 ** 24).round().long() % 8 == index % 8).double().mean())


def test_score_sigma_and_noise_come_from_independent_streams(tiny_pixel_path):
    """A row's score noise says nothing of its score sigma (verl-omni draws them from separate
    streams); the same attack on one shared stream, as the code had, reads the index back."""
    engine, _ = _dmd2_engine(tiny_pixel_path)
    p, n = engine.objective.params, 400
    rows = Batch({}, {"prompts": ["a"] * n, "seeds": list(range(n))})
    sigma, eps = engine.objective._score_noise(rows, torch.zeros(n, 64))
    assert _leaked_index_bits(sigma, eps, p.shift) < 0.25  # chance: 1/8
    low, high = p.score_sigma_range
    one_stream = [torch.Generator().manual_seed(s) for s in range(n)]
    shared_sigma = torch.cat([draw_score_sigmas(1, g, timesteps=p.score_timesteps, shift=p.shift, low=low, high=high)
                              for g in one_stream])
    shared_eps = torch.cat([torch.randn(1, 64, generator=torch.Generator().manual_seed(s)) for s in range(n)])
    assert _leaked_index_bits(shared_sigma, shared_eps, p.shift) > 0.6  # the attack works on this torch


def test_score_sigmas_on_the_shifted_grid_clamped_or_uniform():
    gen = torch.Generator().manual_seed(0)
    s = draw_score_sigmas(4000, gen, timesteps=1000, shift=3.0, low=0.02, high=0.98)
    assert float(s.min()) == pytest.approx(0.02) and float(s.max()) == pytest.approx(0.98)
    inside = s[(s > 0.02) & (s < 0.98)].double()
    j = inside / (3 - 2 * inside) * 1000  # inverse shift: j / T
    assert torch.allclose(j, j.round(), atol=1e-3)  # integer grid points
    assert float((s > 0.5).double().mean()) > 0.7  # shift 3 puts 3/4 of the draws above 0.5
    u = draw_score_sigmas(4000, gen, timesteps=0, shift=3.0, low=0.02, high=0.98)
    assert 0.02 <= float(u.min()) and float(u.max()) <= 0.98 and float((u > 0.5).double().mean()) == pytest.approx(0.5, abs=0.04)


def test_cycle_order_and_counts_and_params_checks():
    assert update_cycle(DMD2Params()) == ["student", "fake_score", "fake_score"]  # verl-omni
    assert update_cycle(DMD2Params(cycle=["fake_score"] * 5 + ["student"])) == ["fake_score"] * 5 + ["student"]
    for bad in (["student"], [], ["student", "fake_score", "critic"]):
        with pytest.raises(ConfigError, match="cycle"):
            DMD2Params(cycle=bad)
    with pytest.raises(ConfigError, match="fake_score"):
        DMD2Params(fake_score={"learning_rate": 1e-4})
    with pytest.raises(ConfigError, match="score_sigma_range"):
        DMD2Params(score_sigma_range=[0.5, 0.2])


def _dmd2_engine(path, lr=1e-3, **params):
    from pixelrl.engine import PolicyEngine
    from pixelrl.models import load_model

    cfg = tiny_config(path, algorithm__trainer_type="distribution_matching", rollout__num_steps=4,
                      rollout__sigma_schedule="linspace_shift", rollout__sigma_shift=3.0, rollout__noise_level=0.0)
    cfg.actor.lr = lr
    cfg.diffusion_loss.name = "dmd2"
    cfg.diffusion_loss.params = {"teacher_guidance": 1.0, "fake_score": {"lr": 3e-3}, **params}
    model = load_model(cfg.model.type, cfg.model.path, max_sequence_length=0)
    return PolicyEngine(model, cfg), cfg


def _attempt_rows(offset=0, exit_index=2):
    prompts = ["a red circle", "two blue squares", "a green tree", "a flower"]
    return Batch({}, {"prompts": prompts, "seeds": [offset + i for i in range(4)]}, {"exit_index": exit_index})


def _adapter(engine, name):
    from pixelrl.models.lora import adapter_params

    return {k: v.detach().clone() for k, v in adapter_params(engine.model.transformer, name).items()}


def test_two_roles_on_one_base_stay_disjoint(tiny_pixel_path):
    """The student's grid is [1, .9, .75, .5, 0]; a student attempt moves the student only, a fake
    attempt the fake score only, each counted by its own optimizer; a gradient left on the other
    role's adapter is refused."""
    engine, _ = _dmd2_engine(tiny_pixel_path)
    assert torch.allclose(engine.sigmas, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]))
    student, fake = _adapter(engine, "default"), _adapter(engine, "fake_score")
    assert all(torch.equal(student[k], fake[k]) for k in student)  # the fake score starts as the student
    out = engine.train_role("fake_score", _attempt_rows())
    assert out["fake_score/grad_norm"] > 0 and out["fake_score/lr"] == pytest.approx(3e-3)
    assert all(torch.equal(student[k], v) for k, v in _adapter(engine, "default").items())
    moved_fake = _adapter(engine, "fake_score")
    assert any(not torch.equal(fake[k], moved_fake[k]) for k in fake)
    out = engine.train_role("student", _attempt_rows(10))
    assert out["student/grad_norm"] > 0 and out["student/lr"] == pytest.approx(1e-3)
    assert all(torch.equal(moved_fake[k], v) for k, v in _adapter(engine, "fake_score").items())
    assert any(not torch.equal(student[k], v) for k, v in _adapter(engine, "default").items())
    assert engine.counters()["policy_version"] == 1 and engine.counters()["roles"]["fake_score"]["steps"] == 1
    for param in engine.objective.fake_parameters():
        param.grad = torch.zeros_like(param)
    with pytest.raises(RuntimeError, match="disjoint"):
        engine.train_role("student", _attempt_rows(20))


def test_a_fake_score_attempt_trains_on_the_students_sample_not_its_own(tiny_pixel_path, monkeypatch):
    """With the two adapters made to differ, the x_g a fake-score attempt fits is the student's
    exit-step x0 estimate (verl-omni's student_sample, Flow-Factory's generator variant), not the
    fake adapter's: the fake score must describe the student's distribution."""
    import pixelrl.engine.distribution_matching as dm

    engine, _ = _dmd2_engine(tiny_pixel_path)
    with torch.no_grad():
        for param in engine.objective.fake_parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    rows, sigmas = _attempt_rows(), engine.sigmas
    objective = engine.objective
    text = objective._encode(rows)
    with engine.policy("current"):
        of_student = objective._student_sample(rows, text, sigmas, 2, with_graph=False)
    with engine.policy("fake_score"):
        of_fake = objective._student_sample(rows, text, sigmas, 2, with_graph=False)
    assert float((of_student - of_fake).abs().max()) > 1e-2  # the test can tell the two apart
    fitted = []
    real_loss = dm.fake_score_loss

    def recording(v, eps, x_g):
        fitted.append(x_g.detach().clone())
        return real_loss(v, eps, x_g)

    monkeypatch.setattr(dm, "fake_score_loss", recording)
    out = engine.train_role("fake_score", rows)
    assert out["fake_score/grad_norm"] > 0 and len(fitted) == 1
    assert torch.allclose(fitted[0], of_student, atol=1e-6)


def test_an_attempt_does_not_depend_on_its_micro_batches(tiny_pixel_path):
    """Every draw comes from the row's seed: one micro-batch of 4 or four of 1 step alike."""
    results = []
    for micro in (4, 1):
        engine, _ = _dmd2_engine(tiny_pixel_path)
        engine.cfg.actor.ppo_micro_batch_size = micro
        engine.train_role("fake_score", _attempt_rows())
        results.append(_adapter(engine, "fake_score"))
    assert all(torch.allclose(results[0][k], results[1][k], atol=1e-6) for k in results[0])


@pytest.mark.parametrize("override, field", [
    ("rollout.sigma_schedule=scheduler rollout.sigma_shift=0", "rollout.sigma_schedule"),
    ("rollout.noise_level=0.7", "rollout.noise_level"),
    ("model.lora_rank=0", "model.lora_rank"),
    ("diffusion_loss.kl_coef=0.1", "diffusion_loss.kl_coef"),
    ("diffusion_loss.params.cycle=[student,student]", "diffusion_loss.params.cycle"),
    # a param of another kind than its default's is named, not a raw TypeError from a comparison
    ("diffusion_loss.params.cycle=null", "diffusion_loss.params.cycle"),
    ("diffusion_loss.params.shift=fast", "diffusion_loss.params.shift"),
    ("diffusion_loss.params.score_timesteps=1000.5", "diffusion_loss.params.score_timesteps"),
    ("diffusion_loss.params.reuse_rollout=null", "diffusion_loss.params.reuse_rollout"),
    ("diffusion_loss.params.teacher_guidance=null", "diffusion_loss.params.teacher_guidance"),
    ("algorithm.trainer_type=transition", "diffusion_loss.name"),
])
def test_config_refuses_what_dmd2_cannot_run(tmp_path, override, field):
    from pixelrl.config import load_config

    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(ConfigError) as err:
        load_config("dmd2_tiny", [f"model.path={tmp_path}", *override.split(" ")])
    assert err.value.field == field


def _train(tmp_path, model_path, *overrides):
    from pixelrl.cli import main

    code = main(["train", "--config-name", "dmd2_tiny", f"model.path={model_path}", "trainer.backend=local",
                 f"trainer.default_local_dir={tmp_path}", "trainer.num_cpus_per_worker=1", *overrides])
    return code, tmp_path / "pixelrl" / "dmd2_tiny"


def test_resume_mid_run_is_exact_for_both_roles(tmp_path, tiny_pixel_path, capsys):
    """4 steps straight, or 2 then a restart to 4: the student, its EMA and the fake score end
    bitwise equal; a resume with another cycle is refused before any worker starts."""
    from safetensors.torch import load_file

    common = ["trainer.total_training_steps=4", "trainer.save_freq=2", "actor.ema_decay=0.9"]
    assert _train(tmp_path / "straight", tiny_pixel_path, *common)[0] == 0
    assert _train(tmp_path / "split", tiny_pixel_path, *common, "trainer.total_training_steps=2")[0] == 0
    code, run = _train(tmp_path / "split", tiny_pixel_path, *common)
    assert code == 0
    for name in ("trainable.safetensors", "ema.safetensors", "roles/fake_score/trainable.safetensors"):
        a = load_file(str(tmp_path / "straight/pixelrl/dmd2_tiny/checkpoints/global_step_4/actor" / name))
        b = load_file(str(run / "checkpoints/global_step_4/actor" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    code, _ = _train(tmp_path / "split", tiny_pixel_path, *common, "trainer.total_training_steps=6",
                     "diffusion_loss.params.cycle=[fake_score,student]")
    assert code == 2 and "diffusion_loss.params.cycle" in capsys.readouterr().err


def test_the_dmd2_presets_keep_their_references_schedules():
    """dmd2_qwen_image as verl-omni's launcher and DiffusionDMDConfig: 8 prompts per attempt, 1024
    tokens, one student and two fake-score steps per step, the fake score's schedule twice the
    student's, a constant 0.999 EMA, non-finite attempts skipped; dmd2_sd35 as Flow-Factory's
    optimize(): one rollout replayed by five fake-score attempts and one student attempt."""
    from pixelrl.config.validation import compose_config
    from pixelrl.engine.config import actor_optimizer_steps

    qwen = compose_config("dmd2_qwen_image")
    assert (qwen.data.train_batch_size, qwen.rollout.n, qwen.model.max_sequence_length) == (8, 1, 1024)
    assert actor_optimizer_steps(qwen) == 1000 and actor_optimizer_steps(qwen, role="fake_score") == 2000
    assert (qwen.actor.ema_decay, qwen.actor.ema_warmup, qwen.actor.max_consecutive_nonfinite) == (0.999, False, 0)
    sd35 = compose_config("dmd2_sd35")
    assert sd35.diffusion_loss.params["reuse_rollout"] is True
    assert update_cycle(DMD2Params(**dict(sd35.diffusion_loss.params))) == ["fake_score"] * 5 + ["student"]


def test_the_cycle_draws_one_exit_step_per_attempt_and_fresh_seeds():
    from pixelrl.config.validation import compose_config
    from pixelrl.trainers.distribution_matching import attempt_request

    cfg = compose_config("dmd2_tiny", ["diffusion_loss.params.cycle=[fake_score,fake_score,fake_score,student]",
                                      "rollout.num_steps=2"])
    rows = {"prompts": ["a", "b"], "metadata": [{}, {}], "data_sources": ["x", "y"]}
    requests = [attempt_request(rows, step, attempt, cfg) for step in (1, 2) for attempt in range(4)]
    seeds = [s for r in requests for s in r["seeds"]]
    assert len(set(seeds)) == len(seeds) == 8 * 2 * cfg.rollout.n  # no two attempts of the run share a seed
    assert all(0 <= r.info["exit_index"] < 2 for r in requests)
    assert len({r.info["exit_index"] for r in requests}) == 2  # both steps of the 2-step grid are drawn
    assert requests[0]["data_sources"] == ["x", "x", "y", "y"]  # a teacher routes by each row's source


def test_reuse_rollout_replays_one_rollout_across_the_cycle_with_fresh_score_draws():
    """Flow-Factory's one rollout per iteration: every attempt of a step takes the first attempt's
    prompts and seeds (so the same initial noises and student samples), draws its own exit step
    and its own score stream; the loader gives one batch per step, not one per attempt."""
    from pixelrl.config.validation import compose_config
    from pixelrl.trainers.distribution_matching import attempt_request, train_distribution_matching

    cycle = "diffusion_loss.params.cycle=[fake_score,fake_score,fake_score,fake_score,fake_score,student]"
    cfg = compose_config("dmd2_tiny", [cycle, "diffusion_loss.params.reuse_rollout=true"])
    rows = {"prompts": ["a", "b"], "metadata": [{}, {}], "data_sources": ["x", "x"]}
    requests = [attempt_request(rows, 3, attempt, cfg) for attempt in range(6)]
    assert all(r["seeds"] == requests[0]["seeds"] and r["prompts"] == requests[0]["prompts"] for r in requests)
    assert [r.info["score_stream"] for r in requests] == list(range(6))
    assert len({r.info["exit_index"] for r in requests}) > 1
    fresh = compose_config("dmd2_tiny", [cycle])
    assert len({tuple(attempt_request(rows, 3, a, fresh)["seeds"]) for a in range(6)}) == 6
    assert "score_stream" not in attempt_request(rows, 3, 0, fresh).info

    class Actor:
        size = 1

        def __init__(self):
            self.requests = []

        def call(self, verb, *args, gather=None):
            if verb == "counters":
                return {"policy_version": 0}
            self.requests.append(args[0])
            return {f"{args[1]}/loss": 0.0}

    for config, drawn in ((cfg, 1), (fresh, 6)):
        pulled, actor = [], Actor()
        train_distribution_matching(actor, lambda: pulled.append(1) or rows, 3, config)
        assert len(pulled) == drawn and len(actor.requests) == 6


def test_attempts_replaying_one_rollout_draw_their_own_score_noise(tiny_pixel_path):
    engine, _ = _dmd2_engine(tiny_pixel_path)
    rows = _attempt_rows()
    like = torch.zeros(len(rows), 3, 32, 32)
    plain = engine.objective._score_noise(rows, like)
    rows.info["score_stream"] = 0
    first = engine.objective._score_noise(rows, like)
    rows.info["score_stream"] = 1
    second = engine.objective._score_noise(rows, like)
    assert not torch.equal(first[1], second[1]) and not torch.equal(plain[1], first[1])


def test_dmd2_pulls_the_4_step_student_toward_the_teacher(tiny_pixel_path):
    """The teacher (the base, 20 Euler steps) and the student (4 steps) from the same noises: after
    60 cycles the student's samples sit closer to the teacher's than the base's own 4 steps do."""
    from pixelrl.sampling.rollout import SamplingSettings

    engine, _ = _dmd2_engine(tiny_pixel_path, lr=1e-4, fake_score={"lr": 1e-3})
    prompts = ["a red circle", "two blue squares", "a cat on a house", "a green tree", "a yellow star",
               "a car in the city", "three purple triangles", "a flower"]
    held = [p for p in prompts for _ in range(4)]
    seeds = list(range(10_000, 10_000 + len(held)))
    ode = SamplingSettings(noise_level=0.0, guidance_scale=1.0)

    def distance_to_teacher(policy):
        x = engine.rollout(held, seeds, settings=ode, num_steps=4, policy=policy)["x0"]
        return float(((x - teacher) ** 2).mean())

    teacher = engine.rollout(held, seeds, settings=ode, num_steps=20, policy="reference")["x0"]
    base = distance_to_teacher("reference")
    gen = torch.Generator().manual_seed(0)
    for step in range(60):
        for attempt, role in enumerate(update_cycle(DMD2Params())):
            pick = torch.randint(0, len(prompts), (4,), generator=gen).tolist()
            engine.train_role(role, Batch({}, {"prompts": [prompts[i] for i in pick for _ in range(2)],
                                               "seeds": [step * 100 + attempt * 10 + j for j in range(8)]},
                                          {"exit_index": int(torch.randint(0, 4, (1,), generator=gen))}))
    student = distance_to_teacher("current")
    # relative closeness (1 - student / base): 0.192 under the no-vector and AVX2 kernels of a 2-core AMD EPYC
    # (0.185 before the fake score fitted the student's samples)
    assert_learned(0.0, 1 - student / base, 0.08, base, student)


@pytest.mark.slow  # ~30 s: two Ray workers; the attempt's math is tested in one process above
def test_two_ray_workers_under_fsdp2_train_both_roles_as_one_process_does(ray_cluster, tmp_path, tiny_pixel_path):
    """Two adapters on one base sharded by FSDP2 over two workers: each role's gradients reach
    only its own shards, and both roles end where one process ends (up to float reordering)."""
    from safetensors.torch import load_file

    steps = ["trainer.total_training_steps=2", "trainer.save_freq=2"]
    assert _train(tmp_path / "one", tiny_pixel_path, *steps)[0] == 0
    code, run = _train(tmp_path / "fsdp2", tiny_pixel_path, *steps, "trainer.backend=ray", "trainer.n_workers=2",
                       "trainer.strategy=fsdp2")
    assert code == 0
    for name in ("trainable.safetensors", "roles/fake_score/trainable.safetensors"):
        a = load_file(str(tmp_path / "one/pixelrl/dmd2_tiny/checkpoints/global_step_2/actor" / name))
        b = load_file(str(run / "checkpoints/global_step_2/actor" / name))
        assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a), name
        assert any(float(a[k].abs().max()) > 0 for k in a if "lora_B" in k)  # trained, not the zero init


def test_an_exported_student_samples_alike_in_pixelrl_generate_and_in_the_printed_diffusers(tmp_path, tiny_sd3_path,
                                                                                            capsys):
    """The export writes how the student samples (4 steps of its grid, no guidance) beside it and
    prints the plain diffusers lines that sample it; those lines, run as printed (for the pipeline
    folder and for the adapter on its base), draw the images `pixelrl generate` draws."""
    import json

    import numpy as np

    from pixelrl.cli import main
    from pixelrl.engine.evaluate import generate
    from pixelrl.models.loader import load_folder_model

    code, run = _train(tmp_path, tiny_sd3_path, "model.max_sequence_length=8", "trainer.total_training_steps=2",
                       "trainer.save_freq=2", "actor.lr=0.05")
    assert code == 0
    capsys.readouterr()
    model = None
    for name, flags in (("student", []), ("adapter", ["--adapter-only"])):
        out = tmp_path / name
        assert main(["export", str(run / "checkpoints/global_step_2"), str(out), *flags]) == 0
        printed = capsys.readouterr().out.split("in plain diffusers:\n", 1)[1]
        assert "sigmas=[1.0, 0.9, 0.75, 0.5]" in printed and "num_inference_steps=4" in printed
        sampler = json.loads((out / "pixelrl_sampler.json").read_text())
        assert (sampler["num_steps"], sampler["sigma_schedule"], sampler["sigma_shift"]) == (4, "linspace_shift", 3.0)
        namespace: dict = {}
        exec("\n".join(line[4:] for line in printed.splitlines()), namespace)  # the user's copy-paste
        theirs = np.asarray(namespace["sample"], dtype=np.int16)
        if model is None:
            model = load_folder_model(out)
            ours = generate(model, ["a red circle"], [0], num_steps=4, guidance_scale=1.0, resolution=32,
                            sigma_schedule="linspace_shift", sigma_shift=3.0)[0].numpy().astype(np.int16)
        assert theirs.shape == ours.shape and np.abs(theirs - ours).max() <= 3, name


def test_the_teacher_is_the_rows_data_source_lora_guided_in_one_forward(tiny_pixel_path, tmp_path):
    """With `diffusion_loss.teacher: {a: <LoRA folder>, "*": base}`, rows of source `a` get the
    LoRA teacher's guided velocity and the others the base's, each equal to the CFG formula on that
    network's two branches; the student's adapter is active again after."""
    from test_distillation import _holding, _teacher_folder

    from pixelrl.algos.distribution_matching import guided_velocity

    probe, _ = _dmd2_engine(tiny_pixel_path)
    state = _teacher_folder(probe, tmp_path / "teacher", scale=0.5)
    engine, cfg = _dmd2_engine(tiny_pixel_path, teacher_guidance=3.0)
    engine.cfg.diffusion_loss.teacher = {"a": str(tmp_path / "teacher"), "*": "base"}
    engine, _ = _rebuilt(engine)
    rows = Batch({}, {"prompts": ["a red circle", "a flower", "a green tree"], "seeds": [1, 2, 3],
                      "data_sources": ["a", "b", "a"]})
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, *engine.model.latent_shape(32, 32), generator=gen)
    sigma = torch.tensor([0.3, 0.6, 0.9])
    with torch.no_grad():
        got = engine.objective._teacher_velocity(rows, x, sigma)

    def guided(model_engine, i, policy):
        text = model_engine.model.encode_prompts([rows["prompts"][i]])
        negative = model_engine.model.encode_prompts([""])
        with torch.no_grad(), model_engine.policy(policy):
            v_pos = model_engine.model.predict_velocity(x[i:i + 1], sigma[i:i + 1], text)
            v_neg = model_engine.model.predict_velocity(x[i:i + 1], sigma[i:i + 1], negative)
        return guided_velocity(v_pos, v_neg, 3.0, "layer_norm")

    lora_teacher = _holding(_dmd2_engine(tiny_pixel_path)[0], state)
    for i, expected in ((0, guided(lora_teacher, 0, "current")), (1, guided(engine, 1, "reference")),
                        (2, guided(lora_teacher, 2, "current"))):
        # up to float reordering between the one forward of both branches and these separate ones
        assert torch.allclose(got[i:i + 1], expected, atol=2e-3), (i, float((got[i:i + 1] - expected).abs().max()))
    moved = float((got[0:1] - guided(engine, 0, "reference")).abs().max())
    assert moved > 0.05, moved  # the LoRA teacher, not the base
    assert engine.model.transformer.active_adapters() == ["default"]


def _rebuilt(engine):
    """A fresh engine from `engine`'s (edited) config."""
    from pixelrl.engine import PolicyEngine
    from pixelrl.models import load_model

    cfg = engine.cfg
    return PolicyEngine(load_model(cfg.model.type, cfg.model.path, max_sequence_length=0), cfg), cfg
