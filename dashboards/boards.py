"""The three visiongate dashboards (overview, encoder, cache), built as Grafana JSON.

Every query uses the series names the gateway exports (`gateway.telemetry.PROMETHEUS_NAMES`),
never recording rules, so the dashboards work against any Prometheus scraping the gateways.

The module stays one: it is declarative (panel after panel,
each a query and a title), the series names at its top are shared by all three dashboards and
by the alerts (`alerts.py`), and the panel builders live apart (`_panels.py`).
"""

from __future__ import annotations

from typing import Any

from dashboards._panels import Layout, dashboard, heatmap, query_variable, row, stat, timeseries
from dashboards.slo import ITL_OBJECTIVE_S, RESPONSE_TIME_OBJECTIVE_S, TTFT_OBJECTIVE_S
from gateway.telemetry import PROMETHEUS_NAMES as N

__all__ = (
    "DASHBOARD_UIDS",
    "ITL_PANEL",
    "cache_dashboard",
    "encoder_dashboard",
    "overview_dashboard",
)

DASHBOARD_UIDS = ("visiongate-overview", "visiongate-encoder", "visiongate-cache")

TTFT = N["gen_ai.server.time_to_first_token"]
DURATION = N["gen_ai.server.request.duration"]
TPOT = N["gen_ai.server.time_per_output_token"]
RESPONSES = N["visiongate.responses"]
ERRORS = N["visiongate.errors"]
TOKENS = N["visiongate.tokens"]
STAGE = N["visiongate.encode.stage.duration"]
QUEUE_WAIT = N["visiongate.encode.queue.duration"]
BATCH = N["visiongate.encode.batch.size"]
VISUAL = N["visiongate.visual_tokens"]
LOOKUPS = N["visiongate.cache.lookups"]
KV_REUSED = N["visiongate.kv.reused_tokens"]
KV_PREFILL = N["visiongate.kv.prefill_tokens"]
CACHE_BYTES = N["visiongate.cache.bytes"]
WS = N["visiongate.websocket.connections"]
SESSIONS = N["visiongate.sessions.active"]
QUEUE_DEPTH = N["visiongate.encode.queue.depth"]
ITL = N["visiongate.llm.inter_token_latency"]
SCHED_REQUESTS = N["visiongate.scheduler.requests"]
SCHED_BATCH = N["visiongate.scheduler.batch.size"]
SCHED_STEP_TOKENS = N["visiongate.scheduler.step.tokens"]
KV_BLOCKS = N["visiongate.kv.blocks"]
PREEMPTIONS = N["visiongate.scheduler.preemptions"]
UP_REQUESTS = N["visiongate.upstream.requests"]
UP_TTFT = N["visiongate.upstream.time_to_first_token"]
UP_IN_FLIGHT = N["visiongate.upstream.in_flight"]
UP_HEALTHY = N["visiongate.upstream.healthy"]
ITL_PANEL = "Inter-token latency vs objective"

M = 'gen_ai_request_model=~"$model"'
R = "$__rate_interval"


def _quantiles(metric: str, selector: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{R}])))",
            f"p{round(q * 100)}{suffix}",
        )
        for q in (0.5, 0.95, 0.99)
    ]


