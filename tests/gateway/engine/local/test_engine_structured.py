"""Grammar-constrained decoding and raw prompts on the real model.

A JSON-schema grammar holds for every answer (greedy and seeded sampling, in one batch, through
preemption), a Lark grammar's alternatives are obeyed, a bad grammar is refused with
`invalid_request` while the engine keeps serving, unconstrained neighbours keep the exact
tokens they get alone, and a raw prompt decodes as transformers' own `generate` does.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.engine.interface import EngineError, GenerationRequest, SamplingParams
from gateway.testing.engine_requests import text_requests

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PERSON = "start: %json " + json.dumps(SCHEMA)
SUBJECTS = (
    "a baker",
    "a pilot",
    "a painter",
    "a nurse",
    "a farmer",
    "a poet",
    "a judge",
    "a sailor",
    "a miner",
    "a chef",
    "a tailor",
    "a dancer",
    "a monk",
    "a clown",
    "a barber",
    "a knight",
    "a drummer",
    "a potter",
    "a ranger",
    "a glazier",
)
QUESTION = "What is the capital of France? Answer in one sentence."


# a salt of its own: prompts of other tests' files share no KV with these
ask = text_requests("structured", max_tokens=80, salt="structured")


def person_request(i: int, **sampling) -> GenerationRequest:
    return ask(f"Describe {SUBJECTS[i]} as a JSON object with name, age and city.", **sampling)


def check_person(text: str) -> None:
    """The schema's constraints, checked by hand (no jsonschema dependency)."""
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"name", "age", "city"}, text
    assert isinstance(value["name"], str) and len(value["name"]) <= 24, text
    assert isinstance(value["city"], str) and len(value["city"]) <= 24, text
    assert type(value["age"]) is int and 0 <= value["age"] <= 150, text


@pytest.fixture(scope="module")
async def wide(engine):
    """A replica whose batch takes all twenty prompts at once."""
    twin = engine.replica(max_batch=len(SUBJECTS), max_queue=64, max_queue_per_key=64)
    await twin.start()
    yield twin
    await twin.aclose()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_json_schema_holds_for_twenty_prompts(wide, collect, temperature) -> None:
    requests = [
        person_request(i, temperature=temperature, seed=100 + i, grammar=PERSON)
        for i in range(len(SUBJECTS))
    ]
    outcomes = await asyncio.gather(*(collect(wide, r) for r in requests))
    texts = set()
    for deltas, result in outcomes:
        assert result.finish_reason == "stop", result.text  # the grammar ended it, not the limit
        assert "".join(deltas) == result.text
        check_person(result.text)
        texts.add(result.text)
    assert len(texts) > 1  # twenty prompts, not one canned answer


async def test_seeded_grammar_sampling_is_reproducible(engine, collect) -> None:
    def request() -> GenerationRequest:
        return person_request(3, temperature=1.0, seed=7, grammar=PERSON)

    (_, first), (_, second) = await asyncio.gather(
        collect(engine, request()), collect(engine, request())
    )
    check_person(first.text)
    assert first.text == second.text


async def test_unconstrained_neighbours_keep_their_tokens(engine, collect) -> None:
    _, alone = await collect(engine, ask(QUESTION, 24, salt="plain-alone"))
    outcomes = await asyncio.gather(
        collect(engine, person_request(0, grammar=PERSON, salt="json-a")),
        collect(engine, ask(QUESTION, 24, salt="plain-mixed")),
        collect(engine, person_request(1, grammar=PERSON, salt="json-b")),
    )
    mixed = outcomes[1][1]
    assert mixed.text == alone.text and mixed.output_tokens == alone.output_tokens
    assert "Paris" in mixed.text
    for _, result in (outcomes[0], outcomes[2]):
        check_person(result.text)


async def test_lark_alternatives_are_obeyed(engine, collect) -> None:
    _, yes_no = await collect(
        engine, ask("Is the sky green? Explain.", 16, grammar='start: "yes" | "no"')
    )
    assert yes_no.text in ("yes", "no") and yes_no.finish_reason == "stop"
    colours = 'start: colour ", " colour\ncolour: "red" | "green" | "blue"'
    for temperature in (0.0, 1.0):
        _, pair = await collect(
            engine, ask("Name two colours.", 16, grammar=colours, temperature=temperature, seed=3)
        )
        first, second = pair.text.split(", ")
        assert {first, second} <= {"red", "green", "blue"}, pair.text
        assert pair.finish_reason == "stop"


@pytest.mark.parametrize(
    "grammar",
    [
        "start: undefined_rule",
        "start: /[/",
        'start: %json { "type": 12 }',
        "start: %json {not json",
        "   ",
        "x" * (64 * 1024 + 1),
    ],
)
async def test_bad_grammar_is_invalid_request_and_the_engine_serves_on(
    engine, collect, grammar
) -> None:
    with pytest.raises(EngineError) as refused:
        await collect(engine, ask(QUESTION, 4, grammar=grammar))
    assert refused.value.code == "invalid_request"
    _, after = await collect(engine, ask(QUESTION, 4))
    assert after.output_tokens == 4


async def test_grammar_survives_preemption(engine, collect) -> None:
    """A full batch of one key's grammar requests, mid-answer, makes room for another key's
    request: the one preempted resumes with its matcher where it was."""
    calm = [
        (await collect(engine, person_request(i, grammar=PERSON, salt=f"calm-{i}")))[1].text
        for i in range(2)
    ]
    twin = engine.replica(max_batch=2, max_queue=8)
    await twin.start()
    sched = twin._scheduler
    try:
        hogs = [
            asyncio.create_task(collect(twin, person_request(i, grammar=PERSON, salt="hog")))
            for i in range(2)
        ]
        async with asyncio.timeout(120):
            while not (
                len(sched.admission.running) == 2
                and all(len(s.generated) >= 4 for s in sched.admission.running)
            ):
                await asyncio.sleep(0.002)
        _, guest = await collect(twin, person_request(5, grammar=PERSON, salt="guest"))
        outcomes = await asyncio.gather(*hogs)
    finally:
        await twin.aclose()
    check_person(guest.text)
    assert sum(result.preemptions for _, result in outcomes) == 1
    for (_, result), expected in zip(outcomes, calm, strict=True):
        assert result.text == expected  # greedy: the same answer as without preemption


async def test_raw_prompt_decodes_as_transformers_generate(engine, collect) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from gateway.engine.local.weights import ensure_default_converted

    text = "The three primary colours are"
    _, result = await collect(
        engine, GenerationRequest("raw", [], SamplingParams(max_output_tokens=20), raw_prompt=text)
    )
    tokenizer = engine.tokenizer
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert result.input_tokens == ids.shape[1]
    reference = AutoModelForCausalLM.from_pretrained(
        ensure_default_converted(), dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        out = reference.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20
        )
    expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert result.text == expected
    assert result.output_tokens == out.shape[1] - ids.shape[1]


async def test_raw_prompt_reuses_cached_prefix(engine, collect) -> None:
    text = "Once upon a time, in a quiet village by the sea, there lived an old fisherman who"
    request = GenerationRequest(
        "raw-a", [], SamplingParams(max_output_tokens=4), raw_prompt=text, cache_salt="raw"
    )
    _, first = await collect(engine, request)
    await engine.flush_kv()
    again = GenerationRequest(
        "raw-b", [], SamplingParams(max_output_tokens=4), raw_prompt=text, cache_salt="raw"
    )
    _, second = await collect(engine, again)
    assert first.cached_tokens == 0
    assert second.cached_tokens == second.input_tokens - 1
    assert second.text == first.text
