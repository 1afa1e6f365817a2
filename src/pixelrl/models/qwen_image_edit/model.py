"""Qwen-Image-Edit family adapter (`QwenImageEditPlusPipeline`: Qwen-Image-Edit-2509 and -2511).

Everything but the condition is Qwen-Image's (`models/qwen_image`): packing, true CFG with norm
rescaling, the sigma grid shifted by the target's token count. What editing adds:
- the text encoder reads the source: the instruction becomes "Picture 1: <image>" + instruction
  under the edit system prompt, the image resized to the pipeline's `CONDITION_IMAGE_SIZE` area
  for the vision tower; so a text embedding is keyed by the prompt and the source's content,
  and both CFG branches (the negative prompt too) see the source;
- the source's clean latents (VAE posterior mode, normalised) are appended to the target's
  tokens, `img_shapes` naming both grids for the 2-D RoPE (2511's `zero_cond_t` modulates the
  source's tokens at timestep 0 from the same shapes); the prediction is the target's tokens.
The source enters the VAE at the output's size (the row's image is decoded there): the pipeline
resizes it to a 1024 x 1024 area whatever the output, the same thing at the 1024 px the
releases are trained at, and Flow-Factory's `condition_image_size` set to the resolution.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pixelrl.models.base import PromptEmbeds, load_part
from pixelrl.models.qwen_image.model import QwenImageModel


class QwenImageEditModel(QwenImageModel):
    pipeline_class_name = "QwenImageEditPlusPipeline"
    condition_images = 1
    # 2509 and 2511 edit from one to three pictures ("Picture 1: ... Picture 2: ..." in the prompt,
    # each picture's latents appended with its own img_shapes entry): the releases' stated range
    most_condition_images = 3
    output_side_rounding, aspect_source_index = 32, -1  # the pipeline's output size: its last picture's aspect

    def _pipeline(self, folder: Path, components: dict):
        from pixelrl.models.qwen_image_edit.processor import load_processor

        processor = load_part(folder, "processor/", lambda: load_processor(folder))
        return self.pipeline_class()(**components, processor=processor)

    @classmethod
    def load_pipeline(cls, folder: Path):
        """The diffusers pipeline of the folder, its processor pixelrl's (`processor.py`)."""
        from pixelrl.models.qwen_image_edit.processor import load_processor

        def load():
            # diffusers accepts only a ProcessorMixin here: load without one, then set it
            pipeline = cls.pipeline_class().from_pretrained(folder, processor=None, use_safetensors=True)
            pipeline.processor = load_processor(Path(folder))
            return pipeline

        return load_part(folder, "pipeline", load)

    @classmethod
    def save_pipeline(cls, pipeline, folder: Path) -> None:
        from pixelrl.models.qwen_image_edit.processor import write_processor

        super().save_pipeline(pipeline, folder)
        write_processor(folder, pipeline.processor)

    def _encode_text_seeing(self, prompts: list[str], images: list, keys: list[tuple[str, ...]]) -> PromptEmbeds:
        keys = [(prompt, *row_keys) for prompt, row_keys in zip(prompts, keys)]
        rows = dict(zip(keys, images))
        return self._cached_embeds(keys, lambda key: self._encode_with_images(key[0], rows[key]))

    def _encode_with_images(self, prompt: str, images: tuple) -> PromptEmbeds:
        """The pipeline's `encode_prompt` on the instruction and the vision tower's view of each
        image, cut to `model.max_sequence_length` tokens (as Flow-Factory; the pipeline keeps all)."""
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit
        from PIL import Image

        views = []
        for image in images:
            height, width = image.shape[:2]
            view_width, view_height = edit.calculate_dimensions(edit.CONDITION_IMAGE_SIZE, width / height)
            views.append(self.pipeline.image_processor.resize(Image.fromarray(image.numpy()), view_height, view_width))
        embeds, mask = self.pipeline.encode_prompt([prompt], image=views, device=self.device)
        embeds = embeds[:, :self.max_sequence_length]
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device) if mask is None else \
            mask[:, :self.max_sequence_length]
        return PromptEmbeds(embeds.to(self.dtype), mask=mask)
