"""The official OpenAI Node SDK (`openai` on npm, with `ws`) against the real gateway over TLS.
`node/sdk_checks.mjs` runs every check once in one Node process (chat with an image, the chat
stream helper, `runTools`, the Responses API and its stream, the Realtime WebSocket client over
wss with an image) and prints one JSON report, which each test here reads. Node trusts the
test CA through `NODE_EXTRA_CA_CERTS`, as a user's would. The packages are installed from
`node/package-lock.json` by `make system-deps` (`npm ci`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.frameworks.conftest import API_KEY, LocalCA

pytestmark = pytest.mark.slow

NODE_DIR = Path(__file__).parent / "node"


@pytest.fixture(scope="module")
def report(base_url: str, model_id: str, photo_url: str, test_ca: LocalCA) -> dict[str, Any]:
    node = shutil.which("node")
    assert node, "node is missing: `make system-deps` installs it"
    assert (NODE_DIR / "node_modules" / "openai").is_dir(), "run `npm ci` in tests/frameworks/node"
    env = {
        **os.environ,
        "BASE_URL": base_url,
        "API_KEY": API_KEY,
        "MODEL": model_id,
        "PHOTO_URL": photo_url,
        "NODE_EXTRA_CA_CERTS": str(test_ca.ca_pem),
    }
    env.pop("NODE_TLS_REJECT_UNAUTHORIZED", None)  # the CA is trusted, nothing else is
    done = subprocess.run(
        [node, "sdk_checks.mjs"],
        cwd=NODE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def part(report: dict[str, Any], name: str) -> dict[str, Any]:
    value = report[name]
    assert "error" not in value, value.get("error") if isinstance(value, dict) else value
    return value


def test_models_carry_root_and_parent(report: dict[str, Any], model_id: str) -> None:
    assert part(report, "models") == [{"id": model_id, "root": model_id, "parent": None}]


def test_chat_with_an_image(report: dict[str, Any]) -> None:
    chat = part(report, "chat_image")
    assert chat["text"] and chat["finish_reason"] in ("stop", "length")
    assert chat["image_tokens"] > 0 and chat["prompt_tokens"] > chat["image_tokens"]


def test_chat_stream_helper(report: dict[str, Any]) -> None:
    stream = part(report, "chat_stream")
    assert stream["plain"] and stream["streamed"] == stream["final"] == stream["plain"]


def test_run_tools(report: dict[str, Any]) -> None:
    run = part(report, "run_tools")
    (call,) = run["calls"]  # a named tool_choice: one call, then the runner ends
    assert set(call) == {"city"} and isinstance(call["city"], str)
    assert run["messages"] == ["user", "assistant", "tool"]
    assert run["result"] == f"It is sunny and 21 C in {call['city']}."


def test_responses_and_their_stream(report: dict[str, Any]) -> None:
    responses = part(report, "responses")
    assert responses["text"] and responses["status"] in ("completed", "incomplete")
    assert responses["input_tokens"] > responses["plain_input_tokens"] + 50  # the image's
    assert responses["streamed"] == responses["final"] == responses["plain"] != ""


def test_realtime_over_wss_with_an_image(report: dict[str, Any]) -> None:
    realtime = part(report, "realtime")
    assert realtime["url"].startswith("wss://127.0.0.1:")
    assert realtime["status"] in ("completed", "incomplete")
    assert realtime["text"] and realtime["streamed"] == realtime["text"]
    assert realtime["image_tokens"] > 0
    assert {"session.updated", "conversation.item.added", "response.created"} <= set(
        realtime["seen"]
    )
