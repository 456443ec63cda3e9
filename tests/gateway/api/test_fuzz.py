"""Fuzzing the gateway's edges: Realtime frames (JSON text, msgpack binary) and HTTP bodies.

A real gateway (Litestar, uvicorn, the stores, the wire codecs) runs on a loopback port with the
deterministic fake engine and encoder, so thousands of cases run in seconds. Each case is a
valid event or body put through a few seeded mutations (wrong types, missing and extra fields,
huge, negative and non-finite numbers, deep nesting, long and odd unicode strings, invalid
UTF-8, random bytes, empty frames, unknown event types, bursts of item / response / cancel
events). After every case the gateway must have answered with a well-formed event or OpenAI
error object whose code is a stable one (never `internal_error`), and must still be serving:
a probe event on the same connection is answered, and every few cases a `session.update` round
trip, a WebSocket ping and `/healthz` are checked.

Bounds: each group runs a fixed number of cases, sized so the file runs in about 20 s on two
cores. `VISIONGATE_FUZZ_CASES=N` runs N cases per group instead (long runs);
`VISIONGATE_FUZZ_SEED=S` picks the seed (`random`: a fresh one). Every failure names the seed,
the group and the case, and shows the offending input; rerunning with the same seed replays
the same inputs in the same order. A bug that is known has a case of its own at the end of
the file, marked `xfail(strict=True)`; random cases that run into one are counted (printed at
the end with `-s`) rather than failed, so a long run goes on looking for new ones.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import io
import json
import math
import os
import random
import struct
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest
import websockets

from bench._soak_abuse import png_claiming
from gateway.api.openai.chat import protocol as hp
from gateway.api.realtime import protocol as rt
from gateway.protocol.errors import ERROR_CODES, GatewayError
from gateway.protocol.subprotocols import MSGPACK_SUBPROTOCOL
from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from gateway.settings import Settings
from gateway.testing.fakes import FakeEncoder, FakeEngine
from gateway.testing.images import data_url

KiB = 1024
MODEL = FakeEngine.model_id


def _seed() -> int:
    raw = os.environ.get("VISIONGATE_FUZZ_SEED", "").strip()
    if raw == "random":
        return random.SystemRandom().randrange(2**32)
    return int(raw) if raw else 20_240_917


SEED = _seed()


def cases(default: int) -> int:
    """Cases of one group: `default`, or VISIONGATE_FUZZ_CASES for a long run."""
    raw = os.environ.get("VISIONGATE_FUZZ_CASES", "").strip()
    return max(1, int(raw)) if raw else default


def case_rng(group: str, index: int) -> random.Random:
    # str seeds hash with SHA-512: the same case gets the same inputs on every run
    return random.Random(f"{SEED}:{group}:{index}")


def show(value: Any, limit: int = 600) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


class FuzzFailure(AssertionError):
    pass


def fail(group: str, index: int, what: str, case: Any, seen: Any = None) -> None:
    test = os.environ.get("PYTEST_CURRENT_TEST", "tests/gateway/api/test_fuzz.py").split(" ")[0]
    scale = os.environ.get("VISIONGATE_FUZZ_CASES", "").strip()
    scale = f" VISIONGATE_FUZZ_CASES={scale}" if scale else ""
    raise FuzzFailure(
        f"{what}\n  group {group!r}, case {index}, seed {SEED} "
        f"(rerun: VISIONGATE_FUZZ_SEED={SEED}{scale} pytest '{test}')\n"
        f"  input: {show(case)}" + (f"\n  seen: {show(seen, 1500)}" if seen is not None else "")
    )


# Bugs with a case of their own below (xfail strict). Random cases that run into one of them
# are counted, not failed, so a long run goes on looking for new ones: (name, the error's
# message, does the input hold the trigger). None open at the moment.
KNOWN_BUGS: tuple[tuple[str, str, Callable[[Any], bool]], ...] = ()
known_hits: dict[str, int] = {}


def known_bug(message: str, case: Any) -> bool:
    for name, text, trigger in KNOWN_BUGS:
        if text in message and trigger(case):
            known_hits[name] = known_hits.get(name, 0) + 1
            return True
    return False


# ---------------------------------------------------------------- the gateway under test


SETTINGS = {
    "log_level": "warning",
    "max_image_bytes": 256 * KiB,
    "max_pixels": 4_000_000,
    "max_text_chars": 4096,
    "max_images_per_session": 4,
    "max_items_per_session": 64,
    "max_output_tokens": 16,
    "max_output_tokens_limit": 64,
}


FRAME_LIMIT = Settings.load(SETTINGS, environ={}).ws_max_frame_bytes


@pytest.fixture(scope="module")
def gateway() -> Iterator[ServerThread]:
    settings = Settings.load(SETTINGS, environ={})
    # a small delay between deltas, so cancels and bursts meet responses still running
    app = create_app(settings, engine=FakeEngine(delay_s=0.001), encoder=FakeEncoder())
    with ServerThread(app, settings) as server:
        server.wait_ready(timeout=60)
        yield server
    if known_hits:
        print(f"\nfuzz cases that ran into known bugs (seed {SEED}): {known_hits}")


# ---------------------------------------------------------------- images


def _image(fmt: str, size: tuple[int, int] = (16, 12), mode: str = "RGB") -> bytes:
    from PIL import Image

    img = Image.new(mode, size, (200, 40, 90) if mode == "RGB" else None)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _images() -> dict[str, bytes]:
    good = {fmt: _image(fmt) for fmt in ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")}
    jpeg, png = good["JPEG"], good["PNG"]
    rng = random.Random(7)
    flipped = bytearray(jpeg)
    for _ in range(12):
        flipped[rng.randrange(20, len(flipped))] ^= 1 << rng.randrange(8)
    return {
        **{f"ok_{k.lower()}": v for k, v in good.items()},
        "ok_rgba_png": _image("PNG", (5, 7), "RGBA"),
        "ok_1x1_png": _image("PNG", (1, 1)),
        "truncated_jpeg": jpeg[: len(jpeg) // 2],
        "header_only_png": png[:33],
        "flipped_jpeg": bytes(flipped),
        "png_magic_then_noise": b"\x89PNG\r\n\x1a\n" + rng.randbytes(200),
        "bomb_png": png_claiming(100_000, 100_000),
        "zero_width_png": png_claiming(0, 10),
        "random_bytes": rng.randbytes(300),
        "svg": b"<svg xmlns='http://www.w3.org/2000/svg'/>",
        "pdf": b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n",
        "oversize": b"\xff\xd8\xff" + b"\0" * (SETTINGS["max_image_bytes"] + 10),
        "empty": b"",
    }


IMAGES = _images()
GOOD_IMAGES = [k for k in IMAGES if k.startswith("ok_")]


# ---------------------------------------------------------------- values and mutations


class BadUtf8(bytes):
    """A string field whose bytes are not UTF-8 (only in binary frames and HTTP bodies)."""


ODD_TEXT = (
    "",
    " ",
    "\x00",
    "\x00\x01\x1f\x7f",
    "\u202eevil",
    "e\u0301\u0301\u0301",
    "\u200b\u200d\ufeff",
    "\U0001f600\U0001f680",
    "日本語のテキスト",
    "\ud800",
    "a\udfffb",
    "\uffff\ufffe",
    "null",
    "true",
    "{}",
    '{"type":"error"}',
    "%s%n",
    "\\u0000",
    "../../etc/passwd",
    "data:image/png;base64,",
    "visiongate:sha256:",
    "inf",
    "NaN",
    "-0",
)
NUMBERS = (
    0,
    1,
    -1,
    2,
    7,
    64,
    65,
    2**31,
    2**31 - 1,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    2**70,
    -(2**63),
    -(2**63) - 1,
    -(2**70),
    0.5,
    -0.0,
    1e-300,
    5e-324,
    1e308,
    -1e308,
    1.7976931348623157e308,
    math.nan,
    math.inf,
    -math.inf,
    2.0000001,
)
KNOWN_TYPES = ("session.update", "conversation.item.create", "response.create", "response.cancel")
OTHER_TYPES = (
    "",
    "session.created",
    "response.done",
    "error",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "conversation.item.delete",
    "conversation.item.truncate",
    "conversation.item.retrieve",
    "transcription_session.update",
    "output_audio_buffer.clear",
    "SESSION.UPDATE",
    "session.update ",
    "response.create\x00",
    "x" * 300,
    "response.*",
)


class Gen:
    """Seeded random values of every kind a frame or body might hold. BadUtf8 values make a
    JSON frame travel as binary (a text frame must be UTF-8); NaN and infinities are written
    as Python's json writes them, which JSON decoders must refuse."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def text(self) -> Any:
        r = self.rng.random()
        if r < 0.35:
            return self.rng.choice(ODD_TEXT)
        if r < 0.55:
            return "".join(self.rng.choice("abc xyz.,?!") for _ in range(self.rng.randrange(40)))
        if r < 0.75:  # random code points, surrogates included
            return "".join(chr(self.rng.randrange(0x110000)) for _ in range(self.rng.randrange(30)))
        if r < 0.9:
            unit = self.rng.choice(("word ", "é", "\U0001f600", "\x00", "a"))
            return unit * self.rng.choice((1000, 4096, 4097, 20_000, 100_000))
        return BadUtf8(self.rng.choice((b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"ok\xe2\x82")))

    def number(self) -> Any:
        return self.rng.choice(NUMBERS)

    def scalar(self) -> Any:
        return self.rng.choice((None, True, False, self.number(), self.text(), self.number()))

    def value(self, depth: int = 0) -> Any:
        r = self.rng.random()
        if depth > 3 or r < 0.6:
            return self.scalar()
        if r < 0.8:
            return [self.value(depth + 1) for _ in range(self.rng.randrange(4))]
        return {self.key(): self.value(depth + 1) for _ in range(self.rng.randrange(4))}

    def key(self) -> Any:
        return self.rng.choice(
            (
                "type",
                "event_id",
                "item",
                "session",
                "response",
                "content",
                "text",
                "image_url",
                "role",
                "x",
                "",
                "\x00",
                "🔑",
                self.text(),
            )
        )

    def nested(self, inner: Any) -> Any:
        # deep, but under the decoder's recursion limit: the known deep-nesting failure has
        # its own case (test_deep_nesting_*)
        for _ in range(self.rng.randrange(2, 120)):
            inner = [inner] if self.rng.random() < 0.5 else {"a": inner}
        return inner


