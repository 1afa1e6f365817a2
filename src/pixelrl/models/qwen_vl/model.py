"""The Qwen2-VL adapter: prompts from (image, question) pairs, sampling, and per-token log-probs.

A batch of token sequences is laid out as `[left-padded prompt | right-padded response]`:
every prompt ends at column P, so response token j is at column P + j for every row, and the
logits that predict it are at column P + j - 1. `response_mask` marks the response tokens up to
and including the first end-of-sequence token; prompt and padding are never in it.

Loading goes through the tokenizer and the PIL image processor directly (not AutoProcessor, whose
video half needs torchvision); the image placeholder is expanded to one token per merged patch
exactly as Qwen2VLProcessor does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pixelrl.core.errors import ConfigError
from pixelrl.models.base import load_part, resolve_dtype
from pixelrl.models.kernels import float32_adapters, float32_master_weights, master_weights_autocast
from pixelrl.models.qwen_vl.shared_images import encode_each_image_once
from pixelrl.models.qwen_vl.shared_prompts import PackedBatch, group_by_prompt, pack_by_prompt, prompt_positions


@dataclass
class TokenBatch:
    """Token sequences with their images: what every forward of the policy or critic takes."""

    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R], 0 on padding
    pixel_values: torch.Tensor  # [sum of patches, patch dim]
    image_grid_thw: torch.Tensor  # [B, 3]
    prompt_length: int  # P
    response_mask: torch.Tensor | None = None  # [B, R] float; None for a prompt-only batch
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_length:]

    def select(self, rows: torch.Tensor | list[int]) -> "TokenBatch":
        """The rows `rows` (their images too)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        patches = self.image_grid_thw.prod(-1).tolist()
        chunks = torch.split(self.pixel_values, patches)
        return replace(
            self, input_ids=self.input_ids[rows], attention_mask=self.attention_mask[rows],
            pixel_values=torch.cat([chunks[i] for i in rows.tolist()]), image_grid_thw=self.image_grid_thw[rows],
            response_mask=None if self.response_mask is None else self.response_mask[rows],
            extra={k: v[rows] for k, v in self.extra.items()})


    @staticmethod
    def concat(batches: list["TokenBatch"], pad_id: int) -> "TokenBatch":
        """Sampled batches as one: prompts left-padded and responses right-padded to the longest
        (padding masked out as generation pads), images in row order."""
        prompt = max(b.prompt_length for b in batches)
        response = max(b.input_ids.shape[1] - b.prompt_length for b in batches)

        def pad(tensor: torch.Tensor, value, left: int, right: int) -> torch.Tensor:
            return torch.nn.functional.pad(tensor, (left, right), value=value)

        ids, attention, masks, extra = [], [], [], {k: [] for k in batches[0].extra}
        for b in batches:
            left, right = prompt - b.prompt_length, response - (b.input_ids.shape[1] - b.prompt_length)
            ids.append(pad(b.input_ids, pad_id, left, right))
            attention.append(pad(b.attention_mask, 0, left, right))
            masks.append(pad(b.response_mask, 0.0, 0, right))
            for k, v in b.extra.items():
                extra[k].append(pad(v, 0.0, 0, right))
        return TokenBatch(torch.cat(ids), torch.cat(attention), torch.cat([b.pixel_values for b in batches]),
                          torch.cat([b.image_grid_thw for b in batches]), prompt, torch.cat(masks),
                          {k: torch.cat(v) for k, v in extra.items()})


