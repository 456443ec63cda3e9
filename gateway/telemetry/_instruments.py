"""The gateway's metric instruments: their names, kinds, units, bucket boundaries and the
series names Prometheus stores them under.

Prometheus names are what ``opentelemetry-exporter-prometheus`` derives from the OTel name and
unit (dots become underscores, ``s`` adds ``_seconds``, counters get ``_total``, curly-brace
units add nothing). Recording rules, alerts and dashboards use `PROMETHEUS_NAMES` values only.
Attribute keys become label names the same way (``gen_ai.request.model`` ->
``gen_ai_request_model``). Histogram ``le`` labels are written from float bounds (``"2.0"``).

The ``visiongate.upstream.*`` series exist only for an engine on OpenAI-compatible replicas
(``--engine openai``), labelled by the replica's ``host:port``; a request counts once per
replica it tried. Plain data and one function: what records them is `_metrics.GatewayMetrics`.
"""

from __future__ import annotations

from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

__all__ = (
    "BATCH_SIZE_BUCKETS",
    "DURATION_BUCKETS_S",
    "ENCODE_BUCKETS_S",
    "ITL_BUCKETS_S",
    "METRICS",
    "PROMETHEUS_NAMES",
    "TPOT_BUCKETS_S",
    "TTFT_BUCKETS_S",
    "metric_views",
)


# Multimodal TTFT spans a text-only follow-up (tens of ms) to a cold multi-image encode (seconds).
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.05,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    3.0,
    4.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
)
DURATION_BUCKETS_S: tuple[float, ...] = (
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    45.0,
    60.0,
    90.0,
    120.0,
)
TPOT_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
)
# One encode stage takes from about a millisecond (INT4 pack on GPU) to seconds (CPU tower).
ENCODE_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
)
# Gaps between streamed text deltas: a few ms (small model, light batch) to seconds (a step
# stalled behind long prefill chunks or preemption). 0.25 s is the ITL objective's bound.
ITL_BUCKETS_S: tuple[float, ...] = (
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.06,
    0.075,
    0.1,
    0.125,
    0.15,
    0.2,
    0.25,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
)
BATCH_SIZE_BUCKETS: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0)

# OTel instrument name -> (kind, unit, description)
METRICS: dict[str, tuple[str, str, str]] = {
    "gen_ai.server.time_to_first_token": (
        "histogram",
        "s",
        "Time from response start to its first output token",
    ),
    "gen_ai.server.time_per_output_token": (
        "histogram",
        "s",
        "Mean time per output token after the first",
    ),
    "gen_ai.server.request.duration": ("histogram", "s", "Whole response duration"),
    "visiongate.llm.inter_token_latency": (
        "histogram",
        "s",
        "Gap between consecutive streamed text deltas of one response",
    ),
    "visiongate.encode.stage.duration": ("histogram", "s", "Duration of one image encode stage"),
    "visiongate.encode.queue.duration": ("histogram", "s", "Wait in the encode queue"),
    "visiongate.encode.batch.size": ("histogram", "{image}", "Images per encoder batch"),
    "visiongate.responses": ("counter", "{response}", "Responses by final status"),
    "visiongate.tokens": ("counter", "{token}", "Tokens by type (input/output/image/cached)"),
    "visiongate.visual_tokens": ("counter", "{token}", "Visual tokens kept or dropped by pruning"),
    "visiongate.cache.lookups": ("counter", "{lookup}", "Cache lookups by cache, tier and result"),
    "visiongate.kv.reused_tokens": ("counter", "{token}", "Prompt tokens served from reused KV"),
    "visiongate.kv.prefill_tokens": ("counter", "{token}", "Prompt tokens prefilled anew"),
    "visiongate.encode.budget": (
        "counter",
        "{image}",
        "Images encoded, by the keep-ratio cap in force (adaptive visual budget)",
    ),
    "visiongate.kv.warmups": (
        "counter",
        "{warmup}",
        "KV warm-ups by outcome (warmed/superseded/dropped/failed)",
    ),
    "visiongate.kv.warmed_tokens": (
        "counter",
        "{token}",
        "Prompt tokens prefilled ahead of the question by KV warm-ups",
    ),
    "visiongate.errors": ("counter", "{error}", "Errors returned to clients by code"),
    "visiongate.key.tokens": (
        "counter",
        "{token}",
        "Tokens of finished responses per managed API key, by type (input/cached/output/image)",
    ),
    "visiongate.key.encode.duration": (
        "counter",
        "s",
        "Time responses of each managed API key waited for image encodes",
    ),
    "visiongate.key.rate_limited": (
        "counter",
        "{response}",
        "Responses of each managed API key refused by its limits (requests/tokens)",
    ),
    "visiongate.websocket.connections": ("updowncounter", "{connection}", "Open WebSockets"),
    "visiongate.connections.refused": (
        "counter",
        "{connection}",
        "Connections refused or cut off by the slow-client defences, by reason",
    ),
    "visiongate.sessions.active": ("gauge", "{session}", "Sessions held by this replica"),
    "visiongate.encode.queue.depth": ("gauge", "{job}", "Encode jobs waiting"),
    "visiongate.cache.bytes": ("gauge", "By", "Bytes held by each cache"),
    "visiongate.scheduler.requests": (
        "gauge",
        "{request}",
        "Requests in the engine's batch (running) or queued (waiting)",
    ),
    "visiongate.scheduler.batch.size": ("gauge", "{sequence}", "Sequences in the last step"),
    "visiongate.scheduler.step.tokens": (
        "gauge",
        "{token}",
        "Tokens (prefill chunks and decodes) in the last step",
    ),
    "visiongate.kv.blocks": ("gauge", "{block}", "KV cache blocks by state (used/cached/free)"),
    "visiongate.scheduler.preemptions": (
        "observable_counter",
        "{preemption}",
        "Requests preempted (KV freed, later recomputed)",
    ),
    "visiongate.upstream.requests": (
        "counter",
        "{request}",
        "Attempts on an upstream replica by outcome (ok/failover/error/cancelled/busy)",
    ),
    "visiongate.upstream.time_to_first_token": (
        "histogram",
        "s",
        "From a request sent to an upstream replica to its first text",
    ),
    "visiongate.upstream.in_flight": ("gauge", "{request}", "Requests open on each replica"),
    "visiongate.upstream.healthy": ("gauge", "{replica}", "1 while a replica is up, else 0"),
}

