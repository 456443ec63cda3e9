"""Wire shapes of the admin API. Every bound is here: a body that breaks one is refused with
`invalid_request` (400) before anything is stored. The secret appears in `CreatedKey` only."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from gateway.policy.key_store import SECRET_PREFIX, KeyRecord, KeyUsage

__all__ = (
    "MAX_BODY",
    "MAX_PAGE",
    "MAX_USAGE_DAYS",
    "CreateKeyRequest",
    "CreatedKey",
    "KeyList",
    "KeyView",
    "UsageList",
    "UsageView",
    "key_view",
    "usage_view",
)

MAX_BODY = 64 * 1024  # a create body; the largest legal one is about 14 KiB
MAX_PAGE = 200  # records per list page
MAX_USAGE_DAYS = 92  # the longest period one usage page sums (a quarter)
DEFAULT_PAGE = 50
TEN_YEARS_S = 10 * 366 * 86400.0

Text = Annotated[str, Meta(max_length=200)]
Name = Annotated[str, Meta(min_length=1, max_length=200)]
Count = Annotated[int, Meta(ge=1, le=10**15)]


class CreateKeyRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Name
    owner: Text = ""
    expires_at: Annotated[float, Meta(gt=0)] | None = None  # unix seconds, in the future
    expires_in_s: Annotated[float, Meta(gt=0, le=TEN_YEARS_S)] | None = None
    models: Annotated[list[Name], Meta(min_length=1, max_length=64)] | None = None
    rpm: Annotated[int, Meta(ge=1, le=10**9)] | None = None
    input_tpm: Count | None = None
    output_tpm: Count | None = None
    budget_tokens: Count | None = None
    budget_period: Literal["day", "month"] | None = None
    # responses in flight at once; None: the gateway's max_concurrent_responses_per_key
    max_concurrent: Annotated[int, Meta(ge=0, le=10**6)] | None = None


class KeyView(msgspec.Struct, kw_only=True):
    id: str
    object: str = "api_key"
    name: str
    owner: str
    created: float
    redacted_key: str  # "vgk-...x9Zq": enough to tell keys apart, never to use one
    expires_at: float | None
    models: list[str] | None
    rpm: int | None
    input_tpm: int | None
    output_tpm: int | None
    budget_tokens: int | None
    budget_period: str | None
    max_concurrent: int | None
    revoked: bool
    revoked_at: float | None


class CreatedKey(KeyView, kw_only=True):
    secret: str  # shown here once; the gateway keeps only its digest


class KeyList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[KeyView]
    has_more: bool
    last_id: str | None  # pass as `after` for the next page


class UsageView(msgspec.Struct, kw_only=True):
    """A key's counts since it was made (`gateway.policy.key_store.KeyUsage`)."""

    id: str
    object: str = "api_key.usage"
    requests: int  # responses started
    input_tokens: int  # of the responses that ended, cached and image tokens included
    cached_tokens: int
    output_tokens: int
    image_tokens: int
    encode_ms: int  # what they waited for image encodes


class UsageList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[UsageView]
    has_more: bool
    last_id: str | None
    # the UTC days counted, inclusive (`YYYY-MM-DD`); None: every count since each key was made
    start: str | None = None
    end: str | None = None


def key_view(record: KeyRecord) -> KeyView:
    return KeyView(
        id=record.id,
        name=record.name,
        owner=record.owner,
        created=record.created,
        redacted_key=f"{SECRET_PREFIX}...{record.hint}",
        expires_at=record.expires_at,
        models=record.models,
        rpm=record.rpm,
        input_tpm=record.input_tpm,
        output_tpm=record.output_tpm,
        budget_tokens=record.budget_tokens,
        budget_period=record.budget_period,
        max_concurrent=record.max_concurrent,
        revoked=record.revoked,
        revoked_at=record.revoked_at,
    )


def usage_view(usage: KeyUsage) -> UsageView:
    return UsageView(
        id=usage.id,
        requests=usage.requests,
        input_tokens=usage.input_tokens,
        cached_tokens=usage.cached_tokens,
        output_tokens=usage.output_tokens,
        image_tokens=usage.image_tokens,
        encode_ms=usage.encode_ms,
    )
