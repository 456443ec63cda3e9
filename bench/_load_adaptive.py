"""Adaptive visual budget off vs on, open loop, in one run (`bench.load --adaptive-compare`).

Two real gateways with visiongate's defaults (batching, prefix caching, vision cache, KV warm-up),
both played by the stateful client (the photo first, the question after the typing delay,
follow-ups on the same session): `budget_off` (the fixed keep-ratio budget) and `budget_on`
(`visual_budget_adaptive=true`). Every session asks about a distinct photo and each gateway has
its own vision cache, so every session's photo is encoded by the gateway serving it, under the
cap in force at that moment; the client keeps the gateway's `visiongate.image.encoded` event
(`images_encoded` counts the first turns whose photo was a cache miss, i.e. encoded for them).

1. Reference: closed loop, 1 session, on `budget_off` for 2x `--point-s` seconds. SLO: P95 TTFT <=
   4x its first-turn TTFT P50 (unless `--slo-ms`); the rate ladder is `--rate-multipliers` x its
   capacity (1 / its mean turn time), unless `--rates`.
2. `budget_on`'s objective (`visual_budget_ttft_ms`) is `--budget-objective-ms`, by default the
   SLO (it starts beside `budget_off` when that is known beforehand, after the reference if
   not). On a small CPU the objective can be set below the SLO so that the controller engages
   within a short run; the output says which was used.
3. At each rate, a pair of open-loop points, budget off then on, with the same seeded Poisson
   arrivals and the same photos; both configurations run every rate (plus `--extra-rungs`
   doublings while one still meets the SLO at the top). The controller of `budget_on` keeps its
   state from one rate to the next, as a served gateway's would.

Per rate and configuration: achieved turns/s (every completed turn of the sessions that arrived
in the window), P95 TTFT over all attempted turns (lost turns infinitely late; the SLO's
measure) and over first turns, the share of attempted turns within the SLO, the mean kept-token
ratio of the sessions' photos (first turns: usage `image_tokens` / `visiongate.image_tokens_total`),
the keep-ratio cap the responses reported in force as they finished
(`visiongate.cache.visual_budget`; a photo is encoded as its session starts, under the cap of
that moment, so the kept ratio lags the cap), images encoded, and errors/busy/abandoned turns.
QPS at SLO as in bench.load: the highest offered rate whose P95 TTFT is within the SLO.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from bench._load_client import QUESTIONS, SessionSource
from bench._load_report import machine_info
from bench._load_server import GatewayProcess
from bench._load_stats import qps_at_slo, write_json
from bench._outcome import RunOutcome

__all__ = (
    "ADAPTIVE_CONFIGS",
    "ADAPTIVE_HEADER",
    "adaptive_chart",
    "adaptive_headline",
    "adaptive_main",
    "adaptive_overrides",
    "adaptive_row",
)

log = structlog.get_logger("bench.load")

ADAPTIVE_CONFIGS = ("budget_off", "budget_on")
COLORS = {"budget_off": "#c0504d", "budget_on": "#4f81bd"}


def adaptive_overrides(name: str, args: argparse.Namespace, objective_ms: float) -> dict[str, Any]:
    """Gateway settings of one configuration: visiongate's defaults, the budget on or off."""
    out: dict[str, Any] = {"log_level": "warning", "visual_budget_adaptive": name == "budget_on"}
    if args.max_queue is not None:
        out["engine_max_queue"] = args.max_queue
    if name == "budget_on":
        out["visual_budget_ttft_ms"] = objective_ms
        for arg, setting in (
            ("budget_floor", "visual_budget_floor"),
            ("budget_step", "visual_budget_step"),
            ("budget_window_s", "visual_budget_window_s"),
        ):
            if getattr(args, arg) is not None:
                out[setting] = getattr(args, arg)
    return out


# ---------------------------------------------------------------- table and headline


def _n(v: float | None, width: int, digits: int = 0) -> str:
    if v is None:
        return f"{'-':>{width}}"
    if math.isinf(v):
        return f"{'inf':>{width}}"
    return f"{v:>{width}.{digits}f}"


