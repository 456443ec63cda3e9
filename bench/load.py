"""Load benchmark: stateless serving vs visiongate, closed and open loop, in one run.

    python -m bench.load --out DIR            # ~15 min on a 2-core CPU; DIR/load.json, DIR/load.png
    python -m bench.load --out DIR --quick    # smoke run, under 2 minutes

Two real gateways run as child processes on free loopback ports, one per configuration:
- `baseline`, stateless serving: no vision cache (`vision_cache_bytes=0`), no automatic prefix
  caching (`prefix_caching=false`), one generation at a time (`engine_max_batch=1`), and the
  client opens a new session for every turn, resending the conversation with the photo in the
  same item as the question.
- `visiongate`: the defaults (batching, prefix caching, vision cache), one session per
  conversation, the photo sent first and the question after the typing delay, follow-ups on the
  same session.
Settings a gateway build does not have yet are skipped (and listed in load.json).

Every session asks about a distinct photo (skimage sample photos, then crops and mirrors of
them): a question and two follow-ups, `--tokens` output tokens each, greedy. Each gateway
first plays one untimed session (a warm-up, on photos no point uses). Points run in
pairs, baseline then visiongate, so machine drift hits both alike:
- closed loop: `--concurrency` users, each starting a new session when the last one ends
  (the 1-session point is the reference for the SLO and the ratios, and runs twice as long);
- open loop: sessions arrive as a seeded Poisson process (first arrival at 0) at each rate of
  `--rates` (sessions/s), by default a ladder of multiples of the baseline single-session
  capacity (1 / its mean turn time) measured by this run's closed loop, doubled up to
  `--extra-rungs` more times while a configuration still meets the SLO at its top; a
  configuration leaves the ladder after its first point over the SLO.
Per point: turns/s and output tok/s (closed loop: turns finished inside the window; open loop:
every completed turn of the sessions that arrived inside it), TTFT P50/P95/P99 for
first and follow-up turns, ITL P95 (gaps between deltas at the client), errors, busy and
abandoned turns. SLO: P95 TTFT <= 4x the baseline single-session first-turn TTFT P50 (one SLO
for both; `--slo-ms` sets it); QPS at SLO is the highest offered rate (turns/s) whose P95 TTFT
over all attempted turns, lost turns counting as infinitely late, is within it (a lower bound,
marked ">=", when a configuration met the SLO at the highest rate it ran). Rates are the
nominal ones of the schedule; load.json also has each point's arrived rate (few sessions arrive
at light load, so it can differ).

`--adaptive-compare` runs instead the adaptive visual budget off vs on, open loop, in one run
(see `bench._load_adaptive`): DIR/load_adaptive.json, DIR/load_adaptive.png.

Progress goes to stderr (structlog), tables and headline ratios to stdout. The gateways are
stopped at the end, on errors and on Ctrl-C or SIGTERM.

It stays one module: its flags (`parse_args`) and the run they drive
(`LoadRun`: the points, their pairing and the rate ladder) read best together; the clients, the
statistics, the report and the gateway processes it is built from live in `bench/_load_*.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog

from bench._load_client import QUESTIONS, SessionSource, closed_loop, open_loop
from bench._load_report import TABLE_HEADER, chart, headline, headline_text, machine_info, table_row
from bench._load_server import GatewayProcess
from bench._load_stats import poisson_arrivals, qps_at_slo, summarize, write_json
from bench._outcome import RunOutcome

__all__ = ("CONFIGS", "main", "parse_args")

log = structlog.get_logger("bench.load")

CONFIGS = ("baseline", "visiongate")
MODES = {"baseline": "stateless", "visiongate": "stateful"}
SLO_FACTOR = 4.0
SLO_RULE = (
    f"{SLO_FACTOR:g}x the baseline single-session (closed loop, 1 session) first-turn "
    "TTFT P50; one SLO for both configurations"
)
DEFAULT_MULTIPLIERS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
# --adaptive-compare: multiples of the budget-off single-session capacity (it batches)
ADAPTIVE_MULTIPLIERS = (0.5, 1.0, 2.0, 4.0)
MAX_DISTINCT_PHOTOS = 6 * 2048  # the sample photos x their distinct crops and mirrors


def config_overrides(name: str, args: argparse.Namespace) -> dict[str, Any]:
    common: dict[str, Any] = {"log_level": "warning"}
    if args.max_queue is not None:
        common["engine_max_queue"] = args.max_queue
    if name == "baseline":
        return {**common, "vision_cache_bytes": 0, "prefix_caching": False, "engine_max_batch": 1}
    return common


def _floats(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive comma-separated numbers, got {text!r}")
    return values


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="bench/out", help="output directory (default bench/out)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: concurrency 1,2, one low rate, 8 tokens, short points",
    )
    p.add_argument(
        "--concurrency",
        type=_ints,
        help="closed-loop sessions (default 1,2,4,8,16); "
        "1 is always run (it sets the SLO and the rate ladder)",
    )
    p.add_argument(
        "--rates",
        type=_floats,
        help="open-loop session arrival rates, sessions/s "
        "(default: multiples of the baseline single-session capacity)",
    )
    p.add_argument(
        "--rate-multipliers",
        type=_floats,
        help="the default ladder, in multiples of the baseline single-session capacity "
        f"(default {','.join(f'{m:g}' for m in DEFAULT_MULTIPLIERS)})",
    )
    p.add_argument(
        "--extra-rungs",
        type=int,
        help="doublings added to the default ladder while a configuration still meets "
        "the SLO at its top (default 2; --quick: 0)",
    )
    p.add_argument(
        "--full-ladder",
        action="store_true",
        help="run every rate even after a configuration has left its SLO",
    )
    p.add_argument("--tokens", type=int, help="output tokens per answer (default 24)")
    p.add_argument(
        "--point-s",
        type=float,
        help="closed-loop window per point, s (default 20; "
        "the 1-session point, the reference, runs twice as long)",
    )
    p.add_argument(
        "--open-point-s", type=float, help="open-loop arrival window per rate, s (default 30)"
    )
    p.add_argument(
        "--drain-s",
        type=float,
        help="time a point's running turns get after its window, s (default 15)",
    )
    p.add_argument(
        "--typing-s",
        type=float,
        help="delay between a session's start and its first question, s (default 0.5)",
    )
    p.add_argument("--turn-timeout-s", type=float, default=120.0, help="per turn (default 120)")
    p.add_argument(
        "--max-sessions",
        type=int,
        default=400,
        help="most sessions one point may start (default 400)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        help="engine_max_queue of both gateways (default: the gateway's own)",
    )
    p.add_argument("--slo-ms", type=float, help="fixed TTFT SLO instead of the measured one")
    p.add_argument(
        "--adaptive-compare",
        action="store_true",
        help="adaptive visual budget off vs on (two visiongate gateways, stateful clients), "
        "open loop at each rate, instead of baseline vs visiongate",
    )
    p.add_argument(
        "--budget-objective-ms",
        type=float,
        help="--adaptive-compare: the budget's TTFT objective (visual_budget_ttft_ms; "
        "default: the run's SLO)",
    )
    p.add_argument(
        "--budget-floor", type=float, help="--adaptive-compare: visual_budget_floor (default 0.1)"
    )
    p.add_argument(
        "--budget-step", type=float, help="--adaptive-compare: visual_budget_step (default 0.1)"
    )
    p.add_argument(
        "--budget-window-s",
        type=float,
        help="--adaptive-compare: visual_budget_window_s (default: the gateway's, 30)",
    )
    p.add_argument("--seed", type=int, default=1234, help="seed of the arrival schedules")
    p.add_argument(
        "--ready-timeout-s",
        type=float,
        default=600.0,
        help="how long a gateway may take to load (default 600)",
    )
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {
        "concurrency": [1, 2] if quick else [1, 2, 4, 8, 16],
        "rate_multipliers": [0.5]
        if quick
        else list(ADAPTIVE_MULTIPLIERS if args.adaptive_compare else DEFAULT_MULTIPLIERS),
        "tokens": 8 if quick else 24,
        "point_s": 4.0 if quick else 20.0,
        "open_point_s": 4.0 if quick else 30.0,
        "drain_s": 5.0 if quick else 15.0,
        "typing_s": 0.2 if quick else 0.5,
        "extra_rungs": 0 if quick else 2,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.concurrency = sorted({1, *args.concurrency})
    if (
        args.tokens < 1
        or args.point_s <= 0
        or args.open_point_s <= 0
        or args.drain_s < 0
        or args.typing_s < 0
    ):
        p.error(
            "--tokens must be >= 1, --point-s and --open-point-s > 0, --drain-s and --typing-s >= 0"
        )
    if args.extra_rungs < 0:
        p.error("--extra-rungs must be >= 0")
    budget = (args.budget_objective_ms, args.budget_floor, args.budget_step, args.budget_window_s)
    if any(v is not None for v in budget) and not args.adaptive_compare:
        p.error("--budget-* options go with --adaptive-compare")
    if any(v is not None and v <= 0 for v in budget):
        p.error("--budget-* options must be > 0")
    points = (
        1  # the warm-up's photos (`LoadRun.warm_up`)
        + len(args.concurrency)
        + len(args.rates or args.rate_multipliers)
        + (0 if args.rates else args.extra_rungs)
    )
    if not 1 <= args.max_sessions * points <= MAX_DISTINCT_PHOTOS:
        p.error(
            f"--max-sessions x points must be 1..{MAX_DISTINCT_PHOTOS} (distinct photos), "
            f"got {args.max_sessions} x {points}"
        )
    return args


class LoadRun:
    """The sequence of points against the two running gateways, and what they measured."""

    def __init__(
        self, args: argparse.Namespace, gateways: dict[str, GatewayProcess], source: SessionSource
    ) -> None:
        self.args = args
        self.gateways = gateways
        self.source = source
        self.modes: dict[str, str] = dict(MODES)  # the client each configuration gets
        self.points: list[dict[str, Any]] = []
        self.slo_ms: float | None = args.slo_ms
        self.ladder: dict[str, Any] = {}

    def _play(self) -> dict[str, Any]:
        a = self.args
        return {"typing_s": a.typing_s, "max_tokens": a.tokens, "turn_timeout_s": a.turn_timeout_s}

    def _plans(self, block: int, expected: int):
        """Session plans of one pair of points: both configurations get the same photos, and
        no photo is seen at two points (a vision-cache hit on a first turn would be unreal)."""
        base = block * self.args.max_sessions
        self.source.forget_below(base)
        self.source.prepare(range(base, base + min(expected, self.args.max_sessions)))
        counter = itertools.count(base)
        return lambda: self.source.plan(next(counter))

    async def _point(self, kind: str, config: str, level: float, block: int) -> dict[str, Any]:
        a, gw = self.args, self.gateways[config]
        if kind == "closed":
            window = a.point_s * (2 if level == 1 else 1)
            plans = self._plans(block, int(level) * 3 + 4)
            started = time.monotonic()
            records = await closed_loop(
                gw.ws_url,
                self.modes[config],  # type: ignore[arg-type]
                int(level),
                plans,
                window_s=window,
                drain_s=a.drain_s,
                max_sessions=a.max_sessions,
                **self._play(),
            )
            extra: dict[str, Any] = {"concurrency": int(level)}
        else:
            # the same seeded schedule for both configurations at one rate; at light load the
            # window stretches (up to 2x) until enough sessions have arrived
            arrivals = poisson_arrivals(
                level,
                a.open_point_s,
                seed=a.seed + block,
                max_count=a.max_sessions,
                min_count=1 if a.quick else 3,
                max_duration_s=2 * a.open_point_s,
            )
            window = max(a.open_point_s, arrivals[-1])
            plans = self._plans(block, len(arrivals))
            started = time.monotonic()
            records = await open_loop(
                gw.ws_url,
                self.modes[config],  # type: ignore[arg-type]
                arrivals,
                plans,
                window_s=window,
                drain_s=a.drain_s,
                **self._play(),
            )
            extra = {
                "rate_sessions_per_s": level,
                "offered_turns_per_s": level * len(QUESTIONS),
                "arrivals": len(arrivals),
                "arrived_turns_per_s": len(arrivals) * len(QUESTIONS) / window,
            }
        summary = summarize(records, window, count_drained=kind == "open", slo_ms=self.slo_ms)
        point = {
            "kind": kind,
            "config": config,
            **extra,
            **summary,
            "wall_s": time.monotonic() - started,
            "records": [asdict(r) for r in sorted(records, key=lambda r: r.sent_s)],
        }
        log.info(
            "point_done",
            kind=kind,
            config=config,
            level=level,
            turns=summary["turns"],
            turns_per_s=round(summary["turns_per_s"], 3),
            ttft_first_p95_ms=_r(summary["ttft_first_p95_ms"]),
            ttft_followup_p95_ms=_r(summary["ttft_followup_p95_ms"]),
            errors=summary["errors"],
            busy=summary["busy"],
            abandoned=summary["abandoned"],
            wall_s=round(point["wall_s"], 1),
        )
        self.points.append(point)
        return point

    async def warm_up(self, block: int) -> None:
        """One untimed session on each gateway before the first point (its photos are seen at
        no point), so that no point pays a process's first requests: allocations that stay,
        each kernel's and shape's first call, the encoder's first photo."""
        a = self.args
        for cfg in CONFIGS:
            started = time.monotonic()
            records = await closed_loop(
                self.gateways[cfg].ws_url,
                self.modes[cfg],  # type: ignore[arg-type]
                1,
                self._plans(block, 1),
                window_s=a.turn_timeout_s * len(QUESTIONS),
                drain_s=a.drain_s,
                max_sessions=1,
                **self._play(),
            )
            failed = [r.status for r in records if r.status != "ok"]
            log.info(
                "warm_up_done",
                config=cfg,
                turns=len(records),
                failed=failed,
                wall_s=round(time.monotonic() - started, 1),
            )

    async def run(self) -> None:
        a = self.args
        block = itertools.count()
        await self.warm_up(next(block))
        print(
            "closed loop: concurrent sessions, each a photo + question + "
            f"{len(QUESTIONS) - 1} follow-ups, {a.tokens} tokens per answer",
            flush=True,
        )
        print(TABLE_HEADER, flush=True)
        for c in a.concurrency:
            b = next(block)
            done = {cfg: await self._point("closed", cfg, c, b) for cfg in CONFIGS}
            print(table_row(f"closed c={c}", done["baseline"], done["visiongate"]), flush=True)
        self._set_slo_and_ladder()
        print(
            f"\nopen loop: Poisson session arrivals (seed {a.seed}); SLO P95 TTFT <= "
            f"{_fmt_ms(self.slo_ms)}; rates {self.ladder['source']}",
            flush=True,
        )
        print(TABLE_HEADER, flush=True)
        active = set(CONFIGS)
        rates = list(self.ladder["sessions_per_s"])
        extra = 0 if a.rates else a.extra_rungs
        while rates and active:
            rate = rates.pop(0)
            b = next(block)
            pair: dict[str, dict[str, Any] | None] = {cfg: None for cfg in CONFIGS}
            within: set[str] = set()
            for cfg in CONFIGS:
                if cfg in active:
                    pair[cfg] = p = await self._point("open", cfg, rate, b)
                    if self._within_slo(p):
                        within.add(cfg)
                    elif not a.full_ladder:
                        active.discard(cfg)
            label = f"open {rate * len(QUESTIONS):.3g} t/s"
            print(table_row(label, pair["baseline"], pair["visiongate"]), flush=True)
            if not rates and within and extra > 0:
                # a configuration still meets the SLO at the top of the ladder: double the rate
                extra -= 1
                rates.append(2 * rate)
                self.ladder["sessions_per_s"].append(2 * rate)
                self.ladder["turns_per_s"].append(2 * rate * len(QUESTIONS))
                self.ladder["extended"] = self.ladder.get("extended", 0) + 1

    def _within_slo(self, point: dict[str, Any]) -> bool:
        return (
            self.slo_ms is not None
            and point["slo_p95_ms"] is not None
            and point["slo_p95_ms"] <= self.slo_ms
        )

    def _set_slo_and_ladder(self) -> None:
        a = self.args
        base1 = next(
            (
                p
                for p in self.points
                if p["kind"] == "closed" and p["config"] == "baseline" and p["concurrency"] == 1
            ),
            None,
        )
        if self.slo_ms is None and base1 and base1["ttft_first_p50_ms"]:
            self.slo_ms = SLO_FACTOR * base1["ttft_first_p50_ms"]
        turn_ms = (base1 or {}).get("turn_ms_mean")
        capacity = 1000.0 / turn_ms if turn_ms else 0.5  # turns/s one generation at a time
        if a.rates:
            rates, source = list(a.rates), "given by --rates"
        else:
            rates = [m * capacity / len(QUESTIONS) for m in a.rate_multipliers]
            source = (
                f"{','.join(f'{m:g}' for m in a.rate_multipliers)} x the baseline "
                f"single-session capacity {capacity:.3f} turns/s"
            )
        self.ladder = {
            "source": source,
            "baseline_turn_ms_mean": turn_ms,
            "capacity_turns_per_s": capacity,
            "sessions_per_s": rates,
            "turns_per_s": [r * len(QUESTIONS) for r in rates],
        }


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def _fmt_ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f} ms"


