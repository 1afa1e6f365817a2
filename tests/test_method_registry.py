"""A method family added from outside the package, in this file only: its spec, its loss, its
engine objective with a second trained role, and its consumer, each registered under its name.
The controller, the config checks, the planner, the schedule's optimizer-step count and the
checkpoint then carry it without a line of theirs naming it.

The example method ("two_role_example") is a test fixture, not an algorithm anyone should run:
a `helper` adapter learns plain flow matching on the step's samples, then the `student` (the
policy) learns flow matching on the samples whose advantage is positive. It reads rewards through
the shared producer, and its cycle trains the two roles in turn."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from pixelrl.algos.losses import register_loss
from pixelrl.algos.methods import MethodSpec, register_method
from pixelrl.core.batch import Batch
from pixelrl.engine.learner import Learner, kept_on_device
from pixelrl.engine.objectives import Objective, register_objective
from pixelrl.models.lora import activate_adapter, adapter_params, add_adapter_copy
from pixelrl.trainers.consumers import register_consumer, trained_on_rollout

METHOD, HELPER = "two_role_example", "helper"
CYCLE = ["helper", "student"]

LOSS = "two_role_example_loss"


def weighted_flow_matching(step: dict, cfg):
    per_sample = ((step["v"] - step["target"]) ** 2).flatten(1).mean(1)
    return (step["weights"] * per_sample).mean(), {"weight_mean": step["weights"].mean()}


class TwoRoleObjective(Objective):
    name = METHOD

    def __init__(self, engine):
        super().__init__(engine)
        self.helper_learner = None
        self.helper_names: list[str] = []
        self.helper_steps = 0

    def add_adapters(self) -> None:
        transformer = self.engine.model.transformer
        add_adapter_copy(transformer, HELPER)
        self.helper_names = [n for n, _ in transformer.named_parameters() if "lora_" in n and f".{HELPER}." in n]

    def helper_parameters(self):
        return list(adapter_params(self.engine.model.transformer, HELPER).values())

    def build_learners(self, trains: bool) -> None:
        from pixelrl.engine.config import actor_optimizer_steps

        if trains:
            self.helper_learner = Learner.from_actor_config(self.helper_parameters, self.engine.cfg.actor,
                                                            total_steps=actor_optimizer_steps(self.engine.cfg, role=HELPER))

    def extra_roles(self) -> dict:
        return {HELPER: (self.helper_names, self.helper_learner)}

    def role_counters(self) -> dict:
        return {HELPER: {"steps": self.helper_steps}}

    def set_role_counters(self, state: dict) -> None:
        self.helper_steps = int(state[HELPER]["steps"])

    def attempt(self, role: str, batch: Batch) -> dict[str, float]:
        e = self.engine
        helper = role == HELPER
        transformer = e.model.transformer
        learner = self.helper_learner if helper else e.learner
        x0 = batch["x0"].to(e.model.device)
        gen = torch.Generator().manual_seed(int(batch.info["seed"]))
        t = torch.rand(len(x0), generator=gen).to(x0)
        eps = torch.randn(x0.shape, generator=gen).to(x0)
        x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
        weights = torch.ones(len(x0)) if helper else (batch["advantages"] > 0).float()
        transformer.train()
        learner.zero_grad()
        if helper:
            activate_adapter(transformer, HELPER)
            for param in self.helper_learner.params:
                param.requires_grad_(True)
        try:
            v = e.model.predict_velocity(x_t, t, e.model.encode_conditions(batch["prompts"], None))
            loss, metrics = e.loss({"v": v, "target": eps - x0, "weights": weights.to(v)}, e.loss_options)
            loss.backward()
        finally:
            activate_adapter(transformer, "default")
        step = learner.step(float(kept_on_device(loss)))
        transformer.eval()
        if step.pop("stepped"):
            if helper:
                self.helper_steps += 1
            else:
                e.policy_version += 1
        return {f"{role}/loss": float(loss.detach()), **{f"{role}/{k}": float(v) for k, v in metrics.items()}}


def consume_two_roles(ctx):
    def update(actor, rollout, cfg, num_workers=1, actor_version=None):
        batch = rollout.batch
        train = Batch({"x0": batch["x0"], "advantages": batch["advantages"]}, {"prompts": batch["prompts"]},
                      {"seed": rollout.step})
        metrics = {"critic/rewards/mean": float(batch["rewards"].mean())}
        for role in CYCLE:
            metrics.update(actor.call("train_role", train, role, gather="mean"))
        metrics["actor/policy_version"] = float(actor.call("counters", gather="first")["policy_version"])
        metrics["timing_s/step"] = 0.0
        return metrics

    return trained_on_rollout(ctx, update)


@pytest.fixture
def example_method():
    """The method's four registrations (what a plugin module would do at import), removed again
    after the test so that other tests see the package's own families only."""
    from pixelrl.algos.losses import LOSSES
    from pixelrl.algos.methods import METHODS
    from pixelrl.engine.objectives import OBJECTIVES
    from pixelrl.trainers.consumers import CONSUMERS

    register_method(MethodSpec(METHOD, trained_roles=("student", HELPER), attempt_cycle=lambda loss_cfg: CYCLE,
                               training_metrics=("helper/loss", "student/weight_mean")))
    register_loss(LOSS, objective=METHOD, batch_keys=("x0", "advantages"),
                  step_keys=("v", "target", "weights"))(weighted_flow_matching)
    register_objective(TwoRoleObjective)
    register_consumer(METHOD)(consume_two_roles)
    yield
    for registry, name in ((METHODS, METHOD), (LOSSES, LOSS), (OBJECTIVES, METHOD), (CONSUMERS, METHOD)):
        registry._entries.pop(name)  # no public removal: a registration lasts the process


