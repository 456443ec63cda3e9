"""The encoder boundary: image bytes in, visual tokens out.

`Encoder.encode` takes the raw bytes of one image and returns an `EncodedImage` whose
`embeds()` are ready to splice into the language model's input embeddings. Decoding,
preprocessing, the vision tower, patch dropping and quantization all happen behind it.
Bad input raises `ImageError` with a stable code; nothing else about the image escapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = ("ENCODE_STAGES", "EncodedImage", "Encoder", "ImageError")

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


@dataclass(slots=True)
class EncodedImage:
    digest: str  # sha256 hex of the image bytes
    fingerprint: str  # encoder fingerprint: weights id + preprocess + pruning + quantization config
    tokens_kept: int  # visual tokens the language model will see
    tokens_total: int  # visual tokens before patch dropping
    hidden_size: int
    payload: object  # the stored form (e.g. INT4-packed tokens); see encoder_worker.payload
    timings_ms: dict[str, float] = field(default_factory=dict)  # ENCODE_STAGES, batch_size

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

    async def encode(self, data: bytes, *, traceparent: str | None = None) -> EncodedImage:
        """Encode one image off the event loop (micro-batched with concurrent calls).

        `traceparent` (W3C) is the caller's span: an encoder that runs elsewhere records its
        stage spans under it; an in-process one may ignore it (the caller records them)."""

    async def queue_depth(self) -> int:
        """Images waiting to be encoded."""

    async def aclose(self) -> None: ...
