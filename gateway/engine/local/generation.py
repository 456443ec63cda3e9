"""Per-token generation helpers, independent of how the forward pass is batched.

`sample_next` is greedy or temperature + top-p over one sequence's logits; `StreamDecoder` turns
generated ids into text deltas that never hold broken UTF-8 and never leak a stop string;
`LogprobTrail` holds each token's log-probabilities back until the text of that token has gone
out in a delta. None of these know about threads or requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ("LogprobTrail", "StreamDecoder", "sample_next")


def sample_next(
    logits: torch.Tensor,  # [vocab]
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> int:
    """Greedy when temperature == 0, else temperature + nucleus (top-p) sampling."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    # shift before dividing: a tiny temperature must not overflow the logits to inf (NaN probs)
    scaled = logits.float()
    probs = torch.softmax((scaled - scaled.max()) / temperature, dim=-1)  # [vocab]
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs.cpu(), 1, generator=generator)
        return int(order.cpu()[choice])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class StreamDecoder:
    """Incremental detokenization with stop strings.

    Decodes the whole id list each step and emits the new suffix, holding back a trailing
    incomplete character (U+FFFD from a split multi-byte sequence) and any suffix that could
    still grow into a stop string. `text` is everything emitted so far.
    """

    __slots__ = ("_decode", "_stops", "ids", "stopped", "text")

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stops = tuple(s for s in stops if s)
        self.ids: list[int] = []
        self.text = ""  # emitted so far
        self.stopped = False  # a stop string was found

    def _held_back(self, full: str) -> int:
        """How many trailing chars of `full` might be the start of a stop string."""
        keep = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(full)), keep, -1):
                if full.endswith(stop[:n]):
                    keep = n
                    break
        return keep

    def push(self, token_id: int) -> str:
        """Add one id; return the text that can be emitted now ("" if none)."""
        self.ids.append(token_id)
        full = self._decode(self.ids)
        if self._stops:
            window = max(0, len(self.text) - max(len(s) for s in self._stops))
            hits = [i for s in self._stops if (i := full.find(s, window)) >= 0]
            if hits:
                self.stopped = True
                return self._emit(full[: min(hits)])
        end = len(full)
        while end > 0 and full[end - 1] == "\ufffd":
            end -= 1
        end -= self._held_back(full[:end])
        return self._emit(full[:end])

    def finish(self) -> str:
        """Flush what was held back (no more ids are coming)."""
        if self.stopped:
            return ""
        full = self._decode(self.ids).rstrip("\ufffd")
        return self._emit(full)

    def _emit(self, upto: str) -> str:
        if len(upto) <= len(self.text) or not upto.startswith(self.text):
            return ""
        delta = upto[len(self.text) :]
        self.text = upto
        return delta


class LogprobTrail:
    """Per-token log-probabilities waiting for their text to be sent.

    A token goes out with the delta that completes its text: `add` records where its bytes end
    in the answer, `sent` counts the answer's bytes emitted so far, and `take` returns the
    tokens that lie wholly inside them. What is left when the answer ends (held back, then cut
    by a stop string, or never flushed) is `rest`.
    """

    __slots__ = ("_end", "_pending", "sent")

    def __init__(self) -> None:
        self._pending: list[tuple[int, Any]] = []  # (byte offset where the token ends, entry)
        self._end = 0
        self.sent = 0

    def add(self, entry: Any, nbytes: int) -> None:
        self._end += nbytes
        self._pending.append((self._end, entry))

    def take(self) -> tuple[Any, ...]:
        n = 0
        while n < len(self._pending) and self._pending[n][0] <= self.sent:
            n += 1
        taken = tuple(entry for _, entry in self._pending[:n])
        del self._pending[:n]
        return taken

    def rest(self) -> tuple[Any, ...]:
        rest = tuple(entry for _, entry in self._pending)
        self._pending.clear()
        return rest
