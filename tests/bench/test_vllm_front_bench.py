"""bench.vllm_front's report: medians per mode and ratios against vLLM alone (the run itself
needs the vLLM venv and minutes: `python -m bench.vllm_front`)."""

from __future__ import annotations

from bench.vllm_front import summarize, table


def turn(ttft: float, cached: int = 0) -> dict:
    return {"ttft_ms": ttft, "cached_tokens": cached, "prompt_tokens": 170, "output_tokens": 8}


def test_summary_and_ratios() -> None:
    results = {
        "latency": {
            "vllm": [[turn(100), turn(20, 160)], [turn(120), turn(30, 160)]],
            "data_url": [[turn(110), turn(25, 160)], [turn(130), turn(35, 160)]],
            "embeds+ahead": [[turn(20, 160), turn(25, 192)], [turn(30, 160), turn(35, 192)]],
        },
        "throughput_tokens_per_s": {
            "1": {"vllm": 10.0, "data_url": 9.0, "embeds+ahead": 9.5},
            "8": {"vllm": 20.0, "data_url": 19.0, "embeds+ahead": 22.0},
        },
    }
    summary = summarize(results)
    assert summary["vllm"]["first_ttft_ms"] == 110 and summary["vllm"]["follow_up_ttft_ms"] == 25
    assert summary["embeds+ahead"]["first_cached"] == 160
    assert summary["embeds+ahead"]["tokens_per_s_x8"] == 22.0
    lines = table(summary).splitlines()
    embeds = next(line for line in lines if line.startswith("embeds+ahead"))
    assert "0.23" in embeds  # 25 ms first turn / 110 ms
    assert "1.10" in embeds  # 22 / 20 tokens/s at 8 sessions
    assert lines[-1].endswith("1.00x")  # photo-ahead first turn 25 ms / vLLM's follow-up 25 ms
