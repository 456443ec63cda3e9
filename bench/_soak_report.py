"""Numbers and output of the soak benchmark: per-key summaries, the side-by-side table, error
counts, the gateway's memory, and the chart. Pure functions except `chart` (matplotlib, Agg)
and `read_rss` / `parse_error_counter` (which read what they are given).

Definitions:
- A key's TTFT P95 (and P50) is over its `ok` turns, WebSocket and HTTP together, first turns
  and follow-ups together; the per-transport and per-kind P95s are reported beside it.
  `lost_p95_ms` counts failed and abandoned turns as infinitely late (as the load benchmark's
  SLO does), so a key cannot look fast by losing its slow turns.
- The ratio of a key is its P95 with the abusers over its P95 alone (the baseline phase); the
  goal is a ratio of at most `GOAL_RATIO` for every well-behaved key.
- Error counts are by code: the code of every failed turn of a well-behaved key, and the
  outcome of every abusive request (`ok` included), by behaviour.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench._load_stats import TurnRecord, percentile

__all__ = (
    "GOAL_RATIO",
    "chart",
    "code_counts",
    "key_summary",
    "key_table",
    "parse_error_counter",
    "parse_gauges",
    "per_key_rows",
    "read_rss",
    "report_text",
    "rss_summary",
    "rss_text",
)

GOAL_RATIO = 2.0
PHASES = ("baseline", "abuse")
PHASE_COLORS = {"baseline": "#4f81bd", "abuse": "#c0504d"}


def key_summary(ws: Sequence[TurnRecord], http: Sequence[TurnRecord]) -> dict[str, Any]:
    """One key's turns in one phase -> its published numbers."""
    records = [*ws, *http]
    ok = [r for r in records if r.status == "ok" and r.ttft_ms is not None]
    ok_ids = {id(r) for r in ok}
    ttft = [r.ttft_ms for r in ok]
    late = [math.inf if r.status != "ok" or r.ttft_ms is None else r.ttft_ms for r in records]
    return {
        "turns": len(ok),
        "turns_attempted": len(records),
        "failed": len(records) - len(ok),
        "error_codes": dict(code_counts(records)),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p95_ms": percentile(ttft, 95),
        "lost_p95_ms": percentile(late, 95),
        "ttft_first_p95_ms": percentile([r.ttft_ms for r in ok if r.turn == 0], 95),
        "ttft_followup_p95_ms": percentile([r.ttft_ms for r in ok if r.turn > 0], 95),
        "ttft_ws_p95_ms": percentile([r.ttft_ms for r in ws if id(r) in ok_ids], 95),
        "ttft_http_p95_ms": percentile([r.ttft_ms for r in http if id(r) in ok_ids], 95),
        "turns_ws": sum(1 for r in ws if r.status == "ok"),
        "turns_http": sum(1 for r in http if r.status == "ok"),
    }


def code_counts(records: Iterable[TurnRecord]) -> Counter[str]:
    """Codes of the turns that did not succeed (`abandoned` when a turn had no code)."""
    return Counter(r.error_code or r.status for r in records if r.status != "ok")


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0 or math.isinf(a) or math.isinf(b):
        return None
    return a / b


def per_key_rows(
    summaries: Mapping[str, Mapping[str, dict[str, Any]]], keys: Sequence[str]
) -> list[dict[str, Any]]:
    """`summaries[phase][key]` -> one row per key: both phases' P95s, the ratio, the goal."""
    rows = []
    for key in keys:
        base = summaries.get("baseline", {}).get(key)
        abuse = summaries.get("abuse", {}).get(key)
        ratio = _ratio(abuse and abuse["ttft_p95_ms"], base and base["ttft_p95_ms"])
        # turns tried beside the abusers and none answered: starved, whatever the baseline
        starved = bool(abuse) and abuse["turns"] == 0 and abuse["failed"] > 0
        rows.append(
            {
                "key": key,
                "baseline_p95_ms": base and base["ttft_p95_ms"],
                "abuse_p95_ms": abuse and abuse["ttft_p95_ms"],
                "baseline_turns": base["turns"] if base else 0,
                "abuse_turns": abuse["turns"] if abuse else 0,
                "baseline_failed": base["failed"] if base else 0,
                "abuse_failed": abuse["failed"] if abuse else 0,
                "baseline_lost_p95_ms": base and base.get("lost_p95_ms"),
                "abuse_lost_p95_ms": abuse and abuse.get("lost_p95_ms"),
                "ratio": ratio,
                "starved": starved,
                "within_goal": ratio is not None
                and ratio <= GOAL_RATIO
                and (abuse["failed"] if abuse else 0) == 0,
            }
        )
    return rows


def _ms(v: float | None, width: int = 9) -> str:
    if v is None:
        return f"{'-':>{width}}"
    if math.isinf(v):
        return f"{'inf':>{width}}"
    return f"{v:>{width}.0f}"


