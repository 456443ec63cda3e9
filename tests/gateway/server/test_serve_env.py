"""`visiongate serve` as a real process, started from a shell that exports the client tools'
variables: `VISIONGATE_API_KEY` (what `visiongate client-secret` and the API-keys guide use) and
the others of NOT_SETTINGS do not stop it; a misspelt setting still does."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from gateway.settings import NOT_SETTINGS, Settings
from gateway.testing.ports import free_port
from gateway.testing.processes import ROOT


def serve(env_extra: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VISIONGATE_")}
    env.update(env_extra)
    # an upstream engine that loads no model: the process listens at once
    args = [
        "--port",
        str(port),
        "--engine",
        "openai",
        "--upstream",
        f"http://127.0.0.1:{free_port()}",
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli.main", "serve", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def test_serve_starts_with_the_client_tools_variables_exported() -> None:
    port = free_port()
    proc = serve(
        {
            "VISIONGATE_API_KEY": "sk-a-client-key-0123456789",
            "VISIONGATE_KEY": "vgk-" + "a" * 43,
            "VISIONGATE_FUZZ_SEED": "7",
        },
        port,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]  # type: ignore[union-attr]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "serve did not listen within 60 s"
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_misspelt_setting_still_stops_serve() -> None:
    proc = serve({"VISIONGATE_PROT": "8001"}, free_port())
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert b"VISIONGATE_PROT: unknown setting" in out


def test_no_client_variable_is_also_a_setting() -> None:
    import msgspec

    fields = {f.name for f in msgspec.structs.fields(Settings)}
    assert not NOT_SETTINGS & fields


def test_more_connections_than_the_process_may_open_files_for_are_refused() -> None:
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here to exceed")
    proc = serve(
        {
            "VISIONGATE_MAX_CONNECTIONS": str(hard),
            "VISIONGATE_MAX_UNAUTHENTICATED_CONNECTIONS": "1",
        },
        free_port(),
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert b"VISIONGATE_MAX_CONNECTIONS:" in out and b"open files" in out
