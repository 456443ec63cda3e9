"""Gateway configuration: one msgspec struct whose fields are each declared once.

A field reads `name: Annotated[type, Doc(...), Flag(...) | NoFlag(...), Range(...), Unit(...),
Check(...)] = default`. Its type is what a value is converted to (`Literal[...]` for a choice);
the metadata say the rest. Everything else is derived from those declarations
(`declarations()`), never written again:

- the environment variable of every field, `VISIONGATE_<NAME>` (read by `Settings.load`);
- the checks of one value at start: its type and choice (msgspec), its `Range` and its
  `Check`, each refusal naming the variable;
- the settings flags of `visiongate serve` and `visiongate demo` (gateway/cli/main.py);
- docs/configuration.md (docs/generate.py).

Checks that join several fields (a configuration that cannot work) are explicit code in
`Settings.__post_init__`. Flags override the environment, which overrides the defaults.
"""

from __future__ import annotations

import functools
import os
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

__all__ = (
    "Check",
    "Declared",
    "Doc",
    "Flag",
    "NoFlag",
    "Range",
    "Settings",
    "SettingsError",
    "Unit",
    "declarations",
)

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
KiB = 1024
MiB = 1024 * 1024


class SettingsError(ValueError):
    """A configuration value is missing or out of range."""


# ---- the declaration vocabulary: what `Annotated[...]` of a field may carry ----


@dataclass(frozen=True, slots=True)
class Doc:
    """The group and the meaning (Markdown, one table cell) of a setting on the configuration
    page."""

    group: str
    text: str


@dataclass(frozen=True, slots=True)
class Flag:
    """The setting's flag of `visiongate serve` (and `demo`) with its help, where `{default}`
    stands for the declared default; `name` where it is not `--<field-name>`. The type decides
    how it parses: an int or float is converted, a bool is `--x` / `--no-x`, a list is
    repeatable."""

    help: str
    name: str = ""


@dataclass(frozen=True, slots=True)
class NoFlag:
    """Why a setting has no flag: it is set in the environment only."""

    why: str


