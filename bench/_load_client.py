"""Load benchmark clients: real WebSocket Realtime sessions played against a running gateway.

Two ways to play one session (a distinct photo, a question, then follow-ups):
- `stateless` (the baseline): every turn opens a new connection, so a new session, and sends
  the whole conversation again (the photo in the same item as the first question, earlier
  answers as assistant items), then `response.create`. Nothing can be reused by session.
- `stateful` (visiongate): one connection for the whole session; the photo is sent alone at
  once and the first question after the "typing" delay (pre-encoding), follow-ups on the same
  session.

Both wait the same typing delay before the first question, so users behave the same and only
the serving differs. TTFT is measured from the moment the question is submitted (stateless:
before connecting; stateful: before sending the question item) to the first
`response.output_text.delta`; ITL are the gaps between deltas as they arrive here.

Loops: `closed_loop` keeps `concurrency` sessions going back to back; `open_loop` starts
sessions at seeded Poisson arrival times. Both are bounded: no new turn starts after the
measurement window, and whatever is still running when the drain time is over is cancelled
(its connection closed, which also cancels the response on the gateway) and recorded as
`abandoned`.
"""

from __future__ import annotations

import asyncio
import io
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import websockets

from bench._load_stats import TurnRecord

__all__ = (
    "PHOTOS",
    "QUESTIONS",
    "SessionPlan",
    "SessionSource",
    "closed_loop",
    "open_loop",
    "play_session",
    "session_image",
)

Mode = Literal["stateless", "stateful"]

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry")
QUESTIONS = (
    "What is in this photo?",
    "What colours stand out?",
    "Suggest a short caption for it.",
)


