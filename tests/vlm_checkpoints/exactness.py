"""One photo through transformers and through the project's own path, for exactness tests.

Reference: the checkpoint's own processor and `*ForConditionalGeneration` (float32, CPU):
`get_image_features` on the processor's pixels, `get_rope_index` (Qwen2.5-VL) on its inputs,
and greedy `generate` on the chat template's conversation (a system line, then the photo and
a question).

Project: the photo as PNG bytes (lossless, so both sides see the same pixels) through
`EncoderPipeline` in exact mode (`pruning="none"`, fp32 tokens: no patch is dropped, whatever
`keep_ratio` says), then the encoded image with its layout into a started `LocalEngine` on the
same checkpoint: `render` with the engine's tokenizer gives the token ids and M-RoPE
positions, and a greedy request gives the answer, whose tokens are compared by their bytes
(`logprobs`), so an answer cut inside a multi-byte character compares as well.
"""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = (
    "SYSTEM",
    "ProjectAnswer",
    "Reference",
    "assert_same_answer",
    "png",
    "project_answers",
    "reference",
    "shaped",
)

SYSTEM = "You describe pictures."
QUESTION = "What is in this picture?"

_MODEL_CLASSES = {
    "llava": "LlavaForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}


def shaped(name: str) -> np.ndarray:
    """A photo of a given size and aspect ratio, [H, W, 3] uint8: skimage's photos, crops
    and resizes of them."""
    import skimage.data

    coffee, rocket, astronaut = skimage.data.coffee, skimage.data.rocket, skimage.data.astronaut
    make = {
        "astronaut": astronaut,  # 512 x 512
        "coffee": coffee,  # 400 x 600
        "chelsea": skimage.data.chelsea,  # 300 x 451
        "tall": lambda: np.ascontiguousarray(coffee()[:, 150:350]),  # 400 x 200
        "strip": lambda: np.ascontiguousarray(rocket()[100:220]),  # 120 x 640
        "small": lambda: np.asarray(Image.fromarray(astronaut()).resize((70, 90))),  # 90 x 70
        "camera": lambda: np.stack([skimage.data.camera()] * 3, axis=-1),  # gray, 512 x 512
    }
    return make[name]()


def png(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return buf.getvalue()


def _processor(family: str, path: Path) -> Any:
    if family == "qwen2_5_vl":  # its AutoProcessor wants torchvision for the video half
        from tests.vlm_checkpoints import qwen2_5_vl

        return qwen2_5_vl.load_processor(path)
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path, local_files_only=True)


def _token_bytes(tokenizer: Any, ids: list[int]) -> list[bytes]:
    """Each id's bytes under the byte-level BPE (SmolLM2's tokenizer, which every builder uses)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decoder = {c: b for b, c in bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    out = []
    for i, token in zip(ids, tokenizer.convert_ids_to_tokens(ids), strict=True):
        if i in special or any(c not in decoder for c in token):
            out.append(token.encode())
        else:
            out.append(bytes(decoder[c] for c in token))
    return out


@dataclass
class Reference:
    """transformers' own answer for one photo."""

    features: torch.Tensor  # [N, lm_hidden] get_image_features, in prompt order
    input_ids: list[int]  # the processor's ids for the conversation
    tokens: list[bytes]  # greedy generate's new tokens (to the first stop id, exclusive)
    grid_thw: tuple[int, int, int] | None = None  # Qwen2.5-VL: the processor's grid
    mrope: torch.Tensor | None = None  # [3, L] get_rope_index (Qwen2.5-VL)
    rope_delta: int = 0
    # Qwen2.5-VL: what generate answers when it is not given mm_token_type_ids and falls back
    # to 1-D positions (the answer an M-RoPE mistake would give)
    tokens_1d: list[bytes] = field(default_factory=list)


@dataclass
class ProjectAnswer:
    """The project's rows, prompt and greedy answer for one photo."""

    rows: torch.Tensor  # [N, lm_hidden] the encoded image's rows
    tokens_kept: int
    tokens_total: int
    input_ids: list[int]  # render's ids, image rows as the image token
    mrope: torch.Tensor | None
    rope_delta: int
    tokens: list[bytes]
    output_tokens: int


def _conversation(question: str) -> list[dict]:
    return [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
    ]


def _image_features(family: str, model: Any, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        if family == "qwen2_5_vl":
            out = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        elif family == "idefics3":
            out = model.get_image_features(
                pixel_values=inputs["pixel_values"],
                pixel_attention_mask=inputs["pixel_attention_mask"],
            )
        else:
            out = model.get_image_features(pixel_values=inputs["pixel_values"])
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    if isinstance(feats, (list, tuple)):
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
    return feats.reshape(-1, feats.shape[-1])


def reference(
    family: str, path: Path, photos: list[np.ndarray], max_new_tokens: int
) -> list[Reference]:
    """transformers' features, positions and greedy answer for each photo (decoded from the
    same PNG bytes the project is sent)."""
    import transformers

    processor = _processor(family, path)
    model = getattr(transformers, _MODEL_CLASSES[family]).from_pretrained(path, dtype=torch.float32)
    model = model.eval()
    text = processor.apply_chat_template(
        _conversation(QUESTION), add_generation_prompt=True, tokenize=False
    )
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])
    out = []
    for rgb in photos:
        image = Image.open(io.BytesIO(png(rgb))).convert("RGB")
        images = [[image]] if family == "idefics3" else [image]
        inputs = processor(text=text, images=images, return_tensors="pt")
        ref = Reference(
            features=_image_features(family, model, inputs),
            input_ids=inputs["input_ids"][0].tolist(),
            tokens=[],
        )
        if family == "qwen2_5_vl":
            # without mm_token_type_ids generate silently uses 1-D positions: a reference
            # that compares against those would be wrong from the first token
            assert "mm_token_type_ids" in inputs, "the processor must give mm_token_type_ids"
            ref.grid_thw = tuple(int(v) for v in inputs["image_grid_thw"][0])
            positions, delta = model.model.get_rope_index(
                inputs["input_ids"],
                inputs["mm_token_type_ids"],
                image_grid_thw=inputs["image_grid_thw"],
                attention_mask=inputs["attention_mask"],
            )
            ref.mrope, ref.rope_delta = positions[:, 0], int(delta[0, 0])

        def greedy(kwargs: dict) -> list[bytes]:
            with torch.no_grad():
                ids = model.generate(**kwargs, do_sample=False, max_new_tokens=max_new_tokens)
            new = ids[0, kwargs["input_ids"].shape[1] :].tolist()
            cut = next((i for i, t in enumerate(new) if t in stops), len(new))
            return _token_bytes(processor.tokenizer, new[:cut])

        ref.tokens = greedy(dict(inputs))
        if family == "qwen2_5_vl":
            ref.tokens_1d = greedy({k: v for k, v in inputs.items() if k != "mm_token_type_ids"})
        out.append(ref)
    return out


