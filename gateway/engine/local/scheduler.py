"""Iteration-level (continuous) batching over one model, on one thread.

Requests wait in a bounded queue; between steps the scheduler admits as many as the batch size
and the KV budget allow (`Admission`, gateway.engine.local.admission), and each step runs one
packed forward (`gateway.engine.local.batch`) over the positions the step builder chose
(`gateway.engine.local.step_plan`): one token for every decoding sequence, then prefill chunks
of admitted prompts under the per-step token budget (`prefill_chunk_tokens`). A long new prompt
(an image and a long history) is therefore spread over several steps while the others keep
streaming, and a request joins or leaves the batch at any step boundary. Cancelling a request
takes it out at the next boundary (its KV freed); the others' tokens are untouched. KV warm-ups
(`WarmUps`, gateway.engine.local.kv_warmup) are background prefills at the lowest priority.

The engine is shared fairly between owners (API keys, `GenerationRequest.owner`; policy in
`gateway.engine.local.fair_queue`): admission takes owners in turn, a step's prefill budget is
split max-min fairly between them, and one owner may keep at most `max_queue_per_key` requests
waiting beyond the batch's free slots (past that, and past `max_queue` in all, `submit`
refuses).

A request is refused before it runs when it would run wrongly or cost every other stream
(`check_request` in `gateway.engine.local.sequence`: image embeds, sampling ranges, stop
strings bounded by `MAX_STOPS` x `MAX_STOP_CHARS`), with an `EngineError` of a stable code. A
failure while admitting or sampling one sequence fails that sequence alone; only a failed
forward fails its whole step. Non-finite values that arise inside the forward (an overflow)
fail the sequence at its next logits, and KV that holds them is never given to the prefix
cache or the spill store.

A sequence (`Sequence`: its own sampler, grammar matcher, stops, detokenizer) is one list of
positions, the prompt's then its generated tokens, `fed` of them with KV in its buffer. A step
feeds positions [fed, known) up to the budget and samples a token when it reaches the end, so
prefill, decode and the recompute after a preemption are the same operation. What a step's
logits become (log-probabilities, grammar masks computed on a worker thread during the
forward, sampling, deltas) is `gateway.engine.local.choices`.

A request for n choices is admitted when n batch slots are free (and KV room for n prompts),
prefilled once, and forked into n sequences at its prompt's last position (`Admission.fork`:
the siblings get copies of the prompt's KV, or wait in the queue if the batch is full); from
there each is a sequence like any other, in the batch, the KV budget, preemption and fair share.
The slow-reader limit of a request is per choice, since its choices share one reader.

The scheduler holds three parts: `KVMemory` (gateway.engine.local.kv.kv_memory: the prefix
cache, the byte budget, the spill store; every question about KV goes there, and it fixes the
order memory comes back in), `WarmUps`, and `Admission` (given the other two); it keeps the
loop, the steps, sampling and finishing. When
decoding sequences outgrow the budget (`_fit`), KV memory reclaims it in its order, and as a
last resort a sequence is preempted: its computed blocks go to the prefix cache, its buffer is
freed, and it goes back to the front of its owner's line with its generated tokens and its
admission order (so the oldest running sequence is never the one preempted); on readmission it
recomputes what the cache no longer holds and continues, token-identical for greedy decoding
(and for seeded sampling, whose generator state it keeps). One sequence alone may exceed the
budget rather than never run. A sequence that ends commits its positions to KV memory, its
session's turn pinned (and spilled, when the engine has a spill store).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
import torch

from gateway.engine.interface import EngineError, EngineStats
from gateway.engine.local.admission import Admission
from gateway.engine.local.batch import Slice, run_step
from gateway.engine.local.choices import StepLogprobs, advance, emit, fork, post_results
from gateway.engine.local.grammar import GrammarMasks, TokenVocab
from gateway.engine.local.kv.blocks import chain_seed
from gateway.engine.local.kv.kv_memory import KVLayout, KVMemory
from gateway.engine.local.kv_warmup import WarmUps
from gateway.engine.local.sequence import (
    Job,
    SchedulerConfig,
    Sequence,
    prepare_sequence,
    sequence_inputs,
)
from gateway.engine.local.step_plan import StepPlanner

if TYPE_CHECKING:
    from gateway.engine.local.kv.store import KVStore
    from gateway.engine.local.weights import LoadedModel

__all__ = ("Scheduler",)

log = structlog.get_logger(__name__)


class Scheduler:
    """The engine thread: the loop, steps, sampling, finishing; it holds the KV memory,
    admission and the KV warm-ups. See the module doc."""

    def __init__(
        self,
        weights: LoadedModel,
        config: SchedulerConfig,
        *,
        eos_ids: frozenset[int],
        max_positions: int,
        kv_store: KVStore | None,
        cache_arg: str,
        torch_threads: int | Callable[[], int] | None = None,
        name: str = "engine",
        spill_seed: bytes | None = None,
        vocab: TokenVocab | None = None,
    ) -> None:
        self.w = weights
        self.cfg = config
        self.eos_ids = eos_ids
        self.cache_arg = cache_arg
        self.torch_threads = torch_threads
        # the tokens as llguidance sees them (shared by replicas; built in the background)
        self.vocab = vocab or TokenVocab(weights.tokenizer, eos_ids)
        self._masks = GrammarMasks(self.vocab)
        self.prefill_positions = 0  # prompt positions computed (not reused), for tests and gauges
        self._logprobs: StepLogprobs | None = None  # the step's, while its tokens are sampled
        # the loop sleeps on it; the queues filled from other threads are guarded by it
        self._cond = threading.Condition()
        self._barriers: list[threading.Event] = []
        self._stop = False
        self._steps = 0
        # each step's positions, and the fair-share record (heavy keys) admission reads too
        self._planner = StepPlanner(config, hold_decodes=torch.device(weights.device).type == "cpu")
        # chain seed of the KV written to the spill store (the store checks it on every read);
        # None: from the model id and dtype alone
        spill_seed = spill_seed or chain_seed(weights.model_id, weights.weights, config.block_size)
        # every question about KV memory; the buffers it counts are the running sequences'
        self.kv = KVMemory(
            KVLayout.of(weights),
            config.kv_budget_bytes,
            config.block_size,
            lambda: (self.admission.running, self.warmups.running),
            prefix_caching=config.prefix_caching,
            store=kv_store,  # Redis spill of sessions' KV (None: this process only)
            spill_seed=spill_seed,
        )
        prepare = functools.partial(
            prepare_sequence,
            w=weights,
            max_positions=max_positions,
            block_size=config.block_size,
            vocab=self.vocab,
        )
        self.warmups = WarmUps(config, self.kv, self._cond, prepare=prepare)
        self.admission = Admission(
            config,
            self.kv,
            self.warmups,
            self._cond,
            prepare=prepare,
            siblings=functools.partial(fork, w=weights),
            heavy=lambda: self._planner.heavy,
        )
        self._last_batch = 0
        self._last_tokens = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    # -- called from other threads -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> str | None:
        """Queue a job; None when queued, else why it was refused (the queue, or its owner's
        share of it, is full)."""
        seq = Sequence(job)
        with self._cond:
            if self._stop:
                raise EngineError("engine closed", code="closed")
            refused = self.admission.enqueue(seq)
            if refused is None:
                self._cond.notify()
        return refused

    def submit_warmup(self, job: Job) -> None:
        """Queue a KV warm-up (`job.request.warm_up` set, `kv_key` its session); its
        `WarmUpResult` is posted to `job` when it ends. A queued warm-up of the same session is
        replaced (dropped); past `max_queue` warm-ups, the oldest is dropped."""
        seq = Sequence(job)
        with self._cond:
            if self._stop:
                raise EngineError("engine closed", code="closed")
            replaced = self.warmups.enqueue(seq)
            self._cond.notify()
        self.warmups.dismiss(replaced, "replaced")

    def forget(self, kv_key: str) -> None:
        """Drop a session's running warm-up and its KV (pins, cached blocks and spilled entry),
        between steps."""

        def drop() -> None:
            self.warmups.forget(kv_key)
            self.kv.forget(kv_key)

        self.call_between_steps(drop)

    @property
    def owners_waiting(self) -> int:
        """How many owners have requests queued (a count: owners are never exported)."""
        return self.admission.queue.owners

    def barrier(self, timeout: float) -> bool:
        """Wait until every finished request's KV is in the cache (one full loop iteration)."""
        event = threading.Event()
        with self._cond:
            if self._stop:
                return True
            self._barriers.append(event)
            self._cond.notify()
        return event.wait(timeout)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()
        self._masks.close()

    def call_between_steps(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop's thread before its next step (the cache is the loop's)."""
        with self._cond:
            self._barriers.append(_Call(fn))
            self._cond.notify()

    def clear_kv(self) -> None:
        """Drop every cached KV block (sessions' pins too) before the loop's next step."""
        self.call_between_steps(self.kv.clear)

    def stats(self) -> EngineStats:
        used, total, cached = self.kv.blocks()
        admission = self.admission
        return EngineStats(
            owners_waiting=admission.queue.owners,
            running=len(admission.running),
            waiting=len(admission.queue),
            batch_size=self._last_batch,
            step_tokens=self._last_tokens,
            kv_blocks_used=used,
            kv_blocks_total=total,
            kv_blocks_cached=cached,
            preemptions_total=admission.preemptions,
        )

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        threads_now = self.torch_threads if callable(self.torch_threads) else None
        threads = 0
        if isinstance(self.torch_threads, int) and self.torch_threads:
            torch.set_num_threads(self.torch_threads)  # torch keeps it per thread
        while True:
            with self._cond:
                while not (
                    self.admission.busy or self.warmups.busy or self._barriers or self._stop
                ):
                    self._cond.wait()
                if self._stop:
                    break
                barriers, self._barriers = self._barriers, []
            self._release(barriers)
            if threads_now is not None and (wanted := threads_now()) != threads:
                torch.set_num_threads(wanted)  # the cores an encoder batch leaves the engine
                threads = wanted
            try:
                with torch.inference_mode():
                    self.admission.admit()
                    self._step()
            except Exception as exc:  # the thread must outlive any one step
                log.exception("engine.step_failed")
                for seq in list(self.admission.running):
                    self._fail(seq, EngineError(f"generation failed: {exc}"))
        self._shutdown()

    def _shutdown(self) -> None:
        with self._cond:
            barriers, self._barriers = self._barriers, []
        for seq in self.admission.close():
            seq.job.post(EngineError("engine closed", code="closed"))
        self.warmups.close()
        self._release(barriers)
        self.kv.clear()

    @staticmethod
    def _release(barriers: list[Any]) -> None:
        """Set barriers and run queued calls; a call that raises is logged, never fatal."""
        for b in barriers:
            try:
                b.set()
            except Exception:
                log.exception("engine.call_failed")

    # -- one step ------------------------------------------------------------------------------

    def _plan(self) -> list[tuple[Sequence, int, int]]:
        """This step's (sequence, start, length): `StepPlanner.plan`."""
        return self._planner.plan(self.admission.running, self.warmups.running, self._steps)

    def _fit(self, plan: list[tuple[Sequence, int, int]]) -> list[tuple[Sequence, int, int]]:
        """Grow buffers for the plan; while over the KV budget, give memory back in KV memory's
        order (`KVMemory.reclaim`): cached blocks, warm-ups, a heavy key's newest sequence,
        sessions' pins, the newest sequence of the owner holding the most. Returns the plan
        less the sequences that left the batch."""
        for s, start, n in plan:
            self.kv.grow(s, start + n)
        gone: set[Sequence] = set()

        def drop_warmups() -> bool:
            gone.update(self.warmups.running)
            return self.warmups.drop("kv_pressure")

        def preempt(victim: Sequence | None) -> bool:
            if victim is None:
                return False
            self.admission.preempt(victim, "kv_budget")
            gone.add(victim)
            return True

        self.kv.reclaim(
            drop_warmups,
            lambda: preempt(self.admission.heavy_victim()),
            lambda: preempt(self.admission.largest_victim()),
        )
        return [p for p in plan if p[0] not in gone] if gone else plan

    def _step(self) -> None:
        now = time.perf_counter()
        running = self.admission.running
        for seq in [s for s in running if s.request.cancel.is_set()]:
            self._finish(seq, "cancelled", now)
        limit = self.cfg.max_unread_deltas  # per choice: a request's n choices share one reader
        for seq in [s for s in running if s.job.unread > limit * s.request.sampling.n]:
            log.warning("engine.slow_reader", request_id=seq.request.request_id, unread=limit)
            self._finish(seq, "slow_reader", now)
        self.warmups.drop_cancelled()
        if not running and not self.warmups.running:
            return
        plan = self._fit(self._plan())
        if not plan:
            return
        self._steps += 1
        slices = []
        wanting: list[Sequence] = []  # the sequences whose logits this step gives, by row
        for s, start, n in plan:
            embeds, positions = sequence_inputs(self.w, s, start, n)
            want = start + n == s.known and not s.warm  # a warm-up samples nothing
            slices.append(Slice(s.kv, start, n, embeds, positions, want))  # type: ignore[arg-type]
            if want:
                wanting.append(s)
            self.prefill_positions += max(min(start + n, s.prompt.length) - start, 0)  # type: ignore[union-attr]
        constrained = [row for row, s in enumerate(wanting) if s.matcher is not None]
        if constrained:  # the masks are computed on a worker thread while the forward runs
            self._masks.start([wanting[row].matcher for row in constrained])
        if self.w.fused is not None:
            logits = self.w.fused.run(slices)
        else:
            logits = run_step(
                self.w.decoder, self.w.lm_head, slices, mrope=self.w.mrope, cache_arg=self.cache_arg
            )
        self._last_batch, self._last_tokens = len(plan), sum(n for _, _, n in plan)
        now = time.perf_counter()
        # NaN (or +inf) logits mean the sequence's KV is NaN too: it fails and is never cached
        broken = (logits.isnan() | logits.isposinf()).any(dim=-1).tolist()  # [rows], one sync
        asking = {s: row for row, s in enumerate(wanting) if s.trail is not None}
        # of the raw logits: before the grammar's mask
        self._logprobs = StepLogprobs(logits, asking, self.vocab) if asking else None
        if constrained:
            self._masks.apply(logits, constrained)
        row = 0
        for (s, start, n), sl in zip(plan, slices, strict=True):
            s.fed = start + n
            if start < s.prompt.length:  # type: ignore[union-attr]
                s.prefill_chunks += 1
            if s.warm and s.fed == s.known:
                self.warmups.complete(s)
            if not sl.want_logits:
                continue
            if broken[row]:
                self._fail(s, EngineError("the model produced non-finite logits for this request"))
            elif s.forked or s.request.sampling.n == 1:
                self._advance(s, logits[row], now)
            else:
                try:
                    siblings = self.admission.fork(s)
                    if self._logprobs is not None:
                        self._logprobs.share(s, siblings)
                except Exception as exc:  # the request's failure (its stream stops the rest)
                    log.exception("engine.fork_failed", request_id=s.request.request_id)
                    self._fail(s, EngineError(f"generation failed: {exc}"))
                else:
                    for c in (s, *siblings):
                        self._advance(c, logits[row], now)
            row += 1

    def _advance(self, seq: Sequence, logits: torch.Tensor, now: float) -> None:
        """Sample the next token of `seq`, stream it, and finish `seq` if it ends there."""
        try:
            finish = advance(seq, logits, self._logprobs, self.eos_ids, self.vocab, now)
        except Exception as exc:  # this sequence's failure, not the batch's
            log.exception("engine.sample_failed", request_id=seq.request.request_id)
            error = exc if isinstance(exc, EngineError) else None
            self._fail(seq, error or EngineError(f"generation failed: {exc}"))
            return
        if finish is not None:
            self._finish(seq, finish, now)

    # -- finishing -----------------------------------------------------------------------------

    def _finish(self, seq: Sequence, finish: str, now: float) -> None:
        self.admission.leave(seq)
        if seq.decoder is not None and finish not in ("cancelled", "slow_reader"):
            tail = seq.decoder.finish()
            if tail:
                emit(seq, tail, now)
        result = post_results(seq, finish, now)
        log.info(
            "engine.generated",
            request_id=seq.request.request_id,
            index=seq.index,
            finish_reason=finish,
            input_tokens=result.input_tokens,
            cached_tokens=result.cached_tokens,
            output_tokens=result.output_tokens,
            prefill_ms=result.prefill_ms,
            decode_ms=result.decode_ms,
            preemptions=seq.preemptions,
        )
        try:  # the session's turn is its first choice; the cache gives way, pins too
            self.kv.commit(seq, "turn" if seq.index == 0 else "none", unpin=True)
        except Exception:  # losing a cache entry costs speed only
            log.exception("kv.keep_failed", request_id=seq.request.request_id)
        seq.kv = None

    def _fail(self, seq: Sequence, exc: EngineError) -> None:
        self.admission.leave(seq)
        seq.kv = None
        seq.job.post(exc)


class _Call:
    """A barrier that runs a function when the loop reaches it."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn

    def set(self) -> None:
        self._fn()
