"""Running the app on uvicorn: in the foreground (`visiongate serve`) or on a background thread
(the demo and the tests, which talk to it over real loopback sockets).

uvicorn's proxy-header handling is off: it would believe `X-Forwarded-For` from any loopback
peer. The client address is decided once, in the app (gateway/server/client_address.py). The
server's HTTP and WebSocket protocols report each connection to a `ConnectionGuard`
(gateway/server/connection_guard.py), which cuts off slow heads and bodies and caps connections.
"""

from __future__ import annotations

import ssl
import threading
import time
from typing import TYPE_CHECKING

import h11
import msgspec
import uvicorn
from litestar import Litestar
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.protocol import State

from gateway.protocol.errors import ERROR_CODES, ErrorBody, ErrorResponse
from gateway.protocol.subprotocols import KEY_SUBPROTOCOL_PREFIX
from gateway.server.chunked_body import ChunkedCycle, adopt
from gateway.server.client_address import normalize_address
from gateway.server.connection_guard import ConnectionGuard, Entry, GuardLimits
from gateway.server.websocket_frames import TEXT_FRAMES, framed_text
from gateway.settings import Settings

if TYPE_CHECKING:
    import asyncio

    from websockets.http11 import Request

__all__ = (
    "GuardedH11Protocol",
    "RealtimeWSProtocol",
    "ServerThread",
    "connection_guard",
    "ensure_open_files",
    "serve",
    "uvicorn_config",
)

_BAD_HANDSHAKE = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: 28\r\n"
    b"Connection: close\r\n\r\ninvalid WebSocket handshake\n"
)
_KEY_SUBPROTOCOL = KEY_SUBPROTOCOL_PREFIX.encode()
_REASONS = {408: b"Request Timeout", 503: b"Service Unavailable"}
# the OpenAI-shaped error bodies of what the guard answers itself (gateway/protocol/errors.py)
_MESSAGES = {
    408: ("request_timeout", "the request did not arrive in time"),
    503: ("busy", "too many connections; retry"),
    0: ("busy", "the WebSocket handshake was not answered in time; retry"),
}
_BODIES = {
    key: msgspec.json.encode(
        ErrorResponse(ErrorBody(message=message, type=ERROR_CODES[code][0], param=None, code=code))
    )
    for key, (code, message) in _MESSAGES.items()
}
_HANDSHAKE_TIMEOUT = 0  # the 503 of an upgrade the app did not answer in time


def _raw_response(status: int) -> bytes:
    """A whole response written straight to the socket, for a connection about to close
    (the HTTP parser may be mid-request, or have seen no request at all); `_HANDSHAKE_TIMEOUT`
    is a 503 saying so."""
    body = _BODIES[status]
    status = status or 503
    retry = b"Retry-After: 1\r\n" if status == 503 else b""
    return b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % (
        status,
        _REASONS[status],
        len(body),
    ) + b"Connection: close\r\n%s\r\n%s" % (retry, body)