def _slots(node: Any) -> list[tuple[Any, Any]]:
    """(container, key) of every node below `node`."""
    out: list[tuple[Any, Any]] = []
    stack = [node]
    while stack:
        cur = stack.pop()
        items = (
            cur.items()
            if isinstance(cur, dict)
            else enumerate(cur)
            if isinstance(cur, list)
            else ()
        )
        for key, child in list(items):
            out.append((cur, key))
            stack.append(child)
    return out


def mutate(tree: Any, gen: Gen, count: int) -> Any:
    """Apply `count` random mutations to a JSON-like tree (in place where it can)."""
    rng = gen.rng
    for _ in range(count):
        slots = _slots(tree)
        op = rng.choice(
            (
                "replace",
                "replace",
                "delete",
                "extra",
                "retype",
                "nest",
                "long",
                "number",
                "repeat",
                "event_id",
                "root",
            )
        )
        if op == "root" and rng.random() < 0.15:
            tree = gen.value()
            continue
        if op == "retype" and isinstance(tree, dict):
            tree["type"] = rng.choice(KNOWN_TYPES + OTHER_TYPES + (gen.scalar(),))
            continue
        if op == "event_id" and isinstance(tree, dict):
            tree["event_id"] = gen.scalar()
            continue
        if op == "extra":
            dicts = [tree] + [c[k] for c, k in slots if isinstance(c[k], dict)]
            target = rng.choice(dicts) if isinstance(tree, dict) else None
            if isinstance(target, dict):
                key = gen.key()
                if isinstance(key, str):
                    target[key] = gen.value()
            continue
        if not slots:
            continue
        container, key = rng.choice(slots)
        if op == "delete":
            del container[key]
        elif op == "nest":
            container[key] = gen.nested(container[key])
        elif op == "long":
            container[key] = gen.text()
        elif op == "number":
            container[key] = gen.number()
        elif op == "repeat" and isinstance(container[key], list) and container[key]:
            container[key] = container[key] * rng.choice((2, 20, 200))
        else:
            container[key] = gen.value()
    return tree


# ---------------------------------------------------------------- encoders that can lie


def _clean(value: Any, marks: dict[str, bytes]) -> Any:
    """Swap BadUtf8 for placeholder strings (filled back in after encoding)."""
    if isinstance(value, BadUtf8):
        mark = f"@@bad{len(marks)}@@"
        marks[mark] = bytes(value)
        return mark
    if isinstance(value, dict):
        return {
            (_clean(k, marks) if isinstance(k, BadUtf8) else k): _clean(v, marks)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_clean(v, marks) for v in value]
    return value


def to_json(value: Any, rng: random.Random) -> bytes:
    """JSON bytes; NaN/Infinity appear as Python writes them (not JSON: must be refused)."""
    marks: dict[str, bytes] = {}
    cleaned = _clean(value, marks)
    try:
        text = json.dumps(cleaned, ensure_ascii=rng.random() < 0.5)
        data = text.encode()
    except (UnicodeEncodeError, TypeError, ValueError):
        text = json.dumps(cleaned, ensure_ascii=True, default=str)
        data = text.encode()
    for mark, raw in marks.items():
        data = data.replace(mark.encode(), raw)
    return data


