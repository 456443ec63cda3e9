"""Wire shapes of the legacy `POST /v1/completions`: the request, a completion (or one chunk of
its stream), its choices with log-probabilities in the legacy layout, and its usage."""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

from gateway.api.openai.chat import protocol as p

__all__ = (
    "Completion",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionUsage",
    "LegacyLogprobs",
)


class CompletionRequest(Struct):
    model: str
    prompt: str | list[Any]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    stream: bool | None = None
    stream_options: p.StreamOptions | None = None
    suffix: str | None = None
    best_of: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, int] | None = None
    user: str | None = None  # accepted and ignored
    # as vLLM's: prefix-cache entries are shared only between requests with the same salt,
    # within the API key's own
    cache_salt: str | None = None


class LegacyLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: LegacyLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class CompletionUsage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: p.PromptTokensDetails


class Completion(Struct, tag="text_completion", tag_field="object", omit_defaults=True):
    """A completion, or (streaming) one chunk of it: chunks leave `usage` out."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: CompletionUsage | None = None
