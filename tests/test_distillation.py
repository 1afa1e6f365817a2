"""On-policy distillation (`distill_kl`): the loss by hand, the teacher read from a LoRA folder and
replaying the student's states, the config's checks, and a tiny run pulling a student onto it."""

import pytest
import torch
from conftest import assert_learned, read_metrics, stand_in_safetensors, train_cli
from safetensors.torch import save_file

from pixelrl.algos import get_loss
from pixelrl.core.errors import ConfigError
from pixelrl.parallel.group import Mesh


def _step(seed=0, batch=3, shape=(4, 2, 2)):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(batch, *shape, generator=g).requires_grad_(True)
    std_dev_t = torch.rand(batch, 1, 1, 1, generator=g) + 0.5
    sqrt_dt = torch.rand(batch, 1, 1, 1, generator=g) * 0.3 + 0.1
    return {"mean": mean, "teacher_mean": torch.randn(batch, *shape, generator=g), "std_dev_t": std_dev_t,
            "sqrt_dt": sqrt_dt, "noise_std": std_dev_t * sqrt_dt}


@pytest.mark.parametrize("variance", ["transition", "scheduler"])
def test_distill_kl_by_hand(variance):
    """L = mean_B(mean_dims((mu - mu_t)^2) / (2 var)), var = (sigma_t sqrt(-dt))^2 (the step's
    sampled variance, Flow-Factory) or sigma_t^2 (verl-omni); dL/dmu = (mu - mu_t) / (B D var)."""
    loss_spec = get_loss("distill_kl")
    from pixelrl.algos.config import DiffusionLossConfig

    options = loss_spec.bind(DiffusionLossConfig(name="distill_kl", distill_variance=variance))
    step = _step()
    loss, metrics = loss_spec(step, options)
    loss_value = float(loss.detach())
    mu, mu_t = step["mean"].detach(), step["teacher_mean"]
    B, D = mu.shape[0], mu[0].numel()
    var = (step["std_dev_t"] * step["sqrt_dt"]) ** 2 if variance == "transition" else step["std_dev_t"] ** 2
    var = var.reshape(B)
    by_hand = sum(float(((mu[i] - mu_t[i]) ** 2).sum()) / D / (2 * float(var[i])) for i in range(B)) / B
    assert loss_value == pytest.approx(by_hand, rel=1e-6) and float(metrics["distill_kl"]) == pytest.approx(by_hand, rel=1e-6)
    loss.backward()
    expected = (mu - mu_t) / (B * D * var.reshape(B, 1, 1, 1))
    assert torch.allclose(step["mean"].grad, expected, rtol=1e-5, atol=1e-7)
    # rollout correction's rejected steps: out of the mean (mask holds kept / kept fraction)
    step = _step(1)
    step["step_mask"] = torch.tensor([1.5, 0.0, 1.5])
    loss, metrics = loss_spec(step, options)
    per = [float(((step["mean"][i].detach() - step["teacher_mean"][i]) ** 2).mean()) for i in range(3)]
    var = (step["noise_std"] if variance == "transition" else step["std_dev_t"]).reshape(3) ** 2
    per = [p / (2 * float(v)) for p, v in zip(per, var)]
    assert float(loss.detach()) == pytest.approx((per[0] + per[2]) / 2, rel=1e-6)
    assert float(metrics["distill_kl"]) == pytest.approx((per[0] + per[2]) / 2, rel=1e-6)


def _teacher_folder(engine, folder, scale=0.3, seed=7):
    """Write `engine`'s adapter, moved by Gaussian noise, where a diffusers pipeline reads a LoRA."""
    from pixelrl.engine.checkpoint import peft_key
    from pixelrl.models.lora import lora_config

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, param in engine.model.transformer.named_parameters():
        if param.requires_grad:
            state[peft_key(name)] = param.detach() + scale * torch.randn(param.shape, generator=g)
    engine.model.save_lora(folder, state, lora_config(engine.model.transformer))
    return state


def _holding(engine, state):
    """`engine` computing with the adapter weights `state` (peft names)."""
    from pixelrl.engine.checkpoint import peft_key

    with torch.no_grad():
        for name, param in engine.model.transformer.named_parameters():
            if param.requires_grad:
                param.copy_(state[peft_key(name)])
    return engine


