"""TLS served by the gateway itself: the Python SDK trusting the test CA gets through, a client
that trusts only the system's CAs is refused at the handshake, and plain HTTP on the TLS port
gets nothing; `visiongate serve --ssl-certfile/--ssl-keyfile` reach the settings."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from gateway.cli.main import _load_settings, build_parser
from gateway.settings import Settings, SettingsError
from tests.frameworks.conftest import API_KEY, LocalCA

pytestmark = pytest.mark.slow


def test_the_sdk_trusts_the_ca_and_nothing_else(base_url: str, test_ca: LocalCA) -> None:
    with httpx.Client(verify=test_ca.context()) as http:
        client = openai.OpenAI(base_url=base_url, api_key=API_KEY, http_client=http, max_retries=0)
        (card,) = client.models.list().data
        assert card.id
    with httpx.Client() as http:  # the system's CAs only
        client = openai.OpenAI(base_url=base_url, api_key=API_KEY, http_client=http, max_retries=0)
        with pytest.raises(openai.APIConnectionError) as info:
            client.models.list()
        assert "CERTIFICATE_VERIFY_FAILED" in repr(info.value.__cause__)
    with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port
        httpx.get(base_url.replace("https://", "http://") + "/models", timeout=10)


def test_serve_flags_and_settings(test_ca: LocalCA, tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["serve", "--ssl-certfile", str(test_ca.cert_pem), "--ssl-keyfile", str(test_ca.key_pem)]
    )
    settings = _load_settings(args)
    assert (settings.ssl_certfile, settings.ssl_keyfile) == (
        str(test_ca.cert_pem),
        str(test_ca.key_pem),
    )
    environ = {"VISIONGATE_SSL_CERTFILE": str(test_ca.cert_pem)}
    with pytest.raises(SettingsError, match="VISIONGATE_SSL_KEYFILE: TLS needs both"):
        Settings.load(environ=environ)
    environ["VISIONGATE_SSL_KEYFILE"] = str(tmp_path / "missing.pem")
    with pytest.raises(SettingsError, match="no such file"):
        Settings.load(environ=environ)
