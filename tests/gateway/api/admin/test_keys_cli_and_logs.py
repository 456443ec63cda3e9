"""`visiongate keys` against a live gateway, and a managed key kept out of every log line."""

from __future__ import annotations

import io
import json

import httpx
import pytest
import websockets

from gateway.cli.main import main
from gateway.telemetry import configure_logging

ADMIN = "admin-0123456789abcdef-secret"


def run_cli(capsys, *argv: str) -> tuple[int, dict]:
    code = main(list(argv))
    out = capsys.readouterr()
    text = out.out if code == 0 else out.err
    # stderr also holds the in-process gateway's log lines: the answer is the last document
    start = text.rfind("\n{\n") + 1 if not text.startswith("{\n") else 0
    return code, json.loads(text[start:])


def test_keys_cli(make_gateway, monkeypatch, capsys) -> None:
    gw = make_gateway(settings=dict(admin_api_key=ADMIN))
    monkeypatch.setenv("VISIONGATE_ADMIN_API_KEY", ADMIN)
    code, made = run_cli(
        capsys, "keys", "--url", gw.http_url, "create", "--name", "cli", "--rpm", "9"
    )
    assert code == 0 and made["secret"].startswith("vgk-") and made["rpm"] == 9
    headers = {"Authorization": f"Bearer {made['secret']}"}
    assert httpx.get(f"{gw.http_url}/v1/models", headers=headers).status_code == 200
    code, listed = run_cli(capsys, "keys", "--url", gw.http_url, "list")
    assert code == 0 and [k["id"] for k in listed["data"]] == [made["id"]]
    code, limited = run_cli(
        capsys,
        *("keys", "--url", gw.http_url, "create", "--name", "tokens", "--input-tpm", "1000"),
        *("--output-tpm", "200", "--budget-tokens", "50000", "--budget-period", "day"),
    )
    assert code == 0
    assert (limited["input_tpm"], limited["output_tpm"]) == (1000, 200)
    assert (limited["budget_tokens"], limited["budget_period"]) == (50000, "day")
    code, usage = run_cli(
        capsys,
        *("keys", "--url", gw.http_url, "usage", "--start", "2020-01-01", "--end", "2020-01-31"),
    )
    assert code == 0 and (usage["start"], usage["end"]) == ("2020-01-01", "2020-01-31")
    assert [u["id"] for u in usage["data"]] == [made["id"], limited["id"]]
    code, err = run_cli(capsys, "keys", "--url", gw.http_url, "usage", "--end", "2020-01-01")
    assert code == 1 and err["error"]["code"] == "invalid_request"
    code, revoked = run_cli(capsys, "keys", "--url", gw.http_url, "revoke", made["id"])
    assert code == 0 and revoked["revoked"] is True
    assert httpx.get(f"{gw.http_url}/v1/models", headers=headers).status_code == 401
    code, err = run_cli(capsys, "keys", "--url", gw.http_url, "revoke", "key_nope")
    assert code == 1 and err["error"]["code"] == "api_key_not_found"
    monkeypatch.setenv("VISIONGATE_ADMIN_API_KEY", "wrong-admin-key-000000")
    code, err = run_cli(capsys, "keys", "--url", gw.http_url, "list")
    assert code == 1 and err["error"]["code"] == "unauthorized"


async def test_managed_keys_never_reach_logs(make_gateway) -> None:
    gw = make_gateway(settings=dict(admin_api_key=ADMIN))
    logs = io.StringIO()
    configure_logging("debug", json=True, stream=logs)
    try:
        async with httpx.AsyncClient(base_url=gw.http_url) as client:
            admin = {"Authorization": f"Bearer {ADMIN}"}
            made = (await client.post("/v1/admin/keys", json={"name": "x"}, headers=admin)).json()
            secret = made["secret"]
            auth = {"Authorization": f"Bearer {secret}"}
            assert (await client.get("/v1/models", headers=auth)).status_code == 200
            # the key where no pattern expects one: a session id in the path, a model name
            await client.get(f"/v1/sessions/{secret}", headers=auth)
            await client.post(
                "/v1/chat/completions",
                headers=auth,
                json={"model": secret, "messages": [{"role": "user", "content": "hi"}]},
            )
            async with websockets.connect(
                gw.ws_url, subprotocols=["realtime", f"openai-insecure-api-key.{secret}"]
            ) as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
            await client.delete(f"/v1/admin/keys/{made['id']}", headers=admin)
            assert (await client.get("/v1/models", headers=auth)).status_code == 401
            with pytest.raises(websockets.InvalidStatus):
                await websockets.connect(gw.ws_url, additional_headers=auth)
    finally:
        configure_logging("warning", json=True)
    text = logs.getvalue()
    assert "api_key_created" in text and "api_key_revoked" in text
    assert secret not in text and ADMIN not in text
    from gateway.policy.key_store import secret_digest

    assert secret_digest(secret) not in text
