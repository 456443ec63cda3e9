"""Tools, tool_choice and response formats as grammars and prompts; tool calls read back.

Refusals are checked with their params; every grammar the module builds is validated by
llguidance; the reader's round trips (whole and fed a character at a time, cut anywhere) agree
with `render_answer`. With the real SmolLM2 tokenizer (no model), answers are sampled from
random logits under each grammar's token mask and must parse as the schema, split into the
tools' calls and render back to the same bytes.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

import llguidance
import numpy as np
import pytest

from gateway.chat.events import ResponseOptions
from gateway.chat.output_grammar import (
    MAX_TOOLS,
    ArgumentsPiece,
    CallStart,
    Piece,
    TextPiece,
    ToolCall,
    ToolCallStream,
    apply_tool_plan,
    call_id,
    plain_text_grammar,
    plan_tools,
    render_answer,
    render_tool_call,
    render_tool_result,
    split_answer,
    tools_from_chat,
    tools_from_responses,
)
from gateway.chat.response_formats import (
    MAX_DESCRIPTION_CHARS,
    MAX_GRAMMAR_CHARS,
    MAX_SCHEMA_BYTES,
    response_format_grammar,
    text_format_grammar,
)
from gateway.chat.schema_bounds import bound_schema
from gateway.protocol.errors import ERROR_CODES, GatewayError

RID = "resp_0123"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "unit": {"enum": ["c", "f", "°K"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 1, "maximum": 50},
        "b": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}


def chat_tool(name: str = "get_weather", parameters: Any = WEATHER, **extra: Any) -> dict:
    function = {"name": name, "description": f"{name} does a thing", "parameters": parameters}
    return {"type": "function", "function": {**function, **extra}}


def refused(call: Callable[[], object], param: str, text: str = "") -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        call()
    err = caught.value
    assert (err.code, err.param) == ("invalid_request", param), (err.param, err.message)
    assert ERROR_CODES[err.code][1] == 400
    assert text.lower() in err.message.lower(), err.message
    return err


def valid(grammar: str) -> None:
    assert llguidance.LLMatcher.validate_grammar(grammar) == "", grammar[:300]


# -- refusals ------------------------------------------------------------------------------------

CHAT_REFUSALS: list[tuple[Any, str, str]] = [
    ({"type": "function"}, "tools", "array"),
    ([chat_tool()] * (MAX_TOOLS + 1), "tools", f"at most {MAX_TOOLS}"),
    (["get_weather"], "tools[0]", "object"),
    ([{"type": "retrieval"}], "tools[0].type", "not supported"),
    ([{"function": {"name": "f"}}], "tools[0].type", "not supported"),
    ([{"type": "function", "function": "f"}], "tools[0].function", "object"),
    ([chat_tool("get weather")], "tools[0].function.name", "a-z"),
    ([chat_tool("f" * 65)], "tools[0].function.name", "64"),
    ([chat_tool("f\n")], "tools[0].function.name", "a-z"),
    ([{"type": "function", "function": {"parameters": {}}}], "tools[0].function.name", ""),
    ([chat_tool(description=7)], "tools[0].function.description", "string"),
    (
        [chat_tool(description="d" * (MAX_DESCRIPTION_CHARS + 1))],
        "tools[0].function.description",
        f"at most {MAX_DESCRIPTION_CHARS}",
    ),
    ([chat_tool(strict="yes")], "tools[0].function.strict", "boolean"),
    ([chat_tool(parameters=["city"])], "tools[0].function.parameters", "schema"),
    ([chat_tool(parameters={"type": "array"})], "tools[0].function.parameters.type", "object"),
    (
        [chat_tool(parameters={"type": "object", "description": "x" * MAX_SCHEMA_BYTES})],
        "tools[0].function.parameters",
        f"at most {MAX_SCHEMA_BYTES} bytes",
    ),
    (
        [chat_tool(parameters={"type": "object", "maximum": float("nan")})],
        "tools[0].function.parameters",
        "JSON",
    ),
    (
        [chat_tool(parameters={"type": "object", "properties": {"a": {"type": "strnig"}}})],
        "tools[0].function.parameters",
        "strnig",
    ),
    (
        [chat_tool(parameters={"properties": {"a": {"$ref": "#/$defs/missing"}}})],
        "tools[0].function.parameters",
        "missing",
    ),
    (
        [chat_tool(strict=True, parameters={"properties": {"a": {"format": "colour"}}})],
        "tools[0].function.parameters",
        "colour",
    ),
    ([chat_tool("f"), chat_tool("g"), chat_tool("f")], "tools[2].function.name", "twice"),
    (
        [chat_tool(f"f{i}", {"type": "object", "description": "x" * 40_000}) for i in range(2)],
        "tools",
        "together",
    ),
]


@pytest.mark.parametrize(("tools", "param", "text"), CHAT_REFUSALS)
def test_chat_tools_refusals(tools: Any, param: str, text: str) -> None:
    refused(lambda: tools_from_chat(tools), param, text)


def test_chat_tools_are_read() -> None:
    specs = tools_from_chat([chat_tool(), chat_tool("add", ADD), chat_tool("now", None)])
    assert [s.name for s in specs] == ["get_weather", "add", "now"]
    assert specs[0].parameters == WEATHER and specs[0].strict is False
    assert specs[2].parameters == {"type": "object"}  # no schema: any object
    assert tools_from_chat(None) == [] and tools_from_chat([]) == []
    # a schema without `type` is an object schema all the same
    (spec,) = tools_from_chat([chat_tool(parameters={"properties": {"a": {"type": "integer"}}})])
    assert spec.parameters["type"] == "object"
    # a keyword llguidance does not know is ignored unless the tool is strict
    lax = {"properties": {"a": {"type": "string", "format": "colour"}}}
    assert tools_from_chat([chat_tool(parameters=lax)])[0].strict is False


RESPONSES_REFUSALS: list[tuple[Any, str, str]] = [
    ([{"type": "web_search"}], "tools[0].type", "not supported"),
    ([{"type": "file_search", "vector_store_ids": []}], "tools[0].type", "not supported"),
    ([{"type": "function", "name": "a b"}], "tools[0].name", "a-z"),
    ([{"type": "function", "name": "f", "strict": 1}], "tools[0].strict", "boolean"),
    (
        [{"type": "function", "name": "f", "parameters": {"type": "string"}}],
        "tools[0].parameters.type",
        "object",
    ),
    (
        # strict by default in this API: an unknown format is refused
        [{"type": "function", "name": "f", "parameters": {"properties": {"d": {"format": "x"}}}}],
        "tools[0].parameters",
        "format",
    ),
    ([{"type": "function", "name": "f"}, {"type": "function", "name": "f"}], "tools[1].name", ""),
]


@pytest.mark.parametrize(("tools", "param", "text"), RESPONSES_REFUSALS)
def test_responses_tools_refusals(tools: Any, param: str, text: str) -> None:
    refused(lambda: tools_from_responses(tools, "tools"), param, text)


def test_responses_tools_are_read() -> None:
    (spec,) = tools_from_responses([{"type": "function", "name": "add", "parameters": ADD}])
    assert (spec.name, spec.description, spec.parameters, spec.strict) == ("add", "", ADD, True)
    lax = {"type": "function", "name": "f", "strict": False, "parameters": {"format": "x"}}
    assert tools_from_responses([lax])[0].strict is False


CHOICE_REFUSALS: list[tuple[Any, Any, str, str]] = [
    ([], "required", "tool_choice", "needs tools"),
    ([], {"type": "function", "function": {"name": "get_weather"}}, "tool_choice", "tools"),
    (None, "always", "tool_choice", "'auto'"),
    (None, 3, "tool_choice", "'auto'"),
    (None, {"type": "web_search"}, "tool_choice.type", "not supported"),
    (None, {"type": "allowed_tools", "tools": []}, "tool_choice.type", "not supported"),
    (None, {"type": "function", "function": "get_weather"}, "tool_choice.function", "object"),
    (None, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name", ""),
    (None, {"type": "function", "name": "nope"}, "tool_choice.name", "no tool"),
    (None, {"type": "function"}, "tool_choice.name", "name"),
]


@pytest.mark.parametrize(("tools", "choice", "param", "text"), CHOICE_REFUSALS)
def test_tool_choice_refusals(tools: Any, choice: Any, param: str, text: str) -> None:
    specs = tools_from_chat([chat_tool()]) if tools is None else tools
    refused(lambda: plan_tools(specs, choice, None), param, text)


def test_grammars_stay_within_what_the_engine_compiles() -> None:
    from gateway.chat.response_formats import PARSER_LIMITS
    from gateway.engine.local.grammar import MAX_GRAMMAR_CHARS as ENGINE_MAX
    from gateway.engine.local.grammar import PARSER_LIMITS as ENGINE_LIMITS

    assert MAX_GRAMMAR_CHARS == ENGINE_MAX
    assert PARSER_LIMITS == ENGINE_LIMITS
    # the schema fits, and its own grammar, but not the tools grammar around it
    schema = {"type": "object", "description": "x" * (MAX_GRAMMAR_CHARS - 200)}
    specs = tools_from_chat([chat_tool("big", schema)])
    refused(lambda: plan_tools(specs, "auto", None), "tools", f"at most {MAX_GRAMMAR_CHARS}")
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    assert response_format_grammar(fmt) is not None
    schema["description"] += "x" * 100
    refused(lambda: tools_from_chat([chat_tool("big", schema)]), "tools[0].function.parameters")
    refused(lambda: response_format_grammar(fmt), "response_format.json_schema.schema", "grammar")


def test_parallel_tool_calls_must_be_a_boolean() -> None:
    specs = tools_from_chat([chat_tool()])
    refused(lambda: plan_tools(specs, None, "yes"), "parallel_tool_calls", "boolean")  # type: ignore[arg-type]


FORMAT_REFUSALS: list[tuple[Any, str, str]] = [
    ("json", "response_format", "object"),
    ({"type": "xml"}, "response_format.type", "not supported"),
    ({}, "response_format.type", "not supported"),
    ({"type": "json_schema"}, "response_format.json_schema", "object"),
    (
        {"type": "json_schema", "json_schema": {"schema": {}}},
        "response_format.json_schema.name",
        "",
    ),
    (
        {"type": "json_schema", "json_schema": {"name": "a", "strict": "no"}},
        "response_format.json_schema.strict",
        "boolean",
    ),
    (
        {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}},
        "response_format.json_schema.schema",
        "schema",
    ),
    (
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integr"}}},
        "response_format.json_schema.schema",
        "integr",
    ),
    (
        {"type": "json_schema", "json_schema": {"name": "a", "description": "d" * 5000}},
        "response_format.json_schema.description",
        "at most",
    ),
]


@pytest.mark.parametrize(("fmt", "param", "text"), FORMAT_REFUSALS)
def test_response_format_refusals(fmt: Any, param: str, text: str) -> None:
    refused(lambda: response_format_grammar(fmt), param, text)


def test_text_format_refusals() -> None:
    refused(lambda: text_format_grammar({"type": "grammar"}), "text.format.type", "not supported")
    refused(lambda: text_format_grammar({"type": "json_schema"}), "text.format.name", "")
    bad = {"type": "json_schema", "name": "a", "schema": {"type": "string", "pattern": "(?=x)"}}
    refused(lambda: text_format_grammar(bad), "text.format.schema", "look-around")
    big = {"type": "json_schema", "name": "a", "schema": {"title": "x" * MAX_SCHEMA_BYTES}}
    refused(lambda: text_format_grammar(big), "text.format.schema", "bytes")


# -- grammars and prompts ------------------------------------------------------------------------


def test_format_grammars_validate() -> None:
    assert response_format_grammar(None) is None
    assert response_format_grammar({"type": "text"}) is None
    assert text_format_grammar({"type": "text"}) is None
    valid(response_format_grammar({"type": "json_object"}) or "")
    chat = {"type": "json_schema", "json_schema": {"name": "add", "schema": ADD, "strict": True}}
    flat = {"type": "json_schema", "name": "add", "schema": ADD, "strict": True}
    assert response_format_grammar(chat) == text_format_grammar(flat)
    valid(text_format_grammar(flat) or "")


@pytest.mark.parametrize("parallel", [True, False, None])
@pytest.mark.parametrize("choice", ["auto", "required", "function", "none"])
@pytest.mark.parametrize("fmt", [None, {"type": "json_object"}])
def test_plans_validate(choice: str, parallel: bool | None, fmt: Any) -> None:
    specs = tools_from_chat([chat_tool(), chat_tool("add", ADD), chat_tool("now", None)])
    text_grammar = response_format_grammar(fmt)
    tool_choice: Any = {"type": "function", "function": {"name": "add"}}
    plan = plan_tools(
        specs, tool_choice if choice == "function" else choice, parallel, text_grammar=text_grammar
    )
    assert plan is not None
    assert plan.choice == choice and plan.tools == tuple(specs)
    assert plan.parallel is (parallel is not False)
    assert plan.grammar is not None
    valid(plan.grammar)
    # one prompt for every choice (the grammar alone enforces it): a conversation moving from
    # "required" to "none" keeps its whole prefix in the KV cache
    same = plan_tools(specs, "auto", parallel, text_grammar=text_grammar)
    assert same is not None and plan.prompt == same.prompt
    if choice == "none":
        assert plan.function is None
        if text_grammar is not None:
            assert plan.grammar == text_grammar
        else:  # plain text only: never a call
            assert "<tool_call>" not in plan.grammar.split("\n")[0]
        return
    assert plan.function == ("add" if choice == "function" else None)
    # the listing is the same whatever the choice: prompts of one tool set share a prefix
    assert plan.prompt.startswith("# Tools\n")
    listing = plan.prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["name"] for line in listing] == ["get_weather", "add", "now"]
    assert json.loads(listing[1])["parameters"] == ADD
    assert '<tool_call>\n{"name": "<function-name>", "arguments": ' in plan.prompt
    assert "<tool_response>" in plan.prompt
    if choice == "function":
        assert "args_1" not in plan.grammar and "get_weather" not in plan.grammar


def test_no_tools_no_plan() -> None:
    assert plan_tools([], None, None) is None
    assert plan_tools([], "none", True, text_grammar=response_format_grammar(None)) is None
    # "auto" without tools is plain text, as OpenAI takes it (clients send it by default)
    assert plan_tools([], "auto", None) is None
    assert plan_tools([], "auto", False, text_grammar=response_format_grammar(None)) is None
    specs = tools_from_responses([{"type": "function", "name": "add", "parameters": ADD}])
    chosen = plan_tools(specs, {"type": "function", "name": "add"}, False)
    assert chosen is not None and (chosen.choice, chosen.function) == ("function", "add")


def test_a_plan_is_applied_to_a_responses_options_one_way() -> None:
    """The plan's grammar and prompt go in, and the answer is read for calls unless the choice
    is "none"; without a plan, the response format's grammar, or plain text after tool results.
    The options given are left as they were."""
    specs = tools_from_responses([{"type": "function", "name": "add", "parameters": ADD}])
    text = response_format_grammar({"type": "json_object"}, budget=64)
    given = ResponseOptions(max_output_tokens=64)
    for choice, reads_calls in (("auto", True), ("required", True), ("none", False)):
        plan = plan_tools(specs, choice, None, text_grammar=text, budget=64)
        assert plan is not None
        applied = apply_tool_plan(given, plan, text_grammar=text, tool_results=True)
        assert (applied.grammar, applied.tools_prompt) == (plan.grammar, plan.prompt)
        assert applied.tools is reads_calls
        assert applied.max_output_tokens == 64 and applied.response_id == given.response_id
    assert (given.grammar, given.tools_prompt, given.tools) == (None, None, False)
    formatted = apply_tool_plan(given, None, text_grammar=text, tool_results=True)
    assert (formatted.grammar, formatted.tools_prompt, formatted.tools) == (text, None, False)
    after_results = apply_tool_plan(given, None, tool_results=True)
    assert after_results.grammar == plain_text_grammar() and not after_results.tools
    assert apply_tool_plan(given, None).grammar is None


def test_call_ids_are_deterministic() -> None:
    assert call_id(RID, 0) == call_id(RID, 0)
    assert re.fullmatch(r"call_[0-9a-f]{24}", call_id(RID, 0))
    assert len({call_id(RID, 0), call_id(RID, 1), call_id("resp_other", 0)}) == 3


def test_rendering() -> None:
    assert render_tool_call("add", '{"a": 1}') == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    )
    assert render_tool_result("21") == "<tool_response>\n21\n</tool_response>"


# -- reading answers back ------------------------------------------------------------------------

CALL_A = ToolCall(call_id(RID, 0), "get_weather", '{"city": "paris", "unit": "c"}')
CALL_B = ToolCall(call_id(RID, 1), "add", '{"a": {"x": "}\\"{"}, "b": [1, {"c": []}]}')
ANSWERS = [
    ("", []),
    ("Hello, world.", []),
    ("a < b and <b>bold</b> and <tool_cal", []),
    ("", [CALL_A]),
    ("", [CALL_A, CALL_B]),
    ("Let me check.\n", [CALL_A]),
    ('<tool_call>\n{"name": "x y"} is not a call', []),
]


@pytest.mark.parametrize(("text", "calls"), ANSWERS)
def test_split_answer_round_trips(text: str, calls: list[ToolCall]) -> None:
    answer = render_answer(text, calls)
    assert split_answer(answer, RID) == (text, calls)


def merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent text (or one call's arguments) pieces joined."""
    out: list[Piece] = []
    for piece in pieces:
        last = out[-1] if out else None
        if isinstance(piece, TextPiece) and isinstance(last, TextPiece):
            out[-1] = TextPiece(last.text + piece.text)
        elif (
            isinstance(piece, ArgumentsPiece)
            and isinstance(last, ArgumentsPiece)
            and last.index == piece.index
        ):
            out[-1] = ArgumentsPiece(piece.index, last.text + piece.text)
        else:
            out.append(piece)
    return out


