"""A pre-encode's trace: `image.preencode` is the root of a trace of its own, its traceparent
goes with the encode job, and the `image.resolve` of the response that uses the tokens links
to it. The real resolver, caches, session store and chat service, the fake encoder and engine,
spans kept in memory. (tests/deploy/test_trace_pipeline.py checks the same through a real
worker, Collector and Kafka.)"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from encoder_worker.types import EncodedImage
from gateway.caching import make_image_store, make_vision_cache
from gateway.chat.events import Finished, ResponseOptions
from gateway.chat.service import ChatService
from gateway.chat.vision_resolver import VisionResolver
from gateway.protocol.errors import GatewayError
from gateway.sessions import MemorySessionStore, Session, StoredItem, StoredPart
from gateway.telemetry import ATTR, SPAN, Telemetry, config_from_env, context_from_traceparent
from gateway.testing.fakes import FakeEncoder, FakeEngine
from tests.conftest import photo_bytes

MiB = 1024 * 1024
OWNER = "key_owner"


class TracedEncoder(FakeEncoder):
    """The fake encoder, keeping the traceparent each job came with (as a worker reads it)."""

    def __init__(self) -> None:
        super().__init__()
        self.traceparents: list[str | None] = []

    async def encode(
        self, data: bytes, *, traceparent: str | None = None, owner: str | None = None
    ) -> EncodedImage:
        self.traceparents.append(traceparent)
        return await super().encode(data, traceparent=traceparent, owner=owner)


@pytest.fixture
def telemetry() -> Iterator[tuple[Telemetry, InMemorySpanExporter]]:
    t = Telemetry(config_from_env({}), "0.0.0-test", "test-instance")
    exporter = InMemorySpanExporter()
    t.tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield t, exporter
    t.shutdown()


def parts(telemetry: Telemetry) -> tuple[VisionResolver, ChatService, TracedEncoder]:
    encoder = TracedEncoder()
    vision = VisionResolver(
        encoder,
        make_vision_cache(None, 64 * MiB, 3600),
        make_image_store(None, 64 * MiB, 3600),
        tracer=telemetry.tracer,
    )
    service = ChatService(
        engine=FakeEngine(),
        vision=vision,
        sessions=MemorySessionStore(3600),
        max_output_tokens_limit=16,
        telemetry=telemetry,
    )
    return vision, service, encoder


async def test_the_response_links_to_the_pre_encode_that_made_its_tokens(telemetry) -> None:
    t, exporter = telemetry
    vision, service, encoder = parts(t)
    photo = photo_bytes("chelsea", size=48)
    digest = hashlib.sha256(photo).hexdigest()
    await vision.add(OWNER, digest, photo)
    session = Session.new(OWNER, instructions="Answer briefly.", max_output_tokens=8)
    session.items.append(
        StoredItem(id="item_photo", role="user", parts=[StoredPart("image", digest=digest)])
    )
    await service.sessions.save(session)

    task = vision.start(OWNER, digest, item_id="item_photo", session_id=session.id)
    resolved = await task  # encoded before any response asks for it
    options = ResponseOptions(max_output_tokens=2)
    events = [e async for e in service.respond(session, options, pending={digest: task})]
    assert isinstance(events[-1], Finished) and events[-1].status == "completed"
    await asyncio.sleep(0)  # the response's trace is written on the loop's next turn

    spans = exporter.get_finished_spans()
    (preencode,) = [s for s in spans if s.name == SPAN.IMAGE_PREENCODE]
    assert preencode.parent is None  # the root of its own trace
    assert dict(preencode.attributes) == {
        ATTR.IMAGE_DIGEST: digest[:12],
        ATTR.ITEM_ID: "item_photo",
        ATTR.SESSION_ID: session.id,
        ATTR.CACHE_HIT: False,
        ATTR.CACHE_TIER: "none",
        ATTR.TOKENS_KEPT: encoder.tokens,
        ATTR.TOKENS_TOTAL: encoder.tokens,
    }
    assert resolved.preencode == preencode.context
    # the encode job carried the pre-encode's context: a worker's spans go beneath it
    (sent,) = encoder.traceparents
    remote = trace.get_current_span(context_from_traceparent(sent)).get_span_context()
    assert (remote.trace_id, remote.span_id) == (
        preencode.context.trace_id,
        preencode.context.span_id,
    )

    (root,) = [s for s in spans if s.name == "chat " + service.engine.model_id]
    assert root.attributes[ATTR.RESPONSE_ID] == options.response_id
    (resolve,) = [s for s in spans if s.name == SPAN.IMAGE_RESOLVE]
    assert resolve.context.trace_id == root.context.trace_id != preencode.context.trace_id
    assert [link.context for link in resolve.links] == [preencode.context]

    # the next response gets the tokens from the cache: nothing to link to
    exporter.clear()
    [e async for e in service.respond(session, ResponseOptions(max_output_tokens=2))]
    (resolve,) = [s for s in exporter.get_finished_spans() if s.name == SPAN.IMAGE_RESOLVE]
    assert resolve.attributes[ATTR.CACHE_HIT] is True and not resolve.links


async def test_a_failed_pre_encode_is_an_error_span(telemetry) -> None:
    t, exporter = telemetry
    vision, _, _ = parts(t)
    junk = b"not an image at all"
    digest = hashlib.sha256(junk).hexdigest()
    await vision.add(OWNER, digest, junk)
    with pytest.raises(GatewayError) as info:
        await vision.start(OWNER, digest, item_id="item_junk")
    (preencode,) = exporter.get_finished_spans()
    assert preencode.name == SPAN.IMAGE_PREENCODE and not preencode.status.is_ok
    assert preencode.attributes[ATTR.ERROR_TYPE] == info.value.code
    assert ATTR.SESSION_ID not in preencode.attributes


async def test_the_trace_ends_when_the_response_did_and_is_written_on_the_next_turn(
    telemetry,
) -> None:
    """The `Finished` reaches the consumer (the client's last frames) before the trace's end is
    written; the loop's next turn writes it, timed when the response ended."""
    t, exporter = telemetry
    _, service, _ = parts(t)
    session = Session.new(OWNER, instructions="Answer briefly.", max_output_tokens=8)
    session.items.append(
        StoredItem(id="item_q", role="user", parts=[StoredPart("text", text="hi")])
    )
    await service.sessions.save(session)
    root_name = "chat " + service.engine.model_id
    seen_at_end: list[str] = []
    ended_ns = 0
    async for event in service.respond(session, ResponseOptions(max_output_tokens=2)):
        if isinstance(event, Finished):
            ended_ns = time.time_ns()
            seen_at_end = [s.name for s in exporter.get_finished_spans()]
    assert ended_ns and root_name not in seen_at_end  # not written while the answer goes out
    await asyncio.sleep(0)
    (root,) = [s for s in exporter.get_finished_spans() if s.name == root_name]
    assert root.end_time is not None and root.end_time <= ended_ns
