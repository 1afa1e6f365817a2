"""The vision-language trainer (`algorithm.trainer_type: vlm_ppo`): PPO / GRPO on token sequences
for a Qwen-VL policy. Its config checks (`config`), token losses and advantages (`token_losses`),
engine, Ray worker, trainer loop, answer rewards, question files and supervised fine-tuning live
here; the Qwen-VL adapter is a model family (`pixelrl.models.qwen_vl`).

Nothing below this folder imports it: importing the package registers the trainer type, the
answer rewards and the `files` question task in the lower registries, as a user's plugin would
(declared in `pixelrl/__init__.py`)."""

from pixelrl.config.sections import SEPARATE_TRAINERS, SeparateTrainer
from pixelrl.vlm import answers, qa_tasks, reward_model  # noqa: F401  (register the rewards and the task)
from pixelrl.vlm.config import DIFFUSION_FIELD_HINTS, VLMRunConfig, upgrade_saved_config, validate_vlm


def _trainer_class():
    from pixelrl.vlm.trainer import VLMPPOTrainer

    return VLMPPOTrainer


SEPARATE_TRAINERS.register("vlm_ppo")(
    SeparateTrainer(schema=VLMRunConfig, check=validate_vlm, trainer_class=_trainer_class,
                    upgrade_saved=upgrade_saved_config, diffusion_field_hints=DIFFUSION_FIELD_HINTS))
