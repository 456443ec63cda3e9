"""Per key usage and token limits around each response (`/v1/admin/usage`, metrics): managed
keys' own limits, and the settings' limits of static keys (`TokenMeter.defaults`).

`CountingLimiter` wraps the request rate limiter, whose `acquire(owner)` every transport calls
once per response before anything of it is stored: past the requests limit, it asks the token
limiter (`gateway.policy.token_limits`) whether the key's token windows still have room, so a
key past a token limit is refused (429) before its turn is stored, then counts the request.

`TokenMeter.open(owner)` is the chat layer's hook for one response of a key under limits or
under the cap on responses in flight (`Metered`): `admit(estimate, output)` counts the
estimated input tokens and reserves the most output the response may write (its `max_tokens`
x `n`, or the gateway's cap) against the key's limits in one atomic step, and takes one of the
key's slots; that is what keeps concurrent responses within a limit (plus one response's
reservation), on every replica. It returns the refusal if the key has no room left
(`rate_limited`) or no slot (`concurrency_limited`: `TokenMeter.concurrency`, a managed key's
own `max_concurrent`, else the `max_concurrent_responses_per_key` setting). `streamed(n)`
counts output tokens as they go out; only those past the reservation are written (every
`CHARGE_EVERY`), and a long answer renews its slot's lease. `finish(usage)`, once, corrects
the estimate to the real input count, gives back the unused part of the reservation (both in
the windows of the admission: `TokenLimiter.charge`'s `since`) and the slot, and records the
usage: in the key store (requests, input, cached, output and image tokens, encode ms) and as
metrics labelled by key (`gateway.telemetry`: at most `KEY_LABELS` key ids a process, the rest
"other"). `close()` is the same for a response that ends without a `finish` (an error, a
cancel, a client gone): it counts what streamed. One that failed after text went out (an end
with no counts) keeps its estimate and what streamed: only a response refused before any
output gives its estimate back. Neither gives anything back twice.

Counts are written in the background: a store that is slow or down never delays a response;
a count lost that way is logged. At most `MAX_PENDING` writes are in flight; past that they are
dropped (and logged), not queued, except a key's token charges: those are owed (one sum a key,
its corrections that lower a count left out) and written with that key's next charge, or at
shutdown (`aclose`), so a flood of streams or a slow Redis never lets tokens go uncounted.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from gateway.policy.rate_headers import Allowance, note_tokens
from gateway.policy.token_limits import TokenLimits, refusal
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.policy.auth import Authenticator
    from gateway.policy.ratelimit import RateLimiter
    from gateway.policy.token_limits import TokenLimiter
    from gateway.telemetry import GatewayMetrics

__all__ = ("CHARGE_EVERY", "CountingLimiter", "Metered", "TokenMeter", "TokenUsage")

log = structlog.get_logger("visiongate.key_usage")
MAX_PENDING = 1000  # writes in flight
CHARGE_EVERY = 16  # streamed output tokens written to the counters at a time
RENEW_EVERY_S = 60.0  # a streaming response's slot renewed this often (LIVE_LEASE_S: 300 s)
GIVE_BACK_WAIT_S = 0.5  # the most an admission waits for its key's give-backs under way
CONCURRENCY_RETRY_S = 1.0  # Retry-After of a key with every slot taken: one may free any time
KEY_LABELS = 100  # managed key ids a process labels metrics with; later ones are "other"


class TokenUsage(msgspec.Struct, frozen=True, kw_only=True):
    """What one finished response used."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    image_tokens: int = 0
    encode_ms: float = 0.0


class _Background:
    """Writes that must not delay a response: bounded, awaited on close."""

    __slots__ = ("_by_owner", "_pending")

    def __init__(self) -> None:
        self._pending: set[asyncio.Task[None]] = set()
        self._by_owner: dict[str, set[asyncio.Task[None]]] = {}

    def run(self, what: str, owner: str, work: Coroutine[Any, Any, None]) -> bool:
        """Start `work`; False (and `work` closed) when too many writes are in flight."""
        if len(self._pending) >= MAX_PENDING:
            work.close()
            log.warning("key_usage_dropped", key_id=owner, what=what)
            return False

        async def guarded() -> None:
            try:
                async with asyncio.timeout(2.5):
                    await work
            except Exception as exc:
                log.warning("key_usage_lost", key_id=owner, what=what, error=type(exc).__name__)

        task = asyncio.create_task(guarded(), name=what)
        self._pending.add(task)
        mine = self._by_owner.setdefault(owner, set())
        mine.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self._pending.discard(task)
            mine.discard(task)
            if not mine and self._by_owner.get(owner) is mine:
                del self._by_owner[owner]

        task.add_done_callback(done)
        return True

    async def settled(self, owner: str, timeout_s: float = 1.0, what: str | None = None) -> None:
        """Wait (at most `timeout_s`) for the writes of `owner` under way now (those of kind
        `what` only, when given)."""
        tasks = [t for t in self._by_owner.get(owner, ()) if what is None or t.get_name() == what]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def drain(self) -> None:
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)


