"""The blocking client and reconnect-and-resume, against the real gateway."""

from __future__ import annotations

import asyncio

import pytest

from gateway.sdk.client import RealtimeError
from gateway.sdk.resuming_client import Client, ResumingClient
from gateway.server.runner import ServerThread
from tests.conftest import photo_bytes


def drop(client: Client) -> None:
    """Cut the WebSocket under the client, as a network failure would."""

    async def cut(resuming: ResumingClient) -> None:
        await resuming.realtime._ws.close()
        await asyncio.sleep(0.05)

    client.call(cut)


def test_sync_client_streams_and_resumes_after_a_drop(gateway_server: ServerThread) -> None:
    resumed: list[str] = []
    image = photo_bytes("chelsea", size=180)
    with Client(gateway_server.ws_url, on_resume=lambda c: resumed.append(c.session_id)) as client:
        session_id = client.session_id
        client.add_image(image)
        texts = list(client.ask("What animal is this?", max_output_tokens=8))
        first = client.last_result
        assert first is not None and first.status in ("completed", "incomplete")
        assert "".join(texts) == first.text and len(texts) >= 2
        assert first.image_tokens > 0

        drop(client)
        # the next call notices the drop, resumes the same session and carries on
        second = client.answer("And what colour is it?", max_output_tokens=6)
        assert resumed == [session_id] and client.resumes == 1
        assert client.session_id == session_id
        assert second.cache["vision"] == "hit"
        assert second.cached_tokens > 0  # the first turn's KV, image included
        roles = [item["role"] for item in client.history]
        assert roles == ["user", "user", "assistant"]  # history as of resuming
        assert (
            sum(
                1
                for i in client.history
                if i["role"] == "user" and i["content"][0].get("text") == "And what colour is it?"
            )
            == 0
        )


def test_resume_after_the_session_is_deleted_fails_clearly(gateway_server: ServerThread) -> None:
    import httpx

    with Client(gateway_server.ws_url, retries=1, backoff_s=0.01) as client:
        client.add_message([{"type": "input_text", "text": "hello"}])
        assert (
            httpx.delete(f"{gateway_server.http_url}/v1/sessions/{client.session_id}").status_code
            == 200
        )
        drop(client)
        with pytest.raises(RealtimeError) as caught:
            client.answer(max_output_tokens=2)
        assert caught.value.code == "session_not_found"
