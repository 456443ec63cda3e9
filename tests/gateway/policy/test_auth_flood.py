"""Made-up keys cost nothing: a key not of a managed secret's form is unknown without a key
store read and without a cache entry, so a flood of them neither loads the store nor pushes
real keys out of the Authenticator's cache."""

from __future__ import annotations

import secrets
import time

import pytest

from gateway.policy.auth import Authenticator
from gateway.policy.key_store import (
    KeyRecord,
    MemoryKeyStore,
    new_key_id,
    new_secret,
    secret_digest,
)
from gateway.protocol.errors import GatewayError


class CountingStore(MemoryKeyStore):
    """The memory key store, counting its reads."""

    __slots__ = ("reads",)

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    async def by_digest(self, digest: str) -> KeyRecord | None:
        self.reads += 1
        return await super().by_digest(digest)


async def test_made_up_keys_reach_neither_the_store_nor_the_cache() -> None:
    store = CountingStore()
    auth = Authenticator([], store)
    real = new_secret()
    key_id = new_key_id()
    await store.create(KeyRecord(id=key_id, name="r", created=time.time()), secret_digest(real))
    assert (await auth.lookup(real)).id == key_id and store.reads == 1
    made_up = [
        "sk-" + secrets.token_hex(16),
        "vgk-short",
        "vgk-" + "a" * 44,
        "vgk-" + "a" * 42 + "!",
        "x" * 10_000,
        "",
    ]
    for key in made_up * 500:
        assert await auth.lookup(key) is None
        with pytest.raises(GatewayError) as refused:
            await auth.resolve({"authorization": f"Bearer {key}"})
        assert refused.value.code == "unauthorized"
    assert store.reads == 1 and len(auth._cache) == 1  # the real key's entry is still there
    # an unknown key of the right form is read once, then cached
    other = new_secret()
    assert await auth.lookup(other) is None and await auth.lookup(other) is None
    assert store.reads == 2
