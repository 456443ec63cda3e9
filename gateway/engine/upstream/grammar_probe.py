"""Whether a replica applies the gateway's output grammars, asked once before it gets one.

Tools and response formats reach a replica as one llguidance grammar (Lark, JSON schemas as
`%json` with the output's layout fixed by `x-guidance`) in vLLM's `structured_outputs.grammar`
(`gateway.engine.upstream.upstream_bodies`). Not every replica applies it as written:

- vLLM with the llguidance backend (`--structured-outputs-config '{"backend": "guidance"}'`)
  does;
- vLLM with its default "auto" backend hands Lark grammars to xgrammar, which fails on
  llguidance's terminal operators (`&`, `~`: an internal error, HTTP 500, on every such request)
  and reads `%json` with its own whitespace rules (the layout the gateway fixed is lost);
- other servers (SGLang, TensorRT-LLM) ignore the field and generate freely.

So before a replica's first constrained request the engine sends it `PROBE`: a 4-token request
whose grammar allows exactly one answer through a terminal intersection. A replica that answers
exactly `PROBE_ANSWER` applies the grammars ("yes"); one that answers anything else, or fails
the request with a 4xx or a 500, does not ("no"), and constrained requests go to the others
(refused with `invalid_request` when none does). A transport failure or 502-504 says nothing
("unknown": asked again next time). The answer is kept per replica for the engine's life.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Literal

import httpx

from gateway.engine.upstream.wire import error_of

if TYPE_CHECKING:
    from gateway.engine.upstream.routing import Replica

__all__ = ("PROBE_ANSWER", "PROBE_GRAMMAR", "GrammarSupport", "probe_grammar")

GrammarSupport = Literal["yes", "no", "unknown"]

PROBE_ANSWER = "ok"
# lowercase letters that are also exactly "ok": one answer, reached through an intersection
# (llguidance's, which xgrammar refuses)
PROBE_GRAMMAR = "start: WORD\nWORD: /[a-z]+/ & /ok/\n"
PROBE_MAX_TOKENS = 4


async def probe_grammar(
    client: httpx.AsyncClient,
    replica: Replica,
    model: str,
    headers: dict[str, str],
    limits: httpx.Timeout,
) -> tuple[GrammarSupport, str]:
    """Ask `replica` to answer under `PROBE_GRAMMAR`: (support, why) (see the module doc)."""
    body = {
        "model": model,
        "prompt": "Say ok.",
        "max_tokens": PROBE_MAX_TOKENS,
        "temperature": 0,
        "structured_outputs": {"grammar": PROBE_GRAMMAR},
    }
    try:
        response = await client.post(
            f"{replica.upstream.base_url}/v1/completions",
            content=json.dumps(body).encode(),
            headers={**headers, "content-type": "application/json"},
            timeout=limits,
        )
    except httpx.HTTPError as exc:
        return "unknown", type(exc).__name__
    if response.status_code in (502, 503, 504, 429, 408):
        return "unknown", f"HTTP {response.status_code}"
    if response.status_code != 200:
        _, message = error_of(response.content)
        return "no", f"HTTP {response.status_code}: {message[:200]}"
    try:
        text = response.json()["choices"][0]["text"]
    except (ValueError, LookupError, TypeError):
        return "no", "an answer without choices[0].text"
    if text != PROBE_ANSWER:
        return "no", f"answered {text[:40]!r} where the grammar allows only {PROBE_ANSWER!r}"
    return "yes", ""
