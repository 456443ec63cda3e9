"""A tiny random-weight LLaVA checkpoint: CLIP vision tower, MLP projector, Llama text model.

`build(target, seed=0)` saves, with transformers' own classes, everything a real LLaVA
checkpoint directory holds: config.json (LlavaConfig), model.safetensors, the SmolLM2 tokenizer
with "<image>" added as a special token, a CLIP image processor (PIL backend: shortest-edge
resize, center crop, rescale, normalize) and a chat template in the LLaVA-1.5 style
("USER: <image>\\n... ASSISTANT:"). The vision tower has 3 layers so that the default feature
layer (-2) leaves one layer unused. The text model's initializer range is large so that greedy
answers do not flip under reordered float sums.
"""

from __future__ import annotations

from pathlib import Path

from tests.vlm_checkpoints import smollm2_dir

__all__ = ("IMAGE_SIZE", "PATCH_SIZE", "build")

IMAGE_SIZE = 64
PATCH_SIZE = 8

# LLaVA-1.5 shape: a system line, then "USER: ..." / "ASSISTANT: ..." turns; an image part
# renders as "<image>\n" where it stands in the content.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}"
    "{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'system' %}"
    "{% for part in parts %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ message['role'].upper() + ': ' }}"
    "{% for part in parts %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def build(
    target: Path,
    *,
    seed: int = 0,
    feature_layer: int | list[int] = -2,
    select_strategy: str = "default",
    key_layout: str = "saved",
    text_overrides: dict | None = None,
) -> Path:
    """Save a tiny LLaVA checkpoint into `target` and return it.

    `text_overrides` replaces entries of the Llama text config below (e.g. `num_attention_heads`
    for wider heads).

    `key_layout` names the weights as "saved" (what `save_pretrained` writes: `vision_tower.*`,
    `multi_modal_projector.*`, `language_model.model.*`), "model" (the transformers-5 module
    names: `model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`,
    `lm_head.*`) or "vision_model" (as saved, with transformers-4's `vision_tower.vision_model.*`).
    """
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")

    vision = CLIPVisionConfig(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=48,
        hidden_act="quick_gelu",
    )
    text = LlamaConfig(
        **{
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "initializer_range": 0.3,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            **(text_overrides or {}),
        }
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=select_strategy,
        projector_hidden_act="gelu",
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # lift the projector out of the near-zero default init
        for p in model.model.multi_modal_projector.parameters():
            p.normal_(0.0, 0.2)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(target)
    if key_layout != "saved":
        _rename_keys(target / "model.safetensors", key_layout)

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_center_crop=True,
        resample=3,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy=select_strategy,
        chat_template=CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(target)
    return target


def _rename_keys(path: Path, layout: str) -> None:
    from safetensors.torch import load_file, save_file

    renames = {
        "model": (
            ("vision_tower.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
            ("language_model.model.", "model.language_model."),
            ("language_model.lm_head.", "lm_head."),
        ),
        "vision_model": (("vision_tower.", "vision_tower.vision_model."),),
    }[layout]
    out = {}
    for key, value in load_file(path).items():
        for old, new in renames:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        out[key] = value
    save_file(out, path, metadata={"format": "pt"})
