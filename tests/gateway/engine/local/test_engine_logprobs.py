"""Log-probabilities on the real model: what each token reports, and when it is sent.

Each generated token (the end token aside) gets the log-softmax of the raw logits at its
position, its top alternatives, its own text and bytes; a token goes out with the delta that
completes its text, and what a stop string cut goes in the result.
"""

from __future__ import annotations

import math

import pytest
import torch

from gateway.engine.interface import (
    MAX_TOP_LOGPROBS,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    TextDelta,
    TokenLogprob,
)
from gateway.testing.engine_requests import drain, text_requests

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France? Answer in one sentence."
STORY = "Write a short story about a fox."


# a salt of its own: the prompts of other tests' files share no KV with these
ask = text_requests("logprobs", max_tokens=24, salt="logprobs")


async def run(engine, request: GenerationRequest) -> tuple[list[TextDelta], GenerationResult]:
    deltas, results = await drain(engine, request)
    assert results, "no GenerationResult"
    return deltas, results[-1]


def tokens_of(deltas: list[TextDelta], result: GenerationResult) -> list[TokenLogprob]:
    return [t for d in deltas for t in d.logprobs] + list(result.logprobs)


def check_token(token: TokenLogprob, k: int) -> None:
    assert token.token == token.bytes.decode("utf-8", errors="replace")
    assert math.isfinite(token.logprob) and 0.0 < math.exp(token.logprob) <= 1.0
    assert len(token.top) == k
    values = [v for _, v, _ in token.top]
    assert values == sorted(values, reverse=True)
    assert sum(math.exp(v) for v in values) <= 1.0 + 1e-4
    for text, _, raw in token.top:
        assert text == raw.decode("utf-8", errors="replace")
    if token.top:
        assert token.logprob <= token.top[0][1] + 1e-6


async def test_greedy_token_is_the_top_alternative(engine) -> None:
    deltas, result = await run(engine, ask(QUESTION, logprobs=5))
    tokens = tokens_of(deltas, result)
    assert result.finish_reason == "stop" and "Paris" in result.text
    assert len(tokens) == result.output_tokens - 1  # the end token reports nothing
    for token in tokens:
        check_token(token, 5)
        top_text, top_value, top_bytes = token.top[0]
        assert (top_text, top_bytes) == (token.token, token.bytes)
        assert top_value == token.logprob
    # the tokens' bytes are the answer, and each delta carries the tokens its text completes
    assert b"".join(t.bytes for t in tokens).decode() == result.text
    assert result.logprobs == ()
    sent = b""
    for delta in deltas:
        sent += b"".join(t.bytes for t in delta.logprobs)
        assert result.text.encode().startswith(sent)
    assert sent == result.text.encode()


async def test_values_are_the_models_log_softmax(engine) -> None:
    """The first token's log-probabilities against a plain forward of the same prompt."""
    text = "The capital of Italy is"
    deltas, result = await run(
        engine,
        GenerationRequest(
            "lp-raw", [], SamplingParams(max_output_tokens=2, logprobs=4), raw_prompt=text
        ),
    )
    first = tokens_of(deltas, result)[0]
    from transformers import AutoModelForCausalLM

    from gateway.engine.local.weights import ensure_default_converted

    model = AutoModelForCausalLM.from_pretrained(ensure_default_converted(), dtype=torch.float32)
    ids = engine.tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        logits = model(ids).logits[0, -1].float()
    expected = torch.log_softmax(logits, dim=-1).topk(4)
    # the exact mode matches float32 transformers to rounding; float16 weights (what `auto` is
    # on a CPU for this model) move a log-probability by a few thousandths
    tolerance = 1e-3 if engine._weights.weights == "float32" else 2e-2
    for (tok_text, value, raw), exp_value, exp_id in zip(
        first.top, expected.values.tolist(), expected.indices.tolist(), strict=True
    ):
        assert raw.decode() == engine.tokenizer.decode([exp_id])
        assert value == pytest.approx(exp_value, abs=tolerance)


async def test_sampled_tokens_are_consistent(engine) -> None:
    k = MAX_TOP_LOGPROBS
    deltas, result = await run(engine, ask(STORY, 24, temperature=1.0, seed=11, logprobs=k))
    tokens = tokens_of(deltas, result)
    assert len(tokens) == result.output_tokens - (result.finish_reason == "stop")
    for token in tokens:
        check_token(token, k)
        # a sampled token in the top k reports the same value there
        for text, value, raw in token.top:
            if raw == token.bytes:
                assert value == token.logprob
    assert b"".join(t.bytes for t in tokens).decode() == result.text


async def test_zero_alternatives_and_none(engine) -> None:
    deltas, result = await run(engine, ask(QUESTION, 8, logprobs=0))
    tokens = tokens_of(deltas, result)
    assert len(tokens) == result.output_tokens - (result.finish_reason == "stop")
    assert tokens and all(t.top == () for t in tokens)
    deltas, result = await run(engine, ask(QUESTION, 8))
    assert all(d.logprobs == () for d in deltas) and result.logprobs == ()


async def test_tokens_cut_by_a_stop_string_come_with_the_result(engine) -> None:
    _, full = await run(engine, ask(QUESTION, 24))
    assert "Paris" in full.text
    deltas, result = await run(engine, ask(QUESTION, 24, stop=("Paris",), logprobs=2))
    assert result.finish_reason == "stop"
    assert result.text == full.text[: full.text.index("Paris")]
    sent = b"".join(t.bytes for d in deltas for t in d.logprobs)
    cut = b"".join(t.bytes for t in result.logprobs)
    assert result.logprobs, "the token holding the stop string was never sent"
    assert result.text.encode().startswith(sent)
    assert (sent + cut).startswith(result.text.encode())
    assert b"Paris" in sent + cut


async def test_logprobs_with_a_grammar_are_of_the_raw_logits(engine) -> None:
    """The grammar limits what is sampled, not the reported distribution."""
    free, free_result = await run(engine, ask(QUESTION, 4, logprobs=3))
    bound, bound_result = await run(
        engine, ask(QUESTION, 4, logprobs=3, grammar='start: "London" | "Rome"')
    )
    first_free = tokens_of(free, free_result)[0]
    first_bound = tokens_of(bound, bound_result)[0]
    assert bound_result.text in ("London", "Rome")
    # the same position, the same raw distribution
    assert [t for t, _, _ in first_bound.top] == [t for t, _, _ in first_free.top]
    for (_, bound_value, _), (_, free_value, _) in zip(
        first_bound.top, first_free.top, strict=True
    ):
        assert bound_value == pytest.approx(free_value, abs=1e-4)
    assert first_bound.bytes != first_free.top[0][2]  # yet the grammar picked another token