def key_table(rows: Sequence[dict[str, Any]]) -> str:
    """The side-by-side table of the well-behaved keys, as text."""
    lines = [
        f"{'key':<10} {'P95 TTFT ms':^21}  {'ratio':>7}  {'turns ok/failed':^19}  goal",
        f"{'':<10} {'alone':>9} {'w/ abuse':>10}  {'':>7}  {'alone':>8} {'w/ abuse':>10}",
    ]
    for r in rows:
        ratio = "starved" if r["starved"] else "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        goal = "met" if r["within_goal"] else "NOT met"
        lines.append(
            f"{r['key']:<10} {_ms(r['baseline_p95_ms'])} {_ms(r['abuse_p95_ms'], 10)}  "
            f"{ratio:>7}  {r['baseline_turns']:>4}/{r['baseline_failed']:<3} "
            f"{r['abuse_turns']:>6}/{r['abuse_failed']:<3}  {goal}"
        )
    return "\n".join(lines)


def codes_text(counts: Mapping[str, Mapping[str, Mapping[str, int]]]) -> str:
    """`counts[phase][who]` -> a code x (phase, who) table."""
    columns = [(phase, who) for phase in PHASES for who in counts.get(phase, {})]
    codes = sorted({c for phase, who in columns for c in counts[phase][who]})
    if not codes:
        return "no errors"
    head = f"{'code':<28}" + "".join(f" {f'{p}:{w}':>22}" for p, w in columns)
    body = [
        f"{code:<28}" + "".join(f" {counts[p][w].get(code, 0):>22}" for p, w in columns)
        for code in codes
    ]
    return "\n".join([head, *body])


def report_text(
    report: dict[str, Any], bad_keys: int, behaviours: Sequence[str], duration_s: float
) -> str:
    """The printed summary of a run: the side-by-side table, error counts by code (the clients'
    and the gateway's own), the abusers' outcomes and the gateway's memory."""
    out: list[str] = []
    out.append(
        f"\nwell-behaved keys, P95 TTFT alone vs beside {bad_keys} abusive keys "
        f"({', '.join(behaviours)}; {duration_s:g} s per phase; goal <= {GOAL_RATIO:g}x "
        "and no failed turn):"
    )
    out.append(key_table(report["per_key"]))
    out.append("goal: " + ("met by every key" if report["goal"]["met"] else "NOT met"))
    out.append(
        "\nerror counts by code (well-behaved: failed turns; abusive: refused or failed requests):"
    )
    out.append(codes_text(report["errors_by_code"]))
    for name, per_kind in report["phases"].get("abuse", {}).get("abuse_outcomes", {}).items():
        out.append(
            f"{name}: "
            + "; ".join(
                f"{kind} " + ", ".join(f"{c}={n}" for c, n in sorted(counts.items()))
                for kind, counts in per_kind.items()
                if counts
            )
        )
    for phase, data in report["phases"].items():
        server = data.get("server_errors_by_code")
        if server is not None:
            text = ", ".join(f"{c}={n:g}" for c, n in sorted(server.items())) or "none"
            out.append(f"gateway's own error count ({phase}): {text}")
    rss = report["rss"]
    out.append("\ngateway memory: " + rss_text(rss["samples"]))
    for phase, s in rss["by_phase"].items():
        if phase in PHASES:
            out.append(
                f"  {phase}: first {s['first_bytes'] / 2**20:.0f} MiB, peak "
                f"{s['peak_bytes'] / 2**20:.0f} MiB, last {s['last_bytes'] / 2**20:.0f} MiB"
            )
    return "\n".join(out)


# ---------------------------------------------------------------- the gateway's memory


def read_rss(pid: int) -> int | None:
    """Resident set size of `pid` in bytes (Linux /proc), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_summary(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per phase: first, peak and last RSS (bytes) and the growth within the phase."""
    out: dict[str, Any] = {}
    for phase in {s["phase"] for s in samples}:
        values = [s["rss_bytes"] for s in samples if s["phase"] == phase]
        out[phase] = {
            "samples": len(values),
            "first_bytes": values[0],
            "peak_bytes": max(values),
            "last_bytes": values[-1],
            "growth_bytes": values[-1] - values[0],
        }
    return out


def rss_text(samples: Sequence[dict[str, Any]], every_s: float = 5.0) -> str:
    """RSS over time, one value per `every_s` seconds, in MiB."""
    points, next_t = [], -math.inf
    for s in samples:
        if s["t_s"] >= next_t:
            points.append(f"{s['t_s']:.0f}s {s['rss_bytes'] / 2**20:.0f}")
            next_t = s["t_s"] + every_s
    return "RSS MiB: " + ", ".join(points) if points else "RSS: not available"


