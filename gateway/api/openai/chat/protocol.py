"""Wire shapes of the OpenAI-compatible HTTP API: request and response msgspec Structs.

Requests follow the Chat Completions format; fields the gateway does not use (`user`,
`metadata`, penalties, ...) are accepted and ignored, so any OpenAI client works unchanged.
Responses are encoded with `omit_defaults` only where OpenAI leaves a field out; fields OpenAI
always sends (`object`, `logprobs: null`, `finish_reason: null`, `refusal: null`) have no
default in those structs, so they are always present (tests/gateway/api/openai/
test_openai_shapes.py checks every shape against the `openai` package's own types).
visiongate's extensions (`visiongate` objects, `session_id`) are extra fields that OpenAI
clients keep.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from msgspec import Struct

from gateway.protocol.errors import ErrorBody, ErrorResponse, error_response
from gateway.protocol.report import CacheReport, Timings
from gateway.sessions.session import SessionUsage

if TYPE_CHECKING:
    from gateway.engine.interface import TokenLogprob as EngineTokenLogprob

__all__ = (
    "CacheReport",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "Choice",
    "ChoiceLogprobs",
    "ChunkChoice",
    "CompletionExtension",
    "Delta",
    "DeltaFunction",
    "DeltaToolCall",
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
    "TokenLogprob",
    "ToolCall",
    "ToolCallFunction",
    "TopLogprob",
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


class ToolCallFunction(Struct):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(Struct):
    """A tool call of an assistant message: in an answer, and as the client sends it back."""

    id: str
    function: ToolCallFunction
    type: Literal["function"] = "function"


class InputMessage(Struct):
    """One message of the conversation. `developer` is the newer name of `system`; a `tool`
    message answers the assistant's tool call `tool_call_id`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages
    function_call: dict[str, Any] | None = None  # legacy: held only to be refused clearly


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
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # checked by `gateway.chat.output_grammar` (their shapes vary: tool types, named choices,
    # schemas)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # legacy function calling: held only to be refused clearly (use tools / tool_choice)
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # visiongate extension: join this session's cache (also `X-Session-Id`)
    session_id: str | None = None
    # visiongate extension: a conversation longer than the context is refused ("disabled", the
    # default, as OpenAI does) or sent without its oldest turns ("auto")
    truncation: Literal["auto", "disabled"] = "disabled"
    # as vLLM's: prefix-cache entries are shared only between requests with the same salt,
    # within the API key's own (a gateway in front keeps its tenants apart on this one)
    cache_salt: str | None = None


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


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None

    @classmethod
    def of(cls, tokens: Iterable[EngineTokenLogprob]) -> ChoiceLogprobs:
        return cls(
            content=[
                TokenLogprob(
                    token=t.token,
                    logprob=t.logprob,
                    bytes=list(t.bytes),
                    top_logprobs=[
                        TopLogprob(token=token, logprob=logprob, bytes=list(raw))
                        for token, logprob, raw in t.top
                    ],
                )
                for t in tokens
            ]
        )


class ChatMessage(Struct, kw_only=True):
    """The answer of one choice: `content` is null when the answer is only tool calls;
    `tool_calls` is left out when there are none (as OpenAI does). `reasoning_content` is
    always null (the served model does not reason) and always sent, as vLLM and DeepSeek send
    it, so that clients written for reasoning servers, which read it as an attribute, find it."""

    content: str | None
    refusal: str | None
    role: Literal["assistant"]
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class Choice(Struct):
    index: int
    message: ChatMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None
    visiongate: CompletionExtension | None = None


class DeltaFunction(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    """A piece of a streamed tool call: the first of a call carries its `id`, `type` and
    `function.name` (with empty arguments); the next ones carry pieces of the arguments."""

    index: int  # the call's place among the choice's tool calls
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class Delta(Struct):
    """One piece of a streamed answer: what is not given is left out (UNSET), except
    `reasoning_content`, always null and always sent (see `ChatMessage`)."""

    role: Literal["assistant"] | msgspec.UnsetType = msgspec.UNSET
    content: str | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[DeltaToolCall] | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: None = None


class ChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(Struct, kw_only=True, omit_defaults=True):
    """One SSE frame. `object` and `system_fingerprint` have no default, so they are always
    sent (the SDK's stream helper reads `object`); `usage` is left out unless the client asked
    for it (`stream_options.include_usage`), then null on every chunk but the last."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChunkChoice]
    usage: Usage | msgspec.UnsetType | None = msgspec.UNSET
    visiongate: CompletionExtension | None = None


class ModelCard(Struct):
    id: str
    created: int
    object: Literal["model"] = "model"
    owned_by: str = "visiongate"
    # visiongate extension: what encodes the images, e.g. "synthetic seeded tower, answers not
    # grounded" (the embedded default) or "llava checkpoint: its own vision tower and projector"
    vision: str | None = None
    # prompt and answer positions together (the field vLLM's model cards carry); None while
    # the model loads
    max_model_len: int | None = None
    # as vLLM's cards: the model the id serves (read by vLLM and SGLang clients), and the base
    # model of an adapter (none here)
    root: str | None = None
    parent: str | None = None


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
    usage: SessionUsage | None = None  # what the conversation's answers have cost so far


class SessionDeleted(Struct):
    id: str
    deleted: bool = True
    object: Literal["visiongate.session.deleted"] = "visiongate.session.deleted"
