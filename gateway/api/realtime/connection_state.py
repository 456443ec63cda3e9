"""What one Realtime connection knows, in one object its event handlers share.

`ConnectionState` is every value that lives as long as the connection and that more than one
handler reads: the phase of the socket, the session (its settings and its conversation items,
as last read from or written to the store), the session's function tools, the response in
progress, and the pre-encodes of the images the connection sent. The handlers
(`session_events.SessionEvents`, `item_events.ItemEvents`, `response_events.ResponseEvents`)
are each handed this object and the few collaborators they use; what only one handler needs
(the KV warm-up in progress, for instance) stays private to it.

Who writes what:
- `phase`: the connection (`connection.RealtimeConnection`), CONNECTING -> OPEN -> CLOSED,
  never back (`transition` asserts it); `event_sender.EventSender` sends only while OPEN.
- `session`: whichever handler last loaded or updated the stored session; the store is the
  truth, this is the connection's latest copy of it.
- `tools`: `session.update`. They live with the connection, as an OpenAI Realtime session's do,
  never in the stored session.
- `response`: `response.create`; one at a time.
- `pending`, `watchers`: `conversation.item.create` (the pre-encodes it started by digest, and
  the tasks that report them); a response joins the pre-encodes instead of starting them again.
- `encode_quota`: the encodes this connection started and that have not finished, under
  `max_pending_encodes_per_connection`.

Nothing here sends or awaits: it is state, and the few questions asked of it.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.chat.events import ResponseOptions
    from gateway.chat.vision_resolver import EncodeQuota, Resolved
    from gateway.sessions.session import Session

__all__ = ("ConnState", "ConnectionState", "ResponseInFlight", "SessionTools")


class ConnState(enum.Enum):
    CONNECTING = "connecting"
    OPEN = "open"
    CLOSED = "closed"


_LEGAL = {
    ConnState.CONNECTING: frozenset({ConnState.OPEN, ConnState.CLOSED}),
    ConnState.OPEN: frozenset({ConnState.CLOSED}),
    ConnState.CLOSED: frozenset({ConnState.CLOSED}),
}


@dataclass(slots=True)
class SessionTools:
    """The function tools `session.update` set, checked when set."""

    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


@dataclass(slots=True, eq=False)
class ResponseInFlight:
    """The connection's latest response: its options (its ids, its cancel flag) and its run."""

    options: ResponseOptions
    task: asyncio.Task[None]


@dataclass(slots=True, eq=False)
class ConnectionState:
    """The state of one WebSocket that its handlers share (see the module for who writes
    what)."""

    owner: str  # the API key's id: whose session, images and quotas these are
    encode_quota: EncodeQuota
    phase: ConnState = ConnState.CONNECTING
    session: Session | None = None
    tools: SessionTools = field(default_factory=SessionTools)
    response: ResponseInFlight | None = None
    # digest -> its pre-encode, while it runs (and after, until a failure drops it)
    pending: dict[str, asyncio.Task[Resolved]] = field(default_factory=dict)
    # item watchers -> the encodes they wait for
    watchers: dict[asyncio.Task[None], list[asyncio.Task[Resolved]]] = field(default_factory=dict)

    def transition(self, new: ConnState) -> None:
        assert new in _LEGAL[self.phase], f"illegal transition {self.phase} -> {new}"
        self.phase = new

    @property
    def responding(self) -> bool:
        """A response is in progress."""
        return self.response is not None and not self.response.task.done()

    def reporting_watchers(self) -> list[asyncio.Task[None]]:
        """The item watchers whose encodes are all over: each is about to report its images
        (and to drop an item whose image failed)."""
        return [w for w, encodes in self.watchers.items() if all(t.done() for t in encodes)]
