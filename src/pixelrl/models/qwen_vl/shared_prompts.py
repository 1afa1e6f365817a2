"""Score the responses to one prompt in one packed sequence.

GRPO and PPO score n responses per prompt, and a prompt (image tokens, question, chat markup) is
most of every row: on shapes-QA about 34 of 36 tokens. `pack_by_prompt` lays each distinct prompt
out once, followed by the responses that share it, each in its own block:

    [prompt | response 1 | response 2 | ... | response k]

A 4-D attention mask lets every block see the prompt and its own earlier tokens only, and every
response token gets the multimodal rotary position it has after its prompt in an unpacked row, so
the logits are those of the unpacked forward (to float rounding). The prompt is encoded once, and
its gradient is the sum of the responses' gradients through it, as in separate rows.

Rows are grouped by content (prompt tokens, attention mask and image pixels), because training
shuffles them into mini-batches. Sampling uses the same grouping and positions to run one prefill
per distinct prompt (`QwenVLModel.generate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pixelrl.models.qwen_vl.shared_images import group_equal


@dataclass
class PackedBatch:
    """A packed forward's inputs and where each original row's response logits come from."""

    inputs: dict  # keyword arguments of the Qwen2-VL forward
    group_of_row: torch.Tensor  # [B] packed sequence of each row
    columns: torch.Tensor  # [B, R] packed column whose output predicts response token t of the row

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        """[B, R, ...] from a packed forward's per-column output [G, L, ...]."""
        return out[self.group_of_row.unsqueeze(1), self.columns]


def prompt_positions(prompts, rope_index, image_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The multimodal rotary positions [3, B, P] of left-padded prompts, and [B] the position of
    the first response token (one past the prompt's last, the same on every axis: it is text)."""
    P = prompts.prompt_length
    ids, mask = prompts.input_ids[:, :P], prompts.attention_mask[:, :P]
    positions, _ = rope_index(ids, mm_token_type_ids=(ids == image_token_id).long(),
                              image_grid_thw=prompts.image_grid_thw, attention_mask=mask)
    return positions, positions[:, :, P - 1].amax(0) + 1


def group_by_prompt(batch) -> tuple[list[int], list[int], list[int]]:
    """Rows grouped by prompt (tokens, padding and image pixels): (the first row of each distinct
    prompt, each row's group, each row's place within its group)."""
    P = batch.prompt_length
    _, image_of_row = group_equal(batch.pixel_values, batch.image_grid_thw)
    keys = [(tuple(ids), tuple(mask), int(image)) for ids, mask, image in
            zip(batch.input_ids[:, :P].tolist(), batch.attention_mask[:, :P].tolist(), image_of_row.tolist())]
    first: dict[tuple, int] = {}
    unique_rows, group_of_row, slot_of_row, sizes = [], [], [], []
    for row, key in enumerate(keys):
        if key not in first:
            first[key] = len(unique_rows)
            unique_rows.append(row)
            sizes.append(0)
        g = first[key]
        group_of_row.append(g)
        slot_of_row.append(sizes[g])
        sizes[g] += 1
    return unique_rows, group_of_row, slot_of_row


def pack_by_prompt(batch, rope_index, *, image_token_id: int, pad_id: int, dtype: torch.dtype) -> PackedBatch | None:
    """The packed inputs of a `TokenBatch` with responses, or None when no two rows share a
    prompt. `rope_index(input_ids, mm_token_type_ids=, image_grid_thw=, attention_mask=)` is the
    model's multimodal position function (Qwen2VLModel.get_rope_index); `dtype` the model's, for
    the additive attention mask."""
    P = batch.prompt_length
    R = batch.input_ids.shape[1] - P
    rows = len(batch)
    unique_rows, group_of_row, slot_of_row = group_by_prompt(batch)
    if len(unique_rows) == rows:
        return None
    device = batch.input_ids.device
    G, K = len(unique_rows), max(slot_of_row) + 1
    L = P + K * R
    group = torch.tensor(group_of_row, device=device)
    slot = torch.tensor(slot_of_row, device=device)
    prompts = batch.select(unique_rows)

    # tokens: the prompt, then each row's response in its group's slot
    input_ids = torch.full((G, L), pad_id, dtype=batch.input_ids.dtype, device=device)
    input_ids[:, :P] = prompts.input_ids[:, :P]
    block = P + slot.unsqueeze(1) * R + torch.arange(R, device=device)  # [B, R] packed columns of a response
    input_ids[group.unsqueeze(1), block] = batch.input_ids[:, P:]
    live = torch.zeros(G, L, dtype=torch.bool, device=device)
    live[:, :P] = prompts.attention_mask[:, :P].bool()
    live[group.unsqueeze(1), block] = batch.attention_mask[:, P:].bool()

    # attention: a prompt token sees the live prompt before it; a response token sees the live
    # prompt and the live tokens of its own block up to itself
    col = torch.arange(L, device=device)
    block_id = torch.where(col < P, -1, (col - P) // R)  # -1 = the prompt
    causal = col.unsqueeze(1) >= col.unsqueeze(0)
    same_or_prompt = (block_id.unsqueeze(0) == -1) | (block_id.unsqueeze(1) == block_id.unsqueeze(0))
    allowed = (causal & same_or_prompt).unsqueeze(0) & live.unsqueeze(1)  # [G, L(query), L(key)]
    allowed |= torch.eye(L, dtype=torch.bool, device=device).unsqueeze(0)  # dead rows: no all-masked softmax
    mask = torch.zeros(G, 1, L, L, dtype=dtype, device=device)
    mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)

    # positions: the prompt's own; response token t at (last prompt position + 1 + t) on every axis
    prompt_pos, after = prompt_positions(prompts, rope_index, image_token_id)
    position_ids = torch.zeros(3, G, L, dtype=prompt_pos.dtype, device=device)
    position_ids[:, :, :P] = prompt_pos
    position_ids[:, :, P:] = after.view(1, G, 1) + ((col[P:] - P) % R)

    # response token 0 is predicted by the prompt's last column, token t > 0 by its block's t - 1
    columns = torch.cat([torch.full((rows, 1), P - 1, device=device), block[:, :-1]], 1)
    inputs = dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                  pixel_values=prompts.pixel_values, image_grid_thw=prompts.image_grid_thw)
    return PackedBatch(inputs, group, columns)
