"""A gateway serving in a process of its own freezes its startup heap once the models are loaded
(`gc.freeze`): allocation-heavy requests then stop paying collector passes over it."""

from __future__ import annotations

import gc

import pytest
import uvicorn

from gateway.server.app import create_app
from gateway.server.runner import ServerThread, serve
from gateway.testing.fake_gateway import unit_settings
from gateway.testing.fakes import FakeEncoder, FakeEngine


def test_serve_asks_for_the_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = unit_settings()
    app = create_app(settings, engine=FakeEngine(), encoder=FakeEncoder())
    assert app.state["gateway"].freeze_gc is False  # threads in a shared process: never
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    serve(app, settings)
    assert app.state["gateway"].freeze_gc is True


def test_the_heap_is_frozen_once_ready() -> None:
    settings = unit_settings()
    app = create_app(settings, engine=FakeEngine(), encoder=FakeEncoder())
    app.state["gateway"].freeze_gc = True
    gc.unfreeze()
    server = ServerThread(app, settings).start()
    try:
        server.wait_ready(timeout=30)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # this test process goes on with other work
        server.stop()
