"""`visiongate client-secret`: mint an ephemeral Realtime key (`ek_...`) for a browser or a
script, through a gateway's `POST /v1/realtime/client_secrets`.

The parent key (static or managed) comes from the environment variable `VISIONGATE_API_KEY`
(never a flag: flags end up in shell history and `ps`); the ephemeral key it prints is bound
to that key's limits and models, works only on `/v1/realtime`, and expires after
`--expires-in-s` (the gateway's default when not given). `--session` takes the session
settings as JSON (`{"instructions": "..."}`), checked when minted. Prints the API's JSON
answer, or with `--value-only` the key alone; exits 1 with the error object on stderr when the
gateway refuses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ("register",)

ENV = "VISIONGATE_API_KEY"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "client-secret",
        help="mint an ephemeral Realtime key (ek_...) with the key in VISIONGATE_API_KEY",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    p.add_argument("--expires-in-s", type=int, help="lifetime in seconds (gateway's default)")
    p.add_argument("--session", help='session settings as JSON, e.g. {"instructions": "..."}')
    p.add_argument("--value-only", action="store_true", help="print only the ek_ key")
    p.set_defaults(func=cmd_client_secret)


def _fail(message: str, code: str | None = None) -> int:
    print(json.dumps({"error": {"message": message, "code": code}}), file=sys.stderr)
    return 1


def cmd_client_secret(args: argparse.Namespace) -> int:
    import httpx

    parent = os.environ.get(ENV, "").strip()  # a key file's line ending is not the key's
    if not parent:
        print(f"set {ENV} to the API key the ephemeral key is minted with", file=sys.stderr)
        return 2
    if not (parent.isascii() and parent.isprintable()):
        # never echoed: an error that quoted the header would print the key
        return _fail(f"{ENV} holds characters no API key has", "invalid_request")
    body: dict[str, Any] = {}
    if args.expires_in_s is not None:
        body["expires_after"] = {"anchor": "created_at", "seconds": args.expires_in_s}
    if args.session is not None:
        try:
            body["session"] = json.loads(args.session)
        except ValueError as exc:
            return _fail(f"--session is not JSON: {exc}", "invalid_request")
    url = args.url.rstrip("/") + "/v1/realtime/client_secrets"
    try:
        r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {parent}"}, timeout=30)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        # the exception's text may quote the request's headers: only its kind is shown
        return _fail(f"{type(exc).__name__} reaching {args.url}")
    try:
        answer = r.json()
    except ValueError:
        answer = {"error": {"message": f"HTTP {r.status_code}", "code": None}}
    if not r.is_success or not isinstance(answer, dict) or "value" not in answer:
        print(json.dumps(answer, indent=2), file=sys.stderr)
        return 1
    print(answer["value"] if args.value_only else json.dumps(answer, indent=2))
    return 0