def test_teacher_loras_replay_the_students_states_frozen_by_data_source(tiny_sd3_path, tmp_path, make_engine):
    """Teachers read from LoRA folders score the student's stored transitions exactly as engines
    whose own adapter holds those weights, each row under its data_source's teacher ("*" for the
    rest); they stay frozen, out of the trained parameters, and the student's adapter stays the
    active one. teacher=base scores as the reference."""
    holder, _ = make_engine(tiny_sd3_path)
    red = _teacher_folder(holder, tmp_path / "red_teacher", seed=7)
    other = _teacher_folder(holder, tmp_path / "other_teacher", seed=8)
    batch = holder.rollout(["a red circle", "two blue squares", "a red star"], [1, 2, 3])
    batch["data_sources"] = ["red", "blue", "red"]
    expected_red = _holding(holder, red).score(batch, "current")["old_means"]
    expected_other = _holding(holder, other).score(batch, "current")["old_means"]

    student, _ = make_engine(tiny_sd3_path, diffusion_loss__name="distill_kl", algorithm__drop_zero_advantage=False,
                             diffusion_loss__teacher={"red": str(tmp_path / "red_teacher"),
                                                      "*": str(tmp_path / "other_teacher")})
    teacher = student.score(batch, "teacher")["teacher_means"]
    assert torch.allclose(teacher[[0, 2]], expected_red[[0, 2]], atol=1e-5)
    assert torch.allclose(teacher[1], expected_other[1], atol=1e-5)
    assert not torch.allclose(teacher[1], expected_red[1], atol=1e-3)
    assert not torch.allclose(student.score(batch, "current")["old_means"], teacher, atol=1e-3)
    # under FSDP2 every rank replays every row under every teacher (the same forwards on all
    # ranks) and keeps each row's own: the same means
    student.mesh = Mesh(world_size=2, strategy="fsdp2")
    assert torch.allclose(student.score(batch, "teacher")["teacher_means"], teacher, atol=1e-5)  # other batch shapes
    student.mesh = Mesh()
    trained = {id(p) for p in student.model.trainable_parameters()}
    teacher_params = [p for n, p in student.model.transformer.named_parameters() if ".teacher_" in n]
    assert len(teacher_params) == 2 * len(trained)  # two teachers' adapters, as large as the student's
    assert not any(p.requires_grad or id(p) in trained for p in teacher_params)
    assert student.model.transformer.active_adapters() == ["default"]

    base, _ = make_engine(tiny_sd3_path, diffusion_loss__name="distill_kl", algorithm__drop_zero_advantage=False)
    assert torch.equal(base.score(batch, "teacher")["teacher_means"], base.score(batch, "reference")["ref_means"])


def _whole_teacher(engine, seed=9, scale=0.05):
    """The base denoiser's parameters, each moved by Gaussian noise: a whole fine-tune's weights."""
    g = torch.Generator().manual_seed(seed)
    return {name: param.detach().float() + scale * torch.randn(param.shape, generator=g)
            for name, param in engine.model.transformer.named_parameters()}


