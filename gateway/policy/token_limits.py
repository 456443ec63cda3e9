"""Per managed key token limits: input and output tokens per minute, and a token budget per
day or month (`KeyRecord.input_tpm`, `output_tpm`, `budget_tokens` + `budget_period`).

Counting. Each key has three counters in fixed windows: input tokens this minute, output tokens
this minute, and tokens (input + output) this budget period (the UTC day, or the UTC calendar
month). A window starts empty when the clock enters it.

Admission (`admit(owner, limits, add)`): a response is let in while every limit of its key
still has room (used < limit); once in, `add` (its input tokens as estimated before anything
runs) is counted at once, in the same atomic step. So concurrent responses of one key, on any
number of replicas, never pass together on the same room: what is admitted stays within the
limit plus the one response that took the last room. Output tokens are counted as they stream
(`charge`), and a response's estimate is corrected to its real input count when it ends, so
the counters hold what was really used; neither ever cuts an answer that is under way. The
correction counts in the windows the estimate went to (`since`, the admission's `Used.at`): in
a window that has ended since, it is dropped, never put on the next window (a high estimate
given back there would wipe what the key used in the new minute). No counter goes below 0.
Refused: GatewayError("rate_limited") with `retry_after_s`, the seconds until the window
that refused starts again (HTTP 429 and Retry-After).

Two counters with one contract: `MemoryTokenLimiter` (one replica's view) and
`RedisTokenLimiter`, whose counters for one key are the fields of one hash,
`vg:tokens:{<key id>}` (fields `in`, `out`, `b` and the window each belongs to, `in:w`, `out:w`,
`b:w`), changed by single-key scripts: one Redis or any Redis Cluster node. While Redis is
unreachable the limiter lets responses through (and logs it) like the request limiter.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

import msgspec
import structlog

from gateway.policy.rate_headers import Allowance, note_tokens
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.policy.key_store import KeyRecord

__all__ = (
    "MemoryTokenLimiter",
    "RedisTokenLimiter",
    "TokenLimiter",
    "TokenLimits",
    "Used",
    "make_token_limiter",
    "refusal",
    "windows",
)

log = structlog.get_logger("visiongate.ratelimit")

Kind = Literal["input_tpm", "output_tpm", "budget"]


class TokenLimits(msgspec.Struct, frozen=True, kw_only=True):
    """A key's token limits; None: that limit is off."""

    input_tpm: int | None = None
    output_tpm: int | None = None
    budget_tokens: int | None = None
    budget_period: Literal["day", "month"] | None = None

    @classmethod
    def of(cls, record: KeyRecord | None) -> TokenLimits | None:
        """The record's limits; None when it sets none."""
        if record is None:
            return None
        budget = record.budget_tokens if record.budget_period is not None else None
        if record.input_tpm is None and record.output_tpm is None and budget is None:
            return None
        return cls(
            input_tpm=record.input_tpm,
            output_tpm=record.output_tpm,
            budget_tokens=budget,
            budget_period=record.budget_period if budget is not None else None,
        )


class Used(msgspec.Struct, frozen=True):
    """A key's counters in the current windows, and the seconds until each window ends."""

    input: int
    output: int
    budget: int
    minute_reset_s: float
    period_reset_s: float
    admitted: bool = True  # False: a limit had no room, and nothing was counted
    at: float = 0.0  # the clock's reading when it was read (unix s): the admission's windows

    def allowances(self, limits: TokenLimits) -> dict[Kind, Allowance]:
        out: dict[Kind, Allowance] = {}
        for kind, limit, used, reset in (
            ("input_tpm", limits.input_tpm, self.input, self.minute_reset_s),
            ("output_tpm", limits.output_tpm, self.output, self.minute_reset_s),
            ("budget", limits.budget_tokens, self.budget, self.period_reset_s),
        ):
            if limit is not None:
                out[kind] = Allowance(limit, max(limit - used, 0), reset)  # type: ignore[index]
        return out

    def tightest(self, limits: TokenLimits) -> Allowance | None:
        """The limit with the fewest tokens left (the sooner reset on a tie): what the
        `x-ratelimit-*-tokens` headers and the Realtime "tokens" entry show."""
        found = self.allowances(limits).values()
        return min(found, key=lambda a: (a.remaining, a.reset_s), default=None)

    def refused_by(self, limits: TokenLimits) -> list[Kind]:
        return [k for k, a in self.allowances(limits).items() if a.remaining <= 0]


