"""The encoder boundary: image bytes in, visual tokens out.

`Encoder.encode` takes the raw bytes of one image and returns an `EncodedImage` whose
`embeds()` are ready to splice into the language model's input embeddings. Decoding,
preprocessing, the vision tower, patch dropping and quantization all happen behind it.
Bad input raises `ImageError` with a stable code; nothing else about the image escapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:
    import torch

__all__ = ("ENCODE_STAGES", "EncodedImage", "Encoder", "ImageError", "ImageLayout")

# Stages of one encode in the order they run; EncodedImage.timings_ms holds each in ms.
ENCODE_STAGES = ("decode", "preprocess", "vision", "prune", "project", "quantize")


class ImageError(Exception):
    """The image cannot be encoded. `code` is stable and goes on the wire.

    Codes: `invalid_image` (not an image / corrupt), `image_too_large` (bytes or pixels over
    the limits, decompression bombs included), `unsupported_image_format`.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ImageLayout(msgspec.Struct, frozen=True, array_like=True):
    """Where an image's visual tokens go in a real VLM's prompt (absent for the embedded default).

    The model's chat template renders `placeholder` once per image (e.g. "<image>" for LLaVA and
    Idefics3, "<|image_pad|>" for Qwen2.5-VL). `pieces` replace that placeholder in order, the
    way the model's own processor expands it: a str is text the tokenizer turns into ids (tile
    markers such as "<fake_token_around_image><row_1_col_1>"), an int is that many rows of the
    image's embeddings, taken in order (after patch dropping: the rows kept in that run). The
    ints sum to the number of embedding rows.

    `mrope` (Qwen2.5-VL only): for each embedding row, its (t, h, w) rotary position relative to
    the image's first position, flattened as [t0, h0, w0, t1, h1, w1, ...]; a dropped patch's row
    is absent and the kept ones keep their original positions. `mrope_advance`: how far the text
    position moves past the image (the unpruned grid's max(t, h, w) + 1). Empty for 1-D RoPE.
    `mrope_merge`: the checkpoint's spatial merge size (vision_config.spatial_merge_size): each
    row is one merged token of `mrope_merge` x `mrope_merge` patches, so the image's patch grid
    is the positions' (t, h * mrope_merge, w * mrope_merge). Layouts stored before it read as 2.
    """

    placeholder: str
    pieces: tuple[str | int, ...]
    mrope: tuple[int, ...] = ()
    mrope_advance: int = 0
    mrope_merge: int = 2

    @property
    def rows(self) -> int:
        return sum(p for p in self.pieces if isinstance(p, int))


@dataclass(slots=True)
class EncodedImage:
    digest: str  # sha256 hex of the image bytes
    fingerprint: str  # encoder fingerprint: weights id + preprocess + pruning + quantization config
    tokens_kept: int  # visual tokens the language model will see
    tokens_total: int  # visual tokens before patch dropping
    hidden_size: int
    payload: object  # the stored form (e.g. INT4-packed tokens); see encoder_worker.payload
    timings_ms: dict[str, float] = field(default_factory=dict)  # ENCODE_STAGES, batch_size
    layout: ImageLayout | None = None  # real VLM checkpoints: where the rows go in the prompt

    def embeds(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """[tokens_kept, hidden_size] float32 visual tokens on `device`."""
        from encoder_worker.payload import to_embeds

        return to_embeds(self.payload, device)


@runtime_checkable
class Encoder(Protocol):
    fingerprint: str
    hidden_size: int
    # True when encodes run in other processes that record their own stage spans and write
    # the vision cache themselves; the caller then does neither.
    remote: bool

    async def start(self) -> None:
        """Build or load the vision tower and warm it up."""

    async def encode(
        self, data: bytes, *, traceparent: str | None = None, owner: str | None = None
    ) -> EncodedImage:
        """Encode one image off the event loop (micro-batched with concurrent calls).

        `traceparent` (W3C) is the caller's span: an encoder that runs elsewhere records its
        stage spans under it; an in-process one may ignore it (the caller records them).
        `owner` is an opaque name of whom the image is encoded for (the gateway passes its
        API key's owner id): an encoder that shares its batches takes waiting images in turns
        by owner, so one owner's many images do not hold up another's few; None is one more
        owner. It never changes the tokens."""

    async def queue_depth(self) -> int:
        """Images waiting to be encoded."""

    async def aclose(self) -> None: ...