def _carries_key(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"authorization" and value.strip():
            return True
        if name == b"sec-websocket-protocol" and _KEY_SUBPROTOCOL in value:
            return True
    return False


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, reporting each connection's phase to `guard` (a subclass per
    server sets it: `uvicorn_config`): refused at once when over a cap, cut off when a head or
    a body is too slow. Each request's cycle writes a chunked body's chunks itself
    (gateway/server/chunked_body.py)."""

    guard: ConnectionGuard | None = None
    _entry: Entry | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.guard is None:
            return
        peer = normalize_address(self.client[0]) if self.client else ""
        self._entry = self.guard.open(transport, self, peer)
        if self._entry is None:
            transport.write(_raw_response(503))
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.guard is not None:
            self.guard.close(self.transport)
        super().connection_lost(exc)
        if isinstance(self.cycle, ChunkedCycle):
            self.cycle.gone()

    def data_received(self, data: bytes) -> None:
        entry = self._entry
        if self.guard is not None and entry is None:  # refused; closing
            return
        if entry is not None:
            if entry.phase == "head":
                entry.partial = True
            elif entry.phase == "body":
                self.guard.body_received(entry, len(data))  # type: ignore[union-attr]
        super().data_received(data)
        self._report()

    def handle_events(self) -> None:
        super().handle_events()
        adopt(self.cycle)

    def _should_upgrade(self) -> bool:
        # called once for each request head the parser completes, upgrade or not
        if self._entry is not None:
            self.guard.head(self._entry, keyed=_carries_key(self.headers))  # type: ignore[union-attr]
        return super()._should_upgrade()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._report()

    def _report(self) -> None:
        entry = self._entry
        if entry is None or entry.protocol is not self or self.transport.is_closing():
            return
        theirs = self.conn.their_state
        if theirs is h11.SEND_BODY:
            phase = "body"
        elif theirs is h11.IDLE and self.conn.our_state is h11.IDLE:
            phase = "head"
        else:
            phase = "busy"
        self.guard.request_state(entry, phase)  # type: ignore[union-attr]

    @property
    def reading_paused(self) -> bool:
        """The server, not the client, holds the body up: it stopped reading (the app has not
        taken what came), or the client waits for its `100 Continue`."""
        if self.cycle is not None and self.cycle.waiting_for_100_continue:
            return True
        return bool(self.flow is not None and self.flow.read_paused)

    @property
    def answered(self) -> bool:
        """The request being read was already answered (refused before its body came)."""
        return self.cycle is not None and self.cycle.response_started

    def guard_close(self, status: int | None) -> None:
        if self.transport.is_closing():
            return
        cycle = self.cycle
        answered = cycle is not None and cycle.response_started and not cycle.response_complete
        if status is not None and not answered:
            self.transport.write(_raw_response(status))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() gets http.disconnect
            cycle.message_event.set()
        self.transport.close()


class RealtimeWSProtocol(WebSocketsSansIOProtocol):
    """uvicorn's websockets-sansio protocol, but an opening handshake that the websockets
    parser refuses (a request line or header over its 8 KiB line limit, a malformed request)
    is answered 400 and closed. The stock protocol never looks at that refusal: the connection
    stayed open, unanswered, until the client gave up (and held the server's shutdown). With a
    `guard`, an upgrade the app neither accepts nor refuses in time is answered 503. A
    connection handed to the app is offered `write_text` for its text frames
    (gateway/server/websocket_frames.py)."""

    guard: ConnectionGuard | None = None
    _entry: Entry | None = None

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        if not self.close_sent:  # handed to the app (a refused upgrade was answered already)
            self.scope["extensions"][TEXT_FRAMES] = {"write": self.write_text}  # type: ignore[index]

    def write_text(self, payload: bytes) -> bool:
        """Write `payload` (UTF-8) as one text frame now, where the ASGI `send` would write the
        same bytes without waiting; False, and nothing written, anywhere else."""
        conn = self.conn
        if (
            self.close_sent
            or not self.writable.is_set()
            or conn.state is not State.OPEN
            or conn.expect_continuation_frame
            or conn.writes
            or conn.debug
            or self.transport.is_closing()
        ):
            return False
        self.transport.write(framed_text(payload, conn.extensions))
        return True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.guard is not None:
            self._entry = self.guard.adopt(transport, self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.guard is not None:
            self.guard.close(self.transport)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if (
            not self.handshake_initiated
            and self.conn.handshake_exc is not None
            and not self.transport.is_closing()
        ):
            self.transport.write(_BAD_HANDSHAKE)
            self.transport.close()

    def start_keepalive(self) -> None:
        # the server's `send` calls this once, as it writes the accept: the guard hears of the
        # answered handshake here, so that no frame after it pays a wrapper around `send`
        super().start_keepalive()
        if self._entry is not None:
            self.guard.accepted(self._entry)  # type: ignore[union-attr]
            self._entry = None

    def guard_close(self, status: int | None) -> None:
        if self.transport.is_closing():
            return
        if not self.handshake_complete:
            self.handshake_complete = True
            self.close_sent = True
            self.transport.write(_raw_response(_HANDSHAKE_TIMEOUT))
        self.transport.close()


def connection_guard(app: Litestar, settings: Settings) -> ConnectionGuard:
    """The slow-client defences of one server, counting refusals in the app's metrics."""
    limits = GuardLimits(
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        body_min_rate=float(settings.body_min_rate),
        ws_handshake_timeout_s=settings.ws_handshake_timeout_s,
        max_connections=settings.max_connections,
        max_unauthenticated_connections=settings.max_unauthenticated_connections,
        key_required=bool(settings.api_keys or settings.admin_api_key),
    )
    state = app.state.get("gateway")
    metrics = state.telemetry.metrics if state is not None else None
    return ConnectionGuard(
        limits, metrics.record_connection_refusal if metrics is not None else lambda _: None
    )


def uvicorn_config(
    app: Litestar, settings: Settings, *, host: str | None = None, port: int | None = None
) -> uvicorn.Config:
    guard = connection_guard(app, settings)
    return uvicorn.Config(
        app,
        host=host or settings.host,
        port=port if port is not None else settings.port,
        # TLS in uvicorn itself: clients that always dial wss:// (the Node SDK's Realtime
        # client) reach the gateway without a proxy in front
        ssl_certfile=settings.ssl_certfile or None,
        ssl_keyfile=settings.ssl_keyfile or None,
        # a protocol class of this server's own, whatever parser uvicorn would pick
        http=type("GuardedH11", (GuardedH11Protocol,), {"guard": guard}),
        ws=type("GuardedRealtimeWS", (RealtimeWSProtocol,), {"guard": guard}),
        # X-Forwarded-For is believed from `trusted_proxies` only, by the app itself
        proxy_headers=False,
        ws_max_size=settings.ws_max_frame_bytes,
        ws_ping_interval=20.0,
        ws_ping_timeout=30.0,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )


# open files a process needs beside its client sockets: models, Redis, logs, upstreams
SPARE_FILES = 256


def ensure_open_files(max_connections: int) -> None:
    """Raise the soft limit on open files to fit `max_connections` sockets and the process's
    own; SettingsError (the gateway then refuses to start) when the hard limit is lower."""
    import resource

    from gateway.settings import SettingsError

    need = max_connections + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise SettingsError(
            f"VISIONGATE_MAX_CONNECTIONS: {max_connections} connections need {need} open files, "
            f"but this process may open {hard} (ulimit -Hn); lower it or raise the limit"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def serve(app: Litestar, settings: Settings) -> None:
    """Serve in the foreground: the process is the gateway's own, so once the models are loaded
    its heap is frozen for the cyclic collector (`gc.freeze`; gateway/server/app.py), and its
    event loop's thread runs torch on one intra-op thread: the engine's and the encoder's threads
    set their own counts, and a second team of OpenMP workers anywhere in the process (the loop
    thread's, after one large tensor operation) would cost the engine's step a wake-up a parallel
    region (`LocalEngine._load` says how much). Threads started by the tests and the demo share a
    process with other work and leave both alone."""
    import torch

    torch.set_num_threads(1)
    app.state["gateway"].freeze_gc = True
    uvicorn.Server(uvicorn_config(app, settings)).run()


class ServerThread:
    """uvicorn on a daemon thread with its own event loop. `start()` returns once it listens."""

    def __init__(
        self, app: Litestar, settings: Settings, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        if port == 0:
            import socket

            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.host, self.port = host, port
        self.scheme = "https" if settings.ssl_certfile else "http"
        self.app = app
        self.server = uvicorn.Server(uvicorn_config(app, settings, host=host, port=port))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn:{port}", daemon=True)

    @property
    def http_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        ws = "wss" if self.scheme == "https" else "ws"
        return f"{ws}://{self.host}:{self.port}/v1/realtime"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the gateway server exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway did not listen within {timeout}s")
            time.sleep(0.02)
        return self

    def wait_ready(self, timeout: float = 600.0, *, verify: ssl.SSLContext | bool = True) -> None:
        """Block until /readyz answers 200 (models loaded and warmed up); `verify`: what a TLS
        server's certificate is checked with (httpx's `verify`: a context trusting its CA)."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{self.http_url}/readyz", timeout=5, verify=verify)
                if r.status_code == 200:
                    return
                if r.json().get("status") == "failed":
                    raise RuntimeError(f"model loading failed: {r.json().get('error')}")
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the gateway was not ready within {timeout}s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