def response_mask_from(responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 for every response token up to and including the first EOS, 0 after it (generation pads
    finished rows); a row without EOS (cut by max_new_tokens) is all ones."""
    is_eos = responses == eos_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    return (~after_eos).float()


class QwenVLModel:
    """A Qwen2-VL policy (and optionally its frozen reference) loaded from a local folder."""

    def __init__(self, path: str | Path, *, dtype: str = "float32", device: str | torch.device = "cpu",
                 min_pixels: int = 0, max_pixels: int = 0):
        from transformers import AutoModelForImageTextToText, AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.path = Path(path)
        for name in ("config.json", "preprocessor_config.json"):
            if not (self.path / name).is_file():
                raise ConfigError("model.path", str(path), f"no {name} there: point model.path at a Qwen2-VL "
                                  "folder (config.json, *.safetensors, tokenizer files, preprocessor_config.json)")
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype)
        self.tokenizer = load_part(self.path, "tokenizer", lambda: AutoTokenizer.from_pretrained(
            self.path, padding_side="left"))
        bounds = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v}
        self.image_processor = load_part(self.path, "image processor", lambda: Qwen2VLImageProcessorPil.from_pretrained(
            self.path, **bounds))
        size = self.image_processor.size
        if size["shortest_edge"] > size["longest_edge"]:
            raise ConfigError("vlm.min_pixels" if min_pixels else "vlm.max_pixels", min_pixels or max_pixels,
                              f"the image bounds are min {size['shortest_edge']} > max {size['longest_edge']} pixels "
                              f"(the folder's preprocessor_config.json sets the other): set both vlm.min_pixels and "
                              "vlm.max_pixels")
        self.model = load_part(self.path, "model weights", lambda: AutoModelForImageTextToText.from_pretrained(
            self.path, dtype=self.dtype, use_safetensors=True)).to(self.device)
        self.model.eval()
        encode_each_image_once(self.model)  # the n responses to a question share its image
        cfg = self.model.config
        self.image_token = self.tokenizer.convert_ids_to_tokens(cfg.image_token_id)
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        # Vision placeholders are never sampled: one in a response would ask the model for image
        # features that do not exist. Sampling and scoring both give them probability 0.
        self.suppressed_ids = sorted({i for i in (cfg.image_token_id, getattr(cfg, "video_token_id", None),
                                                  getattr(cfg, "vision_start_token_id", None),
                                                  getattr(cfg, "vision_end_token_id", None)) if i is not None})
        # FSDP2: every rank must run the same forwards, so generation goes on until all are done
        self.synced_generation = False
        # full fine-tuning in a low-precision dtype: float32 weights, forwards under autocast
        self.float32_master_weights = False

    def keep_float32_master_weights(self) -> None:
        """For full fine-tuning: the policy trains float32 weights under autocast to `dtype`, as
        verl's FSDP mixed precision keeps float32 master weights (`float32_master_weights`)."""
        self.float32_master_weights = float32_master_weights(self.model, self.dtype)

    def compute_precision(self):
        """The context every forward of the policy (or its frozen reference) runs in."""
        return master_weights_autocast(self.device, self.dtype, self.float32_master_weights)

    # --- inputs --------------------------------------------------------------------------
    def prompt_text(self, question: str, pictures: int = 1) -> str:
        messages = [{"role": "user", "content": [*[{"type": "image"}] * pictures, {"type": "text", "text": question}]}]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def prompts(self, images: list, questions: list[str]) -> TokenBatch:
        """Left-padded prompts for (image, question) pairs; an item's image is a uint8 [H, W, 3]
        array, or a tuple of them for a question about several pictures (an edit judge's source
        and result), shown in that order."""
        from PIL import Image

        items = [tuple(im) if isinstance(im, (tuple, list)) else (im,) for im in images]
        flat = [Image.fromarray(np.asarray(im)) for item in items for im in item]
        vision = self.image_processor(flat, return_tensors="pt")
        merge = self.image_processor.merge_size ** 2
        counts = iter([int(grid.prod()) // merge for grid in vision["image_grid_thw"]])  # in the pictures' order
        texts = []
        for question, item in zip(questions, items):
            # each picture's placeholder becomes as many image tokens as its grid has merged patches
            parts = self.prompt_text(question, len(item)).split(self.image_token)
            if len(parts) != len(item) + 1:
                raise ValueError(f"a question holds the image token {self.image_token!r} itself: {question[:80]!r}")
            texts.append(parts[0] + "".join(self.image_token * next(counts) + part for part in parts[1:]))
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return TokenBatch(enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device),
                          vision["pixel_values"].to(self.device, self.dtype), vision["image_grid_thw"].to(self.device),
                          prompt_length=enc["input_ids"].shape[1])

    def with_responses(self, prompts: TokenBatch, responses: list[str]) -> TokenBatch:
        """Prompts followed by the given response texts (each ended by EOS), right-padded."""
        ids = [self.tokenizer(r, add_special_tokens=False)["input_ids"] + [self.eos_id] for r in responses]
        width = max(len(x) for x in ids)
        resp = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(ids), width)
        for i, x in enumerate(ids):
            resp[i, :len(x)] = torch.tensor(x)
            mask[i, :len(x)] = 1.0
        return replace(prompts, input_ids=torch.cat([prompts.input_ids, resp.to(self.device)], 1),
                       attention_mask=torch.cat([prompts.attention_mask, mask.long().to(self.device)], 1),
                       response_mask=mask.to(self.device))

    def decode(self, batch: TokenBatch) -> list[str]:
        out = []
        for row, mask in zip(batch.responses, batch.response_mask):
            ids = [t for t, m in zip(row.tolist(), mask.tolist()) if m > 0 and t != self.eos_id]
            out.append(self.tokenizer.decode(ids, skip_special_tokens=True).strip())
        return out

    def model_inputs(self, batch: TokenBatch) -> dict:
        """The keyword arguments of a Qwen2-VL forward for `batch`. `mm_token_type_ids` (1 on image
        tokens) is what the model needs to give image tokens their 2-D rotary positions."""
        image_tokens = batch.input_ids == self.model.config.image_token_id
        image_tokens[:, batch.prompt_length:] = False  # images live in the prompt only
        return dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    pixel_values=batch.pixel_values, image_grid_thw=batch.image_grid_thw,
                    mm_token_type_ids=image_tokens.long())

    def _suppress(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[..., self.suppressed_ids] = float("-inf")
        return logits

    # --- sampling ------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: TokenBatch, *, seed: int, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 8, module: nn.Module | None = None) -> TokenBatch:
        """Sample one response per prompt row (repeat rows for n samples), stopping at EOS.

        Returns the full sequences with `response_mask`, `extra["rollout_logp"]`: the log-prob
        of each sampled token under the sampling distribution (temperature applied, before top-p),
        and `extra["rollout_entropy"]`: that distribution's entropy, as `token_logprobs` gives them.

        The loop is pixelrl's own rather than transformers' `generate`, so that the rows sharing a
        prompt share its prefill, and so that a checkpoint's generation_config.json (Qwen2-VL ships
        top_k 1, temperature 0.01) cannot change the distribution the log-probs describe."""
        module = module or self.model
        B = len(prompts)
        # the prompt is computed once for the rows that share it (the n samples of a question),
        # and its key/value cache copied to each of them
        unique_rows, group_of_row, _ = group_by_prompt(prompts)
        group = torch.tensor(group_of_row, device=self.device)
        unique = prompts.select(unique_rows)
        _, next_position = prompt_positions(unique, self.model.model.get_rope_index, self.model.config.image_token_id)
        next_position = next_position[group]
        with torch.random.fork_rng(devices=[]), self.compute_precision():
            torch.manual_seed(seed)
            out = module(**self.model_inputs(unique), use_cache=True)
            cache = out.past_key_values
            cache.batch_select_indices(group)
            logits = out.logits[:, -1].float()[group]
            attention = prompts.attention_mask
            finished = torch.zeros(B, dtype=torch.bool, device=self.device)
            tokens, step_logits = [], []
            for t in range(max_new_tokens):
                step_logits.append(logits)
                token = self._sample(logits, temperature, top_p).masked_fill(finished, self.pad_id)
                tokens.append(token)
                finished |= token == self.eos_id
                if t == max_new_tokens - 1 or not self._any_running(finished):
                    break
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
                out = module(input_ids=token.unsqueeze(1), attention_mask=attention, past_key_values=cache,
                             position_ids=(next_position + t).view(1, B, 1).expand(3, B, 1), use_cache=True)
                logits = out.logits[:, -1].float()
        responses = torch.stack(tokens, 1)
        mask = response_mask_from(responses, self.eos_id)
        logp, entropy = self._logp_and_entropy(torch.stack(step_logits, 1), responses, mask, temperature)
        return replace(prompts, input_ids=torch.cat([prompts.input_ids, responses], 1),
                       attention_mask=torch.cat([prompts.attention_mask, mask.long()], 1),
                       response_mask=mask, extra={"rollout_logp": logp, "rollout_entropy": entropy})

    def _sample(self, logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
        """One token per row: greedy at temperature 0, else from softmax(logits / temperature)
        cut to its top-p nucleus (the smallest set of most likely tokens holding top_p of the
        mass); vision placeholders never."""
        logits = self._suppress(logits)
        if temperature <= 0:
            return logits.argmax(-1)
        logits = logits / temperature
        if top_p < 1.0:
            ordered, order = torch.sort(logits, descending=True)
            probs = ordered.softmax(-1)
            outside = (probs.cumsum(-1) - probs) >= top_p  # the mass before it already reaches top_p
            cut = torch.zeros_like(outside).scatter(-1, order, outside)
            logits = logits.masked_fill(cut, float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1).squeeze(1)

    def _any_running(self, finished: torch.Tensor) -> bool:
        """Whether any row still samples; under FSDP2 on any rank, since every rank must run the
        same forwards (their parameters are gathered collectively)."""
        running = torch.tensor([float(not bool(finished.all()))], device=finished.device)  # NCCL reduces device tensors
        if self.synced_generation:
            import torch.distributed as dist

            dist.all_reduce(running, op=dist.ReduceOp.MAX)
        return bool(running.item() > 0)

    def _logp_and_entropy(self, logits: torch.Tensor, responses: torch.Tensor, mask: torch.Tensor,
                          temperature: float, with_entropy: bool = True):
        logits = self._suppress(logits.float()) / (temperature if temperature > 0 else 1.0)
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1) * mask
        if not with_entropy:  # a real vocabulary makes the [B, R, V] entropy costly: only on request
            return logp, None
        # -sum p log p with 0 log 0 = 0 written so that its gradient is finite: the suppressed
        # tokens' -inf log-probs would make entr's (and p * log p's) backward NaN
        probs = logp_all.exp()
        entropy = -(probs * logp_all.masked_fill(probs == 0, 0.0)).sum(-1) * mask
        return logp, entropy

    # --- scoring -------------------------------------------------------------------------
    def packed_inputs(self, batch: TokenBatch) -> PackedBatch | None:
        """`batch` with the responses to each distinct prompt packed behind one copy of it
        (models/qwen_vl/shared_prompts.py), or None when no two rows share a prompt or the
        attention kernel takes no 4-D mask (flash attention)."""
        if self.model.model.language_model.config._attn_implementation not in ("sdpa", "eager"):
            return None
        return pack_by_prompt(batch, self.model.model.get_rope_index, image_token_id=self.model.config.image_token_id,
                              pad_id=self.pad_id, dtype=self.dtype)

    def response_logits(self, module: nn.Module, batch: TokenBatch) -> torch.Tensor:
        """Logits at the columns that predict each response token: [B, R, V]."""
        packed = self.packed_inputs(batch)
        with self.compute_precision():
            if packed is not None:
                return packed.gather(module(**packed.inputs, use_cache=False).logits)
            out = module(**self.model_inputs(batch), use_cache=False)
        P, R = batch.prompt_length, batch.input_ids.shape[1] - batch.prompt_length
        return out.logits[:, P - 1:P - 1 + R]

    def next_token_logprobs(self, prompts: TokenBatch, module: nn.Module | None = None) -> torch.Tensor:
        """Log-probs [B, V] of the first response token after left-padded `prompts` (the last
        column predicts it), vision placeholders excluded as in sampling."""
        with self.compute_precision():
            logits = (module or self.model)(**self.model_inputs(prompts), use_cache=False).logits[:, -1].float()
        return torch.log_softmax(self._suppress(logits), -1)

    def token_logprobs(self, batch: TokenBatch, *, temperature: float = 1.0, module: nn.Module | None = None,
                       with_entropy: bool = False):
        """Per-token log-probs [B, R] of the batch's responses (zero outside `response_mask`), and
        with `with_entropy` the token entropies of the same distributions."""
        logp, entropy = self._logp_and_entropy(self.response_logits(module or self.model, batch),
                                               batch.responses, batch.response_mask, temperature, with_entropy)
        return (logp, entropy) if with_entropy else logp

    def text_logprobs(self, texts: list[str], module: nn.Module | None = None):
        """Log-probs [B, L - 1] of every token of each plain text (ended by EOS) after the first,
        given the ones before it, no image and no chat template, and their mask (0 on padding):
        a language-model loss over all of a pretraining text, as LightRFT's pretrain mode."""
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] + [self.eos_id] for t in texts]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros(len(ids), width, dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, :len(x)], attention[i, :len(x)] = torch.tensor(x), 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        with self.compute_precision():
            logits = (module or self.model)(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
        mask = attention[:, 1:].float()
        logp, _ = self._logp_and_entropy(logits[:, :-1], input_ids[:, 1:], mask, 1.0, with_entropy=False)
        return logp, mask

    # --- LoRA ----------------------------------------------------------------------------
    def vision_tower(self) -> nn.Module:
        return self.model.model.visual

    def add_lora(self, *, rank: int, alpha: float, targets=None) -> None:
        """Freeze the base weights and attach a trainable LoRA adapter to the language model:
        on the linear layers named `targets` (q_proj, ...), or on every one of them (None, as
        LightRFT's target_modules all-linear). The vision tower keeps its weights."""
        from peft import LoraConfig

        self.model.requires_grad_(False)
        if targets is None:
            targets = sorted({name.rsplit(".", 1)[-1] for name, module in self.model.model.language_model.named_modules()
                              if isinstance(module, nn.Linear)})
        pattern = r".*language_model.*\.(" + "|".join(targets) + r")$"
        self.model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=pattern), adapter_name="default")
        self.model.set_adapter("default")
        for name, param in self.model.named_parameters():
            param.requires_grad_("lora_" in name)
        float32_adapters(self.model)  # transformers creates them in the base dtype

    @contextlib.contextmanager
    def reference(self):
        """The LoRA policy's reference: the same module with its adapter switched off."""
        self.model.disable_adapters()
        try:
            yield self.model
        finally:
            self.model.enable_adapters()


