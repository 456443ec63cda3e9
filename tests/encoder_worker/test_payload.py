from __future__ import annotations

import random

import pytest
import torch

from encoder_worker.payload import VisualTokens, quantize_tokens, to_embeds


def _payload(
    n: int = 40, hidden: int = 576, group: int = 64, seed: int = 0
) -> tuple[VisualTokens, torch.Tensor]:
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 0.05
    positions = torch.arange(0, 2 * n, 2)
    return quantize_tokens(x, positions, 196, group, n_contextual=3), x


@pytest.mark.parametrize("group", [16, 32, 64, 128])
def test_int4_round_trip_fidelity_and_size(group):
    p, x = _payload(group=group)
    y = to_embeds(p)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(x, y, dim=1).min() > 0.99
    n, hidden = x.shape
    groups = -(-hidden // group)  # the last group is zero-padded
    assert p.nbytes == n * (groups * group // 2 + 2 * groups + 4)  # nibbles, fp16 scales, int32 pos
    if group >= 32:
        assert p.nbytes <= 0.30 * x.numel() * 2  # vs fp16


def test_bytes_round_trip_is_exact():
    p, _ = _payload()
    data = p.to_bytes()
    q = VisualTokens.from_bytes(data)
    assert q == p and q.to_bytes() == data
    assert q.header.n_contextual == 3 and q.positions_list() == list(range(0, 80, 2))
    assert torch.equal(to_embeds(data), to_embeds(p))


def test_hidden_not_a_multiple_of_the_group():
    x = torch.randn(5, 100)
    p = quantize_tokens(x, torch.arange(5), 196, 64)
    y = to_embeds(VisualTokens.from_bytes(p.to_bytes()))
    assert y.shape == (5, 100)
    assert torch.nn.functional.cosine_similarity(x, y, dim=1).min() > 0.98


def test_empty_payload():
    p = quantize_tokens(torch.zeros(0, 64), torch.zeros(0, dtype=torch.long), 196, 32)
    assert to_embeds(VisualTokens.from_bytes(p.to_bytes())).shape == (0, 64)


@pytest.mark.parametrize(
    "mangle",
    [
        lambda d: d[:-1],  # truncated body
        lambda d: d + b"\0",  # trailing bytes
        lambda d: d[:10],  # truncated header
        lambda d: b"XXXX" + d[4:],  # bad magic
        lambda d: d[:4] + (10**6).to_bytes(4, "little") + d[8:],  # header length past the end
        lambda d: b"",
    ],
)
def test_corrupted_payloads_raise_value_error(mangle):
    data = _payload()[0].to_bytes()
    with pytest.raises(ValueError):
        VisualTokens.from_bytes(mangle(data))


def test_random_corruption_never_crashes():
    data = bytearray(_payload(n=4)[0].to_bytes())
    rng = random.Random(0)
    for _ in range(300):
        bad = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(len(bad))] = rng.randrange(256)
        try:
            p = VisualTokens.from_bytes(bytes(bad))
        except ValueError:
            continue
        assert to_embeds(p).shape[1] == p.header.hidden  # still decodes if it parsed
