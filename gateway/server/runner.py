"""Running the app on uvicorn: in the foreground (`visiongate serve`) or on a background thread
(the demo and the tests, which talk to it over real loopback sockets)."""

from __future__ import annotations

import ssl
import threading
import time

import uvicorn
from litestar import Litestar
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from gateway.settings import Settings

__all__ = ("RealtimeWSProtocol", "ServerThread", "serve", "uvicorn_config")

_BAD_HANDSHAKE = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: 28\r\n"
    b"Connection: close\r\n\r\ninvalid WebSocket handshake\n"
)


class RealtimeWSProtocol(WebSocketsSansIOProtocol):
    """uvicorn's websockets-sansio protocol, but an opening handshake that the websockets
    parser refuses (a request line or header over its 8 KiB line limit, a malformed request)
    is answered 400 and closed. The stock protocol never looks at that refusal: the connection
    stayed open, unanswered, until the client gave up (and held the server's shutdown)."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if (
            not self.handshake_initiated
            and self.conn.handshake_exc is not None
            and not self.transport.is_closing()
        ):
            self.transport.write(_BAD_HANDSHAKE)
            self.transport.close()


def uvicorn_config(
    app: Litestar, settings: Settings, *, host: str | None = None, port: int | None = None
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host or settings.host,
        port=port if port is not None else settings.port,
        # TLS in uvicorn itself: clients that always dial wss:// (the Node SDK's Realtime
        # client) reach the gateway without a proxy in front
        ssl_certfile=settings.ssl_certfile or None,
        ssl_keyfile=settings.ssl_keyfile or None,
        ws=RealtimeWSProtocol,
        ws_max_size=settings.ws_max_frame_bytes,
        ws_ping_interval=20.0,
        ws_ping_timeout=30.0,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )


def serve(app: Litestar, settings: Settings) -> None:
    """Serve in the foreground: the process is the gateway's own, so once the models are loaded
    its heap is frozen for the cyclic collector (`gc.freeze`; gateway/server/app.py). Threads
    started
    by the tests and the demo share a process with other work and leave the collector alone."""
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
