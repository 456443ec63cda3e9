"""Traces through a real Collector into a real Kafka broker, read back with a Kafka client.

A `visiongate serve` process (the embedded model, `--encoder redis`) and a `visiongate worker`
process on a private redis-server export spans over OTLP/HTTP to `rotel-agent` (the Collector,
configured by deploy/rotel.env), which publishes them as OTLP protobuf to the span topic of a
`tansu` broker. The tests read the topic with `confluent-kafka` and check what a downstream
consumer gets: one trace per response with every stage, the worker's encode spans inside the
gateway's trace, GenAI attributes, and nothing secret in any attribute. Then the Collector and,
separately, the broker are restarted while the gateway serves: responses never wait on
telemetry, and spans sent after each restart reach the topic.

The parts are the local stack's own (`deploy.stack`); the broker sits behind a `Forwarder`
so that a restarted broker is reached at the address the Collector was configured with.
"""

from __future__ import annotations

import base64
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from deploy import stack
from encoder_worker.spans import STAGE_PREFIX
from gateway.testing.otlp_receiver import ReceivedSpan
from gateway.testing.realtime_peer import data_url
from tests.conftest import photo_bytes
from tests.deploy.kafka_topic import Forwarder, TopicSpans
from tests.gateway.server.test_readyz import tiny_clip  # noqa: F401  (a fixture: a small CLIP tower)

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ROOT_SPAN = f"chat {MODEL}"
API_KEY = "sk-vg-pipeline-4f1d9c2a7e"
# the gateway's stages (chat_service, response_trace), beside the worker's encode.* and cache.put
GATEWAY_STAGES = {"session.load", "image.resolve", "llm.prefill", "llm.decode", "stream"}
WORKER_STAGES = {"encode.queue", "encode.decode", "encode.preprocess", "encode.vision", "cache.put"}
# export quickly: the default 5 s batch delay would only make the test wait
RID = "visiongate.request_id"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_BSP_EXPORT_TIMEOUT": "5000"}


@dataclass
class Pipeline:
    gateway: stack.Service
    worker: stack.Service
    collector: stack.Service
    broker: stack.Service
    forwarder: Forwarder
    log_dir: Path

    @property
    def kafka(self) -> str:
        return f"127.0.0.1:{self.forwarder.port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.ports['http']}/v1"

    def stop_broker(self) -> None:
        self.broker.stop()
        self.forwarder.drop_all()

    def start_new_broker(self) -> None:
        """A new, empty broker (memory storage) behind the same address, its topic created.

        The forwarder turns to it only once the topic exists, as a restarted broker keeps its
        topics (a producer reaching it first would have the topic made by its metadata request,
        with tansu's default partition count instead of ours)."""
        port = stack.free_port()
        self.broker = stack.broker(port, self.log_dir, advertised_port=self.forwarder.port)
        self.broker.start().wait_ready()
        stack.create_topic(port)
        self.forwarder.target = port


@pytest.fixture(scope="module")
def pipeline(
    tiny_clip: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Pipeline]:
    from tests.conftest import free_port, start_redis, wait_for_port

    log_dir = tmp_path_factory.mktemp("trace-pipeline")
    redis_port = free_port()
    redis_proc = start_redis(redis_port, str(log_dir))
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    services: list[stack.Service] = []
    forwarder = Forwarder(0).start()
    try:
        wait_for_port(redis_port)
        broker_port = stack.free_port()
        forwarder.target = broker_port
        broker = stack.broker(broker_port, log_dir, advertised_port=forwarder.port)
        services.append(broker.start().wait_ready())
        stack.create_topic(broker_port)
        grpc_port, http_port = stack.free_port(), stack.free_port()
        collector = stack.collector(grpc_port, http_port, forwarder.port, log_dir)
        services.append(collector.start().wait_ready())

        args = ["--encoder", "redis", "--redis-url", redis_url, "--vision-tower", tiny_clip]
        args += ["--engine-max-batch", "2", "--log-level", "info"]
        if cache_dir := os.environ.get("VISIONGATE_CACHE_DIR"):  # where the model is kept
            args += ["--cache-dir", cache_dir]
        env = {**FAST_EXPORT, "VISIONGATE_API_KEYS": API_KEY}
        gateway = stack.gateway(stack.free_port(), http_port, log_dir, *args, env=env)
        worker = stack.Service(
            "worker",
            [sys.executable, "-m", "gateway.cli.main", "worker", "--redis-url", redis_url,
             "--device", "cpu", "--block-ms", "200"],
            log_dir / "worker.log",
            env=stack._clean_env(
                {
                    **FAST_EXPORT,
                    "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{http_port}",
                    "OTEL_METRICS_EXPORTER": "none",
                    "OMP_NUM_THREADS": "1",
                }
            ),
            ports={},
        )  # fmt: skip
        services += [gateway.start(), worker.start()]
        gateway.wait_ready(timeout_s=300)  # ready once the model is loaded and a worker is up
        pipeline = Pipeline(gateway, worker, collector, broker, forwarder, log_dir)
        yield pipeline
        services.append(pipeline.broker)  # a test may have started another one
    finally:
        for service in reversed(services):
            service.stop()
        forwarder.stop()
        redis_proc.terminate()
        redis_proc.wait(timeout=10)


