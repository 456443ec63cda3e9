"""Headless Chromium drives the playground at `/`: upload a real photo, ask, watch it stream.

Uses Debian's chromium (`apt-get install chromium`), driven by Playwright's Python package with
`executable_path`; no browser is downloaded. The screenshot is kept under `artifacts/`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gateway.server.runner import ServerThread
from tests.conftest import unique_photo

REPO = Path(__file__).resolve().parents[4]
ARTIFACTS = REPO / "artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    if shutil.which("apt-get") is None or (hasattr(os, "geteuid") and os.geteuid() != 0):
        pytest.fail(
            "chromium is not installed; install Debian's package: "
            "apt-get update && apt-get install -y chromium"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=900, check=False
        )
        if done.returncode != 0:
            pytest.fail(f"installing chromium failed ({' '.join(cmd)}): {done.stderr[-2000:]}")
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("apt-get installed chromium but no `chromium` is on PATH")
    return path


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(
            "the `playwright` Python package is missing: pip install playwright "
            "(no `playwright install`: the test uses Debian's chromium)"
        )
    executable = find_chromium()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


def test_playground_streams_an_answer_about_a_photo(
    browser, gateway_server: ServerThread, tmp_path: Path
) -> None:
    photo = tmp_path / "astronaut.jpg"
    photo.write_bytes(unique_photo("astronaut"))
    page = browser.new_page(viewport={"width": 1280, "height": 820})
    console_errors: list[str] = []
    page.on("console", lambda msg: console_errors.append(msg.text) if msg.type == "error" else None)
    page.goto(gateway_server.http_url + "/")
    page.wait_for_selector("#status.ready", timeout=60_000)
    assert page.text_content("#session-id").startswith("sess_")

    page.click("details summary")  # the settings panel
    page.fill("#max-tokens", "12")
    page.set_input_files("#file-input", str(photo))
    page.wait_for_selector("#image-status[data-state=encoded]", timeout=120_000)
    assert "visual tokens" in page.text_content("#image-status")

    page.fill("#question", "What is in this picture?")
    # count text updates while it streams: more than one means it arrived piece by piece
    page.evaluate("""() => {
        window.__updates = 0;
        const log = document.getElementById('log');
        new MutationObserver(() => { window.__updates += 1; })
            .observe(log, {subtree: true, characterData: true, childList: true});
    }""")
    page.click("#send")
    page.wait_for_selector(".msg.assistant .timings[data-status]", timeout=180_000)

    answer = page.text_content(".msg.assistant .text")
    timings = page.text_content(".msg.assistant .timings")
    assert answer and answer.strip()
    for label in ("encode", "prefill", "TTFT", "total", "vision", "KV reused"):
        assert label in timings, timings
    assert "encode 0 ms" in timings and "vision pre-encoded" in timings  # encoded while typing
    assert page.evaluate("window.__updates") > 3

    # a follow-up about the same image: its visual tokens and the first turn's KV are reused
    page.fill("#question", "What colour is the suit?")
    page.click("#send")
    page.wait_for_selector(".msg.assistant:nth-of-type(5) .timings[data-status]", timeout=180_000)
    second = page.text_content(".msg.assistant:nth-of-type(5) .timings")
    assert "vision hit" in second, second
    reused = int(second.split("KV reused ")[1].split(" ")[0])
    assert reused > 0, second

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "playground.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"playground screenshot: {shot}")
    assert shot.stat().st_size > 10_000
    assert not [e for e in console_errors if "favicon" not in e], console_errors
    page.close()


@pytest.fixture(scope="module")
def keyed_fake_server():
    """A gateway that wants an API key, over the fake engine and encoder (the test is about the
    playground's connection, not the model)."""
    from gateway.server.app import create_app
    from gateway.settings import Settings
    from gateway.testing.fakes import FakeEncoder, FakeEngine

    settings = Settings.load(dict(api_keys=["pg-key-4d1c9e"], max_output_tokens=16), environ={})
    with ServerThread(
        create_app(settings, engine=FakeEngine(), encoder=FakeEncoder()), settings
    ) as server:
        server.wait_ready(timeout=60)
        yield server


def test_playground_sends_the_key_as_a_subprotocol(browser, keyed_fake_server) -> None:
    page = browser.new_page()
    sockets: list[str] = []
    page.on("websocket", lambda ws: sockets.append(ws.url))
    page.goto(keyed_fake_server.http_url + "/")
    # without a key the gateway refuses the handshake: the page keeps trying
    page.wait_for_function("() => document.getElementById('status').textContent !== ''")
    assert "ready" not in (page.get_attribute("#status", "class") or "")

    page.click("details summary")
    page.fill("#api-key", "pg-key-4d1c9e")
    page.dispatch_event("#api-key", "change")
    page.wait_for_selector("#status.ready", timeout=30_000)
    # the accepted subprotocol is the public one, and no URL carried the key
    assert page.evaluate("() => ws.protocol") == "realtime"
    assert sockets and not [url for url in sockets if "pg-key" in url or "api_key" in url]

    page.fill("#question", "hello from the playground")
    page.click("#send")
    page.wait_for_selector(".msg.assistant .timings[data-status]", timeout=30_000)
    assert "hello" in page.text_content(".msg.assistant .text")
    page.close()
