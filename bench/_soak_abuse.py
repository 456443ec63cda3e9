"""Soak benchmark: the abusive keys' traffic.

Each abusive key (`Abuser`) runs the behaviours it is given, all at once until its phase ends:
- `long_prompts`: many concurrent streamed requests with long, never-repeated prompts and long
  answers (they compete for batch slots, prefill and KV);
- `oversize`: text parts over `max_text_chars` and images over `max_image_bytes`, over HTTP and
  WebSocket (the gateway must refuse them without reading into them);
- `bad_images`: truncated, bit-flipped, decompression-bomb and mislabelled images, over HTTP,
  WebSocket and `POST /v1/images`;
- `slow_readers`: WebSockets that ask for long answers and never read (a tiny receive buffer,
  so the gateway's sends back up), reconnecting when the gateway drops them;
- `bursts`: `burst_size` streamed requests sent at once, again every `burst_every_s`, each a
  long answer (the per-key caps and queue shares must refuse the excess, not the others);
- `slow_clients`: a flood of `slow_clients` connections that send half a request line and wait,
  with no key, plus a few that send a whole keyed head and trickle the body a byte a second;
  each reopened as soon as the gateway closes it (counted as `closed:<status>`), run by a
  process of its own (bench/_soak_flood.py).
Every abusive request's outcome is counted by code (`ok`, an error code, `connection:<error>`,
`unfinished` for a request still running when the phase ended).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import random
import secrets
import socket
import struct
import sys
import zlib
from collections import Counter
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import httpx
import websockets

from bench._soak_users import Target, bearer, connect_realtime, error_code

__all__ = ("ABUSE_KINDS", "AbusePayloads", "Abuser", "png_claiming")

ABUSE_KINDS = ("long_prompts", "oversize", "bad_images", "slow_readers", "bursts", "slow_clients")


def png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims `width` x `height` pixels (a decompression bomb)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 4096))
        + chunk(b"IEND", b"")
    )


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


WORDS = (
    "the",
    "quick",
    "model",
    "reads",
    "every",
    "token",
    "of",
    "this",
    "prompt",
    "slowly",
    "while",
    "others",
    "wait",
    "for",
    "their",
    "turn",
    "at",
    "gateway",
    "under",
    "load",
    "image",
    "photo",
    "colour",
    "river",
    "mountain",
    "city",
    "light",
    "shadow",
    "north",
)


class AbusePayloads:
    """Request bodies made once, before the clock starts: the abusers' own cost stays small."""

    def __init__(
        self, target: Target, photo_jpeg: bytes, *, seed: int, long_prompt_words: int
    ) -> None:
        from PIL import Image

        self.target = target
        self.rng = random.Random(seed)
        self.long_prompt_words = long_prompt_words
        limit = target.max_image_bytes
        too_long = "x" * (target.max_text_chars + 1)
        self.oversize_text_body = json.dumps(
            {"model": target.model, "messages": [{"role": "user", "content": too_long}]}
        ).encode()
        big = b"\xff\xd8\xff\xe0" + bytes(limit + 1024)
        self.oversize_image_body = json.dumps(
            {
                "model": target.model,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {
                                "type": "image_url",
                                "image_url": {"url": _data_url(big, "image/jpeg")},
                            },
                        ],
                    }
                ],
            }
        ).encode()
        self.oversize_ws_item = json.dumps(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": too_long}],
                },
            }
        )
        flipped = bytearray(photo_jpeg)
        for _ in range(64):  # header intact, scan data damaged
            flipped[self.rng.randrange(len(photo_jpeg) // 4, len(photo_jpeg))] ^= 0xFF
        small = io.BytesIO()
        Image.new("RGB", (8, 8), (10, 200, 30)).save(small, format="PNG")
        self.bad_images = {
            "truncated_jpeg": photo_jpeg[: len(photo_jpeg) // 3],
            "bitflipped_jpeg": bytes(flipped),
            "bomb_png": png_claiming(60_000, 60_000),
            "not_an_image": b"GIF89a" + self.rng.randbytes(256),
            "wrong_mime": small.getvalue(),  # a PNG sent as text/plain
        }

    def long_prompt(self) -> str:
        # never the same twice: prefix caching cannot make a repeated long prompt cheap
        words = [self.rng.choice(WORDS) for _ in range(self.long_prompt_words)]
        return f"[{secrets.token_hex(8)}] " + " ".join(words) + "\nSummarise all of the above."

    def bad_image(self) -> tuple[str, bytes, str]:
        name = self.rng.choice(sorted(self.bad_images))
        mime = (
            "text/plain"
            if name == "wrong_mime"
            else ("image/png" if name.endswith("png") else "image/jpeg")
        )
        return name, self.bad_images[name], mime


class Abuser:
    """One abusive key's traffic until `stop_at`; outcomes counted by code per behaviour."""

    def __init__(
        self,
        target: Target,
        key: str,
        payloads: AbusePayloads,
        *,
        concurrency: int,
        slow_readers: int,
        long_max_tokens: int,
        kinds: Iterable[str] = ABUSE_KINDS,
        pause_s: float = 0.25,
        burst_size: int = 32,
        burst_every_s: float = 3.0,
        slow_clients: int = 150,
    ) -> None:
        self.target = target
        self.key = key
        self.payloads = payloads
        self.concurrency = concurrency
        self.slow_readers = slow_readers
        self.long_max_tokens = long_max_tokens
        self.pause_s = pause_s
        self.kinds = frozenset(kinds)
        self.burst_size = burst_size
        self.burst_every_s = burst_every_s
        self.slow_clients = slow_clients
        self.outcomes: dict[str, Counter[str]] = {k: Counter() for k in ABUSE_KINDS}

    def count(self, kind: str, code: str) -> None:
        self.outcomes[kind][code] += 1

    async def run(self, stop_at: float) -> None:
        async with httpx.AsyncClient(
            base_url=self.target.http_url,
            headers=bearer(self.key),
            timeout=httpx.Timeout(120.0, connect=30.0),
        ) as client:
            jobs = {
                "long_prompts": [
                    self._long_prompts(client, stop_at) for _ in range(self.concurrency)
                ],
                "oversize": [self._oversize(client, stop_at)],
                "bad_images": [self._bad_images(client, stop_at)],
                "slow_readers": [self._slow_reader(stop_at) for _ in range(self.slow_readers)],
                "bursts": [self._bursts(client, stop_at)],
                "slow_clients": [self._flood(stop_at)] if self.slow_clients else [],
            }
            tasks = []
            for kind, coroutines in jobs.items():
                for coroutine in coroutines:
                    if kind in self.kinds:
                        tasks.append(asyncio.create_task(coroutine))
                    else:
                        coroutine.close()
            loop = asyncio.get_running_loop()
            try:
                await asyncio.wait(tasks, timeout=max(0.0, stop_at - loop.time()))
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _post(self, client: httpx.AsyncClient, kind: str, path: str, **kwargs: Any) -> None:
        try:
            response = await client.post(path, **kwargs)
        except httpx.HTTPError as exc:
            self.count(kind, f"connection:{type(exc).__name__}")
            return
        self.count(
            kind,
            "ok"
            if response.status_code == 200
            else error_code(response.content, response.status_code),
        )

    async def _stream(self, client: httpx.AsyncClient, kind: str) -> str:
        """One streamed long-prompt request; its outcome's code."""
        body = {
            "model": self.target.model,
            "stream": True,
            "temperature": 1.0,
            "max_tokens": self.long_max_tokens,
            "messages": [{"role": "user", "content": self.payloads.long_prompt()}],
        }
        code = "ok"
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    return error_code(await response.aread(), response.status_code)
                async for line in response.aiter_lines():
                    if line.startswith('data: {"error"'):
                        code = error_code(line[6:].encode(), 200)
        except httpx.HTTPError as exc:
            code = f"connection:{type(exc).__name__}"
        except asyncio.CancelledError:
            self.count(kind, "unfinished")  # still running when the phase ended
            raise
        return code

    async def _bursts(self, client: httpx.AsyncClient, stop_at: float) -> None:
        """`burst_size` requests at once, every `burst_every_s`."""
        loop = asyncio.get_running_loop()
        while loop.time() < stop_at:
            started = loop.time()
            codes = await asyncio.gather(
                *(self._stream(client, "bursts") for _ in range(self.burst_size))
            )
            for code in codes:
                self.count("bursts", code)
            await asyncio.sleep(max(0.0, started + self.burst_every_s - loop.time()))

    async def _flood(self, stop_at: float) -> None:
        """The slow-client flood, in a process of its own (bench/_soak_flood.py)."""
        loop = asyncio.get_running_loop()
        seconds = max(0.0, stop_at - loop.time())
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench._soak_flood",
            self.target.http_url,
            f"{seconds:.3f}",
            str(self.slow_clients),
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "SOAK_FLOOD_KEY": self.key},
        )
        try:
            out, _ = await proc.communicate()
        except asyncio.CancelledError:  # the phase ended first: its counts, then stop
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            out = b""
            with contextlib.suppress(Exception):  # what it said before it stopped, if anything
                out, _ = await asyncio.wait_for(proc.communicate(), timeout=10)
            self._count_flood(out)
            raise
        self._count_flood(out)

    def _count_flood(self, out: bytes) -> None:
        try:
            counts = json.loads(out or b"{}")
        except ValueError:
            counts = {"flood:no report": 1}
        for code, n in counts.items():
            self.outcomes["slow_clients"][code] += n

    async def _long_prompts(self, client: httpx.AsyncClient, stop_at: float) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < stop_at:
            code = await self._stream(client, "long_prompts")
            self.count("long_prompts", code)
            if code != "ok":
                await asyncio.sleep(self.pause_s)  # refused: try again a moment later

    async def _oversize(self, client: httpx.AsyncClient, stop_at: float) -> None:
        loop = asyncio.get_running_loop()
        p = self.payloads
        step = 0
        while loop.time() < stop_at:
            which = step % 3
            step += 1
            if which == 0:
                await self._post(
                    client,
                    "oversize",
                    "/v1/chat/completions",
                    content=p.oversize_text_body,
                    headers={"content-type": "application/json"},
                )
            elif which == 1:
                await self._post(
                    client,
                    "oversize",
                    "/v1/chat/completions",
                    content=p.oversize_image_body,
                    headers={"content-type": "application/json"},
                )
            else:
                await self._ws_refusal("oversize", p.oversize_ws_item)
            await asyncio.sleep(self.pause_s)

    async def _bad_images(self, client: httpx.AsyncClient, stop_at: float) -> None:
        loop = asyncio.get_running_loop()
        step = 0
        while loop.time() < stop_at:
            _, data, mime = self.payloads.bad_image()
            which = step % 3
            step += 1
            if which == 0:
                await self._post(
                    client, "bad_images", "/v1/images", content=data, headers={"content-type": mime}
                )
            elif which == 1:
                body = {
                    "model": self.target.model,
                    "max_tokens": 8,
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "text", "text": "what is this?"},
                                {"type": "image_url", "image_url": {"url": _data_url(data, mime)}},
                            ],
                        }
                    ],
                }
                await self._post(client, "bad_images", "/v1/chat/completions", json=body)
            else:
                item = json.dumps(
                    {
                        "type": "conversation.item.create",
                        "item": {
                            "type": "message",
                            "role": "user",
                            "content": [
                                {"type": "input_image", "image_url": _data_url(data, mime)}
                            ],
                        },
                    }
                )
                await self._ws_refusal("bad_images", item)
            await asyncio.sleep(self.pause_s)

    async def _ws_refusal(self, kind: str, frame: str) -> None:
        """Send one item on a fresh connection; count the first error (or `ok` when the item
        was taken, e.g. a damaged image whose header passes and fails later in the encoder)."""
        try:
            async with asyncio.timeout(60):
                async with await connect_realtime(self.target, self.key) as ws:
                    await ws.recv()  # session.created
                    await ws.send(frame)
                    while True:
                        event = json.loads(await ws.recv())
                        if event.get("type") == "error":
                            self.count(kind, str(event["error"].get("code")))
                            return
                        if event.get("type") == "conversation.item.done":
                            self.count(kind, "ok")
                            return
        except TimeoutError:
            self.count(kind, "timeout")
        except (OSError, websockets.WebSocketException) as exc:
            self.count(kind, f"connection:{type(exc).__name__}")

    async def _slow_reader(self, stop_at: float) -> None:
        """Ask for long answers and never read them; reconnect when dropped."""
        loop = asyncio.get_running_loop()
        url = urlsplit(self.target.ws_url)
        while loop.time() < stop_at:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, (url.hostname, url.port))
                ws = await connect_realtime(
                    self.target, self.key, sock=sock, max_queue=1, ping_interval=None
                )
            except (OSError, TimeoutError, websockets.WebSocketException) as exc:
                sock.close()
                self.count("slow_readers", f"connect:{type(exc).__name__}")
                await asyncio.sleep(1.0)
                continue
            self.count("slow_readers", "connected")
            try:
                await ws.send(
                    json.dumps(
                        {
                            "type": "conversation.item.create",
                            "item": {
                                "type": "message",
                                "role": "user",
                                "content": [
                                    {
                                        "type": "input_text",
                                        "text": self.payloads.long_prompt()[:2000],
                                    }
                                ],
                            },
                        }
                    )
                )
                while loop.time() < stop_at:
                    # never a recv(): answers pile up in the gateway's send path
                    await asyncio.wait_for(
                        ws.send(
                            json.dumps(
                                {
                                    "type": "response.create",
                                    "response": {
                                        "max_output_tokens": "inf",
                                        "conversation": "none",
                                    },
                                }
                            )
                        ),
                        timeout=10,
                    )
                    self.count("slow_readers", "response.create")
                    await asyncio.sleep(1.0)
            except TimeoutError:
                self.count("slow_readers", "send_blocked")
            except (OSError, websockets.WebSocketException) as exc:
                self.count("slow_readers", f"dropped:{type(exc).__name__}")
            finally:
                with contextlib.suppress(Exception):
                    ws.transport.abort()
