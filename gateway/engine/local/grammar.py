"""Grammar-constrained decoding (llguidance) and the model's tokens as bytes.

`TokenVocab` is the model's vocabulary as llguidance sees it: an `LLTokenizer` built on a
background thread when the engine starts (it takes about a second and holds the GIL), shared
by replicas of the same weights. Its stop tokens are the scheduler's, so a grammar that is
complete allows exactly the tokens the scheduler ends on. It also gives each token's own
bytes, for log-probabilities.

Measured (`python -m bench.structured`, SmolLM2-135M on a 2-core CPU): the grammar work of a
step is about 0.3 ms for one JSON-schema sequence and 1.3 ms for eight, against 100-400 ms for
the step's forward on that (busy) machine; the decoding pace with and without a grammar is the
same within noise.

`compile_grammar` turns a request's grammar (llguidance's Lark syntax, JSON schemas embedded
with `%json`) into a matcher, or refuses it with `invalid_request`. `GrammarMasks` computes the
next-token masks of a step's constrained sequences on a worker thread while the forward pass
runs (llguidance releases the GIL), and applies them to their logits rows after it. A mask
depends only on the tokens a matcher has consumed, so the step's forward and its masks are
independent; waiting for the masks costs nothing once the forward is slower than they are.
Sequences without a grammar never reach this module.

A mask is applied as an additive bias (0 or -inf per token) looked up a byte of the bit mask at
a time from a 256 x 8 table, then added to the row in place: about a tenth of a millisecond per
row on a CPU. llguidance's own torch helper compiles its kernel with `torch.compile` (a C++
toolchain and seconds on first use on a CPU host), and unpacking bits with elementwise shifts
and `masked_fill` costs several times more per row.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.torch
import structlog
import torch

from gateway.engine.interface import EngineError

__all__ = ("MAX_GRAMMAR_CHARS", "GrammarMasks", "TokenVocab", "compile_grammar")

log = structlog.get_logger(__name__)

# A grammar is compiled on the thread every stream shares: its size bounds that work.
MAX_GRAMMAR_CHARS = 64 * 1024
# Explicit bounds on one matcher's work and memory (llguidance's defaults are looser): a grammar
# comes from a request and its masks are computed beside every stream's step. Past a bound the
# matcher errs, which fails that sequence alone. Fuel is ~14k units per ms per step.
PARSER_LIMITS = {
    "max_lexer_states": 50_000,  # lexer DFA states (its memory)
    "step_lexer_fuel": 100_000,  # one token's mask: ~7 ms at most
    "initial_lexer_fuel": 1_000_000,  # building the regexes once
    "step_max_items": 50_000,  # Earley items per step
}

# per byte value of a bit mask, the bias of its 8 tokens, least significant bit first
# (0: allowed, -inf: refused); [256, 8]
_BYTE_BIAS = torch.tensor(
    [[0.0 if value >> bit & 1 else float("-inf") for bit in range(8)] for value in range(256)]
)


class TokenVocab:
    """The model's tokens for llguidance (built in the background from the moment it is made)
    and as bytes. `eos_ids`: the tokens generation ends on, which a complete grammar allows."""

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self.eos_ids = sorted(eos_ids)
        self._built = threading.Event()
        self._lltok: llguidance.LLTokenizer | None = None
        self._error: str | None = None
        self._tokens: dict[int, tuple[str, bytes, int]] = {}
        threading.Thread(target=self._build, name="llguidance-vocab", daemon=True).start()

    def _build(self) -> None:
        try:
            import llguidance.hf  # imports transformers: only where a model is loaded anyway

            self._lltok = llguidance.hf.from_tokenizer(self._tokenizer, eos_token=self.eos_ids)
        except Exception as exc:  # a slow (Python) tokenizer: no grammars on this model
            self._error = f"{type(exc).__name__}: {exc}"
            log.warning("grammar.vocab_unavailable", error=self._error)
        finally:
            self._built.set()

    def lltokenizer(self) -> llguidance.LLTokenizer:
        """The LLTokenizer (waits for the build); EngineError when this tokenizer has none."""
        self._built.wait()
        if self._lltok is None:
            raise EngineError(
                f"this model's tokenizer does not support grammars ({self._error})",
                code="invalid_request",
            )
        return self._lltok

    @property
    def size(self) -> int:
        """Tokens the tokenizer knows (the logits may be wider: the extra columns are padding)."""
        self._built.wait()
        if self._lltok is None:
            return len(self._tokenizer)
        return int(self._lltok.vocab_size)

    def token(self, token_id: int) -> tuple[str, bytes, int]:
        """(text, bytes, bytes it adds to the answer's text) of one token: a special token
        shows its name but adds nothing, since the answer's text leaves special tokens out."""
        hit = self._tokens.get(token_id)
        if hit is None:
            self._built.wait()
            lltok = self._lltok
            if lltok is not None:
                raw = lltok.decode_bytes([token_id])
                counted = 0 if lltok.is_special_token(token_id) else len(raw)
            else:
                raw = self._tokenizer.decode([token_id]).encode()
                counted = len(raw)
            hit = self._tokens[token_id] = (raw.decode("utf-8", errors="replace"), raw, counted)
        return hit


def compile_grammar(vocab: TokenVocab, source: str) -> llguidance.LLMatcher:
    """A fresh matcher for `source` (Lark syntax); EngineError `invalid_request` if it is bad.
    Its size is checked with the request (`MAX_GRAMMAR_CHARS`)."""
    lltok = vocab.lltokenizer()
    try:
        matcher = llguidance.LLMatcher(
            lltok,
            llguidance.LLMatcher.grammar_from_lark(source),
            log_level=0,
            limits=llguidance.LLParserLimits(**PARSER_LIMITS),
        )
    except Exception as exc:  # llguidance reports grammar errors as state, but be sure
        raise EngineError(f"invalid grammar: {exc}", code="invalid_request") from None
    if matcher.is_error():
        raise EngineError(f"invalid grammar: {matcher.get_error()}", code="invalid_request")
    return matcher


class GrammarMasks:
    """A step's next-token masks: `start` before the forward, `apply` after it."""

    def __init__(self, vocab: TokenVocab) -> None:
        self._vocab = vocab
        self._pool: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._bitmask: torch.Tensor | None = None  # [rows, words] int32
        self._pending: Future[None] | None = None
        self._bias: dict[torch.device, torch.Tensor] = {}  # _BYTE_BIAS per device

    def start(self, matchers: list[llguidance.LLMatcher]) -> None:
        """Begin computing the masks of `matchers` (rows in that order) on the worker thread."""
        self._wait()
        size = self._vocab.size
        words = (size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < len(matchers):
            self._bitmask = llguidance.torch.allocate_token_bitmask(max(len(matchers), 8), size)
        assert self._bitmask.shape[1] == words
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        self._pending = self._pool.submit(self._fill, matchers, self._bitmask)

    def _fill(self, matchers: list[llguidance.LLMatcher], bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            llguidance.torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llguidance.torch.fill_next_token_bitmask_par(
            self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def apply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Wait for the masks started last, then set the logits of disallowed tokens (and of
        columns beyond the tokenizer's vocabulary) to -inf in `rows` of `logits` [n, V]."""
        self._wait()
        assert self._bitmask is not None
        k = len(rows)
        # token 32w + j is bit j of word w: bytes in little-endian order, 8 tokens each
        octets = self._bitmask[:k].view(torch.uint8)  # [k, 4 * words]
        if sys.byteorder != "little":
            octets = octets.view(k, -1, 4).flip(-1).reshape(k, -1)
        device = logits.device
        table = self._bias.get(device)
        if table is None:
            table = self._bias[device] = _BYTE_BIAS.to(device)
        index = octets.reshape(-1).to(device=device, dtype=torch.long)
        bias = table.index_select(0, index).view(k, -1)  # [k, 32 * words]
        width = min(logits.shape[1], self._vocab.size)
        for i, row in enumerate(rows):
            logits[row, :width].add_(bias[i, :width])
            if logits.shape[1] > width:  # the lm_head's padding columns
                logits[row, width:] = float("-inf")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
