"""`GatewayMetrics`: the one thing the serving code touches to record a metric.

Plain methods that record one fact each, on the instruments of `_instruments` (names, units,
buckets, Prometheus names). It does not time anything itself; callers pass measured durations.
Observable gauges (sessions, queue depth, cache bytes, the scheduler's `_scheduler_gauges`,
the upstream replicas) are registered once each: OTel cannot unregister a callback.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from opentelemetry.metrics import CallbackOptions, Observation

from gateway.telemetry._instruments import METRICS
from gateway.telemetry._scheduler_gauges import scheduler_callbacks

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter

    from gateway.telemetry._scheduler_gauges import SchedulerStats

__all__ = ("GatewayMetrics",)


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
        ``api``: the API that answered (realtime | chat_completions | completions | responses).
        ``ttft_s`` is ``None`` when no token came out.
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
        """One error event / HTTP error sent to a client, by its stable ``code``. ``api``: the
        transport that sent it, "realtime" (an ``error`` event) or "http" (an error answer of
        any HTTP route, bodies refused before routing included), never one API's name."""
        self._add("visiongate.errors", 1, {"code": code, "api": api})

    def record_key_usage(
        self,
        *,
        key: str,
        input_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        image_tokens: int,
        encode_s: float,
    ) -> None:
        """One finished response of a key under token limits. ``key`` is its id, or "other" past the
        ids a process labels (the caller bounds the set: `gateway.policy.key_usage`)."""
        for kind, count in (
            ("input", input_tokens),
            ("cached", cached_tokens),
            ("output", output_tokens),
            ("image", image_tokens),
        ):
            self._add("visiongate.key.tokens", count, {"key": key, "type": kind})
        self._add("visiongate.key.encode.duration", max(encode_s, 0.0), {"key": key})

    def record_key_refusal(self, *, key: str, limit: str) -> None:
        """A response of a key refused by its ``limit`` (requests | tokens | concurrency)."""
        self._add("visiongate.key.rate_limited", 1, {"key": key, "limit": limit})

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

    def record_connection_refusal(self, reason: str) -> None:
        """A connection refused or cut off by gateway/server/connection_guard.py (`reason`:
        header_timeout, body_timeout, ws_handshake_timeout, max_connections,
        max_unauthenticated_connections)."""
        self._add("visiongate.connections.refused", 1, {"reason": reason})

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
            callbacks += scheduler_callbacks(engine_stats)
        for name, callback in callbacks:
            kind, unit, description = METRICS[name]
            create = (
                self._meter.create_observable_counter
                if kind == "observable_counter"
                else self._meter.create_observable_gauge
            )
            create(name, callbacks=[callback], unit=unit, description=description)
