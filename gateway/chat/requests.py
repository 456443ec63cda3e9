"""The request layer: every check of a chat request's values, written once for both transports.

The WebSocket layer (`gateway.api.realtime`) and the HTTP layer (`gateway.api.openai`)
decode their own wire shapes, then hand the values here: sampling ranges, output-token limits,
stop strings, the lengths of instructions and text, item and image counts, image parts (data
URLs, allow-listed remote URLs, `visiongate:sha256:` references, which name only images the
caller's own API key sent), the image bytes themselves, and how many encodes a key or a
connection may have pending. What comes back are gateway types (`StoredPart`,
`ResponseOptions`); what goes wrong is a `GatewayError` whose code is the same on both
transports, with `param` naming the field in the caller's own terms (`response.temperature` on
the WebSocket, `temperature` over HTTP), which the caller passes in.

Not here: the shape of a frame or body (unknown fields, wrong types; each transport's decoder
refuses those), sessions and their storage, and readiness (`GatewayState.require()` raises the
one `busy` answer).

One module on purpose: it is the one place every check of a request's values is written,
so that no transport grows a check of its own; its sections (scalar values, tool calls and
results, content and images) share `RequestLimits` and the refusal helpers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from gateway.chat.events import ResponseOptions
from gateway.chat.image_input import ImageRef, digest_of, parse_image_url, sniff_image
from gateway.chat.remote_images import fetch_remote_images
from gateway.engine.interface import MAX_CHOICES, MAX_STOP_CHARS, MAX_STOPS, MAX_TOP_LOGPROBS
from gateway.protocol.errors import GatewayError, clip
from gateway.sessions.session import StoredItem, StoredPart

if TYPE_CHECKING:
    from gateway.chat.vision_resolver import EncodePermit, EncodeQuota, VisionResolver
    from gateway.settings import Settings

__all__ = (
    "DEFAULT_MODEL",
    "EXTRA_PARTS",
    "MAX_SEED",
    "ContentPart",
    "ParsedContent",
    "RequestLimits",
    "add_inline_images",
    "admit_encodes",
    "check_cache_salt",
    "check_conversation_size",
    "check_image_bytes",
    "check_image_count",
    "check_instructions",
    "check_item_count",
    "check_max_tokens",
    "check_output_modalities",
    "check_prompt_tokens",
    "check_sampling",
    "check_session_id",
    "check_stop",
    "check_text",
    "check_tool_result",
    "conversation_chars",
    "fetch_remote",
    "parse_content",
    "refuse_unsupported",
    "resolve_references",
    "response_options",
    "tool_call_part",
    "tool_result_part",
)

MAX_SEED = 2**63  # seeds are 0 <= seed < 2**63 (a torch.Generator takes them all)
EXTRA_PARTS = 16  # parts a message may hold beside a full session's worth of images


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The limits a request is checked against, read once from `Settings`."""

    max_output_tokens_limit: int
    max_text_chars: int
    max_images_per_session: int
    max_items_per_session: int
    max_image_bytes: int
    max_pixels: int
    image_url_allowlist: tuple[str, ...] = ()
    max_conversation_chars: int = 1024 * 1024
    max_output_tokens: int = 256  # an answer's tokens when the request does not say

    @classmethod
    def of(cls, settings: Settings) -> RequestLimits:
        return cls(
            max_output_tokens_limit=settings.max_output_tokens_limit,
            max_text_chars=settings.max_text_chars,
            max_images_per_session=settings.max_images_per_session,
            max_items_per_session=settings.max_items_per_session,
            max_image_bytes=settings.max_image_bytes,
            max_pixels=settings.max_pixels,
            image_url_allowlist=tuple(settings.image_url_allowlist),
            max_conversation_chars=settings.max_conversation_chars,
            max_output_tokens=settings.max_output_tokens,
        )

    @property
    def max_parts_per_message(self) -> int:
        return self.max_images_per_session + EXTRA_PARTS


