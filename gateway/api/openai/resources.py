"""Serving the small resources of the HTTP API: models, uploaded images, sessions.

Like the chat serving layer, these return values (`ErrorResponse` for a refusal) and leave
HTTP to the routes. Images are content-addressed (the digest is the name) but private to the
API key that sent them, and sessions belong to one API key: another key's image or session is
indistinguishable from an unknown one.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import TYPE_CHECKING

import structlog

from gateway.api.openai.chat import protocol as p
from gateway.chat.image_input import REF_PREFIX, digest_of
from gateway.chat.requests import (
    DEFAULT_MODEL,
    RequestLimits,
    check_image_bytes,
    check_session_id,
)
from gateway.chat.service import kv_key_for
from gateway.chat.vision_resolver import encode_ms
from gateway.protocol.errors import GatewayError
from gateway.sessions.session import Session, StoredItem

if TYPE_CHECKING:
    from gateway.chat.vision_resolver import Resolved
    from gateway.server.state import GatewayState

__all__ = (
    "SYNTHETIC_VISION_LABEL",
    "ImageServing",
    "ModelServing",
    "SessionServing",
    "session_view",
    "vision_label",
)

log = structlog.get_logger("visiongate.http")


SYNTHETIC_VISION_LABEL = "synthetic seeded tower, answers not grounded"


def vision_label(state: GatewayState) -> str:
    """What encodes the images, in words: the seeded synthetic tower (labelled as such), a
    vision-only checkpoint with the seeded projector, or a VLM checkpoint's own encoder."""
    import os

    from encoder_worker.config import SYNTHETIC_TOWERS, tower_family

    settings = state.settings
    if settings.engine == "openai" and settings.upstream_images == "data_url":
        return "the upstream model's own vision encoder (images sent as data URLs)"
    config = getattr(state.serving.encoder, "config", None) if state.serving else None
    tower = config.tower if config is not None else settings.vision_tower
    try:
        family = tower_family(tower) or (
            tower_family(settings.model_path) if config is None and settings.model_path else None
        )
    except ValueError:
        family = None
    if family is not None:
        name = os.path.basename(os.path.normpath(settings.model_path or tower))
        return f"{family} checkpoint {name}: its own vision tower and projector"
    if tower in SYNTHETIC_TOWERS:
        return SYNTHETIC_VISION_LABEL
    return (
        f"vision checkpoint {os.path.basename(os.path.normpath(tower))} with a seeded "
        "projector, answers not grounded"
    )


class ModelServing:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self._vision: str | None = None

    def _card(self) -> p.ModelCard:
        if self._vision is None or not self.state.ready:
            self._vision = vision_label(self.state)
        engine = self.state.engine
        return p.ModelCard(
            id=engine.model_id,
            created=int(self.state.started_at),
            vision=self._vision,
            max_model_len=engine.context_tokens if engine.ready else None,
            root=engine.model_id,
        )

    def list(self) -> p.ModelList:
        return p.ModelList(data=[self._card()])

    def get(self, model: str) -> p.ModelCard | p.ErrorResponse:
        if model not in (self.state.engine.model_id, DEFAULT_MODEL):
            return p.error_response(
                GatewayError(
                    "model_not_found", f"the model {model!r} does not exist", param="model"
                )
            )
        return self._card()


