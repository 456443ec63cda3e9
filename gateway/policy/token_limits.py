"""Per key token limits: input and output tokens per minute, and a token budget per day or
month (a managed key's `KeyRecord.input_tpm`, `output_tpm`, `budget_tokens` + `budget_period`;
a static key's from the settings, `input_tokens_per_minute` / `output_tokens_per_minute`),
and a cap on a key's responses in flight.

Counting. Each key has three counters in fixed windows: input tokens this minute, output tokens
this minute, and tokens (input + output) this budget period (the UTC day, or the UTC calendar
month). A window starts empty when the clock enters it.

Admission (`admit(owner, limits, add, output=...)`): a response is let in while every limit of
its key still has room (used < limit); once in, what it may cost is counted at once, in the
same atomic step: `add`, its input tokens as estimated before anything runs, and `output`, the
most it may write (its `max_tokens` x `n`, or the gateway's cap): a reservation. So concurrent
responses of one key, on any number of replicas, never pass together on the same room: what is
admitted stays within the limit plus the one response that took the last room, its whole
reservation included. When the response ends, its estimate is corrected to its real input
count and the unused part of its reservation is given back (`charge` with negative counts), so
the counters hold what was really used; output past a reservation (one admitted while the
counters could not be read) is counted as it streams. Nothing here ever cuts an answer that is
under way. Corrections count in the windows the admission went to (`since`, the admission's
`Used.at`): once such a window has ended, they only change the debt that window left (below),
never the new window's own use (a reservation given back there would wipe what the key used in
the new minute). No counter goes below 0. Refused: GatewayError("rate_limited") with
`retry_after_s`, the seconds until the counters as they stand have room again (HTTP 429 and
Retry-After): reservations in flight count as used, so a response that ends short may let the
key in sooner, never later.

Responses in flight. With a cap (`concurrency` > 0, and a `response` id), admission also takes
one of the key's slots: a key with `concurrency` responses in flight is refused
(`Used.busy`; the caller answers "concurrency_limited"). A slot is a lease (`LIVE_LEASE_S`,
renewed by `renew` while the response streams) given back by the `charge` that ends the
response (`release`); one whose replica died frees itself when its lease runs out.

Two counters with one contract: `MemoryTokenLimiter` (one replica's view) and
`RedisTokenLimiter`, whose counters for one key are the fields of one hash,
`vg:tokens:{<key id>}` (fields `in`, `out`, `b`, and for each the window it belongs to, `:w`,
that window's index, `:n`, and the debt it opened with, `:c`), and whose slots are the members
of one sorted set, `vg:live:{<key id>}` (score: the lease's end), both changed by scripts over
the two keys of one hash slot: one Redis or any Redis Cluster node.

Debt. A window only refuses once full, so one response can take it far past its limit (a
200,000-token prompt against 1,000 a minute): what a window counted past its limit plus one
more limit is owed by the windows after it, one limit a window, so a key's tokens over time
stay within its limits plus one response, however large that one was. An estimate corrected
after its window ended lowers that debt (never the new window's own use). On Redis the hash
lives until the last window its debts reach has ended (and a minute more), however many days
or months that is. While Redis is unreachable the limiter lets responses through (and logs
it) like the request limiter.
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
    "LIVE_LEASE_S",
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
LIVE_LEASE_S = 300.0  # a slot of a response in flight, unless renewed (`TokenLimiter.renew`)


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
    admitted: bool = True  # False: a limit had no room (or no slot), and nothing was counted
    at: float = 0.0  # the clock's reading when it was read (unix s): the admission's windows
    live: int = 0  # the key's responses in flight after it (with a cap asked for)
    busy: bool = False  # refused for the cap on responses in flight, not for tokens
    # which counters were written in their current window (1: input, 2: output, 4: budget);
    # one that was not holds only the debt it carries
    written: int = 7

    def allowances(self, limits: TokenLimits) -> dict[Kind, Allowance]:
        """Each limit's room; its reset is when a response is let in again, if every
        reservation in flight is used: the window's end, or, with a debt, the start of the
        first window whose debt is under the limit (`_read`: a window written with `used` is
        owed used - limit * (j + 1) by the j-th window after it, one that only carries a debt
        `used` owes used - limit * j; a month as 31 days)."""
        out: dict[Kind, Allowance] = {}
        period_s = _period_s(limits)
        for bit, kind, limit, used, reset, length in (
            (1, "input_tpm", limits.input_tpm, self.input, self.minute_reset_s, 60.0),
            (2, "output_tpm", limits.output_tpm, self.output, self.minute_reset_s, 60.0),
            (4, "budget", limits.budget_tokens, self.budget, self.period_reset_s, period_s),
        ):
            if limit is not None:
                later = 2 if self.written & bit else 1
                owed = max(used // limit - later, 0) if limit > 0 else 0
                allowance = Allowance(limit, max(limit - used, 0), reset + length * owed)
                out[kind] = allowance  # type: ignore[index]
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
    async def admit(
        self,
        owner: str,
        limits: TokenLimits,
        add: int,
        *,
        output: int = 0,
        response: str = "",
        concurrency: int = 0,
    ) -> Used | None:
        """Let a response in while every limit has room, counting `add` input tokens and
        `output` reserved output tokens at once; with no room, count nothing (`Used.admitted`
        False: `refusal` is the answer). With `concurrency` > 0, `response` also takes one of
        the key's slots, and is refused (`Used.busy`) when `concurrency` are taken. `add=0`
        and `output=0` only ask. The counters after it; None when they cannot be read (Redis
        down: let through)."""

    async def charge(
        self,
        owner: str,
        limits: TokenLimits,
        *,
        input: int = 0,
        output: int = 0,
        since: float | None = None,
        release: str = "",
    ):
        """Count tokens used now (a negative `input` corrects an estimate that was too high, a
        negative `output` gives back a reservation). With `since` (the admission's `Used.at`),
        both correct the windows of that time: in one that has ended, only the debt it left.
        `release`: the response whose slot is given back (a slot already gone is no error)."""

    async def renew(self, owner: str, response: str) -> None:
        """The response is still under way: its slot's lease starts again."""

    async def aclose(self) -> None: ...


def _indices(limits: TokenLimits, now: float) -> tuple[int, int]:
    """(minute index, budget period index) at `now`: windows since the epoch, so that the
    windows between two of them are their difference (0 for the period without a budget)."""
    if limits.budget_period is None:
        return int(now // 60), 0
    if limits.budget_period == "day":
        return int(now // 60), int(now // 86400)
    day = dt.datetime.fromtimestamp(now, dt.UTC)
    return int(now // 60), day.year * 12 + day.month - 1


class _Window(msgspec.Struct, frozen=True):
    """Where one counter is asked about or changed: its window id and index, its limit (0:
    off), and the window id of the admission whose estimate a change corrects."""

    id: str
    index: int
    limit: int
    since: str


def _read(fields: dict, name: str, w: _Window) -> tuple[int, int]:
    """(the counter in window `w`, the debt it opened with): a window opened after one that
    went past its limit by more than a limit owes the rest, one limit less each window since.
    The same steps as the scripts' `read`."""
    value, stored = int(fields.get(name, 0)), fields.get(f"{name}:w")
    if stored == w.id:
        return value, int(fields.get(f"{name}:c", 0))
    index = fields.get(f"{name}:n")
    if index is None or w.limit <= 0:
        return 0, 0
    debt = max(value - w.limit * (w.index - int(index) + 1), 0)
    return debt, debt


def _changed(fields: dict, name: str, w: _Window, delta: int) -> tuple[int, int]:
    """The counter after `delta` (the scripts' `change`): in the admission's window, as it
    is; once that window has passed, on its count if nothing was written since (the debt
    follows), else only off the debt the new window opened with, never its own use."""
    value, debt = _read(fields, name, w)
    if not delta or w.since == w.id:
        return max(value + delta, 0), debt
    index = fields.get(f"{name}:n")
    if fields.get(f"{name}:w") == w.since and index is not None and w.limit > 0:
        old = max(int(fields.get(name, 0)) + delta, 0)
        debt = max(old - w.limit * (w.index - int(index) + 1), 0)
        return debt, debt
    if delta < 0:
        taken = min(-delta, debt)
        return value - taken, debt - taken
    return value, debt


def _store(fields: dict, name: str, w: _Window, value: int, debt: int) -> None:
    fields.update({name: value, f"{name}:w": w.id, f"{name}:n": w.index, f"{name}:c": debt})


def _period_s(limits: TokenLimits) -> float:
    """The budget period's length, a month as its longest."""
    return 86400.0 if limits.budget_period == "day" else 31 * 86400.0


def _counter_windows(
    limits: TokenLimits, now: float, since: float | None
) -> tuple[_Window, _Window, _Window, float, float]:
    """The three counters' windows at `now` (corrections belong to the windows of `since`),
    and the seconds to the minute's and the period's end."""
    minute, period, m_reset, p_reset = windows(limits, now)
    m_index, p_index = _indices(limits, now)
    then_minute, then_period = (minute, period) if since is None else windows(limits, since)[:2]
    return (
        _Window(minute, m_index, limits.input_tpm or 0, then_minute),
        _Window(minute, m_index, limits.output_tpm or 0, then_minute),
        _Window(period, p_index, limits.budget_tokens or 0, then_period),
        m_reset,
        p_reset,
    )


class MemoryTokenLimiter:
    """One replica's counters (the embedded default)."""

    __slots__ = ("_clock", "_keys", "_live")

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        # owner -> field -> value, as the Redis hash holds them
        self._keys: dict[str, dict[str, str | int]] = {}
        # owner -> response -> the end of its slot's lease, as the Redis sorted set holds them
        self._live: dict[str, dict[str, float]] = {}

    def _slots(self, owner: str, now: float) -> dict[str, float]:
        live = self._live.setdefault(owner, {})
        for response in [r for r, end in live.items() if end <= now]:
            del live[response]
        return live

    async def admit(
        self,
        owner: str,
        limits: TokenLimits,
        add: int,
        *,
        output: int = 0,
        response: str = "",
        concurrency: int = 0,
    ) -> Used | None:
        now = self._clock()
        wi, wo, wb, m_reset, p_reset = _counter_windows(limits, now, None)
        fields = self._keys.setdefault(owner, {})
        (i, ic), (o, oc), (b, bc) = (
            _read(fields, "in", wi),
            _read(fields, "out", wo),
            _read(fields, "b", wb),
        )
        written = sum(
            bit
            for bit, name, w in ((1, "in", wi), (2, "out", wo), (4, "b", wb))
            if fields.get(f"{name}:w") == w.id
        )
        used = Used(i, o, b, m_reset, p_reset, at=now, written=written)
        if used.refused_by(limits):
            return msgspec.structs.replace(used, admitted=False)
        live = self._slots(owner, now) if concurrency > 0 else {}
        if concurrency > 0 and len(live) >= concurrency:
            return msgspec.structs.replace(used, admitted=False, busy=True, live=len(live))
        if add or output:
            i, o, b = i + add, o + output, b + add + output
            used = msgspec.structs.replace(used, input=i, output=o, budget=b, written=7)
            _store(fields, "in", wi, i, ic)
            _store(fields, "out", wo, o, oc)
            _store(fields, "b", wb, b, bc)
        if concurrency > 0 and response:
            live[response] = now + LIVE_LEASE_S
            used = msgspec.structs.replace(used, live=len(live))
        return used

    async def charge(
        self,
        owner: str,
        limits: TokenLimits,
        *,
        input: int = 0,
        output: int = 0,
        since: float | None = None,
        release: str = "",
    ) -> None:
        if release:
            self._live.get(owner, {}).pop(release, None)
        if not input and not output:
            return
        wi, wo, wb, _, _ = _counter_windows(limits, self._clock(), since)
        fields = self._keys.setdefault(owner, {})
        i, ic = _changed(fields, "in", wi, input)
        o, oc = _changed(fields, "out", wo, output)
        b, bc = _changed(fields, "b", wb, input + output)
        _store(fields, "in", wi, i, ic)
        _store(fields, "out", wo, o, oc)
        _store(fields, "b", wb, b, bc)

    async def renew(self, owner: str, response: str) -> None:
        live = self._live.get(owner, {})
        if response in live:
            live[response] = self._clock() + LIVE_LEASE_S

    async def aclose(self) -> None:
        self._keys.clear()
        self._live.clear()


# The scripts' steps, those of `_read`, `_changed` and `_store` above. ARGV for each counter
# (in, out, b) from ARGV[base]: window id, window index, limit (0: off), the admission's window.
_STEPS = """
local function read(name, base)
  local h = redis.call('HMGET', KEYS[1], name, name .. ':w', name .. ':n', name .. ':c')
  local value, index = tonumber(h[1] or '0'), tonumber(h[3] or '')
  if h[2] == ARGV[base] then return value, tonumber(h[4] or '0') end
  local limit = tonumber(ARGV[base + 2])
  if (not index) or limit <= 0 then return 0, 0 end
  local debt = math.max(value - limit * (tonumber(ARGV[base + 1]) - index + 1), 0)
  return debt, debt
end
local function change(name, base, delta)
  local value, debt = read(name, base)
  if delta == 0 or ARGV[base + 3] == ARGV[base] then return math.max(value + delta, 0), debt end
  local h = redis.call('HMGET', KEYS[1], name, name .. ':w', name .. ':n')
  local limit, index = tonumber(ARGV[base + 2]), tonumber(h[3] or '')
  if h[2] == ARGV[base + 3] and index and limit > 0 then
    local old = math.max(tonumber(h[1] or '0') + delta, 0)
    debt = math.max(old - limit * (tonumber(ARGV[base + 1]) - index + 1), 0)
    return debt, debt
  end
  if delta < 0 then
    local taken = math.min(-delta, debt)
    return value - taken, debt - taken
  end
  return value, debt
end
local function store(name, base, value, debt)
  redis.call('HSET', KEYS[1], name, value, name .. ':w', ARGV[base], name .. ':n',
    ARGV[base + 1], name .. ':c', debt)
end
"""

# The hash's expiry after a write of counters `i`, `o`, `b`: until the end of the last window
# that still owes part of one (`_read`: the j-th window after a counter's owes value - limit *
# (j + 1)), and a minute. ARGV[15], ARGV[16]: seconds to the minute's and to the period's end,
# ARGV[17]: the period's length.
_KEEP = """
local function keep(i, o, b)
  local need = 0
  local function upto(value, limit, reset, length)
    if limit > 0 then
      need = math.max(need, reset + length * math.max(math.ceil(value / limit) - 2, 0))
    end
  end
  upto(i, tonumber(ARGV[3]), tonumber(ARGV[15]), 60)
  upto(o, tonumber(ARGV[7]), tonumber(ARGV[15]), 60)
  upto(b, tonumber(ARGV[11]), tonumber(ARGV[16]), tonumber(ARGV[17]))
  redis.call('EXPIRE', KEYS[1], math.ceil(math.max(need, tonumber(ARGV[15]))) + 60)
end
"""

# KEYS[1]: the key's hash, KEYS[2]: its slots. ARGV[1..12]: the counters' windows (`_STEPS`),
# ARGV[13]: input tokens to add once admitted, ARGV[14]: output tokens to reserve (both 0: only
# ask), ARGV[15..17]: `_KEEP`'s, ARGV[18]: the response ('' : none), ARGV[19]: the cap on
# responses in flight (0: none), ARGV[20]: now (s), ARGV[21]: a slot's lease (s).
# Returns {1 admitted | 0 refused for tokens | 2 refused for the cap, input, output, budget,
# responses in flight, the counters written in their current window (`Used.written`)}.
_ADMIT = (
    _STEPS
    + _KEEP
    + """
local i, ic = read('in', 1)
local o, oc = read('out', 5)
local b, bc = read('b', 9)
local li, lo, lb = tonumber(ARGV[3]), tonumber(ARGV[7]), tonumber(ARGV[11])
local add, reserve = tonumber(ARGV[13]), tonumber(ARGV[14])
local cap, now = tonumber(ARGV[19]), tonumber(ARGV[20])
local w = redis.call('HMGET', KEYS[1], 'in:w', 'out:w', 'b:w')
local written = 0
if w[1] == ARGV[1] then written = written + 1 end
if w[2] == ARGV[5] then written = written + 2 end
if w[3] == ARGV[9] then written = written + 4 end
if (li > 0 and i >= li) or (lo > 0 and o >= lo) or (lb > 0 and b >= lb) then
  return {0, i, o, b, 0, written}
end
local live = 0
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  live = redis.call('ZCARD', KEYS[2])
  if live >= cap then return {2, i, o, b, live, written} end
end
if add ~= 0 or reserve ~= 0 then
  written = 7
  i = i + add
  o = o + reserve
  b = b + add + reserve
  store('in', 1, i, ic)
  store('out', 5, o, oc)
  store('b', 9, b, bc)
  keep(i, o, b)
end
if cap > 0 and ARGV[18] ~= '' then
  local lease = tonumber(ARGV[21])
  redis.call('ZADD', KEYS[2], now + lease, ARGV[18])
  redis.call('EXPIRE', KEYS[2], math.ceil(lease) + 60)
  live = live + 1
end
return {1, i, o, b, live, written}
"""
)

# KEYS[1]: the key's hash, KEYS[2]: its slots. ARGV[1..12]: the counters' windows, ARGV[13]:
# input tokens (negative: an estimate corrected), ARGV[14]: output tokens (negative: a
# reservation given back), ARGV[15..17]: `_KEEP`'s, ARGV[18]: the response whose slot is given
# back ('': none). No counter below 0.
_CHARGE = (
    _STEPS
    + _KEEP
    + """
if ARGV[18] ~= '' then redis.call('ZREM', KEYS[2], ARGV[18]) end
local di, do_ = tonumber(ARGV[13]), tonumber(ARGV[14])
if di == 0 and do_ == 0 then return 1 end
local i, ic = change('in', 1, di)
local o, oc = change('out', 5, do_)
local b, bc = change('b', 9, di + do_)
store('in', 1, i, ic)
store('out', 5, o, oc)
store('b', 9, b, bc)
keep(i, o, b)
return 1
"""
)

# KEYS[1]: a key's slots. ARGV[1]: the response, ARGV[2]: its lease's new end, ARGV[3]: the
# lease (s). Only a slot still held is renewed.
_RENEW = """
if redis.call('ZADD', KEYS[1], 'XX', 'CH', ARGV[2], ARGV[1]) == 1 then
  redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3])) + 60)
end
return 1
"""

REDIS_TIMEOUT_S = 2.5  # a hung master must not hold every request


class RedisTokenLimiter:
    """Counters shared by every replica on one Redis or Redis Cluster (layout above)."""

    __slots__ = ("_admit", "_charge", "_clock", "_redis", "_renew", "namespace")

    def __init__(
        self, redis_url: str, namespace: str = "vg", *, clock: Callable[[], float] = time.time
    ) -> None:
        from gateway.caching.redis_connections import async_client

        self.namespace = namespace
        self._clock = clock
        self._redis = async_client(redis_url, socket_connect_timeout=2.0, socket_timeout=2.0)
        self._admit = self._redis.register_script(_ADMIT)
        self._charge = self._redis.register_script(_CHARGE)
        self._renew = self._redis.register_script(_RENEW)

    def key(self, owner: str) -> str:
        return f"{self.namespace}:tokens:{{{owner}}}"

    def live_key(self, owner: str) -> str:
        """The key's slots: the same hash tag as its counters (one Cluster slot)."""
        return f"{self.namespace}:live:{{{owner}}}"

    def _args(self, limits: TokenLimits, since: float | None) -> tuple[float, list]:
        now = self._clock()
        wi, wo, wb, m_reset, p_reset = _counter_windows(limits, now, since)
        args = [x for w in (wi, wo, wb) for x in (w.id, w.index, w.limit, w.since)]
        return now, [*args, 0, 0, m_reset, p_reset, _period_s(limits)]

    async def admit(
        self,
        owner: str,
        limits: TokenLimits,
        add: int,
        *,
        output: int = 0,
        response: str = "",
        concurrency: int = 0,
    ) -> Used | None:
        now, args = self._args(limits, None)
        args[12:14] = [add, output]
        args += [response, concurrency, now, LIVE_LEASE_S]
        keys = [self.key(owner), self.live_key(owner)]
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                ok, i, o, b, live, written = await self._admit(keys=keys, args=args)
        except Exception as exc:  # Redis down: serve rather than refuse everyone
            log.warning("token_limit_unavailable", error=type(exc).__name__)
            return None
        m_reset, p_reset = args[14], args[15]
        return Used(
            int(i),
            int(o),
            int(b),
            m_reset,
            p_reset,
            admitted=int(ok) == 1,
            at=now,
            live=int(live),
            busy=int(ok) == 2,
            written=int(written),
        )

    async def charge(
        self,
        owner: str,
        limits: TokenLimits,
        *,
        input: int = 0,
        output: int = 0,
        since: float | None = None,
        release: str = "",
    ) -> None:
        if not input and not output and not release:
            return
        _, args = self._args(limits, since)
        args[12:14] = [input, output]
        args.append(release)
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await self._charge(keys=[self.key(owner), self.live_key(owner)], args=args)
        except Exception as exc:
            log.warning("token_charge_lost", key_id=owner, error=type(exc).__name__)

    async def renew(self, owner: str, response: str) -> None:
        args = [response, self._clock() + LIVE_LEASE_S, LIVE_LEASE_S]
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await self._renew(keys=[self.live_key(owner)], args=args)
        except Exception as exc:
            log.warning("token_slot_renew_failed", key_id=owner, error=type(exc).__name__)

    async def aclose(self) -> None:
        await self._redis.aclose()


def make_token_limiter(redis_url: str | None) -> TokenLimiter:
    """On the key store's backend: in-process without a Redis URL, else Redis."""
    return MemoryTokenLimiter() if redis_url is None else RedisTokenLimiter(redis_url)
