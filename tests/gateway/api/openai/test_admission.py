"""Every OpenAI HTTP API is admitted through the one serving base (`gateway.api.openai.serving`):
a legacy completion counts against, and is refused by, a key's cap on responses in flight as a
chat completion is, with the same stable code, over a real gateway (the fake engine)."""

from __future__ import annotations

import time

import httpx

from gateway.testing.fakes import FakeEngine

KEY = "sk-admission-5e1c0a9d47b2f836"
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


def _prompt(n: int) -> str:
    """`n` words: the fake engine answers with them, one token each (`delay_s` apart)."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(n))


def _refused_for_concurrency(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "concurrency_limited"
    assert int(r.headers["retry-after"]) >= 1


def test_a_keys_cap_on_responses_in_flight_holds_completions_as_chat(make_gateway) -> None:
    """With a cap of one, a streamed completion in flight refuses the key's next chat
    completion and completion alike (`concurrency_limited`, Retry-After); once it ends, a
    completion is admitted again."""
    gateway = make_gateway(
        engine=FakeEngine(delay_s=0.05),
        settings=dict(api_keys=[KEY], max_concurrent_responses_per_key=1),
    )
    completion = {"model": "fake-echo", "prompt": _prompt(60), "max_tokens": 60}
    chat = {"model": "fake-echo", "messages": [{"role": "user", "content": "hello"}]}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=gateway.http_url, headers=headers, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**completion, "stream": True}) as held:
            assert held.status_code == 200
            lines = held.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it is answering
            _refused_for_concurrency(client.post("/v1/chat/completions", json=chat))
            _refused_for_concurrency(client.post("/v1/completions", json=completion))
            assert "data: [DONE]" in list(lines)  # the held one was not disturbed
        # its slot is given back as it ends (in the background: allow a moment)
        deadline = time.monotonic() + 10
        while True:
            again = client.post("/v1/completions", json={**completion, "max_tokens": 2})
            if again.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"]