def to_msgpack(value: Any) -> bytes:
    """msgpack written by hand, so it can carry what an encoder refuses: str bytes that are not
    UTF-8, lone surrogates (as their UTF-8-ish bytes), ints past 64 bits (as floats), non-str
    keys."""
    out = bytearray()

    def w(v: Any) -> None:
        if v is None:
            out.append(0xC0)
        elif v is True or v is False:
            out.append(0xC3 if v else 0xC2)
        elif isinstance(v, int):
            if 0 <= v < 128:
                out.append(v)
            elif -32 <= v < 0:
                out.append(v & 0xFF)
            elif 0 <= v < 2**64:
                out.append(0xCF)
                out.extend(struct.pack(">Q", v))
            elif -(2**63) <= v < 0:
                out.append(0xD3)
                out.extend(struct.pack(">q", v))
            else:
                w(float(v))
        elif isinstance(v, float):
            out.append(0xCB)
            out.extend(struct.pack(">d", v))
        elif isinstance(v, (str, BadUtf8)):
            raw = bytes(v) if isinstance(v, BadUtf8) else v.encode("utf-8", "surrogatepass")
            n = len(raw)
            if n < 32:
                out.append(0xA0 | n)
            elif n < 2**8:
                out.extend((0xD9, n))
            elif n < 2**16:
                out.append(0xDA)
                out.extend(struct.pack(">H", n))
            else:
                out.append(0xDB)
                out.extend(struct.pack(">I", n))
            out.extend(raw)
        elif isinstance(v, (bytes, bytearray)):
            out.append(0xC6)
            out.extend(struct.pack(">I", len(v)))
            out.extend(v)
        elif isinstance(v, list):
            out.append(0xDD)
            out.extend(struct.pack(">I", len(v)))
            for x in v:
                w(x)
        elif isinstance(v, dict):
            out.append(0xDF)
            out.extend(struct.pack(">I", len(v)))
            for k, x in v.items():
                w(k)
                w(x)
        else:
            w(str(v))

    w(value)
    return bytes(out)


# ---------------------------------------------------------------- valid events to start from


