"""The gateway's metric instruments, their bucket boundaries and their Prometheus names.

`GatewayMetrics` is the only thing the serving code touches: plain methods that record one fact
each. It does not time anything itself; callers pass measured durations.

Prometheus names are what ``opentelemetry-exporter-prometheus`` derives from the OTel name and
unit (dots become underscores, ``s`` adds ``_seconds``, counters get ``_total``, curly-brace
units add nothing). Recording rules, alerts and dashboards use `PROMETHEUS_NAMES` values only.
Attribute keys become label names the same way (``gen_ai.request.model`` ->
``gen_ai_request_model``). Histogram ``le`` labels are written from float bounds (``"2.0"``).

Scheduler gauges read an engine's `SchedulerStats` snapshot at each collection; an engine
without one (no ``stats()``) exports no scheduler series. KV blocks are split into three states
that add up to the pool: ``used`` (held by running requests), ``cached`` (unreferenced but
holding reusable prefix KV, so allocatable at the cost of the reuse) and ``free`` (empty).

The ``visiongate.upstream.*`` series exist only for an engine on OpenAI-compatible replicas
(``--engine openai``), labelled by the replica's ``host:port``; a request counts once per
replica it tried.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

import structlog
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter

__all__ = (
    "BATCH_SIZE_BUCKETS",
    "DURATION_BUCKETS_S",
    "ENCODE_BUCKETS_S",
    "ITL_BUCKETS_S",
    "METRICS",
    "PROMETHEUS_NAMES",
    "TPOT_BUCKETS_S",
    "TTFT_BUCKETS_S",
    "GatewayMetrics",
    "SchedulerStats",
    "metric_views",
)

log = structlog.get_logger(__name__)

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
    "visiongate.websocket.connections": ("updowncounter", "{connection}", "Open WebSockets"),
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
    "visiongate.websocket.connections": "visiongate_websocket_connections",
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


class SchedulerStats(Protocol):
    """What the scheduler gauges read (`gateway.engine.interface.EngineStats` has these fields)."""

    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def step_tokens(self) -> int: ...
    @property
    def kv_blocks_used(self) -> int: ...
    @property
    def kv_blocks_total(self) -> int: ...
    @property
    def kv_blocks_cached(self) -> int: ...
    @property
    def preemptions_total(self) -> int: ...


def _kv_block_states(stats: SchedulerStats) -> dict[str, int]:
    """used + cached + free == total; ``free`` never goes negative on a torn snapshot."""
    used, cached = int(stats.kv_blocks_used), int(stats.kv_blocks_cached)
    return {
        "used": used,
        "cached": cached,
        "free": max(int(stats.kv_blocks_total) - used - cached, 0),
    }


class GatewayMetrics:
    """Records the gateway's metrics on one OTel meter. Thread-safe; never blocks on export."""

    __slots__ = ("_gauge_lock", "_gauges_registered", "_i", "_meter", "_upstreams_registered")

    def __init__(self, meter: Meter) -> None:
        self._meter = meter
        self._gauge_lock = threading.Lock()
        self._gauges_registered = False
        self._upstreams_registered = False
        i: dict[str, object] = {}
        for name, (kind, unit, description) in METRICS.items():
            if kind == "histogram":
                i[name] = meter.create_histogram(name, unit=unit, description=description)
            elif kind == "counter":
                i[name] = meter.create_counter(name, unit=unit, description=description)
            elif kind == "updowncounter":
                i[name] = meter.create_up_down_counter(name, unit=unit, description=description)
        self._i = i

    def _add(self, name: str, value: float, attributes: Mapping[str, str]) -> None:
        if value:
            self._i[name].add(value, attributes)  # type: ignore[attr-defined]

    def _record(self, name: str, value: float, attributes: Mapping[str, str] | None = None) -> None:
        self._i[name].record(value, attributes)  # type: ignore[attr-defined]

    def record_response(
        self,
        *,
        model: str,
        status: str,
        ttft_s: float | None,
        duration_s: float,
        output_tokens: int,
        input_tokens: int,
        image_tokens: int,
        cached_tokens: int,
        time_per_output_token_s: float | None,
        api: str,
        inter_token_latencies_s: Iterable[float] = (),
    ) -> None:
        """One finished response. ``status``: completed | cancelled | failed | incomplete;
        ``api``: realtime | chat_completions. ``ttft_s`` is ``None`` when no token came out.
        ``inter_token_latencies_s``: the gaps between its consecutive text deltas, one
        histogram observation each."""
        base = {"gen_ai.operation.name": "chat", "gen_ai.request.model": model, "api": api}
        self._add("visiongate.responses", 1, {**base, "status": status})
        self._record("gen_ai.server.request.duration", duration_s, {**base, "status": status})
        if ttft_s is not None:
            self._record("gen_ai.server.time_to_first_token", ttft_s, base)
        if time_per_output_token_s is not None:
            self._record("gen_ai.server.time_per_output_token", time_per_output_token_s, base)
        for gap_s in inter_token_latencies_s:
            self._record("visiongate.llm.inter_token_latency", max(float(gap_s), 0.0), base)
        for kind, count in (
            ("input", input_tokens),
            ("output", output_tokens),
            ("image", image_tokens),
            ("cached", cached_tokens),
        ):
            self._add("visiongate.tokens", count, {"gen_ai.request.model": model, "type": kind})

    def record_encode(
        self,
        *,
        timings_ms: Mapping[str, float],
        batch_size: int,
        queue_ms: float,
        tokens_kept: int,
        tokens_total: int,
    ) -> None:
        """One encoded image: per-stage durations (ms, keys like ``preprocess``), the batch it
        rode in, its queue wait, and how many visual tokens pruning kept out of the total."""
        for stage, ms in timings_ms.items():
            name = stage.removeprefix("encode.")
            self._record("visiongate.encode.stage.duration", ms / 1000.0, {"stage": name})
        self._record("visiongate.encode.queue.duration", queue_ms / 1000.0)
        self._record("visiongate.encode.batch.size", float(batch_size))
        self._add("visiongate.visual_tokens", tokens_kept, {"kind": "kept"})
        dropped = max(tokens_total - tokens_kept, 0)
        self._add("visiongate.visual_tokens", dropped, {"kind": "dropped"})

    def record_cache_lookup(self, *, cache: str, tier: str, result: str) -> None:
        """``cache``: vision | kv; ``tier``: memory | redis | none; ``result``: hit | miss."""
        self._add("visiongate.cache.lookups", 1, {"cache": cache, "tier": tier, "result": result})

    def record_kv_reuse(self, *, reused_tokens: int, prefill_tokens: int) -> None:
        """Prompt tokens taken from a session's KV blocks vs. prefilled for one response."""
        self._add("visiongate.kv.reused_tokens", reused_tokens, {})
        self._add("visiongate.kv.prefill_tokens", prefill_tokens, {})

    def record_visual_budget(self, *, keep_ratio_cap: float) -> None:
        """One image encoded under the adaptive visual budget's cap."""
        self._add("visiongate.encode.budget", 1, {"keep_ratio_cap": f"{keep_ratio_cap:g}"})

    def record_kv_warmup(self, *, outcome: str, computed_tokens: int) -> None:
        """One KV warm-up's end, and the prompt tokens it prefilled."""
        self._add("visiongate.kv.warmups", 1, {"outcome": outcome})
        self._add("visiongate.kv.warmed_tokens", computed_tokens, {})

    def record_error(self, *, code: str, api: str) -> None:
        """One error event / HTTP error sent to a client, by its stable ``code``."""
        self._add("visiongate.errors", 1, {"code": code, "api": api})

    def record_upstream_attempt(
        self, *, upstream: str, outcome: str, ttft_s: float | None = None
    ) -> None:
        """One attempt on an upstream replica (``upstream``: its ``host:port``). ``outcome``:
        ok | failover (failed before any text; the next replica was tried) | error | cancelled |
        busy (it answered 429). ``ttft_s``: request sent to its first text, when text came."""
        self._add("visiongate.upstream.requests", 1, {"upstream": upstream, "outcome": outcome})
        if ttft_s is not None:
            self._record(
                "visiongate.upstream.time_to_first_token", max(ttft_s, 0.0), {"upstream": upstream}
            )

    def observe_upstreams(
        self,
        *,
        in_flight: Callable[[], Mapping[str, int]],
        healthy: Callable[[], Mapping[str, bool]],
    ) -> None:
        """Register the per-replica gauges: requests open on each and whether it is up (both
        by ``host:port``), read at each collection. Once only, as `observe_gauges`."""
        with self._gauge_lock:
            if self._upstreams_registered:
                raise RuntimeError("observe_upstreams() was already called on these metrics")
            self._upstreams_registered = True

        def open_requests(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(int(n), {"upstream": u}) for u, n in in_flight().items()]

        def up(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(1 if ok else 0, {"upstream": u}) for u, ok in healthy().items()]

        for name, callback in (
            ("visiongate.upstream.in_flight", open_requests),
            ("visiongate.upstream.healthy", up),
        ):
            _, unit, description = METRICS[name]
            self._meter.create_observable_gauge(
                name, callbacks=[callback], unit=unit, description=description
            )

    def ws_connection_opened(self) -> None:
        self._i["visiongate.websocket.connections"].add(1)  # type: ignore[attr-defined]

    def ws_connection_closed(self) -> None:
        self._i["visiongate.websocket.connections"].add(-1)  # type: ignore[attr-defined]

    def observe_gauges(
        self,
        *,
        active_sessions: Callable[[], int],
        queue_depth: Callable[[], int],
        cache_bytes: Callable[[], Mapping[str, int]],
        engine_stats: Callable[[], SchedulerStats | None] | None = None,
    ) -> None:
        """Register the observable gauges; the callables run at each collection. Once only:
        a second call raises, since OTel cannot unregister a callback.

        ``engine_stats`` (the engine's ``stats`` method, or ``None`` for an engine without a
        scheduler) feeds the scheduler gauges and the preemption counter. It runs on the
        collecting thread, so it must be a cheap snapshot; when it raises or returns ``None``,
        that collection has no scheduler series."""
        with self._gauge_lock:
            if self._gauges_registered:
                raise RuntimeError("observe_gauges() was already called on these metrics")
            self._gauges_registered = True

        def sessions(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(int(active_sessions()))]

        def depth(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(int(queue_depth()))]

        def nbytes(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(int(v), {"cache": k}) for k, v in cache_bytes().items()]

        callbacks: list[tuple[str, Callable[[CallbackOptions], Iterable[Observation]]]] = [
            ("visiongate.sessions.active", sessions),
            ("visiongate.encode.queue.depth", depth),
            ("visiongate.cache.bytes", nbytes),
        ]
        if engine_stats is not None:
            callbacks += _scheduler_callbacks(engine_stats)
        for name, callback in callbacks:
            kind, unit, description = METRICS[name]
            create = (
                self._meter.create_observable_counter
                if kind == "observable_counter"
                else self._meter.create_observable_gauge
            )
            create(name, callbacks=[callback], unit=unit, description=description)


