"""Remote image URLs: refused by default, fetched only under an allow-listed prefix."""

from __future__ import annotations

import pytest

from gateway.chat.image_input import parse_image_url
from gateway.chat.remote_images import fetch_remote_images
from gateway.protocol.errors import GatewayError
from gateway.testing.realtime_peer import Peer


async def test_fetch_only_what_the_allow_list_admits(photo_server) -> None:
    allowed, private = (
        f"{photo_server.base}/allowed/chelsea.jpg",
        f"{photo_server.base}/private/chelsea.jpg",
    )
    fetched = await fetch_remote_images(
        [allowed, private, "data:image/png;base64,AAAA"],
        allowlist=[f"{photo_server.base}/allowed/"],
        max_bytes=10**6,
    )
    assert list(fetched) == [allowed] and fetched[allowed][:2] == b"\xff\xd8"
    assert parse_image_url(allowed, max_bytes=10**6, fetched=fetched) == fetched[allowed]
    with pytest.raises(GatewayError) as err:
        parse_image_url(private, max_bytes=10**6, fetched=fetched)
    assert err.value.code == "invalid_image"
    assert await fetch_remote_images([allowed], allowlist=[], max_bytes=10**6) == {}


@pytest.mark.parametrize(
    "path, code",
    [
        ("/allowed/redirect", "image_fetch_failed"),  # a redirect could leave the allow-list
        ("/allowed/missing.png", "image_fetch_failed"),
        ("/allowed/text", "unsupported_image_format"),
        ("/allowed/astronaut.jpg", "image_too_large"),
    ],
)
async def test_fetch_failures_have_codes(photo_server, path: str, code: str) -> None:
    with pytest.raises(GatewayError) as err:
        await fetch_remote_images(
            [photo_server.base + path], allowlist=[f"{photo_server.base}/allowed/"], max_bytes=2000
        )
    assert err.value.code == code


async def test_unreachable_host_is_a_fetch_failure() -> None:
    with pytest.raises(GatewayError) as err:
        await fetch_remote_images(
            ["http://127.0.0.1:1/allowed/x.jpg"],
            allowlist=["http://127.0.0.1:1/"],
            max_bytes=10**6,
            timeout_s=2,
        )
    assert err.value.code == "image_fetch_failed"


@pytest.mark.slow
async def test_gateway_fetches_allow_listed_images(gateway_server, photo_server) -> None:
    peer = await Peer.open(gateway_server.ws_url)
    await peer.add(
        [{"type": "input_image", "image_url": f"{photo_server.base}/private/coffee.jpg"}],
        event_id="private",
    )
    error = await peer.recv()
    assert error["type"] == "error" and error["error"]["code"] == "invalid_image"
    await peer.add(
        [
            {"type": "input_image", "image_url": f"{photo_server.base}/allowed/coffee.jpg"},
            {"type": "input_text", "text": "What is this?"},
        ]
    )
    encoded, _ = await peer.until("visiongate.image.encoded")
    assert encoded["tokens_kept"] > 0
    done, _ = await peer.respond(max_output_tokens=2)
    assert (
        done["response"]["usage"]["input_token_details"]["image_tokens"] == encoded["tokens_kept"]
    )
    await peer.close()

    from openai import AsyncOpenAI, BadRequestError

    client = AsyncOpenAI(base_url=f"{gateway_server.http_url}/v1", api_key="x")
    reply = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        max_tokens=2,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": f"{photo_server.base}/allowed/coffee.jpg"},
                    },
                    {"type": "text", "text": "And this?"},
                ],
            }
        ],
    )
    assert reply.usage.model_extra["visiongate"]["cache"]["vision"] == "hit"
    with pytest.raises(BadRequestError) as err:
        await client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            max_tokens=2,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": f"{photo_server.base}/allowed/missing.jpg"},
                        }
                    ],
                }
            ],
        )
    assert err.value.body["code"] == "image_fetch_failed"
    await client.close()


