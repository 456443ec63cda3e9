"""Routes of the admin API, `/v1/admin`: thin handlers over `AdminServing`.

Every answer that is not a success is the OpenAI-shaped error object with a stable code, what
routing or body limits refuse included (a create body over `protocol.MAX_BODY` is
`request_too_large`, 413). Registered only when `admin_api_key` is set. Wrong admin keys are
counted per client, on every replica (`lockout.make_lockout`): past a few in a row,
`auth_locked_out` (429).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
from litestar import Request, Response, Router, delete, get, post

from gateway.api.admin import protocol as p
from gateway.api.admin.lockout import client_of, make_lockout
from gateway.api.admin.serving import AdminServing
from gateway.api.http.error_replies import error_handler
from gateway.policy.auth import key_of
from gateway.policy.client_secrets import is_ephemeral
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.server.state import GatewayState

__all__ = ("admin_route_handlers",)

log = structlog.get_logger("visiongate.admin")

NO_STORE = {"Cache-Control": "no-store"}


def admin_route_handlers(state: GatewayState) -> list[Any]:
    """The `/v1/admin` router, or nothing when the gateway has no admin key or key store."""
    settings, store = state.settings, state.auth.store
    if not settings.admin_api_key or store is None:
        return []
    from gateway.telemetry import register_secrets

    register_secrets([settings.admin_api_key])
    admin = AdminServing(settings.admin_api_key, state.auth, store)
    lockout = state.admin_lockout = make_lockout(settings.redis_url)

    async def check_admin(request: Request) -> None:
        client = client_of(request.client.host if request.client is not None else "")
        key = key_of(request.headers)
        presented = bool(key)
        if not presented:  # guesses nothing: only checked
            await lockout.check(client)
        else:  # counted before it is compared
            await lockout.attempt(client)
        try:
            await admin.check_admin(request.headers)
        except GatewayError as exc:
            # a valid API key is no guess; a key shaped like an ephemeral one (refused
            # permission_denied, valid or not: anyone may get one from the playground) is
            if presented and exc.code != "unauthorized" and not is_ephemeral(key):
                await lockout.forgive(client)
            raise
        if presented:
            await lockout.succeeded(client)

    @post("/keys", status_code=201, request_max_body_size=p.MAX_BODY)
    async def create_key(request: Request) -> Response[p.CreatedKey]:
        await check_admin(request)
        created = await admin.create(await request.body())
        return Response(created, status_code=201, headers=NO_STORE)

    @get("/keys")
    async def list_keys(request: Request) -> p.KeyList:
        await check_admin(request)
        return await admin.list(request.query_params)

    @get("/keys/{key_id:str}")
    async def get_key(request: Request, key_id: str) -> p.KeyView:
        await check_admin(request)
        return await admin.get(key_id)

    @delete("/keys/{key_id:str}", status_code=200)
    async def revoke_key(request: Request, key_id: str) -> p.KeyView:
        await check_admin(request)
        return await admin.revoke(key_id)

    @get("/usage")
    async def list_usage(request: Request) -> p.UsageList:
        await check_admin(request)
        return await admin.usage(request.query_params)

    return [
        Router(
            path="/v1/admin",
            tags=["Admin"],
            route_handlers=[create_key, list_keys, get_key, revoke_key, list_usage],
            exception_handlers={Exception: error_handler(state, api="admin")},
        )
    ]
