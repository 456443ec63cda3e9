"""Wire shapes of the Responses API (`/v1/responses`): request, response object, stream events.

The request Struct names every parameter the official SDK sends; anything else is refused as
an unknown field, and the parameters the gateway cannot honour are refused by the serving
layer with a clear message (those that change nothing, such as `user` or `service_tier`, are
accepted and ignored). The body is decoded by `decode_request`, so that a refusal names the
field in the caller's terms, an unknown one included.

Input items arrive as plain objects and are typed one by one (`convert_items`: messages,
`function_call` and `function_call_output`), so that an error names the item
(`input[2].content[0].image_url`) and an unknown item type is refused by name; `parse_input`
then checks them in the request layer (`gateway.chat.requests`) and turns them into the
session's stored items; both, and `decode_request`, are in `inputs`. Not here: sessions, chains
and the answer itself (`serving`).

The response object and the events follow `openai.types.responses` field for field; fields the
SDK requires are always sent. visiongate's report of a response is the extra `visiongate`
object, as on chat completions.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

from gateway.protocol.report import CacheReport, Timings

__all__ = (
    "FunctionCall",
    "FunctionCallInput",
    "FunctionCallOutputInput",
    "IncompleteDetails",
    "InputImage",
    "InputItemList",
    "InputText",
    "Logprob",
    "MessageInput",
    "OutputItem",
    "OutputMessage",
    "OutputText",
    "PromptCacheOptions",
    "ResponseDeleted",
    "ResponseError",
    "ResponseEvent",
    "ResponseExtension",
    "ResponseObject",
    "ResponseUsage",
    "ResponsesRequest",
    "TextConfig",
    "event_type",
)


# ---------------------------------------------------------------- request


class TextConfig(Struct, forbid_unknown_fields=True):
    format: dict[str, Any] | None = None
    verbosity: str | None = None  # accepted and ignored


class PromptCacheOptions(Struct, forbid_unknown_fields=True):
    """`prompt_cache_options`: `prewarm` prefills the input into the prompt cache without
    generating (`gateway.api.openai.responses.prewarm`); `ttl` and `mode` are checked and
    said in the response's notes (the engine caches every full KV block of every prompt);
    `comparison_response_id` (cache diagnostics) is refused."""

    prewarm: bool | None = None
    ttl: Literal["30m", "12h"] | None = None
    mode: Literal["implicit", "explicit"] | None = None
    comparison_response_id: str | None = None


class ResponsesRequest(Struct, forbid_unknown_fields=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # None: true
    stream: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    # refused when given (the serving layer says why)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    max_tool_calls: int | None = None
    background_options: Any = None
    # accepted and ignored: they change nothing about what this gateway answers
    reasoning: dict[str, Any] | None = None  # the served model does not reason (noted)
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_retention: str | None = None
    # the prompt cache: checked by the serving layer, `prewarm` answered without output
    prompt_cache_key: str | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    stream_options: Any = None
    access_programs: Any = None
    image: Any = None


# input items, converted one by one from the request's plain objects


class InputText(Struct, tag="input_text", tag_field="type"):
    text: str
    prompt_cache_breakpoint: Any = None


class InputImage(Struct, tag="input_image", tag_field="type"):
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high", "original"] | None = None
    prompt_cache_breakpoint: Any = None


class InputFile(Struct, tag="input_file", tag_field="type"):
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None


class InputOutputText(Struct, tag="output_text", tag_field="type"):
    """An earlier answer's text, sent back as history."""

    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputRefusal(Struct, tag="refusal", tag_field="type"):
    refusal: str


InputContent = InputText | InputImage | InputFile | InputOutputText | InputRefusal


class MessageInput(Struct, forbid_unknown_fields=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputContent]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallInput(Struct, forbid_unknown_fields=True):
    """A call the model made earlier, sent back as history."""

    call_id: str
    name: str
    arguments: str
    type: Literal["function_call"] = "function_call"
    id: str | None = None
    status: str | None = None
    namespace: str | None = None
    caller: Any = None


class FunctionCallOutputInput(Struct, forbid_unknown_fields=True):
    """What the client's function returned for a call."""

    call_id: str
    output: str | list[dict[str, Any]]
    type: Literal["function_call_output"] = "function_call_output"
    id: str | None = None
    status: str | None = None
    name: str | None = None
    namespace: str | None = None
    caller: Any = None


# ---------------------------------------------------------------- response object


class TopLogprob(Struct):
    token: str
    bytes: list[int]
    logprob: float


class Logprob(Struct):
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob]


class OutputText(Struct, tag="output_text", tag_field="type", omit_defaults=True):
    text: str
    annotations: list[Any]
    logprobs: list[Logprob] | None = None  # only when include asks for them


class OutputMessage(Struct, tag="message", tag_field="type"):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"


class FunctionCall(Struct, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | FunctionCall


class InputTokensDetails(Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct):
    reason: Literal["max_output_tokens", "content_filter"] | None = None


class ResponseError(Struct):
    """`code` is from OpenAI's vocabulary for failed responses; `type` holds visiongate's
    stable code (a key of ERROR_CODES)."""

    code: str
    message: str
    param: str | None = None
    type: str | None = None


class ResponseExtension(Struct, omit_defaults=True):
    """visiongate's report of one response: timings, cache results, where it lives."""

    timings: Timings
    cache: CacheReport
    image_tokens: int = 0
    image_tokens_total: int = 0
    session_id: str | None = None  # the session holding the chain (None: store=false)
    truncated_items: int = 0
    stored: bool | None = None  # with store: whether answer and record were both stored
    forked: bool = False  # the previous response had been continued already: a new session
    notes: list[str] = []  # parameters accepted but not applied, in words


class ResponseObject(Struct):
    id: str
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress", "cancelled"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    previous_response_id: str | None
    store: bool
    metadata: dict[str, str]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None
    text: dict[str, Any]
    truncation: Literal["auto", "disabled"]
    top_logprobs: int | None = None
    user: str | None = None
    background: bool = False
    reasoning: dict[str, Any] | None = None
    service_tier: str = "default"
    object: Literal["response"] = "response"
    visiongate: ResponseExtension | None = None


class ResponseDeleted(Struct):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItemList(Struct):
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


# ---------------------------------------------------------------- stream events


class ResponseEvent(Struct, tag_field="type"):
    """Base of the stream events: each is sent as `event: <type>` with its JSON as data."""

    sequence_number: int


class ResponseCreated(ResponseEvent, tag="response.created"):
    response: ResponseObject


class ResponseInProgress(ResponseEvent, tag="response.in_progress"):
    response: ResponseObject


class ResponseCompleted(ResponseEvent, tag="response.completed"):
    response: ResponseObject


class ResponseIncomplete(ResponseEvent, tag="response.incomplete"):
    response: ResponseObject


class ResponseFailed(ResponseEvent, tag="response.failed"):
    response: ResponseObject


class OutputItemAdded(ResponseEvent, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(ResponseEvent, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(ResponseEvent, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(ResponseEvent, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(ResponseEvent, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Logprob]


class OutputTextDone(ResponseEvent, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Logprob]


class ArgumentsDelta(ResponseEvent, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(ResponseEvent, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str
    name: str


def event_type(event: ResponseEvent) -> str:
    """The `type` an event is sent with (its tag)."""
    return str(type(event).__struct_config__.tag)
