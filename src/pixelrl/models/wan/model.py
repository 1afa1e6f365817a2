"""Wan 2.1 / 2.2 text-to-video family adapter (`WanPipeline`) over diffusers components.

Video through the same RL code as images: a sample's latent is 5-D `[C, T', h, w]` (the SDE
step, log-probs and losses are elementwise or mean over all latent dimensions, so nothing else
changes), `decode` returns uint8 frames `[B, T, H, W, 3]`, and rewards receive those videos
(image rewards are scored per frame and averaged, see `pixelrl.rewards.multi`).

- Prompts: UMT5 token states through the pipeline's own `encode_prompt`, zero past each
  prompt's length and padded to `model.max_sequence_length` (no mask, as Wan's transformer takes
  them); CFG as a doubled batch, v = v_u + s (v_c - v_u).
- Timesteps go to the transformer as `sigma x 1000`; the sigma grid is the scheduler's own
  (static shift). A folder shipping Wan's UniPC scheduler is sampled with the flow-matching
  Euler/SDE steps at its `flow_shift`, as the RL references sample Wan.
- `model.num_frames` frames per video, 4k + 1 for Wan's VAE (1 frame + 4 per latent frame).
- Wan 2.2 A14B folders (`transformer_2` and a `boundary_ratio` in model_index.json): the two
  experts as one module (`pixelrl.models.wan.experts`), routed per row by timestep as the pipeline
  routes per step; the low-noise expert guides with `model.guidance_scale_2` (the pipeline's
  `guidance_scale_2`; unset, the same scale as the high-noise one), and `model.trained_experts`
  says which experts train (LoRA or full), the others staying frozen.
- Wan 2.2 TI2V-5B folders (`expand_timesteps` in model_index.json), text-to-video, with their
  residual VAE (16x spatial). WanPipeline hands these folders' transformer one timestep per video
  token, all equal without a first-frame image; pixelrl passes the one scalar per row, the same
  arithmetic (equal samples to float noise) without the per-token modulation tensor, six
  hidden-state sizes per row (about 1 GB in bf16 at 121 frames of 704 x 1280).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pixelrl.core.errors import ConfigError
from pixelrl.models.base import (DiffusionModel, PromptEmbeds, check_resolution, from_uint8_images, load_part,
                                 read_component_config, sigmas_from_scheduler, to_uint8_images)
from pixelrl.models.wan.experts import EXPERTS, TimestepExperts, expert_state

# Flow-GRPO's Wan targets: the attention projections of self- and cross-attention (suffixes, so
# attn1 and attn2 both match; the add_* projections exist in image-to-video models only).
WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def _vae_scales(folder: Path) -> tuple[int, int] | None:
    vae = read_component_config(folder, "vae")
    if vae is None:
        return None
    return int(vae.get("scale_factor_temporal") or 4), int(vae.get("scale_factor_spatial") or 8)


def _pipeline_index(folder: Path) -> dict:
    path = folder / "model_index.json"
    return json.loads(path.read_text()) if path.is_file() else {}


class WanModel(DiffusionModel):
    default_lora_targets = WAN_LORA_TARGETS
    pipeline_class_name = "WanPipeline"
    diffusers_output = "frames"
    text_tokens_hint = "Wan is conditioned on UMT5 token states: use 512 (Wan 2.1's length) or fewer"

    @classmethod
    def check_options(cls, max_sequence_length: int, num_frames: int = 1, folder: Path | None = None) -> None:
        cls.check_text_tokens(max_sequence_length)  # frames: a video family's own rule, not the image one
        temporal = (_vae_scales(folder) or (4, 8))[0] if folder is not None else 4
        if num_frames < 1 or (num_frames - 1) % temporal:
            raise ConfigError("model.num_frames", num_frames, f"this VAE packs {temporal} frames per latent frame after "
                              f"the first: use {temporal}k + 1 frames, e.g. {((max(num_frames, 1) - 1) // temporal) * temporal + 1}")

    @classmethod
    def expert_names(cls, folder: Path) -> tuple[str, ...]:
        """The folder's experts: both pipeline components for a Wan 2.2 A14B folder (a second
        transformer and a boundary), none for one transformer (WanPipeline then ignores a
        `transformer_2` without a boundary, and so does pixelrl)."""
        index = _pipeline_index(Path(folder))
        two = index.get("boundary_ratio") is not None and (index.get("transformer_2") or [None])[0] is not None
        return EXPERTS if two else ()

    @classmethod
    def check_trained_steps(cls, folder: Path, trained_experts: list[str] | None, num_steps: int,
                            steps: range) -> None:
        experts = cls.expert_names(folder)
        if not experts or not trained_experts or set(trained_experts) == set(experts):
            return
        ratio = float(_pipeline_index(folder)["boundary_ratio"])
        scheduler = cls._load_scheduler(folder)
        timesteps = sigmas_from_scheduler(scheduler, num_steps)[:-1].float() * scheduler.config.num_train_timesteps
        # each step's expert, as TimestepExperts routes it
        expert_of = [experts[0] if high else experts[1]
                     for high in (timesteps >= ratio * scheduler.config.num_train_timesteps).tolist()]
        if any(expert_of[step] in trained_experts for step in steps):
            return
        trained = [step for step, expert in enumerate(expert_of[:-1]) if expert in trained_experts]  # never the last
        if not trained:
            where = f"no stochastic step of {num_steps} reaches {trained_experts}"
        else:
            span = f"step {trained[0]}" if len(trained) == 1 else f"steps {trained[0]}-{trained[-1]}"
            where = (f"{span} computed by {trained_experts}: set rollout.sde_window_range within "
                     f"[{trained[0]}, {trained[-1] + 1}]")
        raise ConfigError("rollout.sde_window_range", [steps.start, steps.stop],
                          f"every trained step in it is computed by a frozen expert (model.trained_experts = "
                          f"{trained_experts}, boundary_ratio {ratio}): {where}, or train both experts")

    @classmethod
    def latent_unit(cls, folder: Path) -> int | None:
        scales, transformer = _vae_scales(folder), read_component_config(folder, "transformer")
        if scales is None or transformer is None:
            return None
        return scales[1] * int(transformer.get("patch_size", [1, 2, 2])[-1])

    @staticmethod
    def _load_scheduler(folder: Path):
        """A flow-matching Euler scheduler; Wan 2.1 folders ship UniPC, whose `flow_shift` is the shift."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
        if config.get("_class_name") == "FlowMatchEulerDiscreteScheduler":
            return DiffusionModel._load_scheduler(folder)
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config.get("num_train_timesteps", 1000),
                                               shift=float(config.get("flow_shift") or 1.0))

    def __init__(self, path: str | Path, *, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 max_sequence_length: int = 512, num_frames: int = 33, prompt_cache_size: int = 4096,
                 guidance_scale_2: float | None = None, trained_experts: list[str] | None = None):
        super().__init__(prompt_cache_size)
        from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
        from transformers import AutoTokenizer, UMT5EncoderModel

        folder = self._open(path, ("transformer", "scheduler", "vae", "text_encoder"), device, dtype,
                            max_sequence_length, num_frames)
        self.num_frames = int(num_frames)
        self.transformer = self._load_module(folder, "transformer", WanTransformer3DModel, frozen=False)
        self.scheduler = self._load_scheduler(folder)
        self.guidance_scale_2 = guidance_scale_2
        experts = {}
        if self.expert_names(folder):
            experts = dict(transformer_2=self._load_module(folder, "transformer_2", WanTransformer3DModel, frozen=False),
                           boundary_ratio=float(_pipeline_index(folder)["boundary_ratio"]))
        self.vae = self._load_module(folder, "vae", AutoencoderKLWan)
        encoder = self._load_module(folder, "text_encoder", UMT5EncoderModel)
        tokenizer = load_part(folder, "tokenizer/", lambda: AutoTokenizer.from_pretrained(folder / "tokenizer"))
        # The diffusers pipeline over the same modules: its encode_prompt is the prompt encoding.
        self.pipeline = WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=self.vae, scheduler=self.scheduler,
                                    transformer=self.transformer, **experts)
        if experts:
            boundary = experts["boundary_ratio"] * self.scheduler.config.num_train_timesteps
            self.transformer = TimestepExperts(self.transformer, experts["transformer_2"], boundary,
                                               tuple(trained_experts or EXPERTS))
        self.temporal_scale = self.pipeline.vae_scale_factor_temporal
        self.spatial_scale = self.pipeline.vae_scale_factor_spatial
        self.patch = tuple(self.transformer.config.patch_size)
        z_dim = self.vae.config.z_dim
        self.latents_mean = torch.tensor(self.vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(self.device)
        self.latents_std = torch.tensor(self.vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(self.device)

    # --- text -----------------------------------------------------------------------------
    def _encode_uncached(self, prompts: list[str]) -> PromptEmbeds:
        embeds, _ = self.pipeline.encode_prompt(prompts, do_classifier_free_guidance=False, device=self.device,
                                                max_sequence_length=self.max_sequence_length)
        return PromptEmbeds(embeds.to(self.dtype))

    # --- denoiser -------------------------------------------------------------------------
    def image_seq_len(self, height: int, width: int) -> int:
        _, frames, h, w = self.latent_shape(height, width)
        return frames // self.patch[0] * (h // self.patch[1]) * (w // self.patch[2])

    def sequence_tokens(self, latents: torch.Tensor) -> int:
        """The video tokens of (B, C, F, H, W) latents: what a sequence group splits (the text
        stays whole)."""
        frames, h, w = latents.shape[2:]
        return frames // self.patch[0] * (h // self.patch[1]) * (w // self.patch[2])

    def _timestep(self, sigmas: torch.Tensor) -> torch.Tensor:
        """The scheduler's timestep of each sigma (what the pipeline passes and routes experts by)."""
        return sigmas.float() * self.scheduler.config.num_train_timesteps

    def guidance_weight(self, sigmas: torch.Tensor, guidance_scale: float):
        """Each row's expert's scale: the low-noise expert's is `guidance_scale_2` where set."""
        if not isinstance(self.transformer, TimestepExperts) or self.guidance_scale_2 is None:
            return guidance_scale
        high = self.transformer.high_noise(self._timestep(sigmas))
        weight = torch.where(high, torch.tensor(float(guidance_scale)), torch.tensor(float(self.guidance_scale_2)))
        return weight.view(-1, 1, 1, 1, 1)

    def denoiser_networks(self) -> list[torch.nn.Module]:
        if isinstance(self.transformer, TimestepExperts):
            return self.transformer.experts()
        return [self.transformer]

    @classmethod
    def save_lora(cls, folder: Path, lora: dict[str, torch.Tensor], config: dict) -> None:
        """Two experts: one diffusers LoRA folder per trained expert, `folder/transformer` and
        `folder/transformer_2` (the pipeline loads the second with `load_into_transformer_2=True`)."""
        if not any(name.startswith(tuple(f"{e}." for e in EXPERTS)) for name in lora):
            return super().save_lora(folder, lora, config)
        for expert in EXPERTS:
            own = expert_state(lora, expert)
            if own:
                super().save_lora(Path(folder) / expert, own, config)

    @classmethod
    def load_lora_into_pipeline(cls, pipeline, folder: Path) -> None:
        """A `save_lora` folder into WanPipeline as diffusers loads it: one `load_lora_weights`
        call per expert's folder (a one-transformer adapter: the folder itself)."""
        experts = [expert for expert in EXPERTS if (Path(folder) / expert).is_dir()]
        if not experts:
            pipeline.load_lora_weights(folder)
        for expert in experts:
            pipeline.load_lora_weights(Path(folder) / expert, load_into_transformer_2=expert == EXPERTS[1])

    @classmethod
    def fuse_lora_into_pipeline(cls, pipeline, folder: Path) -> None:
        cls.load_lora_into_pipeline(pipeline, folder)
        # WanPipeline fuses `transformer` only unless told: the low-noise expert's adapter would be dropped
        pipeline.fuse_lora(components=[c for c in EXPERTS if getattr(pipeline, c, None) is not None])
        pipeline.unload_lora_weights()

    @classmethod
    def denoiser_state_into_pipeline(cls, pipeline, state: dict[str, torch.Tensor]) -> list[str]:
        if getattr(pipeline, "transformer_2", None) is None:
            return super().denoiser_state_into_pipeline(pipeline, state)
        unexpected = [n for n in state if not n.startswith(tuple(f"{e}." for e in EXPERTS))]
        for expert in EXPERTS:
            unexpected += getattr(pipeline, expert).load_state_dict(expert_state(state, expert), strict=False)[1]
        return unexpected

    def _forward(self, latents, sigmas, text: PromptEmbeds):
        return self.transformer(
            hidden_states=latents,
            timestep=self._timestep(sigmas),  # Wan's transformer takes the 0..1000 timestep
            encoder_hidden_states=text.embeds.to(self.device, self.dtype),
            return_dict=False,
        )[0]

    # --- videos ---------------------------------------------------------------------------
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        check_resolution(height, width, self.spatial_scale * self.patch[-1])
        frames = (self.num_frames - 1) // self.temporal_scale + 1
        return (self.vae.config.z_dim, frames, height // self.spatial_scale, width // self.spatial_scale)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> uint8 videos [B, T, H, W, 3]."""
        z = latents.to(self.device) * self.latents_std + self.latents_mean
        video = self.vae.decode(z.to(self.dtype), return_dict=False)[0]  # [B, 3, T, H, W] in [-1, 1]
        batch, _, frames, height, width = video.shape
        frames_first = video.permute(0, 2, 1, 3, 4).reshape(batch * frames, 3, height, width)
        return to_uint8_images(frames_first).reshape(batch, frames, height, width, 3)

    @torch.no_grad()
    def encode(self, videos: torch.Tensor) -> torch.Tensor:
        """uint8 videos [B, T, H, W, 3] -> normalised latents (the VAE posterior mean)."""
        batch, frames, height, width, _ = videos.shape
        if frames != self.num_frames:
            raise ConfigError("model.num_frames", self.num_frames, f"the videos to encode have {frames} frames")
        self.latent_shape(height, width)
        pixels = from_uint8_images(videos.reshape(batch * frames, height, width, 3))
        pixels = pixels.reshape(batch, frames, 3, height, width).permute(0, 2, 1, 3, 4).to(self.device, self.dtype)
        z = self.vae.encode(pixels).latent_dist.mode().float()
        return (z - self.latents_mean) / self.latents_std