def _image() -> tuple[bytes, str]:
    data = photo_bytes("chelsea", size=96)
    return data, data_url(data)


async def converse(pipeline: Pipeline, turns: list[list[dict[str, Any]]]) -> list[Any]:
    """One Realtime conversation through the official openai client; each turn's
    `response.done` event, in order."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=pipeline.base_url, api_key=API_KEY)
    done = []
    try:
        async with client.realtime.connect(model=MODEL) as conn:
            for content in turns:
                await conn.conversation.item.create(
                    item={"type": "message", "role": "user", "content": content}
                )
                await conn.response.create(response={"max_output_tokens": 4})
                async for event in conn:
                    if event.type == "error":
                        pytest.fail(f"error event: {event.error}")
                    if event.type == "response.done":
                        done.append(event)
                        break
    finally:
        await client.close()
    return done


@dataclass
class Answer:
    request_id: str  # the response's x-request-id, which its root span carries
    id: str  # the completion's id, as the client got it (chatcmpl-...)
    input_tokens: int
    output_tokens: int
    text: str


def chat(pipeline: Pipeline, messages: list[dict[str, Any]], session_id: str) -> Answer:
    """One streamed turn of a stored session over the OpenAI-compatible HTTP API, through the
    official openai client. Over HTTP an image is encoded while the response waits for it, so
    the encode job carries the response's traceparent to the worker."""
    from openai import OpenAI

    with (
        OpenAI(base_url=pipeline.base_url, api_key=API_KEY) as client,
        client.chat.completions.with_streaming_response.create(
            model=MODEL,
            messages=messages,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"session_id": session_id},
        ) as response,
    ):
        request_id = response.headers["x-request-id"]
        chunks = list(response.parse())
    usage = next(c.usage for c in chunks if c.usage is not None)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (completion_id,) = {c.id for c in chunks}
    return Answer(request_id, completion_id, usage.prompt_tokens, usage.completion_tokens, text)


def trace_of(
    spans: list[ReceivedSpan], value: str, key: str = "gen_ai.response.id"
) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
    """The response's root span (the one whose `key` attribute is `value`) and the rest of
    its trace."""
    roots = [s for s in spans if s.name == ROOT_SPAN and s.attributes.get(key) == value]
    assert len(roots) == 1, f"{len(roots)} root spans with {key}={value}"
    root = roots[0]
    return root, [s for s in spans if s.trace_id == root.trace_id and s is not root]


def has_response(value: str, key: str = "gen_ai.response.id"):
    def check(spans: list[ReceivedSpan]) -> bool:
        return any(s.name == ROOT_SPAN and s.attributes.get(key) == value for s in spans)

    return check


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)


