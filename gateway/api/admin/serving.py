"""The admin API's serving layer: who may call it, what a body may say, and the key store calls.

Only `Authorization: Bearer <admin_api_key>` passes (compared in constant time). No key, or a
key that is neither the admin key nor a valid API key, is `unauthorized` (401); a valid API key
(static or managed) is `permission_denied` (403). Ids that are not `key_` and 24 hex digits are
answered `api_key_not_found` (404) without a store read, as unknown ones are. A created key's
secret is in the one answer to its create; nothing here logs a secret.
"""

from __future__ import annotations

import datetime as dt
import hmac
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec
import structlog

from gateway.api.admin import protocol as p
from gateway.policy.auth import key_of
from gateway.policy.key_store import KEY_ID, KeyRecord, new_key_id, new_secret, secret_digest
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.policy.auth import Authenticator
    from gateway.policy.key_store import KeyStore

__all__ = ("AdminServing",)

log = structlog.get_logger("visiongate.admin")

_decode_create = msgspec.json.Decoder(p.CreateKeyRequest).decode


def _not_found() -> GatewayError:
    return GatewayError("api_key_not_found", "no API key has this id", param="id")


class AdminServing:
    __slots__ = ("_admin", "auth", "store")

    def __init__(self, admin_key: str, auth: Authenticator, store: KeyStore) -> None:
        self._admin = admin_key.encode()
        self.auth = auth
        self.store = store

    async def check_admin(self, headers: Mapping[str, str]) -> None:
        key = key_of(headers)
        if not key:
            raise GatewayError("unauthorized", "the admin API needs the admin key")
        if hmac.compare_digest(key.encode("utf-8", "surrogatepass"), self._admin):
            return
        try:
            await self.auth.resolve({"authorization": f"Bearer {key}"})
        except GatewayError as exc:
            if exc.code in ("busy", "permission_denied"):  # down; or valid but not for this
                raise
            raise GatewayError("unauthorized", "the admin API needs the admin key") from None
        raise GatewayError("permission_denied", "this key may not use the admin API")

    async def create(self, body: bytes) -> p.CreatedKey:
        try:
            req = _decode_create(body)
        except msgspec.ValidationError as exc:
            raise GatewayError("invalid_request", str(exc)) from None
        except msgspec.DecodeError:
            raise GatewayError("invalid_json", "the body is not a JSON object") from None
        now = time.time()
        if req.expires_at is not None and req.expires_in_s is not None:
            raise GatewayError(
                "invalid_request", "give expires_at or expires_in_s, not both", param="expires_at"
            )
        expires = req.expires_at if req.expires_in_s is None else now + req.expires_in_s
        if expires is not None and expires <= now:
            raise GatewayError("invalid_request", "expires_at is in the past", param="expires_at")
        if (req.budget_tokens is None) != (req.budget_period is None):
            raise GatewayError(
                "invalid_request",
                "budget_tokens and budget_period go together",
                param="budget_period",
            )
        secret = new_secret()
        record = KeyRecord(
            id=new_key_id(now),
            name=req.name,
            owner=req.owner,
            created=now,
            hint=secret[-4:],
            expires_at=expires,
            models=req.models,
            rpm=req.rpm,
            input_tpm=req.input_tpm,
            output_tpm=req.output_tpm,
            budget_tokens=req.budget_tokens,
            budget_period=req.budget_period,
            max_concurrent=req.max_concurrent,
        )
        await self.store.create(record, secret_digest(secret))
        log.info("api_key_created", key_id=record.id, owner=record.owner)
        view = p.key_view(record)
        return p.CreatedKey(**msgspec.structs.asdict(view), secret=secret)

    @staticmethod
    def page_args(query: Mapping[str, str]) -> tuple[str | None, int]:
        raw = query.get("limit", str(p.DEFAULT_PAGE))
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 6 or not 1 <= int(raw) <= p.MAX_PAGE:
            raise GatewayError("invalid_request", f"limit must be 1..{p.MAX_PAGE}", param="limit")
        after = query.get("after")
        if after is not None and not KEY_ID.fullmatch(after):
            raise GatewayError("invalid_request", "after must be a key id", param="after")
        return after, int(raw)

    async def list(self, query: Mapping[str, str]) -> p.KeyList:
        after, limit = self.page_args(query)
        records = await self.store.page(after, limit + 1)
        shown = records[:limit]
        return p.KeyList(
            data=[p.key_view(r) for r in shown],
            has_more=len(records) > limit,
            last_id=shown[-1].id if shown else None,
        )

    async def get(self, key_id: str) -> p.KeyView:
        record = await self.store.by_id(key_id) if KEY_ID.fullmatch(key_id) else None
        if record is None:
            raise _not_found()
        return p.key_view(record)

    async def revoke(self, key_id: str) -> p.KeyView:
        record = await self.store.revoke(key_id, time.time()) if KEY_ID.fullmatch(key_id) else None
        if record is None:
            raise _not_found()
        self.auth.forget(key_id)  # this replica refuses it at once; the others within a second
        log.info("api_key_revoked", key_id=key_id)
        return p.key_view(record)

    async def usage(self, query: Mapping[str, str]) -> p.UsageList:
        """A page of keys' usage: totals, or with `start` (and `end`, default today) the UTC
        days from one to the other, inclusive, at most `MAX_USAGE_DAYS` of them."""
        after, limit = self.page_args(query)
        period = usage_period(query)
        records = await self.store.page(after, limit + 1)
        shown = records[:limit]
        days = None if period is None else [d.strftime("%Y%m%d") for d in period]
        counts = await self.store.usage([r.id for r in shown], days)
        return p.UsageList(
            data=[p.usage_view(u) for u in counts],
            has_more=len(records) > limit,
            last_id=shown[-1].id if shown else None,
            start=None if period is None else period[0].isoformat(),
            end=None if period is None else period[-1].isoformat(),
        )


def _date(query: Mapping[str, str], name: str) -> dt.date | None:
    raw = query.get(name)
    if raw is None:
        return None
    try:
        if len(raw) != 10:
            raise ValueError
        return dt.date.fromisoformat(raw)
    except ValueError:
        raise GatewayError(
            "invalid_request", f"{name} is a UTC date, YYYY-MM-DD", param=name
        ) from None


def usage_period(query: Mapping[str, str]) -> list[dt.date] | None:
    """The days `start`..`end` name (None: neither given, the totals)."""
    start, end = _date(query, "start"), _date(query, "end")
    if start is None:
        if end is not None:
            raise GatewayError("invalid_request", "end needs a start", param="start")
        return None
    if end is None:
        end = dt.datetime.now(dt.UTC).date()
    if end < start:
        raise GatewayError("invalid_request", "end is before start", param="end")
    span = (end - start).days + 1
    if span > p.MAX_USAGE_DAYS:
        raise GatewayError(
            "invalid_request", f"a period holds at most {p.MAX_USAGE_DAYS} days", param="end"
        )
    return [start + dt.timedelta(days=i) for i in range(span)]
