"""The `openai` engine's replicas: what each serves, whether it is up, and when it comes back.

`ReplicaPool` owns the replicas' lifecycle, apart from generation
(`gateway.engine.upstream.openai_engine`):

- start: `GET /v1/models` on every replica, asked again every `START_RETRY_S` until one answers
  or `start_timeout_s` passes. It learns the model name to send (unless configured), the
  context each replica takes (`max_model_len`; the engine's context is the smallest reported,
  under the configured one) and, for embeds mode, the checkpoint it serves: a replica serving
  another checkpoint than the gateway's encoder fails the start (`upstream_error`). Replicas
  that did not answer start down.
- health: every `health_interval_s` each replica is probed, `GET /health` (or `/v1/models` where
  there is no such route); a replica that never answered is described first. A probe that fails
  marks it down, one that succeeds brings it back; generation marks a replica down too when it
  fails before the first text (`set_health`).

Routing (`gateway.engine.upstream.routing.Router`) only ever picks among healthy replicas;
`candidates` is its order for one request, in embeds mode less the replicas whose encoder
fingerprint differs from the one that made the request's images.
Failure reasons in logs and errors (`failure_reason`) name host:port at most, never a key.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx
import structlog

from gateway.engine.interface import EngineError, ImageInput, ImageInputKind
from gateway.engine.upstream.routing import Replica, Router, route_key
from gateway.engine.upstream.wire import StreamBroken
from gateway.protocol.errors import clip

if TYPE_CHECKING:
    from gateway.engine.interface import GenerationRequest
    from gateway.engine.upstream.endpoints import Upstream

__all__ = (
    "DEFAULT_CONTEXT_TOKENS",
    "START_RETRY_S",
    "ReplicaPool",
    "failure_reason",
    "load_tokenizer",
    "text_hidden_size",
)

log = structlog.get_logger(__name__)

DEFAULT_CONTEXT_TOKENS = 8192
START_RETRY_S = 1.0  # between rounds of GET /v1/models while no replica has answered


class _Mismatch(Exception):
    """A replica serves another checkpoint than the gateway's encoder (embeds mode)."""


