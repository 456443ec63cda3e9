"""Wire shapes of the OpenAI-compatible HTTP API: request and response msgspec Structs.

Requests follow the Chat Completions format; fields the gateway does not use (`user`,
`metadata`, penalties, ...) are accepted and ignored, so any OpenAI client works unchanged.
Responses are encoded with `omit_defaults` only where OpenAI leaves a field out; fields OpenAI
always sends (`logprobs: null`, `finish_reason: null`) are always present. visiongate's
extensions (`visiongate` objects, `session_id`) are extra fields that OpenAI clients keep.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct

from gateway.protocol.errors import ERROR_CODES, GatewayError
from gateway.protocol.report import CacheReport, Timings

__all__ = (
    "CacheReport",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "Choice",
    "ChunkChoice",
    "CompletionExtension",
    "Delta",
    "ErrorBody",
    "ErrorResponse",
    "ImageStatus",
    "ImageUrl",
    "ImageUrlPart",
    "InputMessage",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "SessionDeleted",
    "SessionItemView",
    "SessionView",
    "StreamOptions",
    "TextPart",
    "Timings",
    "Usage",
    "error_response",
)


# ---------------------------------------------------------------- request


class TextPart(Struct, tag="text", tag_field="type"):
    text: str


class ImageUrl(Struct):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(Struct, tag="image_url", tag_field="type"):
    image_url: ImageUrl


class RefusalPart(Struct, tag="refusal", tag_field="type"):
    refusal: str


ContentPart = TextPart | ImageUrlPart | RefusalPart


class InputMessage(Struct):
    """One message of the conversation. `developer` is the newer name of `system`."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(Struct):
    include_usage: bool = False


class ChatCompletionRequest(Struct):
    model: str
    messages: list[InputMessage]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    tools: list[dict[str, Any]] | None = None
    # visiongate extension: join this session's cache (also `X-Session-Id`)
    session_id: str | None = None
    # visiongate extension: a conversation longer than the context is refused ("disabled", the
    # default, as OpenAI does) or sent without its oldest turns ("auto")
    truncation: Literal["auto", "disabled"] = "disabled"


# ---------------------------------------------------------------- response


class CompletionExtension(Struct):
    """visiongate's report of one completion: where the time went and what the caches saved."""

    timings: Timings
    cache: CacheReport
    image_tokens: int = 0  # visual tokens the model saw (after patch dropping)
    image_tokens_total: int = 0  # visual tokens before patch dropping
    session_id: str | None = None
    truncated_items: int = 0  # oldest messages left out to fit the context (truncation "auto")
    stored: bool | None = None  # with a session: whether the answer was stored in it


class PromptTokensDetails(Struct):
    cached_tokens: int = 0
    audio_tokens: int = 0
    image_tokens: int = 0


class CompletionTokensDetails(Struct):
    reasoning_tokens: int = 0
    audio_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails = msgspec.field(
        default_factory=CompletionTokensDetails
    )
    visiongate: CompletionExtension | None = None


class ChatMessage(Struct):
    content: str
    role: Literal["assistant"] = "assistant"
    refusal: str | None = None


class Choice(Struct):
    index: int
    message: ChatMessage
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None
    visiongate: CompletionExtension | None = None


class Delta(Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(Struct, omit_defaults=True):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None
    usage: Usage | None = None
    visiongate: CompletionExtension | None = None


class ModelCard(Struct):
    id: str
    created: int
    object: Literal["model"] = "model"
    owned_by: str = "visiongate"
    # visiongate extension: what encodes the images, e.g. "synthetic seeded tower, answers not
    # grounded" (the embedded default) or "llava checkpoint: its own vision tower and projector"
    vision: str | None = None


class ModelList(Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ImageStatus(Struct):
    """An uploaded image: reference it as `image_url.url = ref` in later messages."""

    id: str  # sha256 hex of the bytes
    ref: str  # visiongate:sha256:<hex>
    status: Literal["encoding", "ready", "stored", "failed"]
    object: Literal["visiongate.image"] = "visiongate.image"
    bytes: int | None = None
    format: str | None = None
    width: int | None = None
    height: int | None = None
    tokens_kept: int | None = None
    tokens_total: int | None = None
    encode_ms: float | None = None
    error: ErrorBody | None = None


class SessionItemView(Struct, omit_defaults=True):
    id: str
    role: str
    content: list[dict[str, Any]]
    status: str = "completed"


class SessionView(Struct):
    id: str
    created_at: float
    updated_at: float
    instructions: str
    max_output_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    items: list[SessionItemView]  # a page of the conversation (see `after` / `limit`)
    images: list[str]
    object: Literal["visiongate.session"] = "visiongate.session"
    item_count: int = 0  # items in the whole conversation
    has_more: bool = False  # items follow this page: ask again with after=<last item's id>


class SessionDeleted(Struct):
    id: str
    deleted: bool = True
    object: Literal["visiongate.session.deleted"] = "visiongate.session.deleted"


# ---------------------------------------------------------------- errors


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct, omit_defaults=True):
    """`{"error": {"message", "type", "param", "code"}}` as OpenAI sends it, plus the status.

    `retry_after` (seconds) is set when the engine's queue is full: the answer is then 429 with
    a `Retry-After` header rather than the 503 of a model still loading."""

    error: ErrorBody
    retry_after: int | None = None

    @property
    def status_code(self) -> int:
        if self.retry_after is not None and self.error.code == "busy":
            return 429
        return ERROR_CODES.get(self.error.code or "", ("", 500))[1]


def error_response(exc: GatewayError) -> ErrorResponse:
    retry = None if exc.retry_after_s is None else max(1, round(exc.retry_after_s))
    return ErrorResponse(
        ErrorBody(message=exc.message, type=exc.type, param=exc.param, code=exc.code),
        retry_after=retry,
    )
