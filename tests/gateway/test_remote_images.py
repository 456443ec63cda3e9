"""Remote image URLs: refused by default, fetched only under an allow-listed prefix."""

from __future__ import annotations

import pytest

from gateway.image_input import fetch_remote_images, parse_image_url
from gateway.protocol.errors import GatewayError
from tests.gateway.realtime_helpers import Peer


async def test_fetch_only_what_the_allow_list_admits(photo_server) -> None:
    allowed, private = f"{photo_server.base}/allowed/chelsea.jpg", f"{photo_server.base}/private/chelsea.jpg"
    fetched = await fetch_remote_images([allowed, private, "data:image/png;base64,AAAA"],
                                        allowlist=[f"{photo_server.base}/allowed/"], max_bytes=10**6)
    assert list(fetched) == [allowed] and fetched[allowed][:2] == b"\xff\xd8"
    assert parse_image_url(allowed, max_bytes=10**6, fetched=fetched) == fetched[allowed]
    with pytest.raises(GatewayError) as err:
        parse_image_url(private, max_bytes=10**6, fetched=fetched)
    assert err.value.code == "invalid_image"
    assert await fetch_remote_images([allowed], allowlist=[], max_bytes=10**6) == {}


@pytest.mark.parametrize("path, code", [
    ("/allowed/redirect", "image_fetch_failed"),  # a redirect could leave the allow-list
    ("/allowed/missing.png", "image_fetch_failed"),
    ("/allowed/text", "unsupported_image_format"),
    ("/allowed/astronaut.jpg", "image_too_large"),
])
async def test_fetch_failures_have_codes(photo_server, path: str, code: str) -> None:
    with pytest.raises(GatewayError) as err:
        await fetch_remote_images([photo_server.base + path], allowlist=[f"{photo_server.base}/allowed/"],
                                  max_bytes=2000)
    assert err.value.code == code


async def test_unreachable_host_is_a_fetch_failure() -> None:
    with pytest.raises(GatewayError) as err:
        await fetch_remote_images(["http://127.0.0.1:1/allowed/x.jpg"],
                                  allowlist=["http://127.0.0.1:1/"], max_bytes=10**6, timeout_s=2)
    assert err.value.code == "image_fetch_failed"


@pytest.mark.slow
async def test_gateway_fetches_allow_listed_images(gateway_server, photo_server) -> None:
    peer = await Peer.open(gateway_server.ws_url)
    await peer.add([{"type": "input_image", "image_url": f"{photo_server.base}/private/coffee.jpg"}],
                   event_id="private")
    error = await peer.recv()
    assert error["type"] == "error" and error["error"]["code"] == "invalid_image"
    await peer.add([{"type": "input_image", "image_url": f"{photo_server.base}/allowed/coffee.jpg"},
                    {"type": "input_text", "text": "What is this?"}])
    encoded, _ = await peer.until("visiongate.image.encoded")
    assert encoded["tokens_kept"] > 0
    done, _ = await peer.respond(max_output_tokens=2)
    assert done["response"]["usage"]["input_token_details"]["image_tokens"] == encoded["tokens_kept"]
    await peer.close()

    from openai import AsyncOpenAI, BadRequestError

    client = AsyncOpenAI(base_url=f"{gateway_server.http_url}/v1", api_key="x")
    reply = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=2,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"{photo_server.base}/allowed/coffee.jpg"}},
            {"type": "text", "text": "And this?"}]}])
    assert reply.usage.model_extra["visiongate"]["cache"]["vision"] == "hit"
    with pytest.raises(BadRequestError) as err:
        await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=2,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"{photo_server.base}/allowed/missing.jpg"}}]}])
    assert err.value.body["code"] == "image_fetch_failed"
    await client.close()
