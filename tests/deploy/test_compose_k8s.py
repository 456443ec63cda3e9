"""deploy/compose.yaml and deploy/k8s/*.yaml, checked structurally: files load, every service
the stack needs is there, and images, ports and environment agree with each other and with the
Prometheus and Collector configs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import DEPLOY, PROMETHEUS_DIR

SERVICES = {"gateway", "encoder", "redis", "otel-collector", "prometheus", "grafana", "kafka"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def k8s() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def _ports(service: dict[str, Any]) -> set[int]:
    return {int(str(p).split(":")[-1]) for p in service.get("ports", [])}


def test_compose_has_the_whole_stack(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) >= SERVICES
    for name, service in services.items():
        assert service.get("image"), name
        for dep in service.get("depends_on", []) or []:
            assert dep in services, (name, dep)
    # gateway and encoder run the same image
    assert services["gateway"]["image"] == services["encoder"]["image"]
    assert services["gateway"]["command"][:2] == ["visiongate", "serve"]
    assert services["encoder"]["command"][:2] == ["visiongate", "worker"]


def test_compose_env_and_ports_agree(compose: dict[str, Any]) -> None:
    services = compose["services"]
    gateway, encoder = services["gateway"]["environment"], services["encoder"]["environment"]
    for env in (gateway, encoder):
        assert env["VISIONGATE_REDIS_URL"].startswith("redis://redis:6379")
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
    assert int(gateway["VISIONGATE_PORT"]) in _ports(services["gateway"])
    assert {4317, 4318, 8889} <= _ports(services["otel-collector"])
    assert 6379 in _ports(services["redis"]) and 9092 in _ports(services["kafka"])

    collector = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    mounts = services["otel-collector"]["volumes"]
    assert any(m.startswith("./otel-collector.yaml:") for m in mounts)
    assert services["otel-collector"]["environment"]["KAFKA_BROKERS"] == "kafka:9092"
    max_bytes = collector["exporters"]["kafka"]["producer"]["max_message_bytes"]
    assert max_bytes <= int(services["kafka"]["environment"]["KAFKA_MESSAGE_MAX_BYTES"])

    for mount in services["prometheus"]["volumes"] + services["grafana"]["volumes"]:
        source = mount.split(":")[0]
        if source.startswith("./"):
            assert (DEPLOY / source).exists(), mount


def test_prometheus_scrapes_what_compose_exposes(compose: dict[str, Any]) -> None:
    services = compose["services"]
    prom = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    targets = {
        t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    for target in targets:
        host, port = target.rsplit(":", 1)
        if host == "localhost":
            continue
        assert host in services, target
        assert int(port) in _ports(services[host]), target


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc["spec"]["template"]["spec"]["containers"]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_k8s_manifests(k8s: list[dict[str, Any]], compose: dict[str, Any]) -> None:
    by_kind_name = {(d["kind"], d["metadata"]["name"]): d for d in k8s}
    gateway = by_kind_name[("Deployment", "visiongate-gateway")]
    encoder = by_kind_name[("Deployment", "visiongate-encoder")]
    service = by_kind_name[("Service", "visiongate-gateway")]
    hpa = by_kind_name[("HorizontalPodAutoscaler", "visiongate-gateway")]

    for deploy in (gateway, encoder):
        selector = deploy["spec"]["selector"]["matchLabels"]
        labels = deploy["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
    (g,) = _containers(gateway)
    (e,) = _containers(encoder)
    assert g["image"] == e["image"]
    # compose: ${VISIONGATE_IMAGE:-visiongate:0.1.0}; the default is the k8s image
    compose_default = compose["services"]["gateway"]["image"].split(":-", 1)[-1].rstrip("}")
    assert g["image"] == compose_default
    assert g["args"][:2] == ["visiongate", "serve"] and e["args"][:2] == ["visiongate", "worker"]
    assert e["resources"]["limits"]["nvidia.com/gpu"] == 1

    port_names = {p["name"]: p["containerPort"] for p in g["ports"]}
    assert int(_env(g)["VISIONGATE_PORT"]) == port_names["http"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert g[probe]["httpGet"]["port"] in port_names
    assert gateway["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(
        port_names["http"]
    )
    assert (
        service["spec"]["selector"].items()
        <= gateway["spec"]["template"]["metadata"]["labels"].items()
    )
    assert all(p["targetPort"] in port_names for p in service["spec"]["ports"])
    for env in (_env(g), _env(e)):
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4318")
        assert env["VISIONGATE_REDIS_URL"].startswith("redis://")

    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "visiongate-gateway")
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_every_deploy_yaml_loads() -> None:
    for path in Path(DEPLOY).rglob("*.y*ml"):
        list(yaml.safe_load_all(path.read_text()))
