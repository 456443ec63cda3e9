"""A real uvicorn server on a loopback port for a test's ASGI app, on a thread, with the
protocol class under test; and the comparison of two servers' raw answers."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def serving(app: Any, **config: Any) -> Iterator[int]:
    """`app` served on a free loopback port (uvicorn.Config options in `config`, for example
    `http=` or `ws=` a protocol class) until the block ends; yields the port."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = {"lifespan": "off", "log_config": None, **config}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def without_date(raw: bytes) -> bytes:
    """An answer's bytes without its Date header (the one line two servers may differ in)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"date:")]
    return b"\r\n".join(lines) + sep + body
