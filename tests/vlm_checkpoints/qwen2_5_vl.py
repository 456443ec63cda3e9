"""A tiny random-weight Qwen2.5-VL checkpoint, built with transformers' own classes.

`build(target, seed=0)` writes into `target`: config.json + model.safetensors of a
`Qwen2_5_VLForConditionalGeneration` (vision: 14 px patches, temporal patch 2, width 32, 4
blocks of which 1 and 3 attend over the whole image and 0 and 2 within 56 px windows, 2 x 2
patch merger into the text width; text: width 64, 2 layers, 4 heads, 2 KV heads, M-RoPE
sections (2, 3, 3)), the embedded SmolLM2 tokenizer plus "<|vision_start|>", "<|vision_end|>",
"<|image_pad|>" and "<|video_pad|>", the slow (PIL) `Qwen2VLImageProcessorPil` (dynamic
resolution between MIN_PIXELS and MAX_PIXELS: a photo becomes at most 40 visual tokens) and a
chat template in the Qwen2.5-VL format. Nothing is downloaded; a build takes a few seconds.

The processor: `Qwen2_5_VLProcessor` also holds a video processor, and its constructor checks
that sub-processor against a class that only exists when torchvision is installed. The
checkpoint is saved with `ImagesOnlyQwen2_5_VLProcessor`, a subclass whose constructor takes no
video processor, and processor_config.json is then relabelled `Qwen2_5_VLProcessor` so that
the directory reads like a real checkpoint's. `load_processor(dir)` loads it back without
torchvision; with torchvision installed `AutoProcessor.from_pretrained(dir)` works as well.

The text model uses a large initializer range so that greedy decoding is decided by wide
margins and stays identical under reordered float sums.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.vlm_checkpoints import smollm2_dir

__all__ = (
    "CHAT_TEMPLATE",
    "MAX_PIXELS",
    "MIN_PIXELS",
    "SPECIAL_TOKENS",
    "build",
    "load_processor",
)

PATCH = 14
MERGE = 2
MIN_PIXELS = (PATCH * MERGE) ** 2 * 4  # at least 4 visual tokens
MAX_PIXELS = (PATCH * MERGE) ** 2 * 40  # at most 40 visual tokens

SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen2.5-VL's conversation format (ChatML): a default system turn when the conversation has
# none, then "<|im_start|>role\n...<|im_end|>\n" per message. Content is a string or a list of
# parts; an image part renders as "<|vision_start|><|image_pad|><|vision_end|>" where it stands.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def _images_only_class():
    from transformers import Qwen2_5_VLProcessor

    class ImagesOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        """Qwen2_5_VLProcessor without its video half (which needs torchvision)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)

    return ImagesOnlyQwen2_5_VLProcessor


def build(
    target: Path,
    *,
    seed: int = 0,
    module_keys: bool = False,
    vision: dict | None = None,
    text: dict | None = None,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
    tie_word_embeddings: bool = False,
) -> Path:
    """Save a tiny Qwen2.5-VL checkpoint into `target` and return it.

    transformers' save_pretrained writes the checkpoint layout of the published models
    (`visual.*`, `model.*` for the text model, `lm_head.*`); `module_keys` renames the weights
    to the module paths of transformers 5 (`model.visual.*`, `model.language_model.*`).

    `vision` and `text` override entries of the vision and text configs below (window_size,
    fullatt_block_indexes, depth, spatial_merge_size; num_attention_heads, rope_parameters with
    its mrope_section, which must sum to half the text head width); the image processor
    follows the vision config's patch, merge and temporal sizes and takes `min_pixels` /
    `max_pixels` as its bounds.
    """
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = dict(
        zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)), strict=False)
    )

    vision_config = {
        "depth": 4,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "hidden_act": "silu",
        "patch_size": PATCH,
        "temporal_patch_size": 2,
        "spatial_merge_size": MERGE,
        "window_size": 56,
        "fullatt_block_indexes": [1, 3],
        "out_hidden_size": 64,
        "tokens_per_second": 2,
        "initializer_range": 0.05,
        **(vision or {}),
    }
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "initializer_range": 0.3,
        "rms_norm_eps": 1e-6,
        # head_dim 16: the (t, h, w) sections cover its 8 rotary frequencies
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **(text or {}),
    }
    config = Qwen2_5_VLConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(target)
    if module_keys:
        _rename_to_module_keys(target / "model.safetensors")

    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=vision_config["patch_size"],
        merge_size=vision_config["spatial_merge_size"],
        temporal_patch_size=vision_config["temporal_patch_size"],
    )
    processor = _images_only_class()(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(target)
    path = target / "processor_config.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    saved["processor_class"] = "Qwen2_5_VLProcessor"
    path.write_text(json.dumps(saved, indent=2) + "\n")
    return target


def load_processor(checkpoint_dir: Path):
    """The checkpoint's Qwen2_5_VLProcessor (images and text only; no torchvision needed)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir, local_files_only=True)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(
        checkpoint_dir, local_files_only=True
    )
    chat_template = (Path(checkpoint_dir) / "chat_template.jinja").read_text()
    return _images_only_class()(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template
    )


def _rename_to_module_keys(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    renames = (("visual.", "model.visual."), ("model.", "model.language_model."))
    out = {}
    for key, value in load_file(path).items():
        for old, new in renames:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        out[key] = value
    save_file(out, path, metadata={"format": "pt"})
