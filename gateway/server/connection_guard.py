"""Defences against slow and idle clients: what one server's connections may hold, and for how
long, before a single client's request has shown it is worth the socket.

uvicorn (0.55, h11) bounds only the idle time between two requests of a connection
(`timeout_keep_alive`, cancelled by the first byte of the next request) and the size of a
request head (`h11_max_incomplete_event_size`); `limit_concurrency` answers 503 once a head has
been read, so heads that never finish hold sockets for ever. `ConnectionGuard` holds what is
missing; the server's protocols (gateway/server/runner.py) report each connection's phase to it
and it closes what overstays:

- `header_timeout_s`: a request head (request line and headers) must be complete this long after
  the connection opened or its previous response ended; past it, 408 (when any byte of it came)
  and the connection is closed.
- `body_timeout_s` and `body_min_rate`: a request body must keep arriving at `body_min_rate`
  bytes a second on average, counted from the end of its head; `body_timeout_s` is the grace
  before that is checked. Time during which the server itself stopped reading (the app has not
  taken what came) does not count. Past it, 408 if no response was started, and close.
- `ws_handshake_timeout_s`: a WebSocket upgrade must be accepted or refused this long after its
  head; past it, 503 and close.
- `max_connections`: open connections (HTTP and WebSocket). A new one beyond it first takes the
  place of another still sending: the oldest sending a head or a body without a key, else the
  oldest sending a body its request was already answered for (a 401 before the body came),
  else the one sending a body at the lowest rate so far; with none, it is refused (503, close).
- `max_unauthenticated_connections`: connections whose latest request head carried no API key
  (`Authorization`, or the Realtime key subprotocol), or that sent no head yet; on a gateway
  without keys a head of any kind counts as identified. A new connection beyond it takes the
  place of the oldest such connection still sending its head or body that has had
  `HEAD_GRACE_S` to send it; when all of them are younger, it is let in beyond this cap (up to
  `max_connections`). So every client gets that long to send its head, however fast a flood
  reconnects: evicting the oldest alone gave a new connection only (cap / the flood's
  reconnects a second), 0.8 s against 300 reconnecting clients, and well-behaved clients on a
  loaded machine lost their first turns.

A key that was presented is not checked here (the app does that, and answers 401 at once), so a
made-up key moves a connection out of the unauthenticated count only into the total one, which
the timeouts still bound. Every refusal or cut-off calls `on_refusal(reason)` (a Prometheus
counter) and is logged (`connection_refused`, at most one line a reason a second, with the number
of refusals since the last line). This module only keeps the books; it never reads a socket.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

__all__ = (
    "REASONS",
    "ConnectionGuard",
    "Entry",
    "GuardLimits",
    "Guarded",
)

log = structlog.get_logger("visiongate.connections")

# the reasons a connection is refused or cut off (the metric's `reason` label)
REASONS = (
    "header_timeout",
    "body_timeout",
    "ws_handshake_timeout",
    "max_connections",
    "max_unauthenticated_connections",
)
LOG_EVERY_S = 1.0
HEAD_GRACE_S = 2.0  # a new connection's time to send its head before a cap may close it


@dataclass(frozen=True, slots=True)
class GuardLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    body_min_rate: float = 1024.0
    ws_handshake_timeout_s: float = 10.0
    max_connections: int = 2048
    max_unauthenticated_connections: int = 256
    key_required: bool = True  # False: a gateway without keys; any head identifies

    @property
    def sweep_s(self) -> float:
        """How often the deadlines are looked at: a tenth of the shortest, 50 ms..1 s."""
        shortest = min(self.header_timeout_s, self.body_timeout_s, self.ws_handshake_timeout_s)
        return min(1.0, max(0.05, shortest / 10))


class Guarded(Protocol):
    """What the guard asks of a connection's protocol."""

    def guard_close(self, status: int | None) -> None:
        """Answer `status` unless a response was started (None: no answer), then close."""


class Entry:
    """One open connection as the guard sees it."""

    __slots__ = (
        "body_bytes",
        "client",
        "keyed",
        "opened",
        "partial",
        "paused_s",
        "phase",
        "protocol",
        "since",
    )

    def __init__(self, protocol: Guarded, client: str, now: float) -> None:
        self.protocol = protocol
        self.client = client
        # head: waiting for (the rest of) a request head; body: reading a request body;
        # busy: the request is in, the app answers; handshake: a WebSocket upgrade not yet
        # accepted; open: an accepted WebSocket
        self.phase = "head"
        self.since = self.opened = now
        self.keyed = False
        self.partial = False  # bytes of the head came
        self.body_bytes = 0
        self.paused_s = 0.0

    @property
    def reading(self) -> bool:
        """Still sending a head or a body: a slow client's place, the first to give up."""
        return self.phase in ("head", "body")


