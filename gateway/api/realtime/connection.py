"""`/v1/realtime`: one WebSocket connection speaking the Realtime API's text-and-image subset.

A connection owns one session (new, or resumed with `?session_id=`), at most one response in
progress, and the pre-encodes of the images it has sent. Every client frame is decoded by one
made-once decoder; anything wrong with a frame becomes an `error` event echoing the client's
`event_id`, and the connection stays open. The codec refuses frames of the wrong shape
(`invalid_event`); the values in them are checked by the request layer
(`gateway.chat.requests`), with the same codes as over HTTP. Images start encoding the moment
their item arrives, at most `max_pending_encodes_per_connection` at a time per connection (and
`max_pending_encodes_per_key` per API key): an item past either is refused with `rate_limited`
and nothing of it is kept. A model named in the URL (`?model=`, as the OpenAI SDKs send it) or in
`session.update` must be the served one (the one `/v1/models` lists): another is refused with
`model_not_found`, the connection closed (URL) or the session left unchanged (update).

Function tools set by `session.update` live with the connection; a `response.create` may
replace them for itself. A response reads the conversation (or its own `input`) through
`realtime_items.joined`, so function calls reach the model as Chat Completions renders them;
its events are built by `realtime_output.ResponseOutput`, and an answer that called tools is
stored as the items it showed (`realtime_items.split_answer_item`).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from litestar import WebSocket, websocket
from litestar.handlers import WebsocketRouteHandler

from encoder_worker.types import ENCODE_STAGES
from gateway.api.realtime import protocol as rt
from gateway.api.realtime.items import (
    call_ids,
    check_placement,
    content_parts,
    delete_item,
    find_item,
    input_context,
    joined,
    parse_item,
    plan_realtime_tools,
    split_answer_item,
    stored_role,
    truncate_item,
    wire_item,
)
from gateway.api.realtime.output import ResponseOutput
from gateway.chat.events import Finished, ResponseOptions
from gateway.chat.output_grammar import plain_text_grammar
from gateway.chat.requests import (
    ParsedContent,
    RequestLimits,
    add_inline_images,
    admit_encodes,
    check_conversation_size,
    check_image_count,
    check_instructions,
    check_item_count,
    check_max_tokens,
    check_model,
    check_output_modalities,
    check_sampling,
    conversation_chars,
    fetch_remote,
    resolve_references,
    response_options,
)
from gateway.chat.vision_resolver import EncodeQuota
from gateway.policy.auth import QUERY_KEY_REFUSED, public_subprotocol
from gateway.policy.ratelimit import SMALL_BODY, counts_as_refused, refused_error
from gateway.protocol.errors import GatewayError
from gateway.protocol.subprotocols import MSGPACK_SUBPROTOCOL
from gateway.server.state import not_ready
from gateway.sessions.session import Session, StoredItem, new_id

if TYPE_CHECKING:
    from gateway.chat.output_grammar import ToolPlan
    from gateway.chat.vision_resolver import EncodePermit, Resolved
    from gateway.server.state import GatewayState

__all__ = ("RealtimeConnection", "realtime_route", "session_state", "wire_item")

log = structlog.get_logger("visiongate.realtime")


class ConnState(enum.Enum):
    CONNECTING = "connecting"
    OPEN = "open"
    CLOSED = "closed"


# session events stay small however long the conversation: the latest items, each text clipped;
# the whole history is paged from GET /v1/sessions/{id}
EVENT_ITEMS = 32
EVENT_TEXT_CHARS = 2048


def _clipped(text: str) -> str:
    if len(text) <= EVENT_TEXT_CHARS:
        return text
    return text[:EVENT_TEXT_CHARS] + f"... ({len(text)} chars)"


def _summary_item(item: StoredItem) -> rt.Item:
    wired = wire_item(item)
    if isinstance(wired, rt.MessageItem):
        for part in wired.content:
            if part.text is not None:
                part.text = _clipped(part.text)
    elif isinstance(wired, rt.FunctionCallItem):
        wired.arguments = _clipped(wired.arguments)
    else:
        wired.output = _clipped(wired.output)
    return wired


@dataclass(slots=True)
class SessionTools:
    """The function tools `session.update` set: they live with the connection (as an OpenAI
    Realtime session does), checked when set."""

    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


def session_state(
    session: Session,
    model: str,
    *,
    resumed: bool = False,
    with_items: bool = True,
    tools: SessionTools | None = None,
) -> rt.SessionState:
    """The session as its events show it: settings, the item count and (on session.created)
    the latest `EVENT_ITEMS` items with clipped texts; never the whole history."""
    ext: dict[str, object] = {
        "temperature": session.temperature,
        "top_p": session.top_p,
        "seed": session.seed,
        "truncation": session.truncation,
        "resumed": resumed,
        "item_count": len(session.items),
    }
    if with_items:
        ext["items"] = [_summary_item(i) for i in session.items[-EVENT_ITEMS:]]
        ext["items_omitted"] = max(len(session.items) - EVENT_ITEMS, 0)
    tools = tools or SessionTools()
    return rt.SessionState(
        id=session.id,
        model=model,
        instructions=_clipped(session.instructions),
        max_output_tokens=session.max_output_tokens,
        tools=tools.tools,
        tool_choice=tools.tool_choice,
        parallel_tool_calls=tools.parallel_tool_calls,
        visiongate=ext,
    )


def realtime_route(state: GatewayState) -> WebsocketRouteHandler:
    """`/v1/realtime`: authenticate the upgrade, then hand the socket to a `RealtimeConnection`."""

    @websocket("/v1/realtime")
    async def realtime(socket: WebSocket) -> None:
        query = socket.query_params
        offered = socket.scope.get("subprotocols") or []
        if "api_key" in query:
            # accepted only to say why: a refusal before the handshake reaches a browser as a
            # bare 403 with no reason
            await socket.accept(subprotocols=public_subprotocol(offered))
            await socket.close(code=1008, reason=QUERY_KEY_REFUSED)
            return
        try:
            owner = state.auth.owner(socket.headers, offered)
        except GatewayError as exc:
            await socket.close(code=1008, reason=exc.message)
            return
        await RealtimeConnection(socket, state, owner).run(
            query.get("session_id"), model=query.get("model")
        )

    return realtime


class RealtimeConnection:
    """The state of one WebSocket: transitions CONNECTING -> OPEN -> CLOSED, never back."""

    def __init__(self, socket: WebSocket, state: GatewayState, owner: str) -> None:
        self.socket = socket
        self.state = state
        self.owner = owner
        self.conn_state = ConnState.CONNECTING
        self.codec = rt.WireCodec()
        self.limits = RequestLimits.of(state.settings)
        self.session: Session | None = None
        self.response_task: asyncio.Task[None] | None = None
        self.response_options: ResponseOptions | None = None
        self.tools = SessionTools()
        self.pending: dict[str, asyncio.Task[Resolved]] = {}  # digest -> pre-encode
        # pre-encodes this connection started and that have not finished
        self.encode_quota = EncodeQuota(
            state.settings.max_pending_encodes_per_connection, "this connection"
        )
        # item watchers -> the encodes they wait for
        self.watchers: dict[asyncio.Task[None], list[asyncio.Task[Resolved]]] = {}
        self._send_lock = asyncio.Lock()
        self._event_seq = 0
        self._warming: asyncio.Task[Any] | None = None  # this connection's KV warm-up
        self._warm_again = False  # items arrived while it ran

    # ------------------------------------------------------------ lifecycle

    async def run(self, session_id: str | None, *, model: str | None = None) -> None:
        # answer with a subprotocol that carries no key: never echo `openai-insecure-api-key.*`
        chosen = public_subprotocol(self.socket.scope.get("subprotocols") or [])
        self.codec = rt.WireCodec(binary=chosen == MSGPACK_SUBPROTOCOL)
        await self.socket.accept(subprotocols=chosen)
        self._transition(ConnState.OPEN)
        if not self.state.ready:  # in the negotiated codec, then "try again later"
            await self._send_error(not_ready(), None)
            await self.socket.close(code=1013, reason="not ready")
            self._transition(ConnState.CLOSED)
            return
        try:
            check_model(model, self.state.engine.model_id, "model")
        except GatewayError as exc:  # a client built for another model: say so, then close
            await self._send_error(exc, None)
            await self.socket.close(code=1008, reason=exc.code)
            self._transition(ConnState.CLOSED)
            return
        metrics = self.state.metrics
        metrics.ws_connection_opened()
        try:
            if not await self._open_session(session_id):
                return
            await self._receive_loop()
        finally:
            self._transition(ConnState.CLOSED)
            metrics.ws_connection_closed()
            await self._shutdown()

    def _transition(self, new: ConnState) -> None:
        legal = {
            ConnState.CONNECTING: {ConnState.OPEN, ConnState.CLOSED},
            ConnState.OPEN: {ConnState.CLOSED},
            ConnState.CLOSED: {ConnState.CLOSED},
        }
        assert new in legal[self.conn_state], f"illegal transition {self.conn_state} -> {new}"
        self.conn_state = new

    async def _open_session(self, session_id: str | None) -> bool:
        settings = self.state.settings
        if session_id:
            try:
                self.session = await self.state.sessions.load(session_id, self.owner)
            except GatewayError as exc:
                await self._send_error(exc, None)
                not_found = exc.code == "session_not_found"
                await self.socket.close(code=1008 if not_found else 1013, reason=exc.code)
                return False
            await self._send(
                rt.SessionCreated(
                    self._eid(),
                    session_state(self.session, self.state.engine.model_id, resumed=True),
                )
            )
            log.info("session_resumed", session_id=self.session.id, items=len(self.session.items))
            return True
        self.session = Session.new(
            self.owner,
            instructions=settings.default_instructions,
            max_output_tokens=settings.max_output_tokens,
        )
        try:
            await self.state.sessions.save(self.session)
        except GatewayError as exc:  # the session store is down: "try again later"
            await self._send_error(exc, None)
            await self.socket.close(code=1013, reason=exc.code)
            return False
        await self._send(
            rt.SessionCreated(self._eid(), session_state(self.session, self.state.engine.model_id))
        )
        log.info("session_created", session_id=self.session.id)
        return True

    async def _shutdown(self) -> None:
        # A client that goes away mid-response frees the engine at once; pre-encodes are left
        # to finish, since their tokens land in the shared cache for the next turn.
        if self.response_options is not None:
            self.response_options.cancel.set()
        if self.response_task is not None and not self.response_task.done():
            self.response_task.cancel()
            await asyncio.gather(self.response_task, return_exceptions=True)
        # image watchers run to their end (bounded by the encode): one whose image fails still
        # removes the item from the session; their events go nowhere now
        if self.watchers:
            await asyncio.gather(*list(self.watchers), return_exceptions=True)

    async def _receive_loop(self) -> None:
        while True:
            message = await self.socket.receive()
            if message["type"] == "websocket.disconnect":
                return
            frame: Any = message.get("text")
            if frame is None:
                frame = message.get("bytes")
            if frame is None:
                continue
            await self._handle_frame(frame)

    # ------------------------------------------------------------ events

    async def _handle_frame(self, frame: str | bytes) -> None:
        event_id = None
        # large frames as large HTTP bodies (gateway/api/http/body_guard.py): counted when refused,
        # and not decoded while the key's refused bytes are over the limit
        refused = self.state.refused
        size = len(frame) if isinstance(frame, bytes) or frame.isascii() else len(frame.encode())
        large = size > SMALL_BODY
        if large:
            retry = refused.retry_after(self.owner)
            if retry is not None:  # not decoded: its event id is unknown
                await self._send_error(refused_error(refused.limit, retry), None)
                return
        try:
            event = self.codec.decode(frame)
            event_id = event.event_id
            if isinstance(event, rt.ConversationItemCreate):
                await self._item_create(event)
            elif isinstance(event, rt.ResponseCreate):
                await self._response_create(event)
            elif isinstance(event, rt.ResponseCancel):
                await self._response_cancel(event)
            elif isinstance(event, rt.SessionUpdate):
                await self._session_update(event)
            elif isinstance(event, rt.ConversationItemRetrieve):
                await self._item_retrieve(event)
            elif isinstance(event, rt.ConversationItemDelete):
                await self._item_delete(event)
            elif isinstance(event, rt.ConversationItemTruncate):
                await self._item_truncate(event)
        except GatewayError as exc:
            if large and counts_as_refused(exc.http_status):
                refused.add(self.owner, size)
            decoded_id = getattr(exc, "event_id", None)
            await self._send_error(exc, decoded_id if decoded_id is not None else event_id)
        except Exception as exc:  # a bug must not take the connection down with it
            log.exception("realtime_event_failed")
            await self._send_error(
                GatewayError("internal_error", f"internal error: {type(exc).__name__}"), event_id
            )

    async def _session_update(self, event: rt.SessionUpdate) -> None:
        assert self.session is not None
        cfg, limits = event.session, self.limits
        check_model(cfg.model, self.state.engine.model_id, "session.model")
        check_sampling(cfg.temperature, cfg.top_p, cfg.seed, where="session.")
        check_output_modalities(cfg.output_modalities, "session.output_modalities")
        max_tokens = check_max_tokens(
            cfg.max_output_tokens,
            limits.max_output_tokens_limit,
            "session.max_output_tokens",
            allow_inf=True,
        )
        check_instructions(cfg.instructions, limits, "session.instructions")
        tools = SessionTools(
            cfg.tools if cfg.tools is not None else self.tools.tools,
            cfg.tool_choice if cfg.tool_choice is not None else self.tools.tool_choice,
            cfg.parallel_tool_calls
            if cfg.parallel_tool_calls is not None
            else self.tools.parallel_tool_calls,
        )
        plan_realtime_tools(
            tools.tools,
            tools.tool_choice,
            tools.parallel_tool_calls,
            tools_param="session.tools",
            choice_param="session.tool_choice",
        )

        def apply(session: Session) -> None:
            if cfg.instructions is not None:
                check_conversation_size(
                    conversation_chars(cfg.instructions, session.items),
                    limits,
                    "session.instructions",
                )
                session.instructions = cfg.instructions
            if max_tokens is not None:
                session.max_output_tokens = max_tokens
            if cfg.temperature is not None:
                session.temperature = cfg.temperature
            if cfg.top_p is not None:
                session.top_p = cfg.top_p
            if cfg.seed is not None:
                session.seed = cfg.seed
            if cfg.truncation is not None:
                session.truncation = cfg.truncation

        self.session, _ = await self.state.sessions.update(self.session.id, self.owner, apply)
        self.tools = tools
        await self._send(
            rt.SessionUpdated(
                self._eid(),
                session_state(
                    self.session, self.state.engine.model_id, with_items=False, tools=tools
                ),
            )
        )

    async def _item_create(self, event: rt.ConversationItemCreate) -> None:
        assert self.session is not None
        item, limits = event.item, self.limits
        item_id = item.id or new_id("item")
        fetched = None
        if isinstance(item, rt.MessageItem):
            fetched = await fetch_remote(content_parts(item), limits, param="item.content")
        parsed = parse_item(item, limits, fetched, call_ids(self.session.items))
        vision = self.state.require().vision
        await resolve_references(parsed.refs, vision, owner=self.owner)
        # (content index, digest) of each image, for its pre-encode and its report
        new_images = [
            (i, p.digest) for i, p in enumerate(parsed.parts) if p.kind == "image" and p.digest
        ]
        # slots for the encodes this item starts, taken before anything of it is stored
        starts = {digest for _, digest in new_images if digest not in self.pending}
        permit = await admit_encodes(starts, vision, owner=self.owner, also=(self.encode_quota,))
        try:
            await self._add_item(event, item_id, parsed, new_images, permit)
        finally:
            permit.close()  # the slots no pre-encode took (the item was refused)

    async def _add_item(
        self,
        event: rt.ConversationItemCreate,
        item_id: str,
        parsed: ParsedContent,
        new_images: list[tuple[int, str]],
        permit: EncodePermit,
    ) -> None:
        assert self.session is not None
        item, limits = event.item, self.limits
        vision = self.state.require().vision
        await add_inline_images(parsed.inline, vision, owner=self.owner)
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

        self.session, previous = await self.state.sessions.update(
            self.session.id, self.owner, insert
        )
        await self._send(rt.ConversationItemAdded(self._eid(), wire_item(stored), previous))
        if not new_images:
            await self._send(rt.ConversationItemDone(self._eid(), wire_item(stored), previous))
            return
        # pre-encode now, before the question arrives; a response joins these tasks
        tasks: list[tuple[int, str, asyncio.Task[Resolved]]] = []
        for index, digest in new_images:
            task = self.pending.get(digest)
            if task is None:
                task = self.pending[digest] = vision.start(
                    self.owner, digest, item_id=stored.id, session_id=self.session.id
                )
                permit.attach(digest, task)
            tasks.append((index, digest, task))
        watcher = asyncio.create_task(self._watch_encodes(stored, previous, tasks, event.event_id))
        self.watchers[watcher] = [task for _, _, task in tasks]
        watcher.add_done_callback(lambda w: self.watchers.pop(w, None))

    async def _watch_encodes(
        self,
        stored: StoredItem,
        previous: str | None,
        tasks: list[tuple[int, str, asyncio.Task[Resolved]]],
        event_id: str | None,
    ) -> None:
        assert self.session is not None
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
                if self.pending.get(digest) is task:
                    self.pending.pop(digest, None)
                break
            encoded = resolved.source in ("encoded", "joined")
            await self._send(
                rt.ImageEncoded(
                    self._eid(),
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
                self.session, _ = await self.state.sessions.update(
                    self.session.id, self.owner, remove
                )
            except GatewayError:
                log.warning("failed_item_not_removed", item_id=stored.id)
            failed.message = f"item {stored.id}: {failed.message}"
            await self._send_error(failed, event_id)
            return
        await self._send(rt.ConversationItemDone(self._eid(), wire_item(stored), previous))
        self._warm_up()

    def _warm_up(self) -> None:
        """Prefill the conversation through its latest item while they type (not with session
        tools: the warm-up renders no tools prompt, so its prefix would not be the response's;
        nor when a response was already asked for: it prefills the conversation itself).
        One warm-up at a time per connection: items that arrive while one runs are warmed by
        one more after it, from the session as it is then (a burst of items costs two)."""
        asked = self.response_task is not None and not self.response_task.done()
        if not self.state.settings.kv_warmup or self.tools.tools or asked or not self.session:
            return
        if self._warming is not None and not self._warming.done():
            self._warm_again = True
            return
        self._warm_again = False
        self._warming = self.state.require().service.schedule_warm_up(
            self.session.id, self.owner, pending=self.pending
        )
        if self._warming is not None:
            self._warming.add_done_callback(self._warmed)

    def _warmed(self, _: asyncio.Future[Any]) -> None:
        if self._warm_again and self.conn_state is ConnState.OPEN:
            self._warm_up()

    async def _response_create(self, event: rt.ResponseCreate) -> None:
        received = time.perf_counter()
        assert self.session is not None
        if self.response_task is not None and not self.response_task.done():
            raise GatewayError(
                "response_in_progress",
                f"response {self.response_options.response_id} is still in progress; "
                "cancel it or wait for response.done",
            )
        params = event.response or rt.ResponseParams()
        check_output_modalities(params.output_modalities, "response.output_modalities")
        if params.conversation not in (None, "auto", "none"):
            raise GatewayError(
                "invalid_request",
                'conversation is "auto" (the session\'s) or "none" (out-of-band)',
                param="response.conversation",
            )
        options = response_options(
            self.limits,
            where="response.",
            max_tokens=params.max_output_tokens,
            allow_inf=True,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            instructions=params.instructions,
            store=params.conversation != "none",
        )
        # the answer's token budget bounds the calls' arguments, as over HTTP
        budget = min(
            options.max_output_tokens or self.session.max_output_tokens,
            self.limits.max_output_tokens_limit,
        )
        _apply_plan(options, self._response_tools(params, budget))
        await self.state.rate_limiter.acquire(self.owner)
        # watchers whose encodes are over are about to report (and drop a failed image's item):
        # let them, so this response sees the conversation the client was told about
        settled = [w for w, encodes in self.watchers.items() if all(t.done() for t in encodes)]
        if settled:
            await asyncio.gather(*settled, return_exceptions=True)
        # the stored session is the truth (another connection may have added to it)
        load_start = time.time_ns()
        self.session = await self.state.sessions.load(self.session.id, self.owner)
        options.session_load_ns = (load_start, time.time_ns())
        context, permit = self.session.items, None
        if params.input is not None:  # this response's own context, never stored
            context, permit = await input_context(
                params.input,
                self.session.items,
                self.limits,
                self.state.require().vision,
                owner=self.owner,
                started=set(self.pending),
                quota=self.encode_quota,
            )
            if not context and not (
                options.instructions or self.session.instructions or options.tools_prompt
            ):
                permit.close()
                raise GatewayError(
                    "invalid_request",
                    "response.input holds no items and there are no instructions to answer",
                    param="response.input",
                )
        # what the model reads: function_call items joined to the answer that made them
        view = msgspec.structs.replace(self.session, items=joined(context))
        if options.grammar is None and any(i.role == "tool" for i in view.items):
            options.grammar = plain_text_grammar()  # no tools now: answer the results in words
        self.response_options = options
        self.response_task = asyncio.create_task(
            self._run_response(options, params, view, event.event_id, received),
            name=f"response {options.response_id}",
        )
        if permit is not None:  # the input's encode slots, held until the response ends
            self.response_task.add_done_callback(lambda _: permit.close())

    def _response_tools(self, params: rt.ResponseParams, budget: int) -> ToolPlan | None:
        """The response's tools, each field its own or else the session's."""
        own_tools, own_choice = params.tools is not None, params.tool_choice is not None
        session = self.tools
        return plan_realtime_tools(
            params.tools if own_tools else session.tools,
            params.tool_choice if own_choice else session.tool_choice,
            params.parallel_tool_calls
            if params.parallel_tool_calls is not None
            else session.parallel_tool_calls,
            tools_param="response.tools" if own_tools else "session.tools",
            choice_param="response.tool_choice" if own_choice else "session.tool_choice",
            budget=budget,
        )

    async def _response_cancel(self, event: rt.ResponseCancel) -> None:
        active = self.response_task is not None and not self.response_task.done()
        if not active or (
            event.response_id and event.response_id != self.response_options.response_id
        ):
            raise GatewayError(
                "response_not_found",
                "no response in progress"
                + (f" with id {event.response_id!r}" if event.response_id else ""),
                param="response_id",
            )
        self.response_options.cancel.set()

    async def _run_response(
        self,
        options: ResponseOptions,
        params: rt.ResponseParams,
        view: Session,
        event_id: str | None,
        received: float,
    ) -> None:
        rid, iid = options.response_id, options.item_id
        output = ResponseOutput(
            options,
            send=self._send,
            eid=self._eid,
            conversation=view.id if options.store else None,
            metadata=params.metadata,
            model=self.state.engine.model_id,
        )
        finished = False
        try:
            async for ev in self.state.require().service.respond(
                view, options, pending=self.pending, received_at=received
            ):
                if isinstance(ev, Finished):
                    finished = True
                    await self._finish(ev, output, event_id)
                else:
                    await output.on_event(ev)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave a client waiting for a response.done
            log.exception("response_failed", response_id=rid)
            if not finished:
                error = GatewayError("internal_error", f"the response failed: {type(exc).__name__}")
                await self._finish(Finished(rid, iid, "failed", "", error=error), output, event_id)

    async def _finish(self, ev: Finished, output: ResponseOutput, event_id: str | None) -> None:
        options = output.options
        if ev.status != "failed":
            await output.close_items(ev)
            if options.store and options.tools and ev.store_error is None:
                await self._split_answer(options.item_id)
        elif ev.error is not None:
            await self._send_error(ev.error, event_id)
        await output.done(ev)
        if ev.store_error is not None:  # the answer went out; its record in the session did not
            await self._send_error(ev.store_error, event_id)

    async def _split_answer(self, item_id: str) -> None:
        """The stored answer becomes the items the response showed (message, function calls)."""
        assert self.session is not None
        try:
            self.session, _ = await self.state.sessions.update(
                self.session.id, self.owner, lambda s: split_answer_item(s.items, item_id)
            )
        except GatewayError as exc:  # the answer stays one item: it reads the same to the model
            log.warning("answer_not_split", item_id=item_id, code=exc.code)

    # ------------------------------------------------------------ items

    async def _item_retrieve(self, event: rt.ConversationItemRetrieve) -> None:
        assert self.session is not None
        self.session = await self.state.sessions.load(self.session.id, self.owner)
        item = find_item(self.session.items, event.item_id)
        await self._send(rt.ConversationItemRetrieved(self._eid(), wire_item(item)))

    async def _item_delete(self, event: rt.ConversationItemDelete) -> None:
        assert self.session is not None

        def delete(session: Session) -> None:
            delete_item(session.items, event.item_id)

        self.session, _ = await self.state.sessions.update(self.session.id, self.owner, delete)
        await self._send(rt.ConversationItemDeleted(self._eid(), event.item_id))

    async def _item_truncate(self, event: rt.ConversationItemTruncate) -> None:
        assert self.session is not None

        def truncate(session: Session) -> None:
            truncate_item(session.items, event.item_id, event.content_index, event.audio_end_ms)

        self.session, _ = await self.state.sessions.update(self.session.id, self.owner, truncate)
        await self._send(
            rt.ConversationItemTruncated(
                self._eid(), event.item_id, event.content_index, event.audio_end_ms
            )
        )

    # ------------------------------------------------------------ sending

    def _eid(self) -> str:
        self._event_seq += 1
        return f"event_{self._event_seq:06d}"

    async def _send(self, event: rt.ServerEvent) -> None:
        if self.conn_state is not ConnState.OPEN:
            return
        data = self.codec.encode(event)
        async with self._send_lock:
            try:
                if self.codec.binary:
                    await self.socket.send_bytes(data)
                else:
                    await self.socket.send_text(data.decode())
            except Exception:  # the peer went away; the receive loop will see the disconnect
                log.debug("send_failed", event_type=type(event).__name__)

    async def _send_error(self, exc: GatewayError, event_id: str | None) -> None:
        self.state.metrics.record_error(code=exc.code, api="realtime")
        log.info("client_error", code=exc.code, message=exc.message, event_id=event_id)
        await self._send(
            rt.ErrorEvent(
                self._eid(),
                rt.ErrorBody(
                    type=exc.type,
                    code=exc.code,
                    message=exc.message,
                    param=exc.param,
                    event_id=event_id,
                ),
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


def _apply_plan(options: ResponseOptions, plan: ToolPlan | None) -> None:
    """Tools as the HTTP APIs apply them: listed under every choice (one prompt, one KV
    prefix); under "none" the grammar keeps the answer plain text, never read for calls."""
    if plan is not None:
        options.grammar = plan.grammar
        options.tools_prompt = plan.prompt
        options.tools = plan.choice != "none"
