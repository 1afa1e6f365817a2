"""Each distinct image of a Qwen2-VL or Qwen2.5-VL batch is encoded once, each distinct prompt
prefilled once (models/qwen_vl/shared_images.py, shared_prompts.py)."""

import copy

import numpy as np
import torch

from pixelrl.shapes import qa as shapes_qa
from pixelrl.models.qwen_vl import QwenVLModel


def _group_batch(model: QwenVLModel, n: int = 4):
    """Three questions x n identical rows, shuffled as a mini-batch is, with answers."""
    items = shapes_qa.items("train", 0, 3)
    prompts = model.prompts([it["image"] for it in items for _ in range(n)],
                            [it["question"] for it in items for _ in range(n)])
    batch = model.with_responses(prompts, [it["answer"] for it in items for _ in range(n)])
    return batch.select(torch.randperm(len(batch), generator=torch.Generator().manual_seed(0)))


def _patches_encoded(model: QwenVLModel, batch) -> int:
    seen = []
    handle = model.model.model.visual.patch_embed.register_forward_hook(lambda m, a, out: seen.append(len(out)))
    try:
        model.token_logprobs(batch)
    finally:
        handle.remove()
    return sum(seen)


def test_the_vision_tower_encodes_each_distinct_image_once(any_tiny_vlm_path):
    model = QwenVLModel(any_tiny_vlm_path)
    batch = _group_batch(model)
    per_image = int(batch.image_grid_thw[0].prod())
    assert _patches_encoded(model, batch) == 3 * per_image  # 12 rows, 3 distinct images
    # one pixel changed by one grey level makes a distinct image, encoded on its own
    items = shapes_qa.items("train", 0, 1)
    changed = items[0]["image"].copy()
    changed[0, 0, 0] = np.uint8((int(changed[0, 0, 0]) + 1) % 256)
    prompts = model.prompts([items[0]["image"], changed, items[0]["image"]], [items[0]["question"]] * 3)
    assert _patches_encoded(model, model.with_responses(prompts, ["red"] * 3)) == 2 * per_image


def test_shared_encodings_give_the_log_probs_and_gradients_of_separate_ones(any_tiny_vlm_path):
    model = QwenVLModel(any_tiny_vlm_path)
    plain = copy.deepcopy(model.model)
    plain.model.visual._forward_pre_hooks.clear()
    plain.model.visual._forward_hooks.clear()
    batch = _group_batch(model)
    grads = []
    for module in (model.model, plain):
        module.zero_grad()
        logp = model.token_logprobs(batch, module=module)
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        grads.append({name: p.grad.clone() for name, p in module.named_parameters()})
        grads.append(logp.detach())
    torch.testing.assert_close(grads[1], grads[3], rtol=0, atol=0)  # the forward is the same computation
    vision = [name for name in grads[0] if ".visual." in name]
    assert vision and all(grads[0][name].abs().sum() > 0 for name in vision)
    for name in grads[0]:  # the backward sums the rows' gradients in another order
        torch.testing.assert_close(grads[0][name], grads[2][name], rtol=1e-4, atol=1e-6)


def _sampled_groups(model: QwenVLModel):
    """Four prompts x 3 sampled responses of varied length, shuffled; two of the prompts share an
    image (different questions) and two a question (different images)."""
    items = shapes_qa.items("train", 0, 3) + shapes_qa.items("train", 3, 1)
    images = [items[0]["image"], items[0]["image"], items[2]["image"], items[3]["image"]]
    questions = [items[0]["question"], items[1]["question"], items[2]["question"], items[2]["question"]]
    prompts = model.prompts([im for im in images for _ in range(3)], [q for q in questions for _ in range(3)])
    out = model.generate(prompts, seed=5, temperature=1.0, max_new_tokens=5)
    assert len(set(out.response_mask.sum(1).tolist())) > 1, "the responses should differ in length"
    return out.select(torch.randperm(len(out), generator=torch.Generator().manual_seed(1)))


def test_responses_packed_behind_their_prompt_score_as_separate_rows(any_tiny_vlm_path):
    model = QwenVLModel(any_tiny_vlm_path)
    batch = _sampled_groups(model)
    packed = model.packed_inputs(batch)
    assert packed.inputs["input_ids"].shape[0] == 4  # one packed sequence per distinct prompt
    results = []
    for pack in (True, False):
        model.model.zero_grad()
        if not pack:
            model.packed_inputs = lambda b: None
        logp = model.token_logprobs(batch)
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in model.model.named_parameters()}))
    (packed_logp, packed_grads), (plain_logp, plain_grads) = results
    assert (packed_logp[batch.response_mask == 0] == 0).all()
    torch.testing.assert_close(packed_logp, plain_logp, rtol=0, atol=2e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-5)


def test_critic_values_are_the_same_packed(any_tiny_vlm_path):
    from pixelrl.models.qwen_vl.model import ValueModel

    model = QwenVLModel(any_tiny_vlm_path)
    critic = ValueModel(model)
    batch = _sampled_groups(model)
    packed = critic(batch)
    model.packed_inputs = lambda b: None
    torch.testing.assert_close(packed, critic(batch), rtol=0, atol=2e-5)


def test_sampling_shares_the_prefill_of_a_prompt_and_samples_the_same(any_tiny_vlm_path, monkeypatch):
    from pixelrl.models.qwen_vl import model as adapter

    model = QwenVLModel(any_tiny_vlm_path)
    items = shapes_qa.items("train", 0, 3)
    prompts = model.prompts([it["image"] for it in items for _ in range(4)],
                            [it["question"] for it in items for _ in range(4)])
    prefills = []
    handle = model.model.model.language_model.register_forward_hook(
        lambda m, a, out: prefills.append(out.last_hidden_state.shape[:2]))
    shared = model.generate(prompts, seed=2, temperature=1.0, max_new_tokens=4)
    assert prefills[0] == (3, prompts.prompt_length)  # one prefill row per distinct prompt
    monkeypatch.setattr(adapter, "group_by_prompt", lambda b: (list(range(len(b))), list(range(len(b))), [0] * len(b)))
    prefills.clear()
    separate = model.generate(prompts, seed=2, temperature=1.0, max_new_tokens=4)
    handle.remove()
    assert prefills[0] == (12, prompts.prompt_length)
    assert torch.equal(shared.input_ids, separate.input_ids)
    torch.testing.assert_close(shared.extra["rollout_logp"], separate.extra["rollout_logp"], rtol=0, atol=2e-5)


def test_top_p_samples_from_the_nucleus_only(tiny_vlm_path):
    model = QwenVLModel(tiny_vlm_path)
    probs = torch.zeros(model.model.config.text_config.vocab_size)
    probs[[7, 8, 9, 10]] = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, -1)
    torch.manual_seed(0)
    # the mass before token 9 (0.8) reaches 0.7: tokens 7 and 8 stay, renormalised to 5 : 3
    counts = torch.bincount(model._sample(logits, 1.0, 0.7), minlength=11)
    assert counts[9:].sum() == 0 and abs(counts[7] / 4000 - 0.625) < 0.03
    # the mass before token 8 is 0.5: at top_p 0.5 only token 7 stays
    assert (model._sample(logits, 1.0, 0.5) == 7).all()
    assert set(model._sample(logits, 1.0, 1.0).tolist()) == {7, 8, 9, 10}
