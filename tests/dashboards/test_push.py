"""`dashboards.push` against a small fake Grafana HTTP API.

No Grafana server runs here, so `FakeGrafana` stands in for one: a loopback HTTP server that
implements just the endpoints provisioning uses (folders, dashboards/db, provisioning
alert-rules), keeps what was written, and records every call for the assertions.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from grafana_client.client import GrafanaUnauthorizedError

from dashboards import DASHBOARD_UIDS, alert_rules, build_all, push

TOKEN = "glsa_test_token"


class FakeGrafana:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str | None, Any]] = []  # method, path, auth, body
        self.folders: dict[str, dict[str, Any]] = {}
        self.dashboards: dict[str, dict[str, Any]] = {}
        self.rules: dict[str, dict[str, Any]] = {}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeGrafana:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if method == "GET" and path.startswith("/api/folders/"):
            uid = path.rsplit("/", 1)[1]
            if uid in self.folders:
                return 200, self.folders[uid]
            return 404, {"message": "folder not found"}
        if method == "POST" and path == "/api/folders":
            folder = {"id": len(self.folders) + 1, "uid": body["uid"], "title": body["title"]}
            self.folders[body["uid"]] = folder
            return 200, folder
        if method == "POST" and path == "/api/dashboards/db":
            dash = body["dashboard"]
            if body.get("folderUid") not in self.folders:
                return 400, {"message": "folder does not exist"}
            self.dashboards[dash["uid"]] = body
            return 200, {
                "id": 1,
                "uid": dash["uid"],
                "url": f"/d/{dash['uid']}/x",
                "status": "success",
                "version": 1,
            }
        if path.startswith("/api/v1/provisioning/alert-rules"):
            uid = path.rsplit("/", 1)[1] if path.count("/") == 5 else None
            if method == "GET" and uid:
                return (200, self.rules[uid]) if uid in self.rules else (404, {"message": "nf"})
            if method == "POST" and uid is None:
                if body["folderUID"] not in self.folders:
                    return 400, {"message": "folder does not exist"}
                self.rules[body["uid"]] = body
                return 201, body
            if method == "PUT" and uid in self.rules:
                self.rules[uid] = body
                return 200, body
        return 404, {"message": f"no route {method} {path}"}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                auth = self.headers.get("Authorization")
                fake.calls.append((self.command, self.path, auth, body))
                if auth != f"Bearer {TOKEN}":
                    status, payload = 401, {"message": "invalid API key"}
                else:
                    status, payload = fake.handle(self.command, self.path, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = _serve

            def log_message(self, *args: Any) -> None:
                return

        return Handler


@pytest.fixture
def grafana() -> Iterator[FakeGrafana]:
    fake = FakeGrafana().start()
    yield fake
    fake.stop()


def test_push_provisions_folder_dashboards_and_rules(grafana: FakeGrafana) -> None:
    summary = push(grafana.url, TOKEN, folder="visiongate", datasource_uid="prom-main")
    assert summary.folder_uid == "visiongate" and summary.folder_created
    assert set(summary.dashboards) == set(DASHBOARD_UIDS)
    assert summary.dashboards["visiongate-overview"] == "/d/visiongate-overview/x"
    expected_rules = [r["uid"] for r in alert_rules()]
    assert summary.rules_created == expected_rules and summary.rules_updated == []

    assert all(auth == f"Bearer {TOKEN}" for _, _, auth, _ in grafana.calls)
    methods = [(m, p) for m, p, _, _ in grafana.calls]
    assert methods[:2] == [("GET", "/api/folders/visiongate"), ("POST", "/api/folders")]
    assert grafana.folders["visiongate"]["title"] == "visiongate"

    built = build_all()
    for uid in DASHBOARD_UIDS:
        saved = grafana.dashboards[uid]
        assert saved["folderUid"] == "visiongate" and saved["overwrite"] is True
        committed = built[f"{uid}.json"]
        assert {**saved["dashboard"], "id": None} == {**committed, "id": None}
    for uid, rule in grafana.rules.items():
        assert rule["folderUID"] == "visiongate"
        assert rule["data"][0]["datasourceUid"] == "prom-main"

    # A second push changes nothing structurally: folder reused, rules updated in place.
    grafana.calls.clear()
    again = push(grafana.url, TOKEN, folder="visiongate", datasource_uid="prom-main")
    assert not again.folder_created
    assert again.rules_created == [] and again.rules_updated == expected_rules
    assert ("POST", "/api/folders") not in [(m, p) for m, p, _, _ in grafana.calls]
    assert len(grafana.rules) == len(expected_rules)


def test_folder_title_becomes_a_uid(grafana: FakeGrafana) -> None:
    summary = push(grafana.url, TOKEN, folder="Vision Gate / Prod")
    assert summary.folder_uid == "vision-gate-prod"
    assert grafana.folders["vision-gate-prod"]["title"] == "Vision Gate / Prod"


def test_bad_token_is_an_error(grafana: FakeGrafana) -> None:
    with pytest.raises(GrafanaUnauthorizedError):
        push(grafana.url, "wrong")