class TokenMeter:
    """Token limits and usage of managed keys (`open` per response), over one token limiter;
    `defaults` are the limits of every other owner (static keys, or "anonymous" on a gateway
    without keys: the `input_tokens_per_minute` / `output_tokens_per_minute` settings), whose
    usage is not kept in the key store (it lists managed keys only) but counted in metrics.
    `concurrency` caps the responses in flight of a key (a managed key's `max_concurrent`
    overrides it; 0: no cap); callers without a key ("anonymous") have none."""

    __slots__ = (
        "_background",
        "_labelled",
        "_owed",
        "_owed_slots",
        "auth",
        "concurrency",
        "defaults",
        "limiter",
        "metrics",
    )

    def __init__(
        self,
        limiter: TokenLimiter,
        auth: Authenticator,
        metrics: GatewayMetrics | None = None,
        *,
        defaults: TokenLimits | None = None,
        concurrency: int = 0,
    ) -> None:
        self.limiter = limiter
        self.auth = auth
        self.metrics = metrics
        self.defaults = defaults
        self.concurrency = concurrency
        self._background = _Background()
        self._labelled: set[str] = set()
        # owner -> (input, output) tokens whose charge found no room in flight, not yet written
        self._owed: dict[str, tuple[int, int]] = {}
        # owner -> slots whose release found no room in flight, given back with its next charge
        self._owed_slots: dict[str, list[str]] = {}

    def limits(self, owner: str) -> TokenLimits | None:
        record = self.auth.limits_of(owner)
        return TokenLimits.of(record) if record is not None else self.defaults

    def _managed(self, owner: str) -> bool:
        return self.auth.limits_of(owner) is not None

    def cap(self, owner: str) -> int:
        """The most responses `owner` may have in flight at once (0: no cap)."""
        if owner == "anonymous":
            return 0
        record = self.auth.limits_of(owner)
        own = getattr(record, "max_concurrent", None) if record is not None else None
        return self.concurrency if own is None else own

    def key_label(self, owner: str) -> str:
        """The `key` label of a key's metrics: a managed key's id, for the first `KEY_LABELS`
        ids this process sees, else "other" (a bounded set of series); a static key's
        "static-<n>" (`Authenticator.static_label`); "anonymous" on a gateway without keys."""
        static = self.auth.static_label(owner)
        if static is not None or owner == "anonymous":
            return static or owner
        if owner in self._labelled:
            return owner
        if len(self._labelled) < KEY_LABELS:
            self._labelled.add(owner)
            return owner
        return "other"

    async def check(self, owner: str, *, refuse: bool = True) -> Allowance | None:
        """Refuse (rate_limited) a key with no token room left; counts nothing. With
        `refuse=False` only note what is left (for the headers of a refusal of another kind)."""
        limits = self.limits(owner)
        if limits is None:
            return None
        used = await self.limiter.admit(owner, limits, 0)
        if used is None:
            return None
        if not used.admitted and refuse:
            self._refused(owner)
            raise refusal(limits, used)
        allowance = used.tightest(limits)
        note_tokens(allowance)
        return allowance

    async def peek(self, owner: str) -> Allowance | None:
        """The tokens left under the key's tightest limit (None: no limit, or unreadable)."""
        limits = self.limits(owner)
        if limits is None:
            return None
        await self._background.settled(owner)  # the counts of the response that just ended
        used = await self.limiter.admit(owner, limits, 0)
        return used.tightest(limits) if used is not None else None

    def open(self, owner: str) -> Metered | None:
        """The meter of one response of `owner`; None for an owner neither managed, nor under
        the default limits, nor under a cap on responses in flight."""
        if not self._managed(owner) and self.defaults is None and not self.cap(owner):
            return None
        return Metered(self, owner, self.limits(owner), self.cap(owner))

    def charge(
        self,
        owner: str,
        limits: TokenLimits | None,
        *,
        input: int,
        output: int,
        since: float | None = None,
        release: str = "",
        what: str = "tokens",
    ) -> None:
        """Count tokens in the background (`since`: the admission's windows; see
        `TokenLimiter.charge`), giving back the slot of `release` with them. A charge that
        finds too many writes in flight is owed (what raises a count, and the slot) and
        written with the key's next one. `what` names it for `_Background.settled`."""
        if limits is None:
            if not release:
                return
            limits = TokenLimits()
        if not (input or output or release):
            return
        owed_in, owed_out = self._owed.pop(owner, (0, 0))
        slots = self._owed_slots.pop(owner, [])

        async def work() -> None:
            if owed_in or owed_out:  # in the windows of now: it counts late, never less
                await self.limiter.charge(owner, limits, input=owed_in, output=owed_out)
            for slot in slots:
                await self.limiter.charge(owner, limits, release=slot)
            await self.limiter.charge(
                owner, limits, input=input, output=output, since=since, release=release
            )

        if not self._background.run(what, owner, work()):
            self._owed[owner] = (owed_in + max(input, 0), owed_out + max(output, 0))
            if release or slots:
                self._owed_slots[owner] = [*slots, *([release] if release else [])]

    def renew(self, owner: str, response: str) -> None:
        self._background.run("slot", owner, self.limiter.renew(owner, response))

    def record(self, owner: str, usage: TokenUsage) -> None:
        store = self.auth.store
        if store is not None and self._managed(owner):
            work = store.count_usage(
                owner,
                input_tokens=usage.input_tokens,
                cached_tokens=usage.cached_tokens,
                output_tokens=usage.output_tokens,
                image_tokens=usage.image_tokens,
                encode_ms=round(usage.encode_ms),
            )
            self._background.run("usage", owner, work)
        if self.metrics is not None:
            self.metrics.record_key_usage(
                key=self.key_label(owner),
                input_tokens=usage.input_tokens,
                cached_tokens=usage.cached_tokens,
                output_tokens=usage.output_tokens,
                image_tokens=usage.image_tokens,
                encode_s=usage.encode_ms / 1000.0,
            )

    def _uncount_request(self, owner: str) -> None:
        """A response refused here, after `CountingLimiter.acquire` counted its request (another
        response took the last room in between): its key's `requests` count it no more."""
        store = self.auth.store
        if store is not None and self._managed(owner):
            self._background.run("requests", owner, store.count_usage(owner, requests=-1))

    def _refused(self, owner: str, limit: str = "tokens") -> None:
        if self.metrics is not None:
            self.metrics.record_key_refusal(key=self.key_label(owner), limit=limit)

    async def aclose(self) -> None:
        await self._background.drain()
        await self._settle_owed()
        await self.limiter.aclose()

    async def _settle_owed(self, timeout_s: float = 2.5) -> None:
        """Write what is owed (charges that found no room in flight) before the limiter
        closes, so that a shutdown under a flood loses no tokens; what cannot be written in
        `timeout_s` is logged."""
        owed, self._owed = self._owed, {}
        if not owed:
            return

        async def write(owner: str, input: int, output: int) -> None:
            limits = self.limits(owner)
            if limits is not None:
                await self.limiter.charge(owner, limits, input=input, output=output)

        writes = [asyncio.ensure_future(write(o, i, out)) for o, (i, out) in owed.items()]
        _, late = await asyncio.wait(writes, timeout=timeout_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        for (owner, counts), task in zip(owed.items(), writes, strict=True):
            failed = task in late or task.exception() is not None
            if failed:
                log.warning("key_usage_lost", key_id=owner, what="tokens", tokens=sum(counts))


class Metered:
    """One response of a key under limits or a cap: its admission (tokens counted and
    reserved, a slot taken), its streamed tokens, its end (the unused part given back, once)."""

    __slots__ = (
        "_admitted",
        "_done",
        "_out_charged",
        "_out_reserved",
        "_out_seen",
        "_renewed",
        "_reserved",
        "_since",
        "cap",
        "limits",
        "meter",
        "owner",
        "response",
    )

    def __init__(
        self, meter: TokenMeter, owner: str, limits: TokenLimits | None, cap: int = 0
    ) -> None:
        self.meter, self.owner, self.limits, self.cap = meter, owner, limits, cap
        self.response = secrets.token_hex(8)  # its slot's name among the key's
        self._reserved = 0  # input tokens counted at admission (the estimate)
        self._out_reserved = 0  # output tokens counted at admission (the reservation)
        self._out_seen = 0
        self._out_charged = 0  # output written past the reservation
        self._since: float | None = None  # when the admission was counted (its windows)
        self._admitted = False  # a slot is held and the counts are the meter's to correct
        self._renewed = 0.0
        self._done = False

    async def admit(self, estimate: int, output: int = 0) -> GatewayError | None:
        """Count the estimate, reserve `output` tokens and take a slot; the refusal when the
        key has no room or no slot left."""
        if self.limits is None and not self.cap:
            return None
        limits = self.limits or TokenLimits()
        estimate = max(estimate, 1) if self.limits is not None else 0
        output = max(output, 0) if self.limits is not None else 0
        # what the key's last responses here give back lands first: a client's next request
        # after a short answer finds its room (and its slot) again
        await self.settled()
        used = await self.meter.limiter.admit(
            self.owner,
            limits,
            estimate,
            output=output,
            response=self.response,
            concurrency=self.cap,
        )
        if used is None:  # the counters cannot be read: let through, nothing was counted
            return None
        if not used.admitted:
            self.meter._refused(self.owner, "concurrency" if used.busy else "tokens")
            self.meter._uncount_request(self.owner)
            self._done = True  # refused: nothing was counted, nothing is recorded
            if used.busy:
                return GatewayError(
                    "concurrency_limited",
                    f"this API key has {used.live} responses in flight, as many as it may have "
                    "at once; retry when one has ended",
                    retry_after_s=CONCURRENCY_RETRY_S,
                )
            return refusal(limits, used)
        self._admitted = True
        self._reserved, self._out_reserved, self._since = estimate, output, used.at
        self._renewed = time.monotonic()
        if self.limits is not None:
            note_tokens(used.tightest(self.limits))
        return None

    def streamed(self, tokens: int = 1) -> None:
        self._out_seen += tokens
        past = self._out_seen - self._out_reserved - self._out_charged
        if past >= CHARGE_EVERY:
            self._out_charged += past
            self.meter.charge(self.owner, self.limits, input=0, output=past)
        if self._admitted and self.cap and time.monotonic() - self._renewed >= RENEW_EVERY_S:
            self._renewed = time.monotonic()
            self.meter.renew(self.owner, self.response)

    def finish(self, usage: TokenUsage) -> None:
        """The response ended with this usage: counters corrected, the unused reservation and
        the slot given back, usage recorded (once)."""
        if self._done:
            return
        self._done = True
        if self._out_seen and not usage.input_tokens:  # failed after text went out: it cost
            usage = msgspec.structs.replace(usage, input_tokens=self._reserved)
        if usage.output_tokens < self._out_seen:
            usage = msgspec.structs.replace(usage, output_tokens=self._out_seen)
        # output past the reservation counts now; the unused reservation goes back to the
        # admission's windows, with the estimate's correction
        past = max(usage.output_tokens - self._out_reserved, 0) - self._out_charged
        unused = max(self._out_reserved - usage.output_tokens, 0)
        if past:
            self.meter.charge(self.owner, self.limits, input=0, output=past)
        counted = self.limits is not None  # else only a slot is held
        self.meter.charge(
            self.owner,
            self.limits,
            input=usage.input_tokens - self._reserved if counted else 0,
            output=-unused,
            since=self._since,
            # also when its admission's answer never came back (cancelled on the way): a slot
            # it may hold is freed (freeing one not held is no error); nothing else is
            release=self.response if self.cap else "",
            what="give_back",
        )
        self.meter.record(self.owner, usage)

    async def settled(self) -> None:
        """Wait (at most `GIVE_BACK_WAIT_S`) until what the key's ended responses give back
        here is written."""
        await self.meter._background.settled(self.owner, GIVE_BACK_WAIT_S, what="give_back")

    def close(self) -> None:
        """The response is over; one that never finished counts what it streamed."""
        if self._done:
            return
        self.finish(TokenUsage(input_tokens=self._reserved, output_tokens=self._out_seen))


class CountingLimiter:
    """The request limiter, then the token limits' room, then the request counted."""

    __slots__ = ("_background", "auth", "inner", "tokens")

    def __init__(
        self, inner: RateLimiter, auth: Authenticator, tokens: TokenMeter | None = None
    ) -> None:
        self.inner = inner
        self.auth = auth
        self.tokens = tokens
        self._background = _Background()

    async def acquire(self, owner: str) -> Allowance | None:
        try:
            allowance = await self.inner.acquire(owner)
        except GatewayError:
            if self.tokens is not None and self.tokens.limits(owner) is not None:
                if self.auth.limits_of(owner) is not None:
                    self.tokens._refused(owner, "requests")
                await self.tokens.check(owner, refuse=False)  # the 429's token headers
            raise
        if self.tokens is not None:
            await self.tokens.check(owner)
        store = self.auth.store
        if store is None or self.auth.limits_of(owner) is None:
            return allowance
        self._background.run("requests", owner, store.count_usage(owner, requests=1))
        return allowance

    async def peek(self, owner: str) -> Allowance | None:
        return await self.inner.peek(owner)

    async def rate_limits(self, owner: str) -> tuple[Allowance | None, Allowance | None]:
        """(requests, tokens) left for `owner` now, for the Realtime `rate_limits.updated`."""
        tokens = await self.tokens.peek(owner) if self.tokens is not None else None
        return await self.inner.peek(owner), tokens

    async def aclose(self) -> None:
        await self._background.drain()
        if self.tokens is not None:
            await self.tokens.aclose()
        await self.inner.aclose()