class ReplicaPool:
    """The replicas of one model, their health and what they serve (see the module doc)."""

    def __init__(
        self,
        upstreams: Sequence[Upstream],
        *,
        image_input: ImageInputKind,
        model_id: str | None,
        context_tokens: int,
        checkpoint_name: str | None,
        health_interval_s: float,
        health_timeout: httpx.Timeout,
        start_timeout_s: float,
        load_factor: float,
    ) -> None:
        self.replicas = [Replica(u) for u in upstreams]
        self.router = Router(self.replicas, load_factor=load_factor)
        self.image_input = image_input
        self._model_id_arg = model_id
        self.model_id = model_id or next((r.model for r in self.replicas if r.model), "upstream")
        self._context_arg = context_tokens
        self.context_tokens = context_tokens or DEFAULT_CONTEXT_TOKENS
        self.checkpoint = checkpoint_name
        self._health_interval_s = health_interval_s
        self._health_timeout = health_timeout
        self._start_timeout_s = start_timeout_s  # how long start() waits for a replica
        self.client: httpx.AsyncClient | None = None  # the engine's, set before `start`

    @staticmethod
    def headers(replica: Replica) -> dict[str, str]:
        key = replica.upstream.api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    async def start(self) -> list[Replica]:
        """Describe every replica, waiting for one to answer (see the module doc); the replicas
        that answered. Raises `EngineError("upstream_error")` when none did, or when one serves
        another checkpoint in embeds mode."""
        # replicas often start with the gateway: wait for one to answer, up to a deadline
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            outcomes = await asyncio.gather(
                *(self._describe(r) for r in self.replicas), return_exceptions=True
            )
            answered_now = any(o is None or isinstance(o, _Mismatch) for o in outcomes)
            if answered_now or time.monotonic() >= deadline:
                break
            log.info(
                "upstream.waiting",
                replicas=[r.name for r in self.replicas],
                reason=failure_reason(outcomes[0]),
                seconds_left=round(deadline - time.monotonic()),
            )
            await asyncio.sleep(min(START_RETRY_S, max(deadline - time.monotonic(), 0.0)))
        mismatched = [
            f"{r.name}: {o}"
            for r, o in zip(self.replicas, outcomes, strict=True)
            if isinstance(o, _Mismatch)
        ]
        if mismatched:
            raise EngineError(
                "upstream_images=embeds needs every replica to serve the gateway's checkpoint "
                f"{self.checkpoint!r}; " + "; ".join(mismatched),
                code="upstream_error",
            )
        answered = [r for r, o in zip(self.replicas, outcomes, strict=True) if o is None]
        if not answered:
            reasons = "; ".join(
                f"{r.name}: {failure_reason(o)}"
                for r, o in zip(self.replicas, outcomes, strict=True)
            )
            raise EngineError(
                f"no upstream replica answered GET /v1/models ({reasons})", code="upstream_error"
            )
        for r, o in zip(self.replicas, outcomes, strict=True):
            if o is None:
                self.set_health(r, True)
            else:  # starts down; the health loop brings it in once it answers
                log.warning("upstream.down", upstream=r.name, reason=failure_reason(o))
        first = answered[0]
        self.model_id = self._model_id_arg or first.model or self.model_id
        self._fit_context()
        return answered

    def _fit_context(self) -> None:
        """The context every replica that answered can take (the smallest reported, under the
        configured one); again whenever a replica first answers, which may report less."""
        reported = [r.context_tokens for r in self.replicas if r.verified and r.context_tokens]
        if self._context_arg and reported and self._context_arg > min(reported):
            log.warning(
                "upstream.context_capped",
                configured=self._context_arg,
                replicas_report=min(reported),
            )
        limits = [v for v in (self._context_arg, min(reported, default=0)) if v]
        self.context_tokens = min(limits) if limits else DEFAULT_CONTEXT_TOKENS

    async def _describe(self, replica: Replica) -> None:
        """GET /v1/models: the model name to send, its context, what checkpoint it serves."""
        assert self.client is not None
        response = await self.client.get(
            f"{replica.upstream.base_url}/v1/models",
            headers=self.headers(replica),
            timeout=self._health_timeout,
        )
        if response.status_code != 200:
            raise StreamBroken(f"GET /v1/models answered HTTP {response.status_code}")
        entries = response.json().get("data") or []
        entry = next((e for e in entries if e.get("id") == replica.model), None)
        if entry is None and replica.model is None:
            entry = entries[0] if entries else None
        if replica.model is None:
            if entry is None:
                raise StreamBroken("GET /v1/models listed no model")
            replica.model = str(entry["id"])
        entry = entry or {"id": replica.model}  # a configured name the list does not show
        replica.context_tokens = int(entry.get("max_model_len") or 0)
        replica.served = tuple(str(entry[k]) for k in ("id", "root") if entry.get(k))
        extension = entry.get("visiongate") if isinstance(entry.get("visiongate"), dict) else {}
        fingerprint = entry.get("encoder_fingerprint") or extension.get("encoder_fingerprint")
        replica.encoder_fingerprint = str(fingerprint) if fingerprint else None
        if self.image_input == "embeds":
            self._check_checkpoint(replica)
        replica.verified = True

    def _check_checkpoint(self, replica: Replica) -> None:
        want = (self.checkpoint or "").lower()
        names = [s.rstrip("/").rsplit("/", 1)[-1].lower() for s in replica.served or ()]
        if want not in names:
            raise _Mismatch(
                f"it serves {', '.join(replica.served) or replica.model or 'an unnamed model'}"
            )

    def candidates(self, request: GenerationRequest) -> list[Replica]:
        """The replicas to try for `request`, in order (`Router.order`); in embeds mode only
        those whose encoder fingerprint (when they report one) matches its images' ids."""
        order = self.router.order(route_key(request))
        if self.image_input != "embeds":
            return order
        prefixes = {
            p.digest.split(":", 1)[0]
            for m in request.messages
            for p in m.content
            if isinstance(p, ImageInput) and ":" in p.digest
        }
        if not prefixes:
            return order
        fit = [
            r
            for r in order
            if r.encoder_fingerprint is None
            or all(r.encoder_fingerprint.startswith(p) for p in prefixes)
        ]
        if not fit:
            raise EngineError(
                "every upstream replica reports another encoder fingerprint than this gateway's",
                code="upstream_error",
            )
        return fit

    def set_health(self, replica: Replica, ok: bool, reason: str | None = None) -> None:
        if replica.healthy == ok:
            return
        replica.healthy = ok
        if ok:
            log.info("upstream.up", upstream=replica.name)
        else:
            log.warning("upstream.down", upstream=replica.name, reason=reason)

    async def probe(self, replica: Replica) -> None:
        assert self.client is not None
        try:
            if not replica.verified:  # never answered /v1/models: learn what it serves first
                await self._describe(replica)
                self._fit_context()
                self.set_health(replica, True)
                return
            response = await self.client.get(
                f"{replica.upstream.base_url}/health",
                headers=self.headers(replica),
                timeout=self._health_timeout,
            )
            if response.status_code in (404, 405):  # no /health: /v1/models says it is up
                response = await self.client.get(
                    f"{replica.upstream.base_url}/v1/models",
                    headers=self.headers(replica),
                    timeout=self._health_timeout,
                )
            ok = response.status_code == 200
            self.set_health(replica, ok, None if ok else f"HTTP {response.status_code}")
        except _Mismatch as exc:
            log.error("upstream.wrong_checkpoint", upstream=replica.name, reason=str(exc))
            self.set_health(replica, False, "serves another checkpoint")
        except Exception as exc:
            self.set_health(replica, False, failure_reason(exc))

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            await asyncio.gather(*(self.probe(r) for r in self.replicas))


def failure_reason(exc: object) -> str:
    """A short reason for logs and errors (never a key: exceptions name host:port at most)."""
    if isinstance(exc, httpx.ConnectError):
        return "connection refused or unreachable"
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    if isinstance(exc, httpx.TransportError):
        return f"connection failed ({type(exc).__name__})"
    if isinstance(exc, BaseException):
        return clip(str(exc) or type(exc).__name__)
    return clip(str(exc))


def text_hidden_size(model_path: str) -> int:
    """The language model's hidden size from a checkpoint's config.json (its text config's,
    for a VLM); 0 when it does not say (a tokenizer-only directory has no config.json)."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        config = json.load(f)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    size = text.get("hidden_size") or config.get("hidden_size")
    if size:
        return int(size)
    from transformers import AutoConfig  # defaults a sparse config.json leaves out

    auto = AutoConfig.from_pretrained(model_path, local_files_only=True)
    return int(getattr(auto.get_text_config(), "hidden_size", 0) or 0)


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