class ValueModel(nn.Module):
    """The critic: a Qwen2-VL backbone (a copy of the policy's at start) with a scalar head on the
    hidden state that precedes each response token, so V_t is the value before emitting token t."""

    def __init__(self, policy: QwenVLModel):
        super().__init__()
        from transformers import AutoModelForImageTextToText

        # the policy's backbone without its language-model head (which is tied to the embeddings)
        self.backbone = AutoModelForImageTextToText.from_pretrained(policy.path, dtype=policy.dtype, use_safetensors=True).model
        self.backbone.to(policy.device)
        encode_each_image_once(self.backbone)
        hidden = self.backbone.config.text_config.hidden_size
        self.head = nn.Linear(hidden, 1).to(policy.device, policy.dtype)
        nn.init.normal_(self.head.weight, std=1.0 / (hidden + 1))
        nn.init.zeros_(self.head.bias)
        self._policy = [policy]  # a list: not a submodule (its weights are not the critic's)
        # the critic is always fully trained: float32 master weights under a low-precision dtype
        self._compute = (policy.device, policy.dtype)
        self.float32_master_weights = float32_master_weights(self, policy.dtype)

    def forward(self, batch: TokenBatch) -> torch.Tensor:
        packed = self._policy[0].packed_inputs(batch)
        with master_weights_autocast(*self._compute, self.float32_master_weights):
            if packed is not None:
                hidden = packed.gather(self.backbone(**packed.inputs, use_cache=False).last_hidden_state)
            else:
                out = self.backbone(**self._policy[0].model_inputs(batch), use_cache=False)
                P, R = batch.prompt_length, batch.input_ids.shape[1] - batch.prompt_length
                hidden = out.last_hidden_state[:, P - 1:P - 1 + R]
            values = self.head(hidden).squeeze(-1)
        return values.float() * batch.response_mask
