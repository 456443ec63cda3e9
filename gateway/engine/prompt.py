"""Chat messages -> the position sequence the LM sees: token ids with images spliced in.

The chat template renders each image as `<image>` + a one-off marker + `</image>`; the text is
split on the markers and every text segment is tokenized on its own (no BOS per segment), so a
prompt is `ids_0, image_0, ids_1, image_1, ...`. Per position the prompt records a token id,
or -1 where an image token sits; `images` says which image covers which positions. An image is
identified by its digest plus a short hash of its embeddings, so KV reuse never mixes up two
encodings of one image.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gateway.engine.base import ImageInput, Message

__all__ = (
    "IMAGE_CLOSE",
    "IMAGE_OPEN",
    "ImageSpan",
    "Prompt",
    "embed_positions",
    "image_key",
    "render",
)

IMAGE_OPEN = "<image>"
IMAGE_CLOSE = "</image>"


@dataclass(slots=True, frozen=True)
class ImageSpan:
    start: int  # first position of the image's tokens in the sequence
    length: int
    key: str  # digest:content-hash; what KV block hashes see at these positions


@dataclass(slots=True)
class Prompt:
    segments: list[list[int] | ImageInput]
    tokens: list[int] = field(default_factory=list)  # per position: id, or -1 for an image token
    images: list[ImageSpan] = field(default_factory=list)
    # M-RoPE (Qwen2.5-VL): per position its (t, h, w) rotary position, [3, length] int64;
    # None: 1-D RoPE, where a position's rotary index is its index in the sequence
    mrope: torch.Tensor | None = None

    @property
    def rope_delta(self) -> int:
        """Generated token i (0-based, after the prompt) sits at rotary index length + i + delta."""
        if self.mrope is None or self.mrope.shape[1] == 0:
            return 0
        return int(self.mrope.max()) + 1 - self.length

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def image_tokens(self) -> int:
        return sum(span.length for span in self.images)


def image_key(image: ImageInput) -> str:
    """The image's digest plus a short hash of its embedding bytes."""
    raw = image.embeds.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return f"{image.digest}:{hashlib.blake2b(raw, digest_size=8).hexdigest()}"


def render(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    image_keys: dict[int, str] | None = None,
) -> Prompt:
    """Render `messages` with the tokenizer's chat template into a `Prompt`.

    `image_keys` caches `image_key` by `id(ImageInput)` across renders of one request.
    """
    nonce = secrets.token_hex(6)
    images: list[ImageInput] = []
    conversation = []
    for message in messages:
        parts = []
        for part in message.content:
            if isinstance(part, str):
                parts.append(part)
            else:
                parts.append(f"{IMAGE_OPEN}\ue000{nonce}:{len(images)}\ue001{IMAGE_CLOSE}")
                images.append(part)
        conversation.append({"role": message.role, "content": "\n".join(parts)})
    text = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", text)
    keys = image_keys if image_keys is not None else {}
    prompt = Prompt(segments=[])
    for i, piece in enumerate(pieces):
        if i % 2 == 0:  # text between markers
            if not piece:
                continue
            ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
            prompt.segments.append(ids)
            prompt.tokens.extend(ids)
        else:
            image = images[int(piece)]
            if image.embeds.ndim != 2:
                raise ValueError(
                    f"image embeds must be [N, hidden], got {tuple(image.embeds.shape)}"
                )
            key = keys.get(id(image))
            if key is None:
                key = keys[id(image)] = image_key(image)
            n = image.num_tokens
            prompt.segments.append(image)
            prompt.images.append(ImageSpan(len(prompt.tokens), n, key))
            prompt.tokens.extend([-1] * n)
    return prompt


def embed_positions(
    embedding: torch.nn.Module,
    prompt: Prompt,
    start: int,
    dtype: torch.dtype,
    device: torch.device,
    end: int | None = None,
) -> torch.Tensor:
    """Input embeddings [1, end - start, H] of the prompt's positions [start, end)."""
    end = prompt.length if end is None else end
    chunks: list[torch.Tensor] = []
    offset = 0
    for seg in prompt.segments:
        n = seg.num_tokens if isinstance(seg, ImageInput) else len(seg)
        lo = max(start - offset, 0)
        hi = min(end - offset, n)
        if lo < hi:
            if isinstance(seg, ImageInput):
                chunks.append(seg.embeds[lo:hi].to(device=device, dtype=dtype))  # [hi - lo, H]
            else:
                ids = torch.tensor(seg[lo:hi], dtype=torch.long, device=device)
                chunks.append(embedding(ids).to(dtype))  # [hi - lo, H]
        offset += n
        if offset >= end:
            break
    return torch.cat(chunks, dim=0).unsqueeze(0)  # [1, S, H]
