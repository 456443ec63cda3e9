"""What a session starts from: the served model, and no system prompt of the gateway's own.

A Realtime client may name the model in the URL (`?model=`, as the OpenAI SDKs do) or in
`session.update`; only the served one (the one `/v1/models` lists) is taken, another is refused
with `model_not_found` and changes nothing. Without `default_instructions` a conversation that
has no system message reaches the model without one, so the model's chat template applies its
own default (SmolLM2's names itself); an operator's default still replaces it. Fake engine and
encoder over real WebSockets and HTTP, the real SmolLM2 tokenizer for the rendering.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import websockets

from gateway.engine.interface import Message
from gateway.settings import Settings
from gateway.testing.fake_gateway import FakeGateway, GatewayFactory
from gateway.testing.realtime_peer import Peer

TIMEOUT = 10.0
SMOLLM2_DEFAULT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


async def session_view(gateway: FakeGateway, session_id: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=TIMEOUT) as client:
        r = await client.get(f"/v1/sessions/{session_id}")
    assert r.status_code == 200, r.text
    return r.json()


async def served_model(gateway: FakeGateway) -> str:
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=TIMEOUT) as client:
        r = await client.get("/v1/models")
    return r.json()["data"][0]["id"]


# ---------------------------------------------------------------- the model


async def test_session_update_takes_the_served_model(fake_gateway: FakeGateway) -> None:
    model = await served_model(fake_gateway)
    peer = await Peer.open(fake_gateway.ws_url)
    try:
        await peer.send(
            {
                "type": "session.update",
                "event_id": "u1",
                "session": {"type": "realtime", "model": model, "instructions": "Be brief."},
            }
        )
        updated, seen = await peer.until("session.updated", "error", timeout=TIMEOUT)
        assert updated["type"] == "session.updated", updated
        assert updated["session"]["model"] == model and not seen
        assert (await session_view(fake_gateway, peer.session_id))["instructions"] == "Be brief."
    finally:
        await peer.close()


@pytest.mark.parametrize("model", ["gpt-realtime", "", "FAKE-ECHO", "fake-echo ", "m" * 5000])
async def test_session_update_refuses_another_model_and_changes_nothing(
    fake_gateway: FakeGateway, model: str
) -> None:
    peer = await Peer.open(fake_gateway.ws_url)
    try:
        before = await session_view(fake_gateway, peer.session_id)
        await peer.send(
            {
                "type": "session.update",
                "event_id": "u2",
                "session": {
                    "model": model,
                    "instructions": "Speak like a pirate.",
                    "max_output_tokens": 7,
                    "temperature": 0.5,
                },
            }
        )
        error, _ = await peer.until("error", "session.updated", timeout=TIMEOUT)
        assert error["type"] == "error", error
        assert error["error"]["code"] == "model_not_found"
        assert error["error"]["param"] == "session.model"
        assert error["error"]["event_id"] == "u2"
        assert "fake-echo" in error["error"]["message"]
        assert len(error["error"]["message"]) <= 500
        after = await session_view(fake_gateway, peer.session_id)
        assert after == before
        # the connection stays open and usable: an update without a model still applies
        await peer.send({"type": "session.update", "session": {"max_output_tokens": 9}})
        updated, _ = await peer.until("session.updated", "error", timeout=TIMEOUT)
        assert updated["type"] == "session.updated", updated
        assert updated["session"]["max_output_tokens"] == 9
        assert updated["session"]["instructions"] == before["instructions"]
    finally:
        await peer.close()


async def test_the_url_model_must_be_the_served_one(fake_gateway: FakeGateway) -> None:
    url = fake_gateway.ws_url
    async with websockets.connect(f"{url}?model=fake-echo") as ws:
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created" and created["session"]["model"] == "fake-echo"
    sessions_before = await fake_gateway.state.sessions.count()
    async with websockets.connect(f"{url}?model=gpt-realtime") as ws:
        error = json.loads(await ws.recv())
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
    assert error["type"] == "error"
    assert error["error"]["code"] == "model_not_found" and error["error"]["param"] == "model"
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    assert closed.value.rcvd.reason == "model_not_found"
    assert await fake_gateway.state.sessions.count() == sessions_before  # no session was opened


async def test_the_url_model_is_checked_before_a_session_is_resumed(
    fake_gateway: FakeGateway,
) -> None:
    peer = await Peer.open(fake_gateway.ws_url)
    await peer.close()
    url = f"{fake_gateway.ws_url}?session_id={peer.session_id}&model=other"
    async with websockets.connect(url) as ws:
        error = json.loads(await ws.recv())
    assert error["error"]["code"] == "model_not_found"


async def test_the_openai_realtime_client_names_the_model(fake_gateway: FakeGateway) -> None:
    client = openai.AsyncOpenAI(base_url=f"{fake_gateway.http_url}/v1", api_key="unused")
    try:
        async with client.realtime.connect(model="fake-echo") as conn:
            created = await conn.recv()
            assert created.type == "session.created"
            await conn.session.update(session={"type": "realtime", "model": "gpt-realtime"})
            refused = await conn.recv()
            assert refused.type == "error" and refused.error.code == "model_not_found"
            assert refused.error.param == "session.model"
        async with client.realtime.connect(model="gpt-realtime") as conn:
            refused = await conn.recv()
            assert refused.type == "error" and refused.error.code == "model_not_found"
    finally:
        await client.close()


# ---------------------------------------------------------------- the default instructions


def test_default_instructions_are_empty_unless_an_operator_sets_them() -> None:
    assert Settings.load({}, environ={}).default_instructions == ""
    env = {"VISIONGATE_DEFAULT_INSTRUCTIONS": "Answer in French."}
    assert Settings.load({}, environ=env).default_instructions == "Answer in French."
    assert Settings.load({"default_instructions": "Be brief."}, environ=env).default_instructions


def test_smollm2_template_applies_its_own_default_without_a_system_message() -> None:
    from transformers import AutoTokenizer

    from gateway.engine.local.prompt import render
    from tests.vlm_checkpoints import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())

    def rendered(messages: list[Message]) -> str:
        prompt = render(tokenizer, messages, add_generation_prompt=True)
        return tokenizer.decode(prompt.tokens)

    plain = rendered([Message("user", ["What is the capital of France?"])])
    assert SMOLLM2_DEFAULT in plain
    assert plain.index(SMOLLM2_DEFAULT) < plain.index("capital of France")
    instructed = rendered(
        [Message("system", ["Answer in French."]), Message("user", ["What is the capital?"])]
    )
    assert SMOLLM2_DEFAULT not in instructed and "Answer in French." in instructed


def system_messages(gateway: FakeGateway) -> list[list[Any]]:
    return [m.content for m in gateway.engine.requests[-1].messages if m.role == "system"]


async def test_no_system_message_reaches_the_model_unless_someone_sends_one(
    make_gateway: GatewayFactory,
) -> None:
    gateway = make_gateway()
    peer = await Peer.open(gateway.ws_url)
    try:
        assert peer.created["session"]["instructions"] == ""
        await peer.add([{"type": "input_text", "text": "hi there"}])
        done, _ = await peer.respond()
        assert done["response"]["status"] == "completed"
        assert system_messages(gateway) == []
        await peer.send({"type": "session.update", "session": {"instructions": "Be brief."}})
        await peer.until("session.updated", timeout=TIMEOUT)
        await peer.respond()
        assert system_messages(gateway) == [["Be brief."]]
    finally:
        await peer.close()
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=TIMEOUT) as client:
        body: dict[str, Any] = {
            "model": "fake-echo",
            "messages": [{"role": "user", "content": "hello"}],
        }
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert system_messages(gateway) == []
        # a session joined over HTTP (reconcile) keeps the conversation's own: none
        r = await client.post("/v1/chat/completions", json={**body, "session_id": "s-http-1"})
        assert r.status_code == 200, r.text
        assert system_messages(gateway) == []
        assert (await session_view(gateway, "s-http-1"))["instructions"] == ""
        body["messages"].insert(0, {"role": "system", "content": "Be formal."})
        r = await client.post("/v1/chat/completions", json={**body, "session_id": "s-http-1"})
        assert system_messages(gateway) == [["Be formal."]]


async def test_an_operators_default_instructions_still_apply(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(settings=dict(default_instructions="Answer in French."))
    peer = await Peer.open(gateway.ws_url)
    try:
        assert peer.created["session"]["instructions"] == "Answer in French."
        await peer.add([{"type": "input_text", "text": "hi"}])
        await peer.respond()
        assert system_messages(gateway) == [["Answer in French."]]
    finally:
        await peer.close()
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=TIMEOUT) as client:
        body = {"model": "fake-echo", "messages": [{"role": "user", "content": "hello"}]}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert system_messages(gateway) == [["Answer in French."]]
