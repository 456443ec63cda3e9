"""In-process SessionStore: a dict with an idle TTL.
The embedded default; nothing survives a restart.

Session ids are per owner: two API keys may both have a session "my-chat", and neither can tell
whether the other's exists."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from gateway.sessions.session import Session, T, not_found

__all__ = ("MemorySessionStore",)


class MemorySessionStore:
    __slots__ = ("_clock", "_sessions", "ttl_s")

    def __init__(self, ttl_s: float, *, clock=time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        # (owner, id) -> (expires_at, encoded session): ids are per owner, and stored encoded so
        # callers never share mutable state
        self._sessions: dict[tuple[str, str], tuple[float, bytes]] = {}

    async def load(self, session_id: str, owner: str) -> Session:
        key = (owner, session_id)
        entry = self._sessions.get(key)
        if entry is None or entry[0] <= self._clock():
            self._sessions.pop(key, None)
            raise not_found(session_id)
        session = msgspec.msgpack.decode(entry[1], type=Session)
        # An idle TTL: reading the session refreshes it, as saving does.
        self._sessions[key] = (self._clock() + self.ttl_s, entry[1])
        return session

    async def save(self, session: Session) -> None:
        session.updated_at = time.time()
        self._sessions[(session.owner, session.id)] = (
            self._clock() + self.ttl_s,
            msgspec.msgpack.encode(session),
        )
        self._expire()

    async def update(
        self, session_id: str, owner: str, mutate: Callable[[Session], T]
    ) -> tuple[Session, T]:
        # no await between read and write: atomic on the event loop
        session = await self.load(session_id, owner)
        result = mutate(session)
        await self.save(session)
        return session, result

    async def create(self, session: Session) -> bool:
        self._expire()
        if (session.owner, session.id) in self._sessions:
            return False
        await self.save(session)
        return True

    async def delete(self, session_id: str, owner: str) -> bool:
        try:
            await self.load(session_id, owner)
        except Exception:
            return False
        del self._sessions[(owner, session_id)]
        return True

    async def count(self) -> int:
        self._expire()
        return len(self._sessions)

    async def aclose(self) -> None:
        self._sessions.clear()

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, (exp, _) in self._sessions.items() if exp <= now]:
            del self._sessions[key]
