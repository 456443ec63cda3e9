"""The OpenAI-compatible HTTP API through the real app, over the fake engine and encoder: the
official `openai` client (plain and SSE), sessions, models, image upload, readiness, metrics."""

from __future__ import annotations

import hashlib
import threading
import time

import httpx
import openai
import pytest

from gateway.chat.service import kv_key_for
from gateway.engine.interface import EngineError
from gateway.testing.fake_gateway import FakeGateway, GatewayFactory, eventually
from gateway.testing.fakes import FakeEngine
from gateway.testing.realtime_peer import data_url
from tests.conftest import photo_bytes, unique_photo
from tests.gateway.api.openai.conftest import fake_http as http  # noqa: F401 - fixture
from tests.gateway.api.openai.conftest import fake_openai as client  # noqa: F401 - fixture

TIMEOUT = 10.0
MODEL = "fake-echo"


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def test_chat_completion(client: openai.OpenAI, fake_gateway: FakeGateway) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "hello there"},
        ],
        temperature=0.3,
        seed=5,
    )
    assert completion.object == "chat.completion" and completion.model == MODEL
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert choice.message.content == "hello there [0 images]"
    usage = completion.usage
    assert usage is not None and usage.completion_tokens == 3
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert completion.system_fingerprint == "fp_" + fake_gateway.encoder.fingerprint[:12]
    request = next(
        r
        for r in fake_gateway.engine.requests
        if r.messages and r.messages[0].content == ["Be terse."]
    )
    assert (request.sampling.temperature, request.sampling.seed) == (0.3, 5)
    assert request.kv_key is None  # no session: nothing kept


def test_chat_completion_with_an_image(client: openai.OpenAI, fake_gateway: FakeGateway) -> None:
    photo = unique_photo("chelsea")
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": [image_part(photo), {"type": "text", "text": "a cat?"}]}
        ],
    )
    assert completion.choices[0].message.content == "a cat? [1 images]"
    details = completion.usage.prompt_tokens_details
    assert details is not None and details.image_tokens == fake_gateway.encoder.tokens
    extension = completion.model_extra["visiongate"]
    assert extension["cache"]["vision"] == "miss" and extension["image_tokens"] == 4
    assert hashlib.sha256(photo).hexdigest() in fake_gateway.encoder.encoded


def test_max_tokens_ends_with_length(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "one two three four"}], max_tokens=2
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].message.content == "one two"
    assert completion.usage.completion_tokens == 2


def test_streamed_completion(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream these words please"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "stream these words please [0 images]"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "stop" and set(finish[:-1]) == {None}
    assert len({c.id for c in chunks}) == 1
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5


def test_stream_ends_with_done_and_a_fault_mid_stream_is_an_error_frame(
    make_gateway: GatewayFactory,
) -> None:
    gateway = make_gateway(engine=FakeEngine(fail_after=2))
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "a b c d"}]}
    with (
        httpx.Client(base_url=gateway.http_url, timeout=TIMEOUT) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200  # text went out before the fault
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]"
    assert '"code":"engine_error"' in frames[-2]


