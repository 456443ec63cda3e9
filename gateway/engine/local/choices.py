"""A step's logits into each sequence's next token, and a prompt into its n choices.

Per step, for the sequences whose logits the forward gave: `StepLogprobs` takes the
log-softmax of the raw logits of the rows that asked for log-probabilities (one batched call,
before temperature, top-p or a grammar; columns beyond the tokenizer's vocabulary left out) and
their top alternatives; the scheduler then applies grammar masks (`gateway.engine.local.grammar`);
`advance` samples each sequence's token, feeds it to its grammar matcher and its streaming
detokenizer, and `emit` posts the text with the log-probabilities of the tokens it completes.
A row that asks for neither costs nothing here beyond sampling.

A request with n > 1 choices is one sequence while its prompt is prefilled. At the step that
computes the prompt's last position, `fork` makes the other n - 1 sequences: same prompt,
copies of the grammar matcher (nothing consumed yet), their own detokenizer and sampler (seed +
i). Each then samples its first token from the same logits row. The scheduler gives each
sibling a copy of the prompt's KV: buffers are contiguous per sequence (the layout attention
reads fastest on a CPU, see `gateway.engine.local.batch`), so sharing blocks through the prefix
cache
would copy the same bytes into each sibling's buffer anyway, and a direct copy works with
prefix caching off. From then on siblings are ordinary sequences: counted in the batch and the
KV budget, preempted and resumed on their own, each ending with its own result.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from gateway.engine.interface import EngineError, GenerationResult, TextDelta, TokenLogprob
from gateway.engine.local.batch import SeqKV
from gateway.engine.local.generation import LogprobTrail, sample_next
from gateway.engine.local.sequence import (
    Sequence,
    choice_generator,
    ms,
    new_decoder,
    sequence_result,
)

if TYPE_CHECKING:
    from gateway.engine.local.grammar import TokenVocab
    from gateway.engine.local.weights import LoadedModel

__all__ = ("StepLogprobs", "advance", "copy_kv", "emit", "fork", "post_results")

# the floor of a reported log-probability (a probability that underflowed to zero), as OpenAI's
MIN_LOGPROB = -9999.0


class StepLogprobs:
    """Log-probabilities of one step's rows that ask for them, and their top alternatives."""

    __slots__ = ("_lp", "_row", "_top_ids", "_top_values", "_vocab", "_width")

    def __init__(self, logits: torch.Tensor, rows: dict[Sequence, int], vocab: TokenVocab) -> None:
        """`rows`: the logits row of each sequence that asks for log-probabilities."""
        self._vocab = vocab
        self._width = min(logits.shape[1], vocab.size)
        index = torch.tensor(list(rows.values()), device=logits.device)
        picked = logits.index_select(0, index)[:, : self._width].float()  # [r, V]
        self._lp = torch.log_softmax(picked, dim=-1)
        self._row = {seq: i for i, seq in enumerate(rows)}
        k = max(seq.request.sampling.logprobs or 0 for seq in rows)
        if k > 0:
            values, ids = self._lp.topk(k, dim=-1)  # [r, k]
            self._top_values, self._top_ids = values.tolist(), ids.tolist()
        else:
            self._top_values = self._top_ids = [[] for _ in rows]

    def share(self, seq: Sequence, siblings: list[Sequence]) -> None:
        """Choices just forked from `seq` sample from its row."""
        if seq in self._row:
            for sibling in siblings:
                self._row[sibling] = self._row[seq]

    def entry(self, seq: Sequence, token: int, k: int) -> TokenLogprob:
        """The sampled `token` of `seq`, with its row's k most likely tokens."""
        i = self._row[seq]
        value = float(self._lp[i, token]) if token < self._width else float("-inf")
        text, raw, _ = self._vocab.token(token)
        top = []
        for tid, v in zip(self._top_ids[i][:k], self._top_values[i][:k], strict=True):
            t_text, t_raw, _ = self._vocab.token(tid)
            top.append((t_text, max(v, MIN_LOGPROB), t_raw))
        return TokenLogprob(text, max(value, MIN_LOGPROB), raw, tuple(top))


