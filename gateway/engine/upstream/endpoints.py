"""How an upstream replica is named in settings: `URL[#model=NAME&api_key_env=VAR]`.

The fragment never reaches the network (an HTTP client does not send it), so per-upstream
options ride on the URL without leaking: `model` is the model name sent to that replica,
`api_key_env` the environment variable holding its API key (the key itself is never in a flag,
a setting or a log line).
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ("Upstream", "parse_upstream", "parse_upstreams")

_OPTIONS = ("model", "api_key_env")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


@dataclass(frozen=True, slots=True)
class Upstream:
    """One OpenAI-compatible replica."""

    base_url: str  # scheme://host[:port][/prefix], without a trailing /v1: requests go to /v1/...
    model: str | None = None  # the model name to send; None: the replica's first /v1/models entry
    api_key: str | None = field(default=None, repr=False)  # sent as a Bearer token
    name: str = ""  # host:port: what metrics, spans and logs call it (never the key)


def parse_upstream(spec: str, environ: Mapping[str, str] | None = None) -> Upstream:
    """One `URL[#model=NAME&api_key_env=VAR]`; ValueError naming what is wrong."""
    environ = os.environ if environ is None else environ
    url, _, fragment = spec.strip().partition("#")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"upstream {url!r}: expected http(s)://host[:port][/path]")
    if parts.username or parts.password:
        raise ValueError(
            f"upstream {parts.hostname}: put the API key in an environment variable and name it "
            "with #api_key_env=VAR, not in the URL"
        )
    if parts.query:
        raise ValueError(f"upstream {parts.hostname}: a query string is not allowed")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"upstream {url!r}: bad port") from None
    options = dict(urllib.parse.parse_qsl(fragment, keep_blank_values=True)) if fragment else {}
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(
            f"upstream {parts.hostname}: unknown option(s) {', '.join(unknown)} "
            f"(known: {', '.join(_OPTIONS)})"
        )
    api_key = None
    env = options.get("api_key_env")
    if env is not None:
        if not _ENV_NAME.fullmatch(env):
            raise ValueError(f"upstream {parts.hostname}: api_key_env must name a variable")
        api_key = environ.get(env)
        if not api_key:
            raise ValueError(f"upstream {parts.hostname}: ${env} is not set")
    path = parts.path.rstrip("/")
    path = path.removesuffix("/v1")
    default_port = 443 if parts.scheme == "https" else 80
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    base = f"{parts.scheme}://{host}:{port or default_port}{path}"
    return Upstream(
        base_url=base,
        model=options.get("model") or None,
        api_key=api_key,
        name=f"{host}:{port or default_port}",
    )


def parse_upstreams(specs: list[str], environ: Mapping[str, str] | None = None) -> list[Upstream]:
    """Every entry of a list (each may itself hold several, comma-separated); ValueError when
    one is bad, empty, or named twice."""
    out: list[Upstream] = []
    for spec in specs:
        out.extend(parse_upstream(s, environ) for s in spec.split(",") if s.strip())
    if not out:
        raise ValueError("at least one upstream URL is needed")
    names = [u.base_url for u in out]
    if len(set(names)) != len(names):
        raise ValueError("an upstream is listed twice")
    return out