class Memory:
    """What a connection has seen: item ids and image digests, for references that exist."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.digests: list[str] = []
        self.responses: list[str] = []


def image_url(rng: random.Random, memory: Memory) -> str:
    r = rng.random()
    if r < 0.45:
        name = rng.choice(GOOD_IMAGES)
        return data_url(IMAGES[name], "image/" + name.split("_")[-1])
    if r < 0.65:
        return data_url(
            IMAGES[rng.choice(list(IMAGES))], rng.choice(("image/png", "image/jpeg", ""))
        )
    if r < 0.7:  # a few bytes
        return data_url(rng.randbytes(rng.randrange(1, 17)), "image/png")
    if r < 0.78 and memory.digests:
        return "visiongate:sha256:" + rng.choice(memory.digests)
    return rng.choice(
        (
            "visiongate:sha256:" + hashlib.sha256(rng.randbytes(8)).hexdigest(),
            "visiongate:sha256:" + "G" * 64,
            "visiongate:sha256:abc",
            "VISIONGATE:SHA256:" + "a" * 64,
            "http://127.0.0.1:9/x.png",
            "https://",
            "",
            "data:,",
            "data:image/png,notbase64",
            "data:text/plain;base64,aGVsbG8=",
            "data:image/png;base64,!!!!",
            "data:image/png;base64,",
            "data:image/png;charset=x;base64,AAAAAAAA",
            "data:image/png;base64," + "A" * 400_000,
            "file:///etc/passwd",
            "javascript:alert(1)",
        )
    )


def content_part(rng: random.Random, memory: Memory) -> dict[str, Any]:
    kind = rng.choice(
        ("input_text", "input_text", "input_image", "input_image", "text", "output_text")
    )
    if kind == "input_image":
        part: dict[str, Any] = {"type": kind, "image_url": image_url(rng, memory)}
        if rng.random() < 0.3:
            part["detail"] = rng.choice(("auto", "low", "high"))
        return part
    return {"type": kind, "text": rng.choice(("What is in the photo?", "hello there", "ok", "x"))}


def valid_event(rng: random.Random, memory: Memory, kind: str | None = None) -> dict[str, Any]:
    kind = kind or rng.choice(KNOWN_TYPES)
    event: dict[str, Any] = {"type": kind}
    if rng.random() < 0.9:
        event["event_id"] = f"evt_{rng.getrandbits(48):012x}"
    if kind == "session.update":
        cfg: dict[str, Any] = {}
        for key, make in (
            ("instructions", lambda: rng.choice(("Be brief.", "", "Answer in French."))),
            ("max_output_tokens", lambda: rng.choice((1, 8, 64, "inf"))),
            ("temperature", lambda: rng.choice((0.0, 0.7, 2.0))),
            ("top_p", lambda: rng.choice((0.1, 1.0))),
            ("seed", lambda: rng.randrange(2**32)),
            ("output_modalities", lambda: ["text"]),
            ("model", lambda: MODEL),
            ("type", lambda: "realtime"),
        ):
            if rng.random() < 0.3:
                cfg[key] = make()
        event["session"] = cfg
    elif kind == "conversation.item.create":
        role = rng.choice(("user", "user", "user", "system", "assistant"))
        parts = [content_part(rng, memory) for _ in range(rng.randrange(1, 4))]
        if role != "user":
            parts = [
                {"type": "output_text" if role == "assistant" else "input_text", "text": "noted"}
            ]
        item: dict[str, Any] = {"type": "message", "role": role, "content": parts}
        if rng.random() < 0.2:
            item["id"] = (
                rng.choice(memory.items)
                if memory.items and rng.random() < 0.5
                else f"item_{rng.getrandbits(32):08x}"
            )
        event["item"] = item
        if rng.random() < 0.2:
            event["previous_item_id"] = rng.choice(["root", "item_missing", *memory.items[-3:]])
    elif kind == "response.create":
        if rng.random() < 0.7:
            params: dict[str, Any] = {}
            for key, make in (
                ("max_output_tokens", lambda: rng.choice((1, 4, 16, "inf"))),
                ("temperature", lambda: rng.choice((0.0, 1.0))),
                ("top_p", lambda: 0.9),
                ("seed", lambda: 7),
                ("instructions", lambda: "Short answers."),
                ("conversation", lambda: rng.choice(("auto", "none"))),
                ("metadata", lambda: {"k": "v"}),
                ("output_modalities", lambda: ["text"]),
            ):
                if rng.random() < 0.3:
                    params[key] = make()
            event["response"] = params
    elif rng.random() < 0.5 and memory.responses:
        event["response_id"] = rng.choice(memory.responses)
    elif rng.random() < 0.3:
        event["response_id"] = "resp_unknown"
    return event


# ---------------------------------------------------------------- a Realtime peer that checks


JSON_EVENTS = msgspec.json.Decoder(rt.ServerEvent)
MSGPACK_EVENTS = msgspec.msgpack.Decoder(rt.ServerEvent)


class Peer:
    """One fuzzed WebSocket: sends frames, reads and validates every server event."""

    def __init__(self, ws: Any, binary: bool, group: str) -> None:
        self.ws = ws
        self.binary = binary
        self.group = group
        self.codec = rt.WireCodec(binary=binary)  # the server's own decoder, as the oracle
        self.memory = Memory()
        self.sent_ids: set[str] = set()
        self.log: list[dict[str, Any]] = []  # every event, as plain data
        self.active: str | None = None  # the response in progress, from the event stream
        self.created = 0
        self.done = 0
        self._probes = 0
        self.index = 0  # the case being run, for failure messages
        self.case: Any = None

    @classmethod
    async def open(cls, url: str, *, binary: bool, group: str) -> Peer:
        ws = await websockets.connect(
            url,
            subprotocols=[MSGPACK_SUBPROTOCOL] if binary else None,
            max_size=None,
            proxy=None,
            open_timeout=10,
            close_timeout=2,
            ping_interval=None,
            compression=None,
        )
        assert ws.subprotocol == (MSGPACK_SUBPROTOCOL if binary else None)
        peer = cls(ws, binary, group)
        first = await peer.recv()
        assert first["type"] == "session.created", first
        return peer

    def fail(self, what: str, seen: Any = None) -> None:
        fail(self.group, self.index, what, self.case, seen)

    async def send(self, frame: str | bytes, *, text: bool | None = None) -> None:
        try:
            await self.ws.send(frame, text=text)
        except websockets.ConnectionClosed as exc:
            self.fail(f"the gateway closed the connection: {exc.rcvd}", self.log[-5:])

    async def recv(self, timeout: float = 10.0) -> dict[str, Any]:
        try:
            raw = await asyncio.wait_for(self.ws.recv(), timeout)
        except TimeoutError:
            self.fail(f"no server event within {timeout} s (hang)", self.log[-5:])
        except websockets.ConnectionClosed as exc:
            self.fail(f"the gateway closed the connection: {exc.rcvd}", self.log[-5:])
        if isinstance(raw, str) == self.binary:
            self.fail(
                f"a {'text' if isinstance(raw, str) else 'binary'} frame on a "
                f"{'msgpack' if self.binary else 'JSON'} connection",
                raw,
            )
        try:
            (MSGPACK_EVENTS if self.binary else JSON_EVENTS).decode(raw)
        except msgspec.MsgspecError as exc:
            self.fail(f"a malformed server event: {exc}", raw)
        event = (msgspec.msgpack if self.binary else msgspec.json).decode(raw)
        self._track(event)
        return event

    def _track(self, event: dict[str, Any]) -> None:
        self.log.append(event)
        kind = event["type"]
        if kind == "error":
            err = event["error"]
            code = err["code"]
            if code == "internal_error" and known_bug(err["message"], self.case):
                return
            if code not in ERROR_CODES or code == "internal_error":
                self.fail(f"error event with code {code!r}: {err['message']}", event)
            if err["type"] != ERROR_CODES[code][0]:
                self.fail(f"error type {err['type']!r} does not match code {code!r}", event)
            eid = err.get("event_id")
            if eid is not None and eid not in self.sent_ids:
                self.fail(f"error echoes event_id {eid!r}, which was never sent", event)
        elif kind == "response.created":
            if self.active is not None:
                self.fail("a second response started while one was in progress", self.log[-8:])
            self.active = event["response"]["id"]
            self.memory.responses.append(self.active)
            self.created += 1
        elif kind == "response.done":
            rid = event["response"]["id"]
            if self.active is not None and rid != self.active:
                self.fail(f"response.done for {rid} while {self.active} was in progress", event)
            failed = event["response"].get("status_details", {}).get("error") or {}
            if (
                failed.get("code") in ("internal_error", None)
                and event["response"]["status"] == "failed"
            ):
                self.fail("a response failed without a stable code", event)
            self.active = None
            self.done += 1
        elif (
            kind in ("response.output_text.delta", "response.output_text.done")
            and event["response_id"] != self.active
        ):
            self.fail(f"{kind} outside its response", self.log[-8:])
        elif kind == "conversation.item.added":
            self.memory.items.append(event["item"]["id"])
        elif kind == "visiongate.image.encoded":
            self.memory.digests.append(event["digest"])

    def remember(self, event: Any) -> None:
        if isinstance(event, dict) and isinstance(event.get("event_id"), str):
            self.sent_ids.add(event["event_id"])

    async def until(self, match, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Events up to and including the first that `match`es."""
        seen: list[dict[str, Any]] = []
        while True:
            event = await self.recv(timeout)
            seen.append(event)
            if match(event):
                return seen

    def encode(self, event: dict[str, Any]) -> bytes | str:
        if self.binary:
            return msgspec.msgpack.encode(event)
        return json.dumps(event)

    async def probe(self) -> list[dict[str, Any]]:
        """Send an event that always gets an error echoing its id; return what came before it.
        Frames are handled in order, so the fuzzed frame's own answer is in there."""
        self._probes += 1
        pid = f"probe_{self._probes}"
        self.sent_ids.add(pid)
        await self.send(
            self.encode(
                {"type": "response.cancel", "event_id": pid, "response_id": "resp_probe_never"}
            )
        )
        seen = await self.until(lambda e: e["type"] == "error" and e["error"]["event_id"] == pid)
        if seen[-1]["error"]["code"] != "response_not_found":
            self.fail("the probe got the wrong answer", seen[-1])
        return seen[:-1]

    async def round_trip(self) -> None:
        """`session.update` answered with `session.updated`, and a WebSocket ping with a pong."""
        await self.send(self.encode({"type": "session.update", "session": {}}))
        await self.until(lambda e: e["type"] == "session.updated")
        pong = await self.ws.ping()
        try:
            await asyncio.wait_for(pong, 10)
        except TimeoutError:
            self.fail("no pong within 10 s")

    async def finish(self) -> None:
        """Every started response ends; then a plain turn still works end to end."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while self.active is not None:
            await self.recv(max(0.1, deadline - loop.time()))
        await self.round_trip()
        item = {
            "type": "conversation.item.create",
            "event_id": "final_item",
            "item": {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "final check"}],
            },
        }
        self.sent_ids.add("final_item")
        await self.send(self.encode(item))
        for attempt in range(3):
            # a response the fuzzing started may not have announced itself yet: then this one
            # is refused as in progress, and asked again once that one is done
            eid = f"final_response_{attempt}"
            self.sent_ids.add(eid)
            await self.send(
                self.encode(
                    {
                        "type": "response.create",
                        "event_id": eid,
                        "response": {"max_output_tokens": 8},
                    }
                )
            )
            seen = await self.until(
                lambda e, eid=eid: (
                    e["type"] == "response.done"
                    or (e["type"] == "error" and e["error"]["event_id"] == eid)
                ),
                timeout=15,
            )
            if seen[-1]["type"] == "response.done":
                break
            if seen[-1]["error"]["code"] != "response_in_progress":
                self.fail("the final response.create was refused", seen)
            await self.until(lambda e: e["type"] == "response.done", timeout=15)
        done = seen[-1]["response"]
        if done["status"] == "failed":
            code = done["status_details"]["error"]["code"]
            # a conversation the fuzzing filled to its limits may refuse more, with its code
            if code not in ("context_length_exceeded", "input_too_large"):
                self.fail(f"the final turn failed with {code!r}", seen)
        await self.ws.close()

    def expectation(self, frame: str | bytes) -> tuple[str, Any]:
        """What the server must answer `frame` with, by its own decoder: ("error", code, id)
        when decoding refuses it, else the event type."""
        try:
            event = self.codec.decode(frame)
        except GatewayError as exc:
            return "error", (exc.code, getattr(exc, "event_id", None))
        except Exception as exc:  # the decoder itself failing: any stable error will do
            return "error", (None, type(exc).__name__)
        return "event", event

    async def check_case(self, frame: str | bytes, *, text: bool | None = None) -> None:
        kind, detail = self.expectation(frame)
        await self.send(frame, text=text)
        seen = await self.probe()
        errors = [e["error"] for e in seen if e["type"] == "error"]
        if kind == "error":
            code, eid = detail
            if code is None:
                if not errors:
                    self.fail(f"the decoder raised {eid} and no error event came back", seen)
            elif not any(e["code"] == code and _same_id(e["event_id"], eid) for e in errors):
                self.fail(f"expected an error {code!r} echoing event_id {eid!r}", seen)
            return
        own = [e for e in errors if _same_id(e["event_id"], detail.event_id)]
        answers = {e["type"] for e in seen}
        if isinstance(detail, rt.SessionUpdate) and not own and "session.updated" not in answers:
            self.fail("session.update got neither session.updated nor an error", seen)
        if (
            isinstance(detail, rt.ConversationItemCreate)
            and not own
            and "conversation.item.added" not in answers
        ):
            self.fail("conversation.item.create got neither an item nor an error", seen)


def _same_id(echoed: str | None, sent: str | None) -> bool:
    # an empty event_id may come back as null: test_empty_event_id_is_echoed
    return echoed == sent or (sent == "" and echoed is None)


def ws_frame(peer: Peer, rng: random.Random) -> tuple[str | bytes, bool | None, Any]:
    """One mutated event, encoded for the peer's connection: (frame, text flag, the tree)."""
    gen = Gen(rng)
    event = valid_event(rng, peer.memory)
    original = copy.deepcopy(event)
    mutations = rng.choice((0, 0, 1, 1, 1, 2, 3))
    tree = mutate(event, gen, mutations)
    data = to_msgpack(tree) if peer.binary else to_json(tree, rng)
    if len(data) > FRAME_LIMIT:  # past the frame limit: test_frame_over_the_limit
        tree = original
        data = to_msgpack(tree) if peer.binary else to_json(tree, rng)
    peer.remember(tree)
    if peer.binary:
        return data, None, tree
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return data, None, tree  # invalid UTF-8 can only travel in a binary frame
    # JSON in a binary frame is decoded all the same: send some that way
    return (data, None, tree) if rng.random() < 0.1 else (text, None, tree)