def advance(
    seq: Sequence,
    logits: torch.Tensor,  # [V], grammar mask applied
    logprobs: StepLogprobs | None,
    eos_ids: frozenset[int],
    vocab: TokenVocab,
    now: float,
) -> str | None:
    """Sample the next token of `seq` and stream what it adds; the finish reason if it ends."""
    sp = seq.request.sampling
    token = sample_next(logits, sp.temperature, sp.top_p, seq.generator)
    seq.generated.append(token)
    if seq.first_token is None:
        seq.first_token = now
    if token in eos_ids:  # the end is no part of the answer: no text, no log-probability
        return "stop"
    matcher = seq.matcher
    if matcher is not None and not matcher.consume_token(token):
        raise EngineError(f"the grammar refused the sampled token: {matcher.get_error()}")
    if seq.trail is not None:
        assert logprobs is not None and sp.logprobs is not None
        seq.trail.add(logprobs.entry(seq, token, sp.logprobs), vocab.token(token)[2])
    assert seq.decoder is not None
    delta = seq.decoder.push(token)
    if delta:
        emit(seq, delta, now)
    if seq.decoder.stopped or (matcher is not None and matcher.is_stopped()):
        return "stop"
    if len(seq.generated) >= seq.max_new:
        return "length"
    return None


def emit(seq: Sequence, text: str, now: float) -> None:
    """Post a text delta of `seq`, with the log-probabilities of the tokens it completes."""
    logprobs: tuple[TokenLogprob, ...] = ()
    if seq.trail is not None:
        seq.trail.sent += len(text.encode())
        logprobs = seq.trail.take()
    seq.job.post(TextDelta(text, index=seq.index, logprobs=logprobs))
    if seq.first_delta is None:
        seq.first_delta = now
    else:
        seq.itl.append(ms(now - (seq.last_delta or now)))
    seq.last_delta = now


def post_results(seq: Sequence, finish: str, now: float) -> GenerationResult:
    """Post what `seq` ends with: its result, or one per choice if it ends before it forked
    (its request's stream waits for n). Returns its own."""
    result = sequence_result(seq, finish, now)
    seq.job.post(result)
    if not seq.forked:
        for i in range(1, seq.request.sampling.n):
            seq.job.post(dataclasses.replace(result, index=i, logprobs=()))
    return result


def fork(seq: Sequence, w: LoadedModel) -> list[Sequence]:
    """The request's other choices, at the end of the prompt `seq` has just computed (no KV
    yet: the scheduler copies it or parks them). Marks `seq` as forked."""
    sp = seq.request.sampling
    seq.forked = True
    siblings = []
    for i in range(1, sp.n):
        sibling = Sequence(
            seq.job,
            index=i,
            forked=True,
            prompt=seq.prompt,
            image_keys=seq.image_keys,
            seed=seq.seed,
            max_new=seq.max_new,
            cached=seq.cached,
            admitted=seq.admitted,
            prefill_chunks=seq.prefill_chunks,
        )
        sibling.decoder = new_decoder(w, sp.stop)
        if sp.temperature > 0.0:
            sibling.generator = choice_generator(sp.seed, i)
        if seq.matcher is not None:
            sibling.matcher = seq.matcher.deep_copy()
        if sp.logprobs is not None:
            sibling.trail = LogprobTrail()
        siblings.append(sibling)
    return siblings


def copy_kv(kv: SeqKV, n: int, capacity: int) -> SeqKV:
    """A new buffer holding the first `n` positions of `kv` (a sibling's copy of the prompt)."""
    copy = SeqKV(len(kv.layers), kv.kv_heads, kv.head_dim, capacity, kv.dtype, kv.device)
    copy.load(kv.layers, 0, n)
    return copy