def test_a_whole_fine_tuned_teacher_replays_as_an_engine_holding_its_weights(tiny_sd3_path, tmp_path, make_engine):
    """A teacher that is a whole denoiser (a full fine-tune's checkpoint, read as its EMA when the
    run kept one, or a pipeline folder such as a merged export) scores the student's stored steps
    exactly as an engine whose own denoiser holds those weights, for a LoRA student and a fully
    fine-tuned one; it stays frozen and out of the trained parameters, and the student's own
    weights still compute `current`. A full student distilling from `base` keeps its reference
    copy from the start (a resumed run's first replay would otherwise copy the trained weights)."""
    import shutil

    from safetensors.torch import save_file

    holder, _ = make_engine(tiny_sd3_path, model__lora_rank=0)
    whole, ema = _whole_teacher(holder, seed=9), _whole_teacher(holder, seed=10)
    step = tmp_path / "run" / "checkpoints" / "global_step_3"
    (step / "actor").mkdir(parents=True)
    save_file(whole, str(step / "actor" / "trainable.safetensors"))
    pipeline = tmp_path / "merged"
    shutil.copytree(tiny_sd3_path, pipeline)
    for file in (pipeline / "transformer").glob("*.safetensors"):
        file.unlink()
    save_file({k: v.contiguous() for k, v in ema.items()}, str(pipeline / "transformer" / "part.safetensors"))

    batch = holder.rollout(["a red circle", "two blue squares"], [1, 2])
    expected = {}
    for name, state in (("whole", whole), ("ema", ema)):
        with torch.no_grad():
            for pname, param in holder.model.transformer.named_parameters():
                param.copy_(state[pname])
        expected[name] = holder.score(batch, "current")["old_means"]
    assert not torch.allclose(expected["whole"], expected["ema"], atol=1e-3)

    for lora_rank in (8, 0):
        student, _ = make_engine(tiny_sd3_path, model__lora_rank=lora_rank, diffusion_loss__name="distill_kl",
                                 algorithm__drop_zero_advantage=False, diffusion_loss__teacher=str(step))
        own = student.score(batch, "current")["old_means"]
        assert torch.allclose(student.score(batch, "teacher")["teacher_means"], expected["whole"], atol=1e-5)
        assert torch.equal(student.score(batch, "current")["old_means"], own)  # swapped back
        trained = {id(p) for p in student.model.trainable_parameters()}
        frozen = list(student._full_teachers["teacher_0"].parameters())
        assert frozen and not any(p.requires_grad or id(p) in trained for p in frozen)
    save_file(ema, str(step / "actor" / "ema.safetensors"))  # the run kept an EMA: its validated weights
    routed, _ = make_engine(tiny_sd3_path, diffusion_loss__name="distill_kl", algorithm__drop_zero_advantage=False,
                            diffusion_loss__teacher={"red": str(step), "*": str(pipeline)})
    batch["data_sources"] = ["red", "blue"]
    means = routed.score(batch, "teacher")["teacher_means"]
    assert torch.allclose(means, expected["ema"], atol=1e-5)  # both rows: the EMA and the same weights merged

    full_from_base, _ = make_engine(tiny_sd3_path, model__lora_rank=0, diffusion_loss__name="distill_kl",
                                    algorithm__drop_zero_advantage=False)
    assert full_from_base._frozen_reference is not None

    del whole[next(iter(whole))]
    save_file(whole, str(step / "actor" / "trainable.safetensors"))
    (step / "actor" / "ema.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"diffusion_loss\.teacher.*not a denoiser of this model's shape"):
        make_engine(tiny_sd3_path, diffusion_loss__name="distill_kl", algorithm__drop_zero_advantage=False,
                    diffusion_loss__teacher=str(step))


def test_the_distillation_term_sits_beside_flow_grpo(tiny_sd3_path, tmp_path, make_engine):
    """distill_coef x distill_kl added to the policy loss: a sub-step's loss is Flow-GRPO's plus
    coef times the KL distill_kl computes, on the same batch and (identically seeded) weights."""
    from pixelrl.algos import get_loss
    from pixelrl.algos.config import DiffusionLossConfig

    holder, _ = make_engine(tiny_sd3_path)
    _teacher_folder(holder, tmp_path / "teacher")
    losses, batch = {}, None
    for coef in (0.5, 0.0):
        engine, _ = make_engine(tiny_sd3_path, diffusion_loss__teacher=str(tmp_path / "teacher"),
                                diffusion_loss__distill_coef=coef)
        if batch is None:
            batch = engine.rollout(["a red circle", "two blue squares"], [1, 2])
            batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)[:len(batch)]
            batch.update(engine.score(batch, "teacher"))
        ctx = engine.objective.context(batch)
        losses[coef] = engine.objective.substeps_loss(batch, [0], ctx)
    (plain, plain_metrics), (with_term, metrics) = losses[0.0], losses[0.5]
    assert "distill_kl" not in plain_metrics and float(metrics["distill_kl"]) > 0
    distill = get_loss("distill_kl")
    out = engine.step_outputs(batch, torch.zeros(len(batch), dtype=torch.long), ctx.settings)
    step = {"mean": out.mean, "std_dev_t": out.std_dev_t, "noise_std": out.noise_std}
    step["teacher_mean"] = batch["teacher_means"][:, 0]
    expected, _ = distill(step, distill.bind(DiffusionLossConfig(name="distill_kl")))
    assert float(metrics["distill_kl"]) == pytest.approx(float(expected.detach()), rel=1e-5)
    assert float(with_term.detach()) == pytest.approx(float(plain.detach()) + 0.5 * float(expected.detach()), rel=1e-5)


