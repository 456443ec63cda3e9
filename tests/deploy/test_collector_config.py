"""deploy/otel-collector.yaml, checked structurally (no Collector binary runs here)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

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
        # memory_limiter must run first, batch after it
        assert spec["processors"][:2] == ["memory_limiter", "batch"], pipeline


def test_otlp_receiver_takes_grpc_and_http(config: dict[str, Any]) -> None:
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")


def test_traces_go_to_kafka_as_otlp_proto(config: dict[str, Any]) -> None:
    traces = config["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"]
    assert "kafka" in traces["exporters"]
    kafka = config["exporters"]["kafka"]
    assert kafka["traces"] == {"topic": "visiongate-spans", "encoding": "otlp_proto"}
    assert kafka["brokers"]


def test_spanmetrics_feed_the_prometheus_exporter(config: dict[str, Any]) -> None:
    pipelines = config["service"]["pipelines"]
    assert "spanmetrics" in pipelines["traces"]["exporters"]
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
