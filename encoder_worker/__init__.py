"""Image bytes -> visual tokens: decode, fused preprocess, vision tower, saliency, patch
dropping, projector, INT4 payload, micro-batching.

The gateway codes against `Encoder` / `EncodedImage` / `ImageError` (types.py) and builds a
`LocalEncoder` from an `EncoderConfig`; `EncoderPipeline` is the synchronous core.
"""

from __future__ import annotations

from encoder_worker.config import EncoderConfig
from encoder_worker.local_encoder import LocalEncoder
from encoder_worker.payload import TokensHeader, VisualTokens, to_embeds
from encoder_worker.pipeline import EncoderPipeline, encoder_fingerprint
from encoder_worker.types import EncodedImage, Encoder, ImageError

__all__ = (
    "EncodedImage",
    "Encoder",
    "EncoderConfig",
    "EncoderPipeline",
    "ImageError",
    "LocalEncoder",
    "TokensHeader",
    "VisualTokens",
    "encoder_fingerprint",
    "to_embeds",
)
