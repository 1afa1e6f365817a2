"""FLUX.1 Kontext family adapter (`FluxKontextPipeline`).

Everything but the condition is FLUX.1's (`models/flux`): text, packing, guidance embedding and
the sigma grid, shifted by the target's token count alone as the pipeline does. The condition
image is VAE-encoded to its clean latents (the posterior mode, as the pipeline's
`sample_mode="argmax"`), once per image (`DiffusionModel.encode_conditions`), and appended to the
sequence in every forward; the prediction is the target's tokens only.
"""

from __future__ import annotations

import torch

from pixelrl.models.flux.model import FluxModel


class FluxKontextModel(FluxModel):
    pipeline_class_name = "FluxKontextPipeline"
    # FluxKontextPipeline scales height x width to max_area (1024 x 1024 by default) and resizes
    # the source to one of its preferred 1024-px sizes unless told not to
    diffusers_edit_size = "max_area={area}, _auto_resize=False"
    condition_images = 1

    def _append_condition(self, packed, image_ids, condition_latents):
        """FLUX.1 Kontext's way in: each condition image's latents packed like the target's and
        appended to the sequence, their position ids those of a same-size image with the first
        index 1 (a separate frame), as `FluxKontextPipeline.prepare_latents` builds them."""
        batch = packed.shape[0]
        tokens, ids = [packed], [image_ids]
        for k in range(condition_latents.shape[1]):
            cond = condition_latents[:, k].to(self.device, self.dtype)
            _, channels, ch, cw = cond.shape
            tokens.append(self.pipeline._pack_latents(cond, batch, channels, ch, cw))
            cond_ids = self.pipeline._prepare_latent_image_ids(batch, ch // 2, cw // 2, self.device, self.dtype)
            cond_ids[..., 0] = 1
            ids.append(cond_ids)
        return torch.cat(tokens, dim=1), torch.cat(ids, dim=0)

