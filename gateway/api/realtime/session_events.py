"""The session of a Realtime connection: opening it, `session.update`, and how events show it.

A connection opens a new session, or resumes one by id (`?session_id=`): one the key does not
own reads as `session_not_found` (close 1008), a session store that is down as "try again
later" (1013). `session.update` checks every value in the request layer before anything is
stored, then applies them in one session-store update; its function tools live with the
connection (`SessionTools`), not in the session. `session_state` is what `session.created` and
`session.updated` carry: the settings, the item count and (on `session.created`) the latest
`EVENT_ITEMS` items with their texts clipped, never the whole history, which is paged from
`GET /v1/sessions/{id}`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import structlog

from gateway.api.realtime import protocol as rt
from gateway.api.realtime.connection_state import SessionTools
from gateway.api.realtime.items import plan_realtime_tools, wire_item
from gateway.chat.requests import (
    check_conversation_size,
    check_instructions,
    check_max_tokens,
    check_model,
    check_output_modalities,
    check_sampling,
    conversation_chars,
)
from gateway.protocol.errors import GatewayError
from gateway.sessions.session import Session, StoredItem

if TYPE_CHECKING:
    from gateway.api.realtime.connection_state import ConnectionState
    from gateway.api.realtime.event_sender import EventSender
    from gateway.chat.requests import RequestLimits
    from gateway.sessions.session import SessionStore

__all__ = ("EVENT_ITEMS", "SessionEvents", "session_state")

log = structlog.get_logger("visiongate.realtime")

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
        "usage": session.usage,  # what the stored conversation's answers have cost so far
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


class SessionEvents:
    """Opening the connection's session, `session.update`, and the settings an ephemeral key
    was minted with."""

    __slots__ = ("_conn", "_default_instructions", "_limits", "_model", "_sender", "_sessions")

    def __init__(
        self,
        conn: ConnectionState,
        sender: EventSender,
        sessions: SessionStore,
        *,
        model: str,
        limits: RequestLimits,
        default_instructions: str,
    ) -> None:
        self._conn = conn
        self._sender = sender
        self._sessions = sessions
        self._model = model  # the served model: the only one a session may name
        self._limits = limits
        self._default_instructions = default_instructions

    async def open(self, session_id: str | None) -> None:
        """Resume `session_id` (the owner's only) or start a new session, and say so with
        `session.created`. Raises the store's GatewayError (`session_not_found`, `busy`); the
        connection reports it and closes."""
        conn, sender = self._conn, self._sender
        if session_id:
            session = conn.session = await self._sessions.load(session_id, conn.owner)
            state = session_state(session, self._model, resumed=True)
            await sender.send(rt.SessionCreated(sender.eid(), state))
            log.info("session_resumed", session_id=session.id, items=len(session.items))
            return
        session = Session.new(
            conn.owner,
            instructions=self._default_instructions,
            max_output_tokens=self._limits.max_output_tokens,
        )
        await self._sessions.save(session)
        conn.session = session
        await sender.send(rt.SessionCreated(sender.eid(), session_state(session, self._model)))
        log.info("session_created", session_id=session.id)

    async def apply_minted(self, raw: bytes) -> None:
        """The `session` settings an ephemeral key was minted with (JSON), applied as a
        `session.update` from the client would be; one that no longer passes is an `error`
        event, and the session keeps its settings."""
        try:
            config = msgspec.json.decode(raw, type=rt.SessionConfig)
            await self.update(rt.SessionUpdate(session=config))
        except (GatewayError, msgspec.ValidationError) as exc:
            error = (
                exc if isinstance(exc, GatewayError) else GatewayError("invalid_request", str(exc))
            )
            await self._sender.send_error(error, None)

    async def update(self, event: rt.SessionUpdate) -> None:
        conn = self._conn
        assert conn.session is not None
        cfg, limits = event.session, self._limits
        check_model(cfg.model, self._model, "session.model")
        check_sampling(cfg.temperature, cfg.top_p, cfg.seed, where="session.")
        check_output_modalities(cfg.output_modalities, "session.output_modalities")
        max_tokens = check_max_tokens(
            cfg.max_output_tokens,
            limits.max_output_tokens_limit,
            "session.max_output_tokens",
            allow_inf=True,
        )
        check_instructions(cfg.instructions, limits, "session.instructions")
        current = conn.tools
        tools = SessionTools(
            cfg.tools if cfg.tools is not None else current.tools,
            cfg.tool_choice if cfg.tool_choice is not None else current.tool_choice,
            cfg.parallel_tool_calls
            if cfg.parallel_tool_calls is not None
            else current.parallel_tool_calls,
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

        conn.session, _ = await self._sessions.update(conn.session.id, conn.owner, apply)
        conn.tools = tools
        sender = self._sender
        await sender.send(
            rt.SessionUpdated(
                sender.eid(),
                session_state(conn.session, self._model, with_items=False, tools=tools),
            )
        )
