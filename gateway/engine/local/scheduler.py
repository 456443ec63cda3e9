"""Iteration-level (continuous) batching over one model, on one thread.

Requests wait in a bounded queue; between steps the scheduler admits as many as the batch size
and the KV budget allow, and each step runs one packed forward (`gateway.engine.local.batch`) over:
one token for every decoding sequence, then prefill chunks of admitted prompts under the
per-step token budget (`prefill_chunk_tokens`). A long new prompt (an image and a long history)
is therefore spread over several steps while the others keep streaming, and a request joins or
leaves the batch at any step boundary. Cancelling a request takes it out at the next boundary
(its KV freed); the others' tokens are untouched.

The engine is shared fairly between owners (API keys, `GenerationRequest.owner`; policy in
`gateway.engine.local.fair_queue`): admission takes owners in turn, each owner's requests in order;
an owner with nothing running gets a slot of a full batch at the next step (the newest sequence
of an owner holding two or more is preempted for it); the prefill budget is split max-min
fairly between owners, each owner's share going to its oldest prompt first; and one owner may
keep at most `max_queue_per_key` requests waiting beyond the batch's free slots (past that, and
past `max_queue` in all, `submit` refuses).

A request is checked before it runs: image embeds must be `[N, hidden]`, floating point and
finite (one NaN row would reach every position of its chunk, and the prefix cache); sampling
must be in range; stop strings are bounded (`MAX_STOPS` x `MAX_STOP_CHARS`), since they are
matched on the thread every stream shares. A refusal is an `EngineError` with a stable code
(`invalid_image`, `invalid_request`, `context_length_exceeded`). A failure while admitting or
sampling one sequence fails that sequence alone; only a failed forward fails its whole step.
Non-finite values that arise inside the forward (an overflow) fail the sequence at its next
logits, and KV that holds them is never given to the prefix cache or the spill store.

Every sequence keeps its own sampling state (temperature, top-p, seeded generator), grammar
matcher, stop strings, token limit, streaming detokenizer and pending log-probabilities. A
sequence is one list of positions: the prompt's, then its generated tokens; `fed` of them have
KV in its buffer. A step feeds positions [fed, known) up to the budget and samples a token when
it reaches the end, so prefill, decode and the recompute after a preemption are the same
operation. What a step's logits become (log-probabilities, grammar masks, sampling, deltas) is
`gateway.engine.local.choices`; grammar masks are computed on a worker thread during the forward.

A request for n choices is admitted when n batch slots are free (and KV room for n prompts),
prefilled once, and forked into n sequences at its prompt's last position (`_fork`: the
siblings get copies of the prompt's KV, or wait in the queue if the batch is full); from there
each is a sequence like any other, in the batch, the KV budget, preemption and fair share. The
slow-reader limit of a request is per choice, since its choices share one reader.

KV memory: running sequences' buffers and the prefix cache's blocks share one byte budget.
Admission needs room for the new prompt (cached blocks are evicted, least recently used first,
then sessions' pins). A heavy key (or one a new prompt makes heavy) that already has a sequence
running may not take sessions' pins: its next prompt waits for room (`_spares_pins`) while
other owners' requests behind it in turn are admitted, and when decoding outgrows the budget
such a key gives up its newest sequence before any session is unpinned. So one key's long
prompts cannot evict the KV that lets another key's next turn skip its history. When decoding
sequences outgrow the budget, the most recently admitted sequence of the owner holding the most
is preempted: its computed blocks go to the prefix cache, its buffer is freed, and it goes back
to the front of its owner's line with its generated tokens and its admission order (so the
oldest running sequence is never the one preempted); on readmission it recomputes what the
cache no longer holds and continues, token-identical for greedy decoding (and for seeded
sampling, whose generator state it keeps). One sequence alone may exceed the budget rather than
never run.

KV warm-ups (`submit_warmup`) are background work at the lowest priority: a session's prompt
through its latest item, prefilled into the prefix cache while its user is still typing, then
pinned for the session (a warm pin, the first pin to go) until its next turn. They wait in a
queue of their own (one per session, a newer one replacing it) and are admitted only while no
request waits, into free slots (a quarter of the batch at most) and KV room that running
sequences and sessions' pins leave. A step gives them only what requests leave of its budget:
nothing while a prompt is being prefilled, `prefill_chunk_tokens // WARMUP_BESIDE_DIVISOR`
positions beside running decodes, `warmup_chunk_tokens` in an otherwise idle step (so a request
arriving waits for a short step at most). Their positions count towards their owner's fair share
like any prefill. A waiting request that needs a slot or KV a warm-up holds drops it first,
before any preemption or unpinning; the session's own request takes over what its warm-up has
computed so far (published to the prefix cache at its admission).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import structlog
import torch

from gateway.engine.interface import EngineError, EngineStats, WarmUpResult
from gateway.engine.local.batch import SeqKV, Slice, run_step
from gateway.engine.local.choices import StepLogprobs, advance, copy_kv, emit, fork, post_results
from gateway.engine.local.fair_queue import (
    FairQueue,
    RecentService,
    newest_of_largest,
    share_budget,
    share_budget_least_served,
)
from gateway.engine.local.grammar import GrammarMasks, TokenVocab
from gateway.engine.local.kv.blocks import block_hashes, chain_seed, position_keys
from gateway.engine.local.kv.prefix_cache import PrefixCache, PrefixMatch
from gateway.engine.local.sequence import (
    GROW,
    Job,
    SchedulerConfig,
    Sequence,
    load_spilled,
    ms,
    prepare_sequence,
    sequence_inputs,
    spill_entry,
)

if TYPE_CHECKING:
    from gateway.engine.local.kv.store import KVStore
    from gateway.engine.local.weights import LoadedModel

__all__ = ("Scheduler",)

log = structlog.get_logger(__name__)

# how fast an owner's record of prefill service fades: a key idle this long counts half as heavy
SERVED_HALF_LIFE_S = 10.0
# a key counts as heavy once its recent prefill passes this many full steps' budget
HEAVY_PREFILL_STEPS = 4
# ... or at once, while its prompts in the batch still need more than this many steps' budget
HEAVY_DEMAND_STEPS = 2
# beside a light key, the heavy keys together feed prefill_chunk_tokens // this a step
HEAVY_TOKENS_DIVISOR = 16
# beside running decodes, warm-ups together feed prefill_chunk_tokens // this a step: enough to
# finish a photo's prompt within seconds beside 8 decoding sessions (bench.warmup), little
# beside the step's decodes
WARMUP_BESIDE_DIVISOR = 8
# sessions whose last warm-up is remembered for their next turn's report
WARMED_KEPT = 4096

_owner = attrgetter("owner")
_order = attrgetter("order")


def _longest_held(s: Sequence) -> tuple[int, int]:
    return (-s.held, s.order)


class Scheduler:
    """The engine thread: admission, step building, sampling, finishing. See the module doc."""

    def __init__(
        self,
        weights: LoadedModel,
        config: SchedulerConfig,
        *,
        eos_ids: frozenset[int],
        max_positions: int,
        kv_store: KVStore | None,
        cache_arg: str,
        torch_threads: int | None = None,
        name: str = "engine",
        spill_seed: bytes | None = None,
        vocab: TokenVocab | None = None,
    ) -> None:
        self.w = weights
        self.cfg = config
        self.eos_ids = eos_ids
        self.max_positions = max_positions
        self.kv_store = kv_store  # Redis spill of sessions' KV (None: memory only)
        self.cache_arg = cache_arg
        self.torch_threads = torch_threads
        text = weights.model.config.get_text_config()
        self.num_layers = int(text.num_hidden_layers)
        self.kv_heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        self.head_dim = int(
            getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        )
        self.pos_bytes = SeqKV.bytes_per_position(
            self.num_layers, self.kv_heads, self.head_dim, weights.dtype
        )
        # chain seed of the KV written to the spill store (the store checks it on every read);
        # None: from the model id and dtype alone
        self.base_seed = spill_seed or chain_seed(
            weights.model_id, weights.weights, config.block_size
        )
        self.cache = PrefixCache(config.block_size, enabled=config.prefix_caching)
        # the tokens as llguidance sees them (shared by replicas; built in the background)
        self.vocab = vocab or TokenVocab(weights.tokenizer, eos_ids)
        self._masks = GrammarMasks(self.vocab)
        self.prefill_positions = 0  # prompt positions computed (not reused), for tests and gauges
        self._logprobs: StepLogprobs | None = None  # the step's, while its tokens are sampled
        self._waiting: FairQueue[Sequence] = FairQueue(_owner)
        self._running: list[Sequence] = []
        self._warm_waiting: list[Sequence] = []  # KV warm-ups queued, oldest first
        self._warming: list[Sequence] = []  # KV warm-ups being prefilled
        # session -> (first, end) positions its latest warm-up computed, for the next turn's report
        self._warmed: dict[str, tuple[int, int]] = {}
        self.warmups_dropped = 0  # warm-ups given up for other work, for tests and gauges
        self._cond = threading.Condition()
        self._barriers: list[threading.Event] = []
        self._stop = False
        self._order = 0
        self._steps = 0
        self._served = RecentService(SERVED_HALF_LIFE_S)  # prefill tokens by owner, fading
        self._heavy: set[str | None] = set()  # keys counted as heavy now (`_heavy_keys`)
        # heavy keys' decodes are held beside a light key only where a step costs about the
        # positions it feeds (a CPU); on an accelerator a decode position is nearly free
        self._hold_decodes = torch.device(weights.device).type == "cpu"
        self._preemptions = 0
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
            if len(self._waiting) >= self.cfg.max_queue:
                return f"engine queue is full ({self.cfg.max_queue} waiting)"
            # what the batch's free slots take at the next step hardly waits: a burst into an
            # idle engine is not refused, while a full batch holds each owner to its share
            free = max(self.cfg.max_batch - len(self._running), 0)
            if self._waiting.depth(seq.owner) >= self.cfg.max_queue_per_key + free:
                return (
                    f"too many requests of this API key are waiting ({self.cfg.max_queue_per_key})"
                )
            self._waiting.push(seq)
            self._cond.notify()
        return None

    def submit_warmup(self, job: Job) -> None:
        """Queue a KV warm-up (`job.request.warm_up` set, `kv_key` its session); its
        `WarmUpResult` is posted to `job` when it ends. A queued warm-up of the same session is
        replaced (dropped); past `max_queue` warm-ups, the oldest is dropped."""
        seq = Sequence(job)
        gone: list[Sequence] = []
        with self._cond:
            if self._stop:
                raise EngineError("engine closed", code="closed")
            key = job.request.kv_key
            gone = [s for s in self._warm_waiting if s.request.kv_key == key]
            self._warm_waiting = [s for s in self._warm_waiting if s.request.kv_key != key]
            while len(self._warm_waiting) >= self.cfg.max_queue:
                gone.append(self._warm_waiting.pop(0))
            self._warm_waiting.append(seq)
            self._cond.notify()
        for old in gone:
            self._warm_end(old, "dropped", reason="replaced")

    @property
    def owners_waiting(self) -> int:
        """How many owners have requests queued (a count: owners are never exported)."""
        return self._waiting.owners

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

    def forget(self, kv_key: str) -> None:
        def drop() -> None:
            for seq in [s for s in self._warming if s.request.kv_key == kv_key]:
                self._warming.remove(seq)
                seq.kv = None
                self._warm_end(seq, "dropped", reason="forgotten")
            self._warmed.pop(kv_key, None)
            self.cache.forget(kv_key)

        self.call_between_steps(drop)

    def call_between_steps(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop's thread before its next step (the cache is the loop's)."""
        with self._cond:
            self._barriers.append(_Call(fn))
            self._cond.notify()

    def stats(self) -> EngineStats:
        cap = max(self.cfg.kv_budget_bytes // max(self.pos_bytes * self.cfg.block_size, 1), 1)
        running = [*self._running, *self._warming]
        # read each buffer once: the loop thread may drop it between a check and a use
        used_pos = sum(kv.capacity for s in running if (kv := s.kv) is not None)
        blocks_running = -(-used_pos // self.cfg.block_size)
        blocks_cached = -(-self.cache.nbytes // max(self.pos_bytes * self.cfg.block_size, 1))
        return EngineStats(
            owners_waiting=self._waiting.owners,
            running=len(self._running),
            waiting=len(self._waiting),
            batch_size=self._last_batch,
            step_tokens=self._last_tokens,
            kv_blocks_used=blocks_running + blocks_cached,
            kv_blocks_total=max(cap, blocks_running + blocks_cached),
            kv_blocks_cached=blocks_cached,
            preemptions_total=self._preemptions,
        )

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self.torch_threads:  # torch keeps the intra-op thread count per thread
            torch.set_num_threads(self.torch_threads)
        while True:
            with self._cond:
                while not (
                    self._waiting
                    or self._running
                    or self._warm_waiting
                    or self._warming
                    or self._barriers
                    or self._stop
                ):
                    self._cond.wait()
                if self._stop:
                    break
                barriers, self._barriers = self._barriers, []
            self._release(barriers)
            try:
                with torch.inference_mode():
                    self._admit()
                    self._step()
            except Exception as exc:  # the thread must outlive any one step
                log.exception("engine.step_failed")
                for seq in list(self._running):
                    self._fail(seq, EngineError(f"generation failed: {exc}"))
        self._shutdown()

    def _shutdown(self) -> None:
        with self._cond:
            waiting = self._waiting.drain()
            barriers, self._barriers = self._barriers, []
            warm, self._warm_waiting = [*self._warm_waiting, *self._warming], []
        for seq in [*waiting, *self._running]:
            seq.job.post(EngineError("engine closed", code="closed"))
        self._running.clear()
        self._warming.clear()
        for seq in warm:
            self._warm_end(seq, "dropped", reason="closed")
        self._release(barriers)
        self.cache.clear()

    @staticmethod
    def _release(barriers: list[Any]) -> None:
        """Set barriers and run queued calls; a call that raises is logged, never fatal."""
        for b in barriers:
            try:
                b.set()
            except Exception:
                log.exception("engine.call_failed")

    # -- admission -----------------------------------------------------------------------------

    def _running_bytes(self) -> int:
        """KV bytes of the running sequences' buffers (warm-ups' included)."""
        running = sum(s.kv.nbytes for s in self._running if s.kv is not None)
        return running + sum(s.kv.nbytes for s in self._warming if s.kv is not None)

    def _slots(self) -> int:
        """Batch slots taken: a request still to fork into n choices holds n; a warm-up one."""
        return sum(s.width for s in self._running) + len(self._warming)

    def _need(self, seq: Sequence) -> int:
        """KV bytes `seq` needs to join the batch (each of its choices holds the prompt)."""
        return self.pos_bytes * (seq.known + GROW) * seq.width

    def _admit(self) -> None:
        with self._cond:  # a cancelled request leaves the queue at once, not when it is its turn
            cancelled = [s for s in self._waiting if s.request.cancel.is_set()]
            for seq in cancelled:
                self._waiting.discard(seq)
        self._admit_requests(cancelled)
        self._admit_warmups()

    def _admit_requests(self, cancelled: list[Sequence]) -> None:
        now = time.perf_counter()
        for seq in cancelled:
            post_results(seq, "cancelled", now)
        parked: set[int] = set()  # heavy keys' heads that wait this pass (`_spares_pins`)
        while True:
            if self._warming and self._waiting and self._slots() >= self.cfg.max_batch:
                self._drop_warmups("slots")  # a waiting request goes before any warm-up
            with self._cond:
                slots = self._slots()
                if slots < self.cfg.max_batch:
                    seq = next((h for h in self._waiting.heads() if id(h) not in parked), None)
                    victim = None
                else:
                    seq, victim = self._slot_claim()
            if seq is None:
                return
            if victim is None and self._running and slots + seq.width > self.cfg.max_batch:
                if self._drop_warmups("slots"):
                    continue
                return  # a request of n choices waits for n free slots
            req = seq.request
            if req.cancel.is_set():
                self._dequeue(seq, served=False)
                post_results(seq, "cancelled", time.perf_counter())
                continue
            try:
                if seq.prompt is None:
                    self._prepare(seq)
            except EngineError as exc:
                self._dequeue(seq)
                seq.job.post(exc)
                continue
            except Exception as exc:
                log.exception("engine.prepare_failed", request_id=req.request_id)
                self._dequeue(seq)
                seq.job.post(EngineError(f"generation failed: {exc}"))
                continue
            need = self._need(seq)
            budget = self.cfg.kv_budget_bytes
            if self._warming and (
                self._running_bytes() + self.cache.pinned_bytes() + need > budget
            ):
                self._drop_warmups("kv_pressure")  # before any pin or preemption
            if victim is None and self._spares_pins(seq, need):
                parked.add(id(seq))  # the next owner in turn may still fit
                continue
            budget = self.cfg.kv_budget_bytes
            staying = [s for s in self._running if s is not victim]
            room = budget - sum(s.kv.nbytes for s in staying if s.kv is not None)
            if staying and room < need:
                # no KV room for the next in turn: an owner with nothing running may still
                # claim memory from the owner holding the most; otherwise wait for one to end
                claim = self._memory_claim()
                if claim is None:
                    return
                seq, victims = claim
                for v in victims:
                    self._preempt(v, "fair_share")
                need = self._need(seq)
                staying = list(self._running)
                room = budget - sum(s.kv.nbytes for s in staying if s.kv is not None)
                victim = None
            if victim is not None:
                self._preempt(victim, "fair_share")
            if staying and self.cache.nbytes > room - need:
                self.cache.shrink(max(room - need, 0), unpin=True)
            self._dequeue(seq)
            try:
                self._start(seq)
            except Exception as exc:  # out of the queue, not yet running: fail it here
                log.exception("engine.admit_failed", request_id=req.request_id)
                self._fail(seq, EngineError(f"generation failed: {exc}"))

    def _spares_pins(self, seq: Sequence, need: int) -> bool:
        """Whether `seq` waits rather than take sessions' pinned KV: a heavy key that has a
        sequence running is admitted only into the room that running sequences and pinned
        blocks leave, so its long prompts cannot evict the KV that lets another key's next
        turn skip its history. Heavy: counted so by `_heavy_keys`, or made so by this prompt
        (a burst is admitted before any step classifies it): what its running prompts and this
        one still have to prefill, net of cached prefixes, is over `HEAVY_DEMAND_STEPS` steps'
        budget. With nothing running a key may take pins (it must make progress); a light
        key always may."""
        room = self.cfg.kv_budget_bytes - self._running_bytes() - self.cache.pinned_bytes()
        if need <= room:
            return False
        mine = [s for s in self._running if s.owner == seq.owner]
        if not mine:
            return False
        if seq.owner in self._heavy:
            return True
        demand = self._uncached(seq) + sum(s.known - s.fed for s in mine)
        return demand > HEAVY_DEMAND_STEPS * self.cfg.prefill_chunk_tokens

    def _uncached(self, seq: Sequence) -> int:
        """Positions of `seq` the prefix cache does not hold (what it would prefill)."""
        return seq.known - self._lookup(seq, use=False)[1].length

    def _lookup(self, seq: Sequence, *, use: bool = True) -> tuple[list[int], PrefixMatch]:
        """`seq`'s positions and the longest cached prefix of them (at least one position is
        left to feed: its logits give the next token); `use` counts the match as a cache hit."""
        assert seq.prompt is not None
        tokens = [*seq.prompt.tokens, *seq.generated]
        keys = position_keys(tokens, seq.prompt.images)
        hashes = block_hashes(tokens, seq.prompt.images, self.cfg.block_size, seq.seed)
        return tokens, self.cache.match(seq.seed, keys, hashes, seq.known - 1, count=use)

    def _slot_claim(self) -> tuple[Sequence | None, Sequence | None]:
        """With the batch full: the first waiting request, in turn order, of an owner with
        nothing running, and whom to preempt for it (the newest sequence of the owner holding
        the most, if that is two or more). (None, None): it waits for a slot to free."""
        victim = newest_of_largest(self._running, _owner, _order)
        if victim is None or sum(s.owner == victim.owner for s in self._running) < 2:
            return None, None
        busy = {s.owner for s in self._running}
        for head in self._waiting.heads():
            if head.owner not in busy:
                return head, victim
        return None, None

    def _memory_claim(self) -> tuple[Sequence, list[Sequence]] | None:
        """With too little KV memory for the next in turn: the first waiting request, in turn
        order, of an owner with nothing running, and the sequences to preempt so that it fits
        (the newest of whichever owner holds the most, never an owner's last one). None: it
        waits for memory like everyone else."""
        busy = {s.owner for s in self._running}
        with self._cond:
            head = next((h for h in self._waiting.heads() if h.owner not in busy), None)
        if head is None:
            return None
        if head.prompt is None:
            try:
                self._prepare(head)
            except Exception:
                return None  # refused when its turn comes, by the usual path
        need = self._need(head)
        staying = list(self._running)
        room = self.cfg.kv_budget_bytes - sum(s.kv.nbytes for s in staying if s.kv is not None)
        victims: list[Sequence] = []
        while room < need:
            victim = newest_of_largest(staying, _owner, _order)
            if victim is None or sum(s.owner == victim.owner for s in staying) < 2:
                return None
            staying.remove(victim)
            victims.append(victim)
            room += victim.kv.nbytes if victim.kv is not None else 0
        return head, victims

    def _prepare(self, seq: Sequence) -> None:
        prepare_sequence(seq, self.w, self.max_positions, self.cfg.block_size, self.vocab)

    def _dequeue(self, seq: Sequence, *, served: bool = True) -> None:
        """Take `seq` out of the queue; served (admitted or refused), its owner's turn passes."""
        with self._cond:
            if served:
                self._waiting.take(seq)
            else:
                self._waiting.discard(seq)

    def _start(self, seq: Sequence) -> None:
        """Admit: reuse the longest cached prefix, allocate the buffer, join the batch."""
        assert seq.prompt is not None
        first = seq.order == 0  # preempted, or a choice parked at its fork: admitted before
        kv_key = seq.request.kv_key
        if kv_key is not None and not seq.warm:
            self._take_over_warmups(kv_key)
        tokens, found = self._lookup(seq)
        limit = seq.known - 1
        kv = SeqKV(
            self.num_layers,
            self.kv_heads,
            self.head_dim,
            seq.known + GROW,
            self.w.dtype,
            self.w.device,
        )
        at = 0
        for block, n in found.blocks:
            kv.load(block.kv.unbind(0), at, n)
            at += n
        reused = found.length
        if kv_key is not None:
            self.cache.touch_session(kv_key)
            if self.kv_store is not None and reused < limit:
                block = self.cfg.block_size
                loaded = load_spilled(seq, kv, tokens, limit, self.kv_store, block, self.base_seed)
                reused = max(reused, loaded)
        seq.kv, seq.fed = kv, reused
        if first:  # a preempted sequence keeps its admission order (its seniority)
            seq.cached = reused
            seq.admitted = time.perf_counter()
            self._order += 1
            seq.order = self._order
            warmed = self._warmed.pop(kv_key, None) if kv_key and not seq.warm else None
            if warmed is not None:
                seq.warmed = max(min(reused, warmed[1]) - warmed[0], 0)
        (self._warming if seq.warm else self._running).append(seq)

    # -- KV warm-ups ---------------------------------------------------------------------------

    def _admit_warmups(self) -> None:
        """Admit queued warm-ups while no request waits, into free slots (a quarter of the
        batch at most) and the KV room that running sequences and sessions' pins leave."""
        limit = max(self.cfg.max_batch // 4, 1)
        while True:
            with self._cond:
                if (
                    not self._warm_waiting
                    or self._waiting
                    or len(self._warming) >= limit
                    or self._slots() >= self.cfg.max_batch
                ):
                    return
                seq = self._warm_waiting.pop(0)
            key = seq.request.kv_key
            if seq.request.cancel.is_set():
                self._warm_end(seq, "dropped", reason="cancelled")
                continue
            if key is None or any(s.request.kv_key == key for s in self._running):
                self._warm_end(seq, "superseded")  # the session's own request is running
                continue
            try:
                self._prepare(seq)
            except EngineError as exc:
                self._warm_end(seq, "failed", reason=str(exc))
                continue
            except Exception as exc:
                log.exception("engine.warmup_prepare_failed", request_id=seq.request.request_id)
                self._warm_end(seq, "failed", reason=f"{type(exc).__name__}: {exc}")
                continue
            need = self.pos_bytes * (seq.known + GROW)
            budget = self.cfg.kv_budget_bytes
            room = budget - self._running_bytes() - self.cache.pinned_bytes()
            if need > room:  # it never takes what sessions pinned or requests hold
                self._warm_end(seq, "dropped", reason="kv_pressure")
                continue
            free = budget - self._running_bytes() - need
            if self.cache.nbytes > free:
                self.cache.shrink(max(free, 0), unpin=False)
            try:
                self._start(seq)
            except Exception as exc:
                log.exception("engine.warmup_admit_failed", request_id=seq.request.request_id)
                seq.kv = None
                self._warm_end(seq, "failed", reason=f"{type(exc).__name__}: {exc}")

    def _drop_warmups(self, reason: str) -> bool:
        """Give up every running warm-up (their buffers freed); whether there was any."""
        dropped, self._warming = self._warming, []
        for seq in dropped:
            seq.kv = None
            self._warm_end(seq, "dropped", reason=reason)
        return bool(dropped)

    def _take_over_warmups(self, kv_key: str) -> None:
        """The session's own request is being admitted: its queued warm-up is not needed, and
        what a running one computed goes to the prefix cache for the request to reuse."""
        with self._cond:
            queued = [s for s in self._warm_waiting if s.request.kv_key == kv_key]
            self._warm_waiting = [s for s in self._warm_waiting if s.request.kv_key != kv_key]
        for seq in queued:
            self._warm_end(seq, "superseded")
        for seq in [s for s in self._warming if s.request.kv_key == kv_key]:
            self._warming.remove(seq)
            done = self._keep_warm(seq, pin=False)
            self._warm_end(seq, "superseded", positions=done)

    def _keep_warm(self, seq: Sequence, *, pin: bool) -> int:
        """Give a warm-up's computed positions to the prefix cache (`pin`: pinned warm for its
        session); returns how many the cache holds."""
        n = seq.fed
        kv, seq.kv = seq.kv, None
        if kv is None or seq.prompt is None or n <= 0 or not self.cache.enabled:
            return 0
        if not bool(torch.isfinite(kv.layers[-1][:, :, :n]).all()):
            log.warning("kv.not_finite", request_id=seq.request.request_id, positions=n)
            return 0
        tokens = seq.prompt.tokens[:n]
        images = [sp for sp in seq.prompt.images if sp.start < n]
        keys = position_keys(tokens, images)
        hashes = block_hashes(tokens, images, self.cfg.block_size, seq.seed)
        kept = self.cache.insert(seq.seed, keys, hashes, kv.layers, n)
        key = seq.request.kv_key
        if key is not None:
            if pin:
                self.cache.pin(key, kept, warm=True)
            self._warmed.pop(key, None)
            self._warmed[key] = (seq.cached, n)
            while len(self._warmed) > WARMED_KEPT:  # sessions that never came back
                del self._warmed[next(iter(self._warmed))]
        budget = self.cfg.kv_budget_bytes
        if self._running_bytes() + self.cache.nbytes > budget:  # never at another's pins' cost
            self.cache.shrink(max(budget - self._running_bytes(), 0), unpin=False)
        return n

    def _warm_end(
        self, seq: Sequence, outcome: str, *, positions: int = 0, reason: str = ""
    ) -> None:
        if outcome == "dropped":
            self.warmups_dropped += 1
        now = time.perf_counter()
        started = seq.admitted or now
        computed = max(positions - seq.cached, 0) if positions else 0
        seq.job.post(
            WarmUpResult(
                outcome,  # type: ignore[arg-type]
                positions=positions,
                computed=computed,
                queue_ms=ms(started - seq.job.enqueued),
                prefill_ms=ms(now - started) if seq.admitted else 0.0,
                reason=reason,
            )
        )
        log.info(
            "engine.warmup",
            request_id=seq.request.request_id,
            outcome=outcome,
            positions=positions,
            computed=computed,
            reason=reason or None,
        )

    # -- one step ------------------------------------------------------------------------------

    def _plan(self) -> list[tuple[Sequence, int, int]]:
        """(sequence, start, length) for this step: decodes first, then prefill chunks, the
        budget shared fairly between owners and each owner's share given oldest first.

        While a light key has a sequence in the batch, the heavy keys (`_heavy_keys`) together
        feed at most `prefill_chunk_tokens // HEAVY_TOKENS_DIVISOR` positions a step: their
        prefill always, and on a CPU their decodes too, since there a step costs about the
        positions it feeds, so the light key's tokens (and its next request's wait for the
        step under way) cost about what they would alone. Held decodes take turns, the longest
        held first; while a heavy prompt is being prefilled a quarter of the room (at least
        one position) is kept for it. The heavy keys' prefill room is split between them max-min
        fairly, remainder rotating, before the budget is shared, so what they cannot use goes
        to the light keys."""
        plan: list[tuple[Sequence, int, int]] = []
        chunk = self.cfg.prefill_chunk_tokens
        served = self._served.now()
        lines: dict[str | None, list[Sequence]] = {}  # owners by their oldest prompt
        for s in sorted((s for s in self._running if s.known - s.fed > 1), key=_order):
            lines.setdefault(s.owner, []).append(s)
        demands = [sum(s.known - s.fed for s in line) for line in lines.values()]
        heavy_keys = self._heavy_keys(served, dict(zip(lines, demands, strict=True)))
        light_in_batch = any(s.owner not in heavy_keys for s in self._running)
        heavy_lines = [i for i, owner in enumerate(lines) if owner in heavy_keys]
        decoding = [s for s in self._running if s.known - s.fed == 1]
        room = max(chunk // HEAVY_TOKENS_DIVISOR, 1)
        if light_in_batch and heavy_keys and self._hold_decodes:
            waiting = [s for s in decoding if s.owner in heavy_keys]
            if waiting:
                waiting.sort(key=_longest_held)
                reserve = max(room // 4, 1) if heavy_lines else 0
                turns = max(room - reserve, 1)
                for s in waiting[turns:]:
                    s.held += 1
                for s in waiting[:turns]:
                    s.held = 0
                held = set(waiting[turns:])
                decoding = [s for s in decoding if s not in held]
                room = max(room - len(waiting[:turns]), 1 if heavy_lines else 0)
        else:
            for s in decoding:
                s.held = 0
        for s in decoding:
            plan.append((s, s.fed, 1))
        budget = max(chunk - len(decoding), 0)
        # the heavy keys' prefill together: what is left of their room while a light key is
        # in the batch; half the budget while a light key has nothing in the batch but was
        # served lately (an eighth of a step's budget, fading), so that the step under way when
        # its next request comes is short too
        asked = list(demands)
        if heavy_lines:
            if light_in_batch:
                share = room
            elif any(a >= chunk / 8 for o, a in served.items() if o not in heavy_keys):
                share = chunk // 2
            else:
                share = budget
            caps = share_budget([demands[i] for i in heavy_lines], share, start=self._steps)
            for i, cap in zip(heavy_lines, caps, strict=True):
                asked[i] = cap
        recent = [served.get(owner, 0.0) for owner in lines]
        grants = share_budget_least_served(asked, recent, budget)
        for owner, grant in zip(lines, grants, strict=True):
            self._served.add(owner, grant)
        for line, grant in zip(lines.values(), grants, strict=True):
            for s in line:
                if grant <= 0:
                    break
                n = min(s.known - s.fed, grant)
                plan.append((s, s.fed, n))
                grant -= n
        if self._warming:
            self._plan_warmups(plan, bool(lines))
        return plan

    def _plan_warmups(self, plan: list[tuple[Sequence, int, int]], prefilling: bool) -> None:
        """Warm-ups take what requests leave of the step, oldest first: nothing while a prompt
        is being prefilled (its first token comes no later), a small slice beside decodes (the
        step hardly grows), `warmup_chunk_tokens` when nothing else runs (a request arriving
        waits for a short step at most). Counted towards their owners' fair share."""
        chunk = self.cfg.prefill_chunk_tokens
        if prefilling:
            return
        left = chunk - sum(n for _, _, n in plan)
        if self._running:
            left = min(left, max(chunk // WARMUP_BESIDE_DIVISOR, 1))
        else:
            left = min(left, self.cfg.warmup_chunk_tokens)
        for s in self._warming:
            if left <= 0:
                break
            n = min(s.known - s.fed, left)
            if n > 0:
                plan.append((s, s.fed, n))
                self._served.add(s.owner, n)
                left -= n

    def _heavy_keys(
        self, served: dict[str | None, float], demands: dict[str | None, int]
    ) -> set[str | None]:
        """The keys that count as heavy now, with hysteresis: a key becomes heavy once its
        recent prefill passes `HEAVY_PREFILL_STEPS` full steps' budget or the prompts it has in
        the batch still need more than `HEAVY_DEMAND_STEPS` steps' budget, and stays heavy while
        it still has more than a step of prompt to prefill or its recent prefill stays above
        an eighth of that. Without the hysteresis the throttle would undo itself: a heavy key
        held to a few positions a step soon has little recent prefill, counts as light,
        takes whole steps again, and the light keys' steps swing between short and long."""
        chunk = self.cfg.prefill_chunk_tokens
        enter = HEAVY_PREFILL_STEPS * chunk
        heavy = self._heavy
        for owner, amount in served.items():
            if amount >= enter:
                heavy.add(owner)
        for owner, demand in demands.items():
            if demand > HEAVY_DEMAND_STEPS * chunk:  # long prompts in hand: heavy at once
                heavy.add(owner)
        for owner in list(heavy):
            if served.get(owner, 0.0) < enter / 8 and demands.get(owner, 0) <= chunk:
                heavy.discard(owner)
        return heavy

    def _fit(self, plan: list[tuple[Sequence, int, int]]) -> list[tuple[Sequence, int, int]]:
        """Grow buffers for the plan; preempt the newest sequences while over the budget."""
        for s, start, n in plan:
            if s.kv is not None and start + n > s.kv.capacity:
                s.kv.reserve(start + n + GROW)
        budget = self.cfg.kv_budget_bytes
        while True:
            running = self._running_bytes()
            if running + self.cache.nbytes <= budget:
                return plan
            self.cache.shrink(max(budget - running, 0), unpin=False)
            if running + self.cache.nbytes <= budget:
                return plan
            if self._warming:  # warm-ups go first, before any sequence or session's pin
                warm = set(self._warming)
                self._drop_warmups("kv_pressure")
                plan = [p for p in plan if p[0] not in warm]
                continue
            # a heavy key with two or more sequences gives up its newest before any session
            # loses its pins; otherwise pins go, then the newest of the owner holding the most
            victim = self._heavy_victim()
            if victim is None:
                self.cache.shrink(max(budget - running, 0), unpin=True)
                if running + self.cache.nbytes <= budget or len(self._running) <= 1:
                    return plan
                victim = newest_of_largest(self._running, _owner, _order)
                assert victim is not None
            self._preempt(victim, "kv_budget")
            plan = [p for p in plan if p[0] is not victim]

    def _heavy_victim(self) -> Sequence | None:
        """The newest sequence of a heavy key running two or more, if any."""
        counts: dict[str | None, int] = {}
        for s in self._running:
            counts[s.owner] = counts.get(s.owner, 0) + 1
        heavy = [s for s in self._running if s.owner in self._heavy and counts[s.owner] >= 2]
        return max(heavy, key=_order) if heavy else None

    def _preempt(self, seq: Sequence, reason: str) -> None:
        self._running.remove(seq)
        self._publish(seq, make_room=False)  # the caller frees what it needs, its own way
        seq.kv, seq.fed = None, 0
        seq.held = 0
        seq.preemptions += 1
        self._preemptions += 1
        with self._cond:
            self._waiting.push_front(seq)
        log.info(
            "engine.preempted",
            request_id=seq.request.request_id,
            reason=reason,
            positions=seq.known,
            generated=len(seq.generated),
        )

    def _step(self) -> None:
        now = time.perf_counter()
        for seq in [s for s in self._running if s.request.cancel.is_set()]:
            self._finish(seq, "cancelled", now)
        limit = self.cfg.max_unread_deltas  # per choice: a request's n choices share one reader
        for seq in [s for s in self._running if s.job.unread > limit * s.request.sampling.n]:
            log.warning("engine.slow_reader", request_id=seq.request.request_id, unread=limit)
            self._finish(seq, "slow_reader", now)
        for seq in [s for s in self._warming if s.request.cancel.is_set()]:
            self._warming.remove(seq)
            seq.kv = None
            self._warm_end(seq, "dropped", reason="cancelled")
        if not self._running and not self._warming:
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
            if s.warm and s.fed == s.known and s in self._warming:
                self._warming.remove(s)
                done = self._keep_warm(s, pin=True)
                self._warm_end(s, "warmed", positions=done)
            if not sl.want_logits:
                continue
            if broken[row]:
                self._fail(s, EngineError("the model produced non-finite logits for this request"))
            elif s.forked or s.request.sampling.n == 1:
                self._advance(s, logits[row], now)
            else:
                try:
                    siblings = self._fork(s)
                except Exception as exc:  # the request's failure (its stream stops the rest)
                    log.exception("engine.fork_failed", request_id=s.request.request_id)
                    self._fail(s, EngineError(f"generation failed: {exc}"))
                else:
                    for c in (s, *siblings):
                        self._advance(c, logits[row], now)
            row += 1

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The other choices of `seq`'s request, at the end of its prompt: each gets a copy of
        the prompt's KV while the batch has free slots; the rest wait at the front of the
        queue like preempted sequences (the prompt's blocks in the prefix cache for them).
        Returns the siblings that joined the batch."""
        assert seq.kv is not None
        siblings = fork(seq, self.w)
        free = self.cfg.max_batch - self._slots()
        joined, parked = [], []
        for sibling in siblings:
            self._order += 1
            sibling.order = self._order
            if free <= 0:
                parked.append(sibling)
                continue
            sibling.kv, sibling.fed = copy_kv(seq.kv, seq.fed, seq.known + GROW), seq.fed
            self._running.append(sibling)
            joined.append(sibling)
            free -= 1
        if self._logprobs is not None:
            self._logprobs.share(seq, joined)
        if parked:
            self._publish(seq)
            with self._cond:
                for sibling in reversed(parked):
                    self._waiting.push_front(sibling)
        return joined

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
        if seq in self._running:
            self._running.remove(seq)
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
        try:  # the session's turn is its first choice
            self._publish(seq, keep_session=seq.index == 0)
        except Exception:  # losing a cache entry costs speed only
            log.exception("kv.keep_failed", request_id=seq.request.request_id)
        seq.kv = None

    def _fail(self, seq: Sequence, exc: EngineError) -> None:
        if seq in self._running:
            self._running.remove(seq)
        seq.kv = None
        seq.job.post(exc)

    def _publish(
        self, seq: Sequence, *, keep_session: bool = False, make_room: bool = True
    ) -> None:
        """Give the sequence's computed positions to the prefix cache (and its session); with
        `make_room`, then evict (pins too) whatever takes the total over the budget."""
        if seq.kv is None or seq.prompt is None or seq.fed <= 0:
            return
        n = seq.fed
        tokens = [*seq.prompt.tokens, *seq.generated][:n]
        images = [sp for sp in seq.prompt.images if sp.start < n]
        kv_key = seq.request.kv_key
        layers = seq.kv.layers
        # non-finite values anywhere reach the last layer's keys/values of their position:
        # such KV (a forward that overflowed) is never offered to another request
        if not bool(torch.isfinite(layers[-1][:, :, :n]).all()):
            log.warning("kv.not_finite", request_id=seq.request.request_id, positions=n)
            return
        if self.cache.enabled:
            keys = position_keys(tokens, images)
            hashes = block_hashes(tokens, images, self.cfg.block_size, seq.seed)
            kept = self.cache.insert(seq.seed, keys, hashes, layers, n)
            if keep_session and kv_key is not None:
                self.cache.pin(kv_key, kept)
        if keep_session and kv_key is not None and self.kv_store is not None:
            entry = spill_entry(tokens, images, layers, self.cfg.block_size, self.base_seed)
            if entry is not None:
                self.kv_store.put(kv_key, entry)
        budget = self.cfg.kv_budget_bytes
        over = self._running_bytes() + self.cache.nbytes - budget
        if make_room and over > 0:
            self.cache.shrink(max(budget - self._running_bytes(), 0), unpin=True)


class _Call:
    """A barrier that runs a function when the loop reaches it."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn

    def set(self) -> None:
        self._fn()
