"""deploy/otel-collector.yaml (the contrib Collector, which cannot run here: checked
structurally) and deploy/rotel.env (rotel, which runs in the trace-pipeline tests and the local
stack): both name the same route."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from deploy.stack import TOPIC, read_env_file
from tests.deploy.conftest import DEPLOY


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())


def _defined(config: dict[str, Any], section: str, name: str) -> bool:
    return name in (config.get(section) or {})


def test_every_pipeline_component_is_defined(config: dict[str, Any]) -> None:
    service = config["service"]
    for ext in service.get("extensions", []):
        assert _defined(config, "extensions", ext), ext
    for pipeline, spec in service["pipelines"].items():
        for receiver in spec["receivers"]:
            assert _defined(config, "receivers", receiver) or _defined(
                config, "connectors", receiver
            ), (pipeline, receiver)
        for processor in spec.get("processors", []):
            assert _defined(config, "processors", processor), (pipeline, processor)
        for exporter in spec["exporters"]:
            assert _defined(config, "exporters", exporter) or _defined(
                config, "connectors", exporter
            ), (pipeline, exporter)
        # memory_limiter must run first, batch last (after any sampling decision)
        assert spec["processors"][0] == "memory_limiter", pipeline
        assert spec["processors"][-1] == "batch", pipeline


def test_otlp_receiver_takes_grpc_and_http(config: dict[str, Any]) -> None:
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")


def test_traces_go_to_kafka_as_otlp_proto(config: dict[str, Any]) -> None:
    traces = config["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"]
    assert "kafka" in traces["exporters"]
    kafka = config["exporters"]["kafka"]
    assert kafka["traces"] == {"topic": TOPIC, "encoding": "otlp_proto"}
    assert kafka["brokers"]


def test_kafka_gets_tail_sampled_traces_keeping_every_one_over_the_slo(
    config: dict[str, Any],
) -> None:
    from dashboards.slo import TTFT_OBJECTIVE_S

    to_kafka = [
        spec
        for name, spec in config["service"]["pipelines"].items()
        if name.split("/")[0] == "traces" and "kafka" in spec["exporters"]
    ]
    assert len(to_kafka) == 1
    assert "tail_sampling" in to_kafka[0]["processors"]
    policies = config["processors"]["tail_sampling"]["policies"]
    by_type = {p["type"]: p for p in policies}
    # the policies are OR-ed: a trace one of them keeps is kept
    assert by_type["latency"]["latency"]["threshold_ms"] == TTFT_OBJECTIVE_S * 1000
    assert by_type["status_code"]["status_code"]["status_codes"] == ["ERROR"]
    assert 0 < by_type["probabilistic"]["probabilistic"]["sampling_percentage"] < 100
    # span metrics count every span, not only the sampled ones
    to_spanmetrics = [
        spec
        for name, spec in config["service"]["pipelines"].items()
        if name.split("/")[0] == "traces" and "spanmetrics" in spec["exporters"]
    ]
    assert to_spanmetrics and all("tail_sampling" not in s["processors"] for s in to_spanmetrics)


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_rotel_names_the_same_topic_encoding_and_endpoints(config: dict[str, Any]) -> None:
    rotel = read_env_file(DEPLOY / "rotel.env")
    kafka = config["exporters"]["kafka"]
    assert rotel["ROTEL_EXPORTER"] == "kafka"
    assert rotel["ROTEL_KAFKA_EXPORTER_TRACES_TOPIC"] == kafka["traces"]["topic"] == TOPIC
    # rotel calls OTLP protobuf `protobuf`, the contrib exporter `otlp_proto`
    assert {"protobuf": "otlp_proto", "json": "otlp_json"}[
        rotel["ROTEL_KAFKA_EXPORTER_FORMAT"]
    ] == kafka["traces"]["encoding"]
    # the contrib config reads its brokers from KAFKA_BROKERS, defaulting to the same one
    (brokers,) = kafka["brokers"]
    assert brokers.endswith(":-" + rotel["ROTEL_KAFKA_EXPORTER_BROKERS"] + "}"), brokers
    assert (
        int(rotel["ROTEL_KAFKA_EXPORTER_MAX_MESSAGE_BYTES"])
        == kafka["producer"]["max_message_bytes"]
    )
    assert rotel["ROTEL_KAFKA_EXPORTER_COMPRESSION"] == kafka["producer"]["compression"]
    protocols = config["receivers"]["otlp"]["protocols"]
    assert rotel["ROTEL_OTLP_GRPC_ENDPOINT"] == protocols["grpc"]["endpoint"]
    assert rotel["ROTEL_OTLP_HTTP_ENDPOINT"] == protocols["http"]["endpoint"]
    assert _port(rotel["ROTEL_OTLP_HTTP_ENDPOINT"]) == 4318  # what the gateways are told


def test_spanmetrics_feed_the_prometheus_exporter(config: dict[str, Any]) -> None:
    pipelines = config["service"]["pipelines"]
    assert any(
        "spanmetrics" in spec["exporters"]
        for name, spec in pipelines.items()
        if name.split("/")[0] == "traces"
    )
    fed = [
        name
        for name, spec in pipelines.items()
        if name.split("/")[0] == "metrics" and "spanmetrics" in spec["receivers"]
    ]
    assert fed, "no metrics pipeline receives from the spanmetrics connector"
    for name in fed:
        assert "prometheus" in pipelines[name]["exporters"]
    assert config["exporters"]["prometheus"]["endpoint"].endswith(":8889")
    dims = {d["name"] for d in config["connectors"]["spanmetrics"]["dimensions"]}
    assert "gen_ai.request.model" in dims
