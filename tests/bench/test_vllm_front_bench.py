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


def test_breakdown_lines_turns_up_with_the_gateway_log(tmp_path) -> None:
    import json

    from bench.vllm_front import breakdown, breakdown_table

    log = tmp_path / "gw.log"

    def response(sid: str, ttft: float, prefill: float) -> str:
        return json.dumps(
            {"event": "response", "session_id": sid, "ttft_ms": ttft, "prefill_ms": prefill}
        )

    log.write_text(
        "\n".join(
            [
                "not json",
                json.dumps({"event": "http_session_turn", "session_id": "lat-m-0"}),
                response("lat-m-0", 100.0, 80.0),
                response("lat-m-0", 300.0, 60.0),
                response("lat-other-0", 1.0, 1.0),
            ]
        )
    )
    first = {"ttft_ms": 115.0}  # 15 ms outside the gateway's clock
    follow = {"ttft_ms": 560.0}  # 260 ms outside it
    lone = [{"ttft_ms": 1.0}] * 2  # session 1: not in the log, left out
    out = breakdown("m", [[first, follow], lone], log)
    assert out["first"]["outside_ms"] == 15.0
    assert out["first"]["gateway_ms"] == 20.0 and out["first"]["replica_ms"] == 80.0
    assert out["follow_up"]["outside_ms"] == 260.0
    assert out["follow_up"]["gateway_ms"] == 240.0 and out["follow_up"]["replica_ms"] == 60.0
    lines = breakdown_table({"m": out}).splitlines()
    assert lines[2].split() == ["m", "follow_up", "560.0", "260.0", "240.0", "60.0"]


def test_follow_ups_pair_each_round_with_vllm_alone() -> None:
    from bench.vllm_front import follow_up_table, paired

    alone = [[turn(300), turn(80, 160)], [turn(300), turn(120, 160)]]
    gateway = [[turn(310), turn(84, 160)], [turn(310), turn(119, 160)]]
    assert paired(gateway, alone) == [4.0, -1.0]
    by_mode = {
        "vllm": {
            "follow_up_ttft_ms": 100.0,
            "follow_up_cached": 160,
            "follow_up_prompt": 170,
            "paired_diff_ms": [0.0, 0.0],
            "breakdown": {},
        },
        "data_url": {
            "follow_up_ttft_ms": 101.5,
            "follow_up_cached": 160,
            "follow_up_prompt": 170,
            "paired_diff_ms": paired(gateway, alone),
            "breakdown": {},
        },
    }
    row = next(line for line in follow_up_table(by_mode).splitlines() if line.startswith("data"))
    assert row.split() == ["data_url", "101.5", "1.5", "160/170"]
