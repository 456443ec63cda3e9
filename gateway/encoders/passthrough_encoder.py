"""The encoder of a gateway whose engine encodes images itself (an upstream sent data URLs).

Such a gateway still takes, checks, stores and references images exactly as any other (the
session, the ownership rules, `image.encoded` events, the `visiongate:sha256:` references); it
only makes no visual tokens: the upstream runs its own vision tower on the bytes, keyed by the
gateway's content id. So nothing is encoded here, nothing is cached, and no tower is loaded.
"""

from __future__ import annotations

from encoder_worker.types import EncodedImage
from gateway.chat.image_input import digest_of

__all__ = ("PassThroughEncoder",)


class PassThroughEncoder:
    """`Encoder` that makes no tokens: each "encode" reports 0 tokens and takes no time."""

    remote = False

    def __init__(self, model_id: str, hidden_size: int = 0) -> None:
        # the tokens (none) of this gateway are the upstream model's business: one name per model
        self.fingerprint = f"upstream-bytes:{model_id}"
        self.hidden_size = hidden_size

    async def start(self) -> None:
        return None

    async def encode(
        self, data: bytes, *, traceparent: str | None = None, owner: str | None = None
    ) -> EncodedImage:
        return EncodedImage(
            digest=digest_of(data),
            fingerprint=self.fingerprint,
            tokens_kept=0,
            tokens_total=0,
            hidden_size=self.hidden_size,
            payload=None,
            timings_ms={},
        )

    async def queue_depth(self) -> int:
        return 0

    async def aclose(self) -> None:
        return None