def test_ode_rollouts_store_their_euler_steps_and_distil_by_half_the_squared_gap(tiny_sd3_path, tmp_path,
                                                                                   make_engine):
    """DiffusionOPD's own point: `rollout.sde_type: ode` samples exactly the ODE (the images of a
    window-less deterministic rollout), stores steps 0 .. N-2 with log-prob 0, the student's replay of
    step k lands on the stored x_k+1, and the loss is 0.5 mean((mu - mu_teacher)^2) under either
    distill_variance (a step without noise divides by 1, as both references do)."""
    from pixelrl.sampling.rollout import SamplingSettings
    from pixelrl.sampling.windows import Window

    holder, _ = make_engine(tiny_sd3_path)
    _teacher_folder(holder, tmp_path / "teacher")
    prompts, seeds = ["a red circle", "two blue squares"], [1, 2]
    values = {}
    for variance in ("transition", "scheduler"):
        engine, cfg = make_engine(tiny_sd3_path, diffusion_loss__name="distill_kl", rollout__noise_level=0.0,
                                  rollout__sde_type="ode", algorithm__drop_zero_advantage=False,
                                  diffusion_loss__distill_variance=variance,
                                  diffusion_loss__teacher=str(tmp_path / "teacher"))
        batch = engine.rollout(prompts, seeds)
        steps = cfg.rollout.num_steps
        plain = engine.rollout(prompts, seeds, window=Window(0, 0),
                               settings=SamplingSettings(noise_level=0.0, guidance_scale=cfg.rollout.guidance_scale))
        assert torch.equal(batch["images"], plain["images"])
        assert batch["latents"].shape[1] == steps and batch["step_indices"][0].tolist() == list(range(steps - 1))
        assert torch.equal(batch["log_probs"], torch.zeros(2, steps - 1))
        replayed = engine.score(batch, "current")["old_means"]
        assert torch.allclose(replayed, batch["latents"][:, 1:], atol=1e-5)
        batch["advantages"] = torch.zeros(len(batch))
        batch.update(engine.score(batch, "teacher"))
        ctx = engine.objective.context(batch)
        loss, metrics = engine.objective.substeps_loss(batch, [3], ctx)
        mu = engine.step_outputs(batch, torch.full((2,), 3), ctx.settings).mean.detach()
        by_hand = 0.5 * float(((mu - batch["teacher_means"][:, 3]) ** 2).mean())
        assert by_hand > 0 and float(loss.detach()) == pytest.approx(by_hand, rel=1e-5)
        values[variance] = float(metrics["distill_kl"])
    assert values["transition"] == values["scheduler"]


