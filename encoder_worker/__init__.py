"""Image bytes -> visual tokens: decode, fused preprocess, vision tower, saliency, patch
dropping, projector, INT4 payload, micro-batching; and the worker process that runs them for
gateways through Redis.

The gateway codes against `Encoder` / `EncodedImage` / `ImageError` (types.py) and builds a
`LocalEncoder` from an `EncoderConfig`; `EncoderPipeline` is the synchronous core. Where
workers and gateways meet in Redis (keys, stored values) is `storage.py`.

The names below load on first use, so importing a light module (`storage`, `jobs`, `spans`,
`types`) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOMES = {
    "EncodedImage": "types",
    "Encoder": "types",
    "EncoderConfig": "config",
    "EncoderPipeline": "pipeline",
    "ImageError": "types",
    "LocalEncoder": "local_encoder",
    "TokensHeader": "payload",
    "VisualTokens": "payload",
    "encoder_fingerprint": "pipeline",
    "to_embeds": "payload",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'encoder_worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"encoder_worker.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