def test_sessions_api(client: openai.OpenAI, http: httpx.Client, fake_gateway: FakeGateway) -> None:
    session_id = "sess-unit-http-1"
    history = [{"role": "user", "content": "first question"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=history, extra_headers={"X-Session-Id": session_id}
    )
    assert raw.headers["x-session-id"] == session_id
    first = raw.parse()
    assert first.model_extra["visiongate"]["session_id"] == session_id

    view = http.get(f"/v1/sessions/{session_id}").json()
    assert view["id"] == session_id
    # a completed item's status is left out (the default)
    assert [(i["role"], i.get("status", "completed")) for i in view["items"]] == [
        ("user", "completed"),
        ("assistant", "completed"),
    ]
    assert view["items"][1]["content"] == [
        {"type": "text", "text": first.choices[0].message.content}
    ]
    first_ids = [i["id"] for i in view["items"]]

    # the next turn resends the history: the stored items are kept, the new one appended
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "second question"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, extra_body={"session_id": session_id}
    )
    view = http.get(f"/v1/sessions/{session_id}").json()
    assert [i["id"] for i in view["items"][:2]] == first_ids
    assert len(view["items"]) == 4
    assert view["items"][3]["content"][0]["text"] == second.choices[0].message.content
    # the session's usage sums its answers' (zero counts are left out)
    usage = {
        "responses": 2,
        "input_tokens": first.usage.prompt_tokens + second.usage.prompt_tokens,
        "output_tokens": first.usage.completion_tokens + second.usage.completion_tokens,
    }
    assert view["usage"] == usage
    request = fake_gateway.engine.requests[-1]
    assert request.kv_key == kv_key_for("anonymous", session_id)
    assert [m.role for m in request.messages] == ["user", "assistant", "user"]

    deleted = http.delete(f"/v1/sessions/{session_id}")
    assert deleted.status_code == 200 and deleted.json()["id"] == session_id
    assert kv_key_for("anonymous", session_id) in fake_gateway.engine.forgotten
    gone = http.get(f"/v1/sessions/{session_id}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"
    assert http.delete(f"/v1/sessions/{session_id}").status_code == 404


def test_a_turn_refused_before_any_output_leaves_its_session_as_it_was(
    make_gateway: GatewayFactory,
) -> None:
    """A stored session's turn that fails before any text (here the engine's own refusal; a
    key out of token room is the same path) is rolled back: the next try of the same history
    appends to the session as the first would have, and no unanswered message stays."""
    engine = FakeEngine()
    gateway = make_gateway(engine=engine)
    session_id = "sess-refused-turn"
    history = [{"role": "user", "content": "first question"}]
    with httpx.Client(base_url=gateway.http_url, timeout=TIMEOUT) as http:
        body = {"model": MODEL, "messages": history, "session_id": session_id}
        first = http.post("/v1/chat/completions", json=body).json()
        before = http.get(f"/v1/sessions/{session_id}").json()["items"]
        assert [i["role"] for i in before] == ["user", "assistant"]

        history += [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "second question"},
        ]
        engine.refuse = EngineError("the prompt is too long", code="context_length_exceeded")
        refused = http.post("/v1/chat/completions", json={**body, "messages": history})
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        after = http.get(f"/v1/sessions/{session_id}").json()["items"]
        assert [i["id"] for i in after] == [i["id"] for i in before]

        engine.refuse = None  # the same history again: appended once, answered
        again = http.post("/v1/chat/completions", json={**body, "messages": history})
        assert again.status_code == 200
        items = http.get(f"/v1/sessions/{session_id}").json()["items"]
        assert [i["role"] for i in items] == ["user", "assistant", "user", "assistant"]
        assert [i["id"] for i in items[:2]] == [i["id"] for i in before]


def test_sessions_belong_to_their_api_key(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(settings={"api_keys": ["key-a", "key-b"]})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "mine"}]}
    with httpx.Client(base_url=gateway.http_url, timeout=TIMEOUT) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        a = {"Authorization": "Bearer key-a", "X-Session-Id": "shared-name"}
        assert http.post("/v1/chat/completions", json=body, headers=a).status_code == 200
        assert http.get("/v1/sessions/shared-name", headers=a).status_code == 200
        b = {"Authorization": "Bearer key-b"}
        r = http.get("/v1/sessions/shared-name", headers=b)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


def test_models(client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    # the context, under the name vLLM's model cards use (an upstream gateway reads it)
    assert http.get(f"/v1/models/{MODEL}").json()["max_model_len"] == 8192
    r = http.get("/v1/models/no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )


def poll_ready(http: httpx.Client, digest: str) -> dict:
    for _ in range(500):
        status = http.get(f"/v1/images/{digest}").json()
        if status["status"] != "encoding":
            return status
        threading.Event().wait(0.01)
    raise AssertionError(f"image {digest} never finished encoding")


def test_image_upload_status_and_reference(
    client: openai.OpenAI, http: httpx.Client, fake_gateway: FakeGateway
) -> None:
    photo = unique_photo("astronaut")
    digest = hashlib.sha256(photo).hexdigest()
    r = http.post("/v1/images", content=photo, headers={"Content-Type": "image/jpeg"})
    assert r.status_code == 200, r.text
    uploaded = r.json()
    assert uploaded["id"] == digest and uploaded["ref"] == f"visiongate:sha256:{digest}"
    assert uploaded["status"] in ("encoding", "ready")
    assert (uploaded["format"], uploaded["bytes"]) == ("JPEG", len(photo))
    status = poll_ready(http, digest)
    assert status["status"] == "ready"
    assert status["tokens_kept"] == fake_gateway.encoder.tokens

    # referenced by digest: the cached tokens, no second encode
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": uploaded["ref"]}},
                    {"type": "text", "text": "this one"},
                ],
            }
        ],
    )
    assert completion.choices[0].message.content == "this one [1 images]"
    assert completion.model_extra["visiongate"]["cache"]["vision"] == "hit"
    assert fake_gateway.encoder.encoded.count(digest) == 1

    # a multipart upload of the same bytes is the same image
    r = http.post("/v1/images", files={"file": ("photo.jpg", photo, "image/jpeg")})
    assert r.status_code == 200 and r.json()["id"] == digest and r.json()["status"] == "ready"