def _invalid(message: str, param: str | None) -> GatewayError:
    return GatewayError("invalid_request", message, param=param)


# ---------------------------------------------------------------- scalar values


MAX_SESSION_ID_CHARS = 128


def check_session_id(session_id: str, param: str = "session_id") -> str:
    """A client-chosen session id: 1..128 visible ASCII characters (it travels back in the
    `X-Session-Id` header and in URLs, so nothing else is taken)."""
    if not 1 <= len(session_id) <= MAX_SESSION_ID_CHARS or not all(
        "!" <= c <= "~" for c in session_id
    ):
        raise _invalid(
            f"session_id must be 1..{MAX_SESSION_ID_CHARS} visible ASCII characters "
            "(letters, digits and punctuation, no spaces)",
            param,
        )
    return session_id


def check_sampling(
    temperature: float | None, top_p: float | None, seed: int | None, *, where: str = ""
) -> None:
    """Refuse sampling values out of range; `where` prefixes each param ("response.")."""
    # written so that NaN fails too
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise _invalid("temperature must be in [0, 2]", f"{where}temperature")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise _invalid("top_p must be in (0, 1]", f"{where}top_p")
    if seed is not None and (isinstance(seed, bool) or not 0 <= seed < MAX_SEED):
        raise _invalid("seed must be an integer in [0, 2^63)", f"{where}seed")


def check_max_tokens(
    value: int | str | None, limit: int, param: str, *, allow_inf: bool = False
) -> int | None:
    """The checked token limit (None: not given). With `allow_inf`, "inf" means `limit`."""
    if value is None:
        return None
    if allow_inf and value == "inf":
        return limit
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        name = param.rsplit(".", 1)[-1]
        allowed = f'1..{limit} or "inf"' if allow_inf else f"1..{limit}"
        raise _invalid(f"{name} must be {allowed}", param)
    return value


