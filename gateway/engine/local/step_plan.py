"""The step builder: which positions of which running sequences one step feeds.

A step feeds one position for every decoding sequence, then prefill chunks under the per-step
token budget (`prefill_chunk_tokens`), so a long new prompt is spread over several steps while
the others keep streaming. The budget is split max-min fairly between owners (API keys), each
owner's share going to its oldest prompt first, the least served lately first
(`gateway.engine.local.fair_queue`). A key that counts as heavy (`StepPlanner.heavy_keys`: a lot
of prefill lately, or long prompts in hand) is held to a small room beside a light key, so the
light key's steps stay short.

KV warm-ups get only what requests leave of a step: nothing while a prompt is being prefilled,
`prefill_chunk_tokens // WARMUP_BESIDE_DIVISOR` positions beside running requests,
`warmup_chunk_tokens` in an otherwise idle step (so a request arriving waits for a short step at
most). Their positions count towards their owner's fair share like any prefill.

The planner only chooses: it never grows a buffer, frees memory or runs the model (the scheduler
fits the plan to the KV budget, `gateway.engine.local.kv.kv_memory`, and runs it). Its state is the
fair-share record (`served`, fading) and the keys that count as heavy now (`heavy`, with
hysteresis), which admission and preemption read too.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING

from gateway.engine.local.fair_queue import RecentService, share_budget, share_budget_least_served

if TYPE_CHECKING:
    from gateway.engine.local.sequence import SchedulerConfig, Sequence

__all__ = (
    "HEAVY_DEMAND_STEPS",
    "HEAVY_PREFILL_STEPS",
    "HEAVY_TOKENS_DIVISOR",
    "SERVED_HALF_LIFE_S",
    "WARMUP_BESIDE_DIVISOR",
    "StepPlanner",
)

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

_order = attrgetter("order")


def _longest_held(s: Sequence) -> tuple[int, int]:
    return (-s.held, s.order)


class StepPlanner:
    """Builds each step's plan from the running sequences; keeps the fair-share record."""

    __slots__ = ("cfg", "heavy", "hold_decodes", "served")

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        hold_decodes: bool,
        served: RecentService | None = None,
    ) -> None:
        self.cfg = config  # prefill_chunk_tokens and warmup_chunk_tokens are read
        # heavy keys' decodes are held beside a light key only where a step costs about the
        # positions it feeds (a CPU); on an accelerator a decode position is nearly free
        self.hold_decodes = hold_decodes
        # prefill tokens by owner, fading
        self.served = served if served is not None else RecentService(SERVED_HALF_LIFE_S)
        self.heavy: set[str | None] = set()  # keys counted as heavy now (`heavy_keys`)

    def plan(
        self, running: list[Sequence], warming: list[Sequence], step: int
    ) -> list[tuple[Sequence, int, int]]:
        """(sequence, start, length) for this step: decodes first, then prefill chunks, the
        budget shared fairly between owners and each owner's share given oldest first.

        While a light key has a sequence in the batch, the heavy keys (`heavy_keys`) together
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
        served = self.served.now()
        lines: dict[str | None, list[Sequence]] = {}  # owners by their oldest prompt
        for s in sorted((s for s in running if s.known - s.fed > 1), key=_order):
            lines.setdefault(s.owner, []).append(s)
        demands = [sum(s.known - s.fed for s in line) for line in lines.values()]
        heavy_keys = self.heavy_keys(served, dict(zip(lines, demands, strict=True)))
        light_in_batch = any(s.owner not in heavy_keys for s in running)
        heavy_lines = [i for i, owner in enumerate(lines) if owner in heavy_keys]
        decoding = [s for s in running if s.known - s.fed == 1]
        room = max(chunk // HEAVY_TOKENS_DIVISOR, 1)
        if light_in_batch and heavy_keys and self.hold_decodes:
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
            caps = share_budget([demands[i] for i in heavy_lines], share, start=step)
            for i, cap in zip(heavy_lines, caps, strict=True):
                asked[i] = cap
        recent = [served.get(owner, 0.0) for owner in lines]
        grants = share_budget_least_served(asked, recent, budget)
        for owner, grant in zip(lines, grants, strict=True):
            self.served.add(owner, grant)
        for line, grant in zip(lines.values(), grants, strict=True):
            for s in line:
                if grant <= 0:
                    break
                n = min(s.known - s.fed, grant)
                plan.append((s, s.fed, n))
                grant -= n
        if warming:
            self._plan_warmups(plan, warming, requests=bool(running), prefilling=bool(lines))
        return plan

    def _plan_warmups(
        self,
        plan: list[tuple[Sequence, int, int]],
        warming: list[Sequence],
        *,
        requests: bool,
        prefilling: bool,
    ) -> None:
        """Warm-ups take what requests leave of the step, oldest first: nothing while a prompt
        is being prefilled (its first token comes no later), a small slice beside decodes (the
        step hardly grows), `warmup_chunk_tokens` when nothing else runs (a request arriving
        waits for a short step at most). Counted towards their owners' fair share."""
        chunk = self.cfg.prefill_chunk_tokens
        if prefilling:
            return
        left = chunk - sum(n for _, _, n in plan)
        if requests:
            left = min(left, max(chunk // WARMUP_BESIDE_DIVISOR, 1))
        else:
            left = min(left, self.cfg.warmup_chunk_tokens)
        for s in warming:
            if left <= 0:
                break
            n = min(s.known - s.fed, left)
            if n > 0:
                plan.append((s, s.fed, n))
                self.served.add(s.owner, n)
                left -= n

    def heavy_keys(
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
        heavy = self.heavy
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