@pytest.mark.learning
@pytest.mark.parametrize("sampler", [(), ("rollout.noise_level=0", "rollout.sde_type=ode")], ids=["sde", "ode"])
def test_on_policy_distillation_pulls_the_student_onto_its_teacher(tiny_sd3_path, tmp_path, make_engine, sampler):
    """flow_grpo_tiny's student, trained with distill_kl toward a teacher LoRA for 12 steps (its own
    rollouts, the teacher replaying them): the per-step KL to the teacher falls by far more than
    any kernel set moves it: from 0.169 to 0.069 (the mean of the last three) here with SDE
    rollouts, from 0.0206 to 0.0080 with ODE rollouts (the same on AVX-512, AVX2 and default
    kernels); asserted 40%."""
    holder, _ = make_engine(tiny_sd3_path)
    _teacher_folder(holder, tmp_path / "teacher", scale=0.5)
    code, run = train_cli(tmp_path, tiny_sd3_path, "diffusion_loss.name=distill_kl", *sampler,
                          # by data_source: flow_grpo_tiny's inline prompts are `inline`, the rest would get
                          # the base, which the student starts at (a KL of 0: the rows' sources must travel)
                          f"diffusion_loss.teacher={{inline: {tmp_path / 'teacher'}}}",
                          "algorithm.drop_zero_advantage=false", "trainer.total_training_steps=12",
                          "trainer.backend=local", "trainer.logger=[jsonl]", "actor.lr=3e-2")
    assert code == 0
    kl = [row["actor/distill_kl"] for row in read_metrics(run) if "actor/distill_kl" in row]
    assert len(kl) == 12
    before, after = kl[0], sum(kl[-3:]) / 3
    assert_learned(-before, -after, 0.4 * before, "distill_kl first vs last three", kl)


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.slow)])
def test_the_rollout_pool_replays_the_teacher_and_the_run_is_unchanged(tiny_sd3_path, tmp_path, make_engine,
                                                                         monkeypatch, request, backend):
    """rollout.scores_teacher: the pool replays the teacher on each shard it sampled (each row under
    its data_source's teacher), the actor replays nothing and holds no teacher; a one_step_off run
    trains exactly as when the actor replays it (the same per-step losses, the same weights). On
    Ray each pool worker's replay starts from its own sampled shard in the object store."""
    from safetensors.torch import load_file

    from pixelrl.workers.policy_worker import PolicyWorker

    holder, _ = make_engine(tiny_sd3_path)
    _teacher_folder(holder, tmp_path / "teacher", scale=0.5)
    scored = []  # (role, policy) of every score call (in this process: the in-process workers)
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    else:
        score = PolicyWorker.score
        monkeypatch.setattr(PolicyWorker, "score", lambda self, payload, policy, values=None: (
            scored.append((self.role, policy, sorted(values or {}))), score(self, payload, policy, values))[1])
    runs = {}
    for on_pool in (False, True):
        scored.clear()
        code, run = train_cli(tmp_path / str(on_pool), tiny_sd3_path, "diffusion_loss.name=distill_kl",
                              f"diffusion_loss.teacher={{inline: {tmp_path / 'teacher'}}}",
                              "algorithm.drop_zero_advantage=false", "trainer.total_training_steps=3",
                              f"trainer.backend={backend}", "trainer.logger=[jsonl]", "rollout.n_workers=1",
                              "trainer.n_workers=1",
                              "trainer.mode=one_step_off", f"rollout.scores_teacher={on_pool}", "actor.lr=3e-2")
        assert code == 0
        runs[on_pool] = run
        teacher_calls = [call for call in scored if call[1] == "teacher"]
        assert backend == "ray" or teacher_calls == ([("rollout", "teacher", ["data_sources"])] if on_pool
                                                     else [("actor", "teacher", [])]) * 3
    kl = {on_pool: [row["actor/distill_kl"] for row in read_metrics(run) if "actor/distill_kl" in row]
          for on_pool, run in runs.items()}
    assert len(kl[True]) == 3 and kl[True] == kl[False] and kl[True][0] > 0
    assert not any("timing_s/teacher" in row for row in read_metrics(runs[True]))
    weights = {on_pool: load_file(str(run / "checkpoints" / "global_step_3" / "actor" / "trainable.safetensors"))
               for on_pool, run in runs.items()}
    assert all(torch.equal(weights[True][k], weights[False][k]) for k in weights[False])


def test_distillation_config_errors_name_the_field(tiny_sd3_path, tmp_path, make_engine):
    from pixelrl.config import load_config

    holder, _ = make_engine(tiny_sd3_path)
    _teacher_folder(holder, tmp_path / "teacher")
    base = [f"model.path={tiny_sd3_path}", "diffusion_loss.name=distill_kl", "algorithm.drop_zero_advantage=false",
            f"trainer.default_local_dir={tmp_path}", f"diffusion_loss.teacher={tmp_path / 'teacher'}"]
    load_config("flow_grpo_tiny", base)
    for overrides, field in (
            (["algorithm.drop_zero_advantage=true"], "algorithm.drop_zero_advantage"),
            ([f"diffusion_loss.teacher={tmp_path}"], "diffusion_loss.teacher"),  # no LoRA file
            ([f"diffusion_loss.teacher={tmp_path / 'teacher'}", "model.lora_rank=0"],
             "diffusion_loss.teacher"),
            (["diffusion_loss.distill_variance=exact"], "diffusion_loss.distill_variance"),
            (["diffusion_loss.distill_coef=0.1"], "diffusion_loss.distill_coef"),  # distill_kl is the whole loss
            (["diffusion_loss.teacher={red: ''}"], "diffusion_loss.teacher.red"),
            (["rollout.scores_teacher=true"], "rollout.scores_teacher"),  # no rollout pool
            (["rollout.scores_teacher=true", "rollout.n_workers=1", "trainer.mode=one_step_off",
              "diffusion_loss.name=flow_grpo"], "rollout.scores_teacher")):  # no teacher
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config("flow_grpo_tiny", [*base, *overrides])


