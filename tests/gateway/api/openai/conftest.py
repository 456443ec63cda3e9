"""Fixtures for the HTTP API tests: the official `openai` client and an `httpx` client against
the shared real gateway (`openai_client`, `http`), and the same two on the session's fake gateway
(`fake_openai`, `fake_http`), which a fast test module takes under the real ones' names:
`from tests.gateway.api.openai.conftest import fake_http as http`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from gateway.server.runner import ServerThread
from gateway.testing.fake_gateway import FakeGateway
from tests.conftest import photo_bytes


@pytest.fixture(scope="session")
def base_url(gateway_server: ServerThread) -> str:
    return gateway_server.http_url


@pytest.fixture(scope="session")
def openai_client(base_url: str) -> Iterator[OpenAI]:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    yield client
    client.close()


@pytest.fixture(scope="session")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def fake_openai(fake_gateway: FakeGateway) -> Iterator[OpenAI]:
    with fake_gateway.openai_client() as client:
        yield client


@pytest.fixture(scope="module")
def fake_http(fake_gateway: FakeGateway) -> Iterator[httpx.Client]:
    with fake_gateway.http_client() as client:
        yield client


@pytest.fixture(scope="session")
def model(openai_client: OpenAI) -> str:

    return openai_client.models.list().data[0].id


@pytest.fixture(scope="session")
def camera_jpeg() -> bytes:
    """A photo no other test module sends, so its first use is an encode (a vision-cache miss)."""
    return photo_bytes("camera", size=256)


def sse(http: httpx.Client, path: str, body: dict[str, Any]) -> list[tuple[str | None, str]]:
    """(event, data) of every frame of a streamed answer."""
    frames: list[tuple[str | None, str]] = []
    with http.stream("POST", path, json=body) as reply:
        assert reply.status_code == 200, reply.read()
        assert reply.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in reply.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                frames.append((event, line.removeprefix("data: ")))
                event = None
    return frames
