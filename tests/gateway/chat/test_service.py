"""`ChatService` on its own: no server, the fake engine and encoder, the real resolver, caches
and memory session store."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass

from gateway.caching import make_image_store, make_vision_cache
from gateway.chat.events import Finished, ResponseOptions, ServiceEvent, Started, TextChunk
from gateway.chat.service import ChatService, kv_key_for
from gateway.chat.tool_stream import render_tool_call, render_tool_result, split_answer
from gateway.chat.vision_resolver import VisionResolver
from gateway.engine.interface import EngineError, ImageInput
from gateway.sessions import MemorySessionStore, Session, StoredItem, StoredPart
from gateway.testing.fake_gateway import eventually
from gateway.testing.fakes import FakeEncoder, FakeEngine
from tests.conftest import photo_bytes
from tests.gateway.api.openai.test_chat_tools import PARIS, ScriptedEngine

MiB = 1024 * 1024
OWNER = "key_owner"
INSTRUCTIONS = "Answer briefly."


@dataclass
class Parts:
    service: ChatService
    engine: FakeEngine
    encoder: FakeEncoder
    vision: VisionResolver
    sessions: MemorySessionStore


def build(engine: FakeEngine | None = None, encoder: FakeEncoder | None = None) -> Parts:
    engine = engine or FakeEngine()
    encoder = encoder or FakeEncoder()
    vision = VisionResolver(
        encoder, make_vision_cache(None, 64 * MiB, 3600), make_image_store(None, 64 * MiB, 3600)
    )
    sessions = MemorySessionStore(3600)
    service = ChatService(
        engine=engine, vision=vision, sessions=sessions, max_output_tokens_limit=64
    )
    return Parts(service, engine, encoder, vision, sessions)


async def new_session(parts: Parts, *user_parts: StoredPart) -> Session:
    session = Session.new(OWNER, instructions=INSTRUCTIONS, max_output_tokens=32)
    session.items.append(StoredItem(id="item_user1", role="user", parts=list(user_parts)))
    await parts.sessions.save(session)
    return session


def text(value: str) -> StoredPart:
    return StoredPart("text", text=value)


async def collect(
    parts: Parts, session: Session, options: ResponseOptions | None = None, **kwargs
) -> list[ServiceEvent]:
    return [
        ev async for ev in parts.service.respond(session, options or ResponseOptions(), **kwargs)
    ]


def prompt_tokens(engine: FakeEngine, *texts: str) -> int:
    """What the fake engine counts for these text parts (each part ends with one token)."""
    return sum(engine.count_tokens(t) + 1 for t in texts)


async def test_events_in_order_and_answer_stored() -> None:
    parts = build()
    session = await new_session(parts, text("describe the red kite"))
    options = ResponseOptions()
    events = await collect(parts, session, options)

    assert isinstance(events[0], Started)
    assert (events[0].response_id, events[0].item_id) == (options.response_id, options.item_id)
    assert all(isinstance(ev, TextChunk) for ev in events[1:-1]) and len(events) > 3
    done = events[-1]
    assert isinstance(done, Finished) and done.status == "completed" and done.error is None
    chunks = "".join(ev.text for ev in events[1:-1])
    assert chunks == done.text
    assert done.text.startswith("describe the red kite")  # the fake echoes the question
    assert done.output_tokens == len(events) - 2  # one word per delta
    assert done.input_tokens == prompt_tokens(parts.engine, INSTRUCTIONS, "describe the red kite")
    assert done.text_tokens == done.input_tokens and done.image_tokens == 0
    assert done.vision == "none"

    # the engine saw the instructions and the question, under the session's KV namespace
    request = parts.engine.requests[-1]
    assert [m.role for m in request.messages] == ["system", "user"]
    assert request.messages[0].content == [INSTRUCTIONS]
    assert request.kv_key == kv_key_for(OWNER, session.id) and request.cache_salt == OWNER

    stored = await parts.sessions.load(session.id, OWNER)
    answer = stored.items[-1]
    assert (answer.id, answer.role, answer.status) == (options.item_id, "assistant", "completed")
    assert answer.parts == [text(done.text)] and answer.response_id == options.response_id


async def test_image_is_encoded_once_then_served_from_the_cache() -> None:
    parts = build()
    photo = photo_bytes("astronaut", size=64)
    digest = hashlib.sha256(photo).hexdigest()
    await parts.vision.add(OWNER, digest, photo)
    session = await new_session(parts, StoredPart("image", digest=digest), text("what is it"))

    first = (await collect(parts, session))[-1]
    assert isinstance(first, Finished) and first.status == "completed"
    assert first.image_tokens == parts.encoder.tokens == first.image_tokens_total
    assert first.input_tokens == first.text_tokens + first.image_tokens
    assert first.vision == "miss" and first.text.endswith("[1 images]")
    image = next(
        p for p in parts.engine.requests[-1].messages[-1].content if isinstance(p, ImageInput)
    )
    assert tuple(image.embeds.shape) == (parts.encoder.tokens, parts.engine.hidden_size)
    assert image.digest.endswith(digest)

    session = await parts.sessions.load(session.id, OWNER)
    second = (await collect(parts, session))[-1]
    assert isinstance(second, Finished) and second.vision == "hit"
    assert second.timings["encode_ms"] == 0.0
    assert parts.encoder.encoded == [digest]  # encoded once for both turns


async def test_a_pending_pre_encode_is_joined_not_repeated() -> None:
    parts = build(encoder=FakeEncoder(delay_s=0.05))
    photo = photo_bytes("chelsea", size=48)
    digest = hashlib.sha256(photo).hexdigest()
    await parts.vision.add(OWNER, digest, photo)
    session = await new_session(parts, StoredPart("image", digest=digest), text("and this"))
    pending = {digest: parts.vision.start(OWNER, digest)}

    done = (await collect(parts, session, pending=pending))[-1]
    assert isinstance(done, Finished) and done.status == "completed"
    assert pending == {}  # consumed: the next response finds the tokens in the cache
    assert parts.encoder.encoded == [digest] and parts.vision.encodes == 1
    assert done.timings["encode_ms"] > 0  # it waited for the encode still running


async def test_max_output_tokens_ends_incomplete() -> None:
    parts = build()
    session = await new_session(parts, text("one two three four five six"))
    events = await collect(parts, session, ResponseOptions(max_output_tokens=2))
    done = events[-1]
    assert isinstance(done, Finished)
    assert (done.status, done.reason, done.output_tokens) == ("incomplete", "max_output_tokens", 2)
    assert done.text == "one two"
    assert parts.engine.requests[-1].sampling.max_output_tokens == 2
    stored = (await parts.sessions.load(session.id, OWNER)).items[-1]
    assert (stored.status, stored.parts) == ("incomplete", [text("one two")])


async def test_max_output_tokens_is_capped_by_the_limit() -> None:
    parts = build()
    session = await new_session(parts, text("hello"))
    await collect(parts, session, ResponseOptions(max_output_tokens=10_000))
    assert parts.engine.requests[-1].sampling.max_output_tokens == 64


async def test_sampling_comes_from_the_session_unless_the_response_overrides_it() -> None:
    parts = build()
    session = await new_session(parts, text("hello"))
    session.temperature, session.top_p, session.seed = 0.7, 0.9, 11
    await collect(parts, session, ResponseOptions(top_p=0.5, stop=("zzz",)))
    sampling = parts.engine.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.seed) == (0.7, 0.5, 11)
    assert sampling.stop == ("zzz",)


async def test_stop_string_cuts_the_answer_and_never_leaks() -> None:
    parts = build()
    session = await new_session(parts, text("alpha beta gamma delta"))
    events = await collect(parts, session, ResponseOptions(stop=("a gam",)))
    done = events[-1]
    assert isinstance(done, Finished) and done.status == "completed"
    assert done.text == "alpha bet"
    assert "".join(ev.text for ev in events if isinstance(ev, TextChunk)) == done.text


async def test_cancel_mid_stream_is_cancelled_and_stored_incomplete() -> None:
    parts = build(FakeEngine(delay_s=0.02))
    session = await new_session(parts, text(" ".join(f"w{i}" for i in range(40))))
    options = ResponseOptions()
    events: list[ServiceEvent] = []
    async for ev in parts.service.respond(session, options):
        events.append(ev)
        if sum(isinstance(e, TextChunk) for e in events) == 2:
            options.cancel.set()
    done = events[-1]
    assert isinstance(done, Finished)
    assert (done.status, done.reason) == ("cancelled", "client_cancelled")
    streamed = "".join(ev.text for ev in events if isinstance(ev, TextChunk))
    assert done.text == streamed and 2 <= done.output_tokens < 40
    stored = (await parts.sessions.load(session.id, OWNER)).items[-1]
    assert (stored.id, stored.status, stored.parts) == (
        options.item_id,
        "incomplete",
        [text(streamed)],
    )
    assert parts.engine.running == 0


async def test_store_false_leaves_the_session_alone() -> None:
    parts = build()
    session = await new_session(parts, text("do not keep this"))
    before = await parts.sessions.load(session.id, OWNER)
    done = (await collect(parts, session, ResponseOptions(store=False)))[-1]
    assert isinstance(done, Finished) and done.status == "completed" and done.text
    after = await parts.sessions.load(session.id, OWNER)
    assert after.items == before.items
    assert parts.engine.requests[-1].kv_key is None  # nothing kept for a turn kept out


async def test_missing_image_fails_with_its_code_and_drops_the_placeholder() -> None:
    parts = build()
    session = await new_session(parts, StoredPart("image", digest="ab" * 32), text("and this?"))
    events = await collect(parts, session)
    assert isinstance(events[0], Started)
    done = events[-1]
    assert len(events) == 2 and isinstance(done, Finished)
    assert done.status == "failed" and done.error is not None
    assert done.error.code == "image_not_found"
    assert parts.engine.requests == []  # never reached the engine
    stored = await parts.sessions.load(session.id, OWNER)
    assert [i.id for i in stored.items] == ["item_user1"]


async def test_undecodable_image_fails_with_the_encoder_code() -> None:
    parts = build()
    junk = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64  # a PNG signature and nothing behind it
    digest = hashlib.sha256(junk).hexdigest()
    await parts.vision.add(OWNER, digest, junk)
    session = await new_session(parts, StoredPart("image", digest=digest))
    done = (await collect(parts, session))[-1]
    assert isinstance(done, Finished) and done.status == "failed"
    assert done.error is not None and done.error.code == "invalid_image"
    assert [i.id for i in (await parts.sessions.load(session.id, OWNER)).items] == ["item_user1"]


async def test_engine_refusal_keeps_its_code() -> None:
    refusal = EngineError("the prompt has 9000 tokens", code="context_length_exceeded")
    parts = build(FakeEngine(refuse=refusal))
    session = await new_session(parts, text("hello"))
    done = (await collect(parts, session))[-1]
    assert isinstance(done, Finished) and done.status == "failed"
    assert done.error is not None and done.error.code == "context_length_exceeded"
    assert done.error.http_status == 400 and "9000 tokens" in done.error.message
    assert [i.id for i in (await parts.sessions.load(session.id, OWNER)).items] == ["item_user1"]


async def test_engine_error_with_an_unknown_code_is_an_engine_error() -> None:
    parts = build(FakeEngine(refuse=EngineError("the device fell over", code="cuda_oom")))
    session = await new_session(parts, text("hello"))
    done = (await collect(parts, session))[-1]
    assert isinstance(done, Finished) and done.status == "failed"
    assert done.error is not None and done.error.code == "engine_error"


async def test_a_conversation_over_the_context_fails_with_context_length_exceeded() -> None:
    parts = build(FakeEngine(context_tokens=5))
    session = await new_session(parts, text("far too many words for this tiny context window"))
    done = (await collect(parts, session))[-1]
    assert isinstance(done, Finished) and done.status == "failed"
    assert done.error is not None and done.error.code == "context_length_exceeded"
    assert [i.id for i in (await parts.sessions.load(session.id, OWNER)).items] == ["item_user1"]


async def test_engine_fault_mid_stream_fails_with_the_text_so_far() -> None:
    parts = build(FakeEngine(fail_after=2))
    session = await new_session(parts, text("one two three four"))
    events = await collect(parts, session)
    done = events[-1]
    assert isinstance(done, Finished) and done.status == "failed"
    assert done.error is not None and done.error.code == "engine_error"
    assert done.text == "one two" == "".join(e.text for e in events if isinstance(e, TextChunk))
    assert [i.id for i in (await parts.sessions.load(session.id, OWNER)).items] == ["item_user1"]


async def test_engine_busy_maps_to_busy_with_retry_after() -> None:
    parts = build(FakeEngine(busy=True))
    session = await new_session(parts, text("hello"))
    done = (await collect(parts, session))[-1]
    assert isinstance(done, Finished) and done.status == "failed" and done.error is not None
    assert done.error.code == "busy"
    assert done.error.retry_after_s == 1.0 and done.error.http_status == 429
    assert [i.id for i in (await parts.sessions.load(session.id, OWNER)).items] == ["item_user1"]


async def test_closing_the_iterator_early_cancels_the_engine_request() -> None:
    parts = build(FakeEngine(delay_s=0.05))
    session = await new_session(parts, text(" ".join(f"w{i}" for i in range(40))))
    options = ResponseOptions()
    stream = parts.service.respond(session, options)
    assert isinstance(await anext(stream), Started)
    assert isinstance(await anext(stream), TextChunk)
    request = parts.engine.requests[-1]
    assert parts.engine.running == 1 and not request.cancel.is_set()
    await stream.aclose()
    assert request.cancel.is_set() and options.cancel.is_set()
    await eventually(lambda: parts.engine.running == 0)  # the engine's stream ends too
    assert len(parts.engine.requests) == 1


async def test_closing_the_iterator_closes_the_engine_stream_before_it_returns() -> None:
    parts = build(FakeEngine())
    session = await new_session(parts, text("one two three four"))
    stream = parts.service.respond(session, ResponseOptions())
    assert isinstance(await anext(stream), Started)
    assert isinstance(await anext(stream), TextChunk)
    assert parts.engine.running == 1
    await stream.aclose()
    # closed by the close itself, not later when a collected generator is finalized
    assert parts.engine.running == 0


async def test_cancel_while_waiting_for_an_image_ends_before_the_encode() -> None:
    gate = threading.Event()
    parts = build(encoder=FakeEncoder(gate=gate))
    photo = photo_bytes("coffee", size=40)
    digest = hashlib.sha256(photo).hexdigest()
    await parts.vision.add(OWNER, digest, photo)
    session = await new_session(parts, StoredPart("image", digest=digest))
    options = ResponseOptions()
    stream = parts.service.respond(session, options)
    assert isinstance(await anext(stream), Started)
    rest = asyncio.ensure_future(anext(stream))
    await eventually(lambda: parts.encoder._waiting == 1)  # the encode has begun and is held
    options.cancel.set()
    done = await rest
    assert isinstance(done, Finished) and done.status == "cancelled"
    assert parts.encoder.encoded == []  # it ended while the encode was still held
    assert parts.engine.requests == []
    assert [i.id for i in (await parts.sessions.load(session.id, OWNER)).items] == ["item_user1"]
    # the encode was not thrown away: it goes on and fills the cache for the next turn
    gate.set()
    await eventually(lambda: parts.encoder.encoded == [digest])
    assert await parts.vision.cached(OWNER, digest) is not None


async def test_n_answers_stream_by_index_and_only_the_first_is_stored() -> None:
    parts = build()
    session = await new_session(parts, text("red kite"))
    options = ResponseOptions(n=3, logprobs=1)
    events = await collect(parts, session, options)
    done = events[-1]
    assert isinstance(done, Finished) and done.status == "completed"
    assert parts.engine.requests[-1].sampling.n == 3
    assert parts.engine.requests[-1].sampling.logprobs == 1
    chunks = [ev for ev in events if isinstance(ev, TextChunk)]
    for end in done.choices:
        streamed = "".join(ev.text for ev in chunks if ev.index == end.index)
        assert streamed == end.text and end.status == "completed"
        tokens = [t for ev in chunks if ev.index == end.index for t in ev.logprobs]
        assert "".join(t.token for t in [*tokens, *end.logprobs]) == end.text
    assert [end.index for end in done.choices] == [0, 1, 2]
    assert done.text == done.choices[0].text == "red kite [0 images]"
    assert done.output_tokens == sum(end.output_tokens for end in done.choices) == 3 + 4 + 4
    stored = (await parts.sessions.load(session.id, OWNER)).items[-1]
    assert stored.parts == [text(done.text)]


async def test_one_answer_leaves_choices_empty() -> None:
    parts = build()
    session = await new_session(parts, text("hello"))
    done = (await collect(parts, session))[-1]
    assert isinstance(done, Finished) and done.choices == [] and done.logprobs == ()


async def test_tools_prompt_follows_the_instructions_and_a_grammar_goes_to_the_engine() -> None:
    parts = build()
    session = await new_session(parts, text("hello"))
    options = ResponseOptions(tools_prompt="# Tools\nget_weather", grammar='start: "x"\n')
    await collect(parts, session, options)
    request = parts.engine.requests[-1]
    assert request.messages[0].content == [f"{INSTRUCTIONS}\n\n# Tools\nget_weather"]
    assert request.sampling.grammar == 'start: "x"\n'

    session.instructions = ""
    await collect(parts, session, ResponseOptions(tools_prompt="# Tools"))
    assert parts.engine.requests[-1].messages[0].content == ["# Tools"]


async def test_tool_calls_and_results_render_as_the_model_writes_them() -> None:
    parts = build()
    session = await new_session(parts, text("weather in Paris?"))
    call = StoredPart("tool_call", text='{"city": "Paris"}', name="get_weather", call_id="call_1")
    session.items += [
        StoredItem(id="item_a", role="assistant", parts=[call]),
        StoredItem(
            id="item_t", role="tool", parts=[StoredPart("text", text="sunny", call_id="call_1")]
        ),
        StoredItem(id="item_b", role="assistant", parts=[text("Let me check."), call]),
    ]
    await collect(parts, session)
    messages = parts.engine.requests[-1].messages
    assert [m.role for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2].content == [render_tool_call("get_weather", '{"city": "Paris"}')]
    assert messages[3].content == [render_tool_result("sunny")]
    assert messages[4].content == [
        "Let me check." + render_tool_call("get_weather", '{"city": "Paris"}')
    ]


async def test_an_answer_with_tools_is_stored_as_text_and_calls() -> None:
    parts = build(ScriptedEngine(PARIS))
    session = await new_session(parts, text("weather in Paris?"))
    options = ResponseOptions(tools=True)
    done = (await collect(parts, session, options))[-1]
    assert isinstance(done, Finished) and done.text == PARIS
    [call] = split_answer(PARIS, options.response_id)[1]
    stored = (await parts.sessions.load(session.id, OWNER)).items[-1]
    assert stored.parts == [
        StoredPart("tool_call", text='{"city": "Paris"}', name="get_weather", call_id=call.id)
    ]

    # without tools the same text is only text
    session = await new_session(parts, text("weather in Paris?"))
    await collect(parts, session, ResponseOptions())
    assert (await parts.sessions.load(session.id, OWNER)).items[-1].parts == [text(PARIS)]


async def test_context_overflow_is_context_length_exceeded() -> None:
    # past the context by the gateway's own count, and refused by the engine's count
    parts = build(FakeEngine(context_tokens=64))
    session = await new_session(parts, text(" ".join(["word"] * 80)))
    session.truncation = "disabled"
    done = (await collect(parts, session))[-1]
    assert isinstance(done, Finished) and done.status == "failed"
    assert done.error is not None and done.error.code == "context_length_exceeded"

    refusing = FakeEngine(refuse=EngineError("prompt too long", code="context_length_exceeded"))
    parts = build(refusing)
    session = await new_session(parts, text("short"))
    done = (await collect(parts, session))[-1]
    assert isinstance(done, Finished) and done.error is not None
    assert done.error.code == "context_length_exceeded" and done.error.http_status == 400