def test_a_checkpoint_teacher_is_its_ema_adapter_and_must_share_the_base(tmp_path):
    """A run's global_step_N folder names its actor's EMA adapter when the run kept one (the
    weights its validation scored), else its actor's; one trained on another base is refused."""
    from types import SimpleNamespace

    from pixelrl.config.validation import _check_teacher
    from pixelrl.engine.checkpoint import LORA_FILE, TeacherWeights, teacher_weights

    step = tmp_path / "run" / "checkpoints" / "global_step_4"
    for inner in ("actor/adapter", "actor/ema_adapter"):
        (step / inner).mkdir(parents=True)
        save_file({"transformer.block.lora_A.weight": torch.zeros(2, 2)}, step / inner / LORA_FILE)
    assert teacher_weights(str(step)) == TeacherWeights("lora", step / "actor" / "ema_adapter")
    (step / "actor" / "ema_adapter" / LORA_FILE).unlink()
    assert teacher_weights(str(step)) == TeacherWeights("lora", step / "actor" / "adapter")
    assert teacher_weights("base") is None
    (step / "config.yaml").write_text(f"model:\n  path: {tmp_path / 'other_base'}\n")
    (tmp_path / "other_base").mkdir()
    (tmp_path / "this_base").mkdir()
    cfg = SimpleNamespace(model=SimpleNamespace(lora_rank=8, path=str(tmp_path / "this_base")))
    with pytest.raises(ConfigError, match=r"diffusion_loss\.teacher.*other_base"):
        _check_teacher(cfg, "diffusion_loss.teacher", str(step))
    cfg.model.path = str(tmp_path / "other_base")
    _check_teacher(cfg, "diffusion_loss.teacher", str(step))


def test_a_whole_teacher_is_checked_against_the_base_at_start_up(tiny_sd3_path, tmp_path):
    """A full fine-tune's checkpoint may teach a LoRA or a fully fine-tuned student; a pipeline
    folder whose transformer is another architecture, or one holding no weights, is refused before
    anything loads, naming the field."""
    import json
    import shutil

    from pixelrl.config import load_config

    step = tmp_path / "run" / "checkpoints" / "global_step_3"
    (step / "actor").mkdir(parents=True)
    save_file({"block.weight": torch.zeros(2, 2)}, step / "actor" / "trainable.safetensors")
    (step / "config.yaml").write_text(f"model:\n  path: {tiny_sd3_path}\n")
    base = [f"model.path={tiny_sd3_path}", "diffusion_loss.name=distill_kl", "algorithm.drop_zero_advantage=false",
            f"trainer.default_local_dir={tmp_path}"]
    for rank in (8, 0):
        load_config("flow_grpo_tiny", [*base, f"diffusion_loss.teacher={step}", f"model.lora_rank={rank}"])
    other = tmp_path / "other"
    shutil.copytree(tiny_sd3_path, other)
    config = json.loads((other / "transformer" / "config.json").read_text())
    config["num_layers"] += 1
    (other / "transformer" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"diffusion_loss\.teacher.*num_layers"):
        load_config("flow_grpo_tiny", [*base, f"diffusion_loss.teacher={other}"])
    for file in (other / "transformer").glob("*.safetensors"):
        file.unlink()
    with pytest.raises(ConfigError, match=r"diffusion_loss\.teacher.*no \.safetensors"):
        load_config("flow_grpo_tiny", [*base, f"diffusion_loss.teacher={other}"])


def test_resuming_with_another_teacher_is_refused(tmp_path):
    from pixelrl.trainers.checkpointing import check_resume_config

    folder = tmp_path / "global_step_2"
    folder.mkdir()
    (folder / "config.yaml").write_text("diffusion_loss:\n  teacher: /runs/a/global_step_9\n")
    assert check_resume_config(folder, "diffusion_loss:\n  teacher: /runs/a/global_step_9\n") == []
    with pytest.raises(ConfigError, match=r"diffusion_loss\.teacher"):
        check_resume_config(folder, "diffusion_loss:\n  teacher: base\n")