def _scheduler_callbacks(
    engine_stats: Callable[[], SchedulerStats | None],
) -> list[tuple[str, Callable[[CallbackOptions], Iterable[Observation]]]]:
    """One callback per scheduler instrument, each reading a fresh snapshot. A failing
    ``engine_stats`` is logged once per run of failures, not once per instrument and scrape."""
    failing = False

    def snapshot() -> SchedulerStats | None:
        nonlocal failing
        try:
            stats = engine_stats()
        except Exception:  # a gauge must never break a scrape
            if not failing:
                log.warning("engine_stats_failed", exc_info=True)
            failing = True
            return None
        failing = False
        return stats

    def observe(
        read: Callable[[SchedulerStats], Iterable[Observation]],
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(_: CallbackOptions) -> Iterable[Observation]:
            stats = snapshot()
            return [] if stats is None else list(read(stats))

        return callback

    return [
        (
            "visiongate.scheduler.requests",
            observe(
                lambda s: [
                    Observation(int(s.running), {"state": "running"}),
                    Observation(int(s.waiting), {"state": "waiting"}),
                ]
            ),
        ),
        ("visiongate.scheduler.batch.size", observe(lambda s: [Observation(int(s.batch_size))])),
        ("visiongate.scheduler.step.tokens", observe(lambda s: [Observation(int(s.step_tokens))])),
        (
            "visiongate.kv.blocks",
            observe(
                lambda s: [
                    Observation(n, {"state": state}) for state, n in _kv_block_states(s).items()
                ]
            ),
        ),
        (
            "visiongate.scheduler.preemptions",
            observe(lambda s: [Observation(int(s.preemptions_total))]),
        ),
    ]
