"""Fault injection: a catalogue of bad inputs, each replayed through the real command line.

For every entry: the exit code, a message on stderr that names the field (or file) and says
what to do, no traceback, and nothing written into the working folder. Every entry stops
before any model loads, so the whole catalogue runs in seconds.

    python tests/test_bad_inputs.py > docs/bad_inputs.md     # the catalogue as a docs table
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import damaged_png

SHAPES = ["train", "--config-name", "shapes_flow_grpo"]
VLM = ["train", "--config-name", "vlm_grpo_shapes_qa"]

# (what the user does, argv with {tmp}, {file} = an existing regular file, {run} = a run folder
# holding a metrics.jsonl; the text stderr must contain)
CATALOGUE: list[tuple[str, list[str], str]] = [
    # command-line arguments
    ("eval with zero sampling steps", ["eval", "--steps", "0"], "--steps"),
    ("eval with negative steps", ["eval", "--steps", "-3"], "--steps"),
    ("eval with zero items per category", ["eval", "--per-category", "0"], "--per-category"),
    ("eval with guidance nan", ["eval", "--cfg", "nan"], "--cfg"),
    ("eval with negative guidance", ["eval", "--cfg", "-1"], "--cfg"),
    ("eval with a negative seed", ["eval", "--seed", "-1"], "--seed"),
    ("eval with a non-number of steps", ["eval", "--steps", "ten"], "--steps"),
    ("eval writing under a file", ["eval", "--out", "{file}/results.json"], "a_file/results.json'"),
    ("eval-vlm writing under a file", ["eval-vlm", "--out", "{file}/accuracy.json"], "a_file/accuracy.json'"),
    ("reproduce an unknown standard", ["reproduce", "flow_grpoo"], "invalid choice: 'flow_grpoo'"),
    ("reproduce into a file", ["reproduce", "dpo", "--workdir", "{file}"], "--workdir"),
    ("eval against a baseline that is not a results file", ["eval", "--baseline", "{file}"], "--baseline"),
    ("eval against a missing baseline", ["eval", "--baseline", "{tmp}/no_such_results.json"], "--baseline"),
    ("eval of a checkpoint folder that does not exist", ["eval", "--checkpoint", "{tmp}/no_such_run/global_step_1"],
     "--checkpoint"),
    ("a checkpoint's weights on another base model than it trained on, still there",
     ["generate", "--checkpoint", "{ckpt_on_base}", "--model", "{pretrain_run}", "--prompt", "a cat"], "--model"),
    ("eval writing a .txt result", ["eval", "--out", "{tmp}/results.txt"], "unknown file type"),
    ("eval writing onto a folder", ["eval", "--out", "{tmp}"], "is a folder"),
    ("generate zero images", ["generate", "--prompt", "a red circle", "--n", "0"], "--n"),
    ("generate with zero steps", ["generate", "--prompt", "a red circle", "--steps", "0"], "--steps"),
    ("generate with guidance inf", ["generate", "--prompt", "a red circle", "--cfg", "inf"], "--cfg"),
    ("generate to an unknown image type", ["generate", "--prompt", "a red circle", "--out", "{tmp}/grid.xyz"],
     "unknown file type"),
    ("generate onto a folder", ["generate", "--prompt", "a red circle", "--out", "{tmp}"], "is a folder"),
    ("generate under a file", ["generate", "--prompt", "a red circle", "--out", "{file}/g.png"], "is a file"),
    ("pretrain-vlm with zero steps", ["pretrain-vlm", "{tmp}/vlm", "--steps", "0"], "--steps"),
    ("eval-vlm on a folder without a model", ["eval-vlm", "--model", "{tmp}"], "--model"),
    ("eval-vlm with a negative number of questions", ["eval-vlm", "--items", "-1"], "--items"),
    ("eval-vlm on a question file that does not exist", ["eval-vlm", "--files", "{tmp}/qa.jsonl"], "check --files"),
    ("eval-vlm writing a .txt result", ["eval-vlm", "--out", "{tmp}/scores.txt"], "unknown file type"),
    ("pretrain-vlm evaluating every 0 steps", ["pretrain-vlm", "{tmp}/vlm", "--eval-every", "0"], "--eval-every"),
    ("pretrain-vlm with 0 threads", ["pretrain-vlm", "{tmp}/vlm", "--threads", "0"], "--threads"),
    ("pretrain-shapes with negative steps", ["pretrain-shapes", "{tmp}/s", "--steps", "-1"], "--steps"),
    ("pretrain-shapes continuing a scenes run as text", ["pretrain-shapes", "{pretrain_run}", "--world", "text"],
     "--world"),
    ("pretrain-shapes continuing a run with another seed", ["pretrain-shapes", "{pretrain_run}", "--seed", "3"],
     "--seed"),
    ("pretrain-shapes with 0-wide text encoders", ["pretrain-shapes", "{tmp}/s", "--text-width", "0"], "--text-width"),
    ("pretrain-shapes continuing a run with wider text encoders",
     ["pretrain-shapes", "{pretrain_run}", "--text-width", "128"], "--text-width"),
    ("pretrain-shapes on a cosine shorter than its warm-up",
     ["pretrain-shapes", "{tmp}/s", "--steps", "100", "--lr-schedule", "cosine"], "--steps"),
    ("pretrain-shapes continuing a constant-rate run on a cosine",
     ["pretrain-shapes", "{pretrain_run}", "--lr-schedule", "cosine"], "--lr-schedule"),
    ("pretrain-shapes with learning rate 0", ["pretrain-shapes", "{tmp}/s", "--lr", "0"], "--lr"),
    ("pretrain-shapes starting from a folder that is no pipeline", ["pretrain-shapes", "{tmp}/s", "--init", "{tmp}"],
     "--init"),
    ("pretrain-shapes starting from a pipeline with wider text encoders",
     ["pretrain-shapes", "{tmp}/s", "--init", "builtin:shapes", "--text-width", "256"], "--init"),
    ("pretrain-shapes weighting an unknown category", ["pretrain-shapes", "{tmp}/s", "--category-weights", "circles=2"],
     "--category-weights"),
    ("pretrain-shapes weighting every category 0",
     ["pretrain-shapes", "{tmp}/s", "--category-weights",
      "single_object=0,two_object=0,counting=0,colors=0,position=0,color_attr=0"], "--category-weights"),
    ("pretrain-shapes weighting categories of the text world",
     ["pretrain-shapes", "{tmp}/s", "--world", "text", "--category-weights", "two_object=2"], "--category-weights"),
    ("eval --task text on the train split", ["eval", "--task", "text", "--split", "train"], "--split"),
    ("eval --task edit against a baseline that is not a results file", ["eval", "--task", "edit", "--baseline",
                                                                          "{file}"], "--baseline"),
    ("eval --task text paired against a baseline", ["eval", "--task", "text", "--baseline", "{file}"], "--baseline"),
    ("eval --task edit at another size than the world's", ["eval", "--task", "edit", "--resolution", "64"],
     "--resolution"),
    ("pretrain-shapes weighting categories of the edit world",
     ["pretrain-shapes", "{tmp}/s", "--world", "edit", "--category-weights", "two_object=2"], "--category-weights"),
    ("pretrain-shapes with deeper text encoders for the edit world",
     ["pretrain-shapes", "{tmp}/s", "--world", "edit", "--text-layers", "3"], "--text-layers"),
    ("demo-edit with 0 items per kind of edit", ["demo-edit", "--per-edit", "0"], "--per-edit"),
    ("make-preferences over an existing preference file", ["make-preferences", "{prefs}"], "already holds"),
    ("make-preferences pairing by a score the reward does not return",
     ["make-preferences", "{tmp}/p", "--score", "shapes_strictness"], "--score"),
    ("make-preferences writing under a file", ["make-preferences", "{file}/p"], "is a file"),
    ("make-preferences with 0 images per prompt", ["make-preferences", "{tmp}/p", "--n", "0"], "--n"),
    ("make-preferences with margin inf", ["make-preferences", "{tmp}/p", "--margin", "inf"], "--margin"),
    ("make-preferences with 0 pairs", ["make-preferences", "{tmp}/p", "--pairs-per-prompt", "0"],
     "--pairs-per-prompt"),
    ("build-tiny at resolution 0", ["build-tiny", "{tmp}/t", "--resolution", "0"], "--resolution"),
    ("build-tiny of an unknown family", ["build-tiny", "{tmp}/t", "--family", "sdxl"], "--family"),
    ("build-tiny of a Wan folder without a VAE", ["build-tiny", "{tmp}/t", "--family", "wan", "--no-vae"], "--no-vae"),
    ("demo-jpeg with 0 steps", ["demo-jpeg", "--steps", "0"], "--steps"),
    ("plot a folder without metrics", ["plot", "{tmp}/nothing"], "metrics.jsonl"),
    ("plot a key the run never logged", ["plot", "{run}", "--keys", "nope/*"], "no metric"),
    ("plot to an unknown image type", ["plot", "{run}", "--out", "{tmp}/c.bad"], "unknown file type"),
    ("export a run folder", ["export", "{run}", "{tmp}/out"], "is a run folder"),
    ("export a checkpoint without actor/", ["export", "{ckpt_no_actor}", "{tmp}/out"], "actor/"),
    ("export a checkpoint linking a file outside it", ["export", "{ckpt_link_file}", "{tmp}/out", "--adapter-only"],
     "outside the checkpoint"),
    ("export a checkpoint whose adapter folder is a link out", ["export", "{ckpt_link_dir}", "{tmp}/out"],
     "outside the checkpoint"),
    ("export onto an existing file", ["export", "{ckpt}", "{file}"], "exists and is a file"),
    ("export into the checkpoint it exports", ["export", "{ckpt}", "{ckpt}/exported"], "checkpoint rotation"),
    ("export a torn adapter", ["export", "{ckpt_torn}", "{tmp}/out", "--adapter-only", "--base-model", "{tmp}"],
     "does not read"),
    ("export a diffusion checkpoint's EMA", ["export", "{ckpt}", "{tmp}/out", "--weights", "ema"], "--weights"),
    ("export into a non-empty folder", ["export", "{ckpt}", "{run}"], "not empty"),
    ("export onto a link whose target is gone", ["export", "{ckpt}", "{dangling}"], "which does not exist"),
    ("a run folder under a link whose target is gone", [*SHAPES, "trainer.default_local_dir={dangling}/runs"],
     "which does not exist"),
    ("a whole export of a torn adapter", ["export", "{ckpt_torn}", "{tmp}/out", "--base-model", "{tmp}"],
     "does not read"),
    ("export with a relative model path from elsewhere", ["export", "{ckpt}", "{tmp}/out"], "--base-model"),
    # output locations of a training run
    ("run folder that is a file", [*SHAPES, "trainer.default_local_dir={file}"], "trainer.default_local_dir"),
    ("a loss's params given as a list", [*SHAPES, "diffusion_loss.params=[1, 2]"],
     "`diffusion_loss.params` = [1, 2]: must be a mapping"),
    ("the reward functions given as a mapping", [*SHAPES, "reward.functions={name: x}"],
     "`reward.functions` = {'name': 'x'}: must be a list"),
    ("a whole section given as a list", ["config", "rollout=[1]"], "`rollout` = [1]: must be a mapping"),
    ("offline DPO mini-batches larger than a step's pairs",
     ["config", "--config-name", "shapes_dpo_offline", "actor.ppo_mini_batch_size=32"], "the 16 preference pairs"),
    ("run folder under a file", [*SHAPES, "trainer.default_local_dir={file}/runs"], "is a file"),
    ("rollout dump under a file", [*SHAPES, "trainer.rollout_data_dir={file}/r"], "trainer.rollout_data_dir"),
    ("validation dump that is a file", [*SHAPES, "trainer.validation_data_dir={file}"],
     "trainer.validation_data_dir"),
    # numbers out of their domain
    ("learning rate inf", [*SHAPES, "actor.lr=inf"], "actor.lr"),
    ("negative learning rate", [*SHAPES, "actor.lr=-1e-4"], "actor.lr"),
    ("Adam eps 0", [*SHAPES, "actor.adam_eps=0"], "actor.adam_eps"),
    ("negative max grad norm", [*SHAPES, "actor.max_grad_norm=-1"], "actor.max_grad_norm"),
    ("an EMA of the weights that never moves", [*SHAPES, "actor.ema_decay=1"], "actor.ema_decay"),
    ("weighting a data source the training files do not have", [*SHAPES, "data.source_weights={two_shapes: 2}"],
     "data.source_weights"),
    ("a fractional data-source weight", [*SHAPES, "data.source_weights={position: 1.5}"], "data.source_weights"),
    ("allowing a resume to change a field that defines the checkpoint", [*SHAPES, "trainer.resume_changes=[model.path]"],
     "trainer.resume_changes"),
    ("a DMD2 student validated at other steps than it is distilled for",
     ["train", "--config-name", "shapes_dmd2", "val_kwargs.num_steps=10"], "val_kwargs.num_steps"),
    ("a DMD2 cycle without the student", ["train", "--config-name", "shapes_dmd2",
                                          "diffusion_loss.params.cycle=[fake_score]"], "diffusion_loss.params.cycle"),
    ("source weights on a vision-language run", [*VLM, "data.source_weights={counting: 2}"], "data.source_weights"),
    ("an EMA warm-up that is not true or false", [*SHAPES, "actor.ema_decay=0.9", "actor.ema_warmup=maybe"],
     "actor.ema_warmup"),
    ("a negative count of non-finite updates that stop the run", [*SHAPES, "actor.max_consecutive_nonfinite=-1"],
     "actor.max_consecutive_nonfinite"),
    ("an optimizer preflight every -5 steps", [*SHAPES, "actor.preflight_every=-5"], "actor.preflight_every"),
    ("a DMD2 rollout reuse that is not true or false", ["train", "--config-name", "shapes_dmd2",
                                                        "diffusion_loss.params.reuse_rollout=sometimes"],
     "diffusion_loss.params.reuse_rollout"),
    ("an EMA updated every 0 steps", [*SHAPES, "actor.ema_decay=0.9", "actor.ema_update_interval=0"],
     "actor.ema_update_interval"),
    ("the diffusion EMA on a vision-language run", [*VLM, "actor.ema_decay=0.9"], "vlm.ema_decay"),
    ("on-policy distillation that would drop samples by their reward",
     [*SHAPES, "diffusion_loss.name=distill_kl"], "algorithm.drop_zero_advantage"),
    ("a distillation teacher folder without a LoRA in it",
     [*SHAPES, "diffusion_loss.name=distill_kl", "algorithm.drop_zero_advantage=false",
      "diffusion_loss.teacher={tmp}"], "diffusion_loss.teacher"),
    ("a distillation teacher that is not there",
     [*SHAPES, "diffusion_loss.name=distill_kl", "algorithm.drop_zero_advantage=false",
      "diffusion_loss.teacher={tmp}/no_teacher"], "no such folder"),
    ("a teacher LoRA for a fully fine-tuned student (the LoRA's base would move)",
     [*SHAPES, "diffusion_loss.name=distill_kl", "algorithm.drop_zero_advantage=false", "model.lora_rank=0",
      "diffusion_loss.teacher={ckpt}"], "a whole fine-tuned teacher"),
    ("on-policy distillation toward the student's own base (loss and gradient 0 at every step)",
     [*SHAPES, "diffusion_loss.name=distill_kl", "algorithm.drop_zero_advantage=false"], "own base"),
    ("a distillation teacher whose LoRA file is cut short",
     [*SHAPES, "diffusion_loss.name=distill_kl", "algorithm.drop_zero_advantage=false",
      "diffusion_loss.teacher={ckpt_torn}"], "cut short or damaged: copy or export the teacher again"),
    ("a DMD2 update cycle set to null", ["train", "--config-name", "shapes_dmd2", "diffusion_loss.params.cycle=null"],
     "`diffusion_loss.params.cycle` = None: must be a list"),
    ("the distillation demo where no demo ran", ["demo-distill"], "run `make demo` first"),
    ("a diffusion loss's KL on a vision-language run (it was silently ignored)",
     [*VLM, "diffusion_loss.kl_coef=0.5"], "config field `diffusion_loss.kl_coef` = 0.5: is read by the diffusion"),
    ("a denoising step count on a vision-language run", [*VLM, "rollout.num_steps=4"], "`rollout.num_steps` = 4"),
    ("an overlong buffer as long as the responses", [*VLM, "vlm.overlong_buffer=4"], "vlm.overlong_buffer"),
    ("dynamic sampling without a group baseline", [*VLM, "vlm.estimator=gae", "vlm.dynamic_sampling_rounds=3"],
     "vlm.dynamic_sampling_rounds"),
    ("a running-mean subtraction without the running normalisation",
     [*VLM, "vlm.reward_running_norm_minus_mean=true"], "vlm.reward_running_norm_minus_mean"),
    ("sequence parallelism on a vision-language run", [*VLM, "trainer.sequence_parallel_size=2"],
     "trainer.sequence_parallel_size"),
    ("negative LoRA rank", [*SHAPES, "model.lora_rank=-1"], "model.lora_rank"),
    ("AWM with its EMA term on the whole denoiser (the EMA is a second LoRA adapter)",
     ["train", "--config-name", "shapes_awm", "model.lora_rank=0"], "model.lora_rank"),
    ("more AWM timestep strata than the sampling grid holds",
     ["train", "--config-name", "shapes_demo", "diffusion_loss.params.num_timesteps=9"],
     "diffusion_loss.params.num_timesteps"),
    ("noise shared within groups of one image",
     ["train", "--config-name", "shapes_demo", "diffusion_loss.params.group_noise=true", "rollout.n=1"],
     "diffusion_loss.params.group_noise"),
    ("an AWM timestep draw shared by no sample",
     ["train", "--config-name", "shapes_demo", "diffusion_loss.params.samples_per_timestep_draw=0"],
     "diffusion_loss.params.samples_per_timestep_draw"),
    ("AWM timesteps shared by sets of samples and per prompt group at once",
     ["train", "--config-name", "shapes_demo", "diffusion_loss.params.samples_per_timestep_draw=3",
      "diffusion_loss.params.group_noise=true"], "diffusion_loss.params.samples_per_timestep_draw"),
    ("SA-Solver sampling for a loss that re-scores SDE transitions",
     ["train", "--config-name", "shapes_flow_grpo", "rollout.solver=sa_solver"], "rollout.solver"),
    ("one denoising step for a policy-gradient run", ["train", "--config-name", "flow_grpo_tiny", "rollout.num_steps=1",
                                                     "model.path={tmp}"], "rollout.num_steps"),
    ("a policy-gradient run sampling without noise (it used to train nothing, silently)",
     [*SHAPES, "rollout.noise_level=0"], "rollout.noise_level"),
    ("stored ODE steps for a loss that reads log-probabilities",
     [*SHAPES, "rollout.noise_level=0", "rollout.sde_type=ode"], "rollout.sde_type"),
    ("ODE steps asked to inject noise", [*SHAPES, "rollout.sde_type=ode"], "rollout.noise_level"),
    ("a CPS noise level past all noise", [*SHAPES, "rollout.sde_type=cps", "rollout.noise_level=1.5"],
     "rollout.noise_level"),
    ("a resolution past the model's position table", [*SHAPES, "rollout.resolution=64"], "rollout.resolution"),
    ("generate past the model's position table", ["generate", "--prompt", "a red circle", "--resolution", "64",
                                                  "--out", "{tmp}/big.png"], "--resolution"),
    ("build-tiny onto a file", ["build-tiny", "{file}"], "is a file"),
    ("inline prompts given as one string", [*SHAPES, "data.train_files=[]", "data.prompts=a red circle"],
     "must be a list"),
    ("a learning rate in words", [*SHAPES, "actor.lr=fast"], "must be a number"),
    ("pretrain-shapes into a file", ["pretrain-shapes", "{file}", "--steps", "2"], "is a file"),
    ("pretrain-vlm into a file", ["pretrain-vlm", "{file}", "--steps", "1"], "is a file"),
    ("make-preferences from a prompt file that is not there",
     ["make-preferences", "{tmp}/p", "--prompts", "{tmp}/nope.jsonl"], "--prompts"),
    ("a recipe extending a config that is nowhere", ["train", "--config-name", "{recipe}"], "no_such_base"),
    ("a prompt file that is not UTF-8", [*SHAPES, "data.train_files=[{not_utf8}]"], "not UTF-8"),
    ("validation with DPM-Solver++ asked to inject noise",
     ["train", "--config-name", "shapes_demo", "val_kwargs.solver=dpm2", "val_kwargs.noise_level=0.5"],
     "val_kwargs.solver"),
    ("DPM-Solver++ asked to inject noise",
     ["train", "--config-name", "shapes_nft", "rollout.solver=dpm2", "rollout.noise_level=0.5"], "rollout.solver"),
    ("sampling AWM's EMA adapter while fine-tuning the whole denoiser",
     ["train", "--config-name", "shapes_demo", "diffusion_loss.params.rollout_policy=old"],
     "diffusion_loss.params.rollout_policy"),
    ("zero images per prompt", [*SHAPES, "rollout.n=0"], "rollout.n"),
    # validation settings, checked before training instead of failing at the first validation
    ("zero images per validation prompt", [*SHAPES, "val_kwargs.n=0"], "val_kwargs.n"),
    ("zero validation sampling steps", [*SHAPES, "val_kwargs.num_steps=0"], "val_kwargs.num_steps"),
    ("negative validation batch", [*SHAPES, "data.val_batch_size=-1"], "data.val_batch_size"),
    ("validation noise nan", [*SHAPES, "val_kwargs.noise_level=nan"], "val_kwargs.noise_level"),
    ("negative validation noise", [*SHAPES, "val_kwargs.noise_level=-1"], "val_kwargs.noise_level"),
    ("save every -3 steps", [*SHAPES, "trainer.save_freq=-3"], "trainer.save_freq"),
    ("validate every -2 steps", [*SHAPES, "trainer.test_freq=-2"], "trainer.test_freq"),
    ("an Adam beta above 1", [*SHAPES, "actor.betas=[1.5,0.999]"], "actor.betas"),
    ("weight decay nan", [*SHAPES, "actor.weight_decay=nan"], "actor.weight_decay"),
    ("negative warm-up", [*SHAPES, "actor.warmup_steps=-1"], "actor.warmup_steps"),
    ("a cosine floor above the rate", [*SHAPES, "actor.min_lr_ratio=2"], "actor.min_lr_ratio"),
    ("negative reward CPUs", [*SHAPES, "reward.num_cpus=-1"], "reward.num_cpus"),
    ("negative T5 length", [*SHAPES, "model.max_sequence_length=-1"], "model.max_sequence_length"),
    ("the only reward weighted 0", [*SHAPES, "reward.functions=[{name: shapes_geneval, weight: 0}]"],
     "reward.functions[].weight"),
    ("a blank inline prompt", [*SHAPES, "data.train_files=[]", "data.prompts=[' ']"], "data.prompts"),
    ("a CUDA device on a machine without one", [*SHAPES, "trainer.backend=local", "trainer.n_workers=1",
                                                 "model.device=cuda"], "model.device"),
    ("a device torch cannot name", [*SHAPES, "model.device=gpu0"], "model.device"),
    ("more GPU workers than this machine has GPUs, on a Ray cluster started here",
     [*SHAPES, "model.device=cuda"], "trainer.n_workers"),
    ("a step whose images alone outgrow the machine", [*SHAPES, "rollout.n=2000000"],
     "rollout.n"),
    ("a step whose stored trajectories outgrow the machine",
     [*SHAPES, "rollout.n=2000", "rollout.num_steps=200", "rollout.sde_window_size=150", "rollout.sde_window_range=null"],
     "stored trajectories take"),
    ("a real-size recipe on a CPU", ["train", "--config-name", "flow_grpo_sd35", "model.path={tmp}", "model.device=cpu",
                                     "model.dtype=float32", "trainer.backend=ray"], "hours per step"),
    ("an override without a key", [*SHAPES, "=5"], "section.key=value"),
    ("an override with an empty section", [*SHAPES, "rollout..n=3"], "section.key=value"),
    ("an override whose list is not closed", [*SHAPES, "data.prompts=[unclosed"], "not valid YAML"),
    ("an unknown rejection level", [*SHAPES, "algorithm.rollout_rs=batch"], "algorithm.rollout_rs"),
    ("rejection bounds the wrong way round", [*SHAPES, "algorithm.rollout_rs_lower=3", "algorithm.rollout_rs_upper=2"],
     "algorithm.rollout_rs_lower"),
    ("a rejection criterion without bounds", [*SHAPES, "algorithm.rollout_rs=seq_mean_k1"],
     "algorithm.rollout_rs_threshold"),
    ("a k1 bound spec YAML reads as one number (0.5_2 is 0.52)", [*SHAPES, "algorithm.rollout_rs=token_k1",
                                                                  "algorithm.rollout_rs_threshold=0.5_2"],
     "algorithm.rollout_rs_threshold"),
    ("a k3 rejection criterion given a lower bound", [*SHAPES, "algorithm.rollout_rs=token_k3",
                                                      "algorithm.rollout_rs_threshold=0.1_0.5"],
     "algorithm.rollout_rs_threshold"),
    ("an IcePop band the wrong way round", [*SHAPES, "algorithm.rollout_is_threshold=5.0_0.5"],
     "algorithm.rollout_is_threshold"),
    ("zero sampling steps", [*SHAPES, "rollout.num_steps=0"], "rollout.num_steps"),
    ("negative clip ratio", [*SHAPES, "diffusion_loss.clip_ratio=-0.1"], "diffusion_loss.clip_ratio"),
    ("cosine lr no longer than its warm-up", [*SHAPES, "actor.lr_schedule=cosine", "actor.warmup_steps=160"],
     "trainer.total_training_steps"),
    ("unknown lr schedule", [*SHAPES, "actor.lr_schedule=linear"], "actor.lr_schedule"),
    ("negative number of steps", [*SHAPES, "trainer.total_training_steps=-5"], "trainer.total_training_steps"),
    ("guidance nan", [*SHAPES, "rollout.guidance_scale=nan"], "rollout.guidance_scale"),
    ("zero PPO epochs", [*SHAPES, "actor.ppo_epochs=0"], "actor.ppo_epochs"),
    ("zero workers", [*SHAPES, "trainer.n_workers=0"], "trainer.n_workers"),
    ("zero CPUs per worker", [*SHAPES, "trainer.num_cpus_per_worker=0"], "trainer.num_cpus_per_worker"),
    ("negative restarts", [*SHAPES, "trainer.max_restarts=-1"], "trainer.max_restarts"),
    ("restarts of the in-process worker", [*SHAPES, "trainer.backend=local", "trainer.n_workers=1",
                                           "trainer.max_restarts=2"],
     "trainer.max_restarts"),
    ("best checkpoint by a training metric", [*SHAPES, "trainer.best_metric=critic/rewards/mean"],
     "trainer.best_metric"),
    ("best checkpoint of a run that never validates (the config's trainer.test_freq=-1)",
     [*SHAPES, "trainer.best_metric=val-core/overall/reward/mean@1"], "trainer.best_metric"),
    ("best checkpoint without validation prompts", [*SHAPES, "trainer.best_metric=val-core/overall/reward/mean@1",
                                                    "trainer.test_freq=10", "data.val_files=[]"],
     "trainer.best_metric"),
    ("stop at a hacking flag of a run that never validates (the config's trainer.test_freq=-1)",
     [*SHAPES, "trainer.stop_when_hacking=true"], "trainer.stop_when_hacking"),
    ("stop at a hacking flag with no untrained baseline",
     [*SHAPES, "trainer.stop_when_hacking=true", "trainer.test_freq=10"], "trainer.val_before_train=true"),
    ("stop at a hacking flag without validation prompts",
     [*SHAPES, "trainer.stop_when_hacking=true", "trainer.test_freq=10", "trainer.val_before_train=true",
      "data.val_files=[]"], "trainer.stop_when_hacking"),
    ("a hacking watch on an unknown image statistic", [*SHAPES, "val_kwargs.hacking.drift={darkness: 0.1}"],
     "val_kwargs.hacking.drift"),
    ("a diversity floor above 1", [*SHAPES, "val_kwargs.hacking.diversity_floor=1.5"],
     "val_kwargs.hacking.diversity_floor"),
    ("gold rewards on the rollouts with no gold rewards", [*SHAPES, "val_kwargs.gold_on_rollouts=true"],
     "val_kwargs.gold_on_rollouts"),
    ("gold outputs to watch with no gold rewards", [*SHAPES, "val_kwargs.hacking.gold=[shapes_strict]"],
     "val_kwargs.hacking.gold"),
    ("an oversampling pool of zero candidates per kept sample", [*SHAPES, "rollout.oversample.factor=0"],
     "rollout.oversample.factor"),
    ("an oversampling keep rule that does not exist", [*SHAPES, "rollout.oversample.factor=4",
                                                       "rollout.oversample.keep=median"], "rollout.oversample.keep"),
    ("a stochastic sampler for the oversampling pool", [*SHAPES, "rollout.oversample.factor=4",
                                                        "rollout.oversample.solver=sa_solver"],
     "rollout.oversample.solver"),
    ("training Flow-GRPO on the pool's own samples (they store no SDE step)",
     [*SHAPES, "rollout.oversample.factor=4", "rollout.oversample.regenerate=false"], "rollout.oversample.regenerate"),
    ("oversampling DanceGRPO's shared group noise", [*SHAPES, "rollout.oversample.factor=4",
                                                    "rollout.same_noise_per_group=true"], "same_noise_per_group=false"),
    ("oversampling on a separate rollout pool", [*SHAPES, "rollout.oversample.factor=4", "rollout.n_workers=1",
                                                 "trainer.mode=one_step_off"], "rollout.n_workers=0"),
    ("oversampling a distillation run without rewards", ["train", "--config-name", "shapes_dmd2",
                                                        "rollout.oversample.factor=4"], "rollout.oversample.factor"),
    ("oversampling offline preference pairs", ["train", "--config-name", "shapes_dpo_offline",
                                              "rollout.oversample.factor=4"], "rollout.oversample.factor"),
    ("a rollout accelerator that does not exist", [*SHAPES, "rollout.accelerator=teacache"], "rollout.accelerator"),
    ("a lossy rollout cache for Flow-GRPO, whose loss re-scores the rollout's steps",
     [*SHAPES, "rollout.accelerator=first_block_cache"], "rollout.accelerator=none"),
    ("accelerator params with no accelerator", ["train", "--config-name", "shapes_nft",
                                                "rollout.accelerator_params={threshold: 0.2}"],
     "rollout.accelerator_params"),
    ("a first-block cache with a negative threshold", ["train", "--config-name", "shapes_nft",
                                                       "rollout.accelerator=first_block_cache",
                                                       "rollout.accelerator_params={threshold: -0.1}"],
     "rollout.accelerator_params.threshold"),
    ("a first-block cache param that does not exist", ["train", "--config-name", "shapes_nft",
                                                       "rollout.accelerator=first_block_cache",
                                                       "rollout.accelerator_params={thresh: 0.1}"],
     "rollout.accelerator_params"),
    # names and combinations
    ("misspelled key", [*SHAPES, "actor.lrr=1e-4"], "did you mean `lr`?"),
    ("a config file path that does not exist", ["train", "--config-name", "{tmp}/my_recipe.yaml"],
     "that YAML file does not exist"),
    ("a run name that is a path (it would put the run outside default_local_dir)",
     [*SHAPES, "trainer.experiment_name=/elsewhere/run"], "trainer.experiment_name"),
    ("a model path that is a file", [*SHAPES, "model.path={file}"], "is a file, not a folder"),
    ("unknown strategy", [*SHAPES, "trainer.strategy=zero3"], "trainer.strategy"),
    ("unknown backend", [*SHAPES, "trainer.backend=slurm"], "trainer.backend"),
    ("a sequence group larger than the workers", [*SHAPES, "trainer.sequence_parallel_size=2"],
     "trainer.sequence_parallel_size"),
    ("a sequence split of a family without one (the shapes model is SD3)",
     [*SHAPES, "trainer.backend=ray", "trainer.n_workers=2", "trainer.sequence_parallel_size=2"],
     "has no sequence split"),
    ("unknown training mode", [*SHAPES, "trainer.mode=fast"], "trainer.mode"),
    ("unknown logger", [*SHAPES, "trainer.logger=[nope]"], "trainer.logger"),
    ("unknown config name", ["train", "--config-name", "no_such_config"], "no_such_config"),
    ("model folder that does not exist", [*SHAPES, "model.path={tmp}/no_model"], "model.path"),
    ("resume from a folder that does not exist", [*SHAPES, "trainer.resume_mode={tmp}/gone"], "trainer.resume_mode"),
    ("unknown reward", [*SHAPES, "reward.functions=[{name: nope}]"], "reward.functions[0].name"),
    ("reward entry without a name", [*SHAPES, "reward.functions=[{weight: 1}]"], "reward.functions[0]"),
    ("reward option that does not exist", [*SHAPES, "reward.functions=[{name: shapes_geneval, options: {x: 1}}]"],
     "reward.functions[0].options"),
    ("strict weight above 1", [*SHAPES, "reward.functions=[{name: shapes_geneval, options: {strict_weight: 2}}]"],
     "strict_weight"),
    ("negative extra-object penalty",
     [*SHAPES, "reward.functions=[{name: shapes_geneval, options: {extra_object_penalty: -1}}]"],
     "extra_object_penalty"),
    ("reward weight inf", [*SHAPES, "reward.functions=[{name: shapes_geneval, weight: inf}]"],
     "reward.functions[0].weight"),
    ("reward weight that is a word", [*SHAPES, "reward.functions=[{name: shapes_geneval, weight: heavy}]"],
     "reward.functions[0].weight"),
    ("remote reward without an address", [*SHAPES, "reward.functions=[{name: remote}]"], "options.url"),
    ("remote reward with an ftp address", [*SHAPES, "reward.functions=[{name: remote, options: {url: 'ftp://127.0.0.1:1'}}]"],
     "options.url"),
    ("remote reward with zero timeout",
     [*SHAPES, "reward.functions=[{name: remote, options: {url: 'http://127.0.0.1:1', timeout_s: 0}}]"], "options.timeout_s"),
    ("CLIP score from a folder that does not exist",
     [*SHAPES, "reward.functions=[{name: clip_score, options: {path: '{tmp}/no_clip'}}]"], "options.path"),
    ("aesthetic folder without its head", [*SHAPES, "reward.functions=[{name: aesthetic, options: {path: '{tmp}'}}]"],
     "head.safetensors"),
    ("VLM judge from a folder that does not exist",
     [*SHAPES, "reward.functions=[{name: vlm_judge, options: {path: '{tmp}/no_judge'}}]"], "options.path"),
    ("OCR confidence above 1", [*SHAPES, "reward.functions=[{name: ocr, options: {min_confidence: 2}}]"],
     "options.min_confidence"),
    ("reward GPUs for in-process rewards", [*SHAPES, "reward.num_gpus=1"], "reward.num_gpus"),
    ("two in-process workers", [*SHAPES, "trainer.backend=local"], "trainer.n_workers"),
    ("reward GPUs on a machine without one",
     [*SHAPES, "trainer.backend=ray", "reward.placement=pool", "reward.num_gpus=1"], "reward.num_gpus"),
    ("negative reward GPUs", [*SHAPES, "reward.num_gpus=-1"], "reward.num_gpus"),
    ("demo that would save no checkpoint", ["demo", "trainer.save_freq=-1"], "trainer.save_freq"),
    ("negative device peak for MFU", [*SHAPES, "trainer.peak_tflops=-1"], "trainer.peak_tflops"),
    ("negative memory to fit the micro-batches to", [*SHAPES, "trainer.fit_to_memory_gb=-1"], "trainer.fit_to_memory_gb"),
    ("a memory plan for the vision-language trainer", [*VLM, "trainer.fit_to_memory_gb=80"], "trainer.fit_to_memory_gb"),
    ("a micro-batch that is neither a number nor auto", [*SHAPES, "actor.ppo_micro_batch_size=most"],
     "actor.ppo_micro_batch_size"),
    ("checkpointing that is neither true, false nor auto", [*SHAPES, "model.gradient_checkpointing=sometimes"],
     "model.gradient_checkpointing"),
    ("compiling that is neither true, false nor auto", [*SHAPES, "model.compile=sometimes"], "model.compile"),
    ("auto sizes for GPUs this process cannot see (on a Ray cluster's other nodes)",
     [*SHAPES, "model.device=cuda", "trainer.ray_address=127.0.0.1:6379", "rollout.micro_batch_size=auto"],
     "rollout.micro_batch_size"),
    ("an auto micro-batch for the vision-language trainer", [*VLM, "actor.ppo_micro_batch_size=auto"],
     "actor.ppo_micro_batch_size"),
    ("a negative step to profile", [*SHAPES, "trainer.profile_step=-2"], "trainer.profile_step"),
    ("a plan for GPUs the recipe's batch does not split over",
     ["plan", "--config-name", "flow_grpo_sd35", "--gpus", "7", "--gpu-memory", "80"], "--gpus"),
    ("a plan for GPUs too small for the weights",
     ["plan", "--config-name", "flow_grpo_sd35", "--gpus", "1", "--gpu-memory", "12"], "--gpu-memory"),
    ("a plan for zero GPUs", ["plan", "--config-name", "flow_grpo_sd35", "--gpus", "0", "--gpu-memory", "80"], "--gpus"),
    ("a plan with a misspelt field", ["plan", "--config-name", "flow_grpo_sd35", "--gpus", "1", "--gpu-memory", "80",
                                      "actor.ppo_micro_bach_size=2"], "ppo_micro_bach_size"),
    # the reward server
    ("reward server reachable from other machines without a token",
     ["serve-reward", "--reward", "jpeg_compressibility", "--host", "0.0.0.0"], "--host"),
    ("reward server for an unknown reward", ["serve-reward", "--reward", "nope"], "--reward"),
    ("ImageReward conversion without the checkpoint",
     ["convert-reward", "image_reward", "{tmp}/ImageReward.pt", "{tmp}/out", "--base", "{tmp}"], "<checkpoint>"),
    ("ImageReward conversion with a BLIP folder lacking its config",
     ["convert-reward", "image_reward", "{file}", "{tmp}/out", "--base", "{tmp}"], "--base"),
    ("HPSv2 conversion into a folder that holds files",
     ["convert-reward", "hpsv2", "{file}", "{run}", "--base", "{tmp}"], "<out>"),
    ("conversion of a reward that has no converter", ["convert-reward", "pickscore", "{file}", "{tmp}/out", "--base",
                                                      "{tmp}"], "pickscore"),
    ("reward server with options that are not JSON", ["serve-reward", "--reward", "ocr", "--reward-options", "{x"],
     "--reward-options"),
    ("reward server on port 70000", ["serve-reward", "--reward", "ocr", "--port", "70000"], "--port"),
    ("reward server with a zero size limit", ["serve-reward", "--reward", "ocr", "--max-request-mb", "0"],
     "--max-request-mb"),
    ("unknown built-in model", [*SHAPES, "model.path=builtin:nope"], "builtin:shapes"),
    ("the shapes model (an SD3 folder) as FLUX", [*SHAPES, "model.type=flux", "model.max_sequence_length=16"],
     "model.type"),
    ("an unknown model family", [*SHAPES, "model.type=sdxl"], "model.type"),
    ("video frames for an image model", [*SHAPES, "model.num_frames=5"], "model.num_frames"),
    ("FLUX without T5 tokens", [*SHAPES, "model.type=flux", "model.max_sequence_length=0"],
     "model.max_sequence_length"),
    ("unknown gold reward", [*SHAPES, "val_kwargs.rewards=[{name: nope}]"], "val_kwargs.rewards[0].name"),
    ("gold reward that is not a mapping", [*SHAPES, "val_kwargs.rewards=[3]"], "val_kwargs.rewards[0]"),
    ("GRPO-Guard with window steps sharing a forward",
     ["train", "--config-name", "grpo_guard_tiny", "model.path=builtin:shapes", "actor.window_steps_per_forward=0"],
     "actor.window_steps_per_forward"),
    ("negative window steps per forward", [*SHAPES, "actor.window_steps_per_forward=-2"],
     "actor.window_steps_per_forward"),
    ("unknown reward error policy", [*SHAPES, "reward.on_error=ignore"], "reward.on_error"),
    ("exact-scene weight above what strict leaves",
     [*SHAPES, "reward.functions=[{name: shapes_geneval, options: {strict_weight: 0.5, exact_weight: 0.8}}]"],
     "exact_weight"),
    ("zero reward failures allowed in a row", [*SHAPES, "reward.on_error=skip", "reward.max_consecutive_errors=0"],
     "reward.max_consecutive_errors"),
    ("a negative deadline for a reward call", [*SHAPES, "reward.timeout_s=-1"], "reward.timeout_s"),
    ("a JPEG quality PIL does not take, checked before the first step",
     [*SHAPES, "reward.functions=[{name: jpeg_compressibility, options: {quality: 0}}]"],
     "reward.functions[0].options.quality"),
    # plugins (the user's own rewards and losses)
    ("plugin file that does not exist", [*SHAPES, "plugins=[{tmp}/my_rewards.py]"], "plugins[0]"),
    ("plugin module that is not installed", [*SHAPES, "plugins=[my_project_rewards]"], "no module named"),
    ("plugin that raises while importing", [*SHAPES, "plugins=[{broken_plugin}]"], "broken_plugin.py:2"),
    ("plugin entry that is neither", [*SHAPES, "plugins=['my rewards']"], "plugins[0]"),
    ("reward of a plugin that is not listed", [*SHAPES, "reward.functions=[{name: my_reward}]"], "plugins:"),
    ("reward server with a plugin that does not exist",
     ["serve-reward", "--reward", "ocr", "--plugin", "{tmp}/mine.py"], "--plugin"),
    # the vision-language trainer
    ("VLM: unknown estimator", [*VLM, "vlm.estimator=ppo"], "vlm.estimator"),
    ("VLM: dual clip below 1", [*VLM, "vlm.dual_clip=0.5"], "vlm.dual_clip"),
    ("VLM: top-p above 1", [*VLM, "vlm.top_p=2"], "vlm.top_p"),
    ("VLM: negative temperature", [*VLM, "vlm.temperature=-1"], "vlm.temperature"),
    ("VLM: EMA decay 1", [*VLM, "vlm.ema_decay=1"], "vlm.ema_decay"),
    ("VLM: validate the EMA without one", [*VLM, "vlm.ema_decay=0", "vlm.validate_ema=true"], "vlm.validate_ema"),
    ("VLM: final lr above the peak", [*VLM, "actor.lr_schedule=cosine", "actor.min_lr_ratio=2"], "actor.min_lr_ratio"),
    ("VLM: adaptive KL from a zero coefficient", [*VLM, "vlm.kl_target=0.1"], "vlm.kl_coef"),
    ("VLM: entropy mask ratio 2", [*VLM, "vlm.entropy_mask_ratio=2"], "vlm.entropy_mask_ratio"),
    ("VLM: GRPO with one answer per question", [*VLM, "rollout.n=1"], "rollout.n"),
    ("VLM: critic warm-up without a critic", [*VLM, "vlm.freezing_actor_steps=3"], "vlm.freezing_actor_steps"),
    ("VLM: mini-batch not dividing the batch", [*VLM, "actor.ppo_mini_batch_size=5"], "actor.ppo_mini_batch_size"),
    ("VLM: two in-process workers", [*VLM, "trainer.backend=local"], "trainer.n_workers"),
    ("VLM: questions not splitting over workers", [*VLM, "trainer.backend=ray", "trainer.n_workers=3"],
     "data.train_batch_size"),
    ("VLM: asynchronous mode", [*VLM, "trainer.mode=one_step_off"], "trainer.mode"),
    ("VLM: skipping steps whose reward fails", [*VLM, "reward.on_error=skip"], "reward.on_error"),
    ("VLM: rewards in their own pool", [*VLM, "reward.placement=pool"], "reward.placement"),
    ("several reward workers in one process", [*SHAPES, "trainer.backend=local", "trainer.n_workers=1",
                                               "reward.num_workers=4"], "reward.num_workers"),
    ("VLM: gold image rewards", [*VLM, "val_kwargs.rewards=[{name: answer_match}]"], "val_kwargs.rewards"),
    ("VLM: a compiled denoiser", [*VLM, "model.compile=true"], "model.compile"),
    ("VLM: model folder without a processor", [*VLM, "model.path={tmp}"], "model.path"),
    ("VLM: question files without data.train_files", [*VLM, "vlm.task=files"], "data.train_files"),
    ("VLM: train files given to the built-in task", [*VLM, "data.train_files=[{file}]"], "vlm.task=files"),
    ("VLM: a question file that does not exist", [*VLM, "vlm.task=files", "data.train_files=[{tmp}/qa.jsonl]"],
     "check data.train_files"),
    ("VLM: a question file of an unknown type", [*VLM, "vlm.task=files", "data.train_files=[{file}]"],
     "unsupported type"),
    # editing: rows that name source images
    ("edit rows whose source image is missing", [*SHAPES, "data.train_files=[{edits}/missing.jsonl]"],
     "missing.jsonl, row 1"),
    ("edit rows whose source PNG has whole chunks but damaged pixel data (PIL's verify() passes it)",
     [*SHAPES, "data.train_files=[{edits}/damaged.jsonl]"], "damaged.jsonl, row 1: condition image"),
    ("the shapes detector reward on prompt rows without scene metadata (it failed at step 1 before)",
     [*SHAPES, "data.train_files=[{plain_prompts}]"], "reward `shapes_geneval` judges each image from its row's"),
    ("the shapes detector reward on inline prompts", [*SHAPES, "data.train_files=[]", "data.prompts=[a cat, a dog]"],
     "`data.prompts` = '2 inline prompts'"),
    ("the editing reward on edit rows without edit metadata", ["train", "--config-name", "shapes_edit_demo",
                                                               "data.train_files=[{edits}/edits.jsonl]"],
     "reward `shapes_edit` judges each image from its row's `metadata`"),
    ("edit rows for a text-to-image model", [*SHAPES, "data.train_files=[{edits}/edits.jsonl]"],
     "takes 0 condition"),
    ("a source-reading reward on a text-to-image model", [*SHAPES, "reward.functions=[{name: source_preservation}]"],
     "reward.functions"),
    ("a condition image size for a text-to-image model", [*SHAPES, "rollout.condition_resolution=64"],
     "rollout.condition_resolution"),
    ("a negative condition image size", [*SHAPES, "rollout.condition_resolution=-32"],
     "rollout.condition_resolution"),
    ("an unknown way to fit sources to the output", [*SHAPES, "data.condition_fit=squash"], "data.condition_fit"),
    ("a source fit for a text-to-image model", [*SHAPES, "data.condition_fit=pad"], "data.condition_fit"),
    ("validating an old adapter the run does not keep", [*SHAPES, "val_kwargs.weights=old"], "val_kwargs.weights"),
    ("validating the old adapter beside an EMA", ["train", "--config-name", "shapes_nft", "val_kwargs.weights=old",
                                                 "actor.ema_decay=0.9"], "actor.ema_decay=0.9"),
    ("edits in their sources' aspects for a text-to-image model", [*SHAPES, "rollout.output_aspect=source"],
     "rollout.output_aspect"),
    ("an unknown output aspect", [*SHAPES, "rollout.output_aspect=wide"], "rollout.output_aspect"),
    ("offline preference pairs in their sources' aspects", ["train", "--config-name", "shapes_dpo_offline",
                                                            "rollout.output_aspect=source"], "offline preference"),
    ("DMD2 with edits in their sources' aspects", ["train", "--config-name", "shapes_dmd2",
                                                   "rollout.output_aspect=source"], "DMD2 student samples"),
    ("an NFT strata end without strata", ["train", "--config-name", "shapes_nft", "diffusion_loss.params.min_sigma=0.3"],
     "diffusion_loss.params.min_sigma"),
    ("a second expert's guidance for a one-denoiser model", ["train", "--config-name", "shapes_flow_grpo",
                                                             "model.guidance_scale_2=3"], "model.guidance_scale_2"),
    ("trained experts of a one-denoiser model", ["train", "--config-name", "shapes_flow_grpo",
                                                 "model.trained_experts=[transformer_2]"], "model.trained_experts"),
]


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs")
    _make_places(root)
    return root


def _make_places(root: Path) -> None:
    """Things a bad input points at: a file, a run folder (metrics and a checkpoints/ folder) and
    checkpoints with and without actor/ (their config names a relative model path)."""
    (root / "a_file").write_text("not a folder")
    from pixelrl.shapes.pretrain import SHAPES_ARCH

    (root / "pretrain_run").mkdir()  # a scenes pretraining run with the default recipe, seed 0
    (root / "pretrain_run" / "run.json").write_text(json.dumps(
        {"world": "scenes", "seed": 0, "batch_size": 64, "lr": 1e-3, "warmup": 200, "ema_decay": 0.999,
         "arch": SHAPES_ARCH}))
    (root / "broken_plugin.py").write_text("import math\nraise RuntimeError('the plugin fails at import')\n")
    run = root / "run"
    (run / "checkpoints" / "global_step_3").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "critic/rewards/mean": 0.5}\n')
    for name, with_actor in (("ckpt", True), ("ckpt_no_actor", False)):
        (root / name / ("actor" if with_actor else "")).mkdir(parents=True, exist_ok=True)
        (root / name / "config.yaml").write_text("model:\n  path: runs/tiny_sd3\n")
    # crafted checkpoints: a weights file, or the whole adapter folder, linked to outside the checkpoint
    for name in ("ckpt_link_file", "ckpt_link_dir"):
        (root / name / "actor").mkdir(parents=True)
        (root / name / "config.yaml").write_text("model:\n  path: runs/tiny_sd3\n")
    (root / "ckpt_link_file" / "actor" / "adapter").mkdir()
    (root / "ckpt_link_file" / "actor" / "adapter" / "pytorch_lora_weights.safetensors").symlink_to(root / "a_file")
    (root / "ckpt_link_dir" / "actor" / "adapter").symlink_to(root / "run")
    (root / "base_model").mkdir()  # the base a checkpoint trained on (only its place matters here)
    (root / "ckpt_on_base" / "actor").mkdir(parents=True)
    (root / "ckpt_on_base" / "config.yaml").write_text(f"model:\n  path: {root / 'base_model'}\n")
    (root / "prefs").mkdir()
    (root / "prefs" / "preferences.jsonl").write_text('{"prompt": "a red circle"}\n')
    (root / "dangling").symlink_to(root / "deleted_since")  # a link whose target is gone
    from PIL import Image

    (root / "edits").mkdir()  # edit rows: one with a readable source, one naming a file that is not there
    Image.new("RGB", (32, 32), (200, 40, 40)).save(root / "edits" / "source.png")
    (root / "edits" / "edits.jsonl").write_text('{"prompt": "make it blue", "image": "source.png"}\n')
    (root / "edits" / "missing.jsonl").write_text('{"prompt": "make it blue", "image": "gone.png"}\n')
    damaged_png(root / "edits" / "damaged.png")
    (root / "edits" / "damaged.jsonl").write_text('{"prompt": "make it blue", "image": "damaged.png"}\n')
    (root / "plain_prompts.jsonl").write_text('{"prompt": "a red circle"}\n{"prompt": "two blue squares"}\n')
    (root / "recipe.yaml").write_text("defaults: [no_such_base]\nrollout:\n  n: 2\n")  # extends nothing there
    (root / "not_utf8.jsonl").write_bytes(b'{"prompt": "a red circle"}\n{"prompt": "a caf\xe9"}\n')  # Latin-1
    # an adapter whose weights file was cut short (a header promising more bytes than follow)
    (root / "ckpt_torn" / "actor" / "adapter").mkdir(parents=True)
    (root / "ckpt_torn" / "config.yaml").write_text("model:\n  path: runs/tiny_sd3\n")
    (root / "ckpt_torn" / "actor" / "adapter" / "pytorch_lora_weights.safetensors").write_bytes(
        b"\x40\x00\x00\x00\x00\x00\x00\x00" + b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}')


def _tree(folder: Path) -> dict[str, float]:
    # lstat: a link is recorded as itself (the dangling one has no target to stat)
    return {str(p.relative_to(folder)): p.lstat().st_mtime for p in sorted(folder.rglob("*"))}


def replay(argv: list[str], root: Path, workdir: Path) -> tuple[int, str]:
    """Run `pixelrl argv` in-process from `workdir`; the exit code and everything printed."""
    from pixelrl.cli import main

    places = {"{tmp}": str(workdir), "{file}": str(root / "a_file"), "{run}": str(root / "run"),
              "{ckpt_no_actor}": str(root / "ckpt_no_actor"), "{ckpt}": str(root / "ckpt"),
              "{ckpt_link_file}": str(root / "ckpt_link_file"), "{ckpt_link_dir}": str(root / "ckpt_link_dir"),
              "{ckpt_torn}": str(root / "ckpt_torn"), "{prefs}": str(root / "prefs"),
              "{broken_plugin}": str(root / "broken_plugin.py"), "{pretrain_run}": str(root / "pretrain_run"),
              "{ckpt_on_base}": str(root / "ckpt_on_base"), "{dangling}": str(root / "dangling"),
              "{edits}": str(root / "edits"), "{plain_prompts}": str(root / "plain_prompts.jsonl"), "{not_utf8}": str(root / "not_utf8.jsonl"),
              "{recipe}": str(root / "recipe.yaml")}
    filled = []
    for arg in argv:
        for mark, path in places.items():
            arg = arg.replace(mark, path)
        filled.append(arg)
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(filled)
            except SystemExit as exit_:  # argparse
                code = exit_.code
    finally:
        os.chdir(cwd)
    return code, err.getvalue() + out.getvalue()


@pytest.mark.parametrize("what, argv, expected", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_bad_input_gets_one_clear_error(places, tmp_path, what, argv, expected):
    before, before_root = _tree(tmp_path), _tree(places)
    code, printed = replay(argv, places, tmp_path)
    assert code == 2, f"{what}: exit {code}\n{printed}"
    assert "Traceback" not in printed, printed
    assert expected in printed, f"{what}: {expected!r} not in\n{printed}"
    assert "error" in printed, printed
    assert _tree(tmp_path) == before and _tree(places) == before_root, f"{what} wrote something"


def test_the_catalogue_is_large_and_every_kind_is_covered():
    assert len(CATALOGUE) >= 60
    assert len({c[0] for c in CATALOGUE}) == len(CATALOGUE)


if __name__ == "__main__":
    import tempfile

    print("| input | `pixelrl` says (exit code 2) |\n|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        _make_places(root)
        work = root / "work"
        work.mkdir()
        for what, argv, _ in CATALOGUE:
            code, printed = replay(argv, root, work)
            message = " ".join(printed.strip().splitlines()[-1:]).replace(str(work), "<tmp>").replace(scratch, "<scratch>")
            message = message.replace("|", "\\|")
            print(f"| {what}: `{' '.join(argv)}` | {message} |")
        sys.stdout.flush()