def streamed(chunks: list[str]) -> list[Piece]:
    stream = ToolCallStream(RID)
    pieces = [piece for chunk in chunks for piece in stream.feed(chunk)]
    return pieces + stream.finish()


@pytest.mark.parametrize(("text", "calls"), ANSWERS)
def test_one_character_at_a_time_gives_the_same_pieces(text: str, calls: list[ToolCall]) -> None:
    answer = render_answer(text, calls)
    whole = streamed([answer])
    assert merged(streamed(list(answer))) == merged(whole)
    assert [p for p in whole if isinstance(p, CallStart)] == [
        CallStart(i, c.id, c.name) for i, c in enumerate(calls)
    ]


def test_any_chunking_gives_the_same_pieces() -> None:
    """Answers built of calls, text, look-alike heads and broken calls, cut into random
    chunks: the pieces, joined, are those of the answer fed whole."""
    rng = random.Random(7)
    fragments = [
        render_tool_call("add", '{"a": 1, "b": [2, "}]"]}'),
        "plain text ",
        "\n ",
        "<",
        "<tool_call>",
        '<tool_call>\n{"name": "bad name"}',
        '<tool_call>\n{"name": "add", "arguments": 7}',
        '<tool_call>\n{"name": "add", "arguments": {}}</tool_call>',
        '<tool_call>\n{"name": "add"',
    ]
    for _ in range(300):
        answer = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 6)))
        cuts = sorted(rng.sample(range(len(answer) + 1), min(len(answer) + 1, rng.randint(0, 8))))
        chunks = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)], strict=True)]
        assert merged(streamed(chunks)) == merged(streamed([answer])), answer


