"""The answer's place in a stored conversation: taken when a response starts, filled or dropped.

A response takes its answer's place as it starts (`take_place`: an empty assistant item,
`in_progress`), as the Realtime API does at `response.output_item.added`, so items a client adds
while it streams come after it. The place is filled with the answer when it ends
(`fill_place`, completed or incomplete) or dropped when no answer stays (`drop_place`). Each is
one compare-and-set update of the session; a response whose options do not store it
(`store=false`) touches nothing.

An answer is acknowledged only once `fill_place` returned: it raises the store's error
(`busy`) when the answer could not be written, and the caller reports the response as failed.
A place can outlive its response (the gateway killed mid-answer, the store down for both the
answer and the drop): readers leave `in_progress` items out of the prompt, and the next
response of the session to take its place removes any place of another response still there.
If that was a response still running elsewhere (two connections on one session answering at
once), its answer is appended at the end when it is written, so it is never lost.
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

__all__ = ("drop_place", "fill_place", "is_place", "take_place")

log = structlog.get_logger("visiongate.service")


def is_place(item: StoredItem) -> bool:
    """An answer's place: an `in_progress` item that a response took (never a client's)."""
    return item.status == "in_progress" and item.response_id is not None


async def take_place(sessions: SessionStore, session: Session, options: ResponseOptions) -> None:
    """Append the answer's empty, in-progress item to the stored session, removing the places
    other responses left there."""
    if not options.store:
        return

    def place(stored: Session) -> None:
        left = [i.id for i in stored.items if is_place(i) and i.id != options.item_id]
        if left:
            stored.items[:] = [i for i in stored.items if i.id not in left]
            log.info("stale_places_removed", session_id=stored.id, items=left)
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
) -> None:
    """Write the answer into its place (at the end, if another response removed the place),
    and add what it cost (`usage`) to the session's. Raises the store's `GatewayError` (busy)
    when it could not be written: the answer must then not be reported as given."""
    if not options.store:
        return

    parts = answer_parts(text, options)

    def fill(stored: Session) -> None:
        for item in stored.items:
            if item.id == options.item_id:
                item.parts = parts
                item.status = status
                break
        else:
            stored.items.append(
                StoredItem(
                    id=options.item_id,
                    role="assistant",
                    parts=parts,
                    status=status,
                    response_id=options.response_id,
                )
            )
        if usage is not None:
            stored.usage.add(usage)

    try:
        await sessions.update(session.id, session.owner, fill)
    except GatewayError as exc:
        log.error("answer_not_stored", response_id=options.response_id, code=exc.code)
        if exc.code == "session_not_found":  # deleted or expired while it was answered
            raise
        raise GatewayError(
            "busy", f"the answer could not be stored ({exc.message}); retry the turn"
        ) from exc


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