class ConnectionGuard:
    """The books of one server's connections (one event loop). See the module."""

    def __init__(
        self,
        limits: GuardLimits,
        on_refusal: Callable[[str], None] = lambda reason: None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self._on_refusal = on_refusal
        self._clock = clock
        # id(transport) -> entry, the oldest first
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._unkeyed = 0
        self._closing_unkeyed = 0  # of those, cut and not yet gone
        self._sweeping: asyncio.TimerHandle | None = None
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (last line at, since then)

    @property
    def open_connections(self) -> int:
        return len(self._entries)

    @property
    def unauthenticated(self) -> int:
        return self._unkeyed

    # ------------------------------------------------------------ the protocols' reports

    def open(self, transport: object, protocol: Guarded, client: str) -> Entry | None:
        """A new connection: its entry, or None when it is refused (the caller answers 503
        and closes). Past a cap, the oldest connection still reading takes the refusal."""
        limits = self.limits
        if len(self._entries) >= limits.max_connections and not self._make_room():
            self.refused("max_connections", client)
            return None
        now = self._clock()
        grace = min(HEAD_GRACE_S, limits.header_timeout_s)
        # as many as it takes to bring the count (closing ones aside) under the cap; none old
        # enough: this one is let in beyond it
        while self._unkeyed - self._closing_unkeyed >= limits.max_unauthenticated_connections:
            if not self._evict(
                "max_unauthenticated_connections",
                lambda e: e.reading and not e.keyed and now - e.opened >= grace,
            ):
                break
        entry = Entry(protocol, client, now)
        self._entries[id(transport)] = entry
        self._unkeyed += 1
        self._arm()
        return entry

    def adopt(self, transport: object, protocol: Guarded) -> Entry | None:
        """The transport's connection moved to another protocol (a WebSocket upgrade)."""
        entry = self._entries.get(id(transport))
        if entry is not None:
            entry.protocol = protocol
            self._phase(entry, "handshake")
        return entry

    def head(self, entry: Entry, *, keyed: bool) -> None:
        """A request head came; `keyed`: it carried an API key. Its body, if any, comes next."""
        if entry.phase == "closing":
            return
        keyed = keyed or not self.limits.key_required
        if keyed != entry.keyed:
            self._unkeyed += -1 if keyed else 1
            entry.keyed = keyed
        entry.body_bytes = 0
        entry.paused_s = 0.0
        self._phase(entry, "body")

    def body_received(self, entry: Entry, nbytes: int) -> None:
        entry.body_bytes += nbytes

    def request_state(self, entry: Entry, phase: str) -> None:
        """What the HTTP parser says after a read or a response: `head` (waiting for the next
        request), `body` (a body still coming, answered or not) or `busy`."""
        if entry.phase in ("closing", "handshake", "open"):
            return
        if phase == "head" and entry.phase != "head":
            entry.partial = False
        self._phase(entry, phase)

    def accepted(self, entry: Entry) -> None:
        """A WebSocket handshake was answered."""
        self._phase(entry, "open")

    def close(self, transport: object) -> None:
        entry = self._entries.pop(id(transport), None)
        if entry is not None and not entry.keyed:
            self._unkeyed -= 1
            if entry.phase == "closing":
                self._closing_unkeyed -= 1

    # ------------------------------------------------------------ deadlines

    def _phase(self, entry: Entry, phase: str) -> None:
        if entry.phase != phase:
            entry.phase = phase
            entry.since = self._clock()

    def _arm(self) -> None:
        if self._sweeping is None and self._entries:
            loop = asyncio.get_running_loop()
            self._sweeping = loop.call_later(self.limits.sweep_s, self._sweep)

    def _sweep(self) -> None:
        self._sweeping = None
        now, limits = self._clock(), self.limits
        for entry in list(self._entries.values()):
            age = now - entry.since
            if entry.phase == "head" and age > limits.header_timeout_s:
                self._cut(entry, "header_timeout", 408 if entry.partial else None)
            elif entry.phase == "body":
                if getattr(entry.protocol, "reading_paused", False):
                    entry.paused_s += limits.sweep_s
                active = age - entry.paused_s
                if active > limits.body_timeout_s and entry.body_bytes < (
                    limits.body_min_rate * active
                ):
                    self._cut(entry, "body_timeout", 408)
            elif entry.phase == "handshake" and age > limits.ws_handshake_timeout_s:
                self._cut(entry, "ws_handshake_timeout", 503)
        self._arm()

    def _cut(self, entry: Entry, reason: str, status: int | None) -> None:
        self.refused(reason, entry.client)
        entry.phase = "closing"  # not cut twice while the transport closes
        if not entry.keyed:
            self._closing_unkeyed += 1
        entry.protocol.guard_close(status)

    def _make_room(self) -> bool:
        """Close a connection still sending to let a new one in (see the module)."""
        if self._evict(
            "max_connections", lambda e: e.reading and not (e.phase == "body" and e.keyed)
        ):
            return True
        if self._evict(
            "max_connections",
            lambda e: e.phase == "body" and getattr(e.protocol, "answered", False),
        ):
            return True
        now = self._clock()
        bodies = [e for e in self._entries.values() if e.phase == "body"]
        if not bodies:
            return False
        slowest = min(bodies, key=lambda e: e.body_bytes / max(now - e.since, 1e-3))
        self._cut(slowest, "max_connections", 408)
        return True

    def _evict(self, reason: str, eligible: Callable[[Entry], bool]) -> bool:
        """Close the oldest eligible connection to make room; False when none is."""
        for entry in self._entries.values():
            if eligible(entry):
                self._cut(entry, reason, 408 if entry.partial or entry.phase == "body" else None)
                return True
        return False

    def refused(self, reason: str, client: str) -> None:
        self._on_refusal(reason)
        now = self._clock()
        last, since = self._logged.get(reason, (-LOG_EVERY_S, 0))
        if now - last >= LOG_EVERY_S:
            self._logged[reason] = (now, 0)
            log.warning(
                "connection_refused",
                reason=reason,
                peer=client,
                open_connections=len(self._entries),
                unauthenticated=self._unkeyed,
                refused_since_last_line=since,
            )
        else:
            self._logged[reason] = (last, since + 1)
