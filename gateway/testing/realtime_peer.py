"""A thin raw-WebSocket peer for protocol tests: sends dicts, collects server events.

`Peer` speaks JSON text frames. For a test that holds a bare `websockets` connection (to send
hostile frames, or on the msgpack subprotocol), `recv_event` reads one server event from text
(JSON) or binary (msgpack) frames, and `until_event` / `until_frame` read up to an event of a
given type. `data_url` is `gateway.testing.images.data_url`, importable from here too for the
tests that build a Realtime image part next to a `Peer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import msgspec
import websockets

from gateway.testing.images import data_url

__all__ = (
    "Peer",
    "data_url",
    "deltas",
    "image_question",
    "recv_event",
    "until_event",
    "until_frame",
)


def image_question(image: bytes, question: str, mime: str = "image/jpeg") -> list[dict[str, Any]]:
    """A user message's parts: `image` (as a data URL declaring `mime`), then `question`."""
    return [
        {"type": "input_image", "image_url": data_url(image, mime)},
        {"type": "input_text", "text": question},
    ]


def _decoded(frame: str | bytes) -> dict[str, Any]:
    return msgspec.msgpack.decode(frame) if isinstance(frame, bytes) else json.loads(frame)


async def recv_event(ws: Any, timeout: float = 10.0) -> dict[str, Any]:
    """The next server event on `ws`: a JSON text frame or a msgpack binary one."""
    return _decoded(await asyncio.wait_for(ws.recv(), timeout))


async def until_frame(ws: Any, kind: str, timeout: float = 10.0) -> tuple[dict[str, Any], int]:
    """Read events until one of type `kind`; returns it and the size of its frame (characters
    of a text frame, bytes of a binary one). `timeout` bounds each read."""
    while True:
        frame = await asyncio.wait_for(ws.recv(), timeout)
        event = _decoded(frame)
        if event["type"] == kind:
            return event, len(frame)


async def until_event(ws: Any, kind: str, timeout: float = 10.0) -> dict[str, Any]:
    """Read events until one of type `kind`, and return it. `timeout` bounds each read."""
    event, _ = await until_frame(ws, kind, timeout)
    return event


class Peer:
    def __init__(self, ws: Any, created: dict[str, Any]) -> None:
        self.ws = ws
        self.created = created

    @classmethod
    async def open(
        cls,
        url: str,
        session_id: str | None = None,
        *,
        api_key: str | None = None,
        key_in: Literal["subprotocol", "header"] = "subprotocol",
        subprotocols: Sequence[str] = (),
    ) -> Peer:
        """Connect to `url` (resuming `session_id` if given) and read its first event. An
        `api_key` travels as a browser sends it (`key_in="subprotocol"`: after `subprotocols`,
        as `openai-insecure-api-key.<key>`) or as a server-side client does (`"header"`:
        `Authorization: Bearer`)."""
        protocols = list(subprotocols)
        headers: dict[str, str] = {}
        if api_key is not None and key_in == "subprotocol":
            protocols.append(f"openai-insecure-api-key.{api_key}")
        elif api_key is not None:
            headers["Authorization"] = f"Bearer {api_key}"
        ws = await websockets.connect(
            url + (f"?session_id={session_id}" if session_id else ""),
            max_size=None,
            subprotocols=protocols or None,  # type: ignore[arg-type]
            additional_headers=headers or None,
        )
        created = json.loads(await ws.recv())
        return cls(ws, created)

    @classmethod
    @contextlib.asynccontextmanager
    async def connected(cls, url: str, **open_kwargs: Any) -> AsyncIterator[Peer]:
        """`open`, checking that the first event is `session.created`; closed on exit."""
        peer = await cls.open(url, **open_kwargs)
        assert peer.created["type"] == "session.created", peer.created
        try:
            yield peer
        finally:
            await peer.close()

    @property
    def session_id(self) -> str:
        return self.created["session"]["id"]

    async def send(self, event: dict[str, Any] | str | bytes) -> None:
        await self.ws.send(event if isinstance(event, (str, bytes)) else json.dumps(event))

    async def recv(self, timeout: float = 120.0) -> dict[str, Any]:
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def until(
        self, *types: str, timeout: float = 180.0
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Read until an event of one of `types`; returns it and everything read before it."""
        seen: list[dict[str, Any]] = []
        while True:
            event = await self.recv(timeout)
            if event["type"] in types:
                return event, seen
            seen.append(event)

    async def add(
        self, parts: list[dict[str, Any]], event_id: str | None = None, role: str = "user"
    ) -> None:
        event: dict[str, Any] = {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": role, "content": parts},
        }
        if event_id:
            event["event_id"] = event_id
        await self.send(event)

    async def respond(self, **params: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        await self.send({"type": "response.create", "response": params})
        return await self.until("response.done")

    async def ask(self, parts: list[dict[str, Any]], **params: Any) -> tuple[str, dict[str, Any]]:
        """Add `parts` as a user message, wait until it is stored, and ask for a response with
        `params` (`max_output_tokens=8`, ...): the response's text, and its `response.done`
        body."""
        await self.add(parts)
        await self.until("conversation.item.done")
        done, events = await self.respond(**params)
        return deltas(events), done["response"]

    async def close(self) -> None:
        await self.ws.close()


def deltas(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
