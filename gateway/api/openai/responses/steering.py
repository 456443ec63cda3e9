"""`response.steer` on a Responses WebSocket: user input queued for the continuation of a response
on the same connection, its images encoding from the moment it is accepted.

A steer names the response it steers (`previous_response_id`). It is accepted while that
response is in progress on the connection, or once it stopped for its function calls' results;
the input must be user messages of text and images (`input_file` is refused, as everywhere in
visiongate). Accepted input is checked by the request layer as a `response.create`'s is, its
inline images stored and their encodes started at once (so a queued photo's visual tokens are
ready, or nearly, when its continuation runs), and it waits in `SteerQueue` under its target.

When the target ends (`ResponsesSocket` asks `on_end`):

- completed without calls: the queued input becomes a successor response, created at once with
  the target's settings and `previous_response_id` set to it (the successor's `response.created`
  commits it);
- completed with function calls: `response.steer.pending` (waiting_for_required_input) names
  the calls whose results are due; the input stays queued and is put before the input of the
  next `response.create` that continues the target (`take`);
- anything else (cancelled, incomplete, failed): `response.steer.failed`
  (`response_not_active`), the input given back.

A response in progress is never cut short for a steer: it ends as it would have, and its
successor follows. Steering failures are `response.steer.failed` events with the SDK's codes
(`response_not_found`, `invalid_input`, `too_many_pending_steers`,
`response_already_completed`, `response_not_active`, `successor_creation_failed`).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.api.openai.responses.inputs import convert_items, image_parts, parse_input
from gateway.chat.requests import (
    RequestLimits,
    add_inline_images,
    admit_encodes,
    fetch_remote,
    resolve_references,
)
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.chat.vision_resolver import Resolved
    from gateway.server.state import GatewayState

__all__ = ("MAX_PENDING", "Steer", "SteerQueue", "SteerRefused", "steer_items")

MAX_PENDING = 8  # steers queued for one response at most
_ids = itertools.count(1)


class SteerRefused(Exception):
    """A steer that is not accepted: `code` is one of the SDK's steering error codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class Steer:
    id: str
    target: str  # the response it steers
    input: Any  # as the client sent it (given back in a failure)
    items: list[dict[str, Any]]  # the input as input items of a response.create
    encodes: list[asyncio.Task[Resolved]] = field(default_factory=list)


def steer_items(value: Any) -> list[dict[str, Any]]:
    """A steer's input as input items: a string is one user message; a list must hold user
    messages of only `type` ("message"), `role` and `content`. `SteerRefused` otherwise."""
    if isinstance(value, str):
        if not value:
            raise SteerRefused("invalid_input", "the input is empty")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise SteerRefused("invalid_input", "the input is a string or a non-empty list of items")
    for i, item in enumerate(value):
        if (
            not isinstance(item, dict)
            or item.get("role") != "user"
            or item.get("type", "message") != "message"
            or set(item) - {"type", "role", "content"}
        ):
            raise SteerRefused(
                "invalid_input",
                f"input[{i}]: steering takes user messages of only type, role and content",
            )
    return list(value)


class SteerQueue:
    """The steers of one connection's owner, queued by the response each steers."""

    def __init__(self, state: GatewayState, owner: str) -> None:
        self.state = state
        self.owner = owner
        self.limits = RequestLimits.of(state.settings)
        self._queued: dict[str, list[Steer]] = {}

    async def accept(self, target: str, value: Any) -> Steer:
        """Check `value`, store its images and start encoding them, and queue it for
        `target`; `SteerRefused` (invalid_input, too_many_pending_steers, or the request
        layer's refusal as invalid_input) when it is not taken."""
        if len(self._queued.get(target, ())) >= MAX_PENDING:
            raise SteerRefused(
                "too_many_pending_steers", f"{MAX_PENDING} steers wait for this response already"
            )
        items = steer_items(value)
        vision = self.state.require().vision
        try:
            converted = convert_items(items, self.limits)
            fetched = await fetch_remote(image_parts(converted), self.limits, param="input")
            parsed = parse_input(converted, self.limits, fetched)
            await resolve_references(parsed.refs, vision, owner=self.owner)
            permit = await admit_encodes([*parsed.inline, *parsed.refs], vision, owner=self.owner)
        except GatewayError as exc:
            raise SteerRefused("invalid_input", exc.message) from None
        steer = Steer(f"steer_{next(_ids)}", target, value, items)
        try:
            await add_inline_images(parsed.inline, vision, owner=self.owner)
            for digest in [*parsed.inline, *parsed.refs]:
                task = vision.start(self.owner, digest)
                permit.attach(digest, task)
                task.add_done_callback(_consume)
                steer.encodes.append(task)
        except GatewayError as exc:
            raise SteerRefused("invalid_input", exc.message) from None
        finally:
            permit.close()
        self._queued.setdefault(target, []).append(steer)
        return steer

    def queued(self, target: str) -> list[Steer]:
        return list(self._queued.get(target, ()))

    def take(self, target: str) -> list[Steer]:
        """The steers queued for `target`, in the order they came, now out of the queue."""
        return self._queued.pop(target, [])


def _consume(task: asyncio.Task[Resolved]) -> None:
    """An encode's failure is the continuation's to report (it resolves the image again)."""
    if not task.cancelled():
        task.exception()
