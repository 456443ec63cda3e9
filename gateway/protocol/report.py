"""visiongate's per-response report, shared by the WebSocket and HTTP wire formats: where the
milliseconds went and what the caches saved."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from msgspec import Struct

if TYPE_CHECKING:
    from gateway.chat.events import Finished

__all__ = ("CacheReport", "Timings")


class Timings(Struct):
    queue_ms: float = 0.0  # waiting for the engine
    encode_ms: float = 0.0  # waiting for image encodes after the request (0 when pre-encoded)
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0  # request received -> first text delta sent
    total_ms: float = 0.0
    # of ttft_ms, the gateway's own part: what neither encode_ms, queue_ms nor prefill_ms (an
    # upstream engine's: the replica's time to first token) account for
    gateway_ms: float = 0.0

    @classmethod
    def of(cls, finished: Finished) -> Timings:
        t = finished.timings
        return cls(*(float(t.get(name, 0.0)) for name in cls.__struct_fields__))


class CacheReport(Struct):
    vision: Literal["hit", "miss", "partial", "none"] = "none"
    vision_hits: int = 0
    vision_misses: int = 0
    kv_tokens_reused: int = 0
    # of kv_tokens_reused, prompt tokens a KV warm-up prefilled while the client was still
    # composing its question (the image's item arrived first)
    kv_warmed_tokens: int = 0
    # with an adaptive visual budget: the keep-ratio cap new images were encoded under when
    # this response ran (lower than the configured one while the TTFT objective burns)
    visual_budget: float | None = None

    @classmethod
    def of(cls, finished: Finished) -> CacheReport:
        return cls(
            vision=finished.vision,
            vision_hits=finished.vision_hits,
            vision_misses=finished.vision_misses,
            kv_tokens_reused=finished.cached_tokens,
            kv_warmed_tokens=finished.kv_warmed_tokens,
            visual_budget=finished.visual_budget,
        )