class Origin:
    """An image host that records every path it is asked for: /ok/cat.png (allowed), /secret.png
    (never to be fetched), and redirects from /ok/hop (to /ok/cat.png), /ok/away (to
    /secret.png), /ok/far (to another port) and /ok/loop (to itself)."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from tests.conftest import photo_bytes

        self.png = photo_bytes("chelsea", fmt="PNG", size=32)
        self.paths: list[str] = []
        origin = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                origin.paths.append(self.path)
                moves = {
                    "/ok/hop": "/ok/cat.png",
                    "/ok/away": "/secret.png",
                    "/ok/far": "http://127.0.0.1:1/ok/cat.png",
                    "/ok/loop": "/ok/loop",
                }
                if self.path in moves:
                    self.send_response(302)
                    self.send_header("Location", moves[self.path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path not in ("/ok/cat.png", "/secret.png"):
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(origin.png)))
                self.end_headers()
                self.wfile.write(origin.png)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.allow = [f"{self.base}/ok/"]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def origin():
    server = Origin()
    yield server
    server.close()


@pytest.fixture
def seen(origin: Origin) -> list[str]:
    origin.paths.clear()
    return origin.paths


@pytest.mark.parametrize(
    "path",
    [
        "/ok/../secret.png",
        "/ok/%2e%2e/secret.png",
        "/ok/.%2E/secret.png",
        "/ok/sub/../../secret.png",
    ],
)
async def test_dot_segments_cannot_leave_the_allowed_prefix(
    origin: Origin, seen: list[str], path: str
) -> None:
    url = origin.base + path
    assert await fetch_remote_images([url], allowlist=origin.allow, max_bytes=10**6) == {}
    with pytest.raises(GatewayError) as err:  # off the list: refused as a remote URL
        parse_image_url(url, max_bytes=10**6, fetched={})
    assert err.value.code == "invalid_image"
    assert seen == []


@pytest.mark.parametrize(
    "path",
    [
        "/ok/..%2fsecret.png",
        "/ok/..%2Fsecret.png",
        "/ok/%2e%2e%2fsecret.png",
        "/ok/..%5csecret.png",
        "/ok/%252e%252e/secret.png",
        "/ok/..;/secret.png",
    ],
)
async def test_encoded_separators_are_refused(origin: Origin, seen: list[str], path: str) -> None:
    with pytest.raises(GatewayError) as err:
        await fetch_remote_images([origin.base + path], allowlist=origin.allow, max_bytes=10**6)
    assert err.value.code == "invalid_request" and err.value.param == "image_url"
    assert seen == []


@pytest.mark.parametrize(
    "make_url",
    [
        lambda o: f"http://user:pw@127.0.0.1:{o.port}/ok/cat.png",
        lambda o: f"http://127.0.0.1:{o.port}@evil.invalid/ok/cat.png",
        lambda o: f"http://allowed.example@127.0.0.1:{o.port}/ok/cat.png",
    ],
)
async def test_user_info_is_refused(origin: Origin, seen: list[str], make_url) -> None:
    allow = [*origin.allow, "http://allowed.example/"]
    with pytest.raises(GatewayError) as err:
        await fetch_remote_images([make_url(origin)], allowlist=allow, max_bytes=10**6)
    assert err.value.code == "invalid_request" and "user info" in err.value.message
    assert seen == []


async def test_what_is_fetched_is_the_normalised_url(origin: Origin, seen: list[str]) -> None:
    urls = [
        f"HTTP://LOCALHOST:{origin.port}/ok/cat.png",  # host case
        f"{origin.base}/ok/./%63at.png#part",  # a dot segment, an escaped letter, a fragment
        f"{origin.base}/ok/x/../cat.png",
    ]
    fetched = await fetch_remote_images(
        urls, allowlist=[f"http://localhost:{origin.port}/ok/", *origin.allow], max_bytes=10**6
    )
    assert list(fetched) == urls and all(body == origin.png for body in fetched.values())
    assert seen == ["/ok/cat.png"] * 3  # the origin saw only the normalised path
    # the allow-list ends on a segment boundary: /ok admits /ok/..., not /okay/...
    assert (
        await fetch_remote_images(
            [f"{origin.base}/okay/cat.png"], allowlist=[f"{origin.base}/ok"], max_bytes=10**6
        )
        == {}
    )


async def test_redirects_are_followed_only_inside_the_allow_list(
    origin: Origin, seen: list[str]
) -> None:
    hop = f"{origin.base}/ok/hop"
    assert await fetch_remote_images([hop], allowlist=origin.allow, max_bytes=10**6) == {
        hop: origin.png
    }
    assert seen == ["/ok/hop", "/ok/cat.png"]
    for path, why in (
        ("/ok/away", "allow-list"),
        ("/ok/far", "allow-list"),
        ("/ok/loop", "redirects more than"),
    ):
        with pytest.raises(GatewayError) as err:
            await fetch_remote_images([origin.base + path], allowlist=origin.allow, max_bytes=10**6)
        assert err.value.code == "image_fetch_failed" and why in err.value.message
    assert "/secret.png" not in seen


async def test_errors_clip_the_url(origin: Origin) -> None:
    url = f"{origin.base}/ok/{'m' * 5000}.png"  # the origin answers 404
    with pytest.raises(GatewayError) as err:
        await fetch_remote_images([url], allowlist=origin.allow, max_bytes=10**6)
    assert err.value.code == "image_fetch_failed" and "HTTP 404" in err.value.message
    assert len(err.value.message) < 300 and f"({len(url)} chars)" in err.value.message
    url = f"{origin.base}/ok/{'m' * 1_000_000}.png"
    with pytest.raises(GatewayError) as err:
        await fetch_remote_images([url], allowlist=origin.allow, max_bytes=10**6)
    assert err.value.code == "invalid_request" and "longer than" in err.value.message
    assert len(err.value.message) < 300
