"""On-policy distillation (`distill_kl`): the loss by hand, the teacher read from a LoRA folder and
replaying the student's states, the config's checks, and a tiny run pulling a student onto it."""

import pytest
import torch
from conftest import assert_learned, read_metrics, train_cli

from pixelrl.algos import get_loss
from pixelrl.core.errors import ConfigError


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
    options = loss_spec.bind(type("L", (), {"params": {"variance": variance}})())
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
    per = [float(((step["mean"][i] - step["teacher_mean"][i]) ** 2).mean()) for i in range(3)]
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


def test_the_teacher_lora_replays_the_students_states_frozen(tiny_sd3_path, tmp_path, make_engine):
    """A teacher read from a LoRA folder scores the student's stored transitions exactly as an
    engine whose own adapter holds those weights; it stays frozen, out of the trained parameters,
    and the student's adapter stays the active one. teacher=base scores as the reference."""
    from pixelrl.engine.checkpoint import peft_key

    holder, _ = make_engine(tiny_sd3_path)
    state = _teacher_folder(holder, tmp_path / "teacher")
    with torch.no_grad():  # the holder now computes with the teacher's weights
        for name, param in holder.model.transformer.named_parameters():
            if param.requires_grad:
                param.copy_(state[peft_key(name)])
    batch = holder.rollout(["a red circle", "two blue squares"], [1, 2])
    expected = holder.score(batch, "current")["old_means"]

    student, _ = make_engine(tiny_sd3_path, diffusion_loss__name="distill_kl",
                             diffusion_loss__params={"teacher": str(tmp_path / "teacher")},
                             algorithm__drop_zero_advantage=False)
    teacher = student.score(batch, "teacher")["teacher_means"]
    assert torch.allclose(teacher, expected, atol=1e-5)
    assert not torch.allclose(student.score(batch, "current")["old_means"], expected, atol=1e-3)
    trained = {id(p) for p in student.model.trainable_parameters()}
    teacher_params = [p for n, p in student.model.transformer.named_parameters() if ".teacher." in n]
    assert teacher_params and not any(p.requires_grad or id(p) in trained for p in teacher_params)
    assert student.model.transformer.active_adapters() == ["default"]

    base, _ = make_engine(tiny_sd3_path, diffusion_loss__name="distill_kl", algorithm__drop_zero_advantage=False)
    assert torch.equal(base.score(batch, "teacher")["teacher_means"], base.score(batch, "reference")["ref_means"])


@pytest.mark.learning
def test_on_policy_distillation_pulls_the_student_onto_its_teacher(tiny_sd3_path, tmp_path, make_engine):
    """flow_grpo_tiny's student, trained with distill_kl toward a teacher LoRA for 12 steps (its own
    rollouts, the teacher replaying them): the per-step KL to the teacher falls by far more than
    any kernel set moves it: from 0.169 to 0.069 (the mean of the last three) here, asserted 40%."""
    holder, _ = make_engine(tiny_sd3_path)
    _teacher_folder(holder, tmp_path / "teacher", scale=0.5)
    code, run = train_cli(tmp_path, tiny_sd3_path, "diffusion_loss.name=distill_kl",
                          f"diffusion_loss.params.teacher={tmp_path / 'teacher'}",
                          "algorithm.drop_zero_advantage=false", "trainer.total_training_steps=12",
                          "trainer.backend=local", "trainer.logger=[jsonl]", "actor.lr=3e-2")
    assert code == 0
    kl = [row["actor/distill_kl"] for row in read_metrics(run) if "actor/distill_kl" in row]
    assert len(kl) == 12
    before, after = kl[0], sum(kl[-3:]) / 3
    assert_learned(-before, -after, 0.4 * before, "distill_kl first vs last three", kl)


