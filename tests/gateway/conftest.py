"""A real gateway (real SmolLM2 engine, real encoder) on a loopback port, shared by the tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from gateway.settings import Settings

MiB = 1024 * 1024


def gateway_settings(**overrides) -> Settings:
    base = dict(
        max_output_tokens=24,
        max_image_bytes=2 * MiB,
        max_pixels=4_000_000,
        engine_max_queue=8,
        cache_dir=os.environ.get("VISIONGATE_CACHE_DIR"),
    )
    base.update(overrides)
    return Settings.load(base, environ={})


class PhotoServer:
    """A loopback HTTP server standing in for an image host: /allowed/<name>.jpg and
    /private/<name>.jpg serve real photos, /redirect/ redirects, /text is not an image."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from tests.conftest import photo_bytes

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path
                if path.startswith(("/allowed/", "/private/")) and path.endswith(".jpg"):
                    body, kind = photo_bytes(path.rsplit("/", 1)[1][:-4], size=256), "image/jpeg"
                elif path.startswith("/allowed/redirect"):
                    self.send_response(302)
                    self.send_header("Location", "/private/rocket.jpg")
                    self.end_headers()
                    return
                elif path.startswith("/allowed/text"):
                    body, kind = b"hello", "text/plain"
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="session")
def photo_server() -> Iterator[PhotoServer]:
    server = PhotoServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def gateway_server(photo_server: PhotoServer) -> Iterator[ServerThread]:
    """One in-process gateway for the whole test session (the models load once). It may fetch
    images from the photo server's /allowed/ prefix and nowhere else."""
    settings = gateway_settings(image_url_allowlist=[f"{photo_server.base}/allowed/"])
    with ServerThread(create_app(settings), settings) as server:
        server.wait_ready()
        yield server


@pytest.fixture(scope="session")
def ws_url(gateway_server: ServerThread) -> str:
    return gateway_server.ws_url


def gateway_state(server: ServerThread):
    return server.app.state["gateway"]


@pytest.fixture(scope="module")
def uncached_server() -> Iterator[ServerThread]:
    """A gateway that keeps nothing between turns: no vision cache, no KV reuse (the stateless
    baseline answers must match)."""
    settings = gateway_settings(vision_cache_bytes=0, kv_budget_bytes=0)
    with ServerThread(create_app(settings), settings) as server:
        server.wait_ready()
        yield server