GAUGES = (
    "visiongate_scheduler_requests",
    "visiongate_scheduler_batch_size",
    "visiongate_scheduler_step_tokens",
    "visiongate_scheduler_preemptions_total",
    "visiongate_kv_blocks",
    "visiongate_encode_queue_depth",
    "visiongate_websocket_connections",
)
_SERIES = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$", re.M)


def parse_gauges(metrics_text: str, names: Iterable[str] = GAUGES) -> dict[str, float]:
    """The scheduler's and queues' current values from the gateway's Prometheus text, keyed
    `name` or `name{labels}` (e.g. `visiongate_scheduler_requests{state="waiting"}`)."""
    wanted = set(names)
    out: dict[str, float] = {}
    for match in _SERIES.finditer(metrics_text):
        if match.group("name") in wanted:
            labels = match.group("labels")
            key = match.group("name") + (f"{{{labels}}}" if labels else "")
            try:
                out[key] = float(match.group("value"))
            except ValueError:
                continue
    return out


_ERRORS = re.compile(r"^visiongate_errors_total\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)", re.M)
_CODE = re.compile(r'code="(?P<code>[^"]*)"')


def parse_error_counter(metrics_text: str) -> dict[str, float]:
    """The gateway's own count of errors sent to clients, by code (all APIs summed), from its
    Prometheus text."""
    out: dict[str, float] = {}
    for match in _ERRORS.finditer(metrics_text):
        code = _CODE.search(match.group("labels"))
        if code:
            key = code.group("code")
            out[key] = out.get(key, 0.0) + float(match.group("value"))
    return out


# ---------------------------------------------------------------- chart


def chart(report: dict[str, Any], path: Path) -> Path:
    """Three panels: per-key P95 TTFT alone vs with abusers (the 2x goal marked), every
    well-behaved turn's TTFT over time, and the gateway's RSS over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    rows = report["per_key"]
    xs = range(len(rows))
    width = 0.38
    for offset, phase, key in (
        (-width / 2, "baseline", "baseline_p95_ms"),
        (width / 2, "abuse", "abuse_p95_ms"),
    ):
        values = [r[key] if r[key] is not None and math.isfinite(r[key]) else 0.0 for r in rows]
        axes[0].bar(
            [x + offset for x in xs],
            values,
            width,
            color=PHASE_COLORS[phase],
            label="alone" if phase == "baseline" else "with abusers",
        )
    for x, r in zip(xs, rows, strict=True):
        if r["baseline_p95_ms"]:
            axes[0].plot(
                [x - width, x + width], [GOAL_RATIO * r["baseline_p95_ms"]] * 2, ":", color="gray"
            )
        label = "starved" if r["starved"] else None if r["ratio"] is None else f"{r['ratio']:.1f}x"
        if label:
            axes[0].annotate(
                label,
                (x + width / 2, r["abuse_p95_ms"] or 0),
                ha="center",
                va="bottom",
                fontsize=8,
                color=PHASE_COLORS["abuse"],
            )
    axes[0].set_xticks(list(xs), [r["key"] for r in rows])
    axes[0].set(title=f"well-behaved keys: P95 TTFT (dotted: {GOAL_RATIO:g}x alone)", ylabel="ms")
    for phase in PHASES:
        turns = report["phases"].get(phase, {}).get("turns", [])
        ok = [t for t in turns if t["status"] == "ok" and t["ttft_ms"] is not None]
        lost = [t for t in turns if t["status"] != "ok"]
        if ok:
            axes[1].plot(
                [t["sent_s"] for t in ok],
                [t["ttft_ms"] for t in ok],
                ".",
                color=PHASE_COLORS[phase],
                alpha=0.6,
                label=f"{phase}: ok turns",
            )
        if lost:
            axes[1].plot(
                [t["sent_s"] for t in lost],
                [0.96] * len(lost),
                "x",
                color=PHASE_COLORS[phase],
                transform=axes[1].get_xaxis_transform(),
                label=f"{phase}: failed turns",
            )
    axes[1].set(title="well-behaved turns: TTFT over time", xlabel="s since start", ylabel="ms")
    if axes[1].lines:
        axes[1].set_yscale("log")
    samples = report["rss"]["samples"]
    if samples:
        axes[2].plot(
            [s["t_s"] for s in samples],
            [s["rss_bytes"] / 2**20 for s in samples],
            "-",
            color="black",
        )
    for phase in PHASES:
        window = report["phases"].get(phase, {}).get("window_s")
        if window:
            axes[2].axvspan(
                window[0], window[1], color=PHASE_COLORS[phase], alpha=0.12, label=phase
            )
            axes[1].axvspan(window[0], window[1], color=PHASE_COLORS[phase], alpha=0.06)
    axes[2].set(title="gateway RSS", xlabel="s since start", ylabel="MiB")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("visiongate soak: well-behaved keys alone, then beside abusive keys")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
