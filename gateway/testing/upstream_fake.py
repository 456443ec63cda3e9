"""A scripted OpenAI-compatible server on a loopback port, standing in for vLLM or SGLang.

It speaks the part of their HTTP API the upstream engine uses, over real sockets (HTTP/1.1
with keep-alive, chunked server-sent events), and lets each test script what it does: the
failures, delays and odd answers a real server gives only by accident. (SGLang needs a GPU; a
real vLLM, the CPU build, runs in `tests/gateway/engine/upstream/test_real_vllm.py` through
`gateway.testing.vllm_server`.)

- `GET /v1/models`: `models` (vLLM-shaped entries: id, root, max_model_len), or `models_status`;
- `GET /health`: `health_status` (404 when `has_health` is false, as a server without it);
- `POST /v1/chat/completions` and `/v1/completions`: the next `Script` of `scripts` (else
  `default`): an error status with a JSON body, or a stream of text chunks with delays, a
  usage chunk (with cached tokens), and optionally a dropped connection mid-stream (a request
  without `stream: true` gets the chunks joined, as one JSON answer);
- `set_listening(False)`: stops accepting and closes every open connection (a replica that
  went away); `True` listens on the same port again.

Every request is recorded (`requests`: path, headers, parsed JSON body); every stream the
client closed before its end is recorded in `disconnects` (and sets `disconnected`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from gateway.testing.ports import free_port
from gateway.testing.waiting import wait_until

# wait_until is gateway.testing.waiting's, importable from here too
__all__ = ("FakeUpstream", "Recorded", "Script", "wait_until")


@dataclass
class Script:
    """What the fake does with one completion request."""

    status: int = 200
    error: dict[str, Any] | None = None  # the JSON body of an error status
    headers: dict[str, str] = field(default_factory=dict)  # extra response headers
    chunks: list[str] = field(default_factory=lambda: ["Hello", ",", " world"])
    delay_s: float = 0.0  # before each chunk
    first_delay_s: float = 0.0  # before the first chunk (after the headers)
    drop_after: int | None = None  # close the connection after this many text chunks
    hang_s: float = 0.0  # after the last text chunk, before the end
    finish_reason: str = "stop"
    n: int = 1  # choices: every chunk is sent once per choice
    usage: dict[str, Any] | None = field(
        default_factory=lambda: {
            "prompt_tokens": 21,
            "completion_tokens": 3,
            "total_tokens": 24,
            "prompt_tokens_details": {"cached_tokens": 16},
        }
    )
    logprobs: bool = False  # attach a chat-form logprob to every chunk
    stream_error: str | None = None  # an error object instead of the end
    stream_error_code: int = 500  # its `code` (vLLM sends the HTTP status there)


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: Any


class FakeUpstream:
    """The server (see the module docstring). Use as a context manager."""

    def __init__(
        self, model: str = "fake-vlm", *, max_model_len: int = 4096, port: int | None = None
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = f"127.0.0.1:{self.port}"
        self.models: list[dict[str, Any]] = [
            {"id": model, "object": "model", "root": model, "max_model_len": max_model_len}
        ]
        self.models_status = 200
        self.health_status = 200
        self.has_health = True
        self.scripts: deque[Script] = deque()
        self.default = Script()
        self.requests: list[Recorded] = []
        self.disconnects: list[str] = []  # paths of streams the client closed early
        self.disconnected = threading.Event()
        self.chunks_sent = 0  # text chunks written, over all streams
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    # -- control (from the test's thread) --------------------------------------------------

    def __enter__(self) -> FakeUpstream:
        self._thread.start()
        self.set_listening(True)
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def set_listening(self, on: bool) -> None:
        asyncio.run_coroutine_threadsafe(self._listen(on), self._loop).result(timeout=5)

    def chat_requests(self) -> list[Recorded]:
        return [r for r in self.requests if r.path.endswith("completions")]

    # -- the server (on its own loop) ------------------------------------------------------

    async def _listen(self, on: bool) -> None:
        if on and self._server is None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        elif not on and self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            await self._server.wait_closed()
            self._server = None

    async def _shutdown(self) -> None:
        await self._listen(False)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *header_lines = head.decode("latin-1").split("\r\n")
                method, path, _ = line.split(" ", 2)
                headers = {}
                for h in header_lines:
                    if ":" in h:
                        k, v = h.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                raw = await reader.readexactly(int(headers.get("content-length", "0")))
                body = json.loads(raw) if raw else None
                self.requests.append(Recorded(path, headers, body))
                if not await self._answer(method, path, body, reader, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        except asyncio.CancelledError:  # shutting down: end quietly (asyncio logs a raise)
            return
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _send(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        body: Any,
        headers: dict[str, str] | None = None,
    ) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        writer.write(
            f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n{extra}\r\n".encode()
            + data
        )
        await writer.drain()

    async def _answer(
        self,
        method: str,
        path: str,
        body: Any,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Answer one request; False when the connection is to be closed."""
        if method == "GET" and path == "/v1/models":
            answer = {"object": "list", "data": self.models} if self.models_status == 200 else {}
            await self._send(writer, self.models_status, answer)
            return True
        if method == "GET" and path == "/health":
            await self._send(writer, self.health_status if self.has_health else 404, None)
            return True
        if method != "POST" or not path.endswith("/completions"):
            await self._send(writer, 404, {"error": {"message": "not found"}})
            return True
        script = self.scripts.popleft() if self.scripts else self.default
        if script.status != 200:
            error = script.error or {"object": "error", "message": "scripted failure"}
            await self._send(writer, script.status, error, script.headers)
            return True
        if not (isinstance(body, dict) and body.get("stream")):
            await self._send(writer, 200, _whole_answer(script, path))
            return True
        return await self._stream(script, path, body, reader, writer)

    async def _stream(
        self,
        script: Script,
        path: str,
        body: Any,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        chat = path.endswith("chat/completions")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        # the client sends nothing more until this answer ends: reading EOF means it left
        gone = asyncio.ensure_future(reader.read(1))

        async def event(payload: Any) -> bool:
            data = f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n"
            raw = data.encode()
            writer.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
            try:
                await writer.drain()
            except ConnectionError:
                return False
            return not gone.done()

        def choice(i: int, text: str | None, finish: str | None = None) -> dict[str, Any]:
            c: dict[str, Any] = {"index": i, "finish_reason": finish}
            if chat:
                c["delta"] = {"content": text} if text is not None else {}
            else:
                c["text"] = text or ""
            if script.logprobs and text:
                c["logprobs"] = {
                    "content": [
                        {
                            "token": text,
                            "logprob": -0.5,
                            "bytes": list(text.encode()),
                            "top_logprobs": [
                                {"token": text, "logprob": -0.5, "bytes": list(text.encode())}
                            ],
                        }
                    ]
                }
            return c

        try:
            if chat and not await event(
                {"choices": [{"index": i, "delta": {"role": "assistant"}} for i in range(script.n)]}
            ):
                return await self._left(path, gone)
            await self._wait(script.first_delay_s, gone)
            for k, text in enumerate(script.chunks):
                if k:
                    await self._wait(script.delay_s, gone)
                if gone.done():
                    return await self._left(path, gone)
                if script.drop_after is not None and k >= script.drop_after:
                    writer.transport.abort()
                    return False
                for i in range(script.n):
                    if not await event({"choices": [choice(i, text)]}):
                        return await self._left(path, gone)
                self.chunks_sent += 1
            await self._wait(script.hang_s, gone)
            if gone.done():
                return await self._left(path, gone)
            if script.stream_error is not None:
                error = {"message": script.stream_error, "code": script.stream_error_code}
                await event({"error": error})
            else:
                finals = [choice(i, None, script.finish_reason) for i in range(script.n)]
                await event({"choices": finals})
                if script.usage is not None and (body or {}).get("stream_options"):
                    await event({"choices": [], "usage": script.usage})
                await event("[DONE]")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            if gone.done():
                return await self._left(path, gone)
            gone.cancel()
            return script.stream_error is None
        except ConnectionError:
            return await self._left(path, gone)

    async def _wait(self, seconds: float, gone: asyncio.Future[bytes]) -> None:
        if seconds > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(gone), seconds)

    async def _left(self, path: str, gone: asyncio.Future[bytes]) -> bool:
        gone.cancel()
        self.disconnects.append(path)
        self.disconnected.set()
        return False


def _whole_answer(script: Script, path: str) -> dict[str, Any]:
    """A request without `stream: true`: the script's chunks joined into one JSON answer."""
    text = "".join(script.chunks)
    if path.endswith("chat/completions"):
        choice: dict[str, Any] = {"message": {"role": "assistant", "content": text}}
    else:
        choice = {"text": text}
    finish = script.finish_reason
    choices = [{"index": i, "finish_reason": finish, **choice} for i in range(script.n)]
    return {"object": "text_completion", "choices": choices, "usage": script.usage}
