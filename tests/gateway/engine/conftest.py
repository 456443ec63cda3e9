"""One started LocalEngine (the real SmolLM2-135M-Instruct) shared by the engine tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.engine.interface import GenerationRequest, GenerationResult
from gateway.engine.local.local_engine import LocalEngine
from gateway.testing.engine_requests import drain


@pytest.fixture(scope="session")
async def engine() -> AsyncIterator[LocalEngine]:
    eng = LocalEngine(max_queue=4)
    await eng.start()
    yield eng
    await eng.aclose()


async def _collect(
    engine: LocalEngine, request: GenerationRequest
) -> tuple[list[str], GenerationResult]:
    """Run one request to the end: (text deltas, the result)."""
    deltas, results = await drain(engine, request)
    assert len(results) == 1, "exactly one GenerationResult"
    return [d.text for d in deltas], results[0]


@pytest.fixture(scope="session")
def collect():
    return _collect
