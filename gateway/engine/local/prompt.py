"""Chat messages -> the position sequence the LM sees: token ids with images spliced in.

A raw prompt (legacy completions, `render_raw`) is its text tokenized as is: no chat template,
no images, special tokens added as the tokenizer adds them to plain text (a BOS if it has one).

Per position a `Prompt` records a token id, or -1 where an image row sits; `images` says which
image rows cover which positions (the key of a row is its image's key, the span's first row and
the offset in the span, so KV block hashes tell every row apart); `segments` hold the same
sequence as runs of ids and runs of embedding rows, for `embed_positions`. An image is
identified by its digest plus a short hash of its embeddings, so KV reuse never mixes up two
encodings of one image. Two renderings:

- Images without a layout (the embedded default): the chat template renders each image as
  `<image>` + a one-off marker + `</image>`; the text is split on the markers and every text
  segment is tokenized on its own (no BOS per segment): `ids_0, image_0, ids_1, image_1, ...`.
- Images with an `ImageLayout` (a real VLM checkpoint): messages go to the checkpoint's chat
  template as structured content (`{"type": "image"}` / `{"type": "text"}` parts in order) and
  every rendered placeholder is expanded as the model's processor does it: the layout's str
  pieces stay text, each int piece becomes that many image tokens. The expanded string is
  tokenized in one call (add_special_tokens=False), like the processor's, and the image tokens
  are then replaced, in order, by the image's rows. A prompt whose placeholder count differs
  from its image count (user text that spells the placeholder) is refused with ValueError. With
  M-RoPE layouts (Qwen2.5-VL), `mrope` gives every position its (t, h, w) rotary index the way
  the model's `get_rope_index` does: text advances by one, an image's rows sit at the image's
  start plus their layout positions (kept rows keep their original ones), and the text after
  the image resumes at its start plus `mrope_advance`.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gateway.engine.interface import ImageInput, Message

if TYPE_CHECKING:
    from encoder_worker.types import ImageLayout

__all__ = (
    "IMAGE_CLOSE",
    "IMAGE_OPEN",
    "STRUCTURED_CONTENT_ATTR",
    "ImageSpan",
    "Prompt",
    "embed_positions",
    "image_key",
    "render",
    "render_raw",
)

IMAGE_OPEN = "<image>"
IMAGE_CLOSE = "</image>"
# Set on a VLM checkpoint's tokenizer: its chat template takes structured content
# ([{"type": "image"}, {"type": "text", "text": ...}]) for every message, text-only ones too.
# The value is the image placeholder (its image token, e.g. "<image>"), or True if unknown;
# a placeholder lets text-only prompts that spell it be refused as well.
STRUCTURED_CONTENT_ATTR = "visiongate_structured_content"


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
    structured: bool | None = None,
    open_last: bool = False,
) -> Prompt:
    """Render `messages` with the tokenizer's chat template into a `Prompt`.

    `image_keys` caches `image_key` by `id(ImageInput)` across renders of one request.
    `structured` (default: when any image has a layout, or the tokenizer is marked with
    `STRUCTURED_CONTENT_ATTR`) renders every message's content as a list of typed parts, the
    form VLM chat templates take; images must then all carry layouts. `open_last` renders the
    conversation only through the last part of the last message, leaving that message open (what
    the template renders before a part that would follow it); with add_generation_prompt=False,
    the result is then a prefix of the rendering of the same messages with more parts appended
    to the last one.
    """
    images = [
        part for message in messages for part in message.content if isinstance(part, ImageInput)
    ]
    for image in images:
        if image.embeds.ndim != 2:
            raise ValueError(f"image embeds must be [N, hidden], got {tuple(image.embeds.shape)}")
    if structured is None:
        structured = any(image.layout is not None for image in images) or bool(
            getattr(tokenizer, STRUCTURED_CONTENT_ATTR, False)
        )
    keys = image_keys if image_keys is not None else {}
    cut = f"\ue002{secrets.token_hex(6)}\ue003" if open_last else None
    if cut is not None:  # a part after the last one, where the rendering is cut
        if not messages:
            raise ValueError("open_last needs a message")
        *head, last = messages
        messages = [*head, Message(last.role, [*last.content, cut])]
    if structured:
        return _render_laid_out(tokenizer, messages, images, add_generation_prompt, keys, cut)
    if any(image.layout is not None for image in images):
        raise ValueError("images with a layout need the structured rendering")
    nonce = secrets.token_hex(6)
    conversation = []
    count = 0
    for message in messages:
        parts = []
        for part in message.content:
            if isinstance(part, str):
                parts.append(part)
            else:
                parts.append(f"{IMAGE_OPEN}\ue000{nonce}:{count}\ue001{IMAGE_CLOSE}")
                count += 1
        conversation.append({"role": message.role, "content": "\n".join(parts)})
    text = _cut(
        tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        ),
        cut,
    )
    pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", text)
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
            key = _cached_key(image, keys)
            n = image.num_tokens
            prompt.segments.append(image)
            prompt.images.append(ImageSpan(len(prompt.tokens), n, key))
            prompt.tokens.extend([-1] * n)
    return prompt


def _cut(text: str, cut: str | None) -> str:
    """`text` up to the marker `cut` (None: all of it)."""
    if cut is None:
        return text
    at = text.find(cut)
    if at < 0:
        raise ValueError("the chat template dropped the last part of the last message")
    return text[:at]


def render_raw(tokenizer: Any, text: str | tuple[int, ...]) -> Prompt:
    """A plain-text prompt as the tokenizer tokenizes it alone (no chat template), or token ids
    taken as they are."""
    ids = list(text) if isinstance(text, tuple) else [int(i) for i in tokenizer(text)["input_ids"]]
    return Prompt(segments=[ids] if ids else [], tokens=ids)


def _cached_key(image: ImageInput, keys: dict[int, str]) -> str:
    key = keys.get(id(image))
    if key is None:
        key = keys[id(image)] = image_key(image)
    return key


def _check_layout(image: ImageInput, layout: ImageLayout, placeholder: str) -> None:
    if layout.placeholder != placeholder:
        raise ValueError(
            f"images disagree on the placeholder: {layout.placeholder!r} and {placeholder!r}"
        )
    if layout.rows != image.num_tokens:
        raise ValueError(
            f"image layout places {layout.rows} rows but the image has {image.num_tokens}"
        )
    if any(isinstance(p, int) and p < 0 for p in layout.pieces):
        raise ValueError("image layout has a negative row count")
    if layout.mrope and len(layout.mrope) != 3 * layout.rows:
        raise ValueError(
            f"image layout has {len(layout.mrope)} M-RoPE entries for {layout.rows} rows"
        )


def _render_laid_out(
    tokenizer: Any,
    messages: Sequence[Message],
    images: list[ImageInput],
    add_generation_prompt: bool,
    keys: dict[int, str],
    cut: str | None = None,
) -> Prompt:
    """The VLM rendering: chat template with typed parts, placeholders expanded by layout."""
    conversation = []
    for message in messages:
        parts = [
            {"type": "text", "text": part} if isinstance(part, str) else {"type": "image"}
            for part in message.content
        ]
        conversation.append({"role": message.role, "content": parts})
    text = _cut(
        tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        ),
        cut,
    )
    marked = getattr(tokenizer, STRUCTURED_CONTENT_ATTR, None)
    layouts: list[ImageLayout] = []
    for image in images:
        if image.layout is None:
            raise ValueError("every image needs a layout on a vision-language checkpoint")
        _check_layout(image, image.layout, images[0].layout.placeholder)  # type: ignore[union-attr]
        layouts.append(image.layout)
    placeholder = layouts[0].placeholder if layouts else marked if isinstance(marked, str) else ""
    chunks = text.split(placeholder) if placeholder else [text]
    if len(chunks) - 1 != len(images):
        raise ValueError(
            f"the prompt renders {len(chunks) - 1} image placeholders {placeholder!r} for "
            f"{len(images)} images (message text must not contain {placeholder!r})"
        )
    if not images:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        return Prompt(segments=[ids] if ids else [], tokens=list(ids))
    image_id = _single_token_id(tokenizer, placeholder)
    expanded = [chunks[0]]
    for layout, chunk in zip(layouts, chunks[1:], strict=False):
        expanded.extend(p if isinstance(p, str) else placeholder * p for p in layout.pieces)
        expanded.append(chunk)
    ids: list[int] = tokenizer("".join(expanded), add_special_tokens=False)["input_ids"]
    total_rows = sum(layout.rows for layout in layouts)
    found = sum(1 for t in ids if t == image_id)
    if found != total_rows:
        raise ValueError(
            f"the expanded prompt holds {found} image tokens for {total_rows} image rows"
        )
    return _assemble(ids, image_id, images, layouts, keys)


def _single_token_id(tokenizer: Any, placeholder: str) -> int:
    ids = tokenizer(placeholder, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"image placeholder {placeholder!r} is not one token ({ids})")
    return int(ids[0])


def _assemble(
    ids: list[int],
    image_id: int,
    images: list[ImageInput],
    layouts: list[ImageLayout],
    keys: dict[int, str],
) -> Prompt:
    """Turn expanded ids into segments/spans; image tokens take the images' rows in order."""
    use_mrope = any(layout.mrope for layout in layouts)
    if use_mrope and not all(layout.mrope or layout.rows == 0 for layout in layouts):
        raise ValueError("some images have M-RoPE positions and some do not")
    prompt = Prompt(segments=[])
    columns: list[torch.Tensor] = []  # each [3, n]
    pos = 0  # next text rotary index
    img, row = 0, 0  # image being filled, and its next row
    img_start = 0  # rotary index of the current image's first row
    i = 0
    while i < len(ids):
        if ids[i] != image_id:
            j = i
            while j < len(ids) and ids[j] != image_id:
                j += 1
            run = ids[i:j]
            prompt.segments.append(run)
            prompt.tokens.extend(run)
            if use_mrope:
                columns.append(torch.arange(pos, pos + len(run)).expand(3, -1))
            pos += len(run)
            i = j
            continue
        while images[img].num_tokens == row:  # images without rows take no positions
            img, row = img + 1, 0
        image, layout = images[img], layouts[img]
        j = i
        while j < len(ids) and ids[j] == image_id and j - i < image.num_tokens - row:
            j += 1
        n = j - i
        if row == 0:
            img_start = pos
        prompt.segments.append(ImageInput(image.digest, image.embeds[row : row + n]))
        prompt.images.append(ImageSpan(len(prompt.tokens), n, f"{_cached_key(image, keys)}@{row}"))
        prompt.tokens.extend([-1] * n)
        if use_mrope:
            grid = torch.tensor(layout.mrope, dtype=torch.long).view(-1, 3).T  # [3, rows]
            columns.append(img_start + grid[:, row : row + n])
        row += n
        if row == image.num_tokens:
            pos = img_start + layout.mrope_advance if use_mrope else pos
            img, row = img + 1, 0
        i = j
    if use_mrope:
        prompt.mrope = torch.cat(columns, dim=1) if columns else torch.zeros(3, 0, dtype=torch.long)
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
