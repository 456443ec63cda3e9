"""Tools, `tool_choice` and response formats as constrained-decoding grammars and prompt text.

Both HTTP APIs (Chat Completions and Responses) hand their wire fields here and get back a
`ToolPlan`: the text that tells the model which tools it has and how to call them, and one
grammar (`SamplingParams.grammar`) that makes its answer exactly one of the allowed shapes.
`gateway.chat.tool_stream` reads the answer back into text and calls. Pure functions: no engine,
no server, no I/O.

Why llguidance: its grammars are Lark with JSON schemas embedded (`%json {...}`), so "plain text
or these tool calls, each with arguments of its own schema" is one grammar; it computes each
token's mask lazily in Rust as decoding goes (nothing is precompiled over the vocabulary per
schema, so a new schema costs nothing up front), releases the GIL while doing it, validates a
grammar without a tokenizer (so a bad schema is refused before anything is queued), and pins no
torch or transformers version.

Decisions:
- Calls are written in the Hermes/Qwen style (`tool_stream.render_tool_call`). The grammar fixes
  the key order and every byte of whitespace, arguments included (compact JSON with `", "` and
  `": "`, as Python's `json.dumps` writes it), so a call the client sends back renders to the
  tokens the model generated and the KV prefix cache hits.
- Arguments always match the function's `parameters` schema; `strict` only decides what an
  unsupported keyword does: refused when strict, ignored (llguidance's `lenient`) when not.
  An empty or missing schema is any JSON object.
- Given the answer's token budget, the grammar narrows what a schema leaves unbounded (string
  and array lengths, other properties, the number of parallel calls) so that its longest answer
  fits (`bound_schema`): a small model looping inside a string then closes it instead of being
  cut by `max_tokens`. Every answer still validates against the client's schema.
- `auto`: either plain text (which does not start with `<` and never contains `<tool_call>`; the
  response format's grammar instead, when there is one) or calls. `required`: one call, or one
  or more when `parallel_tool_calls`. A named function: exactly one call of it. `none`: the
  tools stay listed in the prompt, and the grammar allows plain text only. The prompt is the
  same under every choice (the grammar alone enforces it), so a conversation that moves from
  `required` to `auto` or `none` keeps its whole prefix in the KV cache.
- Sizes are bounded before llguidance sees anything: names, descriptions, each schema (64 KiB)
  and all of them together (the engine compiles grammars of at most `MAX_GRAMMAR_CHARS`).
  Validation of a grammar is remembered by digest, since clients resend the same tools.
- Every refusal is `invalid_request` with `param` naming the field in the caller's terms.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import llguidance
import structlog

from gateway.chat.tool_stream import (
    CALL_HEAD,
    CALL_JOIN,
    CALL_SEP,
    CALL_TAIL,
    ArgumentsPiece,
    CallStart,
    Piece,
    TextPiece,
    ToolCall,
    ToolCallStream,
    call_id,
    render_answer,
    render_tool_call,
    render_tool_result,
    split_answer,
)
from gateway.protocol.errors import GatewayError, clip

__all__ = (
    "MAX_DESCRIPTION_CHARS",
    "MAX_GRAMMAR_CHARS",
    "MAX_SCHEMA_BYTES",
    "MAX_TOOLS",
    "MAX_TOOLS_SCHEMA_BYTES",
    "ArgumentsPiece",
    "CallStart",
    "Piece",
    "TextPiece",
    "ToolCall",
    "ToolCallStream",
    "ToolPlan",
    "ToolSpec",
    "bound_schema",
    "call_id",
    "plain_text_grammar",
    "plan_tools",
    "render_answer",
    "render_tool_call",
    "render_tool_result",
    "response_format_grammar",
    "split_answer",
    "text_format_grammar",
    "tools_from_chat",
    "tools_from_responses",
)

log = structlog.get_logger(__name__)

MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 64 * 1024  # a schema's JSON text
# the largest grammar the engine compiles (gateway.engine.local.grammar.MAX_GRAMMAR_CHARS; not
# imported:
# this module stays free of torch); the grammar holds every schema, hence the bound on them all
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_TOOLS_SCHEMA_BYTES = MAX_GRAMMAR_CHARS
# the engine's bounds on one matcher (gateway.engine.local.grammar.PARSER_LIMITS, not imported for
# the
# same reason): a grammar is validated under them, so what passes here compiles there
PARSER_LIMITS = {
    "max_lexer_states": 50_000,
    "step_lexer_fuel": 100_000,
    "initial_lexer_fuel": 1_000_000,
    "step_max_items": 50_000,
}
MAX_DESCRIPTION_CHARS = 4096
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")

Choice = Literal["auto", "none", "required", "function"]

# A response format's grammar: this first line, then rules defining `answer_text`, so that
# `plan_tools` can offer it as the text branch beside the calls.
_TEXT_START = "start: answer_text\n"
# plain text under `auto`: empty, or not starting with `<`, and never holding a call's tag
_PLAIN_TEXT = "TEXT: /(?s:[^<].*)?/ & ~/(?s:.*)<tool_call>(?s:.*)/\n"
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict  # a JSON schema of an object
    strict: bool


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: tuple[ToolSpec, ...]
    choice: Choice
    function: str | None  # the named function when choice == "function"
    parallel: bool
    prompt: str  # appended to the system prompt (the same whatever the choice)
    grammar: str | None


def _refuse(param: str, message: str) -> GatewayError:
    return GatewayError("invalid_request", message, param=param)


def _shown(value: object) -> str:
    return repr(clip(value, 40) if isinstance(value, str) else value)


# -- tools ---------------------------------------------------------------------------------------


def tools_from_chat(tools: list[dict] | None, param: str = "tools") -> list[ToolSpec]:
    """Chat Completions' `tools`: `[{"type": "function", "function": {name, description,
    parameters, strict}}]`."""
    specs = []
    for i, item in enumerate(_tool_items(tools, param)):
        where = f"{param}[{i}]"
        _check_function_type(item, where)
        function = item.get("function")
        if not isinstance(function, dict):
            raise _refuse(
                f"{where}.function",
                "must be an object: the function's name, description and parameters",
            )
        specs.append(_tool_spec(function, f"{where}.function", strict_default=False))
    _check_tool_set(specs, param, lambda i: f"{param}[{i}].function.name")
    for i, spec in enumerate(specs):  # the costly check last, on a set of bounded size
        _check_schema(spec.parameters, spec.strict, f"{param}[{i}].function.parameters")
    return specs


def tools_from_responses(tools: list[dict] | None, param: str = "tools") -> list[ToolSpec]:
    """The Responses API's `tools`: `[{"type": "function", name, description, parameters,
    strict}]` (strict by default there); built-in tools are not supported."""
    specs = []
    for i, item in enumerate(_tool_items(tools, param)):
        where = f"{param}[{i}]"
        _check_function_type(item, where)
        specs.append(_tool_spec(item, where, strict_default=True))
    _check_tool_set(specs, param, lambda i: f"{param}[{i}].name")
    for i, spec in enumerate(specs):
        _check_schema(spec.parameters, spec.strict, f"{param}[{i}].parameters")
    return specs


def _tool_items(tools: object, param: str) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _refuse(param, "must be an array of tools")
    if len(tools) > MAX_TOOLS:
        raise _refuse(param, f"at most {MAX_TOOLS} tools, got {len(tools)}")
    for i, item in enumerate(tools):
        if not isinstance(item, dict):
            raise _refuse(f"{param}[{i}]", "must be an object")
    return tools


def _check_function_type(item: dict, where: str) -> None:
    kind = item.get("type")
    if kind != "function":
        raise _refuse(
            f"{where}.type", f"tool type {_shown(kind)} is not supported; only 'function' tools are"
        )


def _tool_spec(fields: dict, where: str, *, strict_default: bool) -> ToolSpec:
    name = fields.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise _refuse(f"{where}.name", "must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
    description = _description(fields.get("description"), f"{where}.description")
    strict = fields.get("strict")
    if strict is None:
        strict = strict_default
    elif not isinstance(strict, bool):
        raise _refuse(f"{where}.strict", "must be a boolean")
    parameters = _object_schema(fields.get("parameters"), f"{where}.parameters")
    _schema_text(parameters, f"{where}.parameters")
    return ToolSpec(name, description, parameters, strict)


def _description(value: object, param: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _refuse(param, "must be a string")
    if len(value) > MAX_DESCRIPTION_CHARS:
        raise _refuse(param, f"at most {MAX_DESCRIPTION_CHARS} characters, got {len(value)}")
    return value


def _object_schema(schema: object, param: str) -> dict:
    """The schema of a JSON object: `type` is "object" when given and added when not (so the
    arguments are always an object, whatever else the schema says)."""
    if schema is None:
        return {"type": "object"}
    if not isinstance(schema, dict):
        raise _refuse(param, "must be a JSON schema object")
    kind = schema.get("type", "object")
    if kind != "object":
        raise _refuse(f"{param}.type", 'must be "object": arguments are a JSON object')
    return schema if "type" in schema else {"type": "object", **schema}


def _check_tool_set(
    specs: Sequence[ToolSpec], param: str, name_param: Callable[[int], str]
) -> None:
    """Names are unique; the schemas together stay small enough to validate and prompt with."""
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        if spec.name in seen:
            raise _refuse(name_param(i), f"tool name {spec.name!r} is used twice")
        seen.add(spec.name)
    total = sum(len(_schema_text(spec.parameters, param).encode()) for spec in specs)
    if total > MAX_TOOLS_SCHEMA_BYTES:
        raise _refuse(
            param,
            f"the tools' parameters schemas take {total} bytes; at most "
            f"{MAX_TOOLS_SCHEMA_BYTES} together",
        )


# -- schemas and grammars ------------------------------------------------------------------------


def _schema_text(schema: dict, param: str) -> str:
    """The schema's JSON text, bounded; what the grammar embeds and the prompt shows."""
    try:
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        raise _refuse(param, "must be a JSON schema (plain JSON values)") from None
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise _refuse(param, f"at most {MAX_SCHEMA_BYTES} bytes of JSON")
    return text


def _json_rule(schema: dict, strict: bool, budget: int | None = None) -> str:
    """`%json {...}` of the schema, its output compact; a strict schema's unsupported keywords
    are errors, a lax one's are ignored. The schema's own `x-guidance` is replaced: the layout
    of the output is ours to fix. With `budget` (the answer's max tokens), what the schema
    leaves unbounded is bounded to fit it (`bound_schema`)."""
    options = _COMPACT if strict else {**_COMPACT, "lenient": True}
    if budget is not None:
        schema = bound_schema(schema, budget)
    body = {key: value for key, value in schema.items() if key != "x-guidance"}
    body["x-guidance"] = options
    # the grammar's own JSON text is compact too: the engine bounds the grammar's size
    text = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return "%json " + text


# -- bounds on what a schema leaves unbounded ---------------------------------------------------

# A small model asked for JSON may loop inside a string or an array until `max_tokens` cuts it
# (the SDK's `.parse()` then raises). So the grammar narrows the schema, never widening it, so
# that every answer it allows still validates against the client's schema, and its longest
# answer fits the token budget: strings without `maxLength` (nor enum, const, pattern or
# format) get one, arrays without `maxItems` get one, objects with `properties` and no word on
# others take no others, and free objects (no `properties`) take at most a few keys of at most
# 32 identifier characters, holding scalars or lists of them.
CHARS_PER_TOKEN = 2  # what a token of JSON text holds, taken low: the bounds are sized by it
MAX_CALLS = 16  # parallel calls in one answer, at most
# (string length, array length) tried in turn, the largest first, the two cut by turns
BOUNDS = (
    (512, 16), (256, 16), (256, 8), (128, 8), (128, 4), (64, 4), (64, 2), (32, 2), (32, 1),
    (16, 1), (8, 1),
)  # fmt: skip
_FREE_KEY = "^[A-Za-z0-9_ -]{1,32}$"
_UNBOUNDED = 10**6  # what the estimate counts for a part of unknown size (a $ref)


def bound_schema(schema: dict, budget: int) -> dict:
    """`schema` narrowed so that its longest answer fits about `budget` tokens: the longest
    strings and arrays that fit, else the shortest (8 characters, one item)."""
    chars = budget * CHARS_PER_TOKEN
    for length, items in BOUNDS:
        bounded = _bound(schema, length, items)
        if _longest(bounded, length) <= chars:
            break
    return bounded


def _bound(node: object, length: int, items: int) -> object:
    if isinstance(node, list):
        return [_bound(item, length, items) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _bound_child(key, value, length, items) for key, value in node.items()}
    kinds = node.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds} if kinds else set()
    fixed = any(k in node for k in ("enum", "const", "$ref"))
    if "string" in kinds and not fixed and not {"maxLength", "pattern", "format"} & set(node):
        out["maxLength"] = max(length, _count(node, "minLength", 0))
    if "array" in kinds and not fixed and "maxItems" not in node:
        out["maxItems"] = max(items, _count(node, "minItems", 0))
    if "object" in kinds and not fixed:
        others = {"additionalProperties", "patternProperties", "unevaluatedProperties"}
        if node.get("properties") and not others & set(node):
            out["additionalProperties"] = False  # only the named ones
        elif not node.get("properties") and not others & set(node):
            out["patternProperties"] = {_FREE_KEY: _free_value(length, items)}
            out["additionalProperties"] = False
            out.setdefault("maxProperties", max(items, _count(node, "minProperties", 0)))
    return out


def _bound_child(key: str, value: object, length: int, items: int) -> object:
    if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(
        value, dict
    ):
        return {name: _bound(sub, length, items) for name, sub in value.items()}
    if key in ("items", "additionalProperties", "prefixItems", "anyOf", "oneOf", "allOf"):
        return _bound(value, length, items)
    return value  # enum and const values, descriptions, numbers: as they are


def _count(node: dict, key: str, default: int) -> int:
    """A schema's count keyword (`minItems`, `maxLength`, ...) if it is a non-negative integer,
    else `default`: a malformed one is left for the grammar compiler to refuse."""
    value = node.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return default


def _listed(node: dict, key: str) -> list:
    value = node.get(key)
    return value if isinstance(value, list) else []


def _free_value(length: int, items: int) -> dict:
    scalar: list[dict] = [
        {"type": "string", "maxLength": length},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
    ]
    listed = {"type": "array", "items": {"anyOf": scalar}, "maxItems": items}
    return {"anyOf": [*scalar, listed]}


def _longest(node: object, length: int) -> int:
    """An estimate of the longest compact JSON text `node` allows, in characters."""
    if not isinstance(node, dict):
        return 5 if node is True else 0
    if "const" in node:
        return len(json.dumps(node["const"]))
    if isinstance(node.get("enum"), list) and node["enum"]:
        return max(len(json.dumps(value)) for value in node["enum"])
    if "$ref" in node:
        return _UNBOUNDED
    branches = [b for key in ("anyOf", "oneOf") for b in _listed(node, key)]
    if branches:
        return max(_longest(b, length) for b in branches)
    kinds = node.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds] if kinds else ["object"]
    return max(_longest_of(kind, node, length) for kind in kinds)


def _longest_of(kind: str, node: dict, length: int) -> int:
    if kind == "string":
        return _count(node, "maxLength", length) + 2
    if kind in ("number", "integer"):
        return 24
    if kind in ("boolean", "null"):
        return 5
    if kind == "array":
        count = _count(node, "maxItems", _UNBOUNDED)
        item = node.get("items")
        prefix = _listed(node, "prefixItems")
        # counted, never listed: a client's minItems may be in the billions
        sizes = [_longest(p, length) + 2 for p in prefix[:count]]
        total = 2 + sum(sizes)
        if isinstance(item, dict) or item is None:
            total += (_longest(item or {}, length) + 2) * max(0, count - len(prefix))
        return total
    if kind == "object":
        total = 2
        properties = node.get("properties")
        for name, sub in (properties if isinstance(properties, dict) else {}).items():
            total += len(json.dumps(name)) + 4 + _longest(sub, length)
        extra = node.get("patternProperties")
        extra = extra if isinstance(extra, dict) else {}
        for sub in extra.values():
            total += _count(node, "maxProperties", _UNBOUNDED) * (38 + _longest(sub, length))
        if node.get("additionalProperties", True) is not False and not extra:
            total += _UNBOUNDED
        return total
    return _UNBOUNDED


def _check_schema(schema: dict, strict: bool, param: str) -> None:
    _checked(f"start: value\nvalue: {_json_rule(schema, strict)}\n", param)


def _checked(grammar: str, param: str, what: str = "the schema is not supported") -> str:
    """`grammar`, if the engine will compile it; else a refusal naming `param`."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise _refuse(
            param,
            f"the grammar it makes has {len(grammar)} characters; at most {MAX_GRAMMAR_CHARS}",
        )
    error = _grammar_error(grammar)
    if error:
        raise _refuse(param, f"{what}: {error}")
    return grammar


def _grammar_error(grammar: str) -> str:
    """llguidance's complaint about a grammar, without its position and echo of the grammar (""
    if none). Remembered by digest: clients send the same tools request after request, and a
    large tool set takes llguidance tens of milliseconds (with the GIL released)."""
    key = hashlib.sha256(grammar.encode()).digest()
    with _validated_lock:
        if key in _validated:
            _validated.move_to_end(key)
            return _validated[key]
    message = llguidance.LLMatcher.validate_grammar(
        grammar, limits=llguidance.LLParserLimits(**PARSER_LIMITS)
    )
    # drop the position and llguidance's echo of the grammar (numbered lines, carets)
    lines = [line.strip() for line in message.splitlines() if not _ECHO.match(line)]
    error = re.sub(r"^at \d+\(\d+\): ", "", " ".join(line for line in lines if line))
    with _validated_lock:
        _validated[key] = error
        while len(_validated) > _VALIDATED_MAX:
            _validated.popitem(last=False)
    return error


_ECHO = re.compile(r"\s*(\d+ \|.*|\^+)\s*$")
_VALIDATED_MAX = 1024
_validated: OrderedDict[bytes, str] = OrderedDict()  # grammar digest -> error ("" when valid)
_validated_lock = threading.Lock()


def _format_grammar(schema: dict, strict: bool, param: str, budget: int | None) -> str:
    _schema_text(schema, param)
    rule = _json_rule(schema, strict, budget)
    return _checked(f"{_TEXT_START}answer_text: {rule}\n", param)


def response_format_grammar(
    fmt: dict | None, param: str = "response_format", *, budget: int | None = None
) -> str | None:
    """Chat Completions' `response_format`: text (None), any JSON object, or a JSON schema
    (`{"type": "json_schema", "json_schema": {name, schema, strict, description}}`). `budget`:
    the answer's max tokens, which the JSON's unbounded parts are bounded to fit."""
    kind = _format_type(fmt, param)
    if kind != "json_schema" or not isinstance(fmt, dict):
        return _simple_format(kind, budget)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _refuse(f"{param}.json_schema", "must be an object: name, schema, strict")
    return _schema_format(spec, f"{param}.json_schema", budget)


def text_format_grammar(
    fmt: dict | None, param: str = "text.format", *, budget: int | None = None
) -> str | None:
    """The Responses API's `text.format`: `{"type": "text" | "json_object"}` or
    `{"type": "json_schema", name, schema, strict, description}`; `budget` as in
    `response_format_grammar`."""
    kind = _format_type(fmt, param)
    if kind != "json_schema" or not isinstance(fmt, dict):
        return _simple_format(kind, budget)
    return _schema_format(fmt, param, budget)


def _format_type(fmt: object, param: str) -> str:
    if fmt is None:
        return "text"
    if not isinstance(fmt, dict):
        raise _refuse(param, "must be an object with a type")
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise _refuse(
            f"{param}.type",
            f"format {_shown(kind)} is not supported: 'text', 'json_object' or 'json_schema'",
        )
    return kind


def _simple_format(kind: str, budget: int | None) -> str | None:
    if kind == "text":
        return None
    return f"{_TEXT_START}answer_text: {_json_rule({'type': 'object'}, True, budget)}\n"


def _schema_format(spec: dict, param: str, budget: int | None) -> str:
    name = spec.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise _refuse(f"{param}.name", "must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
    _description(spec.get("description"), f"{param}.description")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _refuse(f"{param}.strict", "must be a boolean")
    schema = spec.get("schema")
    if schema is None:
        schema = {"type": "object"}
    elif not isinstance(schema, dict):
        raise _refuse(f"{param}.schema", "must be a JSON schema object")
    return _format_grammar(schema, bool(strict), f"{param}.schema", budget)


# -- the plan ------------------------------------------------------------------------------------


def plan_tools(
    tools: list[ToolSpec],
    tool_choice: str | dict | None,
    parallel_tool_calls: bool | None,
    *,
    text_grammar: str | None = None,
    param: str = "tool_choice",
    budget: int | None = None,
) -> ToolPlan | None:
    """The prompt and grammar for `tools` under `tool_choice`; None when there are no tools and
    none are asked for. `text_grammar` (from `response_format_grammar` or
    `text_format_grammar`) constrains a plain-text answer; `budget` (the answer's max tokens)
    bounds what the arguments' schemas leave unbounded (`bound_schema`)."""
    if parallel_tool_calls is None:
        parallel = True
    elif isinstance(parallel_tool_calls, bool):
        parallel = parallel_tool_calls
    else:
        raise _refuse("parallel_tool_calls", "must be a boolean")
    if text_grammar is not None and not text_grammar.startswith(_TEXT_START):
        raise ValueError("text_grammar must come from response_format_grammar")
    if not tools:
        # "auto" and "none" without tools mean plain text, as OpenAI takes them (clients send
        # "auto" by default); "required" or a named function has nothing to call
        if tool_choice is None or tool_choice in ("auto", "none"):
            return None
        raise _refuse(param, "tool_choice 'required' or a named function needs tools")
    if len(tools) > MAX_TOOLS:
        raise _refuse("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    _check_tool_set(tools, "tools", lambda i: "tools")
    choice, function = _parse_choice(tool_choice, {t.name for t in tools}, param)
    prompt = _tools_prompt(tools, parallel)
    if choice == "none":
        # the tools stay listed (the same prompt as under any other choice, so the KV of a
        # conversation that called them is reused); the grammar allows plain text only
        grammar = text_grammar or plain_text_grammar()
        return ToolPlan(tuple(tools), choice, None, parallel, prompt, grammar)
    offered = [t for t in tools if t.name == function] if function else tools
    grammar = _checked(
        _tools_grammar(offered, choice, parallel, text_grammar, budget),
        "tools",
        "the tools' schemas are not supported together",
    )
    log.debug("tools planned", tools=len(tools), choice=choice, grammar_chars=len(grammar))
    return ToolPlan(tuple(tools), choice, function, parallel, prompt, grammar)


def plain_text_grammar() -> str:
    """Plain text that does not start with `<` and never holds a call's tag. Also for an answer
    after tool results when no tools are offered: a small model otherwise imitates the
    results' markup (`<tool_response>...`) instead of answering."""
    return _checked("start: TEXT\n" + _PLAIN_TEXT, "tools", "the plain-text grammar")


def _parse_choice(tool_choice: object, names: set[str], param: str) -> tuple[Choice, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice in ("auto", "none", "required"):
            return tool_choice, None  # type: ignore[return-value]
        raise _refuse(param, "must be 'auto', 'none', 'required' or a named function")
    if not isinstance(tool_choice, dict):
        raise _refuse(param, "must be 'auto', 'none', 'required' or a named function")
    kind = tool_choice.get("type")
    if kind != "function":
        raise _refuse(f"{param}.type", f"tool choice {_shown(kind)} is not supported")
    function = tool_choice.get("function")
    if function is not None:  # Chat Completions: {"type": "function", "function": {"name"}}
        if not isinstance(function, dict):
            raise _refuse(f"{param}.function", "must be an object with the function's name")
        name, name_param = function.get("name"), f"{param}.function.name"
    else:  # Responses: {"type": "function", "name"}
        name, name_param = tool_choice.get("name"), f"{param}.name"
    if not isinstance(name, str):
        raise _refuse(name_param, "must be the name of one of the tools")
    if name not in names:
        raise _refuse(name_param, f"no tool is named {clip(name, 64)!r}")
    return "function", name


def _literal(text: str) -> str:
    """A Lark string literal of `text` (llguidance reads JSON string escapes)."""
    return json.dumps(text)


def _tools_grammar(
    tools: list[ToolSpec],
    choice: Choice,
    parallel: bool,
    text_grammar: str | None,
    budget: int | None,
) -> str:
    lines = [
        f"call: {_literal(CALL_HEAD)} fn {_literal(CALL_TAIL)}",
        "fn: " + " | ".join(f"fn_{i}" for i in range(len(tools))),
    ]
    longest_call = 0
    for i, tool in enumerate(tools):
        schema = tool.parameters if budget is None else bound_schema(tool.parameters, budget)
        lines.append(f"fn_{i}: {_literal(tool.name + CALL_SEP)} args_{i}")
        lines.append(f"args_{i}: {_json_rule(schema, tool.strict)}")
        overhead = len(CALL_HEAD + tool.name + CALL_SEP + CALL_TAIL + CALL_JOIN)
        longest_call = max(longest_call, overhead + _longest(schema, 0))
    if not parallel:
        lines.insert(1, "calls: call")
    elif budget is None:
        lines.insert(1, f"calls: call ({_literal(CALL_JOIN)} call)*")
    else:  # as many calls as fit the budget, one at least: a model repeating a call stops
        more = min(MAX_CALLS, budget * CHARS_PER_TOKEN // max(longest_call, 1)) - 1
        if more > 0:
            lines.insert(1, f"calls: call ({_literal(CALL_JOIN)} call){{0,{more}}}")
        else:
            lines.insert(1, "calls: call")
    if choice == "auto":
        if text_grammar is None:
            start = "start: TEXT | calls\n" + _PLAIN_TEXT
        else:
            start = "start: answer_text | calls\n" + text_grammar[len(_TEXT_START) :]
    elif choice == "required":
        start = "start: calls\n"
    else:  # one call of the named function
        start = "start: call\n"
    return start + "\n".join(lines) + "\n"


def _tools_prompt(tools: list[ToolSpec], parallel: bool) -> str:
    """The tools as JSON between <tools> tags, then how to call them. The listing comes first
    and does not depend on the choice, so prompts of one tool set share their prefix."""
    listing = "\n".join(
        json.dumps(
            {"name": t.name, "description": t.description, "parameters": t.parameters},
            ensure_ascii=False,
        )
        for t in tools
    )
    # the rule does not depend on the choice either (the grammar enforces it): a follow-up under
    # another tool_choice renders the same system prompt, so the whole conversation's KV is reused
    rule = (
        "Answer either in plain text or with one or more function calls, one after another."
        if parallel
        else "Answer either in plain text or with one function call."
    )
    return (
        "# Tools\n\n"
        "You can call functions to help answer the user. They are listed below, one JSON "
        "object each (name, description, JSON schema of the arguments), between <tools> and "
        "</tools>:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "To call a function, write its name and arguments as one line of JSON between "
        "<tool_call> and </tool_call>:\n"
        + render_tool_call("<function-name>", "<arguments-json-object>")
        + "\n\nEach result comes back between <tool_response> and </tool_response>. "
        + rule
    )
