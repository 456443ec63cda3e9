"""Soak benchmark: well-behaved API keys alone, then beside abusive keys, on one gateway.

    python -m bench.soak --out DIR                 # the real embedded engine, 60 s per phase
    python -m bench.soak --out DIR --duration 30   # shorter phases
    python -m bench.soak --out DIR --abuse slow_readers   # one abusive behaviour only
    python -m bench.soak --out DIR --fake          # fake engine and encoder: the mechanics only

One gateway runs as a child process on a free loopback port with `api_keys` set: `--good-keys`
well-behaved keys and `--bad-keys` abusive ones (keys made for the run, never written out).
After a warm-up, two phases of `--duration` seconds each:
1. baseline: the well-behaved keys alone, each one user alternating multi-turn chats about a
   distinct photo over WebSocket and over HTTP (bench/_soak_users.py);
2. abuse: the same users again, beside the abusive keys (bench/_soak_abuse.py): many
   concurrent long prompts, oversize requests, bad images, WebSockets that never read, bursts
   of parallel requests and a flood of slow connections (`--abuse` picks some of them, to see
   which one hurts).
Turns in flight when a phase ends get `--drain-s` more seconds; abusers stop at once.

Printed (and in DIR/soak.json, with every turn): per well-behaved key, its P95 TTFT alone and
with the abusers side by side and their ratio (goal: <= 2x, and no failed turns); error counts
by code (failed well-behaved turns; every abusive request's outcome; the gateway's own
`visiongate_errors_total` over each phase); the gateway's RSS over time. DIR/soak.png charts
them. Progress goes to stderr (structlog), one line every few seconds with the gateway's
scheduler gauges (running, waiting, batch), which soak.json keeps too. `--fake` serves the
fake engine and encoder of gateway/testing/fakes.py (bench/_soak_server.py): a quick look at the
benchmark itself, not at the engine's fairness.

It stays one module: its flags and the run they drive (`SoakRun`: the
warm-up, the two phases, their drain and the gateway's gauges) read best together; the users,
the abusers, the gateway and the report live in `bench/_soak_*.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import secrets
import signal
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import structlog

from bench._load_client import QUESTIONS, SessionSource, session_image
from bench._load_report import machine_info
from bench._load_server import redacted
from bench._load_stats import write_json
from bench._outcome import RunOutcome
from bench._soak_abuse import ABUSE_KINDS, AbusePayloads, Abuser
from bench._soak_report import (
    GOAL_RATIO,
    chart,
    code_counts,
    key_summary,
    parse_error_counter,
    parse_gauges,
    per_key_rows,
    read_rss,
    report_text,
    rss_summary,
)
from bench._soak_server import SoakGateway
from bench._soak_users import KeyRecords, Target, good_user

__all__ = ("main", "parse_args")

log = structlog.get_logger("bench.soak")

PHASES = ("baseline", "abuse")
# abusive outcomes that are not refusals: a request served or still running when its phase
# ended, a slow reader (re)connected or asking again
NOT_ERRORS = frozenset(("ok", "unfinished", "connected", "response.create"))
MAX_SESSIONS = 6 * 2048  # distinct photos (bench._load_client.session_image)


def _setting(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip().lower(), value


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(ABUSE_KINDS))
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(ABUSE_KINDS)}, got {text!r}")
    return kinds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="bench/out", help="output directory (default bench/out)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per phase (default 60)")
    p.add_argument(
        "--fake",
        action="store_true",
        help="serve the fake engine and encoder (gateway/testing/fakes.py) instead of the models",
    )
    p.add_argument("--good-keys", type=int, default=3, help="well-behaved keys (default 3)")
    p.add_argument("--bad-keys", type=int, default=2, help="abusive keys (default 2)")
    p.add_argument(
        "--abuse-concurrency",
        type=int,
        default=6,
        help="concurrent long-prompt requests per abusive key (default 6)",
    )
    p.add_argument(
        "--slow-readers",
        type=int,
        default=2,
        help="never-reading WebSockets per abusive key (default 2)",
    )
    p.add_argument(
        "--burst-size",
        type=int,
        default=32,
        help="streamed requests each abusive key sends at once in a burst (default 32)",
    )
    p.add_argument(
        "--burst-every-s",
        type=float,
        default=3.0,
        help="seconds from one burst's start to the next's (default 3)",
    )
    p.add_argument(
        "--slow-clients",
        type=int,
        default=150,
        help="connections per abusive key that send half a request line and wait, or trickle "
        "a body (default 150)",
    )
    p.add_argument(
        "--abuse",
        type=_kinds,
        default=list(ABUSE_KINDS),
        help=f"the abusive behaviours to run (default all: {','.join(ABUSE_KINDS)})",
    )
    p.add_argument(
        "--long-prompt-words",
        type=int,
        default=1000,
        help="words per abusive long prompt (default 1000)",
    )
    p.add_argument(
        "--long-max-tokens",
        type=int,
        default=128,
        help="output tokens asked by each abusive long prompt (default 128)",
    )
    p.add_argument(
        "--tokens", type=int, default=24, help="output tokens per well-behaved answer (default 24)"
    )
    p.add_argument(
        "--typing-s",
        type=float,
        default=0.5,
        help="delay before a chat's first question (default 0.5)",
    )
    p.add_argument(
        "--think-s", type=float, default=1.0, help="pause between a user's chats (default 1.0)"
    )
    p.add_argument(
        "--warmup-s", type=float, help="untimed warm-up before the baseline (default 10; --fake: 1)"
    )
    p.add_argument(
        "--drain-s",
        type=float,
        help="time turns in flight get after a phase (default 15; --fake: 3)",
    )
    p.add_argument("--turn-timeout-s", type=float, default=120.0, help="per turn (default 120)")
    p.add_argument(
        "--rss-interval-s",
        type=float,
        default=1.0,
        help="gateway RSS sampling interval (default 1)",
    )
    p.add_argument(
        "--progress-s", type=float, default=5.0, help="seconds between progress lines (default 5)"
    )
    p.add_argument(
        "--gateway-setting",
        type=_setting,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a gateway setting for the run (repeatable), "
        "e.g. rate_limit_per_minute=30; settings this build lacks are skipped",
    )
    p.add_argument("--seed", type=int, default=1234, help="seed of the abusive prompts")
    p.add_argument(
        "--ready-timeout-s",
        type=float,
        default=600.0,
        help="how long the gateway may take to load (default 600)",
    )
    args = p.parse_args(argv)
    if args.warmup_s is None:
        args.warmup_s = 1.0 if args.fake else 10.0
    if args.drain_s is None:
        args.drain_s = 3.0 if args.fake else 15.0
    if args.duration <= 0 or args.good_keys < 1 or args.bad_keys < 0 or args.tokens < 1:
        p.error("--duration must be > 0, --good-keys >= 1, --bad-keys >= 0, --tokens >= 1")
    if (
        min(
            args.abuse_concurrency,
            args.slow_readers,
            args.long_prompt_words,
            args.burst_size,
            args.slow_clients,
        )
        < 0
        or args.burst_every_s <= 0
        or min(args.warmup_s, args.drain_s, args.think_s, args.typing_s) < 0
    ):
        p.error("counts and times must be >= 0")
    if args.rss_interval_s <= 0 or args.progress_s <= 0 or args.long_max_tokens < 1:
        p.error("--rss-interval-s and --progress-s must be > 0, --long-max-tokens >= 1")
    return args


class SoakRun:
    """The warm-up and the two phases against the running gateway, and what they measured."""

    def __init__(
        self,
        args: argparse.Namespace,
        gateway: SoakGateway,
        target: Target,
        good: dict[str, str],
        bad: dict[str, str],
    ) -> None:
        self.args = args
        self.gateway = gateway
        self.target = target
        self.good = good  # name -> key
        self.bad = bad
        self.source = SessionSource(QUESTIONS)
        self.sessions = itertools.count()
        self.phase = "starting"
        self.records: dict[str, dict[str, KeyRecords]] = {}
        self.abusers: dict[str, dict[str, Abuser]] = {}
        self.windows: dict[str, tuple[float, float]] = {}
        self.server_errors: dict[str, dict[str, float] | None] = {}
        self.rss: list[dict[str, Any]] = []
        self.gauges: list[dict[str, Any]] = []  # the gateway's scheduler series, per progress line
        self.origin = 0.0
        self.payloads: AbusePayloads | None = None

    def _play(self) -> dict[str, Any]:
        a = self.args
        return {"typing_s": a.typing_s, "max_tokens": a.tokens, "turn_timeout_s": a.turn_timeout_s}

    def _next_plan(self):
        index = next(self.sessions)
        if index >= MAX_SESSIONS:
            raise RuntimeError("the run used up the distinct photos")
        return self.source.plan(index)

    def _prepare_plans(self, seconds: float) -> None:
        """Photos of the sessions a phase will likely start, made before its clock starts."""
        start = next(self.sessions)
        self.sessions = itertools.count(start)
        per_key = int(seconds / max(1.0, self.args.think_s + 2.0)) + 3
        self.source.forget_below(start)
        self.source.prepare(range(start, min(MAX_SESSIONS, start + per_key * len(self.good))))

    async def _sample_rss(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            pid = self.gateway.pid
            rss = read_rss(pid) if pid else None
            if rss is not None:
                self.rss.append(
                    {"t_s": loop.time() - self.origin, "phase": self.phase, "rss_bytes": rss}
                )
            await asyncio.sleep(self.args.rss_interval_s)

    async def _metrics(self) -> str | None:
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.get(f"{self.target.http_url}/metrics")
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    async def _server_errors(self) -> dict[str, float] | None:
        text = await self._metrics()
        return parse_error_counter(text) if text is not None else None

    async def _progress(
        self, phase: str, records: dict[str, KeyRecords], abusers: dict[str, Abuser], start: float
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.args.progress_s)
            turns = [r for k in records.values() for r in k.all()]
            text = await self._metrics()
            gauges = parse_gauges(text) if text is not None else {}
            if gauges:
                self.gauges.append(
                    {"t_s": loop.time() - self.origin, "phase": phase, "values": gauges}
                )
            log.info(
                "progress",
                running=gauges.get('visiongate_scheduler_requests{state="running"}'),
                waiting=gauges.get('visiongate_scheduler_requests{state="waiting"}'),
                batch=gauges.get("visiongate_scheduler_batch_size"),
                phase=phase,
                t_s=round(loop.time() - start, 1),
                good_turns=sum(1 for r in turns if r.status == "ok"),
                good_failed=sum(1 for r in turns if r.status != "ok"),
                abusive_requests=sum(
                    sum(c.values()) for a in abusers.values() for c in a.outcomes.values()
                ),
                rss_mib=round(self.rss[-1]["rss_bytes"] / 2**20) if self.rss else None,
            )

    async def _phase(self, phase: str, seconds: float, *, with_abusers: bool) -> None:
        a, loop = self.args, asyncio.get_running_loop()
        self._prepare_plans(seconds)
        records = {name: KeyRecords() for name in self.good}
        abusers = (
            {
                name: Abuser(
                    self.target,
                    key,
                    self.payloads,
                    concurrency=a.abuse_concurrency,
                    slow_readers=a.slow_readers,
                    long_max_tokens=a.long_max_tokens,
                    kinds=a.abuse,
                    burst_size=a.burst_size,
                    burst_every_s=a.burst_every_s,
                    slow_clients=a.slow_clients,
                )
                for name, key in self.bad.items()
            }
            if with_abusers
            else {}
        )
        before = await self._server_errors()
        self.phase = phase
        start = loop.time()
        stop_at = start + seconds
        log.info(
            "phase_start",
            phase=phase,
            seconds=seconds,
            good_keys=len(self.good),
            bad_keys=len(abusers),
        )
        users = [
            asyncio.create_task(
                good_user(
                    self.target,
                    key,
                    rank,
                    records[name],
                    self._next_plan,
                    origin=self.origin,
                    stop_at=stop_at,
                    think_s=a.think_s,
                    **self._play(),
                )
            )
            for rank, (name, key) in enumerate(self.good.items())
        ]
        bad = [asyncio.create_task(abuser.run(stop_at)) for abuser in abusers.values()]
        progress = asyncio.create_task(self._progress(phase, records, abusers, start))
        try:
            await asyncio.wait(users, timeout=max(0.0, stop_at + a.drain_s - loop.time()))
        finally:
            for task in [*users, *bad, progress]:
                task.cancel()
            await asyncio.gather(*users, *bad, progress, return_exceptions=True)
        after = await self._server_errors()
        self.windows[phase] = (start - self.origin, stop_at - self.origin)
        self.records[phase] = records
        self.abusers[phase] = abusers
        self.server_errors[phase] = (
            {
                k: v - (before or {}).get(k, 0.0)
                for k, v in after.items()
                if v - (before or {}).get(k, 0.0) > 0
            }
            if after is not None
            else None
        )
        turns = [r for k in records.values() for r in k.all()]
        log.info(
            "phase_done",
            phase=phase,
            good_turns=sum(1 for r in turns if r.status == "ok"),
            good_failed=sum(1 for r in turns if r.status != "ok"),
            wall_s=round(loop.time() - start, 1),
        )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.origin = loop.time()
        self.payloads = AbusePayloads(
            self.target,
            session_image(MAX_SESSIONS - 1),
            seed=self.args.seed,
            long_prompt_words=self.args.long_prompt_words,
        )
        sampler = asyncio.create_task(self._sample_rss())
        try:
            if self.args.warmup_s > 0:
                await self._phase("warmup", self.args.warmup_s, with_abusers=False)
            for phase in PHASES:
                await self._phase(phase, self.args.duration, with_abusers=phase == "abuse")
            self.phase = "after"
            await asyncio.sleep(min(2.0, self.args.rss_interval_s * 2))
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)

    # ------------------------------------------------------------ the report

    def report(self) -> dict[str, Any]:
        phases: dict[str, Any] = {}
        summaries: dict[str, dict[str, dict[str, Any]]] = {}
        errors: dict[str, dict[str, dict[str, int]]] = {}
        for phase in PHASES:
            records = self.records.get(phase)
            if records is None:
                continue
            summaries[phase] = {name: key_summary(k.ws, k.http) for name, k in records.items()}
            turns = [
                {"key": name, "transport": transport, **asdict(r)}
                for name, k in records.items()
                for transport, recs in (("ws", k.ws), ("http", k.http))
                for r in recs
            ]
            turns.sort(key=lambda t: t["sent_s"])
            errors[phase] = {
                "well_behaved": dict(code_counts(r for k in records.values() for r in k.all()))
            }
            outcomes = {
                name: {kind: dict(c) for kind, c in ab.outcomes.items() if kind in ab.kinds}
                for name, ab in self.abusers.get(phase, {}).items()
            }
            if outcomes:
                total: dict[str, int] = {}
                for per_kind in outcomes.values():
                    for counts in per_kind.values():
                        for code, n in counts.items():
                            if code not in NOT_ERRORS:
                                total[code] = total.get(code, 0) + n
                errors[phase]["abusive"] = total
            phases[phase] = {
                "window_s": self.windows.get(phase),
                "keys": summaries[phase],
                "sessions": {n: k.sessions for n, k in records.items()},
                "abuse_outcomes": outcomes,
                "server_errors_by_code": self.server_errors.get(phase),
                "turns": turns,
            }
        rows = per_key_rows(summaries, list(self.good))
        return {
            "per_key": rows,
            "phases": phases,
            "errors_by_code": errors,
            "goal": {
                "ratio_max": GOAL_RATIO,
                "rule": "P95 TTFT with abusers <= "
                f"{GOAL_RATIO:g}x alone and no failed turn, for every well-behaved key",
                "met": bool(rows) and all(r["within_goal"] for r in rows),
            },
            "rss": {"samples": self.rss, "by_phase": rss_summary(self.rss)},
            "gateway_gauges": self.gauges,
        }


def _target(gw: SoakGateway, key: str) -> Target:
    effective = gw.effective_settings()
    response = httpx.get(
        f"{gw.http_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
    response.raise_for_status()
    return Target(
        http_url=gw.http_url,
        ws_url=gw.ws_url,
        model=response.json()["data"][0]["id"],
        max_text_chars=int(effective["max_text_chars"]),
        max_image_bytes=int(effective["max_image_bytes"]),
    )


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from gateway.telemetry import configure_logging

    configure_logging("info", json=False)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    good = {f"good-{i + 1}": f"sk-soak-{secrets.token_hex(12)}" for i in range(args.good_keys)}
    bad = {f"abusive-{i + 1}": f"sk-soak-{secrets.token_hex(12)}" for i in range(args.bad_keys)}
    overrides: dict[str, Any] = {
        "log_level": "warning",
        **dict(args.gateway_setting),
        "api_keys": [*good.values(), *bad.values()],
    }
    gateway = SoakGateway(overrides, out / "gateway-soak.log", fake=args.fake)
    run: SoakRun | None = None
    outcome = RunOutcome()
    try:
        with outcome.recording(log):
            gateway.start()
            gateway.wait_ready(args.ready_timeout_s)
            run = SoakRun(args, gateway, _target(gateway, next(iter(good.values()))), good, bad)
            asyncio.run(run.run())
    finally:
        gateway.stop()
        signal.signal(signal.SIGTERM, previous)

    measured = (
        run.report()
        if run is not None
        else {
            "per_key": [],
            "phases": {},
            "errors_by_code": {},
            "goal": {"met": False},
            "rss": {"samples": [], "by_phase": {}},
            "gateway_gauges": [],
        }
    )
    report = {
        **outcome.report_fields("soak"),
        "args": {k: v for k, v in vars(args).items()},
        "machine": machine_info(),
        "engine": "fake (gateway/testing/fakes.py)" if args.fake else "real embedded engine",
        "keys": {"well_behaved": list(good), "abusive": list(bad)},
        "gateway": {
            "requested": redacted(gateway.requested),
            "applied": redacted(gateway.applied),
            "skipped": gateway.skipped,
            "effective_settings": _effective(gateway),
        },
        "workload": {
            "questions": list(QUESTIONS),
            "tokens": args.tokens,
            "well_behaved": "one user per key: WebSocket and HTTP chats in turn, a "
            "distinct photo each, then follow-ups",
            "abusive": {
                kind: text
                for kind, text in {
                    "long_prompts": f"{args.abuse_concurrency} concurrent streams of "
                    f"{args.long_prompt_words} fresh words, {args.long_max_tokens} tokens asked",
                    "oversize": "text over max_text_chars and images over max_image_bytes "
                    "(HTTP, WebSocket)",
                    "bad_images": "truncated, bit-flipped, bomb-header and mislabelled images "
                    "(HTTP chat, /v1/images, WebSocket)",
                    "slow_readers": f"{args.slow_readers} WebSockets asking for long answers, "
                    "never reading",
                    "bursts": f"{args.burst_size} streams of long prompts at once, every "
                    f"{args.burst_every_s:g} s",
                    "slow_clients": f"{args.slow_clients} connections: half a request line and "
                    "a wait, no key (a few: a keyed head, then a body at 1 byte/s); reopened "
                    "when closed",
                }.items()
                if kind in args.abuse
            },
        },
        **measured,
    }
    write_json(out / "soak.json", report)
    charted = bool(measured["per_key"] or measured["rss"]["samples"])
    if charted:
        chart(report, out / "soak.png")
    if run is not None and measured["phases"]:
        print(report_text(report, args.bad_keys, args.abuse, args.duration))
    print(f"\nwrote {out / 'soak.json'}" + (f" and {out / 'soak.png'}" if charted else ""))
    return outcome.exit_code()


def _effective(gw: SoakGateway) -> dict[str, Any] | str:
    try:
        return redacted(gw.effective_settings())
    except Exception as exc:
        return f"unavailable: {type(exc).__name__}: {exc}"


if __name__ == "__main__":
    raise SystemExit(main())
