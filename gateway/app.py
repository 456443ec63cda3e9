"""The Litestar application: wiring of settings, stores, encoder, engine and routes.

`create_app` builds everything from `Settings`; the models load in the background so
`/healthz` answers as soon as the server listens and `/readyz` once the engine and encoder are
loaded and warmed up. Parts can be passed in (tests hand in their own engine or encoder).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import structlog
from litestar import Litestar, Response, WebSocket, get, websocket
from litestar.datastructures import State

from gateway import __version__ as VERSION
from gateway.auth import Authenticator
from gateway.engine.base import Engine
from gateway.protocol.errors import GatewayError
from gateway.settings import Settings

__all__ = ("GatewayState", "create_app")

log = structlog.get_logger("visiongate.app")


@dataclass
class GatewayState:
    settings: Settings
    engine: Engine
    encoder: Any
    sessions: Any
    vision: Any
    service: Any
    auth: Authenticator
    rate_limiter: Any = None
    metrics: Any = None
    telemetry: Any = None
    ready: bool = False
    load_error: str | None = None
    started_at: float = field(default_factory=time.time)


def encoder_threads(settings: Settings) -> int:
    """Intra-op threads of the in-process encoder's thread: a quarter of the cores, at least 1."""
    return settings.encoder_threads or max(1, (os.cpu_count() or 2) // 4)


def engine_threads(settings: Settings) -> int:
    """Intra-op threads of the engine's thread: the cores the in-process encoder does not take
    (all of them when encoder workers run elsewhere), so neither stalls the other."""
    if settings.engine_threads:
        return settings.engine_threads
    cores = os.cpu_count() or 2
    return cores if settings.encoder == "redis" else max(1, cores - encoder_threads(settings))


def build_engine(settings: Settings) -> Engine:
    from gateway.engine.local import LocalEngine

    return LocalEngine(model_path=settings.model_path, cache_dir=settings.cache_dir,
                       max_queue=settings.engine_max_queue, kv_budget_bytes=settings.kv_budget_bytes,
                       kv_spill_redis_url=settings.redis_url, kv_ttl_s=settings.kv_ttl_s,
                       device=settings.device, dtype=settings.lm_dtype,
                       max_batch=settings.engine_max_batch,
                       prefill_chunk_tokens=settings.prefill_chunk_tokens,
                       prefix_caching=settings.prefix_caching,
                       torch_threads=engine_threads(settings))


def encoder_config(settings: Settings) -> Any:
    """The EncoderConfig a gateway (or a worker with the same settings) encodes with.

    When `model_path` is a VLM checkpoint (LLaVA, SmolVLM / Idefics3, Qwen2.5-VL) its own vision
    tower and projector encode the images and `vision_tower` is ignored; a VLM of another
    family raises `UnsupportedCheckpoint` naming the supported ones."""
    from encoder_worker.config import EncoderConfig, tower_family

    tower = settings.vision_tower
    family = tower_family(settings.model_path) if settings.model_path else None
    if family is not None:
        log.info("encoder.vlm_checkpoint", family=family, model_path=settings.model_path,
                 vision_tower_ignored=tower)
        tower = settings.model_path
    return EncoderConfig(tower=tower, pruning=settings.pruning, visual_tokens=settings.visual_tokens,
                         max_image_bytes=settings.max_image_bytes, max_pixels=settings.max_pixels,
                         device=settings.device)


def build_encoder(settings: Settings, engine: Engine) -> Any:
    from encoder_worker.service import LocalEncoder

    config = encoder_config(settings)
    # a real checkpoint's projector is real: no embedding-RMS rescaling handshake
    target_rms = None if config.family is not None else getattr(engine, "embedding_rms", None)
    if settings.encoder == "redis":
        from encoder_worker.remote import RedisEncoder

        return RedisEncoder(settings.redis_url, config, hidden_size=engine.hidden_size,
                            target_rms=target_rms,
                            image_ttl_s=settings.vision_cache_ttl_s,
                            vision_ttl_s=settings.vision_cache_ttl_s)
    return LocalEncoder(config, hidden_size=engine.hidden_size, target_rms=target_rms,
                        torch_threads=encoder_threads(settings))


def create_app(settings: Settings, *, engine: Engine | None = None, encoder: Any = None) -> Litestar:
    from gateway.caching import make_image_store, make_vision_cache
    from gateway.ratelimit import make_rate_limiter
    from gateway.service import ChatService
    from gateway.sessions import make_session_store
    from gateway.vision import VisionResolver

    engine = engine or build_engine(settings)
    sessions = make_session_store(settings.redis_url, settings.session_ttl_s)
    cache = make_vision_cache(settings.redis_url, settings.vision_cache_bytes, settings.vision_cache_ttl_s)
    images = make_image_store(settings.redis_url, settings.image_store_bytes, settings.vision_cache_ttl_s)
    telemetry = metrics = None
    try:
        from gateway.telemetry import setup_telemetry
    except ImportError:  # the telemetry extras are optional
        setup_telemetry = None
    if setup_telemetry is not None:
        telemetry = setup_telemetry(VERSION, log_level=settings.log_level)
        metrics = telemetry.metrics
    state = GatewayState(settings=settings, engine=engine, encoder=encoder, sessions=sessions,
                         vision=None, service=None, auth=Authenticator(settings.api_keys),
                         rate_limiter=make_rate_limiter(settings.rate_limit_per_minute, settings.redis_url),
                         metrics=metrics, telemetry=telemetry)

    async def load_models() -> None:
        t0 = time.perf_counter()
        try:
            await engine.start()
            if state.encoder is None:
                state.encoder = build_encoder(settings, engine)
            await state.encoder.start()
            state.vision = VisionResolver(state.encoder, cache, images, metrics=metrics)
            state.service = ChatService(engine=engine, vision=state.vision, sessions=sessions,
                                        max_output_tokens_limit=settings.max_output_tokens_limit,
                                        telemetry=telemetry)
            state.ready = True
            log.info("ready", model=engine.model_id, encoder=state.encoder.fingerprint[:16],
                     load_s=round(time.perf_counter() - t0, 2))
        except Exception as exc:  # keep serving /healthz; /readyz says why it is not ready
            state.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("model_load_failed")

    loader: list[asyncio.Task[None]] = []

    gauges = {"sessions": 0, "queue": 0, "vision_cache": 0}

    async def refresh_gauges() -> None:
        # the gauge callbacks run on the exporter's thread and must not await: read stores here
        while True:
            try:
                gauges["sessions"] = await sessions.count()
                gauges["vision_cache"] = (await cache.stats()).bytes
                if state.ready:
                    gauges["queue"] = await state.encoder.queue_depth()
            except Exception:
                log.warning("gauge_refresh_failed", exc_info=True)
            await asyncio.sleep(5.0)

    if metrics is not None:
        metrics.observe_gauges(active_sessions=lambda: gauges["sessions"],
                               queue_depth=lambda: gauges["queue"],
                               cache_bytes=lambda: {"vision": gauges["vision_cache"]},
                               engine_stats=getattr(engine, "stats", None))

    async def on_startup() -> None:
        loader.append(asyncio.create_task(load_models(), name="load models"))
        if metrics is not None:
            loader.append(asyncio.create_task(refresh_gauges(), name="refresh gauges"))

    async def on_shutdown() -> None:
        for task in loader:
            task.cancel()
        await asyncio.gather(*loader, return_exceptions=True)
        for part in (state.encoder, engine):
            if part is not None:
                try:
                    await part.aclose()
                except Exception:
                    log.exception("close_failed", part=type(part).__name__)
        for store in (sessions, cache, images, state.rate_limiter):
            await store.aclose()
        if telemetry is not None:
            telemetry.shutdown()

    @get("/healthz", sync_to_thread=False)
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "uptime_s": round(time.time() - state.started_at, 3)}

    @get("/readyz", sync_to_thread=False)
    def readyz() -> Response[dict[str, Any]]:
        if state.ready:
            return Response({"status": "ready", "model": engine.model_id}, status_code=200)
        body = {"status": "failed" if state.load_error else "loading", "error": state.load_error}
        return Response(body, status_code=503)

    @websocket("/v1/realtime")
    async def realtime(socket: WebSocket) -> None:
        from gateway.realtime import RealtimeConnection

        query = socket.query_params
        try:
            owner = state.auth.owner(socket.headers, query)
        except GatewayError as exc:
            await socket.close(code=1008, reason=exc.message)
            return
        if not state.ready:
            await socket.accept()
            await socket.send_json({"type": "error", "event_id": "event_000000", "error": {
                "type": "server_error", "code": "busy", "message": "the model is still loading; "
                "retry when /readyz answers 200", "param": None, "event_id": None}})
            await socket.close(code=1013, reason="not ready")
            return
        await RealtimeConnection(socket, state, owner).run(query.get("session_id"))

    route_handlers: list[Any] = [healthz, readyz, realtime]
    try:
        from gateway.http import http_route_handlers
    except ImportError:
        http_route_handlers = None
    if http_route_handlers is not None:
        route_handlers.extend(http_route_handlers(state))
    if telemetry is not None:
        @get("/metrics", sync_to_thread=False)
        def prometheus_metrics() -> Response[bytes]:
            body, content_type = telemetry.prometheus_text()
            return Response(body, media_type=content_type)

        route_handlers.append(prometheus_metrics)

    plugins: list[Any] = []
    if telemetry is not None:
        from gateway.telemetry import litestar_plugin

        plugins.append(litestar_plugin(telemetry))
    from litestar.openapi import OpenAPIConfig

    openapi = OpenAPIConfig(title="visiongate", version=VERSION,
                            description="OpenAI-compatible chat gateway for vision-language models "
                            "with session-aware vision caching.")
    app = Litestar(route_handlers=route_handlers, on_startup=[on_startup], plugins=plugins,
                   openapi_config=openapi,
                   on_shutdown=[on_shutdown], state=State({"gateway": state}), debug=False,
                   logging_config=None)
    return app


def gateway_state(app: Litestar) -> GatewayState:
    return app.state["gateway"]