def test_the_plan_counts_the_teachers_replay():
    """`pixelrl plan` sizes opd_sd35 with one no-grad teacher forward per trained step (and no
    reference: the recipe has no KL); Flow-GRPO-Fast, the same sampler without a teacher, has none."""
    from pixelrl.config.plan import step_work
    from pixelrl.config.validation import compose_config

    opd = compose_config("opd_sd35")
    assert (opd.diffusion_loss.kl_coef, step_work(opd, 8).no_grad_passes) == (0.0, 1)
    assert step_work(compose_config("flow_grpo_fast_sd35"), 8).no_grad_passes == 0


def test_the_plan_holds_a_whole_teacher_as_a_frozen_copy_on_every_gpu(tmp_path):
    """opd_sd35 with a fully fine-tuned teacher (a checkpoint without an adapter) holds one more
    bf16 copy of the 2.47B denoiser on each GPU than with a LoRA teacher, sharded or not; a full
    fine-tune distilling from `base` keeps the base's frozen copy as the reference."""
    from conftest import paper_config

    from pixelrl.config.plan import model_shape, resident_bytes
    from pixelrl.engine.checkpoint import LORA_FILE

    whole = tmp_path / "whole" / "global_step_3"
    (whole / "actor").mkdir(parents=True)
    stand_in_safetensors(whole / "actor" / "trainable.safetensors")
    lora = tmp_path / "lora"
    lora.mkdir()
    stand_in_safetensors(lora / LORA_FILE)

    def resident(teacher, gpus, *more):
        cfg = paper_config("opd_sd35", f"diffusion_loss.teacher={teacher}", *more)
        return resident_bytes(cfg, model_shape(cfg), gpus)

    params = model_shape(paper_config("opd_sd35", f"diffusion_loss.teacher={lora}")).denoiser_params
    for gpus, strategy in ((1, "ddp"), (4, "fsdp2")):
        assert (resident(whole, gpus, f"trainer.strategy={strategy}")
                - resident(lora, gpus, f"trainer.strategy={strategy}")) == pytest.approx(params * 2, rel=1e-9)
    full = ("model.lora_rank=0",)
    # under full fine-tuning `base` is a frozen copy too (a source routed to it), one beside the whole teacher's
    assert resident("{a: base, '*': " + str(whole) + "}", 1, *full) - resident(whole, 1, *full) == pytest.approx(
        params * 2, rel=1e-9)


def test_the_diffusion_opd_config_samples_and_updates_as_its_reference(tmp_path):
    """opd_ode_sd35 is DiffusionOPD's sopd point (config/opd.py, train_sd3_opd.py): one image per
    prompt, 10 ODE steps at 512 px with CFG 4.5 for student and teacher, steps 0 .. 8 trained
    (int(10 x 0.99)), 8 GPUs x 3 x 3 = 72 samples per optimizer step and one step per rollout,
    AdamW 3e-4 / wd 1e-4, clip 1, LoRA r32 / alpha 64, EMA 0.9 every 8th step, the ODE at 40 steps
    for evaluation, no reference KL."""
    from conftest import paper_config

    from pixelrl.config.plan import step_work
    from pixelrl.config.sections import validation_guidance
    from pixelrl.engine.config import optimizer_steps_per_rollout
    from pixelrl.models.sd3.model import SD3Model

    stand_in_safetensors(tmp_path / "pytorch_lora_weights.safetensors")
    cfg = paper_config("opd_ode_sd35", f"diffusion_loss.teacher={tmp_path}")
    r, a = cfg.rollout, cfg.actor
    assert (r.n, r.num_steps, r.resolution, r.guidance_scale, r.noise_level, r.sde_type) == (1, 10, 512, 4.5, 0.0, "ode")
    assert (cfg.data.train_batch_size, cfg.trainer.n_workers, optimizer_steps_per_rollout(cfg)) == (72, 8, 1)
    assert step_work(cfg, 8).substeps == 9 and (r.sde_window_size, a.timestep_fraction) == (0, 1.0)
    assert (a.lr, a.weight_decay, a.max_grad_norm, a.ema_decay, a.ema_update_interval) == (3e-4, 1e-4, 1.0, 0.9, 8)
    assert (cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_target_modules) == (32, 64, None)
    assert set(SD3Model.default_lora_targets) == {  # the reference's target_modules
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k", "attn.to_out.0",
        "attn.to_q", "attn.to_v"}
    assert (cfg.val_kwargs.num_steps, cfg.val_kwargs.noise_level, validation_guidance(cfg)) == (40, 0.0, 4.5)
    assert (cfg.diffusion_loss.name, cfg.diffusion_loss.kl_coef) == ("distill_kl", 0.0)


