"""A tiny random-weight Idefics3 (SmolVLM-style) checkpoint, built with transformers' own classes.

`build(target, seed=0)` writes into `target`: config.json + model.safetensors of an
`Idefics3ForConditionalGeneration` (SigLIP-style tower: 64 px tiles, 8 px patches, width 32,
2 layers; pixel-shuffle connector with scale factor 2, so 16 visual tokens per tile; a 2-layer
Llama text model of width 64), the embedded SmolLM2 tokenizer plus the tokens the Idefics3
processor expects, the slow (PIL) `Idefics3ImageProcessorPil` (tiles of 64 px, longest edge
192 px: a photo becomes up to 3 x 3 tiles plus the global image) and a chat template in the
SmolVLM format. Nothing is downloaded; a build takes a few seconds.

The text model uses a large initializer range so that greedy decoding is decided by wide
margins and stays identical under reordered float sums.
"""

from __future__ import annotations

from pathlib import Path

from tests.vlm_checkpoints import smollm2_dir

__all__ = (
    "CHAT_TEMPLATE",
    "IMAGE_SEQ_LEN",
    "SPECIAL_TOKENS",
    "TILE",
    "build",
)

TILE = 64  # px: the vision tower's image_size and the processor's max_image_size
LONGEST_EDGE = 3 * TILE  # px: the processor's resize target for the longest edge
PATCH = 8
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE_FACTOR**2  # visual tokens per tile

SPECIAL_TOKENS = (
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
)

# SmolVLM's conversation format: "<|im_start|>User:<image>question<end_of_utterance>\n
# Assistant: answer<end_of_utterance>\n...". Content is either a string or a list of
# {"type": "text" | "image"} parts; a turn whose first part is an image gets no space after
# the colon.
CHAT_TEMPLATE = (
    "<|im_start|>"
    "{%- for message in messages -%}"
    "{{- message['role'] | capitalize -}}"
    "{%- if message['content'] is string -%}"
    "{{- ': ' + message['content'] -}}"
    "{%- else -%}"
    "{{- ':' if message['content'][0]['type'] == 'image' else ': ' -}}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<image>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<end_of_utterance>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"
)


def _tokenizer():
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    source = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(source)
    tok.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        special_tokens=True,
    )
    tok.eos_token = "<end_of_utterance>"
    return tok


def build(
    target: Path,
    *,
    seed: int = 0,
    scale_factor: int = SCALE_FACTOR,
    do_image_splitting: bool = True,
    longest_edge: int = LONGEST_EDGE,
) -> Path:
    """Write the tiny checkpoint into `target` (created if missing) and return it.

    `scale_factor` is the connector's pixel shuffle (each tile gives
    (TILE / PATCH)**2 / scale_factor**2 visual tokens); `do_image_splitting` and
    `longest_edge` (px) are the image processor's: with splitting off a photo is only the
    global image, with a larger longest edge it becomes more tiles."""
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        LlamaConfig,
    )

    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<image>", "<end_of_utterance>")}
    pad_id = tok.convert_tokens_to_ids(tok.pad_token)

    text_config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.3,
        rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id,
        eos_token_id=ids["<end_of_utterance>"],
        pad_token_id=pad_id,
        tie_word_embeddings=False,
    )
    vision_config = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": TILE,
        "patch_size": PATCH,
        "initializer_range": 0.05,
    }
    config = Idefics3Config(
        vision_config=vision_config,
        text_config=text_config.to_dict(),
        scale_factor=scale_factor,
        image_token_id=ids["<image>"],
        pad_token_id=pad_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=ids["<end_of_utterance>"],
        pad_token_id=pad_id,
    )
    model.save_pretrained(target)

    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": longest_edge},
        max_image_size={"longest_edge": TILE},
        do_image_splitting=do_image_splitting,
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        image_seq_len=(TILE // PATCH) ** 2 // scale_factor**2,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(target)
    return target
