"""Wan 2.2 A14B's two experts as one denoiser module, so every caller of `model.transformer`
(LoRA, FSDP units, checkpoints, the reference copy, the FLOP meter) sees one network.

WanPipeline picks the expert per step: `transformer` (high noise) while the scheduler timestep is
at or above `boundary_ratio x num_train_timesteps`, `transformer_2` (low noise) below. An RL
batch may hold rows at several timesteps (per-row sampled timesteps, shuffled transitions), so
the test is made per row and each expert runs on its own rows; a window that straddles the
boundary sends gradients to both experts.

Parameter names carry the pipeline's component names (`transformer.blocks.0...`,
`transformer_2.blocks.0...`), so a checkpoint says which expert each tensor belongs to.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

EXPERTS = ("transformer", "transformer_2")  # high noise, low noise: the pipeline's component names


class TimestepExperts(nn.Module):
    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary_timestep: float,
                 trained: tuple[str, ...] = EXPERTS):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_timestep = float(boundary_timestep)
        self.trained = tuple(trained)
        # what callers read off a diffusers transformer: both experts share the layout
        self.config = transformer.config
        self._no_split_modules = transformer._no_split_modules
        # Under FSDP2 every rank must run an expert's forward and backward together (its blocks
        # all-gather and reduce-scatter across ranks): set by the sharding, each forward then
        # agrees with the other ranks on which experts run, one running on a borrowed row where
        # this rank has none of its rows.
        self.routes_in_lockstep = False

    def experts(self) -> list[nn.Module]:
        return [self.transformer, self.transformer_2]

    def trained_experts(self) -> list[nn.Module]:
        return [getattr(self, name) for name in self.trained]

    def high_noise(self, timestep: torch.Tensor) -> torch.Tensor:
        """Per row: whether the high-noise expert computes it (the pipeline's `t >= boundary`)."""
        return timestep >= self.boundary_timestep

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict: bool = False, **kwargs):
        if return_dict:
            raise ValueError("TimestepExperts returns a tuple (call it with return_dict=False)")
        high = self.high_noise(timestep)
        rows = (high, ~high)
        runs = torch.stack([rows[0].any(), rows[1].any()])
        if self.routes_in_lockstep:
            import torch.distributed as dist

            runs = runs.to(torch.int32)
            dist.all_reduce(runs, op=dist.ReduceOp.MAX)
            runs = runs.bool()
        batch = hidden_states.shape[0]

        def run(expert, index):
            def take(value):
                return value[index] if torch.is_tensor(value) and value.shape[:1] == (batch,) else value

            return expert(hidden_states=hidden_states[index], timestep=timestep[index],
                          encoder_hidden_states=encoder_hidden_states[index], return_dict=False,
                          **{k: take(v) for k, v in kwargs.items()})[0]

        out, borrowed = None, []
        for expert, mine, runs_somewhere in zip(self.experts(), rows, runs.tolist()):
            if not runs_somewhere:
                continue
            if bool(mine.all()):  # the common case: the whole batch at one expert, no gather
                out = expert(hidden_states=hidden_states, timestep=timestep,
                             encoder_hidden_states=encoder_hidden_states, return_dict=False, **kwargs)[0]
            elif bool(mine.any()):
                index = mine.nonzero().squeeze(1)
                part = run(expert, index)
                out = (part.new_zeros((batch, *part.shape[1:])) if out is None else out).index_copy(0, index, part)
            else:  # another rank needs this expert: run it on one row, keep its graph, use nothing
                borrowed.append(run(expert, torch.zeros(1, dtype=torch.long, device=hidden_states.device)))
        for part in borrowed:  # zero times the borrowed output: its backward runs, contributing zeros
            out = out + 0.0 * part.sum()
        return (out,)

    # --- the diffusers model API the house calls, over the experts ----------------------------
    def requires_grad_(self, requires_grad: bool = True):
        """Freezing freezes both experts; unfreezing (full fine-tuning) only the trained ones."""
        for name, expert in zip(EXPERTS, self.experts()):
            expert.requires_grad_(requires_grad and name in self.trained)
        return self

    def add_adapter(self, config, adapter_name: str = "default") -> None:
        for expert in self.trained_experts():
            expert.add_adapter(copy.deepcopy(config), adapter_name=adapter_name)

    def _adapted(self) -> list[nn.Module]:
        return [e for e in self.experts() if getattr(e, "peft_config", None)]

    @property
    def peft_config(self) -> dict:
        adapted = self._adapted()
        return adapted[0].peft_config if adapted else {}

    def set_adapter(self, adapter_name: str) -> None:
        for expert in self._adapted():
            expert.set_adapter(adapter_name)

    def disable_adapters(self) -> None:
        for expert in self._adapted():
            expert.disable_adapters()

    def enable_adapters(self) -> None:
        for expert in self._adapted():
            expert.enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts():
            expert.enable_gradient_checkpointing()


def expert_state(state: dict[str, torch.Tensor], expert: str) -> dict[str, torch.Tensor]:
    """The tensors of one expert, named as in that expert alone (`transformer_2.blocks.0.x` ->
    `blocks.0.x` for `transformer_2`)."""
    prefix = expert + "."
    return {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}