def test_the_distillation_term_is_refused_beside_a_forward_process_loss(tmp_path):
    from pixelrl.config import load_config

    with pytest.raises(ConfigError, match=r"diffusion_loss\.distill_coef.*beside transition losses"):
        load_config("shapes_nft", ["diffusion_loss.distill_coef=0.1", f"trainer.default_local_dir={tmp_path}"])


def test_opd_sd35_keeps_the_launchers_update_schedule():
    """verl-omni's run_sd35_medium_ocr_distill.sh: 8 prompts x 8 images, ppo_mini_batch_size 4
    prompts, so two optimizer steps per rollout; no EMA; T5 at 256 tokens; 28 validation steps."""
    from pixelrl.config.validation import compose_config
    from pixelrl.engine.config import optimizer_steps_per_rollout

    cfg = compose_config("opd_sd35")
    assert (cfg.data.train_batch_size, cfg.rollout.n, optimizer_steps_per_rollout(cfg)) == (8, 8, 2)
    assert cfg.actor.ema_decay == 0.0 and cfg.model.max_sequence_length == 256 and cfg.val_kwargs.num_steps == 28


def test_a_teacher_that_cannot_teach_is_refused_naming_the_field(tiny_sd3_path, tmp_path, make_engine):
    """distill_kl toward the student's own base (`base`, or model.path named as a teacher) would
    train with loss and gradient 0; a teacher LoRA cut short, or one adapting modules this base
    lacks (the LoRA of a deeper model, which diffusers would apply in part without a word), is
    refused with the field and the file."""
    from safetensors import safe_open

    from pixelrl.config import load_config

    holder, _ = make_engine(tiny_sd3_path)
    _teacher_folder(holder, tmp_path / "teacher")
    base = [f"model.path={tiny_sd3_path}", "diffusion_loss.name=distill_kl", "algorithm.drop_zero_advantage=false",
            f"trainer.default_local_dir={tmp_path}"]
    for teacher in ("base", str(tiny_sd3_path)):
        with pytest.raises(ConfigError, match=r"diffusion_loss\.teacher.*own base.*stay 0"):
            load_config("flow_grpo_tiny", [*base, f"diffusion_loss.teacher={teacher}"])
    # beside a policy loss the base is a real teacher: the student moves away from it
    load_config("flow_grpo_tiny", [f"model.path={tiny_sd3_path}", "diffusion_loss.distill_coef=0.1",
                                   f"trainer.default_local_dir={tmp_path}"])

    lora = tmp_path / "teacher" / "pytorch_lora_weights.safetensors"
    with safe_open(str(lora), "pt") as file:
        tensors, metadata = {k: file.get_tensor(k) for k in file.keys()}, file.metadata()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / lora.name).write_bytes(lora.read_bytes()[: lora.stat().st_size // 2])
    with pytest.raises(ConfigError, match=r"diffusion_loss\.teacher.*cut.*cannot be read.*cut short or damaged"):
        load_config("flow_grpo_tiny", [*base, f"diffusion_loss.teacher={tmp_path / 'cut'}"])

    deeper = {**tensors, **{k.replace("transformer_blocks.0.", "transformer_blocks.99."): v.clone()
                            for k, v in tensors.items() if "transformer_blocks.0." in k}}
    assert len(deeper) > len(tensors)
    (tmp_path / "deeper").mkdir()
    save_file(deeper, tmp_path / "deeper" / lora.name, metadata=metadata)
    with pytest.raises(ConfigError, match=r"diffusion_loss\.teacher.*of the \d+ modules its LoRA adapts are not in "
                                          r".*transformer_blocks\.99\."):
        make_engine(tiny_sd3_path, diffusion_loss__name="distill_kl", algorithm__drop_zero_advantage=False,
                    diffusion_loss__teacher=str(tmp_path / "deeper"))