def windows(limits: TokenLimits, now: float) -> tuple[str, str, float, float]:
    """(minute window id, budget period id, seconds to the minute's end, to the period's end)
    at unix time `now`; the period id is "" without a budget."""
    minute = str(int(now // 60))
    minute_reset = 60.0 - now % 60.0
    if limits.budget_period is None:
        return minute, "", minute_reset, minute_reset
    day = dt.datetime.fromtimestamp(now, dt.UTC)
    if limits.budget_period == "day":
        start = day.replace(hour=0, minute=0, second=0, microsecond=0)
        end = start + dt.timedelta(days=1)
        period = "d" + start.strftime("%Y%m%d")
    else:
        start = day.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = (start + dt.timedelta(days=32)).replace(day=1)
        period = "m" + start.strftime("%Y%m")
    return minute, period, minute_reset, end.timestamp() - now


def refusal(limits: TokenLimits, used: Used) -> GatewayError:
    """The answer to a response refused by `used` (noted for the rate-limit headers)."""
    note_tokens(used.tightest(limits))
    kinds = used.refused_by(limits)
    allowances = used.allowances(limits)
    retry = max(allowances[k].reset_s for k in kinds)
    names = {
        "input_tpm": f"{limits.input_tpm} input tokens per minute",
        "output_tpm": f"{limits.output_tpm} output tokens per minute",
        "budget": f"the budget of {limits.budget_tokens} tokens per {limits.budget_period}",
    }
    return GatewayError(
        "rate_limited",
        f"this API key reached {' and '.join(names[k] for k in kinds)}; "
        f"retry in {max(retry, 0.1):.0f} s",
        retry_after_s=max(retry, 1.0),
    )


class TokenLimiter(Protocol):
    async def admit(self, owner: str, limits: TokenLimits, add: int) -> Used | None:
        """Let a response in while every limit has room, counting `add` input tokens at once;
        with no room, count nothing (`Used.admitted` False: `refusal` is the answer). `add=0`
        only asks. The counters after it; None when they cannot be read (Redis down: let
        through)."""

    async def charge(
        self,
        owner: str,
        limits: TokenLimits,
        *,
        input: int = 0,
        output: int = 0,
        since: float | None = None,
    ):
        """Count tokens used now (a negative `input` corrects an estimate that was too high).
        With `since` (the admission's `Used.at`), `input` counts only in the windows of that
        time that are still the current ones."""

    async def aclose(self) -> None: ...


class MemoryTokenLimiter:
    """One replica's counters (the embedded default)."""

    __slots__ = ("_clock", "_keys")

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        # owner -> field -> value, as the Redis hash holds them
        self._keys: dict[str, dict[str, str | int]] = {}

    def _used(self, owner: str, limits: TokenLimits) -> tuple[dict, Used, str, str]:
        now = self._clock()
        minute, period, m_reset, p_reset = windows(limits, now)
        fields = self._keys.setdefault(owner, {})

        def current(name: str, window: str) -> int:
            return int(fields.get(name, 0)) if fields.get(f"{name}:w") == window else 0

        used = Used(
            current("in", minute),
            current("out", minute),
            current("b", period),
            m_reset,
            p_reset,
            at=now,
        )
        return fields, used, minute, period

    @staticmethod
    def _store(fields: dict, used: Used, minute: str, period: str) -> None:
        fields.update(
            {
                "in:w": minute,
                "in": used.input,
                "out:w": minute,
                "out": used.output,
                "b:w": period,
                "b": used.budget,
            }
        )

    async def admit(self, owner: str, limits: TokenLimits, add: int) -> Used | None:
        fields, used, minute, period = self._used(owner, limits)
        if used.refused_by(limits):
            return msgspec.structs.replace(used, admitted=False)
        if add:
            used = msgspec.structs.replace(used, input=used.input + add, budget=used.budget + add)
            self._store(fields, used, minute, period)
        return used

    async def charge(
        self,
        owner: str,
        limits: TokenLimits,
        *,
        input: int = 0,
        output: int = 0,
        since: float | None = None,
    ) -> None:
        fields, used, minute, period = self._used(owner, limits)
        in_minute, in_period = _still_current(limits, since, minute, period, input)
        used = msgspec.structs.replace(
            used,
            input=max(used.input + in_minute, 0),
            output=max(used.output + output, 0),
            budget=max(used.budget + in_period + output, 0),
        )
        self._store(fields, used, minute, period)

    async def aclose(self) -> None:
        self._keys.clear()


# KEYS[1]: the key's hash. ARGV: minute window, budget period ("" without), input, output and
# budget limits (0: off), input tokens to add once admitted (0: only ask), expiry (s).
# Returns {admitted 1|0, input, output, budget} after it.
_ADMIT = """
local function used(name, window)
  if redis.call('HGET', KEYS[1], name .. ':w') ~= window then return 0 end
  return tonumber(redis.call('HGET', KEYS[1], name) or '0')
end
local m, p = ARGV[1], ARGV[2]
local i, o, b = used('in', m), used('out', m), used('b', p)
local li, lo, lb = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local add = tonumber(ARGV[6])
if (li > 0 and i >= li) or (lo > 0 and o >= lo) or (lb > 0 and b >= lb) then
  return {0, i, o, b}
end
if add ~= 0 then
  i = i + add
  b = b + add
  redis.call('HSET', KEYS[1], 'in:w', m, 'in', i, 'out:w', m, 'out', o, 'b:w', p, 'b', b)
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[7]))
end
return {1, i, o, b}
"""


def _still_current(
    limits: TokenLimits, since: float | None, minute: str, period: str, input: int
) -> tuple[int, int]:
    """(input for the minute counter, for the budget counter): `input` where the window of
    `since` is the current one, else 0."""
    if since is None or not input:
        return input, input
    then_minute, then_period, _, _ = windows(limits, since)
    return (input if then_minute == minute else 0), (input if then_period == period else 0)


# KEYS[1]: the key's hash. ARGV: minute window, budget period, input tokens for the minute and
# for the budget (negative: an estimate corrected; 0 where its window has ended), output tokens,
# expiry (s). No counter goes below 0.
_CHARGE = """
local function used(name, window)
  if redis.call('HGET', KEYS[1], name .. ':w') ~= window then return 0 end
  return tonumber(redis.call('HGET', KEYS[1], name) or '0')
end
local m, p = ARGV[1], ARGV[2]
local dim, dib, do_ = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local i = math.max(used('in', m) + dim, 0)
local o = math.max(used('out', m) + do_, 0)
local b = math.max(used('b', p) + dib + do_, 0)
redis.call('HSET', KEYS[1], 'in:w', m, 'in', i, 'out:w', m, 'out', o, 'b:w', p, 'b', b)
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[6]))
return 1
"""

REDIS_TIMEOUT_S = 2.5  # a hung master must not hold every request


class RedisTokenLimiter:
    """Counters shared by every replica on one Redis or Redis Cluster (layout above)."""

    __slots__ = ("_admit", "_charge", "_clock", "_redis", "namespace")

    def __init__(
        self, redis_url: str, namespace: str = "vg", *, clock: Callable[[], float] = time.time
    ) -> None:
        from gateway.caching.redis_connections import async_client

        self.namespace = namespace
        self._clock = clock
        self._redis = async_client(redis_url, socket_connect_timeout=2.0, socket_timeout=2.0)
        self._admit = self._redis.register_script(_ADMIT)
        self._charge = self._redis.register_script(_CHARGE)

    def key(self, owner: str) -> str:
        return f"{self.namespace}:tokens:{{{owner}}}"

    @staticmethod
    def _ttl(limits: TokenLimits, period_reset_s: float) -> int:
        # a counter outlives its longest window by a minute at most
        return int(period_reset_s if limits.budget_period else 60.0) + 60

    async def admit(self, owner: str, limits: TokenLimits, add: int) -> Used | None:
        now = self._clock()
        minute, period, m_reset, p_reset = windows(limits, now)
        args = [
            minute,
            period,
            limits.input_tpm or 0,
            limits.output_tpm or 0,
            limits.budget_tokens or 0,
            add,
            self._ttl(limits, p_reset),
        ]
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                ok, i, o, b = await self._admit(keys=[self.key(owner)], args=args)
        except Exception as exc:  # Redis down: serve rather than refuse everyone
            log.warning("token_limit_unavailable", error=type(exc).__name__)
            return None
        return Used(int(i), int(o), int(b), m_reset, p_reset, admitted=bool(int(ok)), at=now)

    async def charge(
        self,
        owner: str,
        limits: TokenLimits,
        *,
        input: int = 0,
        output: int = 0,
        since: float | None = None,
    ) -> None:
        minute, period, _, p_reset = windows(limits, self._clock())
        in_minute, in_period = _still_current(limits, since, minute, period, input)
        if not in_minute and not in_period and not output:
            return
        args = [minute, period, in_minute, in_period, output, self._ttl(limits, p_reset)]
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await self._charge(keys=[self.key(owner)], args=args)
        except Exception as exc:
            log.warning("token_charge_lost", key_id=owner, error=type(exc).__name__)

    async def aclose(self) -> None:
        await self._redis.aclose()


def make_token_limiter(redis_url: str | None) -> TokenLimiter:
    """On the key store's backend: in-process without a Redis URL, else Redis."""
    return MemoryTokenLimiter() if redis_url is None else RedisTokenLimiter(redis_url)
