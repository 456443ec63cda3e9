"""JSON schemas narrowed to fit an answer's token budget, and the longest text they allow.

A small model asked for JSON may loop inside a string or an array until `max_tokens` cuts it
(the SDK's `.parse()` then raises). So a grammar built from a client's schema narrows it, never
widening it: every answer the narrowed schema allows still validates against the client's
schema, and its longest answer fits the token budget. Strings without `maxLength` (nor enum,
const, pattern or format) get one, arrays without `maxItems` get one, objects with `properties`
and no word on others take no others, and free objects (no `properties`) take at most a few
keys of at most 32 identifier characters, holding scalars or lists of them.

Pure functions on plain JSON values: no llguidance, no I/O. A malformed keyword is left as it
is, for the grammar compiler to refuse (`gateway.chat.response_formats`).
"""

from __future__ import annotations

import json

__all__ = ("BOUNDS", "JSON_CHARS_PER_TOKEN", "bound_schema", "longest_chars")

# What a token of JSON text holds, taken low: the bounds are sized by it. JSON's quotes, braces
# and short keys tokenize denser than prose (`gateway.engine.interface.CHARS_PER_TOKEN`).
JSON_CHARS_PER_TOKEN = 2
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
    chars = budget * JSON_CHARS_PER_TOKEN
    for length, items in BOUNDS:
        bounded = _bound(schema, length, items)
        if longest_chars(bounded, length) <= chars:
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


def longest_chars(node: object, length: int) -> int:
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
        return max(longest_chars(b, length) for b in branches)
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
        sizes = [longest_chars(p, length) + 2 for p in prefix[:count]]
        total = 2 + sum(sizes)
        if isinstance(item, dict) or item is None:
            total += (longest_chars(item or {}, length) + 2) * max(0, count - len(prefix))
        return total
    if kind == "object":
        total = 2
        properties = node.get("properties")
        for name, sub in (properties if isinstance(properties, dict) else {}).items():
            total += len(json.dumps(name)) + 4 + longest_chars(sub, length)
        extra = node.get("patternProperties")
        extra = extra if isinstance(extra, dict) else {}
        for sub in extra.values():
            total += _count(node, "maxProperties", _UNBOUNDED) * (38 + longest_chars(sub, length))
        if node.get("additionalProperties", True) is not False and not extra:
            total += _UNBOUNDED
        return total
    return _UNBOUNDED
