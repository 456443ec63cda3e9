"""Responses over a Realtime connection: `response.create` and `response.cancel`.

At most one response is in progress per connection; another `response.create` meanwhile is
refused with `response_in_progress`. A response's values are checked in the request layer
before anything runs; its tools are its own or else the session's, field by field, planned as
for the HTTP APIs (one prompt and grammar under every choice). It reads the stored session (the
truth: another connection may have added to it) or, with `response.input`, its own context,
never stored; function calls reach the model joined to the answer that made them
(`items.joined`). Its events are built by `output.RealtimeResponseWriter`, and every response ends
with a `response.done`, a failed one included; it goes out once the answer is written in the
session, and an answer the store did not take ends the response as failed (`busy`: an `error`
event, then `response.done` with status failed). An answer that called tools is stored as the
items it showed (`items.split_answer_item`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING

import msgspec
import structlog

from gateway.api.realtime import protocol as rt
from gateway.api.realtime.connection_state import ResponseInFlight
from gateway.api.realtime.items import (
    input_context,
    joined,
    plan_realtime_tools,
    split_answer_item,
)
from gateway.api.realtime.output import RealtimeResponseWriter
from gateway.chat.events import Finished, TextChunk
from gateway.chat.output_grammar import apply_tool_plan
from gateway.chat.requests import check_output_modalities, response_options
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.api.realtime.connection_state import ConnectionState
    from gateway.api.realtime.event_sender import EventSender
    from gateway.chat.events import ResponseOptions
    from gateway.chat.output_grammar import ToolPlan
    from gateway.chat.requests import RequestLimits
    from gateway.chat.service import ChatService
    from gateway.chat.vision_resolver import VisionResolver
    from gateway.policy.key_usage import CountingLimiter
    from gateway.sessions.session import Session, SessionStore

__all__ = ("ResponseEvents",)

log = structlog.get_logger("visiongate.realtime")


class ResponseEvents:
    """`response.create`, `response.cancel`, and the run of the response in progress."""

    __slots__ = (
        "_conn",
        "_limits",
        "_model",
        "_rate_limiter",
        "_sender",
        "_service",
        "_sessions",
        "_vision",
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
        rate_limiter: CountingLimiter,
        model: str,
    ) -> None:
        self._conn = conn
        self._sender = sender
        self._sessions = sessions
        self._vision = vision  # the images of a response's own input
        self._service = service  # runs the response: `ChatService.respond`
        self._limits = limits
        self._rate_limiter = rate_limiter
        self._model = model

    async def create(self, event: rt.ResponseCreate) -> None:
        received = time.perf_counter()
        conn, limits = self._conn, self._limits
        assert conn.session is not None
        if conn.responding:
            assert conn.response is not None
            raise GatewayError(
                "response_in_progress",
                f"response {conn.response.options.response_id} is still in progress; "
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
            limits,
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
            options.max_output_tokens or conn.session.max_output_tokens,
            limits.max_output_tokens_limit,
        )
        plan = self._tools(params, budget)
        await self._rate_limiter.acquire(conn.owner)
        # watchers whose encodes are over are about to report (and drop a failed image's item):
        # let them, so this response sees the conversation the client was told about
        settled = conn.reporting_watchers()
        if settled:
            await asyncio.gather(*settled, return_exceptions=True)
        # the stored session is the truth (another connection may have added to it)
        load_start = time.time_ns()
        conn.session = session = await self._sessions.load(conn.session.id, conn.owner)
        load_ns = (load_start, time.time_ns())
        context, permit = session.items, None
        if params.input is not None:  # this response's own context, never stored
            context, permit = await input_context(
                params.input,
                session.items,
                limits,
                self._vision,
                owner=conn.owner,
                started=set(conn.pending),
                quota=conn.encode_quota,
            )
            if not context and not (
                options.instructions or session.instructions or plan is not None
            ):
                permit.close()
                raise GatewayError(
                    "invalid_request",
                    "response.input holds no items and there are no instructions to answer",
                    param="response.input",
                )
        # what the model reads: function_call items joined to the answer that made them
        view = msgspec.structs.replace(session, items=joined(context))
        options = apply_tool_plan(  # as the HTTP APIs apply it
            dataclasses.replace(options, session_load_ns=load_ns),
            plan,
            tool_results=any(i.role == "tool" for i in view.items),
        )
        task = asyncio.create_task(
            self._run(options, params, view, event.event_id, received),
            name=f"response {options.response_id}",
        )
        conn.response = ResponseInFlight(options, task)
        if permit is not None:  # the input's encode slots, held until the response ends
            task.add_done_callback(lambda _: permit.close())

    def _tools(self, params: rt.ResponseParams, budget: int) -> ToolPlan | None:
        """The response's tools, each field its own or else the session's."""
        own_tools, own_choice = params.tools is not None, params.tool_choice is not None
        session = self._conn.tools
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

    async def cancel(self, event: rt.ResponseCancel) -> None:
        response = self._conn.response if self._conn.responding else None
        if response is None or (
            event.response_id and event.response_id != response.options.response_id
        ):
            raise GatewayError(
                "response_not_found",
                "no response in progress"
                + (f" with id {event.response_id!r}" if event.response_id else ""),
                param="response_id",
            )
        response.options.cancel.set()

    async def stop(self) -> None:
        """The connection ends: the response in progress stops now and frees the engine."""
        response = self._conn.response
        if response is None:
            return
        response.options.cancel.set()
        if not response.task.done():
            response.task.cancel()
            await asyncio.gather(response.task, return_exceptions=True)

    async def _run(
        self,
        options: ResponseOptions,
        params: rt.ResponseParams,
        view: Session,
        event_id: str | None,
        received: float,
    ) -> None:
        rid, iid = options.response_id, options.item_id
        sender = self._sender
        output = RealtimeResponseWriter(
            options,
            send=sender.send,
            eid=sender.eid,
            conversation=view.id if options.store else None,
            metadata=params.metadata,
            model=self._model,
            codec=sender.codec,
        )
        finished = False
        try:
            async for ev in self._service.respond(
                view, options, pending=self._conn.pending, received_at=received
            ):
                if type(ev) is TextChunk:  # nearly every event: a frame from its template
                    frame = output.text_frame(ev.text)
                    if frame is not None:
                        if not sender.write_text(frame):  # written at once, nearly always
                            await sender.send_text(frame)
                        continue
                if isinstance(ev, Finished):
                    await self._finish(ev, output, event_id)
                    finished = True
                else:
                    await output.on_event(ev)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave a client waiting for a response.done
            log.exception("response_failed", response_id=rid)
            if not finished:
                error = (  # a store down is busy here too, never internal_error
                    exc
                    if isinstance(exc, GatewayError)
                    else GatewayError(
                        "internal_error", f"the response failed: {type(exc).__name__}"
                    )
                )
                try:
                    await self._finish(
                        Finished(rid, iid, "failed", "", error=error), output, event_id
                    )
                except Exception:  # building the done event itself failed: the error still goes
                    log.exception("response_done_failed", response_id=rid)
                    await sender.send_error(error, event_id)

    async def _finish(
        self, ev: Finished, output: RealtimeResponseWriter, event_id: str | None
    ) -> None:
        options = output.options
        if ev.status != "failed":
            await output.close_items(ev)
            if options.store and options.tools:
                await self._split_answer(options.item_id)
        elif ev.error is not None:
            await self._sender.send_error(ev.error, event_id)
        await output.done(ev)
        await self._send_rate_limits()

    async def _send_rate_limits(self) -> None:
        """`rate_limits.updated` after a response.done, when the key has limits."""
        requests, tokens = await self._rate_limiter.rate_limits(self._conn.owner)
        limits = [
            rt.RateLimit(name, a.limit, a.remaining, round(a.reset_s, 3))
            for name, a in (("requests", requests), ("tokens", tokens))
            if a is not None
        ]
        if limits:
            sender = self._sender
            await sender.send(rt.RateLimitsUpdated(sender.eid(), limits))

    async def _split_answer(self, item_id: str) -> None:
        """The stored answer becomes the items the response showed (message, function calls)."""
        conn = self._conn
        assert conn.session is not None
        try:
            conn.session, _ = await self._sessions.update(
                conn.session.id, conn.owner, lambda s: split_answer_item(s.items, item_id)
            )
        except GatewayError as exc:  # the answer stays one item: it reads the same to the model
            log.warning("answer_not_split", item_id=item_id, code=exc.code)
