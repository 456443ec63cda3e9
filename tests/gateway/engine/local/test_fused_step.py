"""The fused step against the checkpoint's own modules, on the real default model.

In float32 the fused step computes what `run_step` computes (to within rounding) over the same
packed slices: prefill from the start, a chunk at an offset beside a decode, then a batch of
decodes; each slice's keys and values land in its own buffer. int8 weights round-trip within
half a step of their channel's scale; float16 weights (fbgemm's kernel, float32 arithmetic)
give float32's next tokens on the same steps; the engine serves float16 (what `auto` is on a CPU
for this model, KV in float32), int8 and bfloat16 (KV in bfloat16) through the fused step, and
a model the step does not take stays on the modules' path.
"""

from __future__ import annotations

import pytest
import torch

from gateway.engine.local.batch import SeqKV, Slice, cache_param, install_attention, run_step
from gateway.engine.local.fused_step import (
    FusedDecoder,
    fp16_gemm_available,
    quantize_int8,
    supported,
)
from gateway.engine.local.weights import load_weights
from gateway.testing.engine_requests import drain, text_requests

pytestmark = pytest.mark.slow

ask = text_requests("fused", max_tokens=12, salt="fused")


@pytest.fixture(scope="module")
def float_model():
    w = load_weights(device="cpu", dtype="float32")
    install_attention(w.model)
    return w


def _buffers(w, n: int, dtype: torch.dtype) -> list[SeqKV]:
    cfg = w.model.config.get_text_config()
    return [
        SeqKV(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 64, dtype, w.device)
        for _ in range(n)
    ]


def _slices(w, bufs, runs, dtype) -> list[Slice]:
    """runs: (buffer index, start, token ids) per slice."""
    out = []
    for i, start, ids in runs:
        t = torch.tensor(ids)
        out.append(
            Slice(
                bufs[i],
                start,
                len(ids),
                w.embed(t).to(dtype),
                torch.arange(start, start + len(ids)),
                True,
            )
        )
    return out


@torch.inference_mode()
def test_float32_fused_step_matches_the_modules(float_model) -> None:
    w = float_model
    fused = FusedDecoder(w.decoder, w.lm_head, w.model.config.get_text_config(), "float32")
    arg = cache_param(w.decoder)
    tok = w.tokenizer
    a = tok("The capital of France is Paris, and", add_special_tokens=False)["input_ids"]
    b = tok("Once upon a time, a fox found a lantern", add_special_tokens=False)["input_ids"]
    ref_bufs, got_bufs = _buffers(w, 2, torch.float32), _buffers(w, 2, torch.float32)
    steps = [
        [(0, 0, a[:5]), (1, 0, b)],  # two prefills from position 0
        [(0, 5, a[5:]), (1, len(b), [42])],  # a chunk at an offset beside a decode
        [(0, len(a), [7]), (1, len(b) + 1, [9])],  # decodes only
    ]
    for runs in steps:
        ref = run_step(
            w.decoder,
            w.lm_head,
            _slices(w, ref_bufs, runs, torch.float32),
            mrope=False,
            cache_arg=arg,
        )
        got = fused.run(_slices(w, got_bufs, runs, torch.float32))
        assert got.shape == ref.shape == (2, ref.shape[1])
        assert torch.allclose(got, ref, atol=1e-3, rtol=0), (got - ref).abs().max()
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    for r, g in zip(ref_bufs, got_bufs, strict=True):
        assert r.length == g.length == len(a) + 1 or r.length == g.length == len(b) + 2
        n = r.length
        for lr, lg in zip(r.layers, g.layers, strict=True):
            assert torch.allclose(lr[:, :, :n], lg[:, :, :n], atol=1e-4, rtol=0)


@torch.inference_mode()
@pytest.mark.skipif(not fp16_gemm_available(), reason="this torch build has no fbgemm")
def test_float16_weights_give_float32s_next_tokens(float_model) -> None:
    w = float_model
    cfg = w.model.config.get_text_config()
    half = FusedDecoder(w.decoder, w.lm_head, cfg, "float16")
    exact = FusedDecoder(w.decoder, w.lm_head, cfg, "float32")
    assert half.dtype == torch.float32  # activations and KV; the weights are float16
    ids = w.tokenizer("The capital of France is Paris, and the", add_special_tokens=False)
    ids = ids["input_ids"]
    runs = [[(0, 0, ids[:6]), (1, 0, ids)], [(0, 6, ids[6:]), (1, len(ids), [42])]]
    got_bufs, ref_bufs = _buffers(w, 2, torch.float32), _buffers(w, 2, torch.float32)
    for step in runs:
        got = half.run(_slices(w, got_bufs, step, torch.float32))
        ref = exact.run(_slices(w, ref_bufs, step, torch.float32))
        # float16 weights round each weight by up to 2**-11 of itself: logits move by a few
        # hundredths at most, far less than float32's margins between its first two tokens here
        assert (got - ref).abs().max() < 0.1, (got - ref).abs().max()
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
        assert not torch.equal(got, ref)  # the float16 kernel did run