def test_unknown_image_and_bad_upload(http: httpx.Client) -> None:
    r = http.get(f"/v1/images/{'cd' * 32}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "image_not_found"
    r = http.post("/v1/images", content=b"not an image", headers={"Content-Type": "image/png"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image"
    body = {
        "model": MODEL,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"visiongate:sha256:{'ef' * 32}"}}
                ],
            }
        ],
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 404 and r.json()["error"]["code"] == "image_not_found"


def test_malformed_json_body(http: httpx.Client) -> None:
    r = http.post(
        "/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_readyz_before_and_after_load(make_gateway: GatewayFactory) -> None:
    loaded = threading.Event()
    gateway = make_gateway(engine=FakeEngine(loaded=loaded), wait=False)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "too early"}]}
    with httpx.Client(base_url=gateway.http_url, timeout=TIMEOUT) as http:
        try:
            assert http.get("/healthz").status_code == 200  # alive while loading
            r = http.get("/readyz")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            # the name vLLM and SGLang use: a gateway in front probes it before sending work
            assert http.get("/health").status_code == 503
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "busy"
            r = http.post("/v1/images", content=photo_bytes("coffee", size=32))
            assert r.status_code == 503 and r.json()["error"]["code"] == "busy"
        finally:
            loaded.set()
        gateway.server.wait_ready(timeout=TIMEOUT)
        r = http.get("/readyz")
        assert r.status_code == 200 and r.json() == {"status": "ready", "model": MODEL}
        assert http.get("/health").status_code == 200
        assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_busy_engine_is_429_with_retry_after(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(engine=FakeEngine(busy=True))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
    with httpx.Client(base_url=gateway.http_url, timeout=TIMEOUT) as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 429 and r.json()["error"]["code"] == "busy"
    assert float(r.headers["retry-after"]) > 0


def test_metrics_answer_prometheus_text(client: openai.OpenAI, http: httpx.Client) -> None:
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count me"}])
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    lines = r.text.splitlines()
    assert any(line.startswith("# TYPE visiongate_responses_total counter") for line in lines)
    # the response series name the API that answered; "http" is the errors' transport only
    completed = [
        line
        for line in lines
        if line.startswith("visiongate_responses_total{")
        and 'status="completed"' in line
        and 'api="chat_completions"' in line
    ]
    assert completed and float(completed[0].rsplit(" ", 1)[1]) >= 1


async def test_a_client_gone_before_the_answer_cancels_it(make_gateway: GatewayFactory) -> None:
    engine = FakeEngine(delay_s=0.2)  # 400 words: over a minute unless cancelled
    gateway = make_gateway(engine=engine)
    words = " ".join(f"w{i}" for i in range(400))
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": words}],
        "max_tokens": 400,
        "session_id": "gone-before-the-answer",
    }
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/chat/completions", json=body)
    await eventually(lambda: bool(engine.requests) and engine.requests[-1].cancel.is_set())
    await eventually(lambda: engine.running == 0)
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=TIMEOUT) as http:
        view = (await http.get("/v1/sessions/gone-before-the-answer")).json()
    answer = view["items"][-1]
    # cut short: what was generated is kept as an incomplete answer
    assert answer["role"] == "assistant" and answer["status"] == "incomplete"
    assert len(answer["content"][0]["text"].split()) < 400


def responses_counted(gateway: FakeGateway, status: str) -> float:
    with httpx.Client(base_url=gateway.http_url, timeout=TIMEOUT) as http:
        lines = http.get("/metrics").text.splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("visiongate_responses_total{") and f'status="{status}"' in line
    )


async def test_a_stream_closed_by_its_client_is_counted_as_cancelled(
    make_gateway: GatewayFactory,
) -> None:
    """A client (or a gateway in front) that closes a stream mid-answer: generation stops, and
    the response is still logged and counted, as cancelled."""
    engine = FakeEngine(delay_s=0.2)
    gateway = make_gateway(engine=engine)
    words = " ".join(f"w{i}" for i in range(400))
    body = {"model": MODEL, "messages": [{"role": "user", "content": words}], "stream": True}
    async with (
        httpx.AsyncClient(base_url=gateway.http_url, timeout=TIMEOUT) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if '"content"' in line:
                break  # the first text: the client goes away
    await eventually(lambda: bool(engine.requests) and engine.requests[-1].cancel.is_set())
    await eventually(lambda: responses_counted(gateway, "cancelled") >= 1)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where", ["gateway", "engine"])
def test_a_prompt_past_the_context_is_400(
    make_gateway: GatewayFactory, stream: bool, where: str
) -> None:
    # past the context by the gateway's count, or by the engine's own (its refusal)
    engine = (
        FakeEngine(context_tokens=64)
        if where == "gateway"
        else FakeEngine(refuse=EngineError("prompt too long", code="context_length_exceeded"))
    )
    gateway = make_gateway(engine=engine)
    words = " ".join(["word"] * 100) if where == "gateway" else "short"
    url = f"{gateway.http_url}/v1"
    with (
        openai.OpenAI(base_url=url, api_key="unused", timeout=TIMEOUT) as client,
        pytest.raises(openai.BadRequestError) as caught,
    ):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": words}], stream=stream
        )
    assert caught.value.code == "context_length_exceeded"
    # a 400 is not retried by the SDK (a 500 would have been, twice)
    assert len(engine.requests) == (0 if where == "gateway" else 1)


