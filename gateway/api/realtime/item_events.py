"""Conversation items over a Realtime connection: create, retrieve, delete, truncate.

`conversation.item.create` checks the item in the request layer (`gateway.chat.requests`,
through `gateway.api.realtime.items`), takes the encode slots its new images need, then stores
it in one session-store update, placed after `previous_item_id` ("root": first; none: last).
Its images start encoding at once, before the question arrives: `conversation.item.added` goes
out as soon as the item is stored, one `visiongate.image.encoded` per image as each is ready,
and `conversation.item.done` when all are. An item whose image fails to encode is taken out of
the session again and reported as an `error`: it never becomes part of the conversation.

Each stored item may also start a KV warm-up (`ItemEvents._warm_up`): the conversation
prefilled while the client types its question, one warm-up at a time per connection.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import structlog

from encoder_worker.types import ENCODE_STAGES
from gateway.api.realtime import protocol as rt
from gateway.api.realtime.connection_state import ConnState
from gateway.api.realtime.items import (
    call_ids,
    check_placement,
    content_parts,
    delete_item,
    find_item,
    parse_item,
    stored_role,
    truncate_item,
    wire_item,
)
from gateway.chat.requests import (
    ParsedContent,
    add_inline_images,
    admit_encodes,
    check_conversation_size,
    check_image_count,
    check_item_count,
    conversation_chars,
    fetch_remote,
    resolve_references,
)
from gateway.protocol.errors import GatewayError
from gateway.sessions.session import Session, StoredItem, new_id

if TYPE_CHECKING:
    from gateway.api.realtime.connection_state import ConnectionState
    from gateway.api.realtime.event_sender import EventSender
    from gateway.chat.requests import RequestLimits
    from gateway.chat.service import ChatService
    from gateway.chat.vision_resolver import EncodePermit, Resolved, VisionResolver
    from gateway.sessions.session import SessionStore

__all__ = ("ItemEvents",)

log = structlog.get_logger("visiongate.realtime")


class ItemEvents:
    """The `conversation.item.*` events, the pre-encodes of their images and the KV warm-up."""

    __slots__ = (
        "_conn",
        "_limits",
        "_sender",
        "_service",
        "_sessions",
        "_vision",
        "_warm_again",
        "_warming",
        "_warmup",
    )

    def __init__(
        self,
        conn: ConnectionState,
        sender: EventSender,
        sessions: SessionStore,
        vision: VisionResolver,
        service: ChatService,
        *,
        limits: RequestLimits,
        kv_warmup: bool,
    ) -> None:
        self._conn = conn
        self._sender = sender
        self._sessions = sessions
        self._vision = vision
        self._service = service  # for the KV warm-up only
        self._limits = limits
        self._warmup = kv_warmup
        self._warming: asyncio.Task[Any] | None = None  # this connection's KV warm-up
        self._warm_again = False  # items arrived while it ran

    async def create(self, event: rt.ConversationItemCreate) -> None:
        conn = self._conn
        assert conn.session is not None
        item, limits = event.item, self._limits
        item_id = item.id or new_id("item")
        fetched = None
        if isinstance(item, rt.MessageItem):
            fetched = await fetch_remote(content_parts(item), limits, param="item.content")
        parsed = parse_item(item, limits, fetched, call_ids(conn.session.items))
        vision = self._vision
        await resolve_references(parsed.refs, vision, owner=conn.owner)
        # (content index, digest) of each image, for its pre-encode and its report
        new_images = [
            (i, p.digest) for i, p in enumerate(parsed.parts) if p.kind == "image" and p.digest
        ]
        # slots for the encodes this item starts, taken before anything of it is stored
        starts = {digest for _, digest in new_images if digest not in conn.pending}
        permit = await admit_encodes(starts, vision, owner=conn.owner, also=(conn.encode_quota,))
        try:
            await self._add(event, item_id, parsed, new_images, permit)
        finally:
            permit.close()  # the slots no pre-encode took (the item was refused)

    async def _add(
        self,
        event: rt.ConversationItemCreate,
        item_id: str,
        parsed: ParsedContent,
        new_images: list[tuple[int, str]],
        permit: EncodePermit,
    ) -> None:
        conn, sender = self._conn, self._sender
        assert conn.session is not None
        item, limits = event.item, self._limits
        vision = self._vision
        await add_inline_images(parsed.inline, vision, owner=conn.owner)
        stored = StoredItem(id=item_id, role=stored_role(item), parts=parsed.parts)
        new_digests = parsed.digests

        def insert(session: Session) -> str | None:
            if any(i.id == item_id for i in session.items):
                raise GatewayError(
                    "invalid_request", f"item id {item_id!r} already exists", param="item.id"
                )
            check_item_count(len(session.items) + 1, limits, None)
            check_image_count(set(session.image_digests) | new_digests, limits, None)
            check_conversation_size(
                conversation_chars(session.instructions, [*session.items, stored]), limits, None
            )
            previous = _insert(session.items, stored, event.previous_item_id)
            check_placement(
                session.items, next(n for n, i in enumerate(session.items) if i is stored)
            )
            return previous

        conn.session, previous = await self._sessions.update(conn.session.id, conn.owner, insert)
        await sender.send(rt.ConversationItemAdded(sender.eid(), wire_item(stored), previous))
        if not new_images:
            await sender.send(rt.ConversationItemDone(sender.eid(), wire_item(stored), previous))
            return
        # pre-encode now, before the question arrives; a response joins these tasks
        tasks: list[tuple[int, str, asyncio.Task[Resolved]]] = []
        for index, digest in new_images:
            task = conn.pending.get(digest)
            if task is None:
                task = conn.pending[digest] = vision.start(
                    conn.owner, digest, item_id=stored.id, session_id=conn.session.id
                )
                permit.attach(digest, task)
            tasks.append((index, digest, task))
        watcher = asyncio.create_task(self._watch_encodes(stored, previous, tasks, event.event_id))
        conn.watchers[watcher] = [task for _, _, task in tasks]
        watcher.add_done_callback(lambda w: conn.watchers.pop(w, None))

    async def _watch_encodes(
        self,
        stored: StoredItem,
        previous: str | None,
        tasks: list[tuple[int, str, asyncio.Task[Resolved]]],
        event_id: str | None,
    ) -> None:
        conn, sender = self._conn, self._sender
        assert conn.session is not None
        failed: GatewayError | None = None
        for index, digest, task in tasks:
            try:
                resolved = await asyncio.shield(task)
            except GatewayError as exc:
                failed = exc
            except Exception as exc:  # an encoder fault: reported, never a silent stall
                log.exception("pre_encode_failed", digest=digest[:12])
                failed = GatewayError("internal_error", f"encoding failed: {type(exc).__name__}")
            if failed is not None:
                if conn.pending.get(digest) is task:
                    conn.pending.pop(digest, None)
                break
            encoded = resolved.source in ("encoded", "joined")
            await sender.send(
                rt.ImageEncoded(
                    sender.eid(),
                    item_id=stored.id,
                    content_index=index,
                    digest=digest,
                    tokens_kept=resolved.image.tokens_kept,
                    tokens_total=resolved.image.tokens_total,
                    encode_ms=round(
                        sum(v for k, v in resolved.image.timings_ms.items() if k in ENCODE_STAGES),
                        3,
                    )
                    if encoded
                    else 0.0,
                    cache="miss" if encoded else "hit",
                )
            )
        if failed is not None:
            # the item never becomes part of the conversation
            def remove(session: Session) -> None:
                session.items[:] = [i for i in session.items if i.id != stored.id]

            try:
                conn.session, _ = await self._sessions.update(conn.session.id, conn.owner, remove)
            except GatewayError:
                log.warning("failed_item_not_removed", item_id=stored.id)
            failed.message = f"item {stored.id}: {failed.message}"
            await sender.send_error(failed, event_id)
            return
        await sender.send(rt.ConversationItemDone(sender.eid(), wire_item(stored), previous))
        self._warm_up()

    async def settle(self) -> None:
        """Wait for the item watchers (at the connection's end): each runs to its end, bounded
        by its encode, so one whose image fails still removes the item from the session."""
        if self._conn.watchers:
            await asyncio.gather(*list(self._conn.watchers), return_exceptions=True)

    def _warm_up(self) -> None:
        """Prefill the conversation through its latest item while they type (not with session
        tools: the warm-up renders no tools prompt, so its prefix would not be the response's;
        nor when a response was already asked for: it prefills the conversation itself).
        One warm-up at a time per connection: items that arrive while one runs are warmed by
        one more after it, from the session as it is then (a burst of items costs two)."""
        conn = self._conn
        if not self._warmup or conn.tools.tools or conn.responding or not conn.session:
            return
        if self._warming is not None and not self._warming.done():
            self._warm_again = True
            return
        self._warm_again = False
        self._warming = self._service.schedule_warm_up(
            conn.session.id, conn.owner, pending=conn.pending
        )
        if self._warming is not None:
            self._warming.add_done_callback(self._warmed)

    def _warmed(self, _: asyncio.Future[Any]) -> None:
        if self._warm_again and self._conn.phase is ConnState.OPEN:
            self._warm_up()

    async def retrieve(self, event: rt.ConversationItemRetrieve) -> None:
        conn, sender = self._conn, self._sender
        assert conn.session is not None
        conn.session = await self._sessions.load(conn.session.id, conn.owner)
        item = find_item(conn.session.items, event.item_id)
        await sender.send(rt.ConversationItemRetrieved(sender.eid(), wire_item(item)))

    async def delete(self, event: rt.ConversationItemDelete) -> None:
        conn, sender = self._conn, self._sender
        assert conn.session is not None

        def delete(session: Session) -> None:
            delete_item(session.items, event.item_id)

        conn.session, _ = await self._sessions.update(conn.session.id, conn.owner, delete)
        await sender.send(rt.ConversationItemDeleted(sender.eid(), event.item_id))

    async def truncate(self, event: rt.ConversationItemTruncate) -> None:
        conn, sender = self._conn, self._sender
        assert conn.session is not None

        def truncate(session: Session) -> None:
            truncate_item(session.items, event.item_id, event.content_index, event.audio_end_ms)

        conn.session, _ = await self._sessions.update(conn.session.id, conn.owner, truncate)
        await sender.send(
            rt.ConversationItemTruncated(
                sender.eid(), event.item_id, event.content_index, event.audio_end_ms
            )
        )


def _insert(
    items: list[StoredItem], stored: StoredItem, previous_item_id: str | None
) -> str | None:
    """Place `stored` after `previous_item_id` ("root": first; None: last); returns the id of
    the item now before it."""
    if previous_item_id is None:
        previous = items[-1].id if items else None
        items.append(stored)
        return previous
    if previous_item_id == "root":
        items.insert(0, stored)
        return None
    for index, existing in enumerate(items):
        if existing.id == previous_item_id:
            items.insert(index + 1, stored)
            return previous_item_id
    raise GatewayError(
        "invalid_request",
        f"previous_item_id {previous_item_id!r} not found",
        param="previous_item_id",
    )
