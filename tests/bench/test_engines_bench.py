"""bench.engines' own arithmetic: weights read per token, the floor, the ratios and the table."""

from __future__ import annotations

import pytest

from bench import engines


def test_weights_read_per_token_counts_the_tied_head_once() -> None:
    from gateway.testing.vllm_server import default_model_dir

    n = engines.weights_read_per_token(default_model_dir())
    # SmolLM2-135M: 30 layers of (576 x (576 + 2 * 192 + 576) + 3 * 576 x 1536 + 2 * 576),
    # the 49152 x 576 embedding (the output head too) and the final norm
    layer = 576 * (576 + 2 * 192 + 576) + 3 * 576 * 1536 + 2 * 576
    assert n == 30 * layer + 49152 * 576 + 576


def test_auto_is_what_the_gateway_loads_for_the_model(tmp_path) -> None:
    from transformers import LlamaConfig, Qwen2Config

    from gateway.engine.local.fused_step import fp16_gemm_available
    from gateway.testing.vllm_server import default_model_dir

    # the default (a Llama) runs the fused float16 step where fbgemm is present
    expected = "float16" if fp16_gemm_available() else "float32"
    assert engines.auto_precision(default_model_dir()) == expected
    # a model the fused step does not take stays in the exact mode
    Qwen2Config(num_hidden_layers=1).save_pretrained(tmp_path / "qwen2")
    assert engines.auto_precision(tmp_path / "qwen2") == "float32"
    LlamaConfig(num_hidden_layers=1).save_pretrained(tmp_path / "llama")
    assert engines.auto_precision(tmp_path / "llama") == expected


def test_memory_bandwidth_is_measured_per_thread_count() -> None:
    found = engines.memory_bandwidth()
    assert "threads_1" in found
    assert all(v > 0.1 for v in found.values())


def _server(tok1: float, tok8: float, p95: float) -> dict:
    return {
        "tok_s_1": tok1,
        "ttft_p50_1": 10.0,
        "ttft_p95_1": 12.0,
        "tok_s_8": tok8,
        "ttft_p50_8": p95 / 2,
        "ttft_p95_8": p95,
    }


def test_ratios_pair_each_default_and_each_shared_precision() -> None:
    servers = {
        "visiongate auto": _server(30.0, 120.0, 200.0),
        "visiongate float32": _server(30.0, 120.0, 200.0),
        "visiongate int8": _server(60.0, 240.0, 100.0),
        "vllm default": _server(40.0, 200.0, 400.0),
        "vllm float32": {"error": "skipped"},
    }
    r = engines.ratios(servers, 8)
    assert r == {
        "visiongate auto / vllm default": {"tok_s_1": 0.75, "tok_s_8": 0.6, "ttft_p95_8": 0.5}
    }
    report = {
        "bandwidth_gb_s": {"threads_1": 10.0},
        "weights_per_token": 134_515_008,
        "floor_tok_s": {"float32": 18.6},
        "servers": servers,
        "ratios": r,
    }
    text = engines.table(report, 8)
    assert "vllm float32             skipped" in text
    assert "visiongate int8" in text and "240.0" in text
    assert "visiongate auto / vllm default" in text


def test_unknown_flags_are_refused() -> None:
    with pytest.raises(SystemExit):
        engines.parse_args(["--no-such-flag"])
