"""The KV that replicas share through Redis is keyed by the numbers that made it."""

from __future__ import annotations

from types import SimpleNamespace

from gateway.engine.local.local_engine import kv_numerics


def test_fused_and_module_steps_of_one_precision_do_not_share_kv() -> None:
    fused = SimpleNamespace(weights="int8", fused=object())
    modules = SimpleNamespace(weights="int8", fused=None)
    assert kv_numerics(fused) != kv_numerics(modules)
    assert kv_numerics(SimpleNamespace(weights="float32", fused=None)) == "float32"
    assert kv_numerics(SimpleNamespace(weights="bfloat16", fused=object())) != "bfloat16"
