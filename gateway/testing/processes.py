"""Real `visiongate serve` processes on free loopback ports: upstream replicas and the gateway
in front of them, for the tests and the benchmark that need several gateways at once.

Each `ServeProcess` runs `python -m gateway.cli.main serve --port P ...` in its own process group,
with none of the caller's `VISIONGATE_*` variables (only the settings this module passes), its
stdout and stderr in a log file. `wait_ready` polls `GET /readyz` until it answers 200, and
fails early, with the log's tail, if the process exits or reports a failed load. `stop` sends
SIGTERM, then SIGKILL after a grace period; `kill` sends SIGKILL at once (a replica that dies
mid-conversation); `start` again brings a stopped process back on the same port.

A replica (`replica`) runs the embedded model with one engine thread and one encoder thread and
a small batch, so that three gateways share a 2-core machine without starving each other;
`front` is a gateway with `--engine openai` in front of replicas. `prometheus_samples` reads a
gateway's `/metrics` text into (name, labels, value) rows, to tell which replica served what.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from gateway.testing.ports import free_port

__all__ = (
    "ROOT",
    "ServeProcess",
    "front",
    "log_tail",
    "prometheus_samples",
    "read_log",
    "replica",
    "responses_served",
    "running",
    "sample_sum",
    "spawn_logged",
    "which_served",
)

ROOT = Path(__file__).resolve().parents[2]
ENV_PREFIX = "VISIONGATE_"
# three model loads at once on two cores take about three times one load (~30 s)
READY_TIMEOUT_S = 300.0


def wait_for_readyz(
    proc: subprocess.Popen[bytes],
    http_url: str,
    name: str,
    log_path: Path,
    tail: Callable[[], str],
    timeout_s: float,
) -> dict[str, Any]:
    """Poll a starting gateway's `/readyz` until it answers 200 (its body); RuntimeError with
    the log's `tail()` when the process exits or reports a failed load, TimeoutError after
    `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{name} exited with {proc.returncode} during start-up; see {log_path}:\n{tail()}"
            )
        try:
            r = httpx.get(f"{http_url}/readyz", timeout=5)
            body = r.json()
            if r.status_code == 200:
                return body
            if body.get("status") == "failed":
                raise RuntimeError(f"{name} failed to load: {body.get('error')}\n{tail()}")
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{name} not ready within {timeout_s:.0f} s; see {log_path}:\n{tail()}")


def spawn_logged(
    argv: Sequence[str],
    log_path: Path,
    env: Mapping[str, str],
    *,
    cwd: Path | None = ROOT,
    truncate: bool = False,
) -> subprocess.Popen[bytes]:
    """Start `argv` in a process group of its own (a Ctrl-C reaches the caller, which stops
    it), no stdin, stdout and stderr appended to `log_path` (written afresh with `truncate`)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb" if truncate else "ab") as out:
        return subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def read_log(log_path: Path) -> str:
    """A child's log so far ("" when there is none yet)."""
    try:
        return log_path.read_text(errors="replace")
    except OSError:
        return ""


def log_tail(log_path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a child's log, for error messages."""
    return "\n".join(read_log(log_path).splitlines()[-lines:])


def terminate(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM, then SIGKILL after `grace_s`."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


class ServeProcess:
    """One `visiongate serve` child on 127.0.0.1."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log_dir: Path,
        *,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.name = name
        self.args = list(args)
        self.port = port or free_port()
        self.log_path = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        self.env.update(env or {})

    @property
    def url(self) -> str:
        """scheme://host:port, the form `--upstream` takes."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI SDK's base URL for this gateway."""
        return f"{self.url}/v1"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> ServeProcess:
        if self.alive:
            return self
        argv = [sys.executable, "-m", "gateway.cli.main", "serve", "--port", str(self.port)]
        self.proc = spawn_logged([*argv, *self.args], self.log_path, self.env)
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        assert self.proc is not None, "start() first"
        wait_for_readyz(self.proc, self.url, self.name, self.log_path, self.log_tail, timeout_s)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; nothing when it is not running."""
        if self.proc is not None and self.proc.poll() is None:
            terminate(self.proc, grace_s)

    def kill(self) -> None:
        """SIGKILL now: the replica vanishes mid-conversation, as a crashed host would."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        r = httpx.get(f"{self.url}/metrics", timeout=10)
        r.raise_for_status()
        return prometheus_samples(r.text)

    def access_log(self) -> list[dict[str, Any]]:
        """The gateway's access lines so far: one per response it finished (status, usage,
        timings), oldest first."""
        return self.log_events("response", logger="visiongate.access")

    def log_events(self, event: str, *, logger: str | None = None) -> list[dict[str, Any]]:
        """The JSON log lines of `event` (from `logger`, when given) so far, oldest first."""
        rows = []
        needle = json.dumps({"event": event})[1:-1]  # '"event": "<name>"'
        for line in self.log_text().splitlines():
            if needle not in line:
                continue
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("event") == event and (logger is None or row.get("logger") == logger):
                rows.append(row)
        return rows

    def log_text(self) -> str:
        return read_log(self.log_path)

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)


def replica(
    name: str, log_dir: Path, *extra: str, max_batch: int = 2, threads: int = 1
) -> ServeProcess:
    """A gateway running the embedded model, sized to share a small machine with others."""
    env = {
        # no flag for these two: the cores this process may take for its model and its encoder
        f"{ENV_PREFIX}ENGINE_THREADS": str(threads),
        f"{ENV_PREFIX}ENCODER_THREADS": str(threads),
        "OMP_NUM_THREADS": str(threads),
    }
    args = ["--engine-max-batch", str(max_batch), "--log-level", "info", *extra]
    cache_dir = os.environ.get(f"{ENV_PREFIX}CACHE_DIR")
    if cache_dir:  # where this machine keeps the converted model: not a setting under test
        args += ["--cache-dir", cache_dir]
    return ServeProcess(name, args, log_dir, env=env)


def front(
    name: str, upstreams: Sequence[ServeProcess | str], log_dir: Path, *extra: str
) -> ServeProcess:
    """A gateway with `--engine openai` generating on `upstreams` (processes or URLs)."""
    urls = ",".join(u.url if isinstance(u, ServeProcess) else u for u in upstreams)
    args = ["--engine", "openai", "--upstream", urls, "--log-level", "info", *extra]
    return ServeProcess(name, args, log_dir, env={"OMP_NUM_THREADS": "1"})


@contextlib.contextmanager
def running(*procs: ServeProcess, timeout_s: float = READY_TIMEOUT_S) -> Iterator[None]:
    """Start every process at once (their loads overlap), wait until all are ready, stop them
    all on the way out (also when a start fails). A front gateway goes in a `running` of its
    own, inside its replicas': it asks them for their model as it starts, and fails to load
    when none answers yet."""
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.wait_ready(max(deadline - time.monotonic(), 1.0))
        yield
    finally:
        for proc in procs:
            proc.stop()


def prometheus_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each sample line of Prometheus text exposition."""
    rows = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, brace, rest = head.partition("{")
        labels: dict[str, str] = {}
        if brace:
            body = rest.rsplit("}", 1)[0]
            i = 0
            while i < len(body):
                eq = body.index("=", i)
                key = body[i:eq].strip().lstrip(",").strip()
                j = eq + 2  # past ="
                chars = []
                while body[j] != '"':
                    if body[j] == "\\":
                        j += 1
                        chars.append({"n": "\n"}.get(body[j], body[j]))
                    else:
                        chars.append(body[j])
                    j += 1
                labels[key] = "".join(chars)
                i = j + 1
        try:
            rows.append((name, labels, float(value)))
        except ValueError:
            continue
    return rows


def sample_sum(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    return sum(
        v
        for n, lab, v in samples
        if n == name and all(lab.get(k) == want for k, want in labels.items())
    )


RESPONSES = "visiongate_responses_total"


def responses_served(procs: Sequence[ServeProcess], **labels: str) -> list[float]:
    """Each gateway's responses so far (its `visiongate_responses_total`, with `labels`); a
    process that is not running counts as 0."""
    return [sample_sum(p.metrics(), RESPONSES, **labels) if p.alive else 0.0 for p in procs]


def which_served(
    procs: Sequence[ServeProcess], before: Sequence[float], timeout_s: float = 10.0, **labels: str
) -> int:
    """The index of the one gateway whose response count grew since `before` (a response is
    counted as it ends, a moment after its last byte reached the client)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = responses_served(procs, **labels)
        grew = [i for i, (a, b) in enumerate(zip(before, now, strict=True)) if b > a]
        if len(grew) == 1:
            return grew[0]
        if len(grew) > 1:
            raise AssertionError(f"several gateways served a response: {before} -> {now}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no gateway counted a response within {timeout_s} s: {now}")
        time.sleep(0.05)
