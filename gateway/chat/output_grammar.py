"""Tools and `tool_choice` as a constrained-decoding grammar and prompt text: the tool plan.

Both HTTP APIs (Chat Completions and Responses) and the Realtime API hand their wire fields here
and get back a `ToolPlan`: the text that tells the model which tools it has and how to call
them, and one grammar (`SamplingParams.grammar`) that makes its answer exactly one of the
allowed shapes; `apply_tool_plan` puts a plan into a response's options, the same way for
every API. `gateway.chat.tool_stream` reads the answer back into text and calls. Response
formats (`response_format`, `text.format`) and the JSON-schema pieces of a grammar are
`gateway.chat.response_formats` (re-exported here, as the reader's names of `tool_stream` are,
so a transport imports its output grammars from one place); a format's grammar is the text
branch of the plan's. Pure functions: no engine, no server, no I/O.

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
  fits (`schema_bounds.bound_schema`): a small model looping inside a string then closes it
  instead of being cut by `max_tokens`. Every answer still validates against the client's schema.
- `auto`: either plain text (which does not start with `<` and never contains `<tool_call>`; the
  response format's grammar instead, when there is one) or calls. `required`: one call, or one
  or more when `parallel_tool_calls`. A named function: exactly one call of it. `none`: the
  tools stay listed in the prompt, and the grammar allows plain text only. The prompt is the
  same under every choice (the grammar alone enforces it), so a conversation that moves from
  `required` to `auto` or `none` keeps its whole prefix in the KV cache.
- Sizes are bounded before llguidance sees anything: the number of tools, names, descriptions,
  each schema and all of them together (the engine compiles grammars of at most
  `MAX_GRAMMAR_CHARS`).
- Every refusal is `invalid_request` with `param` naming the field in the caller's terms.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import structlog

from gateway.chat.response_formats import (
    MAX_GRAMMAR_CHARS,
    NAME_RE,
    TEXT_START,
    check_description,
    check_schema,
    checked_grammar,
    json_rule,
    response_format_grammar,
    schema_text,
    text_format_grammar,
)
from gateway.chat.schema_bounds import JSON_CHARS_PER_TOKEN, bound_schema, longest_chars
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

if TYPE_CHECKING:
    from gateway.chat.events import ResponseOptions

__all__ = (
    "MAX_CALLS",
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
    "apply_tool_plan",
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
MAX_TOOLS_SCHEMA_BYTES = MAX_GRAMMAR_CHARS
MAX_CALLS = 16  # parallel calls in one answer, at most

Choice = Literal["auto", "none", "required", "function"]

# plain text under `auto`: empty, or not starting with `<`, and never holding a call's tag
_PLAIN_TEXT = "TEXT: /(?s:[^<].*)?/ & ~/(?s:.*)<tool_call>(?s:.*)/\n"


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
        check_schema(spec.parameters, spec.strict, f"{param}[{i}].function.parameters")
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
        check_schema(spec.parameters, spec.strict, f"{param}[{i}].parameters")
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
    description = check_description(fields.get("description"), f"{where}.description")
    strict = fields.get("strict")
    if strict is None:
        strict = strict_default
    elif not isinstance(strict, bool):
        raise _refuse(f"{where}.strict", "must be a boolean")
    parameters = _object_schema(fields.get("parameters"), f"{where}.parameters")
    schema_text(parameters, f"{where}.parameters")
    return ToolSpec(name, description, parameters, strict)


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
    total = sum(len(schema_text(spec.parameters, param).encode()) for spec in specs)
    if total > MAX_TOOLS_SCHEMA_BYTES:
        raise _refuse(
            param,
            f"the tools' parameters schemas take {total} bytes; at most "
            f"{MAX_TOOLS_SCHEMA_BYTES} together",
        )


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
    if text_grammar is not None and not text_grammar.startswith(TEXT_START):
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
    grammar = checked_grammar(
        _tools_grammar(offered, choice, parallel, text_grammar, budget),
        "tools",
        "the tools' schemas are not supported together",
    )
    log.debug("tools planned", tools=len(tools), choice=choice, grammar_chars=len(grammar))
    return ToolPlan(tuple(tools), choice, function, parallel, prompt, grammar)


def apply_tool_plan(
    options: ResponseOptions,
    plan: ToolPlan | None,
    *,
    text_grammar: str | None = None,
    tool_results: bool = False,
) -> ResponseOptions:
    """`options` with the response's tool plan applied, the one way every API applies it: the
    plan's grammar, else `text_grammar` (a response format's), else plain text when the
    conversation holds tool results (`tool_results`: no tools now, so answer them in words).
    The plan's prompt is listed under every choice (one prompt, one KV prefix); under "none"
    the grammar keeps the answer plain text, so it is never read for calls. A new value:
    `options` is left as it was."""
    grammar = text_grammar if plan is None else plan.grammar
    if grammar is None and tool_results:
        grammar = plain_text_grammar()
    if plan is None:
        return replace(options, grammar=grammar)
    return replace(options, grammar=grammar, tools_prompt=plan.prompt, tools=plan.choice != "none")


def plain_text_grammar() -> str:
    """Plain text that does not start with `<` and never holds a call's tag. Also for an answer
    after tool results when no tools are offered: a small model otherwise imitates the
    results' markup (`<tool_response>...`) instead of answering."""
    return checked_grammar("start: TEXT\n" + _PLAIN_TEXT, "tools", "the plain-text grammar")


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
        lines.append(f"args_{i}: {json_rule(schema, tool.strict)}")
        overhead = len(CALL_HEAD + tool.name + CALL_SEP + CALL_TAIL + CALL_JOIN)
        longest_call = max(longest_call, overhead + longest_chars(schema, 0))
    if not parallel:
        lines.insert(1, "calls: call")
    elif budget is None:
        lines.insert(1, f"calls: call ({_literal(CALL_JOIN)} call)*")
    else:  # as many calls as fit the budget, one at least: a model repeating a call stops
        more = min(MAX_CALLS, budget * JSON_CHARS_PER_TOKEN // max(longest_call, 1)) - 1
        if more > 0:
            lines.insert(1, f"calls: call ({_literal(CALL_JOIN)} call){{0,{more}}}")
        else:
            lines.insert(1, "calls: call")
    if choice == "auto":
        if text_grammar is None:
            start = "start: TEXT | calls\n" + _PLAIN_TEXT
        else:
            start = "start: answer_text | calls\n" + text_grammar[len(TEXT_START) :]
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