def test_text_goes_out_at_once_and_a_possible_head_is_held() -> None:
    stream = ToolCallStream(RID)
    assert stream.feed("Hi ") == [TextPiece("Hi ")]
    assert stream.feed("<tool_c") == []  # could be a call
    assert stream.feed("ar> ") == [TextPiece("<tool_car> ")]
    assert stream.feed("<") == []
    assert stream.finish() == [TextPiece("<")]


def test_a_call_starts_when_its_name_is_known_and_streams_its_arguments() -> None:
    stream = ToolCallStream(RID)
    assert stream.feed('<tool_call>\n{"name": "get_wea') == []
    assert stream.feed('ther", "argu') == [CallStart(0, call_id(RID, 0), "get_weather")]
    assert stream.feed('ments": {"city": ') == [ArgumentsPiece(0, '{"city": ')]
    assert stream.feed('"x"}}\n</tool_call>\n<tool') == [ArgumentsPiece(0, '"x"}')]
    assert stream.feed('_call>\n{"name": "add", "arguments": {}}\n</tool_call>\n\n') == [
        CallStart(1, call_id(RID, 1), "add"),
        ArgumentsPiece(1, "{}"),
    ]
    assert stream.finish() == []  # blank text after the last call is layout


def test_text_after_a_call_and_blank_text_alone_are_text() -> None:
    call = render_tool_call("add", "{}")
    assert split_answer(f"{call}\nDone.", RID)[0] == "\nDone."
    assert split_answer(f"  {call}\n \n{call}  ", RID)[0] == ""
    assert split_answer(" \n", RID) == (" \n", [])
    # a head cut short is what was left of a next call only when nothing but calls came before
    cut = '<tool_call>\n{"name": "ad'
    assert split_answer(f"{call}\n{cut}", RID)[0] == ""
    assert split_answer(f"{call}Done. {cut}", RID)[0] == f"Done. {cut}"
    assert split_answer(cut, RID)[0] == cut


