"""Headless Chromium drives the playground at `/`: upload a real photo, ask, watch it stream.

Uses Debian's chromium (`make system-deps` installs it), driven by Playwright's Python package with
`executable_path`; no browser is downloaded. The screenshot is kept under `artifacts/`.
"""

from __future__ import annotations

import shutil
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
    """Debian's chromium, which `make system-deps` installs; a test never installs it itself."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("chromium is not installed: `make system-deps` installs Debian's package")


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


REAL_KEY = "pg-real-key-4d1c9e77"  # an app's key: the page must never see it
PLAYGROUND_KEY = "pg-playground-key-0b5a"  # the key the gateway mints the page's keys with


def fake_server(**settings_overrides):
    """A gateway over the fake engine and encoder (these tests are about the playground's
    connection and keys, not the model)."""
    from gateway.server.app import create_app
    from gateway.settings import Settings
    from gateway.testing.fakes import FakeEncoder, FakeEngine

    settings = Settings.load(dict(max_output_tokens=16, **settings_overrides), environ={})
    server = ServerThread(
        create_app(settings, engine=FakeEngine(), encoder=FakeEncoder()), settings
    )
    return server


@pytest.fixture(scope="module")
def pasting_server():
    """Keys required, no playground key: the page takes a pasted ephemeral key."""
    with fake_server(api_keys=[REAL_KEY]) as server:
        server.wait_ready(timeout=60)
        yield server


@pytest.fixture(scope="module")
def minting_server():
    """Playground mode: the gateway mints the page's ephemeral keys with PLAYGROUND_KEY."""
    with fake_server(
        api_keys=[REAL_KEY, PLAYGROUND_KEY], playground_api_key=PLAYGROUND_KEY
    ) as server:
        server.wait_ready(timeout=60)
        yield server


class Wire:
    """Everything the page sends and receives on the network, read over the DevTools protocol
    (the WebSocket handshake's headers included, which Playwright's own events do not show)."""

    EVENTS = (
        "Network.requestWillBeSent",
        "Network.requestWillBeSentExtraInfo",
        "Network.webSocketCreated",
        "Network.webSocketWillSendHandshakeRequest",
        "Network.webSocketFrameSent",
    )

    def __init__(self, page) -> None:
        self.events: list[tuple[str, str]] = []
        self.bodies: list[str] = []
        cdp = page.context.new_cdp_session(page)
        cdp.send("Network.enable")
        for name in self.EVENTS:
            cdp.on(name, lambda params, name=name: self.events.append((name, repr(params))))
        page.on("response", self._response)

    def _response(self, response) -> None:
        try:
            self.bodies.append(response.text())
        except Exception:  # a WebSocket upgrade or a body already gone
            pass

    def handshakes(self) -> list[str]:
        return [e for n, e in self.events if n == "Network.webSocketWillSendHandshakeRequest"]

    def holds(self, secret: str) -> bool:
        return any(secret in e for _, e in self.events) or any(secret in b for b in self.bodies)


def page_holds(page, secret: str) -> bool:
    """Whether the page's DOM, storage or script state holds `secret`."""
    return secret in page.evaluate(
        """() => document.documentElement.outerHTML + JSON.stringify(localStorage)
            + JSON.stringify(sessionStorage) + document.getElementById('api-key').value"""
    )


def ask(page, question: str) -> str:
    page.fill("#question", question)
    page.click("#send")
    page.wait_for_selector(".msg.assistant .timings[data-status]", timeout=30_000)
    return page.text_content(".msg.assistant .text") or ""


def test_playground_mode_connects_with_a_key_the_gateway_mints(browser, minting_server) -> None:
    page = browser.new_page()
    wire = Wire(page)
    console_errors: list[str] = []
    page.on("console", lambda msg: console_errors.append(msg.text) if msg.type == "error" else None)
    page.goto(minting_server.http_url + "/")
    page.wait_for_selector("#status.ready", timeout=30_000)
    assert page.evaluate("() => ws.protocol") == "realtime"  # the public one, never the key
    assert "hello" in ask(page, "hello from the playground")
    # the page asked for a key and connected with an ephemeral one
    handshakes = wire.handshakes()
    assert handshakes and all("openai-insecure-api-key.ek_" in h for h in handshakes), handshakes
    # no real key crossed the wire or stayed in the page
    for secret in (REAL_KEY, PLAYGROUND_KEY):
        assert not wire.holds(secret) and not page_holds(page, secret)
    # a reconnect mints a new key (each lives a minute)
    page.evaluate("() => ws.close()")
    page.wait_for_function("() => ws && ws.readyState === 1", timeout=30_000)
    page.wait_for_selector("#status.ready", timeout=30_000)
    keys = {h.split("openai-insecure-api-key.")[1][:46] for h in wire.handshakes()}
    assert len(keys) == 2
    assert not console_errors, console_errors
    # another site cannot have its visitors' browsers mint with the playground's key
    import httpx

    r = httpx.post(
        minting_server.http_url + "/playground/session", headers={"Origin": "https://evil.example"}
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    page.close()


def test_playground_on_a_gateway_without_keys(browser) -> None:
    with fake_server() as server:
        server.wait_ready(timeout=60)
        page = browser.new_page()
        wire = Wire(page)
        console_errors: list[str] = []
        page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
        page.goto(server.http_url + "/")
        page.wait_for_selector("#status.ready", timeout=30_000)  # no key minted, none needed
        assert "hello" in ask(page, "hello from the playground")
        assert wire.handshakes() and not any(
            "openai-insecure-api-key" in h for h in wire.handshakes()
        )
        assert not console_errors, console_errors
        page.close()


def test_playground_takes_only_a_pasted_ephemeral_key(browser, pasting_server) -> None:
    import httpx

    page = browser.new_page()
    wire = Wire(page)
    sockets: list[str] = []
    page.on("websocket", lambda ws: sockets.append(ws.url))
    page.goto(pasting_server.http_url + "/")
    # keys required and none minted for the page: it says it needs one
    page.wait_for_selector("#status:text('needs an ephemeral key')", timeout=30_000)

    page.click("details summary")
    # a real key typed in by mistake is refused and never sent
    page.fill("#api-key", REAL_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_selector(".msg.error:text('only an ephemeral key')", timeout=10_000)
    assert page.input_value("#api-key") == ""

    # an ephemeral key minted server-side, as the guide says, and pasted
    minted = httpx.post(
        pasting_server.http_url + "/v1/realtime/client_secrets",
        json={"expires_after": {"anchor": "created_at", "seconds": 600}},
        headers={"Authorization": f"Bearer {REAL_KEY}"},
    ).json()["value"]
    page.fill("#api-key", minted)
    page.dispatch_event("#api-key", "change")
    page.wait_for_selector("#status.ready", timeout=30_000)
    assert "hello" in ask(page, "hello from the playground")
    assert any(minted in h for h in wire.handshakes())
    assert not [url for url in sockets if "ek_" in url or "api_key" in url]  # never in a URL
    assert not wire.holds(REAL_KEY) and not page_holds(page, REAL_KEY)

    # a key the gateway refuses (unknown here): the page says so and stops retrying
    page.fill("#api-key", "ek_" + "Z" * 43)
    page.dispatch_event("#api-key", "change")
    page.wait_for_selector("#status:text('key refused')", timeout=30_000)
    page.wait_for_selector(".msg.error:text('paste a new one')", timeout=10_000)
    tries = len(wire.handshakes())
    page.wait_for_timeout(1500)
    assert len(wire.handshakes()) == tries
    page.close()
