"""What pretraining the shapes editing model (`builtin:shapes_edit`) adds to `pretrain.py`'s loop.

The model is FLUX.1 Kontext's layout (`models/flux_kontext`), small: the source image's clean
latents are appended to the noisy target's tokens as a second frame, the instruction enters
through FLUX's CLIP (pooled) and T5 (tokens) encoders with word-level tokenizers over the edit
vocabulary. Unlike the pixel-space text-to-image shapes model it has a VAE, as the family does:
a small AutoencoderKL (2x down, 4 latent channels) trained first, by reconstruction on rendered
scenes, and frozen; its scaling and shift factors are set from its latents' statistics so the
flow sees unit-variance latents. Then the denoiser and both text encoders learn rectified flow on
(source, instruction, target) triples of the train instructions (`edit_world`). No caption
dropout: the model samples without classifier-free guidance (no guidance embedding, like
FLUX.1-schnell), as the demo's RL does.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from pixelrl.core.errors import ConfigError
from pixelrl.shapes import edit_world
from pixelrl.shapes.world import all_prompts, render

# The shipped architecture (see the model card): 32 x 32 RGB through a 2x VAE (16 x 16 x 4
# latents, 8 x 8 tokens per image after FLUX's 2 x 2 packing), 2 double- and 4 single-stream blocks
# of width 128.
EDIT_ARCH = dict(resolution=32, text_hidden=64, text_max_length=16, num_layers=2, num_single_layers=4, heads=4,
                 head_dim=32, guidance_embeds=False)
VAE_ARCH = dict(block_out_channels=(16, 32), latent_channels=4, norm_num_groups=8)
VAE_STEPS, VAE_BATCH, VAE_LR, VAE_KL_WEIGHT = 1500, 32, 3e-3, 1e-4


def _scene_images(rng: random.Random, count: int) -> torch.Tensor:
    """`count` renders of the text-to-image world's scenes (every category), float [-1, 1] NCHW."""
    items = [item for items in all_prompts().values() for item in items]
    images = np.stack([render(rng.choice(items)["metadata"], rng.randrange(1 << 30)) for _ in range(count)])
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def train_vae(seed: int, log=print):
    """A small AutoencoderKL trained to reconstruct shapes scenes (posterior samples decoded,
    MSE plus VAE_KL_WEIGHT x the KL per pixel), then its scaling and shift factors set to the
    inverse standard deviation and the mean of its latents (posterior means) on 512 more scenes."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, sample_size=32,
                        use_quant_conv=False, use_post_quant_conv=False, **VAE_ARCH)
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=VAE_LR, weight_decay=0.0)
    for step in range(1, VAE_STEPS + 1):
        images = _scene_images(rng, VAE_BATCH)
        posterior = vae.encode(images).latent_dist
        reconstruction = vae.decode(posterior.sample(generator)).sample
        error = ((reconstruction - images) ** 2).mean()
        loss = error + VAE_KL_WEIGHT * posterior.kl().mean() / images[0].numel()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 250 == 0:
            log(f"vae step {step}: reconstruction mse {float(error.detach()):.5f}")
    vae.eval()
    with torch.no_grad():
        images = _scene_images(rng, 512)
        latents = vae.encode(images).latent_dist.mode()
        decoded = vae.decode(latents).sample.clamp(-1, 1)
    vae.register_to_config(scaling_factor=float(1.0 / latents.std()), shift_factor=float(latents.mean()))
    log(f"vae: mean |error| {float((decoded - images).abs().mean()) * 127.5:.2f} / 255 on held-out scenes")
    return vae


def build_edit_model(folder: Path, seed: int, arch: dict, log=print) -> None:
    """A fresh FLUX.1 Kontext folder of `arch` with the edit vocabulary and a VAE trained here; its
    sampler file names the world's 32 px (the Kontext pipeline's own default is 256 px here)."""
    from pixelrl.models.export import write_sampler
    from pixelrl.models.flux_kontext.tiny import build_tiny_flux_kontext

    build_tiny_flux_kontext(folder, words=edit_world.vocabulary(), seed=seed, **arch)
    train_vae(seed, log).save_pretrained(folder / "vae", safe_serialization=True)
    write_sampler(folder, {"resolution": edit_world.SIZE})


class EditStream:
    """Endless (instruction, source, target) triples of the train instructions, kinds of edit
    uniform; `rng` is the stream's state (saved with a run, for resuming)."""

    def __init__(self, seed: int, category_weights=None):
        if category_weights:
            raise ConfigError("--category-weights", category_weights, "the edit world draws its kinds of edit "
                              "uniformly; leave it out with --world edit")
        self.rng = random.Random(seed)
        self.by_edit: dict[str, list[dict]] = {}
        for item in edit_world.instruction_splits()["train"]:
            self.by_edit.setdefault(item["edit"], []).append(item)

    def loss(self, model, size: int, generator: torch.Generator) -> torch.Tensor:
        from pixelrl.shapes.pretrain import flow_matching_loss

        instructions, sources, targets = [], [], []
        for _ in range(size):
            item = self.rng.choice(self.by_edit[self.rng.choice(edit_world.EDITS)])
            source, target, _ = edit_world.edit_triple(item, self.rng.randrange(1 << 30))
            instructions.append(item["prompt"])
            sources.append(torch.from_numpy(source))
            targets.append(torch.from_numpy(target))
        text = model._encode_uncached(instructions)  # with grad: the text encoders train too
        text.condition_latents = model.encode(torch.stack(sources))[:, None]  # frozen VAE, no grad
        return flow_matching_loss(model, model.encode(torch.stack(targets)), text, generator)


def validate_edits(model, split: str, per_item: int) -> tuple[dict, str]:
    """(log record, printable table) of edit success on `split`."""
    from pixelrl.shapes.edit_evaluate import evaluate_edits, format_edit_table

    result = evaluate_edits(model, edit_world.evaluation_items(split, per_edit=per_item), num_steps=10)
    record = {"val_exact": result["exact"], "val_followed": result["followed"], "val_kept": result["kept"]}
    return record, format_edit_table(result, f"EMA ({split})")