def test_an_unfinished_call_keeps_what_was_read() -> None:
    """Cut anywhere (max_tokens), the calls read so far are prefixes of the whole answer's:
    a call exists once its name is read, its arguments are what arrived, and a head cut
    before the name's end is text."""
    full = render_answer("", [CALL_A, CALL_B])
    head_end = full.index('", "arguments"')
    for cut in range(len(full) + 1):
        text, calls = split_answer(full[:cut], RID)
        expect = [CALL_A, CALL_B][: len(calls)]
        assert [c.name for c in calls] == [c.name for c in expect], cut
        for got, want in zip(calls, expect, strict=True):
            assert want.arguments.startswith(got.arguments), cut
        if cut <= head_end:
            assert (text, calls) == (full[:cut], [])
        else:
            assert text == ""
    text, calls = split_answer(full[: full.index('"c": []')], RID)
    assert calls[1].arguments == '{"a": {"x": "}\\"{"}, "b": [1, {'


def test_feed_after_finish_is_an_error() -> None:
    stream = ToolCallStream(RID)
    stream.finish()
    with pytest.raises(RuntimeError):
        stream.feed("x")


# -- sampling under the grammars with the real tokenizer ----------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> llguidance.LLTokenizer:
    import llguidance.hf
    from transformers import AutoTokenizer

    from tests.vlm_checkpoints import smollm2_dir

    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(smollm2_dir()))


