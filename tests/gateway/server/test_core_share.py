"""The engine's and the encoder's share of the cores."""

from __future__ import annotations

import pytest

from gateway.server.app import core_share, engine_threads
from gateway.server.core_share import CoreShare
from gateway.settings import Settings


def test_engine_takes_every_core_between_batches() -> None:
    share = CoreShare(cores=8, encoder_threads=2)
    assert share.engine_threads() == 8
    with share.encoding():
        assert share.engine_threads() == 6
        with share.encoding():  # two batches still leave the engine its share
            assert share.engine_threads() == 6
        assert share.engine_threads() == 6
    assert share.engine_threads() == 8
    with pytest.raises(RuntimeError), share.encoding():
        raise RuntimeError("a failed batch")
    assert share.engine_threads() == 8  # gives the cores back when a batch fails too


def test_one_core_still_leaves_the_engine_one_thread() -> None:
    share = CoreShare(cores=1, encoder_threads=1)
    with share.encoding():
        assert share.engine_threads() == 1
    with pytest.raises(ValueError):
        CoreShare(cores=0, encoder_threads=1)


def test_shared_only_when_both_halves_run_here_with_automatic_threads() -> None:
    assert core_share(Settings()) is not None
    assert core_share(Settings(engine_threads=3)) is None
    assert engine_threads(Settings(engine_threads=3)) == 3
    assert core_share(Settings(encoder="redis", redis_url="redis://127.0.0.1:1")) is None
