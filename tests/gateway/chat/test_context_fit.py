"""ChatService keeps a session usable past the model's context, keeps a partial answer when its
consumer goes away, and reports an answer it could not store (fake engine and encoder; the
vision resolver, caches and session store are the real in-memory ones)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.caching import make_image_store, make_vision_cache
from gateway.chat.events import Finished, ResponseOptions, TextChunk
from gateway.chat.service import ChatService
from gateway.chat.vision_resolver import VisionResolver
from gateway.protocol.errors import GatewayError
from gateway.sessions import MemorySessionStore, Session, StoredItem, StoredPart
from gateway.testing.fakes import FakeEncoder, FakeEngine

OWNER = "owner-a"


def build(
    engine: FakeEngine, sessions: MemorySessionStore | None = None
) -> tuple[ChatService, MemorySessionStore]:
    sessions = sessions or MemorySessionStore(3600)
    vision = VisionResolver(
        FakeEncoder(hidden_size=engine.hidden_size),
        make_vision_cache(None, 1 << 24, 60),
        make_image_store(None, 1 << 24, 60),
    )
    service = ChatService(
        engine=engine, vision=vision, sessions=sessions, max_output_tokens_limit=256
    )
    return service, sessions


def turn(role: str, text: str, n: int) -> StoredItem:
    return StoredItem(id=f"item_{role}_{n}", role=role, parts=[StoredPart("text", text=text)])


async def long_session(sessions: MemorySessionStore, turns: int, words: int, **fields) -> Session:
    session = Session.new(OWNER, instructions="be brief", max_output_tokens=16, **fields)
    for n in range(turns):
        session.items.append(turn("user", " ".join(f"q{n}w{i}" for i in range(words)), n))
        session.items.append(turn("assistant", " ".join(f"a{n}w{i}" for i in range(words)), n))
    session.items.append(turn("user", "latest question here", turns))
    await sessions.save(session)
    return session


async def run(service: ChatService, session: Session, options: ResponseOptions) -> Finished:
    finished = None
    async for ev in service.respond(session, options):
        if isinstance(ev, Finished):
            finished = ev
    assert finished is not None
    return finished


async def test_auto_truncation_leaves_out_the_oldest_turns_and_keeps_them_stored() -> None:
    engine = FakeEngine(context_tokens=400)
    service, sessions = build(engine)
    # 6 turns of 2 x 60-word items: about 800 tokens with overhead, twice the context
    session = await long_session(sessions, turns=6, words=60)
    done = await run(service, session, ResponseOptions(max_output_tokens=16))
    assert done.status == "completed", done.error
    assert done.truncated_items > 0
    sent = engine.requests[-1].messages
    assert sent[0].role == "system" and sent[0].content == ["be brief"]
    assert sent[-1].content == ["latest question here"]
    assert sent[1].role == "user"  # a kept conversation starts with a user turn
    assert len(sent) - 1 == len(session.items) - done.truncated_items
    assert done.input_tokens <= engine.context_tokens
    stored = await sessions.load(session.id, OWNER)
    assert len(stored.items) == len(session.items) + 1  # nothing dropped from the session
    assert stored.items[-1].status == "completed"


async def test_disabled_truncation_refuses_and_the_session_stays_usable() -> None:
    engine = FakeEngine(context_tokens=400)
    service, sessions = build(engine)
    session = await long_session(
        sessions,
        turns=6,
        words=60,
    )
    refused = await run(service, session, ResponseOptions(truncation="disabled"))
    assert refused.status == "failed"
    assert refused.error is not None and refused.error.code == "context_length_exceeded"
    assert refused.error.http_status == 400  # a client error, not engine_error
    assert engine.requests == []  # refused before the engine was involved
    stored = await sessions.load(session.id, OWNER)
    assert [i.id for i in stored.items] == [i.id for i in session.items]  # no placeholder left
    again = await run(service, stored, ResponseOptions())  # the session's default: auto
    assert again.status == "completed"


async def test_a_latest_message_larger_than_the_context_is_refused_even_with_auto() -> None:
    engine = FakeEngine(context_tokens=200)
    service, sessions = build(engine)
    session = Session.new(OWNER, instructions="", max_output_tokens=16)
    session.items.append(turn("user", " ".join(f"w{i}" for i in range(400)), 0))
    await sessions.save(session)
    done = await run(service, session, ResponseOptions())
    assert done.status == "failed" and done.error.code == "context_length_exceeded"


async def test_a_consumer_that_goes_away_leaves_its_partial_answer_as_incomplete() -> None:
    engine = FakeEngine(delay_s=0.02)
    service, sessions = build(engine)
    session = Session.new(OWNER, instructions="", max_output_tokens=64)
    session.items.append(turn("user", "one two three four five six seven eight", 0))
    await sessions.save(session)
    options = ResponseOptions()
    stream = service.respond(session, options)
    seen = []
    async for ev in stream:
        if isinstance(ev, TextChunk):
            seen.append(ev.text)
            if len(seen) == 3:
                break
    await stream.aclose()  # what a disconnect does
    assert options.cancel.is_set()
    for _ in range(100):  # the write runs on after the consumer left
        stored = await sessions.load(session.id, OWNER)
        answer = next(i for i in stored.items if i.id == options.item_id)
        if answer.status != "in_progress":
            break
        await asyncio.sleep(0.01)
    assert answer.status == "incomplete"
    assert answer.parts[0].text == "".join(seen)


class FailingWrites(MemorySessionStore):
    """The real memory store, except that writes fail once `broken` is set (a store outage)."""

    broken = False

    async def update(self, session_id, owner, mutate):
        if self.broken:
            raise GatewayError("busy", "session store unavailable")
        return await super().update(session_id, owner, mutate)


async def on_failing_writes() -> tuple[FakeEngine, FailingWrites, ChatService, Session]:
    """A service over a `FailingWrites` store holding one conversation of one user turn."""
    engine = FakeEngine()
    sessions = FailingWrites(3600)
    service, _ = build(engine, sessions)
    session = Session.new(OWNER, instructions="", max_output_tokens=16)
    session.items.append(turn("user", "hello there", 0))
    await sessions.save(session)
    return engine, sessions, service, session


async def test_an_answer_that_cannot_be_stored_ends_the_response_as_failed() -> None:
    engine, sessions, service, session = await on_failing_writes()
    stream = service.respond(session, ResponseOptions())
    events = []
    async for ev in stream:
        events.append(ev)
        if isinstance(ev, TextChunk):
            sessions.broken = True  # the store goes away while the answer streams
    done = events[-1]
    # never reported as given: failed with the store's retryable error, its usage kept
    assert isinstance(done, Finished) and done.status == "failed"
    assert done.error is not None and done.error.code == "busy"
    assert done.error.http_status == 503
    assert done.text == "hello there [0 images]" and done.output_tokens > 0
    # its place stays (the drop failed too) but the prompt of the next response leaves it out
    sessions.broken = False
    stored = await sessions.load(session.id, OWNER)
    assert [i.status for i in stored.items] == ["completed", "in_progress"]
    again = await run(service, stored, ResponseOptions())
    assert again.status == "completed"
    assert [m.role for m in engine.requests[-1].messages] == ["user"]
    # and the next response to take its place removed the one left behind
    final = await sessions.load(session.id, OWNER)
    assert [(i.role, i.status) for i in final.items] == [
        ("user", "completed"),
        ("assistant", "completed"),
    ]


@pytest.mark.parametrize("truncation", ["auto", "disabled"])
async def test_a_conversation_that_fits_is_sent_whole(truncation: str) -> None:
    engine = FakeEngine(context_tokens=8192)
    service, sessions = build(engine)
    session = await long_session(sessions, turns=3, words=10)
    done = await run(service, session, ResponseOptions(truncation=truncation))
    assert done.status == "completed" and done.truncated_items == 0
    assert len(engine.requests[-1].messages) == 1 + len(session.items)


async def test_a_place_that_cannot_be_taken_fails_the_response_as_busy_not_internal() -> None:
    engine, sessions, service, session = await on_failing_writes()
    sessions.broken = True  # the store is down as the response takes its answer's place
    done = await run(service, session, ResponseOptions())
    assert done.status == "failed" and done.error is not None
    assert (done.error.code, done.error.http_status) == ("busy", 503)
    assert engine.requests == []  # nothing was generated for an answer with no place


async def test_an_answer_whose_place_was_taken_over_is_appended_not_lost() -> None:
    from gateway.chat.answer_place import fill_place, take_place

    sessions = MemorySessionStore(3600)
    session = Session.new(OWNER, instructions="", max_output_tokens=16)
    session.items.append(turn("user", "hello there", 0))
    await sessions.save(session)
    first, second = ResponseOptions(), ResponseOptions()
    await take_place(sessions, session, first)
    await take_place(sessions, session, second)  # removes the first one's place
    places = [i.id for i in (await sessions.load(session.id, OWNER)).items[1:]]
    assert places == [second.item_id]
    await fill_place(sessions, session, second, "the second", "completed")
    await fill_place(sessions, session, first, "the first", "completed")  # still running
    stored = (await sessions.load(session.id, OWNER)).items
    assert [(i.id, i.status, i.parts[0].text) for i in stored[1:]] == [
        (second.item_id, "completed", "the second"),
        (first.item_id, "completed", "the first"),
    ]
