"""The official Node SDK's Realtime client (`openai/realtime/ws`, over the gateway's own TLS) in a
tool round trip with an image: the model's call as a `function_call` item with its arguments
streamed, the tool's result sent back as a `function_call_output`, the answer after it; and the
same two turns over the Node SDK's Chat Completions answer token for token the same (greedy);
then an out-of-band response over its own input, and the item retrieve, truncate and delete
events.
The packages are those of `node/package-lock.json` (`npm ci`), as for `test_node_sdk.py`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.frameworks.conftest import API_KEY

if TYPE_CHECKING:  # not imported at run time, where pytest would take it for a test class
    from tests.frameworks.conftest import TestCA

pytestmark = pytest.mark.slow

NODE_DIR = Path(__file__).resolve().parent / "node"


def test_node_realtime_tool_round_trip_matches_chat_completions(
    base_url: str, model_id: str, photo_url: str, test_ca: TestCA, tmp_path: Path
) -> None:
    assert shutil.which("node"), "node is missing: `make system-deps` installs it"
    assert (NODE_DIR / "node_modules" / "openai").is_dir(), "run `npm ci` in tests/frameworks/node"
    photo = tmp_path / "photo.txt"
    photo.write_text(photo_url)
    env = {
        **os.environ,
        "BASE_URL": base_url,
        "API_KEY": API_KEY,
        "MODEL": model_id,
        "PHOTO_FILE": str(photo),
        "NODE_EXTRA_CA_CERTS": str(test_ca.ca_pem),
    }
    env.pop("NODE_TLS_REJECT_UNAUTHORIZED", None)  # the CA is trusted, nothing else is
    run = subprocess.run(
        ["node", "realtime_tools.mjs"],
        cwd=NODE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    realtime, chat = out["realtime"], out["chat"]

    call = realtime["call"]
    assert (call["type"], call["name"], call["status"]) == (
        "function_call",
        "get_weather",
        "completed",
    )
    assert set(json.loads(call["arguments"])) == {"city"}
    assert realtime["streamed"] == realtime["arguments_done"]["arguments"] == call["arguments"]
    assert realtime["arguments_done"]["call_id"] == call["call_id"]
    answer = realtime["answer"]
    assert answer["type"] == "message" and answer["content"][0]["text"] == realtime["text"]
    assert realtime["text"]
    assert realtime["call_usage"]["input_token_details"]["image_tokens"] > 0

    assert (chat["call"]["function"]["name"], chat["call"]["function"]["arguments"]) == (
        call["name"],
        call["arguments"],
    )
    assert chat["text"] == realtime["text"]
    for turn in ("call_usage", "answer_usage"):
        assert chat[turn]["prompt_tokens"] == realtime[turn]["input_tokens"]
        assert chat[turn]["completion_tokens"] == realtime[turn]["output_tokens"]

    items = out["items"]
    side = items["side"]
    assert side["status"] in ("completed", "incomplete") and side["conversation_id"] is None
    assert side["metadata"] == {"run": "side"} and side["output"][0]["type"] == "message"
    assert not [t for t in items["side_events"] if t.startswith("conversation.")]
    assert items["retrieved"] == {**call, "status": "completed"}
    truncated, answer_id = items["truncated"], items["answer_id"]
    assert (truncated["item_id"], truncated["content_index"], truncated["audio_end_ms"]) == (
        answer_id,
        0,
        0,
    )
    assert items["deleted"]["item_id"] == answer_id
    gone = items["gone"]
    assert (gone["code"], gone["param"], gone["event_id"]) == ("item_not_found", "item_id", "gone")