def overview_dashboard() -> dict[str, Any]:
    """Traffic, P50/P95/P99 TTFT and response time against the SLO, TTFT heatmap, errors, and
    the scheduler (running/waiting, batch, KV blocks, preemptions, ITL and TPOT)."""
    completed = f'{M}, status="completed"'
    lay = Layout()
    lay.add(row("Now"))
    lay.add(
        stat("Responses / s", f"sum(rate({RESPONSES}{{{M}}}[5m]))", unit="reqps", decimals=2),
        w=4,
        h=4,
    )
    lay.add(
        stat(
            "P95 TTFT (5m)",
            f"histogram_quantile(0.95, sum by (le) (rate({TTFT}_bucket{{{M}}}[5m])))",
            unit="s",
            steps=[(None, "green"), (TTFT_OBJECTIVE_S * 0.8, "orange"), (TTFT_OBJECTIVE_S, "red")],
            description=f"Objective: P95 <= {TTFT_OBJECTIVE_S:g} s",
        ),
        w=4,
        h=4,
    )
    lay.add(
        stat(
            "P95 response time (5m)",
            f"histogram_quantile(0.95, sum by (le) (rate({DURATION}_bucket{{{completed}}}[5m])))",
            unit="s",
            steps=[
                (None, "green"),
                (RESPONSE_TIME_OBJECTIVE_S * 0.8, "orange"),
                (RESPONSE_TIME_OBJECTIVE_S, "red"),
            ],
            description=f"Objective: P95 <= {RESPONSE_TIME_OBJECTIVE_S:g} s (completed)",
        ),
        w=4,
        h=4,
    )
    lay.add(
        stat(
            "Error share (5m)",
            # no failed response yet means no `failed` series: 0 %, not "No data"
            f'(sum(rate({RESPONSES}{{{M}, status="failed"}}[5m])) or vector(0)) / '
            f"sum(rate({RESPONSES}{{{M}}}[5m]))",
            unit="percentunit",
            steps=[(None, "green"), (0.01, "orange"), (0.05, "red")],
        ),
        w=4,
        h=4,
    )
    lay.add(stat("Open WebSockets", f"sum({WS})"), w=4, h=4)
    lay.add(stat("Active sessions", f"sum({SESSIONS})"), w=4, h=4)

    lay.add(row("Latency"))
    lay.add(
        timeseries(
            "Time to first token vs SLO",
            _quantiles(TTFT, M),
            unit="s",
            objective=TTFT_OBJECTIVE_S,
            description="Response start to first output token; red line: objective",
        )
    )
    lay.add(
        timeseries(
            "Response time vs SLO (completed)",
            _quantiles(DURATION, completed),
            unit="s",
            objective=RESPONSE_TIME_OBJECTIVE_S,
        )
    )
    lay.add(
        heatmap(
            "TTFT distribution",
            f"sum by (le) (increase({TTFT}_bucket{{{M}}}[{R}]))",
            description="Responses per TTFT bucket",
        )
    )
    lay.add(
        timeseries(
            "Share of responses within objective",
            [
                (
                    (
                        f'sum(rate({TTFT}_bucket{{{M}, le="{TTFT_OBJECTIVE_S}"}}[{R}])) / '
                        f"sum(rate({TTFT}_count{{{M}}}[{R}]))"
                    ),
                    f"TTFT <= {TTFT_OBJECTIVE_S:g}s",
                ),
                (
                    (
                        f"sum(rate({DURATION}_bucket{{{completed}, "
                        f'le="{RESPONSE_TIME_OBJECTIVE_S}"}}[{R}])) / '
                        f"sum(rate({DURATION}_count{{{completed}}}[{R}]))"
                    ),
                    f"response <= {RESPONSE_TIME_OBJECTIVE_S:g}s",
                ),
            ],
            unit="percentunit",
            objective=0.95,
            minimum=None,
            maximum=1,
            description="SLI: the objective is 95%",
        )
    )
    lay.add(timeseries("Time per output token", _quantiles(TPOT, M), unit="s"))

    lay.add(row("Traffic and errors"))
    lay.add(
        timeseries(
            "Responses / s by status",
            [(f"sum by (status) (rate({RESPONSES}{{{M}}}[{R}]))", "{{status}}")],
            unit="reqps",
            stack=True,
        )
    )
    lay.add(
        timeseries(
            "Responses / s by API",
            [(f"sum by (api) (rate({RESPONSES}{{{M}}}[{R}]))", "{{api}}")],
            unit="reqps",
            stack=True,
        )
    )
    lay.add(
        timeseries(
            "Errors / s by code",
            [(f"sum by (code, api) (rate({ERRORS}[{R}]))", "{{code}} ({{api}})")],
            unit="reqps",
            stack=True,
        )
    )
    lay.add(
        timeseries(
            "Tokens / s by type", [(f"sum by (type) (rate({TOKENS}{{{M}}}[{R}]))", "{{type}}")]
        )
    )
    _scheduler_row(lay)
    _upstream_row(lay)
    variables = [query_variable("model", "Model", f"{TTFT}_count", "gen_ai_request_model")]
    return dashboard(
        DASHBOARD_UIDS[0],
        "visiongate / Overview",
        "Traffic, latency SLOs, errors and the engine scheduler of all gateways",
        lay,
        variables,
    )