def _effective(gw: GatewayProcess) -> dict[str, Any] | str:
    try:
        return gw.effective_settings()
    except Exception as exc:
        return f"unavailable: {type(exc).__name__}: {exc}"


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from gateway.telemetry import configure_logging

    configure_logging("info", json=False)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per /readyz poll
    if args.adaptive_compare:
        from bench._load_adaptive import adaptive_main

        return adaptive_main(args, out, LoadRun, SLO_FACTOR)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    gateways = {
        name: GatewayProcess(name, config_overrides(name, args), out / f"gateway-{name}.log")
        for name in CONFIGS
    }
    source = SessionSource()
    run = LoadRun(args, gateways, source)
    outcome = RunOutcome()
    try:
        with outcome.recording(log):
            for gw in gateways.values():
                gw.start()
            for gw in gateways.values():
                gw.wait_ready(args.ready_timeout_s)
            asyncio.run(run.run())
    finally:
        for gw in gateways.values():
            gw.stop()
        signal.signal(signal.SIGTERM, previous)

    qps = {
        cfg: qps_at_slo(
            [p for p in run.points if p["kind"] == "open" and p["config"] == cfg], run.slo_ms
        )
        if run.slo_ms is not None
        else None
        for cfg in CONFIGS
    }
    head = headline(run.points, qps)
    report = {
        **outcome.report_fields("load"),
        "args": vars(args),
        "machine": machine_info(),
        "workload": {
            "questions": list(QUESTIONS),
            "tokens": args.tokens,
            "typing_s": args.typing_s,
            "photos": "skimage sample photos, then crops "
            "and mirrors of them: every session's photo is distinct",
        },
        "configs": {
            name: {
                "client": MODES[name],
                "requested": gw.requested,
                "applied": gw.applied,
                "skipped": gw.skipped,
                "effective_settings": _effective(gw),
            }
            for name, gw in gateways.items()
        },
        "slo": {"ttft_p95_ms": run.slo_ms, "rule": "--slo-ms" if args.slo_ms else SLO_RULE},
        "rate_ladder": run.ladder,
        "qps_at_slo": qps,
        "headline": head,
        "points": run.points,
    }
    write_json(out / "load.json", report)
    if run.points:
        chart(run.points, run.slo_ms, out / "load.png")
    print("\n" + headline_text(head, run.slo_ms, "--slo-ms" if args.slo_ms else SLO_RULE))
    print(f"wrote {out / 'load.json'}" + (f" and {out / 'load.png'}" if run.points else ""))
    return outcome.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
