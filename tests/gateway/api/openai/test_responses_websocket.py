"""`/v1/responses` over WebSocket and `prompt_cache_options.prewarm`, through the real app over
the fake engine and encoder, with the official SDK's `responses.connect()` (sync and async) as
the client: a conversation about a photo with a tool call round trip, the SSE route's events
and answers, cancellation, errors that keep the connection, keys and tenancy, and a prewarm's
shape and refusals. The fake engine has no KV cache: `WarmingEngine` adds a warm-up that only
records what it was asked to prefill (the embedded engine's real one is tested in
`test_responses_prewarm.py`)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import websockets.sync.client as ws_client

from gateway.chat.tool_stream import render_tool_call
from gateway.engine.interface import (
    Delta,
    EngineCapabilities,
    GenerationRequest,
    GenerationResult,
    ImageInput,
    TextDelta,
    WarmUpResult,
)
from gateway.testing.fake_gateway import FakeGateway, GatewayFactory
from gateway.testing.fakes import FakeEngine
from gateway.testing.images import data_url, unique_photo
from tests.gateway.api.openai.conftest import fake_http as http  # noqa: F401 - fixture
from tests.gateway.api.openai.conftest import fake_openai as client  # noqa: F401 - fixture

MODEL = "fake-echo"
TIMEOUT = 10.0
ENDS = ("response.completed", "response.incomplete", "response.failed", "error")
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
PARIS = render_tool_call("get_weather", '{"city": "Paris"}')
WEATHER_PLEASE = "the weather where this was taken please"


class WarmingEngine(FakeEngine):
    """The fake engine with a KV warm-up that records each request and reports every prompt
    position as warmed (one per word and image token, as the fake counts tokens); asked
    `WEATHER_PLEASE`, it calls the weather tool (`PARIS`, a few characters a delta)."""

    capabilities = EngineCapabilities(warm_up=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.warm_ups: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        last = next(m for m in reversed(request.messages) if m.role == "user")
        if last.content != [WEATHER_PLEASE]:
            async for delta in super().generate(request):
                yield delta
            return
        self.requests.append(request)
        input_tokens, image_tokens = self._prompt_tokens(request)
        pieces = [PARIS[i : i + 5] for i in range(0, len(PARIS), 5)]
        for piece in pieces:
            await asyncio.sleep(self.delay_s)
            yield TextDelta(piece)
        yield GenerationResult(PARIS, "stop", input_tokens, image_tokens, len(pieces))

    async def warm_up(self, request: GenerationRequest) -> WarmUpResult:
        self.warm_ups.append(request)
        positions, _ = self._prompt_tokens(request)
        return WarmUpResult("warmed", positions=positions, computed=positions - 1)


def photo_message(text: str, photo: bytes) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "input_image", "image_url": data_url(photo)},
                {"type": "input_text", "text": text},
            ],
        }
    ]


def shape(messages: list[Any]) -> list[tuple[str, list[str]]]:
    """Messages as (role, parts): texts as they are, images by digest."""
    return [
        (m.role, [p if isinstance(p, str) else f"image:{p.digest}" for p in m.content])
        for m in messages
    ]


def until_end(connection: Any) -> list[Any]:
    """The events of one response (or one error), through its end."""
    events = []
    for event in connection:
        events.append(event)
        if event.type in ENDS:
            return events
    raise AssertionError(f"the connection closed after {[e.type for e in events]}")


def text_of(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def sse_types(http: httpx.Client, body: dict[str, Any]) -> list[str]:
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200, reply.read()
        return [
            line.removeprefix("event: ")
            for line in reply.iter_lines()
            if line.startswith("event: ")
        ]


def test_a_conversation_about_a_photo_with_a_tool_round_trip(
    make_gateway: GatewayFactory,
) -> None:
    gateway = make_gateway(engine=WarmingEngine())
    photo = unique_photo("coffee")
    question = photo_message("what is in this photo", photo)
    with gateway.openai_client() as client, gateway.http_client() as http:
        conversation(gateway, client, http, question)


def conversation(
    gateway: FakeGateway, client: openai.OpenAI, http: httpx.Client, question: list[Any]
) -> None:
    over_http = client.responses.create(model=MODEL, input=question)
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, input=question)
        first = until_end(connection)
        # the SSE stream's events, in order, and the HTTP route's answer
        assert [e.type for e in first] == sse_types(
            http, {"model": MODEL, "input": question, "store": False}
        )
        assert first[-1].type == "response.completed"
        assert text_of(first) == first[-1].response.output_text == over_http.output_text
        assert over_http.output_text == "what is in this photo [1 images]"
        opened = first[-1].response
        assert [e.sequence_number for e in first] == list(range(len(first)))

        # the chain continues on the connection's session: the photo's tokens come from the cache
        connection.response.create(
            model=MODEL,
            input=WEATHER_PLEASE,
            previous_response_id=opened.id,
            tools=[WEATHER],
            stream_id="lane-1",
        )
        called = until_end(connection)
        assert {e.stream_id for e in called} == {"lane-1"}
        done = called[-1].response
        assert done.previous_response_id == opened.id
        assert [item.type for item in done.output] == ["function_call"]
        call = done.output[0]
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
        assert done.visiongate["cache"]["vision"] == "hit"
        assert done.visiongate["session_id"] == opened.visiongate["session_id"]

        # the call's result goes back; the answer is words again
        connection.response.create(
            model=MODEL,
            input=[
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
                {"role": "user", "content": "and now"},
            ],
            previous_response_id=done.id,
            tools=[WEATHER],
        )
        answered = until_end(connection)
        assert answered[-1].response.output_text == "and now [0 images]"
    # the whole chain is stored, as over HTTP
    items = client.responses.input_items.list(answered[-1].response.id)
    assert {item.type for item in items.data} >= {"function_call_output", "message"}
    engine_prompt = gateway.engine.requests[-1].messages
    assert any(isinstance(p, ImageInput) for m in engine_prompt for p in m.content)


def test_async_stream_cancelled_mid_answer_and_errors_keep_the_connection(
    make_gateway: GatewayFactory,
) -> None:
    gateway = make_gateway(engine=FakeEngine(delay_s=0.05))
    words = " ".join(f"word{i}" for i in range(25))

    async def run() -> None:
        async with openai.AsyncOpenAI(
            base_url=f"{gateway.http_url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
        ) as client:
            async with client.responses.connect() as connection:
                # a bad request first: an error event, and the connection goes on
                await connection.response.create(model="no-such-model", input="x")
                error = await connection.recv()
                assert error.type == "error" and error.status == 404
                assert error.error.code == "model_not_found" and error.error.param == "model"
                await connection.send({"type": "no.such.event"})
                unknown = await connection.recv()
                assert (unknown.type, unknown.error.code) == ("error", "unknown_event")

                await connection.response.create(model=MODEL, input=words, max_output_tokens=30)
                deltas = 0
                async for event in connection:
                    if event.type == "response.output_text.delta":
                        deltas += 1
                        if deltas == 3:
                            await connection.send({"type": "response.cancel"})
                    if event.type in ENDS:
                        break
                assert event.type == "response.incomplete"
                assert event.response.status == "cancelled"
                assert 3 <= deltas < 25
                cancelled = event.response

                # an ended response takes no steer; the input comes back
                await connection.response.steer(
                    input="look left", previous_response_id=cancelled.id
                )
                steer = await connection.recv()
                assert steer.type == "response.steer.failed"
                assert steer.error.code == "response_already_completed"
                assert steer.steer.input == "look left"

                # and the connection still answers, continuing the cancelled response
                await connection.response.create(
                    model=MODEL, input="still here", previous_response_id=cancelled.id
                )
                async for event in connection:
                    if event.type in ENDS:
                        break
                assert event.type == "response.completed"
                assert event.response.output_text == "still here [0 images]"
            stored = await client.responses.retrieve(cancelled.id)
            assert stored.status == "cancelled" and stored.output_text.startswith("word0 word1")

    asyncio.run(run())


def test_http_cancel_stops_a_response_streaming_over_the_socket(
    make_gateway: GatewayFactory,
) -> None:
    gateway = make_gateway(engine=FakeEngine(delay_s=0.05))
    words = " ".join(f"w{i}" for i in range(25))
    with gateway.openai_client() as client, client.responses.connect() as connection:
        connection.response.create(model=MODEL, input=words, max_output_tokens=30)
        created = connection.recv()
        assert created.type == "response.created"
        cancelled: list[Any] = []
        thread = threading.Thread(
            target=lambda: cancelled.append(client.responses.cancel(created.response.id))
        )
        thread.start()
        events = until_end(connection)
        thread.join(TIMEOUT)
        assert events[-1].type == "response.incomplete"
        assert cancelled[0].status == "cancelled" and cancelled[0].id == created.response.id
        with pytest.raises(openai.BadRequestError) as info:  # it has ended
            client.responses.cancel(created.response.id)
        assert info.value.body["param"] == "response_id"
        with pytest.raises(openai.NotFoundError):
            client.responses.cancel("resp_nope")


def test_keys_and_tenancy_are_the_http_routes(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(engine=WarmingEngine(), settings=dict(api_keys=["key-a", "key-b"]))
    url = f"{gateway.http_url}/v1"
    with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(Exception) as info, stranger.responses.connect() as connection:
            connection.recv()  # refused before the socket opens
        assert "403" in str(info.value) or "1008" in str(info.value)
    with (
        openai.OpenAI(base_url=url, api_key="key-a", timeout=TIMEOUT, max_retries=0) as a,
        openai.OpenAI(base_url=url, api_key="key-b", timeout=TIMEOUT, max_retries=0) as b,
    ):
        mine = a.responses.create(model=MODEL, input=photo_message("mine", unique_photo()))
        with b.responses.connect() as connection:
            # another key's response: neither continued nor prewarmed, as over HTTP
            connection.response.create(model=MODEL, input="x", previous_response_id=mine.id)
            refused = until_end(connection)[-1]
            assert (refused.type, refused.error.code) == ("error", "previous_response_not_found")
            connection.response.create(
                model=MODEL, input="x", previous_response_id=mine.id, generate=False
            )
            refused = until_end(connection)[-1]
            assert (refused.type, refused.error.code) == ("error", "previous_response_not_found")
        with pytest.raises(openai.BadRequestError) as info:
            b.responses.create(
                model=MODEL,
                input="x",
                previous_response_id=mine.id,
                prompt_cache_options={"prewarm": True},
            )
        assert info.value.body["code"] == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):  # nor cancelled
            b.responses.cancel(mine.id)
    assert gateway.engine.warm_ups == []


def test_bad_frames_get_error_events_and_the_connection_stays(fake_gateway: FakeGateway) -> None:
    url = fake_gateway.http_url.replace("http://", "ws://") + "/v1/responses"
    with ws_client.connect(url) as socket:
        for frame, code in (
            ("not json", "invalid_json"),
            ("[1, 2]", "invalid_json"),
            ('{"type": "response.create", "model": "fake-echo"}', "invalid_request"),
            (
                '{"type": "response.create", "model": "fake-echo", "input": "x", "nope": 1}',
                "invalid_request",
            ),
            ('{"type": "response.create", "stream_id": 5}', "invalid_request"),
            ('{"type": "response.cancel"}', "response_not_found"),
        ):
            socket.send(frame)
            event = json.loads(socket.recv(timeout=TIMEOUT))
            assert (event["type"], event["error"]["code"]) == ("error", code), frame
            assert event["status"] in (400, 404)
        socket.send(json.dumps({"type": "response.create", "model": MODEL, "input": "ok then"}))
        while (event := json.loads(socket.recv(timeout=TIMEOUT)))["type"] not in ENDS:
            pass
        assert event["type"] == "response.completed"


def test_prewarm_answers_without_output_and_the_next_response_continues(
    make_gateway: GatewayFactory,
) -> None:
    gateway = make_gateway(engine=WarmingEngine())
    engine: WarmingEngine = gateway.engine  # type: ignore[assignment]
    photo = unique_photo("rocket")
    with gateway.openai_client() as client:
        warmed = client.responses.create(
            model=MODEL,
            input=photo_message("a photo", photo),
            prompt_cache_options={"prewarm": True, "ttl": "12h"},
            prompt_cache_key="shelf-7",
        )
        assert warmed.status == "completed" and warmed.output == []
        usage = warmed.usage
        assert usage.output_tokens == 0 and usage.input_tokens > 0
        assert usage.input_tokens_details.cache_write_tokens == usage.input_tokens - 1
        assert usage.input_tokens_details.cached_tokens == 1
        notes = " ".join(warmed.visiongate["notes"])
        assert "no output was generated" in notes and "ttl 12h" in notes
        assert "prompt_cache_key" in notes
        assert engine.requests == []  # nothing was generated
        (warm,) = engine.warm_ups
        assert warm.warm_up == "message" and warm.kv_key is not None
        assert sum(isinstance(p, ImageInput) for m in warm.messages for p in m.content) == 1

        answer = client.responses.create(
            model=MODEL, input="what is it", previous_response_id=warmed.id
        )
        assert answer.output_text == "what is it [0 images]"
        assert answer.visiongate["session_id"] == warmed.visiongate["session_id"]
        (asked,) = engine.requests
        assert asked.kv_key == warm.kv_key  # the same session's KV
        # the question's prompt starts with the warmed one
        assert shape(asked.messages[: len(warm.messages)]) == shape(warm.messages)
        (photo_item,) = client.responses.input_items.list(warmed.id).data
        assert photo_item.content[0].type == "input_image"

        # over the socket, generate: false is the same prewarm, streamed
        with client.responses.connect() as connection:
            connection.response.create(
                model=MODEL,
                input=photo_message("another", unique_photo("rocket")),
                generate=False,
            )
            events = until_end(connection)
        assert [e.type for e in events] == [
            "response.created",
            "response.in_progress",
            "response.completed",
        ]
        assert events[-1].response.output == [] and len(engine.warm_ups) == 2


def test_prewarm_refusals(client: openai.OpenAI, make_gateway: GatewayFactory) -> None:
    # the shared fake engine cannot warm up, as an upstream engine cannot yet
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", prompt_cache_options={"prewarm": True})
    assert info.value.body["param"] == "prompt_cache_options.prewarm"
    assert info.value.body["code"] == "invalid_request"
    gateway = make_gateway(engine=WarmingEngine())
    with gateway.openai_client() as warming:
        for extra, param in (
            ({"store": False}, "store"),
            (
                {"prompt_cache_options": {"prewarm": True, "comparison_response_id": "resp_1"}},
                "prompt_cache_options.comparison_response_id",
            ),
            ({"prompt_cache_options": {"prewarm": True, "ttl": "5m"}}, "prompt_cache_options.ttl"),
            ({"prompt_cache_key": ""}, "prompt_cache_key"),
        ):
            body = {"prompt_cache_options": {"prewarm": True}, **extra}
            with pytest.raises(openai.BadRequestError) as info:
                warming.responses.create(model=MODEL, input="x", extra_body=body)
            assert info.value.body["param"] == param, extra
    assert gateway.engine.warm_ups == []  # type: ignore[attr-defined]


def steer(connection: Any, target: str, value: Any) -> Any:
    connection.response.steer(input=value, previous_response_id=target)
    return connection


def test_a_steered_photo_encodes_at_once_and_its_successor_follows(
    make_gateway: GatewayFactory,
) -> None:
    gateway = make_gateway(engine=WarmingEngine(delay_s=0.05))
    words = " ".join(f"w{i}" for i in range(20))
    photo = unique_photo("chelsea")
    with gateway.openai_client() as client, client.responses.connect() as connection:
        connection.response.create(
            model=MODEL, input=words, max_output_tokens=25, stream_id="main", temperature=0
        )
        created = connection.recv()
        target = created.response.id
        steer(connection, target, photo_message("and this one", photo))
        events: list[Any] = []
        for event in connection:
            events.append(event)
            if event.type == "response.steer.accepted":
                assert event.steer.previous_response_id == target and event.stream_id == "main"
                accepted_at = len(events)
            if event.type == "response.completed" and event.response.id != target:
                break
        kinds = [e.type for e in events]
        # accepted while the target streamed; its photo was encoding before the target ended
        assert kinds.index("response.steer.accepted") < kinds.index("response.completed")
        assert "response.output_text.delta" in kinds[accepted_at:]
        assert hashlib.sha256(photo).hexdigest() in gateway.encoder.encoded
        # the successor: created after the target completed, continuing it with the input
        ends = [e for e in events if e.type == "response.completed"]
        assert ends[0].response.id == target and ends[0].response.output_text.startswith("w0")
        successor = ends[1].response
        assert successor.previous_response_id == target
        assert successor.output_text == "and this one [1 images]"
        assert successor.temperature == 0 and successor.max_output_tokens == 25  # inherited
        assert {e.stream_id for e in events} == {"main"}
        assert successor.visiongate["cache"]["vision"] == "hit"  # encoded while it waited

        # a response that has ended takes no steer, nor an unknown one
        for target_id, value, code in (
            (target, "more", "response_already_completed"),
            ("resp_nope", "more", "response_not_found"),
        ):
            failed = steer(connection, target_id, value).recv()
            assert (failed.type, failed.error.code) == ("response.steer.failed", code)
            assert failed.steer.input == value


def test_steering_a_response_that_calls_a_tool_waits_for_its_result(
    make_gateway: GatewayFactory,
) -> None:
    gateway = make_gateway(engine=WarmingEngine(delay_s=0.05))
    engine: WarmingEngine = gateway.engine  # type: ignore[assignment]
    with gateway.openai_client() as client, client.responses.connect() as connection:
        connection.response.create(model=MODEL, input=WEATHER_PLEASE, tools=[WEATHER])
        target = connection.recv().response.id
        steer(connection, target, "in Celsius please")
        bad = steer(connection, target, [{"role": "user", "content": "x", "id": "m1"}])
        events = []
        for event in bad:
            events.append(event)
            if event.type == "response.steer.pending":
                break
        kinds = [e.type for e in events]
        failed = next(e for e in events if e.type == "response.steer.failed")
        assert failed.error.code == "invalid_input"
        assert kinds.index("response.completed") < kinds.index("response.steer.pending")
        pending = events[-1]
        done = next(e for e in events if e.type == "response.completed").response
        (call,) = done.output
        assert pending.reason == "waiting_for_required_input"
        assert [(i.type, i.call_id) for i in pending.required_input] == [
            ("function_call_output", call.call_id)
        ]
        # the result goes back; the steered words go before it, in the same request
        connection.response.create(
            model=MODEL,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "20 C"}],
            previous_response_id=target,
            tools=[WEATHER],
        )
        answered = until_end(connection)[-1]
        assert answered.type == "response.completed"
        texts = [p for m in engine.requests[-1].messages for p in m.content if isinstance(p, str)]
        assert any("in Celsius please" in t for t in texts)
        assert any("20 C" in t for t in texts)


def test_a_steer_of_a_cancelled_response_comes_back(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(engine=FakeEngine(delay_s=0.05))
    words = " ".join(f"w{i}" for i in range(25))
    with gateway.openai_client() as client, client.responses.connect() as connection:
        connection.response.create(model=MODEL, input=words, max_output_tokens=30)
        target = connection.recv().response.id
        steer(connection, target, "then this")
        connection.send({"type": "response.cancel"})
        events = []
        for event in connection:
            events.append(event)
            if event.type == "response.steer.failed":
                break
        assert "response.steer.accepted" in [e.type for e in events]
        assert events[-1].error.code == "response_not_active"
        assert events[-1].steer.input == "then this" and events[-1].steer.id is not None


def test_prewarms_count_against_the_token_limits(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(engine=WarmingEngine(), settings=dict(input_tokens_per_minute=40))
    left = 60.0 - time.time() % 60.0  # one window for the whole test
    if left < 10:
        time.sleep(left + 0.05)
    codes = []
    with gateway.openai_client() as client:
        for i in range(8):
            try:
                warmed = client.responses.create(
                    model=MODEL,
                    input=photo_message(f"photo number {i} of a few", unique_photo()),
                    prompt_cache_options={"prewarm": True},
                )
                assert warmed.usage.input_tokens > 0
                codes.append(200)
            except openai.RateLimitError as exc:
                assert exc.body["code"] == "rate_limited"
                codes.append(429)
    assert codes[0] == 200 and 429 in codes, codes
    assert len(gateway.engine.warm_ups) == codes.count(200)  # type: ignore[attr-defined]


def test_a_model_still_loading_is_an_error_event_and_the_connection_stays(
    make_gateway: GatewayFactory,
) -> None:
    loaded = threading.Event()
    gateway = make_gateway(engine=FakeEngine(loaded=loaded), wait=False)
    try:
        with gateway.openai_client() as client, client.responses.connect() as connection:
            connection.response.create(model=MODEL, input="too early")
            busy = connection.recv()
            assert (busy.type, busy.error.code, busy.status) == ("error", "busy", 503)
            connection.response.steer(input="x", previous_response_id="resp_1")
            failed = connection.recv()
            assert failed.type == "response.steer.failed"
            loaded.set()
            gateway.server.wait_ready(timeout=TIMEOUT)
            connection.response.create(model=MODEL, input="now then")
            assert until_end(connection)[-1].response.output_text == "now then [0 images]"
    finally:
        loaded.set()


def test_prewarm_is_refused_over_upstream_replicas_sent_data_urls() -> None:
    """The upstream engine warms replicas in embeds mode only: with images sent as data URLs
    a prewarm is refused before anything is stored or sent to a replica."""
    from gateway.server.app import create_app
    from gateway.server.runner import ServerThread
    from gateway.settings import Settings
    from gateway.testing.upstream_fake import FakeUpstream
    from tests.conftest import free_port

    with FakeUpstream("org/Upstream-VLM") as upstream:
        settings = Settings(engine="openai", upstreams=[upstream.url], port=free_port())
        with ServerThread(create_app(settings), settings, port=settings.port) as server:
            server.wait_ready(timeout=60)
            with (
                openai.OpenAI(
                    base_url=f"{server.http_url}/v1", api_key="none", max_retries=0
                ) as client,
                pytest.raises(openai.BadRequestError) as info,
            ):
                client.responses.create(
                    model="org/Upstream-VLM",
                    input=photo_message("a photo", unique_photo()),
                    prompt_cache_options={"prewarm": True},
                )
        assert info.value.body["param"] == "prompt_cache_options.prewarm"
        assert "embeds" in info.value.body["message"]
        assert upstream.chat_requests() == []