def test_one_trace_per_response_with_the_workers_spans_inside(pipeline: Pipeline) -> None:
    image, url = _image()
    session_id = "sess_trace_pipeline_1"
    question = {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What?"},
        ],
    }
    one = chat(pipeline, [question], session_id)
    # the whole conversation again, as OpenAI clients send it: the image is in it
    history = [question, {"role": "assistant", "content": one.text}]
    two = chat(pipeline, [*history, {"role": "user", "content": "And the colour?"}], session_id)
    done = [one, two]
    first, second = (d.request_id for d in done)
    with TopicSpans(pipeline.kafka) as topic:
        spans = topic.wait_for(
            lambda s: has_response(first, RID)(s) and has_response(second, RID)(s)
        )
        # the worker's spans of the first turn may come in a later batch than the gateway's
        root1, children1 = trace_of(spans, first, RID)
        spans = topic.wait_for(
            lambda s: {x.name for x in s if x.trace_id == root1.trace_id} >= WORKER_STAGES
        )
        assert topic.messages > 0

    root1, children1 = trace_of(spans, first, RID)
    root2, children2 = trace_of(spans, second, RID)
    assert root1.trace_id != root2.trace_id
    roots_per_trace = {}
    for s in spans:
        if s.name == ROOT_SPAN:
            roots_per_trace[s.trace_id] = roots_per_trace.get(s.trace_id, 0) + 1
    assert set(roots_per_trace.values()) == {1}, roots_per_trace

    names1 = {s.name for s in children1}
    assert names1 >= GATEWAY_STAGES | WORKER_STAGES, (GATEWAY_STAGES | WORKER_STAGES) - names1
    assert {"encode.prune", "encode.quantize"} & names1  # the tower's tokens were reduced
    by_service: dict[str, set[str]] = {}
    for s in children1:
        by_service.setdefault(s.resource["service.name"], set()).add(s.name)
    assert root1.resource["service.name"] == "visiongate"
    encode_names = {n for n in names1 if n.startswith(STAGE_PREFIX)} | {"cache.put"}
    # every encode stage was recorded by the worker process, none by the gateway
    assert encode_names <= by_service["visiongate-encoder"], by_service
    assert not encode_names & by_service["visiongate"], by_service
    resolve = next(s for s in children1 if s.name == "image.resolve")
    assert resolve.attributes["visiongate.cache.hit"] is False
    for s in children1:
        if s.resource["service.name"] == "visiongate-encoder":
            assert s.parent_span_id == resolve.span_id, s.name  # joined via the traceparent

    names2 = {s.name for s in children2}
    assert {"session.load", "image.resolve", "llm.prefill", "llm.decode", "stream"} <= names2
    assert not names2 & encode_names  # the second turn's image comes from the vision cache

    for root, d in ((root1, done[0]), (root2, done[1])):
        attrs = root.attributes
        assert attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.request.model"] == MODEL
        assert attrs["gen_ai.provider.name"] == "visiongate"
        assert attrs["gen_ai.usage.input_tokens"] == d.input_tokens
        assert attrs["gen_ai.usage.output_tokens"] == d.output_tokens
        assert attrs["gen_ai.conversation.id"] == session_id
        assert [e.name for e in root.events] == ["ttft"]
        # the id the client got names the response's trace
        assert attrs["gen_ai.response.id"] == d.id and d.id.startswith("chatcmpl-")
        assert trace_of(spans, d.id)[0] is root
    decode = next(s for s in children1 if s.name == "llm.decode")
    assert decode.attributes["visiongate.llm.decode_tokens"] == done[0].output_tokens

    # nothing a client must keep to itself ends up on the topic
    b64 = base64.b64encode(image).decode()
    for s in spans:
        for text in _strings([s.attributes, s.resource, [e.attributes for e in s.events]]):
            assert API_KEY not in text, (s.name, text)
            assert b64[:64] not in text and "base64," not in text, s.name
            assert len(text) < 512, (s.name, len(text))


def test_every_api_names_its_trace_by_the_id_its_client_got(pipeline: Pipeline) -> None:
    """Completions (cmpl-) and Responses (resp_), beside Chat Completions and Realtime above."""
    from openai import OpenAI

    with OpenAI(base_url=pipeline.base_url, api_key=API_KEY) as client:
        completion = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=2)
        response = client.responses.create(model=MODEL, input="Hi?", max_output_tokens=2)
    assert completion.id.startswith("cmpl-") and response.id.startswith("resp_")
    with TopicSpans(pipeline.kafka) as topic:
        spans = topic.wait_for(
            lambda s: has_response(completion.id)(s) and has_response(response.id)(s)
        )
    for client_id, api in ((completion.id, "completions"), (response.id, "responses")):
        root, children = trace_of(spans, client_id)
        assert root.attributes["visiongate.api"] == api
        assert {"llm.prefill", "llm.decode"} <= {s.name for s in children}