# OTel instrument name -> the series name Prometheus stores (histograms: add _bucket/_sum/_count).
PROMETHEUS_NAMES: dict[str, str] = {
    "gen_ai.server.time_to_first_token": "gen_ai_server_time_to_first_token_seconds",
    "gen_ai.server.time_per_output_token": "gen_ai_server_time_per_output_token_seconds",
    "gen_ai.server.request.duration": "gen_ai_server_request_duration_seconds",
    "visiongate.llm.inter_token_latency": "visiongate_llm_inter_token_latency_seconds",
    "visiongate.encode.stage.duration": "visiongate_encode_stage_duration_seconds",
    "visiongate.encode.queue.duration": "visiongate_encode_queue_duration_seconds",
    "visiongate.encode.batch.size": "visiongate_encode_batch_size",
    "visiongate.responses": "visiongate_responses_total",
    "visiongate.tokens": "visiongate_tokens_total",
    "visiongate.visual_tokens": "visiongate_visual_tokens_total",
    "visiongate.cache.lookups": "visiongate_cache_lookups_total",
    "visiongate.kv.reused_tokens": "visiongate_kv_reused_tokens_total",
    "visiongate.kv.prefill_tokens": "visiongate_kv_prefill_tokens_total",
    "visiongate.encode.budget": "visiongate_encode_budget_total",
    "visiongate.kv.warmups": "visiongate_kv_warmups_total",
    "visiongate.kv.warmed_tokens": "visiongate_kv_warmed_tokens_total",
    "visiongate.errors": "visiongate_errors_total",
    "visiongate.key.tokens": "visiongate_key_tokens_total",
    "visiongate.key.encode.duration": "visiongate_key_encode_duration_seconds_total",
    "visiongate.key.rate_limited": "visiongate_key_rate_limited_total",
    "visiongate.websocket.connections": "visiongate_websocket_connections",
    "visiongate.connections.refused": "visiongate_connections_refused_total",
    "visiongate.sessions.active": "visiongate_sessions_active",
    "visiongate.encode.queue.depth": "visiongate_encode_queue_depth",
    "visiongate.cache.bytes": "visiongate_cache_bytes",
    "visiongate.scheduler.requests": "visiongate_scheduler_requests",
    "visiongate.scheduler.batch.size": "visiongate_scheduler_batch_size",
    "visiongate.scheduler.step.tokens": "visiongate_scheduler_step_tokens",
    "visiongate.kv.blocks": "visiongate_kv_blocks",
    "visiongate.scheduler.preemptions": "visiongate_scheduler_preemptions_total",
    "visiongate.upstream.requests": "visiongate_upstream_requests_total",
    "visiongate.upstream.time_to_first_token": "visiongate_upstream_time_to_first_token_seconds",
    "visiongate.upstream.in_flight": "visiongate_upstream_in_flight",
    "visiongate.upstream.healthy": "visiongate_upstream_healthy",
}

_BUCKETS: dict[str, tuple[float, ...]] = {
    "gen_ai.server.time_to_first_token": TTFT_BUCKETS_S,
    "gen_ai.server.time_per_output_token": TPOT_BUCKETS_S,
    "gen_ai.server.request.duration": DURATION_BUCKETS_S,
    "visiongate.llm.inter_token_latency": ITL_BUCKETS_S,
    "visiongate.encode.stage.duration": ENCODE_BUCKETS_S,
    "visiongate.encode.queue.duration": ENCODE_BUCKETS_S,
    "visiongate.encode.batch.size": BATCH_SIZE_BUCKETS,
    "visiongate.upstream.time_to_first_token": TTFT_BUCKETS_S,
}


def metric_views() -> list[View]:
    """Explicit bucket boundaries for every histogram (the SDK defaults suit none of them)."""
    return [
        View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(list(bounds)))
        for name, bounds in _BUCKETS.items()
    ]