async def _run_ws_group(
    url: str, group: str, *, binary: bool, total: int, per_connection: int = 40
) -> None:
    index = 0
    while index < total:
        peer = await Peer.open(url, binary=binary, group=group)
        for _ in range(min(per_connection, total - index)):
            rng = case_rng(group, index)
            frame, text, tree = ws_frame(peer, rng)
            peer.index, peer.case = index, tree
            await peer.check_case(frame, text=text)
            if index % 10 == 9:
                await peer.round_trip()
            index += 1
        await peer.finish()


async def test_realtime_json_frames(gateway: ServerThread) -> None:
    await _run_ws_group(gateway.ws_url, "ws_json", binary=False, total=cases(2500))


async def test_realtime_msgpack_frames(gateway: ServerThread) -> None:
    await _run_ws_group(gateway.ws_url, "ws_msgpack", binary=True, total=cases(1500))


def raw_frame(rng: random.Random, binary: bool) -> tuple[str | bytes, bool | None]:
    """Frames that are not events at all."""
    valid = {"type": "session.update", "event_id": "raw", "session": {"instructions": "hi"}}
    encoded = msgspec.msgpack.encode(valid) if binary else json.dumps(valid).encode()
    choice = rng.randrange(14)
    if choice == 0:
        return (b"" if rng.random() < 0.5 else ""), None
    if choice == 1:
        return rng.randbytes(rng.randrange(1, 2000)), None
    if choice == 2:  # truncated
        return encoded[: rng.randrange(1, len(encoded))], None
    if choice == 3:  # trailing garbage
        return encoded + rng.choice((b" ", b"}", b"\x00", b"{}", rng.randbytes(3))), None
    if choice == 4:
        return b"\xef\xbb\xbf" + encoded, None  # BOM
    if choice == 5:  # a text frame on a msgpack connection, a binary one on a JSON connection
        return (json.dumps(valid), True) if binary else (encoded, False)
    if choice == 6:
        return rng.choice(
            (
                "null",
                "[]",
                "123",
                '"str"',
                "true",
                "{}",
                " ",
                "\n",
                "[{}]",
                '{"type":null}',
                '{"type":1}',
                '{"type":["session.update"]}',
                '{"type":"response.create","response":[]}',
            )
        ), True
    if choice == 7:  # msgpack oddities: ext types, non-str keys, a bare array
        return rng.choice(
            (
                b"\xd4\x01\x00",
                b"\xc7\x00\x05",
                b"\x81\x01\x02",
                b"\x81\xc0\xc0",
                b"\x91\xa4type",
                b"\xc1",
                b"\xdd\xff\xff\xff\xff",
                b"\xdf\xff\xff\xff\xff",
                b"\xdb\xff\xff\xff\xff",
            )
        ), False
    if choice == 8:  # a string header promising more than the frame holds
        return b"\x81\xa4type\xdb\x7f\xff\xff\xff", False
    if choice == 9:  # JSON with numbers no decoder can hold
        return rng.choice(
            (
                '{"type":"response.create","response":{"seed":1e999}}',
                '{"type":"response.create","response":{"seed":' + "9" * 5000 + "}}",
                '{"type":"session.update","session":{"temperature":NaN}}',
                '{"type":"session.update","session":{"top_p":-Infinity}}',
            )
        ), True
    if choice == 10:  # duplicate keys
        return '{"type":"session.update","type":"response.create","session":{}}', True
    if choice == 11:
        return "\x00" * rng.randrange(1, 100), True
    if choice == 12:  # invalid UTF-8 inside a binary frame
        return b'{"type":"session.update","session":{"instructions":"\xff\xfe"}}', False
    return json.dumps(valid) * rng.randrange(2, 5), True  # concatenated events


