"""Realtime WebSocket events: the text-and-image subset of the OpenAI Realtime API, and the
codec every frame goes through.

The events are defined in `client_events` (what a client sends, and the items it carries) and
`server_events` (what the gateway sends); this module names them all in one namespace
(`from gateway.api.realtime import protocol as rt`) and holds `WireCodec`. Client events are one
msgspec tagged union on `type`, decoded by decoders made once (JSON for text frames, msgpack for
binary frames under the `visiongate.v1.msgpack` subprotocol); a frame that fails still has its
`type` and `event_id` read, to classify the error and echo the id.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from msgspec import Struct

from gateway.api.realtime.client_events import (
    CLIENT_EVENT_TYPES,
    MAX_ID_CHARS,
    ClientEvent,
    ClientId,
    ContentPart,
    ConversationItemCreate,
    ConversationItemDelete,
    ConversationItemRetrieve,
    ConversationItemTruncate,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    Item,
    ItemReference,
    MessageItem,
    Metadata,
    ResponseCancel,
    ResponseCreate,
    ResponseParams,
    SessionConfig,
    SessionUpdate,
)
from gateway.api.realtime.server_events import (
    CachedTokensDetails,
    ContentPartAdded,
    ContentPartDone,
    ConversationItemAdded,
    ConversationItemDeleted,
    ConversationItemDone,
    ConversationItemRetrieved,
    ConversationItemTruncated,
    ErrorBody,
    ErrorEvent,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    ImageEncoded,
    InputTokenDetails,
    OutputItemAdded,
    OutputItemDone,
    OutputTextDelta,
    OutputTextDone,
    OutputTokenDetails,
    Part,
    RateLimit,
    RateLimitsUpdated,
    ResponseCreated,
    ResponseDone,
    ResponseExtension,
    ResponseState,
    ServerEvent,
    SessionCreated,
    SessionState,
    SessionUpdated,
    StatusDetails,
    StatusError,
    Usage,
)
from gateway.protocol.errors import GatewayError

__all__ = (
    "CLIENT_EVENT_TYPES",
    "MAX_ID_CHARS",
    "CachedTokensDetails",
    "ClientEvent",
    "ClientId",
    "ContentPart",
    "ContentPartAdded",
    "ContentPartDone",
    "ConversationItemAdded",
    "ConversationItemCreate",
    "ConversationItemDelete",
    "ConversationItemDeleted",
    "ConversationItemDone",
    "ConversationItemRetrieve",
    "ConversationItemRetrieved",
    "ConversationItemTruncate",
    "ConversationItemTruncated",
    "ErrorBody",
    "ErrorEvent",
    "FunctionCallArgumentsDelta",
    "FunctionCallArgumentsDone",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "ImageEncoded",
    "InputItem",
    "InputTokenDetails",
    "Item",
    "ItemReference",
    "MessageItem",
    "Metadata",
    "OutputItemAdded",
    "OutputItemDone",
    "OutputTextDelta",
    "OutputTextDone",
    "OutputTokenDetails",
    "Part",
    "RateLimit",
    "RateLimitsUpdated",
    "ResponseCancel",
    "ResponseCreate",
    "ResponseCreated",
    "ResponseDone",
    "ResponseExtension",
    "ResponseParams",
    "ResponseState",
    "ServerEvent",
    "SessionConfig",
    "SessionCreated",
    "SessionState",
    "SessionUpdate",
    "SessionUpdated",
    "StatusDetails",
    "StatusError",
    "Usage",
    "WireCodec",
)


# ---------------------------------------------------------------- codec


class _Envelope(Struct):
    """What is read of a frame that failed full validation, to classify the error."""

    type: Any = None
    event_id: Any = None


_PATH = re.compile(r" - at `\$\.?(.*)`$")


class WireCodec:
    """Decodes client frames and encodes server events, in JSON or msgpack. Made once per format."""

    __slots__ = ("_decode", "_decode_any", "_decode_envelope", "_encode", "binary")

    def __init__(self, *, binary: bool = False) -> None:
        self.binary = binary
        if binary:
            self._decode = msgspec.msgpack.Decoder(ClientEvent).decode
            self._decode_any = msgspec.msgpack.Decoder().decode
            self._decode_envelope = msgspec.msgpack.Decoder(_Envelope).decode
            self._encode = msgspec.msgpack.Encoder().encode
        else:
            self._decode = msgspec.json.Decoder(ClientEvent).decode
            self._decode_any = msgspec.json.Decoder().decode
            self._decode_envelope = msgspec.json.Decoder(_Envelope).decode
            self._encode = msgspec.json.Encoder().encode

    def encode(self, event: ServerEvent) -> bytes:
        return self._encode(event)

    def decode(self, frame: bytes | str) -> ClientEvent:
        """Parse one client frame, or raise GatewayError.

        The error's code is invalid_json, unknown_event or invalid_event.

        The raised error's `event_id` attribute carries the client's event_id when one could be
        read, so the error event can echo it.
        """
        if self.binary and isinstance(frame, str):
            raise _no_event_id(
                GatewayError("invalid_json", "this connection speaks msgpack: send binary frames")
            )
        try:
            return self._decode(frame)
        except msgspec.ValidationError as exc:
            # a frame that is not valid at all (or nested too deeply) is invalid_json, whatever
            # the typed decoder stumbled on first
            self._check_syntax(frame)
            envelope = self._envelope(frame)
            event_id = envelope.event_id
            if not isinstance(event_id, str) or len(event_id) > MAX_ID_CHARS:
                event_id = None  # never echo an id of any size
            kind = envelope.type
            if not isinstance(kind, str) or kind not in CLIENT_EVENT_TYPES:
                err = GatewayError(
                    "unknown_event" if isinstance(kind, str) else "invalid_event",
                    f"unknown event type {kind!r}; "
                    f"supported: {', '.join(sorted(CLIENT_EVENT_TYPES))}"
                    if isinstance(kind, str)
                    else "an event needs a string `type`",
                    param="type",
                )
            else:
                text = str(exc)
                match = _PATH.search(text)
                err = GatewayError(
                    "invalid_event",
                    f"invalid {kind}: {text}",
                    param=match.group(1) if match else None,
                )
            err.event_id = event_id  # type: ignore[attr-defined]
            raise err from None
        except msgspec.DecodeError as exc:
            raise _no_event_id(self._invalid(exc)) from None
        except RecursionError:  # arrays or maps nested deeper than any event has
            raise _no_event_id(GatewayError("invalid_json", "frame is nested too deeply")) from None

    def _invalid(self, exc: Exception) -> GatewayError:
        fmt = "msgpack" if self.binary else "JSON"
        return GatewayError("invalid_json", f"frame is not valid {fmt}: {exc}")

    def _check_syntax(self, frame: bytes | str) -> None:
        try:
            self._decode_any(frame)
        except msgspec.DecodeError as exc:
            raise _no_event_id(self._invalid(exc)) from None
        except RecursionError:
            raise _no_event_id(GatewayError("invalid_json", "frame is nested too deeply")) from None

    def _envelope(self, frame: bytes | str) -> _Envelope:
        try:
            return self._decode_envelope(frame)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            return _Envelope()


def _no_event_id(err: GatewayError) -> GatewayError:
    err.event_id = None  # type: ignore[attr-defined]
    return err