@torch.inference_mode()
@pytest.mark.skipif(not fp16_gemm_available(), reason="this torch build has no fbgemm")
def test_decode_steps_through_the_kernel_match_the_python_loop(float_model) -> None:
    w = float_model
    cfg = w.model.config.get_text_config()
    fast = FusedDecoder(w.decoder, w.lm_head, cfg, "float16")
    assert fast._decode_kernel is not None, "the decode-attention kernel did not build here"
    loop = FusedDecoder(w.decoder, w.lm_head, cfg, "float16")
    loop._decode_kernel = None
    a = w.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    b = w.tokenizer("Once upon a time, a fox found a lantern", add_special_tokens=False)
    b = b["input_ids"]
    steps = [
        [(0, 0, a), (1, 0, b)],  # prefills: the Python loop in both
        [(0, len(a), [7]), (1, len(b), [9])],  # decodes only: the kernel in `fast`
        [(0, len(a) + 1, [11]), (1, len(b) + 1, [13])],
    ]
    got_bufs, ref_bufs = _buffers(w, 2, torch.float32), _buffers(w, 2, torch.float32)
    for runs in steps:
        got = fast.run(_slices(w, got_bufs, runs, torch.float32))
        ref = loop.run(_slices(w, ref_bufs, runs, torch.float32))
        assert torch.allclose(got, ref, atol=1e-3, rtol=0), (got - ref).abs().max()
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    for r, g in zip(ref_bufs, got_bufs, strict=True):
        assert r.length == g.length
        for lr, lg in zip(r.layers, g.layers, strict=True):
            assert torch.allclose(lr[:, :, : r.length], lg[:, :, : r.length], atol=1e-4, rtol=0)


@torch.inference_mode()
def test_every_row_gives_each_position_its_logits(float_model) -> None:
    w = float_model
    fused = FusedDecoder(w.decoder, w.lm_head, w.model.config.get_text_config(), "float32")
    ids = w.tokenizer("Rain forms when water vapour cools", add_special_tokens=False)["input_ids"]
    every = fused.run(
        _slices(w, _buffers(w, 1, torch.float32), [(0, 0, ids)], torch.float32), every_row=True
    )
    last = fused.run(_slices(w, _buffers(w, 1, torch.float32), [(0, 0, ids)], torch.float32))
    assert every.shape[0] == len(ids)
    assert torch.allclose(every[-1], last[0], atol=1e-4, rtol=0)
    plain = load_weights(device="cpu", dtype="float32")  # transformers' own attention
    full = plain.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    assert torch.allclose(every, full, atol=1e-3, rtol=0)


def test_int8_weights_round_trip_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 96, generator=g) * torch.linspace(0.01, 3.0, 48)[:, None]
    weight[5] = 0.0  # a row of zeros must not divide by zero
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and q.shape == weight.shape
    assert int(q.abs().max()) <= 127
    back = q.float() * scale.float()[:, None]
    assert bool(((back - weight).abs() <= scale.float()[:, None] / 2 + 1e-6).all())
    assert torch.equal(back[5], torch.zeros(96))


def test_supported_takes_llama_only() -> None:
    from transformers import LlamaConfig, Qwen2Config

    assert supported(LlamaConfig()) is None
    assert "biased" in (supported(LlamaConfig(attention_bias=True)) or "")
    assert "qwen2" in (supported(Qwen2Config()) or "")
    with pytest.raises(ValueError, match="not llama"):
        FusedDecoder(None, None, Qwen2Config(), "int8")
    with pytest.raises(ValueError, match="holds"):
        FusedDecoder(None, None, LlamaConfig(), "int4")


@pytest.mark.parametrize(
    ("precision", "weights", "kv"),
    [
        ("auto", "float16" if fp16_gemm_available() else "float32", torch.float32),
        ("int8", "int8", torch.bfloat16),
        ("bfloat16", "bfloat16", torch.bfloat16),
    ],
)
async def test_engine_serves_the_precision_through_the_fused_step(precision, weights, kv) -> None:
    from gateway.engine.local.local_engine import LocalEngine

    engine = LocalEngine(dtype=precision, max_queue=8)
    await engine.start()
    try:
        w = engine._weights
        assert w is not None and w.weights == weights
        assert (w.fused is not None) == (weights != "float32")
        assert w.dtype == kv  # activations and KV
        question = "What is the capital of France? Answer in one sentence."
        _, first = await drain(engine, ask(question, 12))
        assert "Paris" in first[-1].text
        # the same prompt again reuses its cached KV and answers the same way (greedy)
        _, again = await drain(engine, ask(question, 12))
        assert again[-1].cached_tokens > 0
        assert again[-1].text == first[-1].text
    finally:
        await engine.aclose()


def test_exact_mode_keeps_the_modules() -> None:
    w = load_weights(device="cpu", dtype="float32")
    assert w.fused is None and w.weights == "float32"
