"""Image digest -> visual tokens, encoding each image once.

`VisionResolver` is the gateway's one path to visual tokens: read-through the vision cache
(memory, then Redis when configured), else one encode per digest however many callers ask at
once (single-flight), written through to the cache. It also keeps the original bytes in the
image store, so an image can be referenced later by digest and re-encoded when the encoder
changes. It does not decide what a response needs; the chat service asks it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Literal

import structlog

from encoder_worker.storage import pack_encoded, unpack_encoded
from encoder_worker.types import ENCODE_STAGES, EncodedImage, Encoder, ImageError
from gateway.protocol.errors import GatewayError
from gateway.telemetry import NoopTelemetry

__all__ = ("Resolved", "VisionResolver")

log = structlog.get_logger("visiongate.vision")

Source = Literal["memory", "redis", "encoded", "joined"]


@dataclass(slots=True)
class Resolved:
    image: EncodedImage
    source: Source  # where the tokens came from for this call
    wait_ms: float  # wall time this call waited
    encode_started_ns: int | None = None  # epoch ns the encode began (None: from the cache)
    put_ms: float = 0.0  # writing the tokens to the cache


@dataclass(slots=True)
class _Encoded:
    image: EncodedImage
    started_ns: int | None
    put_ms: float


class VisionResolver:
    __slots__ = ("_flight", "_metrics", "cache", "encoder", "encodes", "images")

    def __init__(self, encoder: Encoder, cache, images, metrics=None) -> None:
        from gateway.caching import SingleFlight

        self.encoder = encoder
        self.cache = cache  # gateway.caching.VisionCache
        self.images = images  # gateway.caching.ImageStore
        # an encode runs to the end even if its callers go away: its tokens serve the next turn
        self._flight = SingleFlight(cancel_abandoned=False)
        self._metrics = metrics or NoopTelemetry().metrics
        self.encodes = 0  # images actually run through the encoder by this resolver

    @property
    def fingerprint(self) -> str:
        return self.encoder.fingerprint

    async def add(self, digest: str, data: bytes) -> None:
        """Keep the original bytes so the image can be referenced and re-encoded later."""
        await self.images.put(digest, data)

    async def known(self, digest: str) -> bool:
        """True if the bytes or the visual tokens of this digest are stored."""
        if await self.images.contains(digest):
            return True
        return await self.cache.get(self.fingerprint, digest) is not None

    async def cached(self, digest: str) -> EncodedImage | None:
        hit = await self.cache.get(self.fingerprint, digest)
        if hit is None:
            return None
        try:
            return unpack_encoded(hit.payload)
        except ValueError as exc:
            log.error("vision_cache_entry_corrupt", digest=digest[:12], error=str(exc))
            return None

    async def resolve(self, digest: str, *, traceparent: str | None = None) -> Resolved:
        """The visual tokens of `digest`, encoding it at most once across concurrent callers.

        Raises GatewayError(image_not_found) when neither tokens nor bytes are stored, and
        GatewayError with the encoder's code when the image cannot be encoded.
        """
        t0 = time.perf_counter()
        fingerprint = self.fingerprint
        hit = await self.cache.get(fingerprint, digest)
        if hit is not None:
            try:
                image = unpack_encoded(hit.payload)
            except ValueError as exc:
                log.error("vision_cache_entry_corrupt", digest=digest[:12], error=str(exc))
            else:
                self._lookup(hit.tier, "hit")
                return Resolved(image, hit.tier, (time.perf_counter() - t0) * 1e3)
        self._lookup("none", "miss")
        joined = self._flight.in_flight(digest)
        done = await self._flight.do(digest, lambda: self._encode(digest, traceparent))
        return Resolved(
            done.image,
            "joined" if joined else "encoded",
            (time.perf_counter() - t0) * 1e3,
            done.started_ns,
            done.put_ms,
        )

    async def _encode(self, digest: str, traceparent: str | None) -> _Encoded:
        data = await self.images.get(digest)
        if data is None:
            raise GatewayError(
                "image_not_found", f"no stored image with digest {digest}", param="image_url"
            )
        self.encodes += 1
        started_ns, t0 = time.time_ns(), time.perf_counter()
        try:
            image = await self.encoder.encode(data, traceparent=traceparent)
        except ImageError as exc:
            raise GatewayError(
                exc.code
                if exc.code in ("invalid_image", "image_too_large", "unsupported_image_format")
                else "invalid_image",
                exc.message,
                param="image_url",
            ) from None
        stages = {k: float(v) for k, v in image.timings_ms.items() if k in ENCODE_STAGES}
        # what the stages do not account for is waiting: for a batch to fill, for the worker
        queue_ms = max((time.perf_counter() - t0) * 1e3 - sum(stages.values()), 0.0)
        image.timings_ms = {"queue": round(queue_ms, 3), **image.timings_ms}
        self._metrics.record_encode(
            timings_ms=stages,
            batch_size=int(image.timings_ms.get("batch_size", 1)),
            queue_ms=queue_ms,
            tokens_kept=image.tokens_kept,
            tokens_total=image.tokens_total,
        )
        if getattr(self.encoder, "remote", False):  # the worker stored it and traced its stages
            return _Encoded(image, None, 0.0)
        t_put = time.perf_counter()
        await self.cache.put(self.fingerprint, digest, pack_encoded(image))
        return _Encoded(image, started_ns, (time.perf_counter() - t_put) * 1e3)

    def _lookup(self, tier: str, result: str) -> None:
        self._metrics.record_cache_lookup(cache="vision", tier=tier, result=result)

    def start(self, digest: str) -> asyncio.Task[Resolved]:
        """Pre-encode: begin resolving now, so a later response finds the tokens ready."""
        return asyncio.create_task(self.resolve(digest), name=f"pre-encode {digest[:12]}")
