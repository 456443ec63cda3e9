"""JSON bodies are counted before they are decoded: many tiny values are refused with
`request_too_large` while a body as large but made of one long string (an inline image) passes
the count."""

from __future__ import annotations

import httpx
import pytest

from gateway.api.http.bodies import MAX_JSON_VALUES, check_json_values
from gateway.protocol.errors import GatewayError
from gateway.testing.fake_gateway import FakeGateway

MODEL = "fake-echo"


@pytest.mark.parametrize(
    ("route", "body"),
    [
        # ~2.4 MB: far under the size limits, but over a million values to decode
        (
            "responses",
            b'{"model": "fake-echo", "input": "x", "tools": [' + b"{}," * 600_000 + b"{}]}",
        ),
        (
            "chat/completions",
            b'{"model": "fake-echo", "messages": [], "stop": [' + b'"",' * 600_000 + b'""]}',
        ),
        ("completions", b'{"model": "fake-echo", "prompt": [' + b'"",' * 600_000 + b'""]}'),
    ],
)
def test_a_body_of_many_tiny_values_is_refused_before_decoding(
    fake_gateway: FakeGateway, route: str, body: bytes
) -> None:
    answer = httpx.post(
        f"{fake_gateway.http_url}/v1/{route}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert answer.status_code == 413, answer.text
    error = answer.json()["error"]
    assert error["code"] == "request_too_large" and "JSON values" in error["message"]
    # the gateway still answers
    assert httpx.get(f"{fake_gateway.http_url}/v1/models", timeout=10).status_code == 200


def test_one_long_string_passes_the_count() -> None:
    image = b'{"url": "data:image/png;base64,' + b"A" * (4 * MAX_JSON_VALUES) + b'"}'
    check_json_values(image)  # one value, however long
    with pytest.raises(GatewayError) as refused:
        check_json_values(b"[" + b"1," * MAX_JSON_VALUES + b"1]")
    assert refused.value.code == "request_too_large"
