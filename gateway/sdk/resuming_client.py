"""Realtime clients that survive a dropped connection, async and blocking.

`ResumingClient` wraps `gateway.sdk.client.RealtimeClient`: when the WebSocket drops, it reconnects
with `?session_id=` (the session keeps the conversation, the images and their KV) and retries
the call that failed. `Client` is the same thing for code without an event loop:

    from gateway.sdk.resuming_client import Client

    with Client("ws://127.0.0.1:8000/v1/realtime") as client:
        client.add_image("photo.jpg")                 # starts encoding at once
        for text in client.ask("What is in the picture?", max_output_tokens=64):
            print(text, end="", flush=True)
        print(client.last_result.timings, client.last_result.cache)

An answer cut off by a drop is asked again after resuming (the partial one stays in the
conversation, marked incomplete); `on_resume` is called each time, so a UI can clear what it
showed. A message that reached the server before the drop is not sent twice.

For the HTTP API use the official `openai` package unchanged; `session_id` (or the
`X-Session-Id` header) makes multi-turn requests reuse the session's caches:

    from openai import OpenAI

    oa = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY-or-anything")
    reply = oa.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=64, extra_body={"session_id": "my-chat"},
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_data_url("photo.jpg")}},
            {"type": "text", "text": "What is in the picture?"}]}])
    reply.usage.prompt_tokens_details.cached_tokens      # KV reused
    reply.usage.model_extra["visiongate"]                # timings, vision cache hits
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Self

import websockets

from gateway.sdk.client import RealtimeClient, RealtimeError, ResponseResult, image_data_url

__all__ = ("Client", "ResumingClient")

_REF = "visiongate:sha256:"
_LOST = ("connection_closed",)


def _lost(exc: BaseException) -> bool:
    return (isinstance(exc, RealtimeError) and exc.code in _LOST) or isinstance(
        exc, (websockets.ConnectionClosed, ConnectionError, OSError)
    )


def _part_key(part: dict[str, Any]) -> tuple[str, str]:
    """A part as the server shows it in history: images by digest."""
    if part.get("type") == "input_image":
        url = str(part.get("image_url", ""))
        if url.startswith("data:"):
            url = _REF + hashlib.sha256(base64.b64decode(url.split(",", 1)[1])).hexdigest()
        return ("image", url)
    return ("text", str(part.get("text", "")))


class ResumingClient:
    """A `RealtimeClient` that reconnects to its session and retries after a dropped connection."""

    def __init__(
        self,
        url: str,
        *,
        session_id: str | None = None,
        api_key: str | None = None,
        retries: int = 3,
        backoff_s: float = 0.5,
        on_resume: Callable[[ResumingClient], None] | None = None,
    ) -> None:
        self.url = url
        self.api_key = api_key
        self.retries = retries
        self.backoff_s = backoff_s
        self.on_resume = on_resume
        self.resumes = 0
        self.last_result: ResponseResult | None = None
        self._session_id = session_id
        self._client: RealtimeClient | None = None

    async def connect(self) -> ResumingClient:
        self._client = await RealtimeClient.connect(
            self.url, session_id=self._session_id, api_key=self.api_key
        )
        self._session_id = self._client.session_id
        return self

    @property
    def session_id(self) -> str | None:
        return self._session_id

    @property
    def realtime(self) -> RealtimeClient:
        """The connection in use now (replaced on every resume)."""
        if self._client is None:
            raise RealtimeError("not_connected", "call connect() first")
        return self._client

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.realtime.history

    async def resume(self) -> None:
        """Reconnect to the same session, with backoff; RealtimeError if it can't."""
        last: BaseException | None = None
        for attempt in range(self.retries):
            if self._client is not None:
                with contextlib.suppress(RealtimeError, websockets.WebSocketException, OSError):
                    await self._client.close()  # already gone
            try:
                await self.connect()
            except RealtimeError as exc:
                if exc.code == "session_not_found":
                    raise  # expired or deleted: resuming cannot help
                last = exc
            except (TimeoutError, websockets.WebSocketException, OSError) as exc:
                last = exc
            else:
                self.resumes += 1
                if self.on_resume is not None:
                    self.on_resume(self)
                return
            await asyncio.sleep(self.backoff_s * 2**attempt)
        raise RealtimeError(
            "connection_closed", f"could not resume session {self._session_id}: {last}"
        )

    async def update_session(self, **config: Any) -> dict[str, Any]:
        return await self._retry(lambda: self.realtime.update_session(**config))

    async def add_message(self, parts: list[dict[str, Any]], *, role: str = "user") -> str:
        try:
            return await self.realtime.add_message(parts, role=role)
        except Exception as exc:
            if not _lost(exc):
                raise
        await self.resume()
        landed = self._landed(parts, role)
        if landed is not None:  # it reached the server before the drop
            return landed
        return await self.realtime.add_message(parts, role=role)

    async def add_image(
        self, image: bytes | str | Path, *, text: str | None = None, mime: str | None = None
    ) -> str:
        # ASYNC240 below is a false positive: `startswith` is the str method (ruff sees the Path
        # in the union); the blocking file read happens in the thread of the else branch.
        if isinstance(image, str) and image.startswith(("data:", _REF)):  # noqa: ASYNC240
            url = image
        else:  # reading a file path blocks: keep it off the event loop
            url = await asyncio.to_thread(image_data_url, image, mime)
        parts: list[dict[str, Any]] = [{"type": "input_image", "image_url": url}]
        if text:
            parts.append({"type": "input_text", "text": text})
        return await self.add_message(parts)

    async def stream(self, question: str | None = None, **params: Any) -> AsyncIterator[str]:
        """Text deltas of one answer; `last_result` holds its result afterwards. After a drop the
        answer is asked again on the resumed session (and `on_resume` runs)."""
        if question is not None:
            await self.add_message([{"type": "input_text", "text": question}])
        for attempt in range(self.retries + 1):
            try:
                response = await self.realtime.ask(**params)
                async for text in response:
                    yield text
                self.last_result = response.result
                return
            except Exception as exc:
                if not _lost(exc) or attempt == self.retries:
                    raise
            await self.resume()

    async def ask(self, question: str | None = None, **params: Any) -> ResponseResult:
        """The whole answer at once."""
        async for _ in self.stream(question, **params):
            pass
        assert self.last_result is not None
        return self.last_result

    async def cancel(self) -> None:
        await self.realtime.cancel()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def __aenter__(self) -> Self:
        return self if self._client is not None else await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _retry(self, call: Callable[[], Any]) -> Any:
        try:
            return await call()
        except Exception as exc:
            if not _lost(exc):
                raise
        await self.resume()
        return await call()

    def _landed(self, parts: list[dict[str, Any]], role: str) -> str | None:
        items = self.realtime.history
        if not items:
            return None
        last = items[-1]
        sent = [_part_key(p) for p in parts]
        shown = [_part_key(p) for p in last.get("content", [])]
        return str(last.get("id")) if last.get("role") == role and sent == shown else None


