"""Numbers of the load benchmark: turn records, percentiles, point summaries, arrival schedules,
QPS at SLO and the JSON writer. Pure functions, no I/O except `write_json`.

Contract:
- A `TurnRecord` is one question of one session as the client saw it. Times are seconds from the
  start of the point (`sent_s`, `done_s`); latencies are milliseconds. `status` is `ok`, `busy`
  (the gateway refused with code `busy`), `error` (any other error code or a lost connection),
  or `abandoned` (still unanswered when the point's time ran out, or past the turn timeout).
- `percentile` interpolates linearly between closest ranks; `math.inf` values sort last, so a
  turn that never got a first token can be counted as infinitely late.
- `summarize` turns one point's records into the published metrics. Throughput counts the `ok`
  turns that finished inside the measurement window, divided by the window; with
  `count_drained=True` (open loop, where every session arrived inside the window) it counts
  every `ok` turn, those finished while draining included.
- `slo_p95_ms` is the P95 TTFT of every attempted turn, where a turn that was refused, failed or
  abandoned counts as infinitely late: a point cannot meet the SLO by dropping its slow turns.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = (
    "TurnRecord",
    "percentile",
    "poisson_arrivals",
    "qps_at_slo",
    "summarize",
    "to_jsonable",
    "within_slo_share",
    "write_json",
)

Status = Literal["ok", "busy", "error", "abandoned"]


@dataclass(slots=True)
class TurnRecord:
    session: int  # index of the session in its configuration's run
    turn: int  # 0: the first question about the photo; 1, 2, ...: follow-ups
    sent_s: float  # when the user submitted the question, seconds from the point's start
    status: Status = "ok"
    done_s: float | None = None  # response.done received (seconds from the point's start)
    ttft_ms: float | None = None  # question submitted -> first response.output_text.delta
    total_ms: float | None = None  # question submitted -> response.done
    output_tokens: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV the gateway reused
    itl_ms: list[float] = field(default_factory=list)  # gaps between consecutive deltas
    encode_wait_ms: float = 0.0  # the gateway's report: time the response waited for encoding
    vision: str | None = None  # the gateway's vision-cache report for the turn (hit/miss/none)
    error_code: str | None = None
    image_tokens: int = 0  # visual tokens in the prompt (usage input_token_details.image_tokens)
    image_tokens_total: int = 0  # the same images' visual tokens before patch dropping
    # keep-ratio cap in force as the response finished (adaptive visual budget); None: fixed
    visual_budget: float | None = None
    # the gateway's visiongate.image.encoded for the session's photo seen during this turn:
    # "miss" (encoded for it) or "hit" (from the vision cache)
    image_encode: str | None = None

    @property
    def kind(self) -> str:
        return "first" if self.turn == 0 else "followup"


def percentile(values: Iterable[float], p: float) -> float | None:
    """The `p`-th percentile (0..100) with linear interpolation; None for no values."""
    data = sorted(values)
    if not data:
        return None
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be within 0..100, got {p}")
    rank = (len(data) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(data) - 1)
    frac = rank - lo
    a, b = data[lo], data[hi]
    if frac == 0.0 or a == b:
        return a
    if math.isinf(b):  # interpolating towards an infinitely late turn
        return math.inf
    return a + (b - a) * frac


def _pcts(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    return {
        f"{prefix}_p50_ms": percentile(values, 50),
        f"{prefix}_p95_ms": percentile(values, 95),
        f"{prefix}_p99_ms": percentile(values, 99),
    }


def summarize(
    records: Sequence[TurnRecord],
    window_s: float,
    *,
    count_drained: bool = False,
    slo_ms: float | None = None,
) -> dict[str, Any]:
    """One point's published metrics (see the module docstring for the definitions); with
    `slo_ms`, also the share of attempted turns whose TTFT is within it."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    ok = [r for r in records if r.status == "ok"]
    in_window = (
        ok if count_drained else [r for r in ok if r.done_s is not None and r.done_s <= window_s]
    )
    first = [r.ttft_ms for r in ok if r.turn == 0 and r.ttft_ms is not None]
    follow = [r.ttft_ms for r in ok if r.turn > 0 and r.ttft_ms is not None]
    gaps = [g for r in ok for g in r.itl_ms]
    late = [math.inf if r.status != "ok" or r.ttft_ms is None else r.ttft_ms for r in records]
    counts = {s: sum(1 for r in records if r.status == s) for s in ("busy", "error", "abandoned")}
    codes: dict[str, int] = {}
    for r in records:
        if r.error_code:
            codes[r.error_code] = codes.get(r.error_code, 0) + 1
    return {
        "turns": len(ok),
        "turns_attempted": len(records),
        "first_turns": len(first),
        "followup_turns": len(follow),
        "sessions": len({r.session for r in records}),
        "errors": counts["error"],
        "busy": counts["busy"],
        "abandoned": counts["abandoned"],
        "error_codes": codes,
        "window_s": round(window_s, 3),
        "turns_per_s": len(in_window) / window_s,
        "output_tok_per_s": sum(r.output_tokens for r in in_window) / window_s,
        "output_tokens_mean": _mean([r.output_tokens for r in ok]),
        **_pcts(first, "ttft_first"),
        **_pcts(follow, "ttft_followup"),
        "ttft_all_p95_ms": percentile([r.ttft_ms for r in ok if r.ttft_ms is not None], 95),
        "slo_p95_ms": percentile(late, 95),
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p95_ms": percentile(gaps, 95),
        "turn_ms_mean": _mean([r.total_ms for r in ok if r.total_ms is not None]),
        "cached_tokens_mean": _mean([r.cached_tokens for r in ok]),
        "input_tokens_mean": _mean([r.input_tokens for r in ok]),
        "encode_wait_ms_mean": _mean([r.encode_wait_ms for r in ok]),
        "vision_hits": sum(1 for r in ok if r.vision == "hit"),
        **_budget(ok),
        "within_slo_share": None if slo_ms is None else within_slo_share(records, slo_ms),
    }