def session_image(index: int, photos: dict[str, Any] | None = None) -> bytes:
    """A JPEG distinct for every `index`: the photos in turn, then crops and mirrors of them.

    Variant v of a photo is mirrored when v is odd and cropped by 2 px steps from the top-left
    corner, so the first 2048 variants of each photo all have different pixels (and digests).
    `photos` caches the decoded sample photos between calls.
    """
    from PIL import Image, ImageOps

    name = PHOTOS[index % len(PHOTOS)]
    variant = index // len(PHOTOS)
    if variant >= 2048:
        raise ValueError(f"session index {index} is past the distinct variants of the photos")
    photos = {} if photos is None else photos
    img = photos.get(name)
    if img is None:
        from skimage import data

        img = photos[name] = Image.fromarray(getattr(data, name)()).convert("RGB")
    step = variant // 2
    dx, dy = (step % 32) * 2, (step // 32) * 2
    if dx or dy:
        img = img.crop((dx, dy, img.width, img.height))
    if variant % 2:
        img = ImageOps.mirror(img)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@dataclass(slots=True, frozen=True)
class SessionPlan:
    index: int
    image_url: str  # data URL of the session's photo
    questions: tuple[str, ...]


class SessionSource:
    """Session plans by index. Images are made once (`prepare` makes them before a point's
    clock starts) and shared by the configurations: session k of a point asks about the same
    photo in both."""

    def __init__(self, questions: tuple[str, ...] = QUESTIONS) -> None:
        self.questions = questions
        self._urls: dict[int, str] = {}
        self._photos: dict[str, Any] = {}

    def plan(self, index: int) -> SessionPlan:
        from gateway.sdk.client import image_data_url

        url = self._urls.get(index)
        if url is None:
            url = self._urls[index] = image_data_url(
                session_image(index, self._photos), "image/jpeg"
            )
        return SessionPlan(index, url, self.questions)

    def prepare(self, indices: range) -> None:
        for i in indices:
            self.plan(i)

    def forget_below(self, index: int) -> None:
        for i in [i for i in self._urls if i < index]:
            del self._urls[i]


class _TurnFailed(Exception):
    def __init__(self, status: str, code: str) -> None:
        super().__init__(code)
        self.status, self.code = status, code


def _item(role: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "type": "conversation.item.create",
        "event_id": f"evt_{secrets.token_hex(6)}",
        "item": {"type": "message", "role": role, "content": parts},
    }


async def _exchange(
    ws: Any,
    items: list[dict[str, Any]],
    rec: TurnRecord,
    *,
    t_submit: float,
    max_tokens: int,
    timeout_s: float,
    watch: set[str],
) -> str:
    """Send `items` and a response.create, read until response.done; fills `rec`, returns the
    answer text. Errors tied to `watch` (earlier item events) or to these events fail the turn."""
    loop = asyncio.get_running_loop()
    create = {
        "type": "response.create",
        "event_id": f"evt_{secrets.token_hex(6)}",
        "response": {"max_output_tokens": max_tokens, "temperature": 0},
    }
    for event in items:
        watch.add(event["event_id"])
        await ws.send(json.dumps(event))
    await ws.send(json.dumps(create))
    created, last, code = False, None, None
    async with asyncio.timeout(timeout_s):
        while True:
            event = json.loads(await ws.recv())
            kind = event.get("type")
            now = loop.time()
            if kind == "response.created":
                created = True
            elif kind == "response.output_text.delta":
                if last is None:
                    rec.ttft_ms = (now - t_submit) * 1e3
                else:
                    rec.itl_ms.append((now - last) * 1e3)
                last = now
            elif kind == "visiongate.image.encoded":
                rec.image_encode = event.get("cache")  # "miss": encoded for this session
            elif kind == "error":
                err = event.get("error") or {}
                code = err.get("code") or "error"
                eid = err.get("event_id")
                if (eid == create["event_id"] and not created) or (
                    eid in watch and eid != create["event_id"]
                ):
                    raise _TurnFailed("busy" if code == "busy" else "error", code)
            elif kind == "response.done":
                return _done(event["response"], rec, now, t_submit, code)


def _done(
    resp: dict[str, Any], rec: TurnRecord, now: float, t_submit: float, code: str | None
) -> str:
    if resp.get("status") == "failed":
        err = (resp.get("status_details") or {}).get("error") or {}
        code = err.get("code") or code or "error"
        raise _TurnFailed("busy" if code == "busy" else "error", code)
    usage = resp.get("usage") or {}
    ext = resp.get("visiongate") or {}
    rec.total_ms = (now - t_submit) * 1e3
    rec.output_tokens = int(usage.get("output_tokens", 0))
    rec.input_tokens = int(usage.get("input_tokens", 0))
    rec.cached_tokens = int((usage.get("input_token_details") or {}).get("cached_tokens", 0))
    rec.encode_wait_ms = float((ext.get("timings") or {}).get("encode_ms", 0.0))
    rec.vision = (ext.get("cache") or {}).get("vision")
    rec.visual_budget = (ext.get("cache") or {}).get("visual_budget")
    rec.image_tokens = int((usage.get("input_token_details") or {}).get("image_tokens", 0))
    rec.image_tokens_total = int(ext.get("image_tokens_total", 0))
    return "".join(
        p.get("text", "") for item in resp.get("output", []) for p in item.get("content", [])
    )


async def _connect(url: str, headers: dict[str, str] | None = None) -> Any:
    ws = await websockets.connect(
        url, additional_headers=headers, max_size=None, open_timeout=30, close_timeout=2
    )
    first = json.loads(await ws.recv())
    if first.get("type") != "session.created":
        await ws.close()
        code = ((first.get("error") or {}).get("code")) or "protocol_error"
        raise _TurnFailed("busy" if code == "busy" else "error", code)
    return ws


async def play_session(
    url: str,
    plan: SessionPlan,
    mode: Mode,
    records: list[TurnRecord],
    *,
    origin: float,
    stop_at: float | None,
    typing_s: float,
    max_tokens: int,
    turn_timeout_s: float,
    headers: dict[str, str] | None = None,
) -> None:
    """Play one session; append a `TurnRecord` per attempted turn to `records`. `headers` go
    with the WebSocket upgrade (e.g. `Authorization: Bearer <key>`).

    No turn starts after `stop_at` (loop time). A failed turn ends the session. Cancellation
    records the turn in flight as `abandoned` and closes the connection.
    """
    loop = asyncio.get_running_loop()
    history: list[dict[str, Any]] = []  # stateless: the conversation so far, resent every turn
    ws = None
    watch: set[str] = set()
    rec: TurnRecord | None = None
    next_turn = 0

    def failed(status: str, code: str) -> None:
        # a failure before a turn was sent (e.g. connecting) is the next turn's failure
        nonlocal rec
        if rec is None:
            rec = TurnRecord(session=plan.index, turn=next_turn, sent_s=loop.time() - origin)
        rec.status, rec.error_code = status, code  # type: ignore[assignment]
        records.append(rec)

    try:
        if mode == "stateful":
            ws = await _connect(url, headers)
            photo = _item("user", [{"type": "input_image", "image_url": plan.image_url}])
            watch.add(photo["event_id"])
            await ws.send(json.dumps(photo))  # encoding starts now, while the user types
        await asyncio.sleep(typing_s)
        for turn, question in enumerate(plan.questions):
            if stop_at is not None and loop.time() >= stop_at:
                return
            t_submit = loop.time()
            rec = TurnRecord(session=plan.index, turn=turn, sent_s=t_submit - origin)
            parts: list[dict[str, Any]] = [{"type": "input_text", "text": question}]
            if mode == "stateless":
                if turn == 0:
                    parts.insert(0, {"type": "input_image", "image_url": plan.image_url})
                history.append(_item("user", parts))
                ws = await _connect(url, headers)
                text = await _exchange(
                    ws,
                    history,
                    rec,
                    t_submit=t_submit,
                    max_tokens=max_tokens,
                    timeout_s=turn_timeout_s,
                    watch=set(),
                )
                await ws.close()
                ws = None
                history.append(_item("assistant", [{"type": "output_text", "text": text}]))
                history = [dict(h, event_id=f"evt_{secrets.token_hex(6)}") for h in history]
            else:
                await _exchange(
                    ws,
                    [_item("user", parts)],
                    rec,
                    t_submit=t_submit,
                    max_tokens=max_tokens,
                    timeout_s=turn_timeout_s,
                    watch=watch,
                )
            rec.done_s = loop.time() - origin
            records.append(rec)
            rec, next_turn = None, turn + 1
    except _TurnFailed as exc:
        failed(exc.status, exc.code)
    except TimeoutError:
        failed("abandoned", "turn_timeout")
    except (OSError, websockets.WebSocketException) as exc:
        failed("error", f"connection:{type(exc).__name__}")
    except asyncio.CancelledError:
        if rec is not None:
            rec.status = "abandoned"
            records.append(rec)
        raise
    finally:
        if ws is not None:
            await ws.close()


async def _bounded(tasks: list[asyncio.Task[None]], until: float) -> None:
    """Wait for `tasks` until loop time `until`, then cancel what is left."""
    loop = asyncio.get_running_loop()
    live = [t for t in tasks if not t.done()]
    if live:
        await asyncio.wait(live, timeout=max(0.0, until - loop.time()))
    for t in tasks:
        if not t.done():
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def closed_loop(
    url: str,
    mode: Mode,
    concurrency: int,
    next_plan: Callable[[], SessionPlan],
    *,
    window_s: float,
    drain_s: float,
    max_sessions: int,
    **play: Any,
) -> list[TurnRecord]:
    """`concurrency` users, each starting a new session as soon as the last one ends. The users'
    first sessions start spread over the first moments of the window (up to 2 s), not all in
    the same instant."""
    loop = asyncio.get_running_loop()
    origin = loop.time()
    stop_at = origin + window_s
    spread_s = min(2.0, window_s / 4)
    records: list[TurnRecord] = []
    started = 0

    async def user(rank: int) -> None:
        nonlocal started
        await asyncio.sleep(spread_s * rank / concurrency)
        while loop.time() < stop_at and started < max_sessions:
            started += 1
            before = len(records)
            await play_session(
                url, next_plan(), mode, records, origin=origin, stop_at=stop_at, **play
            )
            if any(r.status != "ok" for r in records[before:]):
                await asyncio.sleep(0.2)  # a refused user waits a moment before trying again

    tasks = [asyncio.create_task(user(rank)) for rank in range(concurrency)]
    await _bounded(tasks, stop_at + drain_s)
    return records


async def open_loop(
    url: str,
    mode: Mode,
    arrivals: list[float],
    next_plan: Callable[[], SessionPlan],
    *,
    window_s: float,
    drain_s: float,
    **play: Any,
) -> list[TurnRecord]:
    """A new session at each arrival offset (seconds); sessions play all their turns until the
    window plus the drain time is over."""
    loop = asyncio.get_running_loop()
    origin = loop.time()
    records: list[TurnRecord] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        for offset in arrivals:
            await asyncio.sleep(max(0.0, origin + offset - loop.time()))
            tasks.append(
                asyncio.create_task(
                    play_session(
                        url, next_plan(), mode, records, origin=origin, stop_at=None, **play
                    )
                )
            )
        await _bounded(tasks, origin + window_s + drain_s)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return records
