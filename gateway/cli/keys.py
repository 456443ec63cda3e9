"""`visiongate keys create|list|revoke|usage`: managed API keys through a gateway's admin API.

Talks HTTP to `--url` (default http://127.0.0.1:8000) with the admin key from the environment
variable `VISIONGATE_ADMIN_API_KEY` (never a flag: flags end up in shell history and `ps`).
Prints the API's JSON answer; exits 1 with the error object on stderr when the gateway refuses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ("register",)

ENV = "VISIONGATE_ADMIN_API_KEY"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="create, list and revoke managed API keys (admin API)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    c = verbs.add_parser("create", help="make a key; its secret is printed once")
    c.add_argument("--name", required=True)
    c.add_argument("--owner", default="")
    c.add_argument("--expires-in-s", type=float)
    c.add_argument("--model", dest="models", action="append", help="allowed model (repeatable)")
    c.add_argument("--rpm", type=int)
    c.add_argument("--input-tpm", type=int)
    c.add_argument("--output-tpm", type=int)
    c.add_argument("--budget-tokens", type=int)
    c.add_argument("--budget-period", choices=("day", "month"))
    c.add_argument("--max-concurrent", type=int, help="responses in flight at once (0: no cap)")
    ls = verbs.add_parser("list", help="one page of keys, oldest first")
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument("--after", help="the last id of the previous page")
    r = verbs.add_parser("revoke", help="revoke a key by id")
    r.add_argument("id")
    u = verbs.add_parser("usage", help="one page of keys' usage: totals, or UTC days")
    u.add_argument("--limit", type=int, default=50)
    u.add_argument("--after", help="the last id of the previous page")
    u.add_argument("--start", help="first UTC day counted, YYYY-MM-DD (default: totals)")
    u.add_argument("--end", help="last UTC day counted, YYYY-MM-DD (default: today)")
    p.set_defaults(func=cmd_keys)


def cmd_keys(args: argparse.Namespace) -> int:
    import httpx

    admin = os.environ.get(ENV, "")
    if not admin:
        print(f"set {ENV} to the gateway's admin key", file=sys.stderr)
        return 2
    base = args.url.rstrip("/") + "/v1/admin/keys"
    usage = args.url.rstrip("/") + "/v1/admin/usage"
    headers = {"Authorization": f"Bearer {admin}"}
    try:
        if args.verb == "create":
            fields = (
                "name", "owner", "expires_in_s", "models", "rpm",
                "input_tpm", "output_tpm", "budget_tokens", "budget_period", "max_concurrent",
            )  # fmt: skip
            body: dict[str, Any] = {f: getattr(args, f) for f in fields}
            body = {k: v for k, v in body.items() if v is not None}
            r = httpx.post(base, json=body, headers=headers, timeout=30)
        elif args.verb in ("list", "usage"):
            params = {"limit": str(args.limit), **({"after": args.after} if args.after else {})}
            if args.verb == "usage":
                params |= {k: v for k in ("start", "end") if (v := getattr(args, k))}
            url = base if args.verb == "list" else usage
            r = httpx.get(url, params=params, headers=headers, timeout=30)
        else:
            r = httpx.delete(f"{base}/{args.id}", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        print(json.dumps({"error": {"message": f"{type(exc).__name__}: {exc}"}}), file=sys.stderr)
        return 1
    try:
        answer = r.json()
    except ValueError:
        answer = {"error": {"message": f"HTTP {r.status_code}", "code": None}}
    ok = r.is_success
    print(json.dumps(answer, indent=2), file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
