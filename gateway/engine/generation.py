"""Per-token generation helpers, independent of how the forward pass is batched.

`sample_next` is greedy or temperature + top-p over one sequence's logits; `StreamDecoder` turns
generated ids into text deltas that never hold broken UTF-8 and never leak a stop string.
None of these know about threads or requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ("StreamDecoder", "sample_next")


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