async def test_realtime_raw_frames(gateway: ServerThread) -> None:
    total = cases(800)
    for binary in (False, True):
        group = "ws_raw_msgpack" if binary else "ws_raw_json"
        index = 0
        while index < total // 2:
            peer = await Peer.open(gateway.ws_url, binary=binary, group=group)
            for _ in range(min(50, total // 2 - index)):
                frame, text = raw_frame(case_rng(group, index), binary)
                peer.index, peer.case = index, frame
                await peer.check_case(frame, text=text)
                index += 1
            await peer.round_trip()
            await peer.finish()


async def test_realtime_interleavings(gateway: ServerThread) -> None:
    """Bursts of item / response / cancel / update events sent without waiting for answers:
    one response at a time, each that started ends, and the connection keeps serving."""
    total = cases(300)
    group = "ws_interleave"
    index = 0
    while index < total:
        binary = index % 40 >= 20
        peer = await Peer.open(gateway.ws_url, binary=binary, group=group)
        for _ in range(min(20, total - index)):
            rng = case_rng(group, index)
            burst = []
            for _ in range(rng.randrange(2, 9)):
                kind = rng.choice(
                    (
                        "conversation.item.create",
                        "response.create",
                        "response.create",
                        "response.cancel",
                        "response.cancel",
                        "session.update",
                    )
                )
                event = valid_event(rng, peer.memory, kind)
                if rng.random() < 0.15:
                    mutated = mutate(copy.deepcopy(event), Gen(rng), 1)
                    if len(to_msgpack(mutated)) < FRAME_LIMIT // 2:
                        event = mutated
                peer.remember(event)
                burst.append(event)
            peer.index, peer.case = index, burst
            for event in burst:
                frame: str | bytes = to_msgpack(event) if binary else to_json(event, rng)
                if not binary and _is_utf8(frame):
                    frame = frame.decode()
                await peer.send(frame)
                if rng.random() < 0.3:
                    await asyncio.sleep(rng.choice((0.0, 0.002, 0.01)))
            await peer.probe()
            index += 1
        await peer.finish()
        if peer.created != peer.done:
            peer.fail(f"{peer.created} responses started, {peer.done} ended", peer.log[-10:])


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


async def test_realtime_invalid_utf8_text_frame_closes_with_1007(gateway: ServerThread) -> None:
    """A text frame that is not UTF-8 breaks the WebSocket protocol itself: the connection is
    closed with 1007 (RFC 6455), and the gateway goes on serving new connections."""
    ws = await websockets.connect(gateway.ws_url, proxy=None, ping_interval=None)
    await ws.recv()  # session.created
    await ws.send(b'{"type":"session.update","session":{"instructions":"\xff"}}', text=True)
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1007
    peer = await Peer.open(gateway.ws_url, binary=False, group="ws_utf8")
    await peer.round_trip()
    await peer.finish()


async def test_realtime_fuzzed_connect_queries(gateway: ServerThread) -> None:
    """Odd `?session_id=` values: a new session, or `session_not_found` and close 1008."""
    from urllib.parse import quote

    rng = case_rng("ws_query", 0)
    gen = Gen(rng)
    for index in range(cases(30)):
        value = gen.text()
        value = value.decode("latin-1") if isinstance(value, BadUtf8) else str(value)
        # past ~8 KB the upgrade is refused with 400: test_long_upgrade_request_line
        query = quote(value.encode("utf-8", "surrogatepass"), safe="")[:6000]
        url = f"{gateway.ws_url}?session_id={query}"
        ws = await websockets.connect(url, proxy=None, ping_interval=None, max_size=None)
        try:
            raw = await asyncio.wait_for(ws.recv(), 10)
            event = JSON_EVENTS.decode(raw)
            if isinstance(event, rt.ErrorEvent):
                if event.error.code != "session_not_found":
                    fail("ws_query", index, f"connect answered {event.error.code!r}", value)
                with pytest.raises(websockets.ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 10)
                assert ws.close_code == 1008
            elif not value and not isinstance(event, rt.SessionCreated):
                fail("ws_query", index, f"connect answered {type(event).__name__}", value)
        finally:
            await ws.close()


def _nested_event(kind: str, field: str, binary: bool, depth: int = 5000) -> bytes | str:
    """An event whose `field` holds arrays nested `depth` deep."""
    outer = "session" if kind == "session.update" else "response"
    if binary:
        head = msgspec.msgpack.encode({"type": kind, "event_id": "deep", outer: {field: 0}})
        return head[:-1] + b"\x91" * depth + b"\xc0"  # the 0 swapped for the nesting
    return (
        f'{{"type":"{kind}","event_id":"deep","{outer}":{{"{field}":'
        + "[" * depth
        + "]" * depth
        + "}}"
    )


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize(
    ("kind", "field"),
    [
        ("response.create", "input"),  # a list[Any] field: the decoder itself goes deep
        # a typed field: validation fails at once, then the read of the envelope goes deep
        ("session.update", "instructions"),
    ],
)
async def test_deep_nesting_realtime(
    gateway: ServerThread, binary: bool, kind: str, field: str
) -> None:
    peer = await Peer.open(gateway.ws_url, binary=binary, group="ws_deep")
    peer.sent_ids.add("deep")
    frame = _nested_event(kind, field, binary)
    peer.case = frame
    await peer.send(frame)
    seen = await peer.probe()
    codes = [e["error"]["code"] for e in seen if e["type"] == "error"]
    assert codes in (["invalid_event"], ["invalid_json"]), seen
    await peer.finish()


# ---------------------------------------------------------------- HTTP


def chat_body(rng: random.Random, digests: list[str]) -> dict[str, Any]:
    memory = Memory()
    memory.digests = digests
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        messages.append({"role": rng.choice(("system", "developer")), "content": "Be brief."})
    for turn in range(rng.randrange(1, 4)):
        if turn:
            messages.append(
                {
                    "role": "assistant",
                    "content": rng.choice(
                        (
                            "ok",
                            None,
                            [{"type": "text", "text": "fine"}],
                            [{"type": "refusal", "refusal": "no"}],
                        )
                    ),
                }
            )
        if rng.random() < 0.4:
            content: Any = rng.choice(("What is this?", "hi", ""))
        else:
            content = []
            for _ in range(rng.randrange(1, 4)):
                if rng.random() < 0.5:
                    content.append({"type": "text", "text": "Describe it."})
                else:
                    url = image_url(rng, memory)
                    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
                    if rng.random() < 0.3:
                        part["image_url"]["detail"] = rng.choice(("auto", "low", "high"))
                    content.append(part)
        messages.append({"role": "user", "content": content})
    body: dict[str, Any] = {
        "model": MODEL if rng.random() < 0.95 else "gpt-4o",
        "messages": messages,
    }
    for key, make in (
        ("stream", lambda: rng.random() < 0.5),
        ("max_tokens", lambda: rng.randrange(1, 9)),
        ("max_completion_tokens", lambda: rng.randrange(1, 9)),
        ("temperature", lambda: 0.0),
        ("top_p", lambda: 1.0),
        ("stop", lambda: rng.choice(("is", ["x", "y"]))),
        ("seed", lambda: 3),
        ("n", lambda: 1),
        ("user", lambda: "u1"),
        ("metadata", lambda: {"a": "b"}),
        ("session_id", lambda: f"sess-fuzz-{rng.randrange(4)}"),
    ):
        if rng.random() < 0.3:
            body[key] = make()
    if body.get("stream") and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


CHAT_COMPLETION = msgspec.json.Decoder(hp.ChatCompletion)
CHAT_CHUNK = msgspec.json.Decoder(hp.ChatCompletionChunk)
ERROR_RESPONSE = msgspec.json.Decoder(hp.ErrorResponse)
IMAGE_STATUS = msgspec.json.Decoder(hp.ImageStatus)


def check_error_body(raw: bytes, status: int) -> hp.ErrorResponse:
    error = ERROR_RESPONSE.decode(raw)  # the OpenAI shape: {"error": {message, type, param, code}}
    code = error.error.code
    assert code in ERROR_CODES and code != "internal_error", f"code {code!r}"
    assert error.error.type == ERROR_CODES[code][0], f"type {error.error.type!r} for {code!r}"
    # the code's status; the router's own refusals (no such path, wrong method) keep theirs
    assert status == ERROR_CODES[code][1] or (code == "invalid_request" and status in (404, 405)), (
        f"status {status} for code {code!r}"
    )
    return error


class HttpFuzz:
    def __init__(self, client: httpx.AsyncClient, group: str) -> None:
        self.client = client
        self.group = group
        self.requests = 0

    async def request(
        self, index: int, case: Any, method: str, path: str, **kwargs: Any
    ) -> httpx.Response:
        try:
            response = await self.client.request(method, path, **kwargs)
        except httpx.TimeoutException:
            fail(self.group, index, f"{method} {path}: no answer within the timeout (hang)", case)
        except httpx.TransportError as exc:
            fail(self.group, index, f"{method} {path}: the connection failed: {exc!r}", case)
        self.requests += 1
        try:
            self._check(response)
        except (AssertionError, msgspec.MsgspecError) as exc:
            if response.status_code in (404, 500) and known_bug(response.text, case):
                return response
            fail(
                self.group,
                index,
                f"{method} {path} -> {response.status_code}: {exc}",
                case,
                response.content[:1500],
            )
        if self.requests % 25 == 0:
            await self.healthy(index, case)
        return response

    def _check(self, response: httpx.Response) -> None:
        status = response.status_code
        assert status < 500, "a server error"
        if status >= 400:
            check_error_body(response.content, status)
            return
        if response.request.url.path.endswith("/chat/completions"):
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                check_sse(response.content)
            else:
                CHAT_COMPLETION.decode(response.content)
        elif response.request.url.path.startswith("/v1/images"):
            status_body = IMAGE_STATUS.decode(response.content)
            if status_body.error is not None:
                assert status_body.error.code in ERROR_CODES
                assert status_body.error.code != "internal_error", status_body.error

    async def healthy(self, index: int, case: Any) -> None:
        response = await self.client.get("/healthz")
        if response.status_code != 200 or response.json().get("status") != "ok":
            fail(
                self.group, index, f"/healthz answered {response.status_code}", case, response.text
            )


def check_sse(body: bytes) -> None:
    frames = [f for f in body.split(b"\n\n") if f.strip()]
    assert frames and frames[-1] == b"data: [DONE]", "the stream does not end with [DONE]"
    for frame in frames[:-1]:
        assert frame.startswith(b"data: "), f"not an SSE data frame: {frame[:100]!r}"
        payload = frame[len(b"data: ") :]
        if payload.startswith(b'{"error"'):
            error = ERROR_RESPONSE.decode(payload).error
            assert error.code in ERROR_CODES and error.code != "internal_error", error
        else:
            CHAT_CHUNK.decode(payload)


@pytest.fixture
async def http(gateway: ServerThread):
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=15.0) as client:
        yield client


async def _known_digest(client: httpx.AsyncClient) -> str:
    response = await client.post(
        "/v1/images", content=IMAGES["ok_png"], headers={"content-type": "image/png"}
    )
    assert response.status_code == 200, response.text
    return response.json()["id"]


async def test_http_chat_bodies(gateway: ServerThread, http: httpx.AsyncClient) -> None:
    fuzz = HttpFuzz(http, "http_chat")
    digests = [await _known_digest(http)]
    for index in range(cases(800)):
        rng = case_rng("http_chat", index)
        body = mutate(chat_body(rng, digests), Gen(rng), rng.choice((0, 0, 1, 1, 2, 3)))
        data = to_json(body, rng)
        headers = {"content-type": "application/json"}
        if rng.random() < 0.1:
            headers["x-session-id"] = rng.choice(
                (b"", b"s" * 129, b"sess-fuzz-1", b"a b", "\u00e9t\u00e9".encode(), b"\xff")
            )
        await fuzz.request(
            index, body, "POST", "/v1/chat/completions", content=data, headers=headers
        )
    await fuzz.healthy(-1, None)


def raw_chat_body(rng: random.Random) -> tuple[bytes, dict[str, str]]:
    valid = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    json_type = {"content-type": "application/json"}
    choice = rng.randrange(10)
    if choice == 0:
        return b"", rng.choice((json_type, {}))
    if choice == 1:
        return rng.randbytes(rng.randrange(1, 3000)), json_type
    if choice == 2:
        return valid[: rng.randrange(1, len(valid))], json_type
    if choice == 3:
        return valid + rng.choice((b"x", b"}", b"\x00", b" []")), json_type
    if choice == 4:
        return rng.choice(
            (
                b"null",
                b"[]",
                b"1",
                b'"x"',
                b"{}",
                b"true",
                b"\xef\xbb\xbf{}",
                b'{"model":NaN}',
                b'{"model":"m","messages":Infinity}',
                b'{"messages":[],"messages":[1]}',
            )
        ), json_type
    if choice == 5:
        return valid, rng.choice(
            (
                {"content-type": "text/plain"},
                {"content-type": "image/png"},
                {"content-type": "multipart/form-data; boundary=x"},
                {"content-type": "application/x-www-form-urlencoded"},
                {"content-type": "application/json; charset=latin-1"},
                {},
            )
        )
    if choice == 6:
        return (
            b'{"model":"'
            + MODEL.encode()
            + b'","messages":[{"role":"user","content":"\xff\xfe"}]}',
            json_type,
        )
    if choice == 7:
        return (
            b'{"model":"'
            + MODEL.encode()
            + b'","max_tokens":'
            + b"9" * rng.choice((20, 5000))
            + b',"messages":[{"role":"user","content":"hi"}]}'
        ), json_type
    if choice == 8:
        return b'--x\r\nContent-Disposition: form-data; name="a"\r\n\r\nb\r\n--x--\r\n', {
            "content-type": "multipart/form-data; boundary=x"
        }
    return valid.replace(b"hi", b"\\ud800\\udc00\\ud800"), json_type


async def test_http_raw_bodies(gateway: ServerThread, http: httpx.AsyncClient) -> None:
    fuzz = HttpFuzz(http, "http_raw")
    for index in range(cases(400)):
        rng = case_rng("http_raw", index)
        body, headers = raw_chat_body(rng)
        method = "POST" if rng.random() < 0.95 else rng.choice(("PUT", "PATCH", "GET", "DELETE"))
        await fuzz.request(
            index,
            (method, headers, body),
            method,
            "/v1/chat/completions",
            content=body,
            headers=headers,
        )
    await fuzz.healthy(-1, None)


def image_upload(rng: random.Random) -> tuple[dict[str, Any], Any]:
    name = rng.choice(list(IMAGES))
    data = IMAGES[name]
    if rng.random() < 0.3 and data:
        flipped = bytearray(data)
        for _ in range(rng.randrange(1, 6)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        data, name = bytes(flipped), name + "+flips"
    if rng.random() < 0.25:
        field = rng.choice(("file", "image", "upload"))
        return {"files": {field: ("x.bin", data, rng.choice(("image/png", "application/x")))}}, (
            name,
            "multipart",
            field,
        )
    ctype = rng.choice(("image/png", "image/jpeg", "application/octet-stream", "text/plain", ""))
    return {"content": data, "headers": {"content-type": ctype} if ctype else {}}, (name, ctype)


async def test_http_image_uploads(gateway: ServerThread, http: httpx.AsyncClient) -> None:
    """Good, broken and hostile images to POST /v1/images; each accepted one is polled until
    its encode settles, and a failed encode must report a stable code."""
    fuzz = HttpFuzz(http, "http_images")
    loop = asyncio.get_running_loop()
    for index in range(cases(250)):
        rng = case_rng("http_images", index)
        kwargs, case = image_upload(rng)
        response = await fuzz.request(index, case, "POST", "/v1/images", **kwargs)
        if response.status_code != 200:
            continue
        digest = response.json()["id"]
        deadline = loop.time() + 10
        while response.json()["status"] == "encoding":
            if loop.time() > deadline:
                fail("http_images", index, "the image never left `encoding`", case)
            await asyncio.sleep(0.005)
            response = await fuzz.request(index, case, "GET", f"/v1/images/{digest}")
    for index in range(cases(100)):
        rng = case_rng("http_image_status", index)
        text = Gen(rng).text()
        digest = text.decode("latin-1") if isinstance(text, BadUtf8) else str(text)
        digest = rng.choice(
            (digest, "a" * 64, "A" * 64, "visiongate:sha256:" + "b" * 64, "%00", "x" * 5000)
        )
        from urllib.parse import quote

        path = quote(digest[:5000].encode("utf-8", "surrogatepass"), safe="") or "%20"
        await fuzz.request(index, digest, "GET", f"/v1/images/{path}")
    await fuzz.healthy(-1, None)


@pytest.mark.parametrize("where", ["content", "tools"])
async def test_deep_nesting_http(http: httpx.AsyncClient, where: str) -> None:
    deep = "[" * 5000 + "]" * 5000
    message = '{"role":"user","content":' + (deep if where == "content" else '"hi"') + "}"
    body = (
        '{"model":"'
        + MODEL
        + '","messages":['
        + message
        + "]"
        + (',"tools":' + deep if where == "tools" else "")
        + "}"
    ).encode()
    response = await http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert check_error_body(response.content, 400).error.code in ("invalid_json", "invalid_request")


# ---------------------------------------------------------------- single cases: bugs found here
# (the ones still open are marked xfail strict)


async def test_text_frame_on_msgpack(gateway: ServerThread) -> None:
    peer = await Peer.open(gateway.ws_url, binary=True, group="ws_text_on_msgpack")
    peer.case = '{"type":null}'
    await peer.check_case('{"type":null}', text=True)
    await peer.finish()


async def test_empty_event_id_is_echoed(gateway: ServerThread) -> None:
    peer = await Peer.open(gateway.ws_url, binary=False, group="ws_empty_event_id")
    peer.sent_ids.add("")
    await peer.send(json.dumps({"type": "response.cancel", "event_id": "", "response_id": 5}))
    seen = await peer.probe()
    assert [e["error"]["event_id"] for e in seen if e["type"] == "error"] == [""], seen
    await peer.finish()


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/chat/completions", 405),
        ("PUT", "/v1/chat/completions", 405),
        ("GET", "/v1/images/..%2F..%2Fetc%2Fpasswd", 404),
        ("GET", "/v1/no-such-thing", 404),
    ],
)
async def test_routing_refusals_get_the_openai_error_shape(
    http: httpx.AsyncClient, method: str, path: str, status: int
) -> None:
    response = await http.request(method, path, content=b"{}")
    assert response.status_code == status
    error = ERROR_RESPONSE.decode(response.content).error
    assert error.code in ERROR_CODES and error.code != "internal_error", error


