"""Fixtures for the HTTP API tests: the official `openai` client against the shared real gateway."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from gateway.server.runner import ServerThread
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


@pytest.fixture(scope="session")
def model(openai_client: OpenAI) -> str:
    return openai_client.models.list().data[0].id


@pytest.fixture(scope="session")
def camera_jpeg() -> bytes:
    """A photo no other test module sends, so its first use is an encode (a vision-cache miss)."""
    return photo_bytes("camera", size=256)