def project_answers(
    path: Path, photos: list[np.ndarray], max_new_tokens: int, **encoder: Any
) -> list[ProjectAnswer]:
    """Each photo through EncoderPipeline (exact mode unless `encoder` says otherwise) and a
    LocalEngine on the same checkpoint: rows, prompt and greedy answer."""
    from encoder_worker import EncoderConfig, EncoderPipeline, ImageError
    from gateway.engine.interface import (
        GenerationRequest,
        GenerationResult,
        ImageInput,
        Message,
        SamplingParams,
        TextDelta,
    )
    from gateway.engine.local.local_engine import LocalEngine
    from gateway.engine.local.prompt import render

    settings = {"pruning": "none", "visual_tokens": "fp32", **encoder}
    pipeline = EncoderPipeline(EncoderConfig(tower=str(path), device="cpu", **settings), None)
    try:
        encoded = pipeline.encode_batch([png(rgb) for rgb in photos])
    finally:
        pipeline.close()
    for image in encoded:
        if isinstance(image, ImageError):
            raise image

    async def answer_all() -> list[ProjectAnswer]:
        engine = LocalEngine(model_path=str(path), device="cpu", dtype="float32")
        await engine.start()
        try:
            answers = []
            for i, image in enumerate(encoded):
                rows = image.embeds()
                item = ImageInput(f"{image.fingerprint}:{image.digest}", rows, image.layout)
                messages = [Message("system", [SYSTEM]), Message("user", [item, QUESTION])]
                prompt = render(engine.tokenizer, messages, add_generation_prompt=True)
                image_id = engine.tokenizer.convert_tokens_to_ids(image.layout.placeholder)
                request = GenerationRequest(
                    request_id=f"exact-{i}",
                    messages=messages,
                    sampling=SamplingParams(max_output_tokens=max_new_tokens, logprobs=0),
                )
                tokens: list[bytes] = []
                result = None
                async for delta in engine.generate(request):
                    if isinstance(delta, TextDelta):
                        tokens.extend(t.bytes for t in delta.logprobs)
                    elif isinstance(delta, GenerationResult):
                        result = delta
                assert result is not None
                answers.append(
                    ProjectAnswer(
                        rows=rows,
                        tokens_kept=image.tokens_kept,
                        tokens_total=image.tokens_total,
                        input_ids=[image_id if t == -1 else t for t in prompt.tokens],
                        mrope=prompt.mrope,
                        rope_delta=prompt.rope_delta,
                        tokens=tokens,
                        output_tokens=result.output_tokens,
                    )
                )
            return answers
        finally:
            await engine.aclose()

    return asyncio.run(answer_all())


def assert_same_answer(ours: ProjectAnswer, ref: Reference, max_new_tokens: int) -> None:
    """Token for token what generate answers: all max_new_tokens of them, or up to its stop
    (which the engine may or may not report as one more token)."""
    assert ours.input_ids == ref.input_ids
    stopped = len(ref.tokens) < max_new_tokens
    extra = 1 if stopped and len(ours.tokens) == len(ref.tokens) + 1 else 0
    assert ours.tokens[: len(ours.tokens) - extra] == ref.tokens, (ours.tokens, ref.tokens)
    assert ours.output_tokens in {len(ref.tokens), len(ref.tokens) + (1 if stopped else 0)}
