"""Loopback ports for servers started by tests and benchmarks: a free one, and waiting for one
to listen."""

from __future__ import annotations

import socket
import time

__all__ = ("free_port", "wait_for_port")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 10.0, host: str = "127.0.0.1") -> None:
    """Return once something accepts connections on `host:port`; TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")
