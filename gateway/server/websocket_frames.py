"""Text frames written straight to a WebSocket's transport, past the ASGI `send`.

A Realtime response sends one text frame per delta. Through the server's ASGI `send`, each
frame paid the message's dispatch, the flow-control wait, and the `websockets` protocol's
framing (a `Frame`, its checks, its serialization, a list of writes joined). The gateway's
WebSocket protocol (gateway/server/runner.py) offers its connections a writer instead, in the
scope's ASGI extensions under `TEXT_FRAMES`: `{"write": write}`, where `write(payload)` frames
a UTF-8 payload as one final text frame and writes it at once, returning True, or writes
nothing and returns False. It writes only where the ASGI `send` would write the same bytes
without waiting: the connection open on both sides, no fragmented message under way, nothing
of the protocol's own waiting to go out, no frame logging asked for, the transport taking
writes (not paused by its flow control). Everything else (a paused transport, a close under
way, a peer gone) is for the ASGI `send`, which waits, raises or refuses as it always did: a
False sends there, in order.

Without an extension the frame is built here (`text_frame`: RFC 6455 section 5.2, unmasked,
as a server's frames are). A connection that negotiated one (permessage-deflate, which the
`websockets` client and the OpenAI SDK offer by default) has its frame built by `websockets`,
through the connection's own extension objects, as its `send` builds it: the compressor's
context is the one every frame of the connection goes through, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from websockets.extensions import Extension
from websockets.frames import Frame, Opcode

__all__ = ("TEXT_FRAMES", "framed_text", "text_frame", "text_writer")

TEXT_FRAMES = "visiongate.websocket.text_frames"

_FIN_TEXT = 0x81  # FIN bit and opcode 1 (text)


def text_frame(payload: bytes) -> bytes:
    """One final, unmasked text frame carrying `payload` (UTF-8, not checked here)."""
    size = len(payload)
    if size < 126:
        return bytes((_FIN_TEXT, size)) + payload
    if size < 65536:
        return b"\x81\x7e" + size.to_bytes(2, "big") + payload
    return b"\x81\x7f" + size.to_bytes(8, "big") + payload


def framed_text(payload: bytes, extensions: Sequence[Extension]) -> bytes:
    """A server's text frame of `payload` on a connection with these negotiated extensions."""
    if not extensions:
        return text_frame(payload)
    return Frame(Opcode.TEXT, payload).serialize(mask=False, extensions=extensions)


def text_writer(scope: dict[str, Any]) -> Callable[[bytes], bool] | None:
    """The connection's direct text-frame writer, or None where its server offers none."""
    offered = (scope.get("extensions") or {}).get(TEXT_FRAMES)
    return offered.get("write") if offered else None
