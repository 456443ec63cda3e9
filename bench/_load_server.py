"""Gateway subprocesses for the load benchmark: start, wait for /readyz, stop.

Each configuration runs `python -m gateway serve` in its own process on a free loopback port,
configured only through `VISIONGATE_*` variables. A setting is passed only when this build's
`Settings` struct has the field; the others are recorded as skipped, so the benchmark runs
unchanged on gateways with and without newer engine settings. Of the caller's own
`VISIONGATE_*` variables only those choosing the model and the hardware are inherited
(`INHERITED`); Redis URLs, keys and OTLP exporters are not, so both gateways run in process,
on loopback, with nothing else on the path. `stop` ends the process it
started (SIGTERM, then SIGKILL after a grace period), and is safe to call more than once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import structlog

from gateway.testing.ports import free_port
from gateway.testing.processes import spawn_logged, terminate, wait_for_readyz

__all__ = ("GatewayProcess", "redacted", "settings_fields")

log = structlog.get_logger("bench.load")

ENV_PREFIX = "VISIONGATE_"
INHERITED = ("cache_dir", "model_path", "vision_tower", "device", "lm_dtype")


def settings_fields() -> set[str]:
    """Names of the gateway's settings in the code that is about to run."""
    import msgspec

    from gateway.settings import Settings

    return {f.name for f in msgspec.structs.fields(Settings)}


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def redacted(settings: dict[str, Any] | str) -> dict[str, Any] | str:
    """`settings` with its API keys replaced by how many there are (for logs and reports)."""
    if isinstance(settings, dict) and "api_keys" in settings:
        return {**settings, "api_keys": f"<{len(settings['api_keys'])} keys>"}
    return settings


class GatewayProcess:
    """One gateway in a child process, listening on 127.0.0.1 only."""

    def __init__(
        self,
        name: str,
        overrides: dict[str, Any],
        log_path: Path,
        *,
        command: tuple[str, ...] = ("gateway", "serve"),
    ) -> None:
        fields = settings_fields()
        self.name = name
        self.command = command  # `python -m <command>` in the child
        self.requested = dict(overrides)
        self.applied = {k: v for k, v in overrides.items() if k in fields}
        self.skipped = sorted(k for k in overrides if k not in fields)
        self.port = free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        inherited = {ENV_PREFIX + name.upper() for name in INHERITED}
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("OTEL_", ENV_PREFIX)) or k in inherited
        }
        for key, value in {**self.applied, "host": "127.0.0.1", "port": self.port}.items():
            self.env[ENV_PREFIX + key.upper()] = _env_value(value)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    def effective_settings(self) -> dict[str, Any]:
        """The settings the child resolves from the same environment (validated here too)."""
        import msgspec

        from gateway.settings import Settings

        return msgspec.to_builtins(Settings.load(environ=self.env))

    def start(self) -> GatewayProcess:
        argv = [sys.executable, "-m", *self.command]
        self.proc = spawn_logged(argv, self.log_path, self.env, cwd=None, truncate=True)
        log.info(
            "gateway_starting",
            config=self.name,
            port=self.port,
            pid=self.proc.pid,
            settings=redacted(self.applied),
            skipped=self.skipped or None,
        )
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> dict[str, Any]:
        assert self.proc is not None, "start() first"
        body = wait_for_readyz(
            self.proc, self.http_url, f"gateway {self.name!r}", self.log_path, self._tail, timeout_s
        )
        log.info("gateway_ready", config=self.name, port=self.port)
        return body

    def stop(self, grace_s: float = 15.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        terminate(proc, grace_s)
        log.info("gateway_stopped", config=self.name, returncode=proc.returncode)

    def _tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