@dataclass(frozen=True, slots=True)
class Range:
    """Bounds of a number, checked at start; `note` says what a special value means."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    note: str = ""

    def holds(self, value: float) -> bool:
        # each bound asked positively, so that NaN holds none
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
        )

    def text(self, unit: str = "", *, note: bool = True) -> str:
        """`1..65535`, `in (0, 1] seconds`, `>= 0 (0: no cap)`: what follows `must be` in a
        refusal, and the bounds on the configuration page."""

        def amount(value: float) -> str:
            return _amount(value, unit)

        if self.le is not None and self.ge is not None:
            text = f"{amount(self.ge)}..{amount(self.le)}"
        elif self.le is not None and self.gt is not None:
            text = f"in ({amount(self.gt)}, {amount(self.le)}]"
        elif self.le is not None:
            text = f"<= {amount(self.le)}"
        elif self.ge is not None:
            text = f">= {amount(self.ge)}"
        else:
            text = f"> {amount(self.gt if self.gt is not None else 0)}"
        last = self.le if self.le is not None else self.ge if self.ge is not None else self.gt
        text += _unit_after(last, unit)
        return f"{text} ({self.note})" if note and self.note else text


@dataclass(frozen=True, slots=True)
class Unit:
    """What a number counts (`seconds`, `bytes`, ...), shown on the page and in refusals."""

    name: str


@dataclass(frozen=True, slots=True)
class Check:
    """A check of the value alone, run at start: what is wrong with it, or None."""

    problem: Callable[[Any], str | None]


def _amount(value: float | None, unit: str) -> str:
    if unit == "bytes" and value:
        for size, name in ((MiB, "MiB"), (KiB, "KiB")):
            if value >= size and value % size == 0:
                return f"{int(value) // size} {name}"
    return str(value) if isinstance(value, int) else f"{value:g}"


def _unit_after(value: float | None, unit: str) -> str:
    if not unit:
        return ""
    if unit == "bytes" and value and value >= KiB:
        return ""  # each amount says it: 1 KiB..512 MiB
    return f" {unit[:-1] if value == 1 and unit.endswith('s') else unit}"


# why the settings without a flag have none
SECRET = "a secret: on a command line it would show in the process list"
ENV_ONLY = "set once per deployment, in the environment: flags are for what a run changes"

# the groups of the configuration page, in its order
SERVING = "Serving"
CLIENTS = "Client addresses and slow clients"
ENGINE = "Language model and engine"
UPSTREAM = "Upstream replicas (`ENGINE=openai`)"
ENCODER = "Vision encoder"
LIMITS = "Input limits"
SESSIONS = "Sessions and caches"


# ---- checks of one value (`Check`) ----


def _file_problem(path: str) -> str | None:
    return f"no such file: {path!r}" if path and not os.path.isfile(path) else None


def _directory_problem(path: str | None) -> str | None:
    return f"{path!r} is not a directory" if path is not None and not os.path.isdir(path) else None


def _admin_key_problem(key: str) -> str | None:
    if key and len(key) < 16:
        return "must be empty or at least 16 characters"
    if key.startswith(KEY_PREFIXES):
        return f"must not start like a managed or ephemeral key ({', '.join(KEY_PREFIXES)})"
    return None


def _allowlist_problem(prefixes: list[str]) -> str | None:
    if all(p.startswith(("http://", "https://")) and p.count("/") >= 3 for p in prefixes):
        return None
    return "entries must be URL prefixes with a host and a path, e.g. https://img.example.com/"


def _deployment_problem(name: str) -> str | None:
    if _DEPLOYMENT_NAME.fullmatch(name):
        return None
    return "use 1-64 letters, digits, '_', '.' or '-' (starting with a letter or digit)"


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


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: Annotated[
        str,
        Doc(SERVING, "address to listen on"),
        Flag("bind address (default {default})"),
    ] = "127.0.0.1"
    port: Annotated[
        int,
        Doc(SERVING, "port to listen on"),
        Flag("port (default {default})"),
        Range(ge=1, le=65535),
    ] = 8000
    ssl_certfile: Annotated[
        str,
        Doc(
            SERVING,
            "serve TLS (`https://`, `wss://`) with this PEM certificate chain; needs "
            "`SSL_KEYFILE` (both or neither); empty: plain HTTP",
        ),
        Flag("serve TLS (https, wss) with this PEM certificate chain"),
        Check(_file_problem),
    ] = ""
    ssl_keyfile: Annotated[
        str,
        Doc(SERVING, "the PEM private key of `SSL_CERTFILE`"),
        Flag("the PEM private key of --ssl-certfile"),
        Check(_file_problem),
    ] = ""
    log_level: Annotated[
        Literal["debug", "info", "warning", "error"],
        Doc(
            SERVING,
            "structlog level: `debug`, `info`, `warning` or `error` (JSON lines, console renderer "
            "on a TTY)",
        ),
        Flag("debug | info | warning | error"),
    ] = "info"
    api_keys: Annotated[
        list[str],
        Doc(
            SERVING,
            "comma-separated keys; empty means no authentication (owner `anonymous`). A key "
            "travels in `Authorization: Bearer <key>`, or, from a browser WebSocket, as the "
            "offered subprotocol `openai-insecure-api-key.<key>` beside `realtime` (the "
            "connection is accepted with `realtime`, never the key); `?api_key=` is refused "
            "(close 1008), and keys are scrubbed from every log line. Session ids are per key: "
            "two keys may both use `my-chat`, and neither can tell whether the other's exists.",
        ),
        NoFlag(SECRET),
    ] = []
    rate_limit_per_minute: Annotated[
        int,
        Doc(
            SERVING,
            "responses per minute per key (`rate_limited`, HTTP 429), shared across replicas "
            "through Redis; `0`: off",
        ),
        NoFlag(ENV_ONLY),
        Range(ge=0, note="0: no limit"),
    ] = 0
    input_tokens_per_minute: Annotated[
        int,
        Doc(
            SERVING,
            "input tokens per minute per static key (`API_KEYS`; with none set, all callers "
            "together), counted as for managed keys (an estimate at admission, corrected at the "
            "end; see the token limits guide) and shared across replicas through Redis; managed "
            "keys carry their own `input_tpm`; `0`: off",
        ),
        NoFlag(ENV_ONLY),
        Range(ge=0, note="0: no limit"),
    ] = 0
    output_tokens_per_minute: Annotated[
        int,
        Doc(
            SERVING,
            "output tokens per minute per static key (with no keys set, all callers together): "
            "each response reserves its `max_tokens` x `n` (else the most the gateway lets it "
            "write) at admission and gives back what it did not write when it ends; managed keys "
            "carry their own `output_tpm`; `0`: off",
        ),
        NoFlag(ENV_ONLY),
        Range(ge=0, note="0: no limit"),
    ] = 0
    # callers of a gateway without keys have no such cap: the engine's queue bounds them
    max_concurrent_responses_per_key: Annotated[
        int,
        Doc(
            SERVING,
            "responses one API key (static or managed) may have in flight at once, on all "
            "replicas together through Redis (`concurrency_limited`, HTTP 429 with "
            "`Retry-After`); a managed key's `max_concurrent` overrides it; callers of a gateway "
            "without keys have no cap; `0`: off",
        ),
        NoFlag(ENV_ONLY),
        Range(ge=0, note="0: no cap"),
    ] = 64
    admin_api_key: Annotated[
        str,
        Doc(
            SERVING,
            "the key of the admin API (`/v1/admin/keys`, `visiongate keys`); set (16 characters "
            "or more, the same on every replica, not starting with `vgk-` or `ek_`), it turns on "
            "managed API keys, kept hashed in the session store's backend, beside `API_KEYS`; "
            "empty: no admin API, static keys only",
        ),
        NoFlag(SECRET),
        Check(_admin_key_problem),
    ] = ""
    client_secret_max_ttl_s: Annotated[
        int,
        Doc(
            SERVING,
            "the longest lifetime a client may ask for an ephemeral Realtime key "
            "(`POST /v1/realtime/client_secrets`, `expires_after.seconds`; default 60 s); see "
            "[API keys](guides/api-keys.md#ephemeral-realtime-keys)",
        ),
        NoFlag(ENV_ONLY),
        Range(ge=10, le=7200),
        Unit("seconds"),
    ] = 7200
    playground_api_key: Annotated[
        str,
        Doc(
            SERVING,
            "the playground's own key, one of `API_KEYS` or a managed `vgk-` key: set, the page "
            "at `/` asks `POST /playground/session` for an ephemeral key minted with it, so "
            "whoever reaches the page may chat within that key's limits and models; empty: the "
            "page takes a pasted ephemeral key (or none on a gateway without keys). See [API "
            "keys](guides/api-keys.md#the-playground)",
        ),
        NoFlag(SECRET),
    ] = ""
    default_instructions: Annotated[
        str,
        Doc(
            SERVING,
            "system message of new sessions; empty: none, so the model's chat template applies "
            "its own default system prompt",
        ),
        NoFlag(ENV_ONLY),
    ] = ""
    # read by gateway/server/client_address.py
    trusted_proxies: Annotated[
        list[str],
        Doc(
            CLIENTS,
            "comma-separated addresses and CIDRs of the proxies in front of the gateway; from "
            "those peers only, the client address (for the admin lockout, the log lines' "
            "`client`, the spans) is the rightmost hop of `TRUSTED_PROXY_HEADER` that is not "
            "itself a trusted proxy; empty: the TCP peer is the client and no forwarding header "
            "is read. A `/0` is refused. See "
            "[Scale-out](guides/scale-out.md#behind-a-proxy-client-addresses)",
        ),
        NoFlag(ENV_ONLY),
        Check(_proxies_problem),
    ] = []
    trusted_proxy_header: Annotated[
        Literal["x-forwarded-for", "forwarded"],
        Doc(
            CLIENTS,
            "the header trusted proxies name the client in: `x-forwarded-for` or `forwarded` (RFC "
            "7239 `for=`)",
        ),
        NoFlag(ENV_ONLY),
    ] = "x-forwarded-for"
    # enforced by gateway/server/connection_guard.py, as are the connection caps below
    header_timeout_s: Annotated[
        float,
        Doc(
            CLIENTS,
            "seconds a request head (request line and headers) may take, from the connection's "
            "opening or its previous response; past it, 408 (or a plain close when nothing came) "
            'and `visiongate_connections_refused_total{reason="header_timeout"}`',
        ),
        NoFlag(ENV_ONLY),
        Range(gt=0, le=3600),
        Unit("seconds"),
    ] = 10.0
    body_timeout_s: Annotated[
        float,
        Doc(
            CLIENTS,
            "grace, in seconds, before a request body must have come at `BODY_MIN_RATE` on "
            'average; past it, 408 and close (`reason="body_timeout"`)',
        ),
        NoFlag(ENV_ONLY),
        Range(gt=0, le=3600),
        Unit("seconds"),
    ] = 10.0
    body_min_rate: Annotated[
        int,
        Doc(
            CLIENTS,
            "bytes a second a request body must average after `BODY_TIMEOUT_S` (time the gateway "
            "itself stopped reading does not count); `0`: a body may take as long as it likes",
        ),
        NoFlag(ENV_ONLY),
        Range(ge=0),
        Unit("bytes a second"),
    ] = 1024
    ws_handshake_timeout_s: Annotated[
        float,
        Doc(
            CLIENTS,
            "seconds a WebSocket upgrade may wait to be accepted or refused; past it, 503 "
            '(`reason="ws_handshake_timeout"`)',
        ),
        NoFlag(ENV_ONLY),
        Range(gt=0, le=3600),
        Unit("seconds"),
    ] = 10.0
    max_connections: Annotated[
        int,
        Doc(
            CLIENTS,
            "open connections (HTTP and WebSocket) per process; a new one past it replaces a "
            "connection still sending (the oldest sending a head or a body without a key, else "
            "one whose request was already answered, else the slowest body), else is refused with "
            '503 (`reason="max_connections"`); the process\'s open-files limit is raised to fit '
            "it, or the gateway refuses to start",
        ),
        NoFlag(ENV_ONLY),
        Range(ge=1),
    ] = 1000
    max_unauthenticated_connections: Annotated[
        int,
        Doc(
            CLIENTS,
            "connections that sent no head yet or whose latest head carried no API key (on a "
            "gateway with keys); a new one past it replaces the oldest of them still sending its "
            "head or body that has had 2 s to send it "
            '(`reason="max_unauthenticated_connections"`); when all are younger it is let in '
            "beyond this cap, up to `MAX_CONNECTIONS`",
        ),
        NoFlag(ENV_ONLY),
        Range(ge=1, note="above max_connections it is max_connections"),
    ] = 256
    engine: Annotated[
        Literal["local", "openai"],
        Doc(
            ENGINE,
            "`local`: the model runs in this process; `openai`: generate on OpenAI-compatible "
            "replicas (see [Upstream engines](guides/upstream-engines.md))",
        ),
        Flag(
            "local (default: the model runs in this process) | openai: generate on "
            "OpenAI-compatible replicas (--upstream)"
        ),
    ] = "local"
    model_path: Annotated[
        str | None,
        Doc(
            ENGINE,
            "a local HF checkpoint directory: a causal LM, or a LLaVA / SmolVLM (Idefics3) / "
            "Qwen2.5-VL checkpoint served split (its vision side in the encoder; see [Real VLM "
            "checkpoints](guides/vlm-checkpoints.md)); unset: the embedded SmolLM2-135M-Instruct",
        ),
        Flag(
            "local HF checkpoint dir (default: embedded SmolLM2-135M-Instruct); a LLaVA, "
            "SmolVLM/Idefics3 or Qwen2.5-VL checkpoint is also the vision encoder"
        ),
        Check(_directory_problem),
    ] = None
    cache_dir: Annotated[
        str | None,
        Doc(ENGINE, "where converted models are kept; unset: `~/.cache/visiongate`"),
        Flag("where converted models are kept (default ~/.cache/visiongate)"),
    ] = None
    device: Annotated[
        str,
        Doc(ENGINE, "`cpu`, `cuda` or `auto`"),
        Flag("auto | cpu | cuda"),
    ] = "auto"
    # bench.precision measures the precisions' quality against float32, bench.engines their speed
    lm_dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16", "int8"],
        Doc(
            ENGINE,
            "language-model weights: `auto` is, on a CPU, float16 for a Llama (the default "
            "model: float16 weights multiplied in float32 by fbgemm's kernel in the [fused step]"
            "(benchmarks/engines.md), perplexity within 0.01% of float32's, "
            "[quality table](benchmarks/engines.md#quality)) and float32 for other models; "
            "bfloat16 on CUDA. `float32` is the exact mode (token-identical to transformers, "
            "cached and uncached answers agree); `bfloat16` or `int8` (int8 weights with one "
            "scale per output channel, bfloat16 activations; CPU only) trade a little more "
            "fidelity, perplexity within 1% of float32's",
        ),
        Flag("auto | float32 (exact) | bfloat16 | float16 | int8"),
    ] = "auto"
    max_output_tokens: Annotated[
        int,
        Doc(ENGINE, "default per response (1..`MAX_OUTPUT_TOKENS_LIMIT`)"),
        NoFlag(ENV_ONLY),
    ] = 256
    max_output_tokens_limit: Annotated[
        int,
        Doc(ENGINE, "most a client may ask for"),
        NoFlag(ENV_ONLY),
    ] = 2048
    engine_max_batch: Annotated[
        int,
        Doc(ENGINE, "sequences batched per step (1: one generation at a time)"),
        Flag("sequences batched per step (default {default}; 1: one generation at a time)"),
        Range(ge=1, le=1024),
    ] = 16
    engine_max_queue: Annotated[
        int,
        Doc(
            ENGINE,
            "responses waiting for a batch slot; past it, `busy` (HTTP 429 with `Retry-After`)",
        ),
        Flag("requests waiting for a batch slot before `busy` / HTTP 429 (default {default})"),
        Range(ge=1),
    ] = 256
    engine_max_queue_per_key: Annotated[
        int,
        Doc(
            ENGINE,
            "responses one API key may have waiting; `0`: a quarter of `ENGINE_MAX_QUEUE` (at "
            "least 4), or the whole queue when no API keys are set",
        ),
        Flag("of those, requests of one API key (default {default}: a quarter, at least 4)"),
        Range(ge=0, note="0: automatic"),
    ] = 0
    prefill_chunk_tokens: Annotated[
        int,
        Doc(
            ENGINE,
            "tokens per engine step: one per decoding sequence, the rest prefill chunks (at least "
            "`ENGINE_MAX_BATCH`)",
        ),
        Flag("tokens per step: decodes plus prefill chunks (default {default})"),
    ] = 256
    prefix_caching: Annotated[
        bool,
        Doc(ENGINE, "reuse KV blocks by content across requests of one API key"),
        Flag("reuse KV blocks by content across requests of one API key (default {default})"),
    ] = True
    # the warm-up is background work of the lowest priority
    kv_warmup: Annotated[
        bool,
        Doc(
            ENGINE,
            "prefill a session's conversation through a newly encoded photo while its question is "
            "typed (see [KV warm-up](design/caching.md#kv-warm-up))",
        ),
        NoFlag(ENV_ONLY),
    ] = True
    kv_budget_bytes: Annotated[
        int,
        Doc(ENGINE, "KV memory of the engine: running sequences and cached blocks together"),
        Flag("KV blocks kept across turns, all sessions"),
        Range(ge=0),
        Unit("bytes"),
    ] = 256 * MiB
    # split so that encodes for new sessions run beside decode steps rather than stalling them
    encoder_threads: Annotated[
        int,
        Doc(
            ENGINE,
            "intra-op threads of the in-process encoder's thread; `0`: a quarter of the cores, at "
            "least 1",
        ),
        NoFlag(ENV_ONLY),
        Range(ge=0, note="0: automatic"),
    ] = 0
    engine_threads: Annotated[
        int,
        Doc(
            ENGINE,
            "intra-op threads of the engine's thread; `0`: every core while no image is being "
            "encoded in-process, the cores the encoder does not take while one is (all of them "
            "with `ENCODER=redis`)",
        ),
        NoFlag(ENV_ONLY),
        Range(ge=0, note="0: automatic"),
    ] = 0
    # parsed by gateway.engine.upstream.endpoints
    upstreams: Annotated[
        list[str],
        Doc(
            UPSTREAM,
            "comma-separated replicas, each `URL[#model=NAME&api_key_env=VAR]` (the flag is "
            "repeatable)",
        ),
        Flag(
            "with --engine openai: replica URL[,URL...], each URL[#model=NAME&api_key_env=VAR] "
            "(repeatable)",
            name="--upstream",
        ),
    ] = []
    upstream_model: Annotated[
        str | None,
        Doc(UPSTREAM, "model name sent upstream; unset: each replica's first `/v1/models` entry"),
        Flag("model name sent upstream (default: each replica's)"),
    ] = None
    upstream_images: Annotated[
        Literal["data_url", "embeds"],
        Doc(
            UPSTREAM,
            "`data_url`: image bytes plus the gateway's content id; `embeds`: visual tokens from "
            "this gateway's encoder (needs `MODEL_PATH`, the upstream's checkpoint)",
        ),
        Flag(
            "data_url (default: bytes plus content id) | embeds (pre-encoded by this gateway with "
            "--model-path, for vLLM --enable-mm-embeds)"
        ),
    ] = "data_url"
    upstream_context_tokens: Annotated[
        int,
        Doc(
            UPSTREAM,
            "the upstream model's context; `0`: what the replicas report (`max_model_len`), else "
            "8192",
        ),
        Flag("the upstream model's context (default: what the replicas report, else 8192)"),
        Range(ge=0, note="0: what the replicas report"),
    ] = 0
    upstream_image_tokens: Annotated[
        int,
        Doc(
            UPSTREAM,
            "what an image sent as a data URL counts as when a prompt is fitted to the upstream's "
            "context (the replica's vision tower makes its tokens, and models differ: about 576 "
            "for LLaVA-1.5, 1000-1300 for a 1-megapixel photo on Qwen2.5-VL)",
        ),
        NoFlag(ENV_ONLY),
        Range(ge=0),
    ] = 1024
    upstream_cache_salt: Annotated[
        bool,
        Doc(
            UPSTREAM,
            "send each API key's hash as vLLM's `cache_salt`, so a replica's prefix cache is "
            "shared within a key only; `false` for servers that refuse unknown fields",
        ),
        NoFlag(ENV_ONLY),
    ] = True
    encoder: Annotated[
        Literal["inproc", "redis"],
        Doc(
            ENCODER,
            "`inproc`: images are encoded in this process; `redis`: by `visiongate worker` "
            "processes through Redis Streams (needs `REDIS_URL`; see "
            "[Scale-out](guides/scale-out.md))",
        ),
        Flag("inproc (default) | redis: encode in `visiongate worker` processes"),
    ] = "inproc"
    encoder_max_in_flight: Annotated[
        int,
        Doc(
            ENCODER,
            "with `ENCODER=redis`: this replica's jobs in the shared job stream at once; more "
            "wait in the gateway and enter in turn by API key (the stream itself is first in, "
            "first out)",
        ),
        NoFlag(ENV_ONLY),
        Range(ge=1),
    ] = 16
    encoder_deployment: Annotated[
        str,
        Doc(
            ENCODER,
            "with `ENCODER=redis`: the deployment name gateways and workers share on one Redis "
            "(its job stream and published encoder configuration; workers take `--deployment`): "
            "1-64 letters, digits, `_`, `.` or `-`",
        ),
        NoFlag(ENV_ONLY),
        Check(_deployment_problem),
    ] = "default"
    vision_tower: Annotated[
        str,
        Doc(
            ENCODER,
            "`vit-b16-224`, `vit-l14-336`, or a local CLIP/SigLIP checkpoint dir (ignored when "
            "`MODEL_PATH` is a VLM checkpoint)",
        ),
        Flag("vit-b16-224 | vit-l14-336 | local CLIP/SigLIP checkpoint dir"),
    ] = "vit-b16-224"
    pruning: Annotated[
        Literal["none", "random", "topk", "dynamic", "dynamic+merge"],
        Doc(
            ENCODER,
            "which patch tokens the language model sees: `none` every one; `random` a fixed "
            "share, at random (a baseline); `topk` the most salient of a fixed share; `dynamic` "
            "as many as hold most of the saliency (few for a photo whose attention sits on a few "
            "patches); `dynamic+merge` as `dynamic`, with the dropped tokens summarized into a "
            "few contextual ones",
        ),
        Flag("none | random | topk | dynamic | dynamic+merge"),
    ] = "dynamic"
    visual_tokens: Annotated[
        Literal["int4", "bf16", "fp32"],
        Doc(
            ENCODER,
            "how visual tokens are stored: `int4`, `bf16`, `fp32` (`fp32` with `PRUNING=none` and "
            "a VLM checkpoint is exact mode)",
        ),
        Flag(
            "int4 (default) | bf16 | fp32: stored form of visual tokens (fp32 with --pruning "
            "none: exact, for VLM checkpoints)"
        ),
    ] = "int4"
    # gateway/chat/visual_budget.py: while the P95 TTFT over the window is above the objective,
    # new images are encoded with a keep-ratio cap lowered a step at a time, down to the floor;
    # it returns step by step once the P95 is back under the objective
    visual_budget_adaptive: Annotated[
        bool,
        Doc(
            ENCODER,
            "lower the keep-ratio cap of new images while the P95 TTFT burns (in-process encoder "
            "and engine; see [Adaptive visual budget](design/caching.md#adaptive-visual-budget))",
        ),
        NoFlag(ENV_ONLY),
    ] = False
    visual_budget_ttft_ms: Annotated[
        float,
        Doc(ENCODER, "the P95 time to first token the adaptive budget holds"),
        NoFlag(ENV_ONLY),
        Range(gt=0),
        Unit("milliseconds"),
    ] = 2000.0
    visual_budget_window_s: Annotated[
        float,
        Doc(ENCODER, "the window the adaptive budget's P95 is taken over"),
        NoFlag(ENV_ONLY),
        Range(gt=0),
        Unit("seconds"),
    ] = 30.0
    visual_budget_step: Annotated[
        float,
        Doc(ENCODER, "how far the keep-ratio cap moves at a time"),
        NoFlag(ENV_ONLY),
        Range(gt=0.0, le=1.0),
    ] = 0.1
    visual_budget_floor: Annotated[
        float,
        Doc(ENCODER, "the lowest keep-ratio cap"),
        NoFlag(ENV_ONLY),
        Range(gt=0.0, le=1.0),
    ] = 0.1
    max_image_bytes: Annotated[
        int,
        Doc(LIMITS, "per image"),
        NoFlag(ENV_ONLY),
        Range(ge=1 * KiB, le=512 * MiB),
        Unit("bytes"),
    ] = 20 * MiB
    max_pixels: Annotated[
        int,
        Doc(LIMITS, "per image (decompression-bomb guard)"),
        NoFlag(ENV_ONLY),
        Range(ge=64 * 64),
    ] = 40_000_000
    max_images_per_session: Annotated[
        int,
        Doc(LIMITS, "images of one session"),
        NoFlag(ENV_ONLY),
        Range(ge=1),
    ] = 16
    max_text_chars: Annotated[
        int,
        Doc(LIMITS, "per text part or instructions (`input_too_large`)"),
        NoFlag(ENV_ONLY),
        Range(ge=1),
    ] = 65536
    max_items_per_session: Annotated[
        int,
        Doc(LIMITS, "items of a conversation (`input_too_large`)"),
        NoFlag(ENV_ONLY),
        Range(ge=2),
    ] = 512
    max_conversation_chars: Annotated[
        int,
        Doc(
            LIMITS,
            "text characters of a conversation: an HTTP request's messages or a session's items "
            "(`input_too_large`)",
        ),
        NoFlag(ENV_ONLY),
    ] = 1024 * 1024
    image_url_allowlist: Annotated[
        list[str],
        Doc(
            LIMITS,
            "comma-separated URL prefixes the gateway may fetch images from (no redirects "
            "followed); empty: remote image URLs are refused",
        ),
        NoFlag(ENV_ONLY),
        Check(_allowlist_problem),
    ] = []
    # images are private to the API key that sent them either way
    share_encodes_across_keys: Annotated[
        bool,
        Doc(
            LIMITS,
            "encode bytes that several API keys sent once (each key still sees only its own "
            "images, and its first use reads and takes as long as an encode); `false`: each key's "
            "images are stored, cached and encoded apart (more encodes and memory)",
        ),
        Flag(
            "encode an image two API keys both sent once (default {default}; images stay "
            "private to each key either way)"
        ),
    ] = True
    max_pending_encodes_per_connection: Annotated[
        int,
        Doc(
            LIMITS,
            "image encodes a WebSocket connection may have running; past it, `rate_limited` (HTTP "
            "429 with `Retry-After`) and nothing is kept; `0`: no cap",
        ),
        Flag(
            "image encodes one WebSocket may have running before `rate_limited` (default {default})"
        ),
        Range(ge=0, note="0: no cap"),
    ] = 8
    max_pending_encodes_per_key: Annotated[
        int,
        Doc(
            LIMITS,
            "image encodes an API key may have running across connections and HTTP; past it, "
            "`rate_limited` and nothing is kept; `0`: no cap",
        ),
        Flag(
            "image encodes one API key may have running before `rate_limited` (default {default})"
        ),
        Range(ge=0, note="0: no cap"),
    ] = 16
    max_refused_body_bytes_per_minute: Annotated[
        int,
        Doc(
            LIMITS,
            "per API key: bytes of refused requests (4xx but 401, 429) over the last minute past "
            "which its bodies and frames over 1 MiB are answered `rate_limited` (HTTP 429 with "
            "`Retry-After`) unread; `0`: off (also off with no API keys; see "
            "[Hardening](design/hardening.md#keys-that-keep-sending-what-is-refused))",
        ),
        NoFlag(ENV_ONLY),
        Range(ge=0, note="0: off"),
        Unit("bytes"),
    ] = 64 * MiB
    redis_url: Annotated[
        str | None,
        Doc(
            SESSIONS,
            "sessions, vision cache and KV spill in Redis (`redis://host:port/db`, or "
            "`redis+cluster://host:port[,host:port...]` for a [Redis "
            "Cluster](guides/redis-cluster.md)); unset: all in process",
        ),
        Flag(
            "redis://host:port/db (or redis+cluster://host:port[,host:port...] for a Redis "
            "Cluster) for sessions, caches, KV spill and encoder jobs; absent: everything in "
            "process"
        ),
        Check(_redis_url_problem),
    ] = None
    session_ttl_s: Annotated[
        int,
        Doc(SESSIONS, "idle seconds before a session is dropped"),
        Flag("idle seconds before a session is dropped"),
        Range(ge=1),
        Unit("seconds"),
    ] = 3600
    store_timeout_s: Annotated[
        float,
        Doc(
            SESSIONS,
            "the longest one request (an HTTP request; a Realtime client event with the response "
            "it starts) waits for Redis under its sessions and stored responses, all its calls "
            "together, each call within it; past it the request fails with `busy` (503, "
            "`Retry-After`), and an answer not yet stored is reported as failed, never as "
            "completed",
        ),
        NoFlag(ENV_ONLY),
        Range(ge=0.05, le=120.0),
        Unit("seconds"),
    ] = 5.0
    vision_cache_bytes: Annotated[
        int,
        Doc(SESSIONS, "budget of the in-process tier of the vision cache"),
        Flag("in-process vision cache budget"),
        Range(ge=0),
        Unit("bytes"),
    ] = 512 * MiB
    vision_cache_ttl_s: Annotated[
        int,
        Doc(SESSIONS, "TTL of visual tokens in Redis"),
        Flag("TTL of visual tokens in Redis"),
        Unit("seconds"),
    ] = 86400
    image_store_bytes: Annotated[
        int,
        Doc(SESSIONS, "original image bytes kept for references and re-encodes"),
        NoFlag(ENV_ONLY),
        Unit("bytes"),
    ] = 256 * MiB
    kv_ttl_s: Annotated[
        int,
        Doc(SESSIONS, "TTL of sessions' KV in Redis"),
        Flag("TTL of KV blocks spilled to Redis"),
        Unit("seconds"),
    ] = 3600

    def __post_init__(self) -> None:
        for declared in declarations():
            problem = declared.problem(getattr(self, declared.name))
            if problem is not None:
                raise SettingsError(f"{declared.env}: {problem}")
        self._check_together()

    def _check_together(self) -> None:
        """The checks that join several settings: a configuration that cannot work."""

        def need(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise SettingsError(f"{ENV_PREFIX}{field.upper()}: {why}")

        need(
            bool(self.ssl_certfile) == bool(self.ssl_keyfile),
            "ssl_keyfile" if self.ssl_certfile else "ssl_certfile",
            "TLS needs both ssl_certfile and ssl_keyfile",
        )
        need(
            1 <= self.max_output_tokens <= self.max_output_tokens_limit,
            "max_output_tokens",
            f"must be 1..{self.max_output_tokens_limit}, got {self.max_output_tokens}",
        )
        need(
            not self.playground_api_key
            or self.playground_api_key in self.api_keys
            or (self.playground_api_key.startswith("vgk-") and bool(self.admin_api_key)),
            "playground_api_key",
            "must be one of api_keys, or a managed key (vgk-...) with admin_api_key set",
        )
        need(
            self.prefill_chunk_tokens >= self.engine_max_batch,
            "prefill_chunk_tokens",
            f"must be >= engine_max_batch ({self.engine_max_batch}): each decode takes a token",
        )
        need(
            self.max_conversation_chars >= self.max_text_chars,
            "max_conversation_chars",
            "must be >= max_text_chars",
        )
        need(
            self.encoder == "inproc" or self.redis_url is not None,
            "encoder",
            f"redis needs {ENV_PREFIX}REDIS_URL",
        )
        if self.engine == "openai":
            problem = _upstreams_problem(self.upstreams)
            need(problem is None, "upstreams", problem or "")
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
        declared = {d.name: d for d in declarations()}
        raw: dict[str, Any] = {}
        for key, value in environ.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX) :].lower()
            if name in NOT_SETTINGS:
                continue
            if name not in declared:
                raise SettingsError(
                    f"{key}: unknown setting (known: "
                    f"{', '.join(ENV_PREFIX + n.upper() for n in sorted(declared))})"
                )
            raw[name] = declared[name].from_env(value)
        raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
        try:
            return msgspec.convert(raw, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise SettingsError(_explain(exc, raw, declared)) from None


@dataclass(frozen=True, slots=True)
class Declared:
    """One setting as its field declares it, with what follows from that."""

    name: str
    type: Any  # the field's type without its metadata: int, Literal[...], list[str], str | None
    default: Any
    doc: Doc
    flag: Flag | None
    no_flag: NoFlag | None
    range: Range | None
    unit: str
    check: Check | None

    @property
    def env(self) -> str:
        return f"{ENV_PREFIX}{self.name.upper()}"

    @property
    def flag_name(self) -> str | None:
        if self.flag is None:
            return None
        return self.flag.name or f"--{self.name.replace('_', '-')}"

    @property
    def optional(self) -> bool:
        """May be unset (None)."""
        return type(None) in typing.get_args(self.type)

    @property
    def value_type(self) -> Any:
        """The type without `| None`: int, float, bool, str, list[str] or a Literal."""
        if self.optional:
            return next(a for a in typing.get_args(self.type) if a is not type(None))
        return self.type

    @property
    def is_list(self) -> bool:
        return typing.get_origin(self.value_type) is list

    @property
    def choices(self) -> tuple[str, ...]:
        """The values of a `Literal` setting; () for any other."""
        if typing.get_origin(self.value_type) is Literal:
            return typing.get_args(self.value_type)
        return ()

    def from_env(self, value: str) -> Any:
        """A variable's text as `msgspec.convert(strict=False)` takes it: an empty value unsets
        what may be unset, a list is comma-separated; numbers are converted and checked there."""
        if value == "" and self.optional:
            return None
        if self.is_list:
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    def problem(self, value: Any) -> str | None:
        """What is wrong with this value alone, or None."""
        if self.choices and value not in self.choices:
            return f"must be {_either(self.choices)}, got {value!r}"
        if self.range is not None and value is not None and not self.range.holds(value):
            return f"must be {self.range.text(self.unit)}, got {_amount(value, '')}"
        if self.check is not None:
            return self.check.problem(value)
        return None


@functools.cache
def declarations() -> tuple[Declared, ...]:
    """Every setting, in the order of its field (the configuration page's order)."""
    hints = typing.get_type_hints(Settings, include_extras=True)
    return tuple(_declared(f, hints[f.name]) for f in msgspec.structs.fields(Settings))


def _declared(field: msgspec.structs.FieldInfo, annotation: Any) -> Declared:
    if typing.get_origin(annotation) is not Annotated:
        raise TypeError(f"Settings.{field.name}: declare it as Annotated[type, Doc(...), ...]")
    base, *metadata = typing.get_args(annotation)

    def one(kind: type) -> Any:
        found = [m for m in metadata if isinstance(m, kind)]
        if len(found) > 1:
            raise TypeError(f"Settings.{field.name}: more than one {kind.__name__}")
        return found[0] if found else None

    doc, flag, no_flag, unit = one(Doc), one(Flag), one(NoFlag), one(Unit)
    if doc is None or (flag is None) == (no_flag is None):
        raise TypeError(f"Settings.{field.name}: needs a Doc, and a Flag or a NoFlag")
    default = field.default
    if default is msgspec.NODEFAULT:
        default = field.default_factory()
    return Declared(
        name=field.name,
        type=base,
        default=default,
        doc=doc,
        flag=flag,
        no_flag=no_flag,
        range=one(Range),
        unit=unit.name if unit else "",
        check=one(Check),
    )


def _either(choices: tuple[str, ...]) -> str:
    return f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else choices[0]


def _explain(
    exc: msgspec.ValidationError, raw: dict[str, Any], declared: dict[str, Declared]
) -> str:
    # "Expected `int`, got `str` - at `$.port`" -> name the environment variable; a value not
    # among a Literal's choices is refused as __post_init__ refuses it
    text = str(exc)
    if "$." not in text:
        return text
    name = text.rsplit("$.", 1)[1].rstrip("`").split("[")[0]
    setting = declared.get(name)
    problem = setting.problem(raw.get(name)) if setting and setting.choices else None
    return f"{ENV_PREFIX}{name.upper()}: {problem or text.split(' - at ')[0]}"