def sample(tok: llguidance.LLTokenizer, grammar: str, seed: int, limit: int = 400) -> str:
    """An answer of random tokens the grammar allows; it must end (EOS in an accepting
    state, or nothing more allowed) within `limit` tokens."""
    matcher = llguidance.LLMatcher(tok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    rng = np.random.default_rng(seed)
    tokens: list[int] = []
    for _ in range(limit):
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: tok.vocab_size].astype(bool)
        logits = np.where(allowed, rng.standard_normal(tok.vocab_size), -np.inf)
        token = int(np.argmax(logits))
        if token in tok.eos_tokens:
            assert matcher.is_accepting()
            return tok.decode_str(tokens)
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    raise AssertionError(f"no end after {limit} tokens: {tok.decode_str(tokens)!r}")


def test_sampled_json_answers_follow_the_schema(tokenizer: llguidance.LLTokenizer) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": True},  # the layout is not the client's to set
    }
    grammar = response_format_grammar(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    )
    assert grammar is not None
    for seed in range(12):
        text = sample(tokenizer, grammar, seed)
        value = json.loads(text)
        assert isinstance(value["name"], str) and isinstance(value["ok"], bool)
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
        assert set(value) <= set(schema["properties"])
        assert text == json.dumps(value, ensure_ascii=False)  # compact, as json.dumps writes


