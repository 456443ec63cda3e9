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

from gateway.api.realtime import protocol as rt
from gateway.api.realtime.channel import (
    CLOSE_POLICY,
    CLOSE_TRY_AGAIN,
    Channel,
    SessionTools,
    log,
)
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

__all__ = ("EVENT_ITEMS", "SessionEvents", "session_state")

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


class SessionEvents(Channel):
    """Opening the connection's session and `session.update`."""

    async def _open_session(self, session_id: str | None) -> bool:
        settings = self.state.settings
        if session_id:
            try:
                self.session = await self.state.sessions.load(session_id, self.owner)
            except GatewayError as exc:
                await self._send_error(exc, None)
                not_found = exc.code == "session_not_found"
                await self.socket.close(
                    code=CLOSE_POLICY if not_found else CLOSE_TRY_AGAIN, reason=exc.code
                )
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
            await self.socket.close(code=CLOSE_TRY_AGAIN, reason=exc.code)
            return False
        await self._send(
            rt.SessionCreated(self._eid(), session_state(self.session, self.state.engine.model_id))
        )
        log.info("session_created", session_id=self.session.id)
        return True

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
