"""Response formats as grammars: `response_format` (Chat Completions) and `text.format`
(Responses), and the JSON-schema grammar pieces the tools grammar is built from too.

A format's grammar is `start: answer_text` then rules defining `answer_text` (`TEXT_START`), so
that `gateway.chat.output_grammar.plan_tools` can offer it as the text branch beside tool
calls. A JSON schema is embedded as llguidance's `%json {...}` with its output compact (`", "`
and `": "`, as Python's `json.dumps` writes it); a strict schema's unsupported keywords are
refused, a lax one's ignored. Given the answer's token budget, what the schema leaves unbounded
is narrowed to fit it (`gateway.chat.schema_bounds`).

Sizes are bounded before llguidance sees anything: each schema (`MAX_SCHEMA_BYTES`) and the
grammar (`MAX_GRAMMAR_CHARS`, what the engine compiles), and a grammar is validated under the
engine's own parser limits, so what passes here compiles there. Validations are remembered by
digest, since clients resend the same schemas. Every refusal is `invalid_request` with `param`
naming the field in the caller's terms.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict

import llguidance

from gateway.chat.schema_bounds import bound_schema
from gateway.protocol.errors import GatewayError, clip

__all__ = (
    "MAX_DESCRIPTION_CHARS",
    "MAX_GRAMMAR_CHARS",
    "MAX_SCHEMA_BYTES",
    "NAME_RE",
    "PARSER_LIMITS",
    "TEXT_START",
    "check_description",
    "check_schema",
    "checked_grammar",
    "json_rule",
    "response_format_grammar",
    "schema_text",
    "text_format_grammar",
)

MAX_SCHEMA_BYTES = 64 * 1024  # a schema's JSON text
# the largest grammar the engine compiles (gateway.engine.local.grammar.MAX_GRAMMAR_CHARS; not
# imported: this module stays free of torch); a tools grammar holds every schema, hence the
# bound on them all
MAX_GRAMMAR_CHARS = 64 * 1024
# the engine's bounds on one matcher (gateway.engine.local.grammar.PARSER_LIMITS, not imported
# for the same reason): a grammar is validated under them, so what passes here compiles there
PARSER_LIMITS = {
    "max_lexer_states": 50_000,
    "step_lexer_fuel": 100_000,
    "initial_lexer_fuel": 1_000_000,
    "step_max_items": 50_000,
}
MAX_DESCRIPTION_CHARS = 4096
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")

# A response format's grammar: this first line, then rules defining `answer_text`, so that
# `plan_tools` can offer it as the text branch beside the calls.
TEXT_START = "start: answer_text\n"
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _refuse(param: str, message: str) -> GatewayError:
    return GatewayError("invalid_request", message, param=param)


def _shown(value: object) -> str:
    return repr(clip(value, 40) if isinstance(value, str) else value)


def check_description(value: object, param: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _refuse(param, "must be a string")
    if len(value) > MAX_DESCRIPTION_CHARS:
        raise _refuse(param, f"at most {MAX_DESCRIPTION_CHARS} characters, got {len(value)}")
    return value


def schema_text(schema: dict, param: str) -> str:
    """The schema's JSON text, bounded; what the grammar embeds and the prompt shows."""
    try:
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        raise _refuse(param, "must be a JSON schema (plain JSON values)") from None
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise _refuse(param, f"at most {MAX_SCHEMA_BYTES} bytes of JSON")
    return text


def json_rule(schema: dict, strict: bool, budget: int | None = None) -> str:
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


def check_schema(schema: dict, strict: bool, param: str) -> None:
    checked_grammar(f"start: value\nvalue: {json_rule(schema, strict)}\n", param)


def checked_grammar(grammar: str, param: str, what: str = "the schema is not supported") -> str:
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
    schema_text(schema, param)
    rule = json_rule(schema, strict, budget)
    return checked_grammar(f"{TEXT_START}answer_text: {rule}\n", param)


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
    return f"{TEXT_START}answer_text: {json_rule({'type': 'object'}, True, budget)}\n"


def _schema_format(spec: dict, param: str, budget: int | None) -> str:
    name = spec.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise _refuse(f"{param}.name", "must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
    check_description(spec.get("description"), f"{param}.description")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _refuse(f"{param}.strict", "must be a boolean")
    schema = spec.get("schema")
    if schema is None:
        schema = {"type": "object"}
    elif not isinstance(schema, dict):
        raise _refuse(f"{param}.schema", "must be a JSON schema object")
    return _format_grammar(schema, bool(strict), f"{param}.schema", budget)