def test_sampled_tool_calls_split_and_render_back(tokenizer: llguidance.LLTokenizer) -> None:
    specs = tools_from_chat([chat_tool(), chat_tool("add", ADD)])
    schemas = {"get_weather": WEATHER, "add": ADD}
    plan = plan_tools(specs, "required", True)
    assert plan is not None and plan.grammar is not None
    counts = []
    for seed in range(12):
        text = sample(tokenizer, plan.grammar, seed)
        said, calls = split_answer(text, f"resp_{seed}")
        assert said == "" and calls, text
        counts.append(len(calls))
        for i, call in enumerate(calls):
            assert call.id == call_id(f"resp_{seed}", i)
            arguments = json.loads(call.arguments)
            assert set(arguments) == set(schemas[call.name]["required"])
            assert call.arguments == json.dumps(arguments, ensure_ascii=False)
        assert render_answer("", calls) == text  # byte-identical: the prefix cache hits
        assert merged(streamed(list(text))) == merged(streamed([text]))
    assert max(counts) > 1  # parallel calls were sampled too


def test_a_single_or_named_call_is_one_call(tokenizer: llguidance.LLTokenizer) -> None:
    specs = tools_from_chat([chat_tool(), chat_tool("add", ADD)])
    single = plan_tools(specs, "required", False)
    named = plan_tools(specs, {"type": "function", "function": {"name": "add"}}, True)
    assert single is not None and single.grammar and named is not None and named.grammar
    for seed in range(6):
        assert len(split_answer(sample(tokenizer, single.grammar, seed), RID)[1]) == 1
        (call,) = split_answer(sample(tokenizer, named.grammar, seed), RID)[1]
        assert call.name == "add"