def within_slo_share(records: Sequence[TurnRecord], slo_ms: float) -> float | None:
    """Share of attempted turns answered with a TTFT <= `slo_ms` (lost turns are not)."""
    if not records:
        return None
    good = sum(
        1 for r in records if r.status == "ok" and r.ttft_ms is not None and r.ttft_ms <= slo_ms
    )
    return good / len(records)


def _budget(ok: Sequence[TurnRecord]) -> dict[str, Any]:
    """Visual-token budget of a point: the kept-token ratio of the sessions' photos (first
    turns: visual tokens in the prompt / before patch dropping), the keep-ratio cap the
    responses reported in force, and how many photos the gateway encoded (cache miss)."""
    first = [r for r in ok if r.turn == 0 and r.image_tokens_total > 0]
    caps = [r.visual_budget for r in ok if r.visual_budget is not None]
    return {
        "image_tokens_mean": _mean([r.image_tokens for r in first]),
        "kept_ratio_mean": _mean([r.image_tokens / r.image_tokens_total for r in first]),
        "visual_budget_mean": _mean(caps),
        "visual_budget_min": min(caps) if caps else None,
        "visual_budget_max": max(caps) if caps else None,
        "images_encoded": sum(1 for r in ok if r.turn == 0 and r.image_encode == "miss"),
    }


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def poisson_arrivals(
    rate: float,
    duration_s: float,
    *,
    seed: int,
    max_count: int,
    min_count: int = 1,
    max_duration_s: float | None = None,
) -> list[float]:
    """Arrival offsets (seconds) of a seeded Poisson process of `rate` per second.

    The schedule is seen from an arrival: the first one is at 0, the gaps after it are
    exponential with mean 1/rate, and arrivals fall in [0, duration_s). When fewer than
    `min_count` fall there the schedule runs on (up to `max_duration_s`) until it has them,
    so a light-load point still measures something. Never more than `max_count` arrivals.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if max_count < 1 or duration_s <= 0:
        raise ValueError("max_count must be >= 1 and duration_s > 0")
    limit = max(duration_s, max_duration_s or duration_s)
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while len(out) < max_count and (t < duration_s or (len(out) < min_count and t < limit)):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def qps_at_slo(points: Sequence[dict[str, Any]], slo_ms: float) -> float | None:
    """The highest offered arrival rate (turns/s) whose `slo_p95_ms` is within `slo_ms`.

    `points`: open-loop summaries carrying `offered_turns_per_s` and `slo_p95_ms` (None or inf:
    the point failed). None when no point meets the SLO.
    """
    passing = [
        p["offered_turns_per_s"]
        for p in points
        if p.get("slo_p95_ms") is not None and p["slo_p95_ms"] <= slo_ms and p.get("turns", 0) > 0
    ]
    return max(passing) if passing else None


def to_jsonable(value: Any) -> Any:
    """Dataclasses, tuples and paths to plain JSON types; non-finite floats become None."""
    if hasattr(value, "__dataclass_fields__"):
        value = asdict(value)
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float):
        return round(value, 3) if math.isfinite(value) else None
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: Path, report: dict[str, Any]) -> Path:
    """Write `report` as strict JSON (no NaN/Infinity) atomically; returns the path."""
    text = json.dumps(to_jsonable(report), indent=2, allow_nan=False)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)
    return path
