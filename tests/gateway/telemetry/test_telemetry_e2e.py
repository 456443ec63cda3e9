"""Telemetry of the real gateway: one trace per response with every stage, /metrics counts,
and a real Prometheus evaluating the SLO recording rules against the gateway itself."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from gateway.testing.otlp_receiver import OTLPReceiver
from gateway.testing.realtime_peer import Peer, data_url
from tests.deploy.conftest import _ensure
from tests.deploy.test_prometheus_live import run_prometheus, wait_for
from tests.gateway.caching.test_session_cache import fresh_image
from tests.gateway.conftest import gateway_settings, gateway_state

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ENCODE_STAGES = {
    "encode.queue",
    "encode.decode",
    "encode.preprocess",
    "encode.vision",
    "encode.prune",
    "encode.quantize",
    "cache.put",
}


async def test_one_trace_per_response_with_every_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    with OTLPReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        settings = gateway_settings()
        with ServerThread(create_app(settings), settings) as server:
            server.wait_ready()
            peer = await Peer.open(server.ws_url)
            await peer.add(
                [
                    {"type": "input_image", "image_url": data_url(fresh_image(11), "image/png")},
                    {"type": "input_text", "text": "What is this?"},
                ]
            )
            done1, _ = await peer.respond(max_output_tokens=4)
            await peer.add([{"type": "input_text", "text": "And now?"}])
            done2, _ = await peer.respond(max_output_tokens=4)
            await peer.close()
            gateway_state(server).telemetry.force_flush()
            spans = receiver.spans()

    def trace_of(response_id: str) -> tuple[object, list]:
        roots = [
            s
            for s in spans
            if s.name == f"chat {MODEL}" and s.attributes.get("gen_ai.response.id") == response_id
        ]
        assert len(roots) == 1, [s.name for s in spans]
        root = roots[0]
        return root, [s for s in spans if s.trace_id == root.trace_id and s is not root]

    root1, children1 = trace_of(done1["response"]["id"])
    names1 = {s.name for s in children1}
    expected = {
        "session.load",
        "image.resolve",
        "llm.prefill",
        "llm.decode",
        "stream",
    } | ENCODE_STAGES
    assert expected <= names1, expected - names1
    assert root1.attributes["gen_ai.operation.name"] == "chat"
    assert root1.attributes["gen_ai.request.model"] == MODEL
    assert root1.attributes["gen_ai.conversation.id"] == peer.session_id
    assert (
        root1.attributes["gen_ai.usage.input_tokens"] == done1["response"]["usage"]["input_tokens"]
    )
    assert (
        root1.attributes["gen_ai.usage.output_tokens"]
        == done1["response"]["usage"]["output_tokens"]
    )
    assert [e["name"] if isinstance(e, dict) else e.name for e in root1.events] == ["ttft"]
    by_name = {s.name: s for s in children1}
    resolve1 = by_name["image.resolve"]
    assert resolve1.attributes["visiongate.cache.hit"] is False
    assert by_name["encode.vision"].parent_span_id == resolve1.span_id
    assert by_name["llm.prefill"].attributes["visiongate.llm.reused_kv_tokens"] == 0
    assert (
        by_name["llm.decode"].attributes["visiongate.llm.decode_tokens"]
        == done1["response"]["usage"]["output_tokens"]
    )
    assert all(s.parent_span_id for s in children1)

    root2, children2 = trace_of(done2["response"]["id"])
    names2 = {s.name for s in children2}
    assert not names2 & ENCODE_STAGES  # the second turn encodes nothing
    resolve2 = [s for s in children2 if s.name == "image.resolve"]
    assert len(resolve2) == 1 and resolve2[0].attributes["visiongate.cache.hit"] is True
    assert resolve2[0].attributes["visiongate.cache.tier"] == "memory"
    prefill2 = next(s for s in children2 if s.name == "llm.prefill")
    assert (
        prefill2.attributes["visiongate.llm.reused_kv_tokens"]
        == done2["response"]["usage"]["input_token_details"]["cached_tokens"]
        > 0
    )
    assert root2.trace_id != root1.trace_id


def _sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_metrics_endpoint_counts_what_was_sent(gateway_server) -> None:
    url = f"{gateway_server.http_url}/metrics"
    before = httpx.get(url).text
    peer = await Peer.open(gateway_server.ws_url)
    outputs = 0
    for question in ("One?", "Two?", "Three?"):
        await peer.add([{"type": "input_text", "text": question}])
        done, _ = await peer.respond(max_output_tokens=3)
        outputs += done["response"]["usage"]["output_tokens"]
    await peer.send("{broken")
    await peer.until("error")
    await peer.close()
    after = httpx.get(url).text
    ttft = "gen_ai_server_time_to_first_token_seconds_count"
    assert _sample(after, ttft, api="realtime") - _sample(before, ttft, api="realtime") == 3
    tokens = "visiongate_tokens_total"
    assert _sample(after, tokens, type="output") - _sample(before, tokens, type="output") == outputs
    errors = "visiongate_errors_total"
    assert (
        _sample(after, errors, code="invalid_json") - _sample(before, errors, code="invalid_json")
        == 1
    )
    assert re.search(
        r"^gen_ai_server_time_to_first_token_seconds_bucket\{.*le=\"\+Inf\"", after, re.M
    )
    assert "visiongate_websocket_connections" in after


async def test_real_prometheus_evaluates_p95_ttft_of_the_gateway(
    gateway_server, tmp_path: Path
) -> None:
    prometheus_bin = _ensure("prometheus")
    with run_prometheus(prometheus_bin, f"127.0.0.1:{gateway_server.port}", tmp_path) as base:
        wait_for(base, 'up{job="visiongate-gateway"}', lambda r: r[0]["value"][1] == "1")
        peer = await Peer.open(gateway_server.ws_url)
        ttfts = []
        for question in ("Hello?", "How are you?", "Bye?"):
            await peer.add([{"type": "input_text", "text": question}])
            done, _ = await peer.respond(max_output_tokens=2)
            ttfts.append(done["response"]["visiongate"]["timings"]["ttft_ms"] / 1e3)
        await peer.close()
        result = wait_for(
            base,
            "visiongate:gen_ai_server_time_to_first_token_seconds:p95_5m",
            lambda r: r and r[0]["value"][1] not in ("NaN",),
            timeout=30,
        )
        p95 = float(result[0]["value"][1])
        # a histogram quantile lands inside the bucket range of what the gateway measured
        assert 0 < p95 <= max(30.0, max(ttfts) * 2)