async def test_an_image_sent_ahead_is_linked_from_the_response_that_uses_it(
    pipeline: Pipeline,
) -> None:
    """Over Realtime an image is encoded when its item arrives, before any response exists: the
    pre-encode is a trace of its own (`image.preencode`, the worker's spans beneath it), and the
    `image.resolve` of the response that uses the tokens links to it."""
    from openai import AsyncOpenAI

    url = data_url(photo_bytes("coffee", size=96))  # not an image the other tests sent
    client = AsyncOpenAI(base_url=pipeline.base_url, api_key=API_KEY)
    try:
        async with client.realtime.connect(model=MODEL) as conn:
            session_id = image_item = None
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [
                    {"type": "input_image", "image_url": url}]}
            )  # fmt: skip
            async for event in conn:  # the item is done once its image is encoded
                if event.type == "error":
                    pytest.fail(f"error event: {event.error}")
                if event.type == "session.created":
                    session_id = event.session.id
                if event.type == "conversation.item.done":
                    image_item = event.item.id
                    break
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "What is it?"}]}
            )  # fmt: skip
            await conn.response.create(response={"max_output_tokens": 4})
            async for event in conn:
                if event.type == "error":
                    pytest.fail(f"error event: {event.error}")
                if event.type == "response.done":
                    done = event
                    break
    finally:
        await client.close()

    def preencode_of(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [
            s
            for s in spans
            if s.name == "image.preencode" and s.attributes.get("visiongate.item.id") == image_item
        ]

    with TopicSpans(pipeline.kafka) as topic:
        spans = topic.wait_for(lambda s: has_response(done.response.id)(s) and preencode_of(s))
        (preencode,) = preencode_of(spans)
        spans = topic.wait_for(
            lambda s: {x.name for x in s if x.trace_id == preencode.trace_id} >= WORKER_STAGES
        )
    root, children = trace_of(spans, done.response.id)
    assert root.attributes["gen_ai.conversation.id"] == session_id
    assert not {s.name for s in children} & WORKER_STAGES  # the encode is not the response's
    (resolve,) = [s for s in children if s.name == "image.resolve"]
    (link,) = resolve.links
    assert (link.trace_id, link.span_id) == (preencode.trace_id, preencode.span_id)
    # the pre-encode is the root of its trace and names the item and session it came with
    assert preencode.parent_span_id == "" and preencode.trace_id != root.trace_id
    assert preencode.attributes["gen_ai.conversation.id"] == session_id
    assert preencode.attributes["visiongate.cache.hit"] is False
    assert preencode.resource["service.name"] == "visiongate"
    worker = [
        s for s in spans if s.trace_id == preencode.trace_id and s.span_id != preencode.span_id
    ]
    assert {s.name for s in worker} >= WORKER_STAGES
    for s in worker:  # joined via the traceparent the encode job carried
        assert s.resource["service.name"] == "visiongate-encoder", s.name
        assert s.parent_span_id == preencode.span_id, s.name


async def test_collector_restart_loses_no_response_and_later_spans_arrive(
    pipeline: Pipeline,
) -> None:
    pipeline.collector.stop()
    started = time.monotonic()
    (down,) = await converse(pipeline, [[{"type": "input_text", "text": "Still there?"}]])
    assert down.response.status in ("completed", "incomplete")
    ttft_ms = down.response.model_extra["visiongate"]["timings"]["ttft_ms"]
    # the OTLP exporter retries in its own thread for seconds; the response does not wait
    assert ttft_ms < 5000, ttft_ms
    assert time.monotonic() - started < 30

    pipeline.collector.start().wait_ready()
    (after,) = await converse(pipeline, [[{"type": "input_text", "text": "Back again?"}]])
    with TopicSpans(pipeline.kafka) as topic:
        spans = topic.wait_for(has_response(after.response.id))
    _, children = trace_of(spans, after.response.id)
    assert {"llm.prefill", "llm.decode", "stream"} <= {s.name for s in children}


async def test_broker_restart_loses_no_response_and_later_spans_arrive(pipeline: Pipeline) -> None:
    with TopicSpans(pipeline.kafka) as topic:
        assert topic.spans(), "the topic holds the earlier spans"
    pipeline.stop_broker()
    (down,) = await converse(pipeline, [[{"type": "input_text", "text": "Kafka gone?"}]])
    assert down.response.status in ("completed", "incomplete")
    assert down.response.model_extra["visiongate"]["timings"]["ttft_ms"] < 5000

    pipeline.start_new_broker()
    # The Collector's producer reconnects with a growing back-off (up to 10 s between tries),
    # and a batch the new broker refuses with a non-retriable error is dropped by rotel (it
    # logs "Failed to send traces"). What must hold: responses after the broker is back reach
    # the topic again, each with its whole trace. One more conversation every 20 s, for 90 s.
    sent: list[str] = []
    deadline = time.monotonic() + 90
    with TopicSpans(pipeline.kafka) as topic:
        while True:
            (after,) = await converse(
                pipeline, [[{"type": "input_text", "text": f"Kafka back? ({len(sent)})"}]]
            )
            sent.append(after.response.id)
            try:
                spans = topic.wait_for(lambda s: any(has_response(r)(s) for r in sent), timeout=20)
                break
            except AssertionError as exc:
                if time.monotonic() < deadline:
                    continue
                said = collector_errors(pipeline)
                raise AssertionError(f"{exc}\nthe Collector said:\n{said}") from exc
    (landed,) = [r for r in sent if has_response(r)(spans)][-1:]
    _, children = trace_of(spans, landed)
    assert {"llm.prefill", "llm.decode", "stream"} <= {s.name for s in children}
    assert pipeline.collector.alive and pipeline.gateway.alive


def collector_errors(pipeline: Pipeline, last: int = 20) -> str:
    """The Collector's last warnings and errors, for a failure's message."""
    lines = (pipeline.log_dir / "collector.log").read_text(errors="replace").splitlines()
    return "\n".join(
        [
            line[:400]
            for line in lines
            if '"level":40' in line or '"level":50' in line or line.startswith("%")
        ][-last:]
    )
