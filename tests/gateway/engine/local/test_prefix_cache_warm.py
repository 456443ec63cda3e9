"""Warm-up pins in the prefix cache: weaker than a session's pin, replaced by its next turn."""

from __future__ import annotations

import torch

from gateway.engine.local.kv.blocks import block_hashes, chain_seed, position_keys
from gateway.engine.local.kv.prefix_cache import PrefixCache

BS = 4
SEED = chain_seed("m", "float32", BS)


def keep(cache: PrefixCache, tokens: list[int]) -> list[bytes]:
    layers = [torch.randn(2, 1, len(tokens), 2)]  # one layer [2, Hkv, n, D]
    keys = position_keys(tokens, [])
    return cache.insert(SEED, keys, block_hashes(tokens, [], BS, SEED), layers, len(tokens))


def held(cache: PrefixCache, tokens: list[int]) -> int:
    keys = position_keys(tokens, [])
    hashes = block_hashes(tokens, [], BS, SEED)
    return cache.match(SEED, keys, hashes, len(tokens)).length


def test_warm_pins_go_after_unpinned_blocks_and_before_session_pins() -> None:
    cache = PrefixCache(BS)
    session, warmed, loose = [1, 2, 3, 4] * 2, [5, 6, 7, 8] * 2, [9, 10, 11, 12] * 2
    cache.pin("turn", keep(cache, session))
    cache.pin("photo", keep(cache, warmed), warm=True)
    keep(cache, loose)
    per = cache.nbytes // 3
    assert cache.warm_sessions == 1 and cache.pinned_sessions == 1
    assert cache.pinned_bytes() == per  # a warm pin is not counted as a session's pin
    cache.shrink(2 * per, unpin=False)  # the unpinned blocks go first
    assert held(cache, loose) == 0 and held(cache, warmed) == 8 and held(cache, session) == 8
    cache.shrink(per, unpin=False)  # then warm pins, even without unpinning sessions
    assert cache.warm_sessions == 0 and held(cache, warmed) == 0 and held(cache, session) == 8
    cache.shrink(0, unpin=False)
    assert held(cache, session) == 8
    cache.shrink(0, unpin=True)
    assert held(cache, session) == 0 and cache.nbytes == 0


def test_a_turn_pin_replaces_the_sessions_warm_pin_and_forget_drops_both() -> None:
    cache = PrefixCache(BS)
    warm_keys = keep(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    cache.pin("s", warm_keys, warm=True)
    turn_keys = keep(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    cache.pin("s", turn_keys)
    assert cache.warm_sessions == 0 and cache.pinned_sessions == 1
    cache.pin("t", keep(cache, [20, 21, 22, 23]), warm=True)
    cache.forget("t")
    assert cache.warm_sessions == 0 and held(cache, [20, 21, 22, 23]) == 0
    cache.forget("s")
    assert cache.nbytes == 0


def test_an_owner_gives_up_its_own_sessions_pins_first_and_the_kept_session_last() -> None:
    """`shrink(first=owner, keep=session)`: the owner's other sessions' pins go first (least
    recently used first), then other owners', the kept session's (the one being admitted,
    about to reuse its pin) only when nothing else is pinned; `pinned_bytes_beside` counts the
    other owners' pins alone."""
    cache = PrefixCache(BS)
    turns = {name: [i * 10 + k for k in range(8)] for i, name in enumerate("abcd", start=1)}
    owners = {"a": "alice", "b": "bob", "c": "alice", "d": "alice"}  # a oldest, d newest
    for name, tokens in turns.items():
        cache.pin(name, keep(cache, tokens), owner=owners[name])
    per = cache.nbytes // 4
    assert cache.pinned_bytes_beside("alice") == per  # bob's one session
    assert cache.pinned_bytes_beside("bob") == 3 * per
    assert cache.pinned_bytes_beside("carol") == 4 * per
    order = []
    for _ in range(4):
        cache.shrink(cache.nbytes - per, unpin=True, first="alice", keep="a")
        order.append(next(n for n, t in turns.items() if n not in order and held(cache, t) == 0))
    assert order == ["c", "d", "b", "a"], order
    # without an owner first: least recently used first, whoever's they are
    cache = PrefixCache(BS)
    for name, tokens in turns.items():
        cache.pin(name, keep(cache, tokens), owner=owners[name])
    cache.shrink(cache.nbytes - per, unpin=True)
    assert held(cache, turns["a"]) == 0 and held(cache, turns["b"]) == 8