def _pct(v: float | None, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{100 * v:>{width - 1}.0f}%"


def _cap(p: dict[str, Any] | None) -> str:
    if p is None or p.get("visual_budget_mean") is None:
        return f"{'fixed':>15}"
    lo, hi, mean = p["visual_budget_min"], p["visual_budget_max"], p["visual_budget_mean"]
    return f"{mean:.2f} [{lo:.2f}-{hi:.2f}]".rjust(15)


def _counts(p: dict[str, Any] | None) -> str:
    return f"{'-':>7}" if p is None else f"{p['errors']}/{p['busy']}/{p['abandoned']}".rjust(7)


ADAPTIVE_HEADER = (
    f"{'offered':>8}  {'achieved t/s':>13}  {'P95 TTFT ms':>13}  {'1st-turn P95':>13}  "
    f"{'within SLO':>11}  {'kept ratio':>11}  {'budget on: cap':>15}  {'encoded':>9}  "
    f"{'err/busy/aband':>15}\n"
    f"{'turns/s':>8}  {'off':>6} {'on':>6}  {'off':>6} {'on':>6}  {'off':>6} {'on':>6}  "
    f"{'off':>5} {'on':>5}  {'off':>5} {'on':>5}  {'mean [min-max]':>15}  {'off':>4} {'on':>4}  "
    f"{'off':>7} {'on':>7}"
)


def adaptive_row(offered: float, off: dict[str, Any] | None, on: dict[str, Any] | None) -> str:
    """One rate of the side-by-side table (a configuration without the point shows '-')."""

    def g(p: dict[str, Any] | None, key: str) -> float | None:
        return None if p is None else p.get(key)

    return (
        f"{offered:>8.3g}  {_n(g(off, 'turns_per_s'), 6, 2)} {_n(g(on, 'turns_per_s'), 6, 2)}  "
        f"{_n(g(off, 'slo_p95_ms'), 6)} {_n(g(on, 'slo_p95_ms'), 6)}  "
        f"{_n(g(off, 'ttft_first_p95_ms'), 6)} {_n(g(on, 'ttft_first_p95_ms'), 6)}  "
        f"{_pct(g(off, 'within_slo_share'), 5)} {_pct(g(on, 'within_slo_share'), 5)}  "
        f"{_n(g(off, 'kept_ratio_mean'), 5, 3)} {_n(g(on, 'kept_ratio_mean'), 5, 3)}  "
        f"{_cap(on)}  {_n(g(off, 'images_encoded'), 4)} {_n(g(on, 'images_encoded'), 4)}  "
        f"{_counts(off)} {_counts(on)}"
    )


def adaptive_headline(points: list[dict[str, Any]], slo_ms: float | None) -> dict[str, Any]:
    """QPS at SLO of each configuration (with whether it is a lower bound: met at the highest
    rate run) and their ratio, on/off."""
    out: dict[str, Any] = {"qps_at_slo": {}, "qps_at_slo_lower_bound": {}}
    for cfg in ADAPTIVE_CONFIGS:
        mine = [p for p in points if p["kind"] == "open" and p["config"] == cfg]
        q = qps_at_slo(mine, slo_ms) if slo_ms is not None else None
        top = max((p["offered_turns_per_s"] for p in mine), default=None)
        out["qps_at_slo"][cfg] = q
        out["qps_at_slo_lower_bound"][cfg] = q is not None and q == top
    off, on = out["qps_at_slo"]["budget_off"], out["qps_at_slo"]["budget_on"]
    out["qps_at_slo_ratio"] = on / off if on is not None and off else None
    return out


def headline_lines(h: dict[str, Any], slo_ms: float | None) -> str:
    def q(cfg: str) -> str:
        v = h["qps_at_slo"][cfg]
        if v is None:
            return "none"
        return (">= " if h["qps_at_slo_lower_bound"][cfg] else "") + f"{v:.3f} turns/s"

    r = h["qps_at_slo_ratio"]
    if r is None:
        ratio = "n/a" + (
            " (budget on meets the SLO where budget off never does)"
            if h["qps_at_slo"]["budget_on"] is not None
            else ""
        )
    else:
        ratio = f"{r:.2f}x"
    slo = "n/a" if slo_ms is None else f"{slo_ms:.0f} ms"
    return (
        f"QPS at SLO (P95 TTFT <= {slo}): budget off {q('budget_off')}, budget on "
        f"{q('budget_on')}; on/off: {ratio}"
    )


# ---------------------------------------------------------------- chart


def adaptive_chart(
    points: list[dict[str, Any]], slo_ms: float | None, objective_ms: float | None, path: Path
) -> Path:
    """Three panels against offered turns/s: achieved turns/s, P95 TTFT (all attempted turns,
    lost ones as an x at the top edge), and the kept-token ratio with the budget's mean cap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for cfg in ADAPTIVE_CONFIGS:
        mine = sorted(
            (p for p in points if p["kind"] == "open" and p["config"] == cfg),
            key=lambda p: p["offered_turns_per_s"],
        )
        if not mine:
            continue
        xs = [p["offered_turns_per_s"] for p in mine]
        color = COLORS[cfg]
        axes[0].plot(xs, [p["turns_per_s"] for p in mine], "o-", color=color, label=cfg)
        ys = [p["slo_p95_ms"] for p in mine]
        fin = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and math.isfinite(y)]
        lost = [x for x, y in zip(xs, ys, strict=True) if y is None or not math.isfinite(y)]
        if fin:
            axes[1].plot([x for x, _ in fin], [y for _, y in fin], "o-", color=color, label=cfg)
        if lost:
            axes[1].plot(
                lost, [0.96] * len(lost), "x", color=color, transform=axes[1].get_xaxis_transform()
            )
        kept = [(x, p["kept_ratio_mean"]) for x, p in zip(xs, mine, strict=True)]
        kept = [(x, y) for x, y in kept if y is not None]
        if kept:
            axes[2].plot(*zip(*kept, strict=True), "o-", color=color, label=f"{cfg}: kept ratio")
        caps = [(x, p["visual_budget_mean"]) for x, p in zip(xs, mine, strict=True)]
        caps = [(x, y) for x, y in caps if y is not None]
        if caps:
            axes[2].plot(*zip(*caps, strict=True), "s--", color=color, label=f"{cfg}: mean cap")
    rates = sorted({p["offered_turns_per_s"] for p in points if p["kind"] == "open"})
    if rates:
        axes[0].plot(rates, rates, ":", color="gray", label="offered")
    if slo_ms is not None:
        axes[1].axhline(slo_ms, color="gray", linestyle=":", label=f"SLO {slo_ms:.0f} ms")
    if objective_ms is not None and objective_ms != slo_ms:
        axes[1].axhline(
            objective_ms, color="#4f81bd", linestyle=":", label=f"objective {objective_ms:.0f} ms"
        )
    axes[0].set(title="achieved turns/s", xlabel="offered turns/s", ylabel="turns/s")
    axes[1].set(title="P95 TTFT (lost turns count as late)", xlabel="offered turns/s", ylabel="ms")
    axes[1].set_yscale("log")
    axes[2].set(title="visual tokens kept / total", xlabel="offered turns/s", ylim=(0, 1))
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle("visiongate load benchmark: adaptive visual budget off vs on (open loop)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- the run


class _Run:
    """Reference point, then the rate sweep, over a `LoadRun` whose configurations are the
    budget off and on (both stateful clients)."""

    def __init__(
        self,
        args: argparse.Namespace,
        gateways: dict[str, GatewayProcess],
        load_run: Callable[..., Any],
        slo_factor: float,
    ) -> None:
        self.run = load_run(args, gateways, SessionSource())
        self.run.modes = dict.fromkeys(ADAPTIVE_CONFIGS, "stateful")
        self.args = args
        self.slo_factor = slo_factor
        self.block = itertools.count()
        self.reference: dict[str, Any] | None = None

    async def measure_reference(self) -> None:
        a = self.args
        self.reference = ref = await self.run._point("closed", "budget_off", 1, next(self.block))
        if self.run.slo_ms is None and ref["ttft_first_p50_ms"]:
            self.run.slo_ms = self.slo_factor * ref["ttft_first_p50_ms"]
        turn_ms = ref.get("turn_ms_mean")
        capacity = 1000.0 / turn_ms if turn_ms else 0.5
        if a.rates:
            rates, source = list(a.rates), "given by --rates"
        else:
            rates = [m * capacity / len(QUESTIONS) for m in a.rate_multipliers]
            source = (
                f"{','.join(f'{m:g}' for m in a.rate_multipliers)} x the budget-off "
                f"single-session capacity {capacity:.3f} turns/s"
            )
        self.run.ladder = {
            "source": source,
            "reference_turn_ms_mean": turn_ms,
            "capacity_turns_per_s": capacity,
            "sessions_per_s": rates,
            "turns_per_s": [r * len(QUESTIONS) for r in rates],
        }

    async def sweep(self) -> None:
        a, run = self.args, self.run
        print(ADAPTIVE_HEADER, flush=True)
        rates = list(run.ladder["sessions_per_s"])
        extra = 0 if a.rates else a.extra_rungs
        while rates:
            rate = rates.pop(0)
            b = next(self.block)
            pair = {cfg: await run._point("open", cfg, rate, b) for cfg in ADAPTIVE_CONFIGS}
            print(adaptive_row(rate * len(QUESTIONS), *pair.values()), flush=True)
            if not rates and extra > 0 and any(run._within_slo(p) for p in pair.values()):
                extra -= 1
                rates.append(2 * rate)
                run.ladder["sessions_per_s"].append(2 * rate)
                run.ladder["turns_per_s"].append(2 * rate * len(QUESTIONS))
                run.ladder["extended"] = run.ladder.get("extended", 0) + 1


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _effective(gw: GatewayProcess) -> dict[str, Any] | str:
    try:
        return gw.effective_settings()
    except Exception as exc:
        return f"unavailable: {type(exc).__name__}: {exc}"


def adaptive_main(
    args: argparse.Namespace, out: Path, load_run: Callable[..., Any], slo_factor: float
) -> int:
    """`bench.load --adaptive-compare`; `load_run` (its `LoadRun`) and `slo_factor` come from
    `bench.load`, which imports this module (never the reverse)."""
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    objective = args.budget_objective_ms or args.slo_ms  # else the measured SLO, set below
    gateways = {
        "budget_off": GatewayProcess(
            "budget_off",
            adaptive_overrides("budget_off", args, 0.0),
            out / "gateway-budget_off.log",
        )
    }

    def budget_on(objective_ms: float) -> GatewayProcess:
        gw = gateways["budget_on"] = GatewayProcess(
            "budget_on",
            adaptive_overrides("budget_on", args, objective_ms),
            out / "gateway-budget_on.log",
        )
        return gw

    run = _Run(args, gateways, load_run, slo_factor)
    outcome = RunOutcome()
    try:
        with outcome.recording(log):
            # with the objective known beforehand both gateways load together; otherwise the
            # budget-on one loads once the reference has measured the SLO it takes as objective
            for gw in [gateways["budget_off"], *([budget_on(objective)] if objective else [])]:
                gw.start()
            for gw in list(gateways.values()):
                gw.wait_ready(args.ready_timeout_s)
            print(
                f"reference: budget off, closed loop, 1 session, {2 * args.point_s:g} s "
                f"(photo + question + {len(QUESTIONS) - 1} follow-ups, {args.tokens} tokens each)",
                flush=True,
            )
            asyncio.run(run.measure_reference())
            ref = run.reference or {}
            if objective is None:
                objective = run.run.slo_ms
                if objective is None:
                    raise RuntimeError("the reference point measured no first-turn TTFT")
                budget_on(objective).start().wait_ready(args.ready_timeout_s)
            on = gateways["budget_on"]
            print(
                f"  first-turn TTFT P50 {ref.get('ttft_first_p50_ms') or 0:.0f} ms, "
                f"mean turn {ref.get('turn_ms_mean') or 0:.0f} ms, kept ratio "
                f"{ref.get('kept_ratio_mean') or 0:.3f}",
                flush=True,
            )
            slo = run.run.slo_ms
            rule = (
                "--slo-ms" if args.slo_ms else f"{run.slo_factor:g}x the reference first-turn P50"
            )
            note = (
                "the run's SLO"
                if objective == slo
                else f"{objective / slo:.2f}x the SLO, set below it by --budget-objective-ms "
                "so the controller engages within a short run"
                if slo and objective < slo
                else "set by --budget-objective-ms"
            )
            eff = _effective(on)
            knobs = (
                {
                    k: eff.get(k)
                    for k in ("visual_budget_floor", "visual_budget_step", "visual_budget_window_s")
                }
                if isinstance(eff, dict)
                else {}
            )
            print(
                f"\nopen loop: Poisson session arrivals (seed {args.seed}), "
                f"{args.open_point_s:g} s per rate; rates {run.run.ladder['source']}\n"
                f"SLO: P95 TTFT <= {slo:.0f} ms ({rule}); "
                f"budget on: objective visual_budget_ttft_ms={objective:.0f} ms ({note}), "
                + ", ".join(f"{k}={v}" for k, v in knobs.items()),
                flush=True,
            )
            asyncio.run(run.sweep())
    finally:
        for gw in gateways.values():
            gw.stop()
        signal.signal(signal.SIGTERM, previous)

    points = run.run.points
    slo = run.run.slo_ms
    head = adaptive_headline(points, slo)
    report = {
        **outcome.report_fields("load_adaptive"),
        "args": vars(args),
        "machine": machine_info(),
        "workload": {
            "questions": list(QUESTIONS),
            "tokens": args.tokens,
            "typing_s": args.typing_s,
            "client": "stateful (photo first, question after typing_s) for both",
            "photos": "skimage sample photos, then crops and mirrors of them: every "
            "session's photo is distinct, encoded by the gateway that serves it",
        },
        "configs": {
            name: {
                "requested": gw.requested,
                "applied": gw.applied,
                "skipped": gw.skipped,
                "effective_settings": _effective(gw),
            }
            for name, gw in gateways.items()
        },
        "slo": {
            "ttft_p95_ms": slo,
            "rule": "--slo-ms" if args.slo_ms else "4x the reference first-turn TTFT P50",
        },
        "budget_objective_ms": objective,
        "reference": {k: v for k, v in (run.reference or {}).items() if k != "records"},
        "rate_ladder": run.run.ladder,
        "headline": head,
        "points": points,
    }
    write_json(out / "load_adaptive.json", report)
    opened = [p for p in points if p["kind"] == "open"]
    if opened:
        adaptive_chart(points, slo, objective, out / "load_adaptive.png")
    print("\n" + headline_lines(head, slo))
    print(
        f"wrote {out / 'load_adaptive.json'}"
        + (f" and {out / 'load_adaptive.png'}" if opened else "")
    )
    return outcome.exit_code()