@pytest.mark.parametrize("transport", ["realtime", "http"])
async def test_tiny_image_bytes(
    gateway: ServerThread, http: httpx.AsyncClient, transport: str
) -> None:
    url = data_url(b"\0\0\0", "image/png")  # data:image/png;base64,AAAA

    if transport == "http":
        body = {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
            ],
        }
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        assert check_error_body(response.content, 400).error.code == "invalid_image"
        return
    peer = await Peer.open(gateway.ws_url, binary=False, group="ws_tiny_image")
    event = {
        "type": "conversation.item.create",
        "event_id": "tiny",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_image", "image_url": url}],
        },
    }
    peer.remember(event)
    peer.case = event
    await peer.send(json.dumps(event))
    seen = await peer.probe()
    assert [e["error"]["code"] for e in seen if e["type"] == "error"] == ["invalid_image"], seen
    await peer.finish()


async def test_long_upgrade_request_line(gateway: ServerThread) -> None:
    """An upgrade the WebSocket parser refuses (a request line over its 8 KiB line limit) is
    answered 400 and closed (gateway.server.runner.RealtimeWSProtocol), and the gateway goes on."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    try:
        writer.write(
            f"GET /v1/realtime?session_id={'a' * 9000} HTTP/1.1\r\nHost: x\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode()
        )
        await writer.drain()
        try:
            head = await asyncio.wait_for(reader.read(64), 3)
        except TimeoutError:
            head = b"(no answer within 3 s)"
        assert head.startswith(b"HTTP/1.1 400"), head
        assert await asyncio.wait_for(reader.read(), 3) is not None  # then closed: EOF
    finally:
        writer.close()
    peer = await Peer.open(gateway.ws_url, binary=False, group="after_long_upgrade")
    await peer.round_trip()
    await peer.finish()


@pytest.mark.parametrize("stream", [False, True])
async def test_wide_session_id(http: httpx.AsyncClient, stream: bool) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "session_id": "\u65e5\u672c",
        "stream": stream,
    }
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        check_error_body(response.content, 400)


async def test_frame_over_the_limit(gateway: ServerThread) -> None:
    """A frame over `ws_max_frame_bytes` (room for the largest image, base64, plus headroom) is
    refused by the WebSocket layer itself: close 1009, and the gateway goes on serving."""
    ws = await websockets.connect(
        gateway.ws_url, proxy=None, ping_interval=None, max_size=None, compression=None
    )
    await ws.recv()  # session.created
    with pytest.raises(websockets.ConnectionClosed):
        await ws.send("x" * (FRAME_LIMIT + 1))
        await asyncio.wait_for(ws.recv(), 10)
    assert ws.close_code == 1009
    peer = await Peer.open(gateway.ws_url, binary=False, group="ws_over_limit")
    await peer.round_trip()
    await peer.finish()


class _GoneSocket:
    """The socket of a client that went away mid-stream: every send fails (an ASGI message
    as the connection hands its frames over, or text and bytes)."""

    scope: dict[str, object] = {}  # noqa: RUF012 (no server's own send kept: `socket.send`)

    async def send(self, message: object) -> None:
        raise OSError("the peer went away")

    async def send_text(self, data: str) -> None:
        raise OSError("the peer went away")

    async def send_bytes(self, data: bytes) -> None:
        raise OSError("the peer went away")


async def test_send_to_a_client_gone_is_quiet(gateway: ServerThread) -> None:
    # over the network this is a race (the send must land between the disconnect and the
    # connection's own close); here the send fails for certain
    from gateway.api.realtime.connection import RealtimeConnection
    from gateway.api.realtime.connection_state import ConnState

    conn = RealtimeConnection(_GoneSocket(), gateway.app.state["gateway"], "anonymous")
    conn.conn.transition(ConnState.OPEN)
    body = rt.ErrorBody(type="server_error", code="busy", message="m")
    await conn.sender.send(rt.ErrorEvent("event_000001", body))  # must not raise
