"""Output of the load benchmark: the side-by-side table, the headline ratios, machine info and the
chart. Tables and headlines are returned as text (the caller prints them on stdout); the chart
is written with matplotlib's Agg backend.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ("TABLE_HEADER", "chart", "headline", "headline_text", "machine_info", "table_row")

CONFIGS = ("baseline", "visiongate")
COLORS = {"baseline": "#c0504d", "visiongate": "#4f81bd"}

TABLE_HEADER = (
    f"{'point':<16} {'turns/s':>13} {'out tok/s':>13}  {'first-turn TTFT P50/P95/P99 ms':^35}"
    f"  {'follow-up TTFT P50/P95/P99 ms':^35}  {'ITL P95 ms':>13}  {'err/busy/aband':>15}\n"
    f"{'':<16} {'base':>6} {'vg':>6} {'base':>6} {'vg':>6}  {'baseline':^17} {'visiongate':^17}"
    f"  {'baseline':^17} {'visiongate':^17}  {'base':>6} {'vg':>6}  {'base':>7} {'vg':>7}"
)


def _num(v: float | None, width: int, digits: int = 2) -> str:
    if v is None:
        return f"{'-':>{width}}"
    if math.isinf(v):
        return f"{'inf':>{width}}"
    return f"{v:>{width}.{digits}f}"


def _ms3(s: dict[str, Any] | None, prefix: str) -> str:
    if s is None:
        return f"{'-':^17}"
    vals = [s.get(f"{prefix}_{p}_ms") for p in ("p50", "p95", "p99")]
    return "/".join(_num(v, 5, 0).strip().rjust(5) for v in vals)


def _counts(s: dict[str, Any] | None) -> str:
    if s is None:
        return f"{'-':>7}"
    return f"{s['errors']}/{s['busy']}/{s['abandoned']}".rjust(7)


def table_row(label: str, base: dict[str, Any] | None, vg: dict[str, Any] | None) -> str:
    """One line of the side-by-side table; a configuration that skipped the point shows '-'."""

    def g(s: dict[str, Any] | None, key: str) -> float | None:
        return None if s is None else s.get(key)

    return (
        f"{label:<16} {_num(g(base, 'turns_per_s'), 6)} {_num(g(vg, 'turns_per_s'), 6)} "
        f"{_num(g(base, 'output_tok_per_s'), 6, 1)} {_num(g(vg, 'output_tok_per_s'), 6, 1)}  "
        f"{_ms3(base, 'ttft_first')} {_ms3(vg, 'ttft_first')}  "
        f"{_ms3(base, 'ttft_followup')} {_ms3(vg, 'ttft_followup')}  "
        f"{_num(g(base, 'itl_p95_ms'), 6, 0)} {_num(g(vg, 'itl_p95_ms'), 6, 0)}  "
        f"{_counts(base)} {_counts(vg)}"
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isinf(a) or math.isinf(b):
        return None
    return a / b


def _closed(points: list[dict[str, Any]], config: str, concurrency: int) -> dict[str, Any] | None:
    for p in points:
        if p["kind"] == "closed" and p["config"] == config and p["concurrency"] == concurrency:
            return p
    return None


def headline(
    points: list[dict[str, Any]], qps: dict[str, float | None], target_concurrency: int = 8
) -> dict[str, Any]:
    """The three headline ratios. When the run has no closed-loop point at the target
    concurrency (e.g. `--quick`), the highest one below it is used and named."""
    levels = sorted(
        {p["concurrency"] for p in points if p["kind"] == "closed" and p["config"] == "visiongate"}
    )
    below = [c for c in levels if c <= target_concurrency]
    at = target_concurrency if target_concurrency in levels else (max(below) if below else None)
    one = _closed(points, "visiongate", 1)
    many = _closed(points, "visiongate", at) if at is not None else None
    out: dict[str, Any] = {"concurrency": at, "target_concurrency": target_concurrency}
    out["vg_tok_per_s_ratio"] = _ratio(
        many and many["output_tok_per_s"], one and one["output_tok_per_s"]
    )
    out["vg_followup_p95_ratio"] = _ratio(
        many and many["ttft_followup_p95_ms"], one and one["ttft_followup_p50_ms"]
    )
    b1, bn = _closed(points, "baseline", 1), (_closed(points, "baseline", at) if at else None)
    out["baseline_tok_per_s_ratio"] = _ratio(
        bn and bn["output_tok_per_s"], b1 and b1["output_tok_per_s"]
    )
    out["baseline_followup_p95_ratio"] = _ratio(
        bn and bn["ttft_followup_p95_ms"], b1 and b1["ttft_followup_p50_ms"]
    )
    out["qps_at_slo"] = dict(qps)
    # met the SLO at the highest rate it ran: its true QPS at SLO may be higher
    out["qps_at_slo_lower_bound"] = {
        cfg: qps.get(cfg) is not None
        and qps[cfg]
        == max(
            (
                p["offered_turns_per_s"]
                for p in points
                if p["kind"] == "open" and p["config"] == cfg
            ),
            default=None,
        )
        for cfg in CONFIGS
    }
    vg, base = qps.get("visiongate"), qps.get("baseline")
    out["qps_at_slo_ratio"] = vg / base if vg is not None and base else None
    return out


def headline_text(h: dict[str, Any], slo_ms: float | None, slo_rule: str) -> str:
    def x(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f}x"

    bound = h.get("qps_at_slo_lower_bound") or {}

    def q(cfg: str) -> str:
        v = h["qps_at_slo"].get(cfg)
        if v is None:
            return "none"
        return (">= " if bound.get(cfg) else "") + f"{v:.3f} turns/s"

    c = h["concurrency"]
    note = (
        ""
        if c == h["target_concurrency"]
        else f" (no {h['target_concurrency']}-session point; using {c})"
    )
    slo = "n/a" if slo_ms is None else f"{slo_ms:.0f} ms"
    ratio = h["qps_at_slo_ratio"]
    if ratio is None and h["qps_at_slo"].get("visiongate") is not None:
        ratio_text = "visiongate meets the SLO where baseline never does"
    else:
        ratio_text = x(ratio)
        if ratio is not None and bound.get("visiongate"):
            ratio_text = f">= {ratio_text} (visiongate met the SLO at the highest rate run)"
    return "\n".join(
        [
            f"headline{note}:",
            (
                f"  output tok/s at {c} sessions / at 1 session (visiongate): "
                f"{x(h['vg_tok_per_s_ratio'])}   [baseline: {x(h['baseline_tok_per_s_ratio'])}]"
            ),
            (
                f"  P95 follow-up TTFT at {c} sessions / single-session follow-up TTFT P50 "
                f"(visiongate): {x(h['vg_followup_p95_ratio'])}   "
                f"[baseline: {x(h['baseline_followup_p95_ratio'])}]"
            ),
            f"  SLO: P95 TTFT <= {slo} ({slo_rule})",
            (
                f"  QPS at SLO: baseline {q('baseline')}, visiongate {q('visiongate')}; "
                f"visiongate/baseline: {ratio_text}"
            ),
        ]
    )


def machine_info() -> dict[str, Any]:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    cpu = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False
            ).stdout.strip()
            or None
        )
    except OSError:
        commit = None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": mem,
        "git_commit": commit,
        "packages": {p: version(p) for p in ("torch", "transformers", "websockets", "visiongate")},
    }


def chart(points: list[dict[str, Any]], slo_ms: float | None, path: Path) -> Path:
    """Two rows: closed loop (against concurrent sessions) and open loop (against offered
    turns/s); left throughput, right P95 TTFT. A point without a finite P95 (its turns lost, or
    none of that kind completed) is drawn as an x at the top edge of its panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for config in CONFIGS:
        color = COLORS[config]
        closed = sorted(
            (p for p in points if p["kind"] == "closed" and p["config"] == config),
            key=lambda p: p["concurrency"],
        )
        opened = sorted(
            (p for p in points if p["kind"] == "open" and p["config"] == config),
            key=lambda p: p["offered_turns_per_s"],
        )
        if closed:
            xs = [p["concurrency"] for p in closed]
            axes[0][0].plot(
                xs, [p["output_tok_per_s"] for p in closed], "o-", color=color, label=config
            )
            for key, style, what in (
                ("ttft_first_p95_ms", "o-", "first turn"),
                ("ttft_followup_p95_ms", "s--", "follow-up"),
            ):
                _plot_latency(
                    axes[0][1], xs, [p[key] for p in closed], style, color, f"{config}, {what}"
                )
        if opened:
            xs = [p["offered_turns_per_s"] for p in opened]
            axes[1][0].plot(xs, [p["turns_per_s"] for p in opened], "o-", color=color, label=config)
            _plot_latency(
                axes[1][1],
                xs,
                [p["slo_p95_ms"] for p in opened],
                "o-",
                color,
                f"{config}, all turns",
            )
    axes[0][0].set(
        title="closed loop: output tokens/s", xlabel="concurrent sessions", ylabel="output tok/s"
    )
    axes[0][1].set(title="closed loop: P95 TTFT", xlabel="concurrent sessions", ylabel="ms")
    axes[1][0].set(
        title="open loop: completed turns/s",
        xlabel="offered turns/s (Poisson sessions)",
        ylabel="turns/s",
    )
    axes[1][1].set(
        title="open loop: P95 TTFT (lost turns count as late)",
        xlabel="offered turns/s (Poisson sessions)",
        ylabel="ms",
    )
    levels = sorted({p["concurrency"] for p in points if p["kind"] == "closed"})
    rates = sorted({p["offered_turns_per_s"] for p in points if p["kind"] == "open"})
    if rates:
        axes[1][0].plot(rates, rates, ":", color="gray", label="offered")
    for ax, ticks, fmt in (
        (axes[0][0], levels, "{:g}"),
        (axes[0][1], levels, "{:g}"),
        (axes[1][0], rates, "{:.3g}"),
        (axes[1][1], rates, "{:.3g}"),
    ):
        if len(ticks) > 1:
            ax.set_xscale("log", base=2)
            ax.minorticks_off()
        if ticks:
            ax.set_xticks(ticks, [fmt.format(t) for t in ticks])
    for ax in (axes[0][1], axes[1][1]):
        ax.set_yscale("log")
        if slo_ms is not None:
            ax.axhline(slo_ms, color="gray", linestyle=":", label=f"SLO {slo_ms:.0f} ms")
    for row in axes:
        for ax in row:
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    fig.suptitle("visiongate load benchmark: baseline (stateless) vs visiongate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_latency(
    ax: Any, xs: list[float], ys: list[float | None], style: str, color: str, label: str
) -> None:
    finite = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and math.isfinite(y)]
    lost = [x for x, y in zip(xs, ys, strict=True) if y is None or not math.isfinite(y)]
    if finite:
        ax.plot([x for x, _ in finite], [y for _, y in finite], style, color=color, label=label)
    if lost:  # at the top edge of the panel, whatever its scale
        ax.plot(
            lost,
            [0.96] * len(lost),
            "x",
            color=color,
            markersize=9,
            transform=ax.get_xaxis_transform(),
        )
