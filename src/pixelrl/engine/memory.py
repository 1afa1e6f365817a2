"""Running out of device memory ends with one message naming the phase, the memory asked for and
free (torch's own figures), and the setting to change; never a raw traceback. The run stops
before the step's update, so its checkpoints and metrics rows stay as they were."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from pixelrl.core.errors import PixelRLError
from pixelrl.engine.profiling import PHASE_PREFIX

# what to lower in each phase, in the order worth trying
KNOBS = {
    "sampling": "rollout.micro_batch_size (images per denoiser forward while sampling; the decode runs on "
                "the same micro-batches)",
    "scoring": "actor.ppo_micro_batch_size (samples per no-grad forward), or actor.window_steps_per_forward=1",
    "update": "actor.ppo_micro_batch_size (samples per forward and backward), actor.window_steps_per_forward=1, "
              "or model.gradient_checkpointing=true",
    "encoding": "data.train_batch_size (prompts encoded at once) or model.max_sequence_length",
}


class OutOfMemory(PixelRLError, MemoryError):
    def __init__(self, phase: str, detail: str):
        self.phase = phase
        super().__init__(f"out of device memory while {phase}: {detail} Lower {KNOBS[phase]}, or have the `auto` "
                         "sizes chosen for less memory than the card's (trainer.fit_to_memory_gb); the checkpoints and "
                         "metrics written so far are intact (the run resumes from its latest checkpoint)")


def _torch_figures(err: BaseException) -> str:
    """torch's first sentences: how much it tried to allocate and how much was free."""
    text = " ".join(str(err).split())
    cut = text.find(" Of the allocated memory")
    return (text if cut < 0 else text[:cut]).strip()


@contextmanager
def naming_the_phase(phase: str):
    try:
        with torch.profiler.record_function(PHASE_PREFIX + phase):  # labels the phase in `trainer.profile_step`'s trace
            yield
    except torch.OutOfMemoryError as err:  # torch.cuda.OutOfMemoryError is the same class
        raise OutOfMemory(phase, _torch_figures(err)) from None