class ImageServing:
    """`POST /v1/images` stores the bytes and starts encoding; the status is polled by digest.

    Both are per owner: an image is visible only to the API key that uploaded (or otherwise
    sent) it, another key's digest reads as unknown (404), and a key's status says "ready" only
    once that key has been given the tokens (its first upload of bytes another key sent is
    reported, and takes as long, as an encode of its own). An upload is refused with
    `rate_limited` (429) when the key has `max_pending_encodes_per_key` encodes pending; then
    nothing of it is kept. With a `session_id` the upload is also a hint that the session's next
    turn sends this image (its question after it, in one user message): once the tokens are
    ready, the conversation so far and the image are prefilled into the engine's prefix cache
    (KV warm-up), a session not created yet counting as one with the default instructions."""

    MAX_TRACKED = 1024  # encodes remembered for status (the cache itself remembers the rest)

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.limits = RequestLimits.of(state.settings)
        # (owner, digest) -> the encode that upload started
        self._encodes: OrderedDict[tuple[str, str], asyncio.Task[Resolved]] = OrderedDict()

    async def upload(
        self, data: bytes, *, owner: str, session_id: str | None = None
    ) -> p.ImageStatus | p.ErrorResponse:
        try:
            vision = self.state.require().vision
            fmt, width, height = check_image_bytes(data, self.limits, "file")
            if session_id is not None:
                check_session_id(session_id)
        except GatewayError as exc:
            return p.error_response(exc)
        digest = digest_of(data)
        status = await self.status(digest, owner=owner)
        if isinstance(status, p.ImageStatus) and status.status in ("encoding", "ready"):
            await vision.add(owner, digest, data)  # the bytes' lifetime starts again
        else:
            try:
                # the slot is taken before the bytes are kept: a refused upload leaves nothing
                permit = await vision.admit(owner, [digest])
            except GatewayError as exc:
                return p.error_response(exc)
            try:
                await vision.add(owner, digest, data)
                task = vision.start(owner, digest, session_id=session_id)
                permit.attach(digest, task)
                self._track(owner, digest, task)
            finally:
                permit.close()
            status = p.ImageStatus(id=digest, ref=REF_PREFIX + digest, status="encoding")
        status.bytes, status.format, status.width, status.height = len(data), fmt, width, height
        if session_id is not None and self.state.settings.kv_warmup:
            self._warm_up(owner, session_id, digest, self._encodes.get((owner, digest)))
        log.info("image_uploaded", digest=digest[:12], bytes=len(data), status=status.status)
        return status

    async def status(self, digest: str, *, owner: str) -> p.ImageStatus | p.ErrorResponse:
        digest = digest.lower().removeprefix(REF_PREFIX)
        try:
            vision = self.state.require().vision
        except GatewayError as exc:
            return p.error_response(exc)
        ref = REF_PREFIX + digest
        task = self._encodes.get((owner, digest))
        if task is not None and not task.done():
            return p.ImageStatus(id=digest, ref=ref, status="encoding")
        if task is not None and not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            error = (
                exc if isinstance(exc, GatewayError) else GatewayError("internal_error", str(exc))
            )
            return p.ImageStatus(
                id=digest, ref=ref, status="failed", error=p.error_response(error).error
            )
        image = await vision.cached(owner, digest)
        if image is not None:
            return p.ImageStatus(
                id=digest,
                ref=ref,
                status="ready",
                tokens_kept=image.tokens_kept,
                tokens_total=image.tokens_total,
                encode_ms=round(encode_ms(image), 3),
            )
        if await vision.known(owner, digest):
            return p.ImageStatus(id=digest, ref=ref, status="stored")
        return p.error_response(
            GatewayError("image_not_found", f"no image with digest {digest}", param="digest")
        )

    def _warm_up(
        self, owner: str, session_id: str, digest: str, task: asyncio.Task[Resolved] | None
    ) -> None:
        """Once the image's tokens are ready, warm the session's KV for a turn sending it."""
        settings = self.state.settings
        service = self.state.require().service

        def warm() -> None:
            blank = Session.new(
                owner,
                instructions=settings.default_instructions,
                max_output_tokens=settings.max_output_tokens,
                session_id=session_id,
            )
            service.schedule_warm_up(session_id, owner, then_image=digest, new_session=blank)

        if task is None or task.done():
            warm()
        else:
            task.add_done_callback(lambda t: t.cancelled() or t.exception() or warm())

    def _track(self, owner: str, digest: str, task: asyncio.Task[Resolved]) -> None:
        # a failed pre-encode is reported by status(); retrieve it so asyncio does not warn
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        key = (owner, digest)
        self._encodes[key] = task
        self._encodes.move_to_end(key)
        if len(self._encodes) > self.MAX_TRACKED:
            # finished entries go first, oldest first; still-running ones only past twice the
            # cap (their encodes go on regardless; only their "encoding" status is forgotten)
            for old in [k for k, t in self._encodes.items() if t.done()]:
                if len(self._encodes) <= self.MAX_TRACKED:
                    break
                del self._encodes[old]
            while len(self._encodes) > 2 * self.MAX_TRACKED:
                self._encodes.popitem(last=False)


MAX_PAGE_ITEMS = 1000


def session_view(
    session, *, after: str | None = None, limit: int = MAX_PAGE_ITEMS
) -> p.SessionView:
    """The session with a page of its items: those after the item `after` (from the first when
    None), at most `limit`. GatewayError(invalid_request) for an unknown `after`."""
    items = session.items
    start = 0
    if after is not None:
        ids = [i.id for i in items]
        if after not in ids:
            raise GatewayError(
                "invalid_request", "after names no item of this session", param="after"
            )
        start = ids.index(after) + 1
    page = items[start : start + limit]
    return p.SessionView(
        id=session.id,
        created_at=session.created_at,
        updated_at=session.updated_at,
        instructions=session.instructions,
        max_output_tokens=session.max_output_tokens,
        temperature=session.temperature,
        top_p=session.top_p,
        seed=session.seed,
        items=[_item_view(i) for i in page],
        images=session.image_digests,
        item_count=len(items),
        has_more=start + len(page) < len(items),
        usage=session.usage,
    )


def _item_view(item: StoredItem) -> p.SessionItemView:
    content: list[dict[str, object]] = []
    for part in item.parts:
        if part.kind == "image":
            content.append(
                {"type": "image_url", "image_url": {"url": REF_PREFIX + (part.digest or "")}}
            )
        elif part.kind == "tool_call":
            content.append(
                {
                    "type": "tool_call",
                    "call_id": part.call_id,
                    "name": part.name,
                    "arguments": part.text or "",
                }
            )
        elif part.call_id is not None:  # a tool's result answers the call it names
            content.append({"type": "text", "text": part.text or "", "call_id": part.call_id})
        else:
            content.append({"type": "text", "text": part.text or ""})
    return p.SessionItemView(id=item.id, role=item.role, content=content, status=item.status)


class SessionServing:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def get(
        self, session_id: str, owner: str, *, after: str | None = None, limit: int = MAX_PAGE_ITEMS
    ) -> p.SessionView | p.ErrorResponse:
        if not 1 <= limit <= MAX_PAGE_ITEMS:
            return p.error_response(
                GatewayError("invalid_request", f"limit must be 1..{MAX_PAGE_ITEMS}", param="limit")
            )
        try:
            session = await self.state.sessions.load(session_id, owner)
            return session_view(session, after=after, limit=limit)
        except GatewayError as exc:
            return p.error_response(exc)

    async def delete(self, session_id: str, owner: str) -> p.SessionDeleted | p.ErrorResponse:
        if not await self.state.sessions.delete(session_id, owner):
            return p.error_response(
                GatewayError(
                    "session_not_found",
                    f"no session {session_id!r} for this API key",
                    param="session_id",
                )
            )
        # its KV goes too: nothing of a deleted conversation is left to be matched
        self.state.engine.forget(kv_key_for(owner, session_id))
        log.info("session_deleted", session_id=session_id, api="http")
        return p.SessionDeleted(id=session_id)
