"""One started LocalEngine (the real SmolLM2-135M-Instruct) shared by the engine tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.engine.interface import GenerationRequest, GenerationResult, TextDelta
from gateway.engine.local.local_engine import LocalEngine


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
    deltas: list[str] = []
    result = None
    async for item in engine.generate(request):
        if isinstance(item, TextDelta):
            deltas.append(item.text)
        else:
            assert result is None, "exactly one GenerationResult"
            result = item
    assert isinstance(result, GenerationResult)
    return deltas, result


@pytest.fixture(scope="session")
def collect():
    return _collect
