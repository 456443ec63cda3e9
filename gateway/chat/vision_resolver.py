"""Image digest -> visual tokens, encoding each image once, private to the API key that sent it.

`VisionResolver` is the gateway's one path to visual tokens: read-through the vision cache
(memory, then Redis when configured), else one encode per image however many callers ask at
once (single-flight), written through to the cache. It also keeps the original bytes in the
image store, so an image can be referenced later by digest and re-encoded when the encoder
changes. It does not decide what a response needs; the chat service asks it.

Every call names the owner: the caller's owner id (`gateway.policy.auth`; "anonymous" without API
keys). Privacy rests on three rules:

- An owner may use a digest only if it sent those bytes itself (the image store's ownership
  index, `gateway.caching.ownership`). Any other digest is `image_not_found`, answered on the
  same path as an unknown one: the index is asked before any cache is touched.
- The encode cache underneath stays shared by content (`share_across_keys`, the default): an
  image two keys both sent is encoded once. A key's first use of tokens that another key's
  encode produced is reported as its own encode (`source` "encoded", a miss, with the original
  encode's stage timings) and delivered no sooner than those stages took after the call began,
  so neither the fields nor the timing tell it from a real encode; later uses are its hits.
- With `share_across_keys=False` nothing is shared: the image store and the vision cache name
  an image `scoped_digest(owner, digest)`, and every key encodes its own images.

Encodes are bounded: `admit` reserves slots for the images an owner is about to have encoded,
per owner (`max_pending_per_key`) and per any further holder the caller passes (a WebSocket
connection's `EncodeQuota`), and refuses past a cap with `rate_limited` before anything is
stored. The counts are this process's (per replica). The owner also travels to the encoder, so
an encoder that shares its batches does so fairly between keys.

A pre-encode (`start`) runs before the response that will use its tokens exists, so it is
traced as `image.preencode`, the root of a trace of its own (with the item and session it came
with); its traceparent goes with the encode job, so a remote worker's spans land beneath it.
The `Resolved` it returns names that span (`preencode`), and the response's `image.resolve`
links to it: the encode is found from the response's trace by following the link.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanContext, Status, StatusCode

from encoder_worker.storage import pack_encoded, scoped_digest, unpack_encoded
from encoder_worker.types import ENCODE_STAGES, EncodedImage, Encoder, ImageError
from gateway.caching.image_store import is_sha256_hex
from gateway.caching.ownership import MemoryOwnerIndex, OwnerIndex
from gateway.protocol.errors import GatewayError
from gateway.telemetry import ATTR, SPAN, NoopTelemetry, traceparent

__all__ = ("EncodePermit", "EncodeQuota", "Resolved", "VisionResolver", "encode_ms")

log = structlog.get_logger("visiongate.vision")

Source = Literal["memory", "redis", "encoded", "joined"]

# seconds a refused client is asked to wait: encodes take tens to hundreds of milliseconds
RETRY_AFTER_S = 1.0


def encode_ms(image: EncodedImage) -> float:
    """What the encode of `image` took, stage by stage (waiting for a batch excluded)."""
    return sum(float(v) for k, v in image.timings_ms.items() if k in ENCODE_STAGES)


@dataclass(slots=True)
class Resolved:
    image: EncodedImage
    source: Source  # where the tokens came from for this call, as the owner is told
    wait_ms: float  # wall time this call waited
    encode_started_ns: int | None = None  # epoch ns the encode began (None: from the cache)
    put_ms: float = 0.0  # writing the tokens to the cache
    # the tokens came from another key's encode (reported and timed as this key's own)
    borrowed: bool = False
    # the `image.preencode` span of the pre-encode that resolved them (`VisionResolver.start`)
    preencode: SpanContext | None = None


@dataclass(slots=True)
class _Encoded:
    image: EncodedImage
    started_ns: int | None
    put_ms: float
    owner: str  # whose call ran the encode


class EncodeQuota:
    """Encodes admitted and not yet finished for one holder (an API key, a connection), under
    `cap` (0: no cap). `holder` names it in the refusal ("this connection")."""

    __slots__ = ("cap", "holder", "pending")

    def __init__(self, cap: int, holder: str) -> None:
        if cap < 0:
            raise ValueError(f"cap must be >= 0, got {cap}")
        self.cap = cap
        self.holder = holder
        self.pending = 0

    def refuses(self, n: int) -> bool:
        return self.cap > 0 and n > 0 and self.pending + n > self.cap


class EncodePermit:
    """Slots `admit` reserved, one per image. `attach(digest, task)` hands an image's slot to
    the task that resolves it (freed when the task ends); `close()` frees the slots never
    attached. Closing twice, or attaching an image that has no slot, does nothing."""

    __slots__ = ("_digests", "_on_release", "_quotas")

    def __init__(
        self, quotas: Sequence[EncodeQuota], digests: set[str], on_release: Callable[[], None]
    ) -> None:
        self._quotas = tuple(quotas)
        self._digests = digests
        self._on_release = on_release

    @property
    def slots(self) -> int:
        """Slots still held and not attached."""
        return len(self._digests)

    def attach(self, digest: str, task: asyncio.Future[object]) -> None:
        if digest not in self._digests:
            return
        self._digests.discard(digest)
        task.add_done_callback(lambda _: self._release(1))

    def close(self) -> None:
        n, self._digests = len(self._digests), set()
        self._release(n)

    def _release(self, n: int) -> None:
        if n <= 0:
            return
        for quota in self._quotas:
            quota.pending -= n
        self._on_release()


def _not_found(digest: str) -> GatewayError:
    # one message for an unknown digest and for another key's: the two must read the same
    return GatewayError(
        "image_not_found", f"no stored image with digest {digest}", param="image_url"
    )


class VisionResolver:
    __slots__ = (
        "_flight",
        "_metrics",
        "_quotas",
        "_tracer",
        "cache",
        "encoder",
        "encodes",
        "images",
        "max_pending_per_key",
        "owners",
        "share_across_keys",
    )

    def __init__(
        self,
        encoder: Encoder,
        cache,
        images,
        metrics=None,
        *,
        owners: OwnerIndex | None = None,
        share_across_keys: bool = True,
        max_pending_per_key: int = 0,
        tracer: trace.Tracer | None = None,
    ) -> None:
        """`cache`: a `gateway.caching.VisionCache`; `images`: an `ImageStore`, whose ownership
        index is used unless `owners` is given. `max_pending_per_key`: 0 is no cap. `tracer`
        records pre-encodes (none without it)."""
        from gateway.caching import SingleFlight

        self.encoder = encoder
        self.cache = cache
        self.images = images
        self.owners: OwnerIndex = owners or getattr(images, "owners", None) or MemoryOwnerIndex()
        self.share_across_keys = share_across_keys
        self.max_pending_per_key = max_pending_per_key
        # an encode runs to the end even if its callers go away: its tokens serve the next turn
        self._flight = SingleFlight(cancel_abandoned=False)
        self._metrics = metrics or NoopTelemetry().metrics
        self._tracer: trace.Tracer = tracer or trace.NoOpTracer()
        self._quotas: dict[str, EncodeQuota] = {}  # owners with encodes admitted
        self.encodes = 0  # images actually run through the encoder by this resolver

    @property
    def fingerprint(self) -> str:
        return self.encoder.fingerprint

    def _fingerprints(self) -> tuple[str, ...]:
        """The fingerprints an image's tokens may be cached under: the encoder's, and with an
        adaptive visual budget each smaller budget's after it."""
        return getattr(self.encoder, "fingerprints", None) or (self.fingerprint,)

    async def _cached(self, name: str):
        """The vision-cache entry of `name` under the first fingerprint that has one."""
        for fingerprint in self._fingerprints():
            hit = await self.cache.get(fingerprint, name)
            if hit is not None:
                return hit
        return None

    def _scope(self, owner: str) -> str | None:
        return None if self.share_across_keys else owner

    def _name(self, owner: str, digest: str) -> str:
        """What the caches call this owner's image: its digest, or a per-owner name."""
        return digest if self.share_across_keys else scoped_digest(owner, digest)

    # ------------------------------------------------------------ ownership

    async def add(self, owner: str, digest: str, data: bytes) -> None:
        """Keep the original bytes so `owner` can reference and re-encode the image later."""
        await self.images.put(digest, data, scope=self._scope(owner))
        await self.owners.add(owner, digest)

    async def known(self, owner: str, digest: str) -> bool:
        """True if `owner` sent this image and its bytes or its visual tokens are stored."""
        if not is_sha256_hex(digest) or await self.owners.state(owner, digest) is None:
            return False
        name = self._name(owner, digest)
        if await self.images.contains(digest, scope=self._scope(owner)):
            return True
        return await self._cached(name) is not None

    async def cached(self, owner: str, digest: str) -> EncodedImage | None:
        """The tokens, if `owner` has been given them before and they are still cached (a key
        that has not is told nothing about another key's encode)."""
        if not is_sha256_hex(digest) or await self.owners.state(owner, digest) != "used":
            return None
        hit = await self._cached(self._name(owner, digest))
        return None if hit is None else self._unpack(hit.payload, digest)

    async def original(self, owner: str, digest: str) -> bytes:
        """The bytes `owner` sent as `digest` (for an engine that encodes images itself).
        GatewayError(image_not_found) when `owner` never sent them or they are no longer
        stored, answered on the same path for both."""
        if not is_sha256_hex(digest) or await self.owners.state(owner, digest) is None:
            raise _not_found(digest)
        data = await self.images.get(digest, scope=self._scope(owner))
        if data is None:
            raise _not_found(digest)
        return data

    # ------------------------------------------------------------ admission

    async def admit(
        self, owner: str, digests: Iterable[str], *, also: Sequence[EncodeQuota] = ()
    ) -> EncodePermit:
        """Reserve a slot for each image of `digests` whose tokens `owner` has not been given
        yet (the ones that will be encoded, or timed as if). GatewayError(rate_limited) when a
        quota (each of `also`, then the owner's) would go past its cap; nothing is reserved."""
        fresh = {d for d in set(digests) if await self.owners.state(owner, d) != "used"}
        # no await from here on: the check and the reservation are one step
        quota = self._quotas.get(owner) or EncodeQuota(self.max_pending_per_key, "this API key")
        quotas = (*also, quota)
        for q in quotas:
            if q.refuses(len(fresh)):
                raise GatewayError(
                    "rate_limited",
                    f"{q.holder} has {q.pending} image encodes pending and may have at most "
                    f"{q.cap}; {len(fresh)} more were asked for; retry when some finish",
                    retry_after_s=RETRY_AFTER_S,
                )
        for q in quotas:
            q.pending += len(fresh)
        if fresh:
            self._quotas[owner] = quota
        return EncodePermit(quotas, fresh, lambda: self._forget_idle(owner))

    def pending(self, owner: str) -> int:
        """Encodes admitted for `owner` and not finished."""
        quota = self._quotas.get(owner)
        return quota.pending if quota is not None else 0

    def _forget_idle(self, owner: str) -> None:
        quota = self._quotas.get(owner)
        if quota is not None and quota.pending <= 0:
            del self._quotas[owner]

    # ------------------------------------------------------------ tokens

    async def resolve(self, owner: str, digest: str, *, traceparent: str | None = None) -> Resolved:
        """The visual tokens of `owner`'s image `digest`, encoding it at most once across
        concurrent callers.

        Raises GatewayError(image_not_found) when `owner` never sent it or neither tokens nor
        bytes are stored, and GatewayError with the encoder's code when it cannot be encoded.
        """
        t0 = time.perf_counter()
        held = await self.owners.state(owner, digest) if is_sha256_hex(digest) else None
        if held is None:
            raise _not_found(digest)
        name = self._name(owner, digest)
        hit = await self._cached(name)
        image = None if hit is None else self._unpack(hit.payload, digest)
        if hit is not None and image is not None:
            self._lookup(hit.tier, "hit")
            if held == "used":
                return Resolved(image, hit.tier, _ms(t0))
            # tokens another key's encode made (or this key's, forgotten since): this key is
            # told what an encode of its own would have told it, no sooner
            await _as_long_as(image, t0)
            await self.owners.mark_used(owner, digest)
            return Resolved(image, "encoded", _ms(t0), borrowed=True)
        self._lookup("none", "miss")
        joined = self._flight.in_flight(name)
        done = await self._flight.do(name, lambda: self._encode(owner, digest, name, traceparent))
        borrowed = done.owner != owner and held != "used"
        if borrowed:
            await _as_long_as(done.image, t0)
            await self.owners.mark_used(owner, digest)
        return Resolved(
            done.image,
            "joined" if joined else "encoded",
            _ms(t0),
            None if borrowed else done.started_ns,
            0.0 if borrowed else done.put_ms,
            borrowed=borrowed,
        )

    def start(
        self,
        owner: str,
        digest: str,
        *,
        item_id: str | None = None,
        session_id: str | None = None,
    ) -> asyncio.Task[Resolved]:
        """Pre-encode: begin resolving now, so a later response finds the tokens ready. Traced
        as `image.preencode` (naming `item_id` and `session_id`, the item and session the image
        came with), whose span context the result carries as `preencode`."""
        attributes: dict[str, str] = {ATTR.IMAGE_DIGEST: digest[:12]}
        if item_id:
            attributes[ATTR.ITEM_ID] = item_id
        if session_id:
            attributes[ATTR.SESSION_ID] = session_id
        return asyncio.create_task(
            self._preencode(owner, digest, attributes, time.time_ns()),
            name=f"pre-encode {digest[:12]}",
        )

    async def _preencode(
        self, owner: str, digest: str, attributes: dict[str, str], started_ns: int
    ) -> Resolved:
        # no parent: the response that will use the tokens does not exist yet (it links here)
        span = self._tracer.start_span(
            SPAN.IMAGE_PREENCODE, context=Context(), attributes=attributes, start_time=started_ns
        )
        try:
            resolved = await self.resolve(owner, digest, traceparent=traceparent(span))
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, str(exc) or type(exc).__name__))
            span.set_attribute(ATTR.ERROR_TYPE, getattr(exc, "code", type(exc).__name__))
            span.end()
            raise
        hit = resolved.source in ("memory", "redis")
        span.set_attributes(
            {
                ATTR.CACHE_HIT: hit,
                ATTR.CACHE_TIER: resolved.source if hit else "none",
                ATTR.TOKENS_KEPT: resolved.image.tokens_kept,
                ATTR.TOKENS_TOTAL: resolved.image.tokens_total,
            }
        )
        span.end()
        context = span.get_span_context()
        if context.is_valid:
            resolved.preencode = context
        return resolved

    async def _encode(
        self, owner: str, digest: str, name: str, traceparent: str | None
    ) -> _Encoded:
        data = await self.images.get(digest, scope=self._scope(owner))
        if data is None:
            raise _not_found(digest)
        self.encodes += 1
        started_ns, t0 = time.time_ns(), time.perf_counter()
        try:
            image = await self.encoder.encode(data, traceparent=traceparent, owner=owner)
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
        # a remote worker stored the tokens under the digest and traced its stages; a per-owner
        # name is this gateway's to write
        # an encoder that makes no tokens (the engine encodes the bytes itself) leaves none
        if (getattr(self.encoder, "remote", False) and name == digest) or not image.tokens_total:
            done = _Encoded(image, None, 0.0, owner)
        else:
            t_put = time.perf_counter()
            # under the fingerprint of the budget it was encoded with (`gateway.chat.visual_budget`)
            fingerprint = image.fingerprint if image.fingerprint in self._fingerprints() else None
            await self.cache.put(fingerprint or self.fingerprint, name, pack_encoded(image))
            done = _Encoded(image, started_ns, (time.perf_counter() - t_put) * 1e3, owner)
        # the tokens are the encoding owner's own, even if every caller has gone away
        await self.owners.mark_used(owner, digest)
        return done

    def _unpack(self, payload: bytes, digest: str) -> EncodedImage | None:
        try:
            return unpack_encoded(payload)
        except ValueError as exc:
            log.error("vision_cache_entry_corrupt", digest=digest[:12], error=str(exc))
            return None

    def _lookup(self, tier: str, result: str) -> None:
        self._metrics.record_cache_lookup(cache="vision", tier=tier, result=result)


async def _as_long_as(image: EncodedImage, t0: float) -> None:
    """Wait until the original encode's stage time has passed since `t0`."""
    remaining = encode_ms(image) / 1e3 - (time.perf_counter() - t0)
    if remaining > 0:
        await asyncio.sleep(remaining)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3
