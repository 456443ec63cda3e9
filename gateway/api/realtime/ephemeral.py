"""Ephemeral Realtime keys over HTTP: `POST /v1/realtime/client_secrets` and the playground's
`POST /playground/session`.

`POST /v1/realtime/client_secrets` takes the GA OpenAI API's body,
`{"expires_after": {"anchor": "created_at", "seconds": N}, "session": {...}}` (both optional;
`seconds` from `MIN_TTL_S` to the `client_secret_max_ttl_s` setting, default `DEFAULT_TTL_S`),
authenticated by a real key (static or managed; an ephemeral key may not mint another:
`permission_denied`), and answers `{"value": "ek_...", "expires_at": <unix s>, "session":
{...}}` with `Cache-Control: no-store`. The session settings are checked here with the request
layer's checks that `session.update` runs, so a bad one is refused when minted, not when the
browser connects; the connection applies them once its session is open. A mint counts as one
request of the parent key's rate limit.

`POST /playground/session` is how the playground page gets its key. With `playground_api_key`
set it mints, with that key, an ephemeral key of the default lifetime and no session settings,
for whoever loads the page (the operator's choice: the page is then as open as the gateway's
address, bounded by that key's limits and models). Without it, it answers 204 (no content): the
gateway mints nothing for the page, which then takes a pasted ephemeral key or, on a gateway
without keys, connects with none. A request from another origin (an `Origin` header naming
another host) is refused with `permission_denied`, so other sites cannot spend the key from
their visitors' browsers.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import msgspec
import structlog
from litestar import Request, Response, Router, post

from gateway.api.http.error_replies import error_handler
from gateway.api.realtime import protocol as rt
from gateway.api.realtime.items import plan_realtime_tools
from gateway.chat.requests import (
    RequestLimits,
    check_instructions,
    check_max_tokens,
    check_model,
    check_output_modalities,
    check_sampling,
)
from gateway.policy.client_secrets import (
    DEFAULT_TTL_S,
    MIN_TTL_S,
    ClientSecret,
    new_client_secret,
    secret_digest,
)
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.server.state import GatewayState

__all__ = ("ClientSecretCreated", "ClientSecretRequest", "ephemeral_routes")

log = structlog.get_logger("visiongate.realtime")

NO_STORE = {"Cache-Control": "no-store"}
KiB = 1024


class ExpiresAfter(msgspec.Struct, forbid_unknown_fields=True):
    anchor: Literal["created_at"] = "created_at"
    seconds: int = DEFAULT_TTL_S


class ClientSecretRequest(msgspec.Struct, forbid_unknown_fields=True):
    expires_after: ExpiresAfter | None = None
    session: rt.SessionConfig | None = None


class ClientSecretCreated(msgspec.Struct):
    value: str  # the ephemeral key: shown here once, stored as its digest
    expires_at: int  # unix seconds
    session: dict[str, Any]


_decode_request = msgspec.json.Decoder(ClientSecretRequest).decode
_encode_json = msgspec.json.Encoder().encode


def check_session_config(cfg: rt.SessionConfig, state: GatewayState) -> None:
    """What `session.update` checks before it applies anything, without a session."""
    limits = RequestLimits.of(state.settings)
    check_model(cfg.model, state.engine.model_id, "session.model")
    check_sampling(cfg.temperature, cfg.top_p, cfg.seed, where="session.")
    check_output_modalities(cfg.output_modalities, "session.output_modalities")
    check_max_tokens(
        cfg.max_output_tokens,
        limits.max_output_tokens_limit,
        "session.max_output_tokens",
        allow_inf=True,
    )
    check_instructions(cfg.instructions, limits, "session.instructions")
    plan_realtime_tools(
        cfg.tools,
        cfg.tool_choice,
        cfg.parallel_tool_calls,
        tools_param="session.tools",
        choice_param="session.tool_choice",
    )


def _decode(body: bytes) -> ClientSecretRequest:
    if not body.strip():
        return ClientSecretRequest()
    try:
        return _decode_request(body)
    except msgspec.ValidationError as exc:
        raise GatewayError("invalid_request", str(exc)) from None
    except msgspec.DecodeError:
        raise GatewayError("invalid_json", "the body is not a JSON object") from None


async def _mint(
    state: GatewayState, req: ClientSecretRequest, headers: dict[str, str]
) -> ClientSecretCreated:
    store = state.auth.client_secrets
    if store is None:  # a gateway built without one (never by create_app)
        raise GatewayError("invalid_request", "ephemeral keys are not enabled on this gateway")
    owner, kind, parent_id = state.auth.parent_of(headers)
    seconds = DEFAULT_TTL_S if req.expires_after is None else req.expires_after.seconds
    longest = state.settings.client_secret_max_ttl_s
    if not MIN_TTL_S <= seconds <= longest:
        raise GatewayError(
            "invalid_request",
            f"expires_after.seconds must be {MIN_TTL_S}..{longest}",
            param="expires_after.seconds",
        )
    cfg = req.session
    if cfg is not None:
        check_session_config(cfg, state)
    await state.rate_limiter.acquire(owner)  # a mint is one request of the parent's
    now = time.time()
    expires_at = int(now) + seconds
    value = new_client_secret()
    record = ClientSecret(
        owner=owner,
        parent_kind=kind,
        parent_id=parent_id,
        created_at=now,
        expires_at=float(expires_at),
        session=b"" if cfg is None else _encode_json(cfg),
    )
    await store.put(secret_digest(value), record)
    log.info("client_secret_created", owner=owner, expires_in_s=seconds)
    shown: dict[str, Any] = msgspec.to_builtins(cfg) if cfg is not None else {}
    shown.update(type="realtime", object="realtime.session", model=state.engine.model_id)
    return ClientSecretCreated(value=value, expires_at=expires_at, session=shown)


def _same_origin(request: Request) -> bool:
    origin = request.headers.get("origin")
    if origin is None:  # not a browser's cross-site request
        return True
    return urlsplit(origin).netloc.lower() == request.headers.get("host", "").lower()


def ephemeral_routes(state: GatewayState) -> Router:
    """The two minting routes (the playground's only when `playground_api_key` is set)."""
    settings = state.settings
    limits = RequestLimits.of(settings)
    # the largest legal body: instructions of max_text_chars (4 bytes each in the worst JSON
    # escaping) and room for tools
    max_body = min(limits.max_text_chars * 6 + 256 * KiB, 8 * 1024 * KiB)

    @post(
        "/v1/realtime/client_secrets",
        status_code=200,
        request_max_body_size=max_body,
        summary="Mint an ephemeral key for the Realtime WebSocket (OpenAI GA shape)",
    )
    async def create_client_secret(request: Request) -> Response[ClientSecretCreated]:
        created = await _mint(state, _decode(await request.body()), dict(request.headers))
        return Response(created, status_code=200, headers=NO_STORE)

    playground_key = settings.playground_api_key
    key_headers = {"authorization": f"Bearer {playground_key}"}
    if playground_key:
        from gateway.telemetry import register_secrets

        register_secrets([playground_key])

    @post(
        "/playground/session",
        status_code=200,
        request_max_body_size=KiB,
        include_in_schema=False,
    )
    async def playground_session(request: Request) -> Response[ClientSecretCreated | None]:
        if not _same_origin(request):
            raise GatewayError("permission_denied", "the playground mints for its own page")
        if not playground_key:  # nothing minted for the page here
            return Response(None, status_code=204, headers=NO_STORE)
        await state.auth.prefetch(key_headers)  # a managed key's record, for owner()
        created = await _mint(state, ClientSecretRequest(), key_headers)
        return Response(created, status_code=200, headers=NO_STORE)

    handlers: list[Any] = [create_client_secret, playground_session]

    return Router(
        path="/",
        tags=["Realtime"],
        route_handlers=handlers,
        exception_handlers={Exception: error_handler(state, api="client_secrets")},
    )