def _upstream_row(lay: Layout) -> None:
    """Replicas behind `--engine openai` (empty for the local engine): attempts by outcome,
    each replica's time to first token, its open requests and whether it is up."""
    lay.add(row("Upstream replicas (--engine openai)"))
    lay.add(
        timeseries(
            "Attempts / s by replica and outcome",
            [
                (
                    f"sum by (upstream, outcome) (rate({UP_REQUESTS}[{R}]))",
                    "{{upstream}} {{outcome}}",
                )
            ],
            unit="reqps",
            description="ok: answered; failover: failed before the first token, moved to the "
            "next replica; error: failed; busy: 429; cancelled: the client went away",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            "Replica time to first token",
            _quantiles(UP_TTFT, "", by="upstream"),
            unit="s",
            description="From the request sent to a replica to its first text, per replica "
            "(the gateway's own share is the gap to the gateway's TTFT)",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            "Requests in flight / replicas up",
            [
                (f"sum by (upstream) ({UP_IN_FLIGHT})", "{{upstream}} in flight"),
                (f"sum({UP_HEALTHY})", "replicas up"),
            ],
            description="Requests open on each replica (session affinity with bounded load "
            "keeps them near even), and how many replicas pass their health check",
        ),
        w=8,
    )


def _scheduler_row(lay: Layout) -> None:
    """The local engine's continuous-batching scheduler: occupancy, KV blocks, preemptions and
    the streaming latency they cause. Gauges are summed over replicas (no model label)."""
    lay.add(row("Scheduler"))
    lay.add(
        timeseries(
            "Requests running / waiting",
            [
                (f'sum({SCHED_REQUESTS}{{state="running"}})', "running"),
                (f'sum({SCHED_REQUESTS}{{state="waiting"}})', "waiting"),
            ],
            description="Running: in the batch (prefilling or decoding). Waiting: "
            "queued for a slot",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            "Batch size and tokens per step",
            [
                (f"avg({SCHED_BATCH})", "sequences (mean of replicas)"),
                (f"max({SCHED_BATCH})", "sequences (largest replica)"),
                (f"avg({SCHED_STEP_TOKENS})", "tokens (mean of replicas)"),
            ],
            description="Of the last scheduler step: sequences, and tokens (prefill "
            "chunks and decodes) it computed",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            "KV blocks",
            [
                (f'sum({KV_BLOCKS}{{state="used"}})', "used"),
                (f'sum({KV_BLOCKS}{{state="cached"}})', "cached"),
                (f'sum({KV_BLOCKS}{{state="free"}})', "free"),
            ],
            stack=True,
            description="Stacked to the pool size. Used: held by running requests; "
            "cached: reusable prefix KV, evicted on demand; free: empty",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            "Preemptions / s",
            [(f"sum(rate({PREEMPTIONS}[{R}]))", "preemptions")],
            unit="ops",
            description="Requests whose KV was freed to make room, to be recomputed; "
            "steady preemption means the KV budget is too small",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            ITL_PANEL,
            [
                (
                    f"histogram_quantile(0.5, sum by (le) (rate({ITL}_bucket{{{M}}}[{R}])))",
                    "ITL p50",
                ),
                (
                    f"histogram_quantile(0.95, sum by (le) (rate({ITL}_bucket{{{M}}}[{R}])))",
                    "ITL p95",
                ),
                (
                    f"histogram_quantile(0.95, sum by (le) (rate({TPOT}_bucket{{{M}}}[{R}])))",
                    "TPOT p95",
                ),
            ],
            unit="s",
            objective=ITL_OBJECTIVE_S,
            description=f"Gaps between streamed text deltas (ITL) and mean time per output token "
            f"per response (TPOT); red line: ITL objective, P95 <= {ITL_OBJECTIVE_S:g} s",
        ),
        w=8,
    )
    lay.add(
        stat(
            "P95 ITL (5m)",
            f"histogram_quantile(0.95, sum by (le) (rate({ITL}_bucket{{{M}}}[5m])))",
            unit="s",
            steps=[(None, "green"), (ITL_OBJECTIVE_S * 0.8, "orange"), (ITL_OBJECTIVE_S, "red")],
            description=f"Objective: P95 <= {ITL_OBJECTIVE_S:g} s",
        ),
        w=8,
    )


