"""Backoff for wrong admin keys, per client (the peer address of the connection).

A client may send `FREE_FAILURES` wrong admin keys in a row; each one past that locks it out
for a delay that doubles, from `FIRST_DELAY_S` to `MAX_DELAY_S`. While locked out, its requests
are answered `auth_locked_out` (429, `Retry-After`) before any key is compared, so guessing the
admin key costs at least that long per guess. The right key, once the delay is over, clears the
count. Only a presented key that is wrong counts (a request with none guesses nothing), and
only `unauthorized` outcomes do: a valid API key used as the admin key is `permission_denied`
and is not a guess.

The counts live in this process (each replica counts its own), at most `MAX_CLIENTS` of them,
the least recently seen dropped first. The peer address is the TCP peer's, never a
client-sent header (`X-Forwarded-For` is anyone's to forge): behind a proxy all clients share
one count, which is why the admin API belongs on a private network.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from gateway.protocol.errors import GatewayError

__all__ = ("FIRST_DELAY_S", "FREE_FAILURES", "MAX_CLIENTS", "MAX_DELAY_S", "AdminLockout")

FREE_FAILURES = 10
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 300.0
MAX_CLIENTS = 10_000


class AdminLockout:
    __slots__ = ("_clients", "_clock")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        # client -> [wrong keys in a row, locked until]
        self._clients: OrderedDict[str, list[float]] = OrderedDict()
        self._clock = clock

    def check(self, client: str) -> None:
        """GatewayError(auth_locked_out) while `client` is locked out."""
        entry = self._clients.get(client)
        if entry is None:
            return
        wait = entry[1] - self._clock()
        if wait > 0:
            raise GatewayError(
                "auth_locked_out",
                "too many wrong admin keys from this client; retry later",
                retry_after_s=wait,
            )

    def failed(self, client: str) -> None:
        entry = self._clients.pop(client, None) or [0.0, 0.0]
        entry[0] += 1
        past = int(entry[0]) - FREE_FAILURES
        if past >= 0:
            entry[1] = self._clock() + min(MAX_DELAY_S, FIRST_DELAY_S * 2.0 ** min(past, 32))
        self._clients[client] = entry
        while len(self._clients) > MAX_CLIENTS:
            self._clients.popitem(last=False)

    def succeeded(self, client: str) -> None:
        self._clients.pop(client, None)