class Client:
    """Blocking `ResumingClient`: its own event loop runs on a daemon thread."""

    def __init__(
        self,
        url: str,
        *,
        session_id: str | None = None,
        api_key: str | None = None,
        timeout: float = 300.0,
        **options: Any,
    ) -> None:
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="visiongate-client", daemon=True
        )
        self._thread.start()
        self._client = ResumingClient(url, session_id=session_id, api_key=api_key, **options)
        try:
            self._run(self._client.connect())
        except BaseException:
            self._stop()
            raise

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self.timeout)

    @property
    def session_id(self) -> str | None:
        return self._client.session_id

    @property
    def history(self) -> list[dict[str, Any]]:
        return self._client.history

    @property
    def last_result(self) -> ResponseResult | None:
        return self._client.last_result

    @property
    def resumes(self) -> int:
        return self._client.resumes

    @property
    def resuming(self) -> ResumingClient:
        """The async client underneath (its calls must run on this client's loop)."""
        return self._client

    def update_session(self, **config: Any) -> dict[str, Any]:
        return self._run(self._client.update_session(**config))

    def add_message(self, parts: list[dict[str, Any]], *, role: str = "user") -> str:
        return self._run(self._client.add_message(parts, role=role))

    def add_image(
        self, image: bytes | str | Path, *, text: str | None = None, mime: str | None = None
    ) -> str:
        return self._run(self._client.add_image(image, text=text, mime=mime))

    def ask(self, question: str | None = None, **params: Any) -> Iterator[str]:
        """Iterate the answer's text deltas; `last_result` is set when it ends."""
        deltas = self._client.stream(question, **params)
        done = object()

        async def step() -> Any:
            try:
                return await deltas.__anext__()
            except StopAsyncIteration:
                return done

        try:
            while (text := self._run(step())) is not done:
                yield text
        finally:
            self._run(deltas.aclose())

    def answer(self, question: str | None = None, **params: Any) -> ResponseResult:
        """The whole answer at once."""
        return self._run(self._client.ask(question, **params))

    def cancel(self) -> None:
        self._run(self._client.cancel())

    def call(self, coro_fn: Callable[[ResumingClient], Any]) -> Any:
        """Run `coro_fn(async_client)` on this client's loop and wait for it."""
        return self._run(coro_fn(self._client))

    def close(self) -> None:
        try:
            self._run(self._client.close())
        finally:
            self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
