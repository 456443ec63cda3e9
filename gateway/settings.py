"""Gateway configuration: one msgspec struct,
filled from defaults, `VISIONGATE_*` variables and flags.

Every field can be set from the environment as `VISIONGATE_<FIELD>` (upper case). Values are
validated once at start; a bad value stops the gateway with a message naming the variable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import msgspec

__all__ = ("Settings", "SettingsError")

ENV_PREFIX = "VISIONGATE_"
# variables with the prefix that other parts read, not settings: `VISIONGATE_KERNELS` (kernels/)
# chooses the kernels' implementation in any process; the client tools' own (`visiongate
# client-secret` reads VISIONGATE_API_KEY, the guides export VISIONGATE_KEY, compose reads
# VISIONGATE_IMAGE, the fuzz tests VISIONGATE_FUZZ_*), so a shell that has them can still serve
NOT_SETTINGS = frozenset({"kernels", "api_key", "key", "image", "fuzz_cases", "fuzz_seed"})
# what managed (`vgk-`) and ephemeral (`ek_`) keys start with: an admin key may not
KEY_PREFIXES = ("vgk-", "ek_")
# the same rule as encoder_worker.storage.check_deployment (a deployment name enters Redis keys)
_DEPLOYMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MiB = 1024 * 1024


class SettingsError(ValueError):
    """A configuration value is missing or out of range."""


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # serving
    host: str = "127.0.0.1"
    port: int = 8000
    # TLS served directly (https:// and wss://): a PEM certificate chain and its private key,
    # both or neither; "": plain HTTP
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    log_level: str = "info"
    # proxies (addresses or CIDRs) whose X-Forwarded-For (or Forwarded) names the client, for
    # the admin lockout and the logs (gateway/server/client_address.py); empty: every client is
    # its TCP peer and no forwarding header is believed
    trusted_proxies: list[str] = []
    trusted_proxy_header: str = "x-forwarded-for"  # or "forwarded" (RFC 7239)
    # slow and idle clients (gateway/server/connection_guard.py): a request head must be in
    # within header_timeout_s; a body must come at body_min_rate bytes/s after a grace of
    # body_timeout_s; an upgrade must be accepted within ws_handshake_timeout_s; open
    # connections, and those that presented no API key, are capped
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    body_min_rate: int = 1024
    ws_handshake_timeout_s: float = 10.0
    max_connections: int = 1000
    max_unauthenticated_connections: int = 256
    api_keys: list[str] = []  # empty: no authentication, every caller is "anonymous"
    rate_limit_per_minute: int = 0  # responses per minute per API key; 0: no limit
    # input / output tokens per minute per static API key (all callers together, as one
    # owner, when no keys are set); managed keys carry their own limits; 0: no limit
    input_tokens_per_minute: int = 0
    output_tokens_per_minute: int = 0
    # responses one API key may have in flight at once, on all replicas together (past it:
    # concurrency_limited, HTTP 429); managed keys may carry their own; 0: no cap. Callers
    # on a gateway without keys have none (the engine's queue bounds them)
    max_concurrent_responses_per_key: int = 64
    # the admin API's key (/v1/admin/keys): set, it turns managed API keys on (gateway.policy)
    admin_api_key: str = ""
    # ephemeral Realtime keys (POST /v1/realtime/client_secrets): the longest lifetime a client
    # may ask for, in seconds (10..7200)
    client_secret_max_ttl_s: int = 7200
    # the playground's own key (one of api_keys, or a managed vgk- key): set, POST
    # /playground/session mints ephemeral keys with it for whoever loads the page; empty: the
    # page connects with an ephemeral key pasted into it (or with none on a keyless gateway)
    playground_api_key: str = ""
    # language model: "local" (in this process) or "openai" (streamed chat completions on
    # OpenAI-compatible upstream replicas: vLLM, SGLang, trtllm-serve, another visiongate)
    engine: str = "local"
    # with engine "openai": the replicas, each URL[#model=NAME&api_key_env=VAR]
    # (gateway.engine.upstream.endpoints); VISIONGATE_UPSTREAMS takes them comma-separated
    upstreams: list[str] = []
    upstream_model: str | None = None  # model name sent upstream; None: each replica's first
    # how images reach the upstream: data_url (the bytes, with the gateway's sha256 content id
    # in the field the engine keys its multimodal cache by) or embeds (visual tokens from this
    # gateway's encoder, which must run the upstream's own checkpoint: --model-path)
    upstream_images: str = "data_url"
    # prompt and answer positions of the upstream model; 0: what the replicas report
    # (max_model_len), else 8192
    upstream_context_tokens: int = 0
    # what one image sent as a data URL is counted as when a prompt is fitted to the upstream's
    # context (the replica's vision tower makes its tokens; models differ: ~576 for LLaVA-1.5,
    # ~1000-1300 for a 1-megapixel photo on Qwen2.5-VL)
    upstream_image_tokens: int = 1024
    # send each API key's hash as vLLM's `cache_salt`, so replicas share prefix-cache entries
    # only within a key (as the local engine does); off for servers that refuse unknown fields
    upstream_cache_salt: bool = True
    model_path: str | None = (
        None  # a local HF checkpoint dir; None: the embedded SmolLM2-135M-Instruct
    )
    cache_dir: str | None = None  # converted models; default ~/.cache/visiongate
    device: str = "auto"
    # language-model weights: auto (float32 on CPU, the exact mode: token-identical to
    # transformers, cached and uncached answers agree; bfloat16 on CUDA), float32, bfloat16,
    # float16, or int8 (int8 weights per output channel, bfloat16 activations; CPU). On a CPU, a
    # Llama (the default model) runs the non-float32 precisions in the fused step; bench.precision
    # measures their quality against float32, bench.engines their speed
    lm_dtype: str = "auto"
    max_output_tokens: int = 256  # default per response; clients may ask for less
    max_output_tokens_limit: int = 2048
    # continuous batching: sequences per step, requests waiting for a slot (past that: busy /
    # HTTP 429), tokens per step (prefill chunks beside the decodes), KV reuse by content
    engine_max_batch: int = 16
    engine_max_queue: int = 256
    # requests of one API key waiting beyond the batch's free slots (past that: busy / HTTP
    # 429), so one key cannot fill the queue; 0: automatic (a quarter of engine_max_queue, at
    # least 4; the whole queue when no api_keys are set, since every caller is then one owner)
    engine_max_queue_per_key: int = 0
    prefill_chunk_tokens: int = 256
    prefix_caching: bool = True
    # KV warm-up: once a session's new image item is encoded, the local engine prefills the
    # conversation through it as background work (lowest priority), so the question that
    # follows prefills only its own words
    kv_warmup: bool = True
    # the cores split between the in-process encoder's thread and the engine's thread, so that
    # encodes for new sessions run beside decode steps rather than stalling them; 0: automatic
    # (encoder a quarter of the cores, at least 1; engine the rest, or all with --encoder redis)
    encoder_threads: int = 0
    engine_threads: int = 0
    # vision encoder
    encoder: str = (
        "inproc"  # inproc: in this process | redis: `visiongate worker` processes via redis_url
    )
    vision_tower: str = "vit-b16-224"  # or vit-l14-336, or a local CLIP/SigLIP checkpoint dir
    pruning: str = "dynamic"  # none | random | topk | dynamic | dynamic+merge
    # adaptive visual budget (in-process encoder, pruning on): while the P95 time to first
    # token over the last visual_budget_window_s is above visual_budget_ttft_ms, new images are
    # encoded with a keep-ratio cap lowered by visual_budget_step at a time, down to
    # visual_budget_floor; it returns step by step once the P95 is back under the objective
    visual_budget_adaptive: bool = False
    visual_budget_ttft_ms: float = 2000.0
    visual_budget_floor: float = 0.1
    visual_budget_step: float = 0.1
    visual_budget_window_s: float = 30.0
    # stored form of visual tokens: int4 (group-wise) | bf16 | fp32; with pruning none and a VLM
    # checkpoint, fp32 is exact mode (the checkpoint's own image features, unchanged)
    visual_tokens: str = "int4"
    max_image_bytes: int = 20 * MiB
    max_pixels: int = 40_000_000
    max_images_per_session: int = 16
    max_text_chars: int = 65536  # per text part or instructions
    max_items_per_session: int = 512
    # text characters of a whole conversation: an HTTP request's messages, or a session's stored
    # items and instructions (refused past it with input_too_large, before any tokenizing)
    max_conversation_chars: int = 1024 * 1024
    # URL prefixes (e.g. https://images.example.com/) whose images the gateway may fetch; empty:
    # remote image URLs are refused and images come as data URLs or uploads
    image_url_allowlist: list[str] = []
    # images are private to the API key that sent them either way; true: an image two keys both
    # sent is encoded once (the second key's first use is reported and timed as its own encode);
    # false: each key's images are stored, cached and encoded apart (more encodes and memory)
    share_encodes_across_keys: bool = True
    # image encodes started and not finished, per WebSocket connection and per API key (across
    # connections and HTTP); past either, the item, request or upload is refused with
    # rate_limited (HTTP 429 with Retry-After) and nothing of it is kept; 0: no cap
    max_pending_encodes_per_connection: int = 8
    max_pending_encodes_per_key: int = 16
    # per API key: once the bodies of its requests refused as too large (HTTP 413) add up to
    # this many bytes within a minute, its bodies over 1 MiB are refused unread with
    # rate_limited (HTTP 429, Retry-After) until the minute's total falls below it; 0: off
    max_refused_body_bytes_per_minute: int = 64 * MiB
    # with encoder=redis: this replica's jobs in the shared job stream at once; more wait in the
    # gateway and enter in turn by API key (the stream itself is first in, first out)
    encoder_max_in_flight: int = 16
    # with encoder "redis": the name gateways and workers of one deployment share on a Redis
    # (its job stream and published encoder configuration); workers take `--deployment`
    encoder_deployment: str = "default"
    # sessions and caches
    session_ttl_s: int = 3600
    redis_url: str | None = None  # absent: everything in process
    # the longest one request (an HTTP request; a Realtime client event with the response it
    # starts) waits for the session store and stored responses on Redis, all its calls
    # together, each call within it; past it the request fails with busy (HTTP 503,
    # Retry-After) and its answer is not reported as completed
    store_timeout_s: float = 5.0
    vision_cache_bytes: int = 512 * MiB
    vision_cache_ttl_s: int = 86400
    image_store_bytes: int = 256 * MiB
    kv_budget_bytes: int = 256 * MiB
    kv_ttl_s: int = 3600
    # the system message of new sessions; empty: none, so the model's chat template applies its
    # own default system prompt (SmolLM2's names itself) to a conversation that has none
    default_instructions: str = ""

    def __post_init__(self) -> None:
        def need(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise SettingsError(f"{ENV_PREFIX}{field.upper()}: {why}")

        need(0 < self.port < 65536, "port", f"must be 1..65535, got {self.port}")
        need(
            bool(self.ssl_certfile) == bool(self.ssl_keyfile),
            "ssl_keyfile" if self.ssl_certfile else "ssl_certfile",
            "TLS needs both ssl_certfile and ssl_keyfile",
        )
        for name in ("ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            need(not path or os.path.isfile(path), name, f"no such file: {path!r}")
        need(
            self.log_level in ("debug", "info", "warning", "error"),
            "log_level",
            f"must be debug, info, warning or error, got {self.log_level!r}",
        )
        need(
            1 <= self.max_output_tokens <= self.max_output_tokens_limit,
            "max_output_tokens",
            f"must be 1..{self.max_output_tokens_limit}, got {self.max_output_tokens}",
        )
        need(
            _proxies_problem(self.trusted_proxies) is None,
            "trusted_proxies",
            _proxies_problem(self.trusted_proxies) or "",
        )
        need(
            self.trusted_proxy_header in ("x-forwarded-for", "forwarded"),
            "trusted_proxy_header",
            f"must be x-forwarded-for or forwarded, got {self.trusted_proxy_header!r}",
        )
        for name in ("header_timeout_s", "body_timeout_s", "ws_handshake_timeout_s"):
            need(0 < getattr(self, name) <= 3600, name, "must be in (0, 3600] seconds")
        need(self.body_min_rate >= 0, "body_min_rate", "must be >= 0 bytes a second")
        need(self.max_connections >= 1, "max_connections", "must be >= 1")
        need(
            self.max_unauthenticated_connections >= 1,
            "max_unauthenticated_connections",
            "must be >= 1 (above max_connections it is max_connections)",
        )
        need(self.rate_limit_per_minute >= 0, "rate_limit_per_minute", "must be >= 0")
        need(self.input_tokens_per_minute >= 0, "input_tokens_per_minute", "must be >= 0")
        need(self.output_tokens_per_minute >= 0, "output_tokens_per_minute", "must be >= 0")
        need(
            self.max_concurrent_responses_per_key >= 0,
            "max_concurrent_responses_per_key",
            "must be >= 0",
        )
        need(
            not self.admin_api_key or len(self.admin_api_key) >= 16,
            "admin_api_key",
            "must be empty or at least 16 characters",
        )
        need(
            not self.admin_api_key.startswith(KEY_PREFIXES),
            "admin_api_key",
            f"must not start like a managed or ephemeral key ({', '.join(KEY_PREFIXES)})",
        )
        need(
            10 <= self.client_secret_max_ttl_s <= 7200,
            "client_secret_max_ttl_s",
            f"must be 10..7200, got {self.client_secret_max_ttl_s}",
        )
        need(
            not self.playground_api_key
            or self.playground_api_key in self.api_keys
            or (self.playground_api_key.startswith("vgk-") and bool(self.admin_api_key)),
            "playground_api_key",
            "must be one of api_keys, or a managed key (vgk-...) with admin_api_key set",
        )
        need(
            self.lm_dtype in ("auto", "float32", "bfloat16", "float16", "int8"),
            "lm_dtype",
            f"must be auto, float32, bfloat16, float16 or int8, got {self.lm_dtype!r}",
        )
        need(self.engine_max_queue >= 1, "engine_max_queue", "must be >= 1")
        need(
            self.engine_max_queue_per_key >= 0,
            "engine_max_queue_per_key",
            "must be >= 0 (0: automatic)",
        )
        need(1 <= self.engine_max_batch <= 1024, "engine_max_batch", "must be 1..1024")
        need(self.encoder_threads >= 0, "encoder_threads", "must be >= 0 (0: automatic)")
        need(self.engine_threads >= 0, "engine_threads", "must be >= 0 (0: automatic)")
        need(
            self.prefill_chunk_tokens >= self.engine_max_batch,
            "prefill_chunk_tokens",
            f"must be >= engine_max_batch ({self.engine_max_batch}): each decode takes a token",
        )
        need(
            self.pruning in ("none", "random", "topk", "dynamic", "dynamic+merge"),
            "pruning",
            f"must be none, random, topk, dynamic or dynamic+merge, got {self.pruning!r}",
        )
        need(
            self.visual_tokens in ("int4", "bf16", "fp32"),
            "visual_tokens",
            f"must be int4, bf16 or fp32, got {self.visual_tokens!r}",
        )
        need(1024 <= self.max_image_bytes <= 512 * MiB, "max_image_bytes", "must be 1 KiB..512 MiB")
        need(self.max_pixels >= 64 * 64, "max_pixels", "must be >= 4096")
        need(
            all(
                p.startswith(("http://", "https://")) and p.count("/") >= 3
                for p in self.image_url_allowlist
            ),
            "image_url_allowlist",
            "entries must be URL prefixes with a host and a path, e.g. https://img.example.com/",
        )
        need(self.max_text_chars >= 1, "max_text_chars", "must be >= 1")
        need(self.max_items_per_session >= 2, "max_items_per_session", "must be >= 2")
        need(
            self.max_conversation_chars >= self.max_text_chars,
            "max_conversation_chars",
            "must be >= max_text_chars",
        )
        need(self.max_images_per_session >= 1, "max_images_per_session", "must be >= 1")
        need(
            self.max_pending_encodes_per_connection >= 0,
            "max_pending_encodes_per_connection",
            "must be >= 0 (0: no cap)",
        )
        need(
            self.max_pending_encodes_per_key >= 0,
            "max_pending_encodes_per_key",
            "must be >= 0 (0: no cap)",
        )
        need(
            self.max_refused_body_bytes_per_minute >= 0,
            "max_refused_body_bytes_per_minute",
            "must be >= 0 (0: off)",
        )
        need(self.encoder_max_in_flight >= 1, "encoder_max_in_flight", "must be >= 1")
        need(
            bool(_DEPLOYMENT_NAME.fullmatch(self.encoder_deployment)),
            "encoder_deployment",
            "use 1-64 letters, digits, '_', '.' or '-' (starting with a letter or digit)",
        )
        need(self.session_ttl_s >= 1, "session_ttl_s", "must be >= 1 second")
        need(
            0.05 <= self.store_timeout_s <= 120.0,
            "store_timeout_s",
            f"must be 0.05..120 seconds, got {self.store_timeout_s}",
        )
        need(self.vision_cache_bytes >= 0, "vision_cache_bytes", "must be >= 0")
        need(self.kv_budget_bytes >= 0, "kv_budget_bytes", "must be >= 0")
        need(0.0 < self.visual_budget_floor <= 1.0, "visual_budget_floor", "must be in (0, 1]")
        need(0.0 < self.visual_budget_step <= 1.0, "visual_budget_step", "must be in (0, 1]")
        for name in ("visual_budget_ttft_ms", "visual_budget_window_s"):
            need(getattr(self, name) > 0, name, "must be > 0")
        need(
            self.redis_url is None or _redis_url_problem(self.redis_url) is None,
            "redis_url",
            _redis_url_problem(self.redis_url) or "",
        )
        need(
            self.encoder in ("inproc", "redis")
            and (self.encoder == "inproc" or self.redis_url is not None),
            "encoder",
            f"must be inproc or redis (redis needs {ENV_PREFIX}REDIS_URL), got {self.encoder!r}",
        )
        need(
            self.engine in ("local", "openai"),
            "engine",
            f"must be local or openai, got {self.engine!r}",
        )
        if self.engine == "openai":
            problem = _upstreams_problem(self.upstreams)
            need(problem is None, "upstreams", problem or "")
        need(
            self.upstream_images in ("data_url", "embeds"),
            "upstream_images",
            f"must be data_url or embeds, got {self.upstream_images!r}",
        )
        need(
            self.upstream_images != "embeds" or self.model_path is not None,
            "upstream_images",
            "embeds needs the upstream's checkpoint as --model-path (its vision tower and "
            "projector make the embeddings)",
        )
        if self.engine == "openai" and self.upstream_images == "embeds" and self.model_path:
            from gateway.engine.upstream.embeds_mode import embeds_problem

            problem = embeds_problem(self.model_path, self.pruning)
            need(problem is None, "pruning", problem or "")
        need(self.upstream_context_tokens >= 0, "upstream_context_tokens", "must be >= 0")
        need(self.upstream_image_tokens >= 0, "upstream_image_tokens", "must be >= 0")
        need(
            self.model_path is None or os.path.isdir(self.model_path),
            "model_path",
            f"{self.model_path!r} is not a directory",
        )

    @property
    def ws_max_frame_bytes(self) -> int:
        """Largest WebSocket frame accepted: one base64 image at the byte limit, plus headroom,
        so an oversized image still gets a proper `image_too_large` error instead of a dropped
        connection."""
        return self.max_image_bytes * 4 // 3 + 4 * MiB

    @classmethod
    def load(
        cls, overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> Settings:
        """Defaults < `VISIONGATE_*` environment < explicit overrides (e.g. CLI flags)."""
        environ = os.environ if environ is None else environ
        raw: dict[str, Any] = {}
        fields = {f.name: f for f in msgspec.structs.fields(cls)}
        for key, value in environ.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX) :].lower()
            if name in NOT_SETTINGS:
                continue
            if name not in fields:
                raise SettingsError(
                    f"{key}: unknown setting (known: "
                    f"{', '.join(ENV_PREFIX + n.upper() for n in sorted(fields))})"
                )
            raw[name] = _parse_env(name, value, fields[name].type)
        raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
        try:
            return msgspec.convert(raw, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise SettingsError(_explain(exc)) from None


def _parse_env(name: str, value: str, annotation: Any) -> Any:
    if value == "" and "None" in str(annotation):
        return None
    if "list" in str(annotation):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value  # msgspec.convert(strict=False) turns "8000" into 8000 and checks the type


def _explain(exc: msgspec.ValidationError) -> str:
    # "Expected `int`, got `str` - at `$.port`" -> name the environment variable
    text = str(exc)
    if "$." in text:
        field = text.rsplit("$.", 1)[1].rstrip("`").split("[")[0]
        return f"{ENV_PREFIX}{field.upper()}: {text.split(' - at ')[0]}"
    return text


def _redis_url_problem(url: str | None) -> str | None:
    """What is wrong with a Redis setting (one node or a cluster), or None."""
    if url is None:
        return None
    from gateway.caching.redis_connections import parse_redis_url

    try:
        parse_redis_url(url)
    except ValueError as exc:
        return str(exc)
    return None


def _proxies_problem(entries: list[str]) -> str | None:
    """What is wrong with the trusted proxies, or None."""
    from gateway.server.client_address import parse_networks

    try:
        parse_networks(entries)
    except ValueError as exc:
        return str(exc)
    return None


def _upstreams_problem(upstreams: list[str]) -> str | None:
    """What is wrong with the upstream list of engine "openai", or None."""
    from gateway.engine.upstream.endpoints import parse_upstreams

    try:
        parse_upstreams(upstreams)
    except ValueError as exc:
        return str(exc)
    return None
