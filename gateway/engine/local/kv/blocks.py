"""KV entries and the content hashes that decide how much of one can be reused.

A sequence is cut into blocks of `block_size` positions; block i hashes
`blake2b(hash_{i-1} || positions of block i)`, where a text position is its token id and an
image position is `(image key, offset in the image)`. The chain starts from a seed naming the
model, dtype and block size (and, for KV spilled to a store other processes read, a content id
of the weights), so KV from another model never matches. Reuse between a stored
entry and a new prompt is the run of equal full-block hashes, extended position by position
inside the first differing block using the entry's own (hash-verified) token list.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from gateway.engine.local.prompt import ImageSpan

__all__ = ("KVEntry", "block_hashes", "chain_seed", "common_prefix", "position_keys")

PositionKey = int | tuple[str, int]
_encode = msgspec.msgpack.Encoder().encode


def chain_seed(model_id: str, dtype: str, block_size: int) -> bytes:
    return hashlib.blake2b(f"{model_id}|{dtype}|{block_size}".encode(), digest_size=16).digest()


def position_keys(tokens: Sequence[int], images: Sequence[ImageSpan]) -> list[PositionKey]:
    """Per position: the token id, or (image key, offset) where an image token sits."""
    keys: list[PositionKey] = list(tokens)
    for span in images:
        for offset in range(span.length):
            if span.start + offset < len(keys):
                keys[span.start + offset] = (span.key, offset)
    return keys


def block_hashes(
    tokens: Sequence[int], images: Sequence[ImageSpan], block_size: int, seed: bytes
) -> list[bytes]:
    """Chained hashes of the full blocks (a trailing partial block has none)."""
    keys = position_keys(tokens, images)
    hashes: list[bytes] = []
    prev = seed
    for start in range(0, len(keys) - block_size + 1, block_size):
        block = _encode(keys[start : start + block_size])
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        hashes.append(prev)
    return hashes


def common_prefix(
    a_hashes: Sequence[bytes],
    a_keys: Sequence[PositionKey],
    b_hashes: Sequence[bytes],
    b_keys: Sequence[PositionKey],
    block_size: int,
) -> int:
    """Length of the common prefix: equal block hashes, then equal positions."""
    blocks = 0
    for ha, hb in zip(a_hashes, b_hashes, strict=False):
        if ha != hb:
            break
        blocks += 1
    pos = blocks * block_size
    end = min(len(a_keys), len(b_keys))
    while pos < end and a_keys[pos] == b_keys[pos]:
        pos += 1
    return pos


@dataclass(slots=True)
class KVEntry:
    """The KV of one sequence: its positions, their block hashes and per-layer tensors."""

    tokens: list[int]  # per position: token id, -1 for an image token
    images: list[ImageSpan]
    block_size: int
    hashes: list[bytes]  # chained hashes of the full blocks of `tokens`
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [1, Hkv, S, D]

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(
            k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers
        )

    def reusable(
        self, tokens: Sequence[int], images: Sequence[ImageSpan], hashes: Sequence[bytes]
    ) -> int:
        """How many leading positions of the given sequence this entry's KV covers."""
        return common_prefix(
            self.hashes,
            position_keys(self.tokens, self.images),
            hashes,
            position_keys(tokens, images),
            self.block_size,
        )
