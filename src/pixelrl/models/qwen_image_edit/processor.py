"""The edit pipeline's `processor` without torchvision.

`QwenImageEditPlusPipeline` calls `processor(text=..., images=..., padding=True,
return_tensors="pt")` and reads `input_ids`, `attention_mask`, `pixel_values` and
`image_grid_thw`. transformers' `Qwen2VLProcessor` cannot even be built without torchvision (its
video half), which this CPU environment and many training images lack, so pixelrl gives the
pipeline this one: the same work (each `<|image_pad|>` expanded to one token per merged patch,
then the tokenizer) over the tokenizer and the PIL image processor the folder's `processor/`
holds. On disk the folder keeps transformers' layout, so diffusers loads it with
`Qwen2VLProcessor` wherever torchvision is installed.
"""

from __future__ import annotations

import json
from pathlib import Path

IMAGE_TOKEN = "<|image_pad|>"
PROCESSOR_ENTRY = ["transformers", "Qwen2VLProcessor"]  # model_index.json's record of the component


class ImageTextProcessor:
    def __init__(self, tokenizer, image_processor):
        self.tokenizer, self.image_processor = tokenizer, image_processor

    def __call__(self, text: list[str], images=None, padding: bool = True, return_tensors: str = "pt"):
        from transformers import BatchFeature

        vision = {} if not images else dict(self.image_processor(images, return_tensors=return_tensors))
        grids = iter(vision.get("image_grid_thw", []))
        merge = self.image_processor.merge_size ** 2
        expanded = []
        for line in text:
            pieces = line.split(IMAGE_TOKEN)
            out = pieces[0]
            for piece in pieces[1:]:
                out += IMAGE_TOKEN * (int(next(grids).prod()) // merge) + piece
            expanded.append(out)
        encoded = self.tokenizer(expanded, padding=padding, return_tensors=return_tensors)
        return BatchFeature({**encoded, **vision})

    def save_pretrained(self, folder: str | Path) -> None:
        self.tokenizer.save_pretrained(folder)
        self.image_processor.save_pretrained(folder)


def load_processor(folder: Path) -> ImageTextProcessor:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return ImageTextProcessor(AutoTokenizer.from_pretrained(folder / "processor"),
                              Qwen2VLImageProcessorPil.from_pretrained(folder / "processor"))


def write_processor(folder: Path, processor: ImageTextProcessor) -> None:
    """`processor/` and its model_index.json entry, as `QwenImageEditPlusPipeline.save_pretrained`
    writes them with transformers' processor (diffusers leaves out a component it cannot save)."""
    folder = Path(folder)
    processor.save_pretrained(folder / "processor")
    index = json.loads((folder / "model_index.json").read_text())
    index["processor"] = PROCESSOR_ENTRY
    (folder / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
