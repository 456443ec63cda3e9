"""Language-model engines behind one protocol (`Engine`); `LocalEngine` runs a model in-process.

`LocalEngine` is imported lazily: importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.engine.interface import (
    Delta,
    Engine,
    EngineBusy,
    EngineCapabilities,
    EngineError,
    GenerationRequest,
    GenerationResult,
    ImageInput,
    Message,
    SamplingParams,
    TextDelta,
    WarmUpResult,
)

if TYPE_CHECKING:
    from gateway.engine.local.local_engine import LocalEngine

__all__ = (
    "Delta",
    "Engine",
    "EngineBusy",
    "EngineCapabilities",
    "EngineError",
    "GenerationRequest",
    "GenerationResult",
    "ImageInput",
    "LocalEngine",
    "Message",
    "SamplingParams",
    "TextDelta",
    "WarmUpResult",
)


def __getattr__(name: str) -> Any:
    if name == "LocalEngine":
        from gateway.engine.local.local_engine import LocalEngine

        return LocalEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