def test_distillation_config_errors_name_the_field(tiny_sd3_path, tmp_path, make_engine):
    from pixelrl.config import load_config

    holder, _ = make_engine(tiny_sd3_path)
    _teacher_folder(holder, tmp_path / "teacher")
    base = ["--", f"model.path={tiny_sd3_path}", "diffusion_loss.name=distill_kl", "algorithm.drop_zero_advantage=false",
            f"trainer.default_local_dir={tmp_path}"][1:]
    load_config("flow_grpo_tiny", [*base, f"diffusion_loss.params.teacher={tmp_path / 'teacher'}"])
    for overrides, field in (
            (["algorithm.drop_zero_advantage=true"], "algorithm.drop_zero_advantage"),
            ([f"diffusion_loss.params.teacher={tmp_path}"], "diffusion_loss.params.teacher"),  # no LoRA file
            ([f"diffusion_loss.params.teacher={tmp_path / 'teacher'}", "model.lora_rank=0"],
             "diffusion_loss.params.teacher"),
            (["diffusion_loss.params.variance=exact"], "diffusion_loss.params.variance")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config("flow_grpo_tiny", [*base, *overrides])


def test_a_checkpoint_teacher_is_its_ema_adapter_and_must_share_the_base(tmp_path):
    """A run's global_step_N folder names its actor's EMA adapter when the run kept one (the
    weights its validation scored), else its actor's; one trained on another base is refused."""
    from types import SimpleNamespace

    from pixelrl.config.validation import _check_teacher
    from pixelrl.engine.checkpoint import LORA_FILE, teacher_adapter_folder

    step = tmp_path / "run" / "checkpoints" / "global_step_4"
    for inner in ("actor/adapter", "actor/ema_adapter"):
        (step / inner).mkdir(parents=True)
        (step / inner / LORA_FILE).write_bytes(b"")
    assert teacher_adapter_folder(SimpleNamespace(teacher=str(step))) == step / "actor" / "ema_adapter"
    (step / "actor" / "ema_adapter" / LORA_FILE).unlink()
    assert teacher_adapter_folder(SimpleNamespace(teacher=str(step))) == step / "actor" / "adapter"
    assert teacher_adapter_folder(SimpleNamespace(teacher="base")) is None
    (step / "config.yaml").write_text(f"model:\n  path: {tmp_path / 'other_base'}\n")
    (tmp_path / "other_base").mkdir()
    (tmp_path / "this_base").mkdir()
    cfg = SimpleNamespace(diffusion_loss=SimpleNamespace(name="distill_kl"),
                          algorithm=SimpleNamespace(drop_zero_advantage=False),
                          model=SimpleNamespace(lora_rank=8, path=str(tmp_path / "this_base")))
    with pytest.raises(ConfigError, match=r"diffusion_loss\.params\.teacher.*other_base"):
        _check_teacher(cfg, SimpleNamespace(teacher=str(step)))
    cfg.model.path = str(tmp_path / "other_base")
    _check_teacher(cfg, SimpleNamespace(teacher=str(step)))


def test_resuming_with_another_teacher_is_refused(tmp_path):
    from pixelrl.trainers.checkpointing import check_resume_config

    folder = tmp_path / "global_step_2"
    folder.mkdir()
    (folder / "config.yaml").write_text("diffusion_loss:\n  params:\n    teacher: /runs/a/global_step_9\n")
    assert check_resume_config(folder, "diffusion_loss:\n  params:\n    teacher: /runs/a/global_step_9\n") == []
    with pytest.raises(ConfigError, match=r"diffusion_loss\.params\.teacher"):
        check_resume_config(folder, "diffusion_loss:\n  params:\n    teacher: base\n")


def test_the_plan_counts_the_teachers_replay():
    """`pixelrl plan` sizes opd_sd35 with one no-grad teacher forward per trained step (and no
    reference: the recipe has no KL); Flow-GRPO-Fast, the same sampler without a teacher, has none."""
    from pixelrl.config.plan import step_work
    from pixelrl.config.validation import compose_config

    opd = compose_config("opd_sd35")
    assert (opd.diffusion_loss.kl_coef, step_work(opd, 8).no_grad_passes) == (0.0, 1)
    assert step_work(compose_config("flow_grpo_fast_sd35"), 8).no_grad_passes == 0
