"""The Litestar application: wiring of settings, stores, encoder, engine and routes.

`create_app` builds the `GatewayState` from `Settings`; the app's lifespan loads the models in
the background, so `/healthz` answers as soon as the server listens and `/readyz` once the
engine and encoder are loaded and warmed up, and closes everything on the way out. An engine or
encoder passed in is used instead of the real one (the fast tests pass `gateway.testing.fakes`'
deterministic pair).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import structlog
from litestar import Litestar, Response, get
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig

from gateway import __version__ as VERSION
from gateway.api.admin import admin_route_handlers
from gateway.api.http.bodies import BoundedRequest
from gateway.api.http.body_guard import BodyGuard
from gateway.api.http.server_send import ServerSend
from gateway.api.openai import http_route_handlers
from gateway.api.openai.routes import routing_error_handler
from gateway.api.realtime.router import realtime_route
from gateway.caching import make_image_store, make_vision_cache
from gateway.chat.service import ChatService
from gateway.chat.vision_resolver import VisionResolver
from gateway.engine.interface import Engine
from gateway.policy.auth import Authenticator
from gateway.policy.client_secrets import make_client_secret_store
from gateway.policy.key_guard import KeyResolver
from gateway.policy.key_store import make_key_store
from gateway.policy.key_usage import CountingLimiter, TokenMeter
from gateway.policy.rate_headers import RateLimitHeaders
from gateway.policy.ratelimit import RefusedBytes, make_rate_limiter
from gateway.policy.token_limits import TokenLimits, make_token_limiter
from gateway.server.client_address import ClientAddressMiddleware, TrustedProxies
from gateway.server.core_share import CoreShare
from gateway.server.readiness import Readiness
from gateway.server.state import GatewayState, Serving
from gateway.sessions import make_session_store
from gateway.sessions.response_records import make_response_store
from gateway.settings import Settings
from gateway.telemetry import litestar_plugin, register_secrets, setup_telemetry
from gateway.telemetry.request_ids import with_request_ids

if TYPE_CHECKING:
    from encoder_worker.config import EncoderConfig
    from encoder_worker.types import Encoder

__all__ = ("build_encoder", "build_engine", "create_app", "encoder_config")

log = structlog.get_logger("visiongate.app")


def encoder_threads(settings: Settings) -> int:
    """Intra-op threads of the in-process encoder's thread: a quarter of the cores, at least 1."""
    return settings.encoder_threads or max(1, (os.cpu_count() or 2) // 4)


def engine_threads(settings: Settings) -> int:
    """Intra-op threads of the engine's thread while the in-process encoder encodes: the cores
    it does not take (all of them when encoder workers run elsewhere), so neither stalls the
    other. Between images the engine takes every core (`core_share`)."""
    if settings.engine_threads:
        return settings.engine_threads
    cores = os.cpu_count() or 2
    return cores if settings.encoder == "redis" else max(1, cores - encoder_threads(settings))


def core_share(settings: Settings) -> CoreShare | None:
    """The cores' sharing between the in-process engine and encoder (`CoreShare`), or None when
    the engine's threads are fixed: `ENGINE_THREADS` set, encoders elsewhere, an upstream."""
    if settings.engine_threads or settings.encoder == "redis" or settings.engine != "local":
        return None
    return CoreShare(os.cpu_count() or 2, encoder_threads(settings))


def build_engine(settings: Settings, cores: CoreShare | None = None) -> Engine:
    if settings.engine == "openai":  # generation on OpenAI-compatible upstream replicas
        from gateway.engine.upstream.openai_engine import OpenAIEngine

        return OpenAIEngine.from_settings(settings)
    from gateway.engine.local.local_engine import LocalEngine

    return LocalEngine(
        model_path=settings.model_path,
        cache_dir=settings.cache_dir,
        max_queue=settings.engine_max_queue,
        # without API keys every caller is one owner: the automatic share is the whole queue
        max_queue_per_key=settings.engine_max_queue_per_key
        or (0 if settings.api_keys or settings.admin_api_key else settings.engine_max_queue),
        kv_budget_bytes=settings.kv_budget_bytes,
        kv_spill_redis_url=settings.redis_url,
        kv_ttl_s=settings.kv_ttl_s,
        device=settings.device,
        dtype=settings.lm_dtype,
        max_batch=settings.engine_max_batch,
        prefill_chunk_tokens=settings.prefill_chunk_tokens,
        prefix_caching=settings.prefix_caching,
        torch_threads=cores.engine_threads if cores is not None else engine_threads(settings),
    )


def encoder_config(settings: Settings) -> EncoderConfig:
    """The EncoderConfig a gateway (or a worker with the same settings) encodes with.

    When `model_path` is a VLM checkpoint (LLaVA, SmolVLM / Idefics3, Qwen2.5-VL) its own vision
    tower and projector encode the images and `vision_tower` is ignored; a VLM of another
    family raises `UnsupportedCheckpoint` naming the supported ones."""
    from encoder_worker.config import EncoderConfig, tower_family

    tower = settings.vision_tower
    family = tower_family(settings.model_path) if settings.model_path else None
    if family is not None:
        log.info(
            "encoder.vlm_checkpoint",
            family=family,
            model_path=settings.model_path,
            vision_tower_ignored=tower,
        )
        tower = settings.model_path
    return EncoderConfig(
        tower=tower,
        pruning=settings.pruning,
        visual_tokens=settings.visual_tokens,
        max_image_bytes=settings.max_image_bytes,
        max_pixels=settings.max_pixels,
        device=settings.device,
    )


def build_encoder(settings: Settings, engine: Engine, cores: CoreShare | None = None) -> Encoder:
    if engine.capabilities.image_input == "bytes":  # the engine encodes images itself
        from gateway.encoders.passthrough_encoder import PassThroughEncoder

        return PassThroughEncoder(engine.model_id, engine.hidden_size)
    from encoder_worker.local_encoder import LocalEncoder

    config = encoder_config(settings)
    # a real checkpoint's projector is real: no embedding-RMS rescaling handshake
    target_rms = None if config.family is not None else engine.capabilities.embedding_rms
    if settings.encoder == "redis":
        from gateway.encoders.redis_encoder import RedisEncoder

        return RedisEncoder(
            settings.redis_url,
            config,
            hidden_size=engine.hidden_size,
            target_rms=target_rms,
            image_ttl_s=settings.vision_cache_ttl_s,
            vision_ttl_s=settings.vision_cache_ttl_s,
            max_in_flight=settings.encoder_max_in_flight,
            deployment=settings.encoder_deployment,
        )
    return LocalEncoder(
        config,
        hidden_size=engine.hidden_size,
        target_rms=target_rms,
        torch_threads=encoder_threads(settings),
        on_batch=cores.encoding if cores is not None else None,
    )


def create_app(
    settings: Settings, *, engine: Engine | None = None, encoder: Encoder | None = None
) -> Litestar:
    """The gateway for `settings`. `engine` / `encoder` replace the real ones when given."""
    # the cores are shared only between an engine and an encoder both built here
    cores = core_share(settings) if engine is None and encoder is None else None
    engine = engine or build_engine(settings, cores)
    telemetry = setup_telemetry(VERSION, log_level=settings.log_level)
    register_secrets(settings.api_keys)  # the keys themselves never reach a log line
    if settings.engine == "openai":  # nor do the upstreams' keys
        from gateway.engine.upstream.endpoints import parse_upstreams

        register_secrets(u.api_key for u in parse_upstreams(settings.upstreams) if u.api_key)
    engine.bind_telemetry(telemetry)  # an upstream engine's per-replica metrics and spans
    auth = _authenticator(settings, engine)
    # managed keys' token limits and usage, on the key store's backend, and the settings'
    # token limits of every other key
    defaults = (
        TokenLimits(
            input_tpm=settings.input_tokens_per_minute or None,
            output_tpm=settings.output_tokens_per_minute or None,
        )
        if settings.input_tokens_per_minute or settings.output_tokens_per_minute
        else None
    )
    concurrency = settings.max_concurrent_responses_per_key
    meter = (
        TokenMeter(
            make_token_limiter(settings.redis_url),
            auth,
            telemetry.metrics,
            defaults=defaults,
            concurrency=concurrency,
        )
        if auth.store is not None or defaults is not None or (auth.enabled and concurrency)
        else None
    )
    state = GatewayState(
        settings=settings,
        engine=engine,
        sessions=make_session_store(
            settings.redis_url, settings.session_ttl_s, timeout_s=settings.store_timeout_s
        ),
        vision_cache=make_vision_cache(
            settings.redis_url, settings.vision_cache_bytes, settings.vision_cache_ttl_s
        ),
        images=make_image_store(
            settings.redis_url, settings.image_store_bytes, settings.vision_cache_ttl_s
        ),
        auth=auth,
        rate_limiter=CountingLimiter(  # then the token limits' room; each response counted
            make_rate_limiter(
                settings.rate_limit_per_minute,
                settings.redis_url,
                limit_of=(lambda o: (r := auth.limits_of(o)) and r.rpm) if auth.store else None,
            ),
            auth,
            meter,
        ),
        token_meter=meter,
        telemetry=telemetry,
        # with the session store's backend: a record names a session of that store
        responses=make_response_store(
            settings.redis_url, settings.session_ttl_s, timeout_s=settings.store_timeout_s
        ),
        # with no API keys every caller is one owner: one caller's refusals would stop everyone
        refused=RefusedBytes(settings.max_refused_body_bytes_per_minute if auth.enabled else 0),
    )
    gauges = {"sessions": 0, "queue": 0, "vision_cache": 0}
    telemetry.metrics.observe_gauges(
        active_sessions=lambda: gauges["sessions"],
        queue_depth=lambda: gauges["queue"],
        cache_bytes=lambda: {"vision": gauges["vision_cache"]},
        engine_stats=engine.stats,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        tasks = [
            asyncio.create_task(_load_models(state, encoder, cores), name="load models"),
            asyncio.create_task(_refresh_gauges(state, gauges), name="refresh gauges"),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await readiness.aclose()
            await _close(state)

    @get("/healthz", sync_to_thread=False)
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "uptime_s": round(time.time() - state.started_at, 3)}

    readiness = Readiness(state)

    @get("/readyz")
    async def readyz() -> Response[dict[str, Any]]:
        """200 once the gateway can serve, else 503 naming what is missing (readiness.py)."""
        status, body = await readiness.check()
        return Response(body, status_code=status)

    @get("/health", sync_to_thread=False)
    def health() -> Response[dict[str, Any]]:
        """As vLLM and SGLang name theirs, what a gateway in front probes: 200 while the model
        can generate (loaded, and for an upstream engine a replica up). Unlike /readyz it does
        not ask Redis or encoder workers, so a Redis outage does not take every replica out of
        a front gateway's rotation: stateless requests still work."""
        if state.load_error:
            return Response({"status": "failed"}, status_code=503)
        if not state.ready or not state.engine.ready:
            return Response({"status": "not_ready"}, status_code=503)
        return Response({"status": "ok"}, status_code=200)

    @get("/metrics", sync_to_thread=False)
    def prometheus_metrics() -> Response[bytes]:
        body, content_type = telemetry.prometheus_text()
        return Response(body, media_type=content_type)

    openapi = OpenAPIConfig(
        title="visiongate",
        version=VERSION,
        description="OpenAI-compatible chat gateway for vision-language models "
        "with session-aware vision caching.",
    )
    app = Litestar(
        route_handlers=[
            healthz,
            readyz,
            health,
            prometheus_metrics,
            realtime_route(state),
            *http_route_handlers(state),
            *admin_route_handlers(state),
        ],
        lifespan=[lifespan],
        exception_handlers={HTTPException: routing_error_handler(state)},
        request_class=BoundedRequest,  # a JSON body's values are counted before decoding
        plugins=[litestar_plugin(telemetry)],
        openapi_config=openapi,
        state=State({"gateway": state}),
        debug=False,
        logging_config=None,
    )
    # a key whose large bodies keep being refused is answered from its headers (body_guard.py)
    app.asgi_handler = BodyGuard(app.asgi_handler, state)
    # the x-ratelimit-* headers of what admission found (gateway/policy/rate_headers.py)
    app.asgi_handler = RateLimitHeaders(app.asgi_handler)
    # managed API keys are read from their store before anything above asks for an owner
    app.asgi_handler = KeyResolver(app.asgi_handler, state.auth)
    app = with_request_ids(app)  # every response, routed or not, gets its id
    # outermost: the one client address the lockout, the logs and the spans read
    app.asgi_handler = ClientAddressMiddleware(
        app.asgi_handler,
        TrustedProxies(settings.trusted_proxies, settings.trusted_proxy_header),
    )
    # outside all of them: a WebSocket's frames go straight to the server (server_send.py)
    app.asgi_handler = ServerSend(app.asgi_handler)
    return app


def _authenticator(settings: Settings, engine: Engine) -> Authenticator:
    """Static keys, and with an admin key the managed ones on the session store's backend."""
    store = make_key_store(settings.redis_url) if settings.admin_api_key else None
    return Authenticator(
        settings.api_keys,
        store,
        served_model=lambda: engine.model_id,
        client_secrets=make_client_secret_store(settings.redis_url),  # ephemeral Realtime keys
    )


async def _load_models(
    state: GatewayState, encoder: Encoder | None, cores: CoreShare | None
) -> None:
    settings, engine = state.settings, state.engine
    t0 = time.perf_counter()
    try:
        await engine.start()
        encoder = encoder or build_encoder(settings, engine, cores)
        # the in-process engine keys KV by the tokens themselves; an upstream's content ids
        # name the encoder's fingerprint, so the budget applies to the local engine only
        adaptive = settings.visual_budget_adaptive and settings.engine == "local"
        if adaptive and hasattr(encoder, "fingerprint_for"):
            from gateway.chat.visual_budget import BudgetedEncoder, VisualBudget

            cfg = encoder.config  # type: ignore[attr-defined]

            budget = VisualBudget(
                objective_ms=settings.visual_budget_ttft_ms,
                ceiling=(ceiling := max(cfg.keep_ratio, cfg.max_keep_ratio)),
                floor=min(settings.visual_budget_floor, ceiling),
                step=settings.visual_budget_step,
                window_s=settings.visual_budget_window_s,
            )
            encoder = BudgetedEncoder(encoder, budget, state.metrics)  # type: ignore[assignment]
        await encoder.start()
        vision = VisionResolver(
            encoder,
            state.vision_cache,
            state.images,
            metrics=state.metrics,
            share_across_keys=settings.share_encodes_across_keys,
            max_pending_per_key=settings.max_pending_encodes_per_key,
            tracer=state.telemetry.tracer,
        )
        service = ChatService(
            engine=engine,
            vision=vision,
            sessions=state.sessions,
            max_output_tokens_limit=settings.max_output_tokens_limit,
            telemetry=state.telemetry,
            meter=state.token_meter,
        )
        state.serving = Serving(encoder=encoder, vision=vision, service=service)
        if state.freeze_gc:
            # what is alive now (models, libraries, tables) lives as long as the process: the
            # cyclic collector's full passes skip it from here on. Without this, a request that
            # allocates many objects (a body of 160,000 tiny JSON values) pays passes over the
            # whole heap: about 8x its decoding time on this gateway's heap
            gc.collect()
            gc.freeze()
            log.info("gc.frozen", objects=gc.get_freeze_count())
        log.info(
            "ready",
            model=engine.model_id,
            encoder=encoder.fingerprint[:16],
            load_s=round(time.perf_counter() - t0, 2),
        )
    except Exception as exc:  # keep serving /healthz; /readyz says why it is not ready
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.exception("model_load_failed")
        if encoder is not None:
            with contextlib.suppress(Exception):
                await encoder.aclose()


async def _refresh_gauges(state: GatewayState, gauges: dict[str, int]) -> None:
    # the gauge callbacks run on the exporter's thread and must not await: read stores here
    while True:
        try:
            gauges["sessions"] = await state.sessions.count()
            gauges["vision_cache"] = (await state.vision_cache.stats()).bytes
            if state.serving is not None:
                gauges["queue"] = await state.serving.encoder.queue_depth()
        except Exception:
            log.warning("gauge_refresh_failed", exc_info=True)
        await asyncio.sleep(5.0)


async def _close(state: GatewayState) -> None:
    parts: list[Any] = [state.engine]
    if state.serving is not None:
        parts.insert(0, state.serving.encoder)
    for part in parts:
        try:
            await part.aclose()
        except Exception:
            log.exception("close_failed", part=type(part).__name__)
    for store in (
        state.sessions,
        state.responses,
        state.vision_cache,
        state.images,
        state.rate_limiter,
        *([state.auth.store] if state.auth.store is not None else []),
        *([state.auth.client_secrets] if state.auth.client_secrets is not None else []),
        *([state.admin_lockout] if state.admin_lockout is not None else []),
    ):
        await store.aclose()
    state.telemetry.shutdown()