def test_a_method_registered_outside_the_package_trains_both_roles_on_rewards(example_method, tmp_path,
                                                                              tiny_pixel_path, capsys):
    """Two steps through the real controller (one process): both adapters move, each role steps
    once per attempt of its cycle (the learner's schedule counted from the spec), the rewards
    reach the student's weights, and the checkpoint holds the second role. The metrics its spec
    names are on the console line (a role's under its name) and drawn in the run report."""
    from safetensors.torch import load_file

    from pixelrl.config.validation import validate
    from pixelrl.trainers.controller import DiffusionTrainer

    cfg = tiny_config(tiny_pixel_path, algorithm__trainer_type=METHOD, rollout__noise_level=0.0,
                      rollout__num_steps=4, data__train_batch_size=2, trainer__total_training_steps=2,
                      trainer__backend="local", trainer__n_workers=1, trainer__save_freq=2, trainer__test_freq=-1,
                      trainer__logger=["jsonl", "console"], trainer__default_local_dir=str(tmp_path))
    cfg.diffusion_loss.name = LOSS
    cfg.data.prompts = ["a red circle", "two blue squares", "a green tree", "a flower"]
    cfg.reward.functions = [{"name": "jpeg_compressibility", "weight": 1.0}]
    validate(cfg)
    result = DiffusionTrainer(cfg).fit()
    history = result["history"]
    assert len(history) == 2
    assert all("helper/loss" in row and "student/loss" in row and "critic/rewards/mean" in row for row in history)
    assert all(0.0 < row["student/weight_mean"] < 1.0 for row in history)  # advantages select the samples
    step_lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step 2:")]
    assert "  helper/loss=" in step_lines[0] and "  student/weight_mean=" in step_lines[0]
    from pixelrl.trainers.report import curve_keys

    assert {"helper/loss", "student/weight_mean"} <= set(curve_keys(history))
    actor = tmp_path / "pixelrl" / cfg.trainer.experiment_name / "checkpoints" / "global_step_2" / "actor"
    student = load_file(str(actor / "trainable.safetensors"))
    helper = {k.replace(f".{HELPER}.", ".default."): v
              for k, v in load_file(str(actor / "roles" / HELPER / "trainable.safetensors")).items()}
    assert student.keys() == helper.keys()
    assert any(not torch.equal(student[k], helper[k]) for k in student)  # two roles, two sets of weights
    engine_state = (actor / "engine_state.json").read_text()
    assert '"steps": 2' in engine_state and '"policy_version": 2' in engine_state


def test_the_config_refuses_a_loss_of_another_family_for_the_method(example_method, tiny_pixel_path):
    from pixelrl.config.validation import validate
    from pixelrl.core.errors import ConfigError

    cfg = tiny_config(tiny_pixel_path, algorithm__trainer_type=METHOD, rollout__noise_level=0.0)
    cfg.data.prompts = ["a red circle"]
    with pytest.raises(ConfigError) as err:
        validate(cfg)  # the default loss, flow_grpo, is a transition loss
    assert err.value.field == "diffusion_loss.name" and LOSS in str(err.value)