def accepts(tok: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tok, grammar)
    tokens = tok.tokenize_str(text)
    return matcher.validate_tokens(tokens) == len(tokens) and (
        matcher.consume_tokens(tokens) and matcher.is_accepting()
    )


def test_auto_allows_text_or_calls_only(tokenizer: llguidance.LLTokenizer) -> None:
    specs = tools_from_chat([chat_tool(), chat_tool("add", ADD)])
    plan = plan_tools(specs, "auto", True)
    assert plan is not None and plan.grammar is not None
    call = render_tool_call("add", json.dumps({"a": 3, "b": 4}))
    assert accepts(tokenizer, plan.grammar, "It is sunny.")
    assert accepts(tokenizer, plan.grammar, "Two lines,\nand a < b in <i>HTML</i>.")
    assert accepts(tokenizer, plan.grammar, "")
    assert accepts(tokenizer, plan.grammar, call + "\n" + call)
    kelvin = render_tool_call("get_weather", '{"city": "oslo", "unit": "°K"}')
    assert accepts(tokenizer, plan.grammar, kelvin)
    assert not accepts(tokenizer, plan.grammar, "<b>sunny</b>")  # text does not start with <
    assert not accepts(tokenizer, plan.grammar, "Sure. " + call)  # calls are not in text
    assert not accepts(tokenizer, plan.grammar, call.replace('": ', '":'))  # fixed layout
    assert not accepts(tokenizer, plan.grammar, render_tool_call("add", '{"a": 99, "b": 1}'))
    # with a response format, the text branch is that format
    formatted = plan_tools(
        specs, "auto", False, text_grammar=response_format_grammar({"type": "json_object"})
    )
    assert formatted is not None and formatted.grammar is not None
    assert accepts(tokenizer, formatted.grammar, '{"weather": "sunny"}')
    assert accepts(tokenizer, formatted.grammar, call)
    assert not accepts(tokenizer, formatted.grammar, "It is sunny.")
    assert not accepts(tokenizer, formatted.grammar, call + "\n" + call)  # not parallel