def test_cache_salt_narrows_the_keys_prefix_cache_namespace(make_gateway: GatewayFactory) -> None:
    """vLLM's `cache_salt`: a gateway in front of this one keeps its tenants apart with it."""
    gateway = make_gateway(settings={"api_keys": ["key-a"]})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    auth = {"Authorization": "Bearer key-a"}
    with httpx.Client(base_url=gateway.http_url, timeout=TIMEOUT, headers=auth) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        plain = gateway.engine.requests[-1].cache_salt
        salted = []
        for salt in ("tenant-1", "tenant-2"):
            r = http.post("/v1/chat/completions", json={**body, "cache_salt": salt})
            assert r.status_code == 200
            salted.append(gateway.engine.requests[-1].cache_salt)
        owners = [gateway.engine.requests[-1].owner]
        r = http.post("/v1/chat/completions", json={**body, "cache_salt": "x" * 257})
        legacy = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "cache_salt": "tenant-1"}
        assert http.post("/v1/completions", json=legacy).status_code == 200
        completion = gateway.engine.requests[-1]
    owner = gateway.state.auth.owner({"authorization": "Bearer key-a"})
    assert plain == owner  # the key's own namespace
    assert len({plain, *salted}) == 3 and all(s.startswith(owner) for s in salted)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    # a salt narrows the cache, never the key's share of the engine (its queue cap, fair share)
    assert owners == [owner] and completion.owner == owner
    assert completion.cache_salt == salted[0]


def test_health_is_the_model_while_readyz_also_asks_redis(make_gateway: GatewayFactory) -> None:
    """`/health` (what a gateway in front probes) stays 200 through a Redis outage, in which
    stateless requests still work; `/readyz` names the missing Redis."""
    from tests.conftest import free_port

    gateway = make_gateway(settings={"redis_url": f"redis://127.0.0.1:{free_port()}/0"}, wait=False)
    with httpx.Client(base_url=gateway.http_url, timeout=TIMEOUT) as http:
        deadline = time.monotonic() + TIMEOUT
        while http.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)  # the fake model loads at once; only Redis is missing
        ready = http.get("/readyz")
        health = http.get("/health")
    assert ready.status_code == 503 and "redis" in ready.json()["missing"]
    assert health.status_code == 200 and health.json() == {"status": "ok"}


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_tool_choice_without_tools_is_plain_text(
    client: openai.OpenAI, fake_gateway: FakeGateway, choice: str
) -> None:
    """As OpenAI takes it (clients send `auto` by default): no tools, so no grammar, on every
    API that has `tool_choice`; `required` still has nothing to call."""
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tool_choice=choice
    )
    assert chat.choices[0].message.content == "hi [0 images]"
    assert fake_gateway.engine.requests[-1].sampling.grammar is None
    response = client.responses.create(model=MODEL, input="hi", tool_choice=choice)
    assert response.output_text == "hi [0 images]"
    assert fake_gateway.engine.requests[-1].sampling.grammar is None
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", tool_choice="required")
    assert info.value.body["param"] == "tool_choice"


def test_an_answer_to_tool_results_without_tools_is_plain_text(
    client: openai.OpenAI, fake_gateway: FakeGateway
) -> None:
    """No tools offered now, but results in the history: the answer is words, not an imitation
    of the results' markup (what a small model otherwise writes), on both APIs."""
    from gateway.chat.output_grammar import plain_text_grammar

    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    )
    assert fake_gateway.engine.requests[-1].sampling.grammar == plain_text_grammar()
    client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
    )
    assert fake_gateway.engine.requests[-1].sampling.grammar == plain_text_grammar()
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert fake_gateway.engine.requests[-1].sampling.grammar is None  # no results: free text
