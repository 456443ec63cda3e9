"""The answer's place in a stored conversation: taken when a response starts, filled or dropped.

A response takes its answer's place as it starts (`take_place`: an empty assistant item,
`in_progress`), as the Realtime API does at `response.output_item.added`, so items a client adds
while it streams come after it. The place is filled with the answer when it ends
(`fill_place`, completed or incomplete) or dropped when no answer stays (`drop_place`). Each is
one compare-and-set update of the session; a response whose options do not store it
(`store=false`) touches nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import structlog

from gateway.chat.turn_prompt import answer_parts
from gateway.protocol.errors import GatewayError
from gateway.sessions.session import SessionUsage, StoredItem, StoredPart

if TYPE_CHECKING:
    from gateway.chat.events import ResponseOptions
    from gateway.sessions.session import Session, SessionStore

__all__ = ("drop_place", "fill_place", "take_place")

log = structlog.get_logger("visiongate.service")


async def take_place(sessions: SessionStore, session: Session, options: ResponseOptions) -> None:
    """Append the answer's empty, in-progress item to the stored session."""
    if not options.store:
        return

    def place(stored: Session) -> None:
        stored.items.append(
            StoredItem(
                id=options.item_id,
                role="assistant",
                parts=[StoredPart("text", text="")],
                status="in_progress",
                response_id=options.response_id,
            )
        )

    await sessions.update(session.id, session.owner, place)


async def fill_place(
    sessions: SessionStore,
    session: Session,
    options: ResponseOptions,
    text: str,
    status: Literal["completed", "incomplete"],
    usage: SessionUsage | None = None,
) -> GatewayError | None:
    """Write the answer into its place, and add what it cost (`usage`) to the session's; the
    error if the record could not be written (the answer went out all the same)."""
    if not options.store:
        return None

    parts = answer_parts(text, options)

    def fill(stored: Session) -> None:
        for item in stored.items:
            if item.id == options.item_id:
                item.parts = parts
                item.status = status
        if usage is not None:
            stored.usage.add(usage)

    try:
        await sessions.update(session.id, session.owner, fill)
    except GatewayError as exc:  # the answer went out; only its record is lost
        log.error("answer_not_stored", response_id=options.response_id, code=exc.code)
        return GatewayError(
            "answer_not_stored",
            f"the answer was sent but could not be "
            f"stored in the session ({exc.code}); resend it to keep it",
        )
    return None


async def drop_place(sessions: SessionStore, session: Session, options: ResponseOptions) -> None:
    """Remove the answer's place: the response leaves no answer in the conversation."""
    if not options.store:
        return

    def drop(stored: Session) -> None:
        stored.items[:] = [i for i in stored.items if i.id != options.item_id]

    try:
        await sessions.update(session.id, session.owner, drop)
    except GatewayError as exc:
        log.error("placeholder_not_removed", response_id=options.response_id, code=exc.code)