def encoder_dashboard() -> dict[str, Any]:
    """Per-stage encode latency, queue wait and depth, batch sizes, visual tokens kept."""
    lay = Layout()
    lay.add(row("Stages"))
    lay.add(
        timeseries(
            "P95 latency by stage",
            [
                (
                    f"histogram_quantile(0.95, sum by (le, stage) (rate({STAGE}_bucket[{R}])))",
                    "{{stage}}",
                )
            ],
            unit="s",
        )
    )
    lay.add(
        timeseries(
            "Mean time per image by stage",
            [
                (
                    f"sum by (stage) (rate({STAGE}_sum[{R}])) / "
                    f"sum by (stage) (rate({STAGE}_count[{R}]))",
                    "{{stage}}",
                )
            ],
            unit="s",
            stack=True,
            description="Stacked: the total is the mean encode time of one image",
        )
    )
    lay.add(
        heatmap(
            "Vision tower latency", f'sum by (le) (increase({STAGE}_bucket{{stage="vision"}}[{R}]))'
        )
    )
    lay.add(
        timeseries(
            "Images encoded / s", [(f"sum(rate({QUEUE_WAIT}_count[{R}]))", "images")], unit="ops"
        )
    )

    lay.add(row("Queue and batching"))
    lay.add(timeseries("Queue wait", _quantiles(QUEUE_WAIT, ""), unit="s"))
    lay.add(timeseries("Queue depth", [(f"sum({QUEUE_DEPTH})", "jobs waiting")]))
    lay.add(
        timeseries(
            "Batch size",
            [
                (f"sum(rate({BATCH}_sum[{R}])) / sum(rate({BATCH}_count[{R}]))", "mean"),
                (f"histogram_quantile(0.95, sum by (le) (rate({BATCH}_bucket[{R}])))", "p95"),
            ],
        )
    )

    lay.add(row("Pruning"))
    lay.add(
        timeseries(
            "Visual tokens kept ratio",
            [(f'sum(rate({VISUAL}{{kind="kept"}}[{R}])) / sum(rate({VISUAL}[{R}]))', "kept")],
            unit="percentunit",
            maximum=1,
        )
    )
    lay.add(
        timeseries(
            "Visual tokens / s", [(f"sum by (kind) (rate({VISUAL}[{R}]))", "{{kind}}")], stack=True
        )
    )
    return dashboard(
        DASHBOARD_UIDS[1],
        "visiongate / Encoder",
        "Image encoding: stages, queue, batching and patch pruning",
        lay,
        [],
    )


def cache_dashboard() -> dict[str, Any]:
    """Vision and KV cache hit rates by tier, bytes held, KV reuse."""
    lay = Layout()
    lay.add(row("Hit rates"))
    for cache in ("vision", "kv"):
        sel = f'cache="{cache}"'
        lay.add(
            timeseries(
                f"{cache.upper() if cache == 'kv' else cache.title()} cache hit rate by tier",
                [
                    (
                        (
                            f'sum by (tier) (rate({LOOKUPS}{{{sel}, result="hit"}}[{R}])) / '
                            "on() group_left() "
                            f"sum(rate({LOOKUPS}{{{sel}}}[{R}]))"
                        ),
                        "{{tier}}",
                    )
                ],
                unit="percentunit",
                stack=True,
                maximum=1,
                description="Share of all lookups answered by each tier",
            )
        )
    lay.add(
        timeseries(
            "Lookups / s",
            [
                (
                    f"sum by (cache, tier, result) (rate({LOOKUPS}[{R}]))",
                    "{{cache}} {{tier}} {{result}}",
                )
            ],
            unit="ops",
        )
    )
    lay.add(
        timeseries(
            "Cached share of input tokens",
            [
                (
                    f'sum(rate({TOKENS}{{type="cached"}}[{R}])) / '
                    f'sum(rate({TOKENS}{{type="input"}}[{R}]))',
                    "cached / input",
                )
            ],
            unit="percentunit",
            maximum=1,
        )
    )

    lay.add(row("KV reuse"))
    lay.add(
        timeseries(
            "KV reuse ratio",
            [
                (
                    (
                        f"sum(rate({KV_REUSED}[{R}])) / "
                        f"(sum(rate({KV_REUSED}[{R}])) + sum(rate({KV_PREFILL}[{R}])))"
                    ),
                    "reused / prompt",
                )
            ],
            unit="percentunit",
            maximum=1,
            description="Prompt tokens served from a session's KV blocks instead of prefilled",
        )
    )
    lay.add(
        timeseries(
            "Prompt tokens / s",
            [
                (f"sum(rate({KV_REUSED}[{R}]))", "reused"),
                (f"sum(rate({KV_PREFILL}[{R}]))", "prefilled"),
            ],
            stack=True,
        )
    )

    lay.add(row("Memory"))
    lay.add(
        timeseries(
            "Bytes held by cache", [(f"sum by (cache) ({CACHE_BYTES})", "{{cache}}")], unit="bytes"
        )
    )
    lay.add(timeseries("Active sessions", [(f"sum({SESSIONS})", "sessions")]))
    return dashboard(
        DASHBOARD_UIDS[2],
        "visiongate / Caches",
        "Vision and KV caches: hit rates by tier, reuse and memory",
        lay,
        [],
    )
