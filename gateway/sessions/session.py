"""Sessions: a conversation's items, settings and image references, owned by one API key.

A `SessionStore` keeps sessions by id with an idle TTL. It does not keep images or KV blocks
themselves (the vision cache and the KV store do, by content); a session references its
images by digest. Loading a session with the wrong owner is the same error as an unknown id,
so a caller can't probe for other keys' sessions.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Literal, Protocol, TypeVar, runtime_checkable

import msgspec

from gateway.protocol.errors import GatewayError

__all__ = ("Session", "SessionStore", "StoredItem", "StoredPart", "new_id", "not_found")

T = TypeVar("T")
UPDATE_ATTEMPTS = 16  # compare-and-set retries before an update gives up as busy


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


class StoredPart(msgspec.Struct, array_like=True, omit_defaults=True):
    kind: Literal["text", "image", "tool_call"]
    text: str | None = None  # a text; a tool call's arguments (JSON text)
    digest: str | None = None  # sha256 hex of the image bytes
    name: str | None = None  # a tool call's function name
    call_id: str | None = None  # a tool call's id; on a "tool" item's text, the call it answers


class StoredItem(msgspec.Struct, omit_defaults=True):
    id: str
    # "tool": a tool's result (one text part carrying the call_id it answers)
    role: Literal["user", "system", "assistant", "tool"]
    parts: list[StoredPart]
    status: Literal["completed", "incomplete", "in_progress"] = "completed"
    response_id: str | None = None


class SessionUsage(msgspec.Struct, omit_defaults=True):
    """What a stored conversation's answers have cost, summed over its responses (each counted
    when its answer is written into the session: completed or cut short, not failed)."""

    responses: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0  # of input_tokens, read from a cache instead of computed
    image_tokens: int = 0  # of input_tokens, the images' visual tokens
    output_tokens: int = 0

    def add(self, other: SessionUsage) -> None:
        self.responses += other.responses
        self.input_tokens += other.input_tokens
        self.cached_tokens += other.cached_tokens
        self.image_tokens += other.image_tokens
        self.output_tokens += other.output_tokens


class Session(msgspec.Struct, omit_defaults=True):
    id: str
    owner: str
    created_at: float
    updated_at: float
    instructions: str
    max_output_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    items: list[StoredItem] = msgspec.field(default_factory=list)
    # when the conversation outgrows the model's context: "auto" leaves out the oldest turns
    # (the stored items stay), "disabled" refuses with context_length_exceeded
    truncation: Literal["auto", "disabled"] = "auto"
    usage: SessionUsage = msgspec.field(default_factory=SessionUsage)

    @property
    def image_digests(self) -> list[str]:
        """Digests of the images the conversation references, in order, without repeats."""
        seen: dict[str, None] = {}
        for item in self.items:
            for part in item.parts:
                if part.kind == "image" and part.digest:
                    seen.setdefault(part.digest, None)
        return list(seen)

    @classmethod
    def new(
        cls, owner: str, *, instructions: str, max_output_tokens: int, session_id: str | None = None
    ) -> Session:
        now = time.time()
        return cls(
            id=session_id or new_id("sess"),
            owner=owner,
            created_at=now,
            updated_at=now,
            instructions=instructions,
            max_output_tokens=max_output_tokens,
        )


def not_found(session_id: str) -> GatewayError:
    return GatewayError(
        "session_not_found", f"no session {session_id!r} for this API key", param="session_id"
    )


@runtime_checkable
class SessionStore(Protocol):
    async def load(self, session_id: str, owner: str) -> Session:
        """The stored session; GatewayError(session_not_found) if unknown, expired or foreign."""

    async def save(self, session: Session) -> None:
        """Store the whole session (refreshing its idle TTL). Last write wins."""

    async def update(
        self, session_id: str, owner: str, mutate: Callable[[Session], T]
    ) -> tuple[Session, T]:
        """Read-modify-write without lost updates: load the stored session, apply `mutate` (a
        plain function; it may run more than once when writers race), store it only if nobody
        wrote in between, else retry. Returns the stored session and mutate's result. Raises
        like `load`, or GatewayError(busy) after too many conflicts."""

    async def create(self, session: Session) -> bool:
        """Store a session under a new id; False (nothing written) if the id is taken by anyone."""

    async def delete(self, session_id: str, owner: str) -> bool:
        """Remove it; False if it was not there (or not the owner's)."""

    async def count(self) -> int:
        """Sessions currently stored (for the active-sessions gauge)."""

    async def aclose(self) -> None: ...
