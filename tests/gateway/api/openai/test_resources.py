"""Models, image uploads, sessions and the OpenAPI schema of the HTTP API."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from openai import OpenAI

from tests.conftest import photo_bytes


def wait_ready(http: httpx.Client, digest: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = http.get(f"/v1/images/{digest}").json()
        if body["status"] != "encoding":
            return body
        time.sleep(0.05)
    raise TimeoutError(f"image {digest} still encoding after {timeout}s")


def test_models(openai_client: OpenAI, http: httpx.Client, model: str) -> None:
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [model] and models.data[0].object == "model"
    assert openai_client.models.retrieve(model).id == model
    r = http.get("/v1/models/gpt-nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_upload_raw_then_reference_by_digest(
    http: httpx.Client, openai_client: OpenAI, model: str
) -> None:
    image = photo_bytes("coins", size=160)
    r = http.post("/v1/images", content=image, headers={"Content-Type": "image/jpeg"})
    assert r.status_code == 200, r.text
    up = r.json()
    assert up["object"] == "visiongate.image" and up["status"] in ("encoding", "ready")
    assert up["ref"] == f"visiongate:sha256:{up['id']}"
    assert (up["format"], up["width"], up["height"], up["bytes"]) == ("JPEG", 160, 160, len(image))
    done = wait_ready(http, up["id"])
    assert done["status"] == "ready" and 0 < done["tokens_kept"] <= done["tokens_total"]

    # pre-encoded: the chat request finds the tokens in the cache
    completion = openai_client.chat.completions.create(
        model=model,
        max_tokens=4,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": up["ref"]}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
    )
    assert completion.usage.model_extra["visiongate"]["cache"]["vision"] == "hit"
    assert completion.usage.model_extra["visiongate"]["image_tokens"] == done["tokens_kept"]


def test_upload_multipart(http: httpx.Client) -> None:
    image = photo_bytes("coffee", fmt="PNG", size=96)
    r = http.post("/v1/images", files={"file": ("coffee.png", image, "image/png")})
    assert r.status_code == 200, r.text
    assert r.json()["format"] == "PNG"
    assert wait_ready(http, r.json()["id"])["status"] == "ready"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"not an image at all", 400, "invalid_image"),
        (b"", 400, "invalid_image"),
    ],
)
def test_upload_refusals(http: httpx.Client, body: bytes, status: int, code: str) -> None:
    r = http.post("/v1/images", content=body, headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == status and r.json()["error"]["code"] == code


def test_unknown_image_and_reference(http: httpx.Client, openai_client: OpenAI, model: str) -> None:
    missing = "0" * 64
    r = http.get(f"/v1/images/{missing}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "image_not_found"
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": f"visiongate:sha256:{missing}"}}
                    ],
                }
            ],
        },
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "image_not_found"


def test_sessions_get_and_delete(http: httpx.Client, model: str) -> None:
    sid = f"http-sess-{uuid.uuid4().hex[:8]}"
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "max_tokens": 3,
            "session_id": sid,
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Hello"},
            ],
        },
    )
    assert r.status_code == 200 and r.headers["x-session-id"] == sid
    view = http.get(f"/v1/sessions/{sid}").json()
    assert view["object"] == "visiongate.session" and view["instructions"] == "Be brief."
    assert [i["role"] for i in view["items"]] == ["user", "assistant"]

    # a different conversation under the same id replaces the stored one
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "max_tokens": 3,
            "session_id": sid,
            "messages": [{"role": "user", "content": "Something else"}],
        },
    )
    assert r.status_code == 200
    view = http.get(f"/v1/sessions/{sid}").json()
    assert next(i["content"][0]["text"] for i in view["items"]) == "Something else"
    assert len(view["items"]) == 2

    assert http.delete(f"/v1/sessions/{sid}").json() == {
        "id": sid,
        "deleted": True,
        "object": "visiongate.session.deleted",
    }
    for r in (http.get(f"/v1/sessions/{sid}"), http.delete(f"/v1/sessions/{sid}")):
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


def test_openapi_schema(http: httpx.Client) -> None:
    schema = http.get("/schema/openapi.json").json()
    paths = schema["paths"]
    for path in (
        "/v1/chat/completions",
        "/v1/models",
        "/v1/images",
        "/v1/images/{digest}",
        "/v1/sessions/{session_id}",
    ):
        assert path in paths
    post = paths["/v1/chat/completions"]["post"]
    assert "requestBody" in post and {"200", "400", "404"} <= set(post["responses"])
    assert "ChatCompletionRequest" in str(post["requestBody"])


def test_playground_is_served(http: httpx.Client) -> None:
    r = http.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "visiongate" in r.text
    assert http.get("/static/playground.js").status_code == 200
    assert http.get("/static/playground.css").status_code == 200
