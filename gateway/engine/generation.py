"""Plain generation steps for a transformers causal LM with a growing KV cache.

`prefill` runs prompt embeddings through the model (in chunks, extending the cache) and returns
the last position's logits; `decode_one_token` feeds one sampled token; `sample_next` is greedy
or temperature + top-p. `StreamDecoder` turns generated ids into text deltas that never hold
broken UTF-8 and never leak a stop string. None of these know about threads or requests.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = (
    "StreamDecoder",
    "cache_kwarg",
    "decode_one_token",
    "make_cache",
    "prefill",
    "sample_next",
)

PREFILL_CHUNK = 512


def cache_kwarg(model: Any) -> str:
    """transformers 5.x calls the cache argument `cache`; older releases `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def make_cache(
    model: Any, layers: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
) -> Any:
    """A DynamicCache, optionally pre-filled with per-layer (keys, values) [1, Hkv, S, D]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if layers:
        for idx, (k, v) in enumerate(layers):
            cache.update(k, v, idx)
    return cache


def prefill(
    model: Any,
    cache: Any,
    embeds: torch.Tensor,  # [1, S, H] prompt positions not yet in `cache`
    *,
    cache_arg: str = "cache",
    should_stop: Callable[[], bool] | None = None,
    chunk: int = PREFILL_CHUNK,
) -> torch.Tensor | None:
    """Extend `cache` with `embeds`; return logits of the last position [vocab] (None if stopped)."""
    logits = None
    total = embeds.shape[1]
    for start in range(0, total, chunk):
        if should_stop is not None and should_stop():
            return None
        part = embeds[:, start : start + chunk]  # [1, s, H]
        out = model(inputs_embeds=part, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
        logits = out.logits[0, -1]  # [vocab]
    return logits


def decode_one_token(
    model: Any, cache: Any, token_id: int, *, cache_arg: str = "cache"
) -> torch.Tensor:
    """Feed one token; return the next-token logits [vocab]."""
    ids = torch.tensor([[token_id]], device=model.device)  # [1, 1]
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
    return out.logits[0, -1]  # [vocab]


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