def check_stop(stop: str | Sequence[str] | None, param: str = "stop") -> tuple[str, ...]:
    """Stop strings as a tuple. Their number and length are the engine's own bounds, so a
    request the gateway admits is never refused by the engine after its stream started."""
    if isinstance(stop, str):
        stops, params = (stop,), [param]
    else:
        stops = tuple(stop or ())
        params = [f"{param}[{i}]" for i in range(len(stops))]
    if len(stops) > MAX_STOPS:
        raise _invalid(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", param)
    for text, where in zip(stops, params, strict=True):
        if not isinstance(text, str) or not text:
            raise _invalid("stop strings must be non-empty strings", where)
        if len(text) > MAX_STOP_CHARS:
            raise _invalid(
                f"stop strings hold at most {MAX_STOP_CHARS} characters, got {len(text)}", where
            )
    return stops


DEFAULT_MODEL = "default"  # names the served model, whatever its id (as vLLM's clients send it)


def check_model(requested: str | None, served: str, param: str = "model") -> None:
    """Refuse a model other than the served one (None: the client named none; `default`
    names the served one)."""
    if requested is not None and requested not in (served, DEFAULT_MODEL):
        raise GatewayError(
            "model_not_found",
            f"the model {clip(requested)!r} does not exist; this gateway serves {served!r}",
            param=param,
        )


def check_logprobs(
    logprobs: bool | None, top_logprobs: int | None, *, param: str = "top_logprobs"
) -> int | None:
    """The engine's `logprobs` value: None (none asked), or how many alternatives per token.
    `top_logprobs` needs `logprobs` (Chat Completions); pass logprobs=True where the API has
    only `top_logprobs` (the Responses API)."""
    if top_logprobs is not None:
        if isinstance(top_logprobs, bool) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise _invalid(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}", param)
        if not logprobs:
            raise _invalid("top_logprobs needs logprobs set to true", param)
    if not logprobs:
        return None
    return top_logprobs or 0


def check_prompt_tokens(
    ids: Sequence[object], vocab_size: int | None, limits: RequestLimits, param: str
) -> tuple[int, ...]:
    """A prompt given as token ids: not empty, no more ids than a text prompt has characters,
    each an integer id of the model's vocabulary (`vocab_size`; None: not known here)."""
    if not ids:
        raise _invalid("a prompt must not be empty", param)
    if len(ids) > limits.max_text_chars:
        raise GatewayError(
            "input_too_large",
            f"a token-id prompt holds at most {limits.max_text_chars} ids, got {len(ids)}",
            param=param,
        )
    top = vocab_size if vocab_size is not None else 2**31
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < top:
            shown = f"0..{vocab_size - 1}" if vocab_size is not None else "non-negative"
            raise _invalid(
                f"token ids are integers in {shown} (the model's vocabulary); got "
                f"{clip(repr(token), 40)}",
                f"{param}[{i}]",
            )
    return tuple(ids)  # type: ignore[arg-type]


def check_choices(n: int | None, param: str = "n") -> int:
    """How many answers to sample from the prompt (1..MAX_CHOICES)."""
    if n is None:
        return 1
    if isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise _invalid(f"n must be an integer in 1..{MAX_CHOICES}", param)
    return n


def check_instructions(text: str | None, limits: RequestLimits, param: str) -> str | None:
    if text is not None and len(text) > limits.max_text_chars:
        raise GatewayError(
            "input_too_large",
            f"instructions hold at most {limits.max_text_chars} characters, got {len(text)}",
            param=param,
        )
    return text


def check_text(text: str, limits: RequestLimits, param: str) -> str:
    if len(text) > limits.max_text_chars:
        raise GatewayError(
            "input_too_large",
            f"text parts hold at most {limits.max_text_chars} characters, got {len(text)}",
            param=param,
        )
    return text


def check_output_modalities(modalities: Iterable[str] | None, param: str) -> None:
    if modalities is not None and any(m != "text" for m in modalities):
        raise _invalid("only text output is supported", param)


def refuse_unsupported(
    value: object, param: str, message: str, *, allow_empty: bool = True
) -> None:
    """Refuse a feature the wire shape holds only so that it can be refused clearly: given
    (and, with `allow_empty`, not empty), it is an `invalid_request` with `message`."""
    if value is not None and not (allow_empty and not value):
        raise _invalid(message, param)


def check_item_count(count: int, limits: RequestLimits, param: str | None) -> None:
    if count > limits.max_items_per_session:
        raise GatewayError(
            "input_too_large",
            f"a conversation holds at most {limits.max_items_per_session} items",
            param=param,
        )


def conversation_chars(instructions: str | None, items: Iterable[StoredItem]) -> int:
    """Text characters of a conversation: its instructions, every text part and every tool
    call's arguments."""
    return len(instructions or "") + sum(
        len(part.text or "")
        for item in items
        for part in item.parts
        if part.kind in ("text", "tool_call")
    )


def check_conversation_size(chars: int, limits: RequestLimits, param: str | None) -> None:
    """Refuse a conversation whose text is over `max_conversation_chars` (cheap: no tokenizing;
    what fits the model's context is decided later, from token counts)."""
    if chars > limits.max_conversation_chars:
        raise GatewayError(
            "input_too_large",
            f"a conversation holds at most {limits.max_conversation_chars} characters of text; "
            f"this one would hold {chars}",
            param=param,
        )


def check_image_count(images: Iterable[str], limits: RequestLimits, param: str | None) -> None:
    """Refuse more distinct images (URLs or digests) than a session may hold."""
    if len(set(images)) > limits.max_images_per_session:
        raise GatewayError(
            "too_many_images",
            f"a conversation holds at most {limits.max_images_per_session} images",
            param=param,
        )


MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(value: str | None, param: str = "cache_salt") -> str | None:
    """A client's prefix-cache salt: 1..256 characters, or None."""
    if value is not None and not 1 <= len(value) <= MAX_CACHE_SALT_CHARS:
        raise _invalid(f"cache_salt is 1..{MAX_CACHE_SALT_CHARS} characters", param)
    return value


def response_options(
    limits: RequestLimits,
    *,
    where: str = "",
    max_tokens: int | str | None = None,
    max_tokens_param: str = "max_output_tokens",
    allow_inf: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    instructions: str | None = None,
    truncation: Literal["auto", "disabled"] | None = None,
    store: bool = True,
    api: str = "realtime",
) -> ResponseOptions:
    """Check one response's values and build its `ResponseOptions`; params are `where` + name."""
    check_sampling(temperature, top_p, seed, where=where)
    checked_max = check_max_tokens(
        max_tokens, limits.max_output_tokens_limit, where + max_tokens_param, allow_inf=allow_inf
    )
    stops = check_stop(stop, where + "stop")
    check_instructions(instructions, limits, where + "instructions")
    return ResponseOptions(
        instructions=instructions,
        max_output_tokens=checked_max,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=stops,
        truncation=truncation,
        store=store,
        api=api,
    )


# ---------------------------------------------------------------- tool calls and results

MAX_CALL_ID_CHARS = 128
MAX_TOOL_NAME_CHARS = 64


def _call_id(value: object, param: str) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_CALL_ID_CHARS:
        raise _invalid(f"a tool call id is 1..{MAX_CALL_ID_CHARS} characters", param)
    return value


def tool_call_part(
    call_id: object,
    name: object,
    arguments: object,
    limits: RequestLimits,
    *,
    params: tuple[str, str, str],
) -> StoredPart:
    """A tool call the model made, as a client sends it back in the history; `params` name
    where its id, function name and arguments sit in the caller's terms."""
    id_param, name_param, arguments_param = params
    checked_id = _call_id(call_id, id_param)
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_TOOL_NAME_CHARS:
        raise _invalid(f"a function name is 1..{MAX_TOOL_NAME_CHARS} characters", name_param)
    if not isinstance(arguments, str):
        raise _invalid("arguments are a string of JSON text", arguments_param)
    check_text(arguments, limits, arguments_param)
    return StoredPart("tool_call", text=arguments, name=name, call_id=checked_id)


def tool_result_part(
    call_id: object, text: str, limits: RequestLimits, *, params: tuple[str, str]
) -> StoredPart:
    """A tool's result, answering the call `call_id`; `params` name where the id and the
    result sit in the caller's terms."""
    id_param, text_param = params
    checked = _call_id(call_id, id_param)
    return StoredPart("text", text=check_text(text, limits, text_param), call_id=checked)


def check_tool_result(call_id: str, calls: Iterable[str], param: str) -> None:
    """A tool result answers a call the conversation made before it (`calls`: their ids)."""
    if call_id not in set(calls):
        raise _invalid(
            f"no earlier tool call has the id {clip(call_id, 64)!r}: a tool result must follow "
            "the assistant message whose call it answers",
            param,
        )


# ---------------------------------------------------------------- content and images


@dataclass(frozen=True, slots=True)
class ContentPart:
    """One part of a message, whatever the transport called it.

    `param` names where the part's value sits (`item.content[0].image_url`,
    `messages[1].content[0].image_url.url`); `type_param` where its type sits, for refusals of
    the part itself (an image in an assistant message).
    """

    kind: Literal["text", "image"]
    param: str
    text: str | None = None
    url: str | None = None
    type_param: str | None = None


@dataclass(slots=True)
class ParsedContent:
    """A message's parts as the gateway stores them, and the images they bring."""

    parts: list[StoredPart] = field(default_factory=list)  # one per ContentPart, in order
    inline: dict[str, bytes] = field(default_factory=dict)  # digest -> bytes sent in the request
    refs: dict[str, str] = field(default_factory=dict)  # digest -> param, images sent by digest

    @property
    def digests(self) -> set[str]:
        return set(self.inline) | set(self.refs)


def check_image_bytes(data: bytes, limits: RequestLimits, param: str) -> tuple[str, int, int]:
    """(format, width, height) of image bytes, read from the header; GatewayError for anything
    empty, unreadable, of a format the encoder does not take, or over the size limits."""
    if not data:
        raise GatewayError("invalid_image", "the image holds no bytes", param=param)
    return sniff_image(
        data, max_bytes=limits.max_image_bytes, max_pixels=limits.max_pixels, param=param
    )


async def fetch_remote(
    parts: Iterable[ContentPart], limits: RequestLimits, *, param: str | None
) -> dict[str, bytes]:
    """Bytes of the parts' allow-listed remote image URLs. The images are counted first, so a
    request with too many of them fetches nothing."""
    urls = [p.url for p in parts if p.kind == "image" and p.url]
    check_image_count(urls, limits, param)
    return await fetch_remote_images(
        urls, allowlist=limits.image_url_allowlist, max_bytes=limits.max_image_bytes
    )


def parse_content(
    role: str,
    parts: Sequence[ContentPart],
    limits: RequestLimits,
    fetched: Mapping[str, bytes] | None = None,
    *,
    param: str,
) -> ParsedContent:
    """Check one message's parts and turn them into stored parts (`param`: where the content
    list sits). Inline images are checked from their header once per digest; references are
    collected for `resolve_references`; remote URLs resolve only through `fetched`."""
    if not parts:
        raise _invalid("a message needs at least one content part", param)
    if len(parts) > limits.max_parts_per_message:
        raise GatewayError(
            "input_too_large",
            f"a message holds at most {limits.max_parts_per_message} parts",
            param=param,
        )
    out = ParsedContent()
    for part in parts:
        if part.kind == "text":
            if part.text is None:
                raise _invalid("a text part needs text", part.param)
            out.parts.append(StoredPart("text", text=check_text(part.text, limits, part.param)))
            continue
        if role != "user":
            raise _invalid("only user messages may hold images", part.type_param or part.param)
        if not part.url:
            raise _invalid("an image part needs an image URL", part.param)
        out.parts.append(
            StoredPart("image", digest=_image(part.url, part.param, limits, fetched, out))
        )
    check_image_count(out.digests, limits, param)
    return out


def _image(
    url: str,
    param: str,
    limits: RequestLimits,
    fetched: Mapping[str, bytes] | None,
    out: ParsedContent,
) -> str:
    ref = parse_image_url(url, max_bytes=limits.max_image_bytes, param=param, fetched=fetched)
    if isinstance(ref, ImageRef):
        out.refs.setdefault(str(ref), param)
        return str(ref)
    digest = digest_of(ref)
    if digest not in out.inline:  # a repeated image is checked once
        check_image_bytes(ref, limits, param)
        out.inline[digest] = bytes(ref)
    return digest


async def resolve_references(
    refs: Mapping[str, str], vision: VisionResolver, *, owner: str
) -> None:
    """Refuse a reference to an image `owner` did not send or the gateway no longer holds
    (`refs`: digest -> param); the two read the same."""
    for digest, param in refs.items():
        if not await vision.known(owner, digest):
            raise GatewayError("image_not_found", f"no image with digest {digest}", param=param)


async def admit_encodes(
    digests: Iterable[str],
    vision: VisionResolver,
    *,
    owner: str,
    also: Sequence[EncodeQuota] = (),
) -> EncodePermit:
    """Reserve encode slots for a request's images (those `owner` has not had encoded yet), or
    refuse it with `rate_limited` (HTTP 429, Retry-After) past the owner's cap or a cap of
    `also` (a connection's). Call it before anything of the request is stored."""
    return await vision.admit(owner, digests, also=also)


async def add_inline_images(
    inline: Mapping[str, bytes], vision: VisionResolver, *, owner: str
) -> None:
    """Store the bytes of the images a request sent, so `owner` can have them encoded and
    reference them later."""
    for digest, data in inline.items():
        await vision.add(owner, digest, data)
