"""Soak benchmark: the well-behaved users, one per API key.

Each user (`good_user`) alternates two kinds of multi-turn chats about a distinct photo: a
Realtime session over WebSocket (the load benchmark's stateful session: photo first, the
question after the typing delay, follow-ups on the same session) and an OpenAI-style HTTP chat
(streamed `POST /v1/chat/completions`, the photo with the first question, the whole
conversation resent every turn, `X-Session-Id` so the gateway's caches apply). TTFT is measured
the same way on both: from the question's submission to its first text delta. Keys travel in
the Authorization header (the gateway refuses them in URLs).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import websockets

from bench._load_client import SessionPlan, play_session
from bench._load_stats import TurnRecord

__all__ = (
    "KeyRecords",
    "Target",
    "bearer",
    "connect_realtime",
    "error_code",
    "good_user",
    "http_session",
    "ws_session",
)


@dataclass(slots=True, frozen=True)
class Target:
    """Where the gateway listens and what a client must know of its settings."""

    http_url: str
    ws_url: str
    model: str
    max_text_chars: int
    max_image_bytes: int


@dataclass(slots=True)
class KeyRecords:
    """One well-behaved key's turns in one phase, by transport."""

    ws: list[TurnRecord] = field(default_factory=list)
    http: list[TurnRecord] = field(default_factory=list)
    sessions: int = 0

    def all(self) -> list[TurnRecord]:
        return self.ws + self.http


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def error_code(body: bytes, status: int) -> str:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return f"http_{status}"


async def connect_realtime(target: Target, key: str, **options: Any) -> Any:
    """A Realtime connection authenticated with the key in the Authorization header (the
    gateway refuses keys in URLs)."""
    return await websockets.connect(
        target.ws_url,
        additional_headers=bearer(key),
        max_size=None,
        proxy=None,
        open_timeout=30,
        close_timeout=2,
        **options,
    )


async def ws_session(
    target: Target, key: str, plan: SessionPlan, records: list[TurnRecord], **play: Any
) -> None:
    """The load benchmark's stateful Realtime session (`bench._load_client.play_session`) with
    the key in the Authorization header: the photo at once, the question after the typing
    time, follow-ups on the same session; a failed turn ends the session."""
    await play_session(target.ws_url, plan, "stateful", records, headers=bearer(key), **play)


async def http_session(
    client: httpx.AsyncClient,
    target: Target,
    plan: SessionPlan,
    records: list[TurnRecord],
    *,
    origin: float,
    stop_at: float | None,
    typing_s: float,
    max_tokens: int,
    turn_timeout_s: float,
) -> None:
    """Play one chat over the HTTP API; append a `TurnRecord` per attempted turn. A failed
    turn ends the session; no turn starts after `stop_at` (loop time)."""
    loop = asyncio.get_running_loop()
    session_id = f"soak-{secrets.token_hex(8)}"
    messages: list[dict[str, Any]] = []
    await asyncio.sleep(typing_s)
    for turn, question in enumerate(plan.questions):
        if stop_at is not None and loop.time() >= stop_at:
            return
        t_submit = loop.time()
        rec = TurnRecord(session=plan.index, turn=turn, sent_s=t_submit - origin)
        content: list[dict[str, Any]] = [{"type": "text", "text": question}]
        if turn == 0:
            content.insert(0, {"type": "image_url", "image_url": {"url": plan.image_url}})
        messages.append({"role": "user", "content": content})
        body = {
            "model": target.model,
            "messages": messages,
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
        text: list[str] = []
        try:
            async with asyncio.timeout(turn_timeout_s):
                await _stream_turn(client, body, session_id, rec, text, t_submit)
        except TimeoutError:
            rec.status, rec.error_code = "abandoned", "turn_timeout"
        except httpx.HTTPError as exc:
            rec.status, rec.error_code = "error", f"connection:{type(exc).__name__}"
        except asyncio.CancelledError:
            rec.status = "abandoned"
            records.append(rec)
            raise
        records.append(rec)
        if rec.status != "ok":
            return
        rec.done_s = loop.time() - origin
        messages.append({"role": "assistant", "content": "".join(text)})


async def _stream_turn(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    session_id: str,
    rec: TurnRecord,
    text: list[str],
    t_submit: float,
) -> None:
    loop = asyncio.get_running_loop()
    last: float | None = None
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": session_id}
    ) as response:
        if response.status_code != 200:
            code = error_code(await response.aread(), response.status_code)
            rec.status, rec.error_code = ("busy" if code == "busy" else "error"), code
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                code = str((chunk["error"] or {}).get("code") or "error")
                rec.status, rec.error_code = ("busy" if code == "busy" else "error"), code
                return
            for choice in chunk.get("choices") or ():
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    now = loop.time()
                    if last is None:
                        rec.ttft_ms = (now - t_submit) * 1e3
                    else:
                        rec.itl_ms.append((now - last) * 1e3)
                    last = now
                    text.append(delta)
            usage = chunk.get("usage")
            if usage:
                rec.output_tokens = int(usage.get("completion_tokens", 0))
                rec.input_tokens = int(usage.get("prompt_tokens", 0))
                rec.cached_tokens = int(
                    (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                )
    rec.total_ms = (loop.time() - t_submit) * 1e3


async def good_user(
    target: Target,
    key: str,
    rank: int,
    records: KeyRecords,
    next_plan: Callable[[], SessionPlan],
    *,
    origin: float,
    stop_at: float,
    think_s: float,
    **play: Any,
) -> None:
    """One well-behaved user: WebSocket and HTTP chats in turn (the first one chosen by
    `rank`, so the keys do not all use the same transport at once), a pause between chats."""
    loop = asyncio.get_running_loop()
    use_ws = rank % 2 == 0
    async with httpx.AsyncClient(
        base_url=target.http_url, headers=bearer(key), timeout=httpx.Timeout(None, connect=30.0)
    ) as client:
        while loop.time() < stop_at:
            plan = next_plan()
            records.sessions += 1
            out = records.ws if use_ws else records.http
            before = len(out)
            if use_ws:
                await ws_session(target, key, plan, out, origin=origin, stop_at=stop_at, **play)
            else:
                await http_session(
                    client, target, plan, out, origin=origin, stop_at=stop_at, **play
                )
            failed = any(r.status != "ok" for r in out[before:])
            use_ws = not use_ws
            await asyncio.sleep(think_s + (0.5 if failed else 0.0))