# -- bounds that make JSON answers close ---------------------------------------------------------

# the SDK's own structured-output example: nothing in it is bounded
MATH = {
    "type": "object",
    "properties": {
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"explanation": {"type": "string"}, "output": {"type": "string"}},
                "required": ["explanation", "output"],
                "additionalProperties": False,
            },
        },
        "final_answer": {"type": "string"},
    },
    "required": ["steps", "final_answer"],
    "additionalProperties": False,
}


def test_bounds_narrow_and_never_widen() -> None:
    given = {
        "type": "object",
        "properties": {
            "short": {"type": "string", "maxLength": 3},
            "code": {"type": "string", "pattern": "^[a-z]+$"},
            "pick": {"type": "string", "enum": ["a", "b"]},
            "many": {"type": "array", "items": {"type": "integer"}, "minItems": 40},
            "open": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
        "additionalProperties": {"type": "integer"},
    }
    bounded = bound_schema(given, 64)
    props = bounded["properties"]
    assert props["short"] == given["properties"]["short"]  # the client's own bounds stay
    assert props["code"] == given["properties"]["code"] and props["pick"]["enum"] == ["a", "b"]
    assert props["many"]["maxItems"] == 40  # never below minItems
    assert props["open"]["additionalProperties"] is False  # named properties only
    assert props["open"]["properties"]["x"]["maxLength"] >= 8
    assert bounded["additionalProperties"] == {"type": "integer"}  # the client said
    assert "additionalProperties" not in given["properties"]["open"]  # the client's stays
    # a larger budget gives longer strings and arrays
    small, large = bound_schema(MATH, 32), bound_schema(MATH, 1024)
    steps = [b["properties"]["steps"] for b in (small, large)]
    assert steps[0]["maxItems"] < steps[1]["maxItems"]
    assert (
        steps[0]["items"]["properties"]["output"]["maxLength"]
        < steps[1]["items"]["properties"]["output"]["maxLength"]
    )


@pytest.mark.parametrize("budget", [48, 96, 200])
def test_bounded_json_closes_within_its_budget(
    tokenizer: llguidance.LLTokenizer, budget: int
) -> None:
    """Random tokens under the bounded grammar end (EOS included) within `budget` tokens, and
    each answer is still one of the client's schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "math", "schema": MATH, "strict": True}}
    bounded = response_format_grammar(fmt, budget=budget)
    unbounded = response_format_grammar(fmt)
    assert bounded is not None and unbounded is not None
    for seed in range(6):
        text = sample(tokenizer, bounded, seed, limit=budget - 1)
        value = json.loads(text)
        assert set(value) == {"steps", "final_answer"} and isinstance(value["final_answer"], str)
        assert all(set(step) == {"explanation", "output"} for step in value["steps"])
        assert accepts(tokenizer, unbounded, text)
    with pytest.raises(AssertionError, match="no end"):  # unbounded, it runs on
        sample(tokenizer, unbounded, 0, limit=64)


def test_bounded_json_object_and_calls_close(tokenizer: llguidance.LLTokenizer) -> None:
    anything = response_format_grammar({"type": "json_object"}, budget=40)
    assert anything is not None
    specs = tools_from_chat([chat_tool("note", {"type": "object", "properties": {}})])
    free = tools_from_chat([chat_tool("save", {"type": "object"})])
    for seed in range(6):
        assert isinstance(json.loads(sample(tokenizer, anything, seed, limit=39)), dict)
        for tools in (specs, free):
            plan = plan_tools(tools, "required", True, budget=48)
            assert plan is not None and plan.grammar is not None
            _, calls = split_answer(sample(tokenizer, plan.grammar, seed, limit=47), RID)
            assert calls and all(isinstance(json.loads(c.arguments), dict) for c in calls)
