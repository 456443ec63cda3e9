"""Python SDK for the visiongate Realtime WebSocket protocol (async).

    async with await RealtimeClient.connect("ws://127.0.0.1:8000/v1/realtime") as client:
        await client.add_image(jpeg_bytes)            # starts encoding at once (pre-encoding)
        async with client.ask("What is in the picture?") as answer:
            async for text in answer:
                print(text, end="")
        print(answer.result.usage, answer.result.timings)

A reconnect with `RealtimeClient.connect(url, session_id=client.session_id)` resumes the
session (history, cached images, KV). For the HTTP API, use the official `openai` package with
`base_url="http://HOST:PORT/v1"`.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import mimetypes
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websockets

__all__ = ("RealtimeClient", "RealtimeError", "ResponseResult", "ResponseStream", "image_data_url")


class RealtimeError(Exception):
    """An `error` event from the server, or a lost connection."""

    def __init__(
        self, code: str, message: str, *, param: str | None = None, event_id: str | None = None
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.param, self.event_id = code, message, param, event_id


@dataclass(slots=True)
class ResponseResult:
    id: str
    status: str  # completed | cancelled | incomplete | failed
    text: str
    usage: dict[str, Any]
    timings: dict[str, float]  # queue, encode, prefill, decode, ttft, total (ms)
    cache: dict[str, Any]  # vision hit/miss, kv tokens reused
    image_tokens_total: int
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def cached_tokens(self) -> int:
        return int(self.usage.get("input_token_details", {}).get("cached_tokens", 0))

    @property
    def image_tokens(self) -> int:
        return int(self.usage.get("input_token_details", {}).get("image_tokens", 0))


def image_data_url(image: bytes | str | Path, mime: str | None = None) -> str:
    """Bytes or a file path -> `data:image/...;base64,...`."""
    if isinstance(image, (str, Path)):
        path = Path(image)
        mime = mime or mimetypes.guess_type(path.name)[0] or "image/jpeg"
        image = path.read_bytes()
    if mime is None:
        mime = "image/png" if image[:8] == b"\x89PNG\r\n\x1a\n" else "image/jpeg"
    return f"data:{mime};base64,{base64.b64encode(image).decode()}"


class ResponseStream:
    """Text deltas of one response; `result` is set when `response.done` arrives."""

    def __init__(self, client: RealtimeClient, event_id: str) -> None:
        self._client = client
        self.event_id = event_id
        self.id: str | None = None
        self._queue: asyncio.Queue[str | ResponseResult | RealtimeError] = asyncio.Queue()
        self.result: ResponseResult | None = None
        self.first_delta_at: float | None = None

    def _push(self, value: str | ResponseResult | RealtimeError) -> None:
        self._queue.put_nowait(value)

    async def __aiter__(self) -> AsyncIterator[str]:
        while self.result is None:
            value = await self._queue.get()
            if isinstance(value, RealtimeError):
                raise value
            if isinstance(value, ResponseResult):
                self.result = value
                return
            if self.first_delta_at is None:
                self.first_delta_at = asyncio.get_running_loop().time()
            yield value

    async def finish(self) -> ResponseResult:
        """Drain the rest of the stream and return the final result."""
        async for _ in self:
            pass
        assert self.result is not None
        return self.result

    async def cancel(self) -> None:
        await self._client.cancel()

    async def __aenter__(self) -> ResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.result is None and exc[0] is None:
            await self.finish()


class RealtimeClient:
    """One WebSocket connection to `/v1/realtime`; one response at a time."""

    def __init__(self, ws: Any, session: dict[str, Any], url: str, api_key: str | None) -> None:
        self._ws = ws
        self.url = url
        self._api_key = api_key
        self.session = session
        self._ids = itertools.count(1)
        self._acks: dict[str, asyncio.Future[dict[str, Any]]] = {}  # item id -> added/done item
        self._event_items: dict[str, str] = {}  # client event id -> item id
        self._encoded: dict[str, asyncio.Future[dict[str, Any]]] = {}  # item id -> image.encoded
        self._response: ResponseStream | None = None
        self._session_waiter: asyncio.Future[dict[str, Any]] | None = None
        self.errors: list[RealtimeError] = []  # errors not tied to a pending call
        self._reader = asyncio.create_task(self._read_loop())

    # ------------------------------------------------------------ connecting

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        session_id: str | None = None,
        api_key: str | None = None,
        open_timeout: float = 30.0,
    ) -> RealtimeClient:
        """Open a new session, or resume `session_id` (RealtimeError session_not_found if gone)."""
        full = url + (
            ("&" if "?" in url else "?") + f"session_id={session_id}" if session_id else ""
        )
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        ws = await websockets.connect(
            full, additional_headers=headers, max_size=None, open_timeout=open_timeout
        )
        first = json.loads(await ws.recv())
        if first.get("type") == "error":
            await ws.close()
            err = first["error"]
            raise RealtimeError(
                err.get("code") or "error", err.get("message", ""), param=err.get("param")
            )
        if first.get("type") != "session.created":
            await ws.close()
            raise RealtimeError(
                "protocol_error", f"expected session.created, got {first.get('type')}"
            )
        return cls(ws, first["session"], url, api_key)

    async def reconnect(self) -> None:
        """Open a new connection that resumes this session (after a drop or on purpose)."""
        await self.close()
        other = await RealtimeClient.connect(
            self.url, session_id=self.session_id, api_key=self._api_key
        )
        self.__dict__.update(other.__dict__)

    @property
    def session_id(self) -> str:
        return str(self.session["id"])

    @property
    def history(self) -> list[dict[str, Any]]:
        """Items of the conversation as of connecting (resumed sessions include earlier turns)."""
        return list((self.session.get("visiongate") or {}).get("items", []))

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self._ws.close()

    async def __aenter__(self) -> RealtimeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ calls

    def _event_id(self) -> str:
        return f"evt_{secrets.token_hex(4)}_{next(self._ids)}"

    async def send(self, event: dict[str, Any]) -> str:
        event.setdefault("event_id", self._event_id())
        await self._ws.send(json.dumps(event))
        return event["event_id"]

    async def update_session(self, **config: Any) -> dict[str, Any]:
        """session.update (instructions, max_output_tokens, temperature, top_p, seed)."""
        self._session_waiter = asyncio.get_running_loop().create_future()
        event_id = await self.send(
            {"type": "session.update", "session": {"type": "realtime", **config}}
        )
        self._event_items[event_id] = "__session__"
        self.session = await self._session_waiter
        return self.session

    async def add_message(
        self, parts: list[dict[str, Any]], *, role: str = "user", wait: bool = True
    ) -> str:
        """conversation.item.create; returns the item id once the server has added it."""
        item_id = f"item_{secrets.token_hex(8)}"
        loop = asyncio.get_running_loop()
        self._acks[item_id] = loop.create_future()
        if any(p.get("type") == "input_image" for p in parts):
            self._encoded[item_id] = loop.create_future()
        event_id = await self.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": role, "id": item_id, "content": parts},
            }
        )
        self._event_items[event_id] = item_id
        if wait:
            await self._acks[item_id]
        return item_id

    async def add_image(
        self, image: bytes | str | Path, *, text: str | None = None, mime: str | None = None
    ) -> str:
        """Send an image now (encoding starts on arrival); returns its item id."""
        # ASYNC240 below is a false positive: `startswith` is the str method (ruff sees the Path
        # in the union); the blocking file read happens in the thread of the else branch.
        if isinstance(image, str) and image.startswith(("data:", "visiongate:")):  # noqa: ASYNC240
            url = image
        else:  # reading a file path blocks: keep it off the event loop
            url = await asyncio.to_thread(image_data_url, image, mime)
        parts: list[dict[str, Any]] = [{"type": "input_image", "image_url": url}]
        if text:
            parts.append({"type": "input_text", "text": text})
        return await self.add_message(parts)

    async def wait_encoded(self, item_id: str) -> dict[str, Any]:
        """The `visiongate.image.encoded` event of an image item (digest, tokens, encode ms)."""
        return await self._encoded[item_id]

    async def ask(self, question: str | None = None, **params: Any) -> ResponseStream:
        """Add `question` (if any) as a user message and start a response; iterate the result
        for text deltas. `params`: max_output_tokens, temperature, top_p, seed, instructions."""
        if question is not None:
            await self.add_message([{"type": "input_text", "text": question}])
        if self._response is not None and self._response.result is None:
            raise RealtimeError("response_in_progress", "a response is still streaming")
        event_id = self._event_id()
        self._response = ResponseStream(self, event_id)
        await self.send({"type": "response.create", "event_id": event_id, "response": params})
        return self._response

    async def cancel(self) -> None:
        await self.send({"type": "response.cancel"})

    # ------------------------------------------------------------ events

    async def _read_loop(self) -> None:
        try:
            async for frame in self._ws:
                self._dispatch(json.loads(frame))
        except websockets.ConnectionClosed:
            pass
        finally:
            lost = RealtimeError("connection_closed", "the connection to the gateway closed")
            for fut in [*self._acks.values(), *self._encoded.values()]:
                if not fut.done():
                    fut.set_exception(lost)
            if self._response is not None and self._response.result is None:
                self._response._push(lost)

    def _dispatch(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "conversation.item.added":
            fut = self._acks.get(event["item"].get("id", ""))
            if fut is not None and not fut.done():
                fut.set_result(event["item"])
        elif kind == "visiongate.image.encoded":
            fut = self._encoded.get(event["item_id"])
            if fut is not None and not fut.done():
                fut.set_result(event)
        elif kind == "session.updated":
            if self._session_waiter is not None and not self._session_waiter.done():
                self._session_waiter.set_result(event["session"])
        elif kind == "response.created" and self._response is not None:
            self._response.id = event["response"]["id"]
        elif kind == "response.output_text.delta" and self._response is not None:
            self._response._push(event["delta"])
        elif kind == "response.done" and self._response is not None:
            r = event["response"]
            ext = r.get("visiongate") or {}
            text = "".join(
                p.get("text", "") for item in r.get("output", []) for p in item.get("content", [])
            )
            self._response._push(
                ResponseResult(
                    id=r["id"],
                    status=r["status"],
                    text=text,
                    usage=r.get("usage") or {},
                    timings=ext.get("timings", {}),
                    cache=ext.get("cache", {}),
                    image_tokens_total=ext.get("image_tokens_total", 0),
                    raw=r,
                )
            )
        elif kind == "error":
            self._on_error(event["error"])

    def _on_error(self, body: dict[str, Any]) -> None:
        err = RealtimeError(
            body.get("code") or "error",
            body.get("message", ""),
            param=body.get("param"),
            event_id=body.get("event_id"),
        )
        target = self._event_items.get(err.event_id or "")
        if target == "__session__" and self._session_waiter and not self._session_waiter.done():
            self._session_waiter.set_exception(err)
            return
        for futures in (self._acks, self._encoded):
            fut = futures.get(target or "")
            if fut is not None and not fut.done():
                fut.set_exception(err)
                return
        if self._response is not None and err.event_id == self._response.event_id:
            # after response.created the failure also arrives as response.done (status failed)
            if self._response.result is None and self._response.id is None:
                self._response._push(err)
            return
        self.errors.append(err)
