"""Admission: may the best queued generation join the running batch now? (paper 000 §4.4)

Two checks, kept apart from the ranking so every policy can reuse them:

* :func:`fits` -- the batch cap and KV memory (the engine owns the memory accounting);
* :func:`latency_guided` -- the most urgent running generation must still finish its segment
  within its remaining budget when the batch grows. Its worst-case time is
  ``WCET = run_cost(candidate) + (l_max − tokens of its segment so far) · step_s(b + 1)``, where
  ``run_cost`` is the prefill or swap-in the candidate adds to the next iteration and
  ``step_s(b + 1)`` is the observed recent decode-step time scaled by the engine's latency
  model from b to b + 1 generations. The budget is the slack until the robot needs that
  segment: ``need + ERT − now − comm``.

Once the most urgent running generation has missed that deadline (budget ≤ 0), the paper's
test refuses every less urgent candidate, for nothing: no refusal can make it keep a deadline
it already missed. Under overload, when nearly every goal is late, that kept the batch at a
handful of generations while the rest of the fleet waited (issue 13). So past that point
admission limits losses instead of guarding a deadline (:func:`latency_guided`): Eq. 1 keeps
falling at slope α past ERT, and past the zero-utility time too, so every second of delay
costs a late goal −α. The candidate joins if the running generations lose less from its
extra delay (:func:`delay_cost`: the late ones for all of it, those still on time for the part
past their deadline) than the queue loses by waiting: the candidate's own lateness, and the
goals already past their zero-utility time (:func:`lost`) that could join the batch now
(:func:`queue_loss_rate`). With a few late goals (a short overload of a small fleet, a costly
prefill) the running ones win and the batch stays small so that they finish sooner; with a
queue full of lost goals the batch grows as vLLM's would. While the most urgent running
generation is on time, the paper's test is unchanged, and the ranking (which puts goals that
can still earn utility first) is the policy's, untouched.

Each test prices the candidate's own run cost, but a round's joins all stall the batch: an
engine that prefills whole (vLLM 0.5) runs every join's prefill in iterations in which no
running generation decodes, and a chunked prefill spreads the same work over the running ones'
iterations. A round of many joins, each admitted on its own, can so delay the most urgent
running generation by many times what any one test saw (measured in issue 28's contended
regime, where each prefill is a whole prompt). With a round stall budget
(``latency_guided(..., round_stall=k)``), once a round has admitted a join a less urgent
candidate joins only while the run costs of the round's joins stay within ``k`` times the
most urgent running generation's remaining segment time (:class:`BatchColumns` keeps the
sum). Where the seen bound below judges that generation, only the joins less urgent than it
count: those at least as urgent (its peers of one event, often itself) prefill first whatever
is refused, and counting them left the default regime's normal goals waiting behind urgent
ones for nothing (measured in the README).

The loss test weighs a waiting candidate's own loss only past its deadline: a candidate with
slack loses nothing by waiting, so any delay cost to a late running generation refuses it.
But once the batch's most urgent generation is late, refusing defers the join rather than
avoiding it (the batch it joins later is as late), while the wait uses up the candidate's
slack and lengthens its response. With a waiting weight ρ
(``latency_guided(..., waiting_weight=ρ)``) the loss test also counts the part of the wait
within the candidate's slack, at ρ times its slope α (ρ = 1: as if its deadline were now).

The worst case l_max can miss a deadline before any join: on the default calibration a drone's
first segment at l_max = 10 tokens takes 10 × 22 ms, past an urgent goal's 0.2 s ERT, while
its first skill is 4 tokens long. Then refusing cannot save the most urgent generation at its
worst case, and the paper's test turns every less urgent candidate away until that segment is
done, at no gain: with the batch cap and memory only, the same goals kept every urgent goal's
utility (WID1, default regime). With a seen bound s
(``latency_guided(..., seen_bound=s)``), while the batch holds at most s of its cap, such a
most urgent generation is judged at the longest segment seen so far for its robot kind and
position (first segment or later; ``AdmissionContext.seen_segment_tokens``) plus
:data:`SEEN_MARGIN_TOKENS`, instead of l_max. Above that share the test stays the paper's: in
an engine with a small cap (the paper's 8) the generations joined ahead take the slots that
the next urgent goals need.

That last point holds for resumes too. A suspended plan's next segment is queued as soon as
its segment is cut, long before its robot has executed the previous one; with a few slots
free Eq. 4's order lets it in early, and it holds its slot through its segment while the next
burst of urgent goals waits for one (the paper's setup, seeds 0–4: urgent utility 1.661 on
the authors' drone workload, 1.763 with half the slots kept from early resumes). With a
resume reserve r (:func:`keeps_resume_reserve`), an early
resume (budget > 0) less urgent than the batch's most urgent generation does not take one of
the last r of the batch's slots while no queued goal has lost its utility (then a free slot
is worth more to it than to a goal that may come).

The urgency tie lets a candidate whose budget is within one segment generation time of the
batch's most urgent generation join at once: goals of one event arrive milliseconds apart,
and serialising them would make each wait a segment for nothing. That holds while a join is
cheap. Without a prefix cache each join prefills a whole prompt, and a burst of urgent goals
that joins together prefills together: on WID2 (seed 0) four urgent goals of one burst cut
their four-token first segments 0.73 s after they arrived, past the 0.5 s at which their
utility is gone, where joining one after the other would have kept the first ones'. With a
tie run cost c (``latency_guided(..., tie_run_cost=c)``) a tied candidate (its budget within
the tie of the batch's most urgent generation's, on either side) joins at once only while its
run cost is at most c tie windows (the wait it would save); a dearer one takes the test of a
less urgent candidate. Only a candidate more urgent by more than the tie joins at once
whatever its cost. (Eq. 4 can rank the later of two goals of one burst first: past its ERT
the earlier one has less utility left. With a one-sided tie the earlier one, admitted second,
counted as more urgent than the first and joined at once.)
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Literal, overload

import numpy as np

from timelyllm_ros.core.queue import Column, QueueView
from timelyllm_ros.core.request import Generation
from timelyllm_ros.core.running import RunningBatch
from timelyllm_ros.engines.base import EngineView

LostSlopes = tuple[float, int]   # (Σ −α, count) over the queued goals past zero utility
DecodeSteps = Callable[[int], float]    # batch size -> the engine's decode-step time (s)

BatchMode = Literal['latency-guided', 'fixed']
BATCH_MODES: tuple[BatchMode, ...] = ('latency-guided', 'fixed')
"""How a policy with latency-guided admission sizes its batch: ``latency-guided`` (§4.4), or
``fixed``: by the batch cap and memory only, as the paper's batch-size sweeps (§7.3.1, Fig. 7
and 8) and the authors' artifact run it."""


@dataclass(frozen=True, slots=True)
class AdmissionContext:
    """What an admission test (and every policy hook) may look at: built once per tick.

    ``running`` is a live view of the batch: it follows admissions and preemptions within the
    tick. Read it; never keep it.
    """

    now: float                                  # s
    comm_s: float                               # one-way network latency (s)
    engine: EngineView                          # read-only: policies never drive the engine
    running: Collection[Generation]             # generations in the batch (live view)
    max_batch: int                              # batch cap of this run
    recent_step_s: float | None                 # observed decode-step time, None before any
    max_segment_tokens: Callable[[Generation], int]  # l_max of a generation's robot profile
    urgency_tie_s: Callable[[Generation], float] | None = None  # budgets closer than this tie
                                                # (the same for a robot profile's generations)
    seen_segment_tokens: Callable[[Generation], int | None] | None = None  # longest segment
                                                # seen for a generation's robot kind and
                                                # position (first or later), None before any
    queued: Sequence[Generation] = ()           # generations in the queue (do not mutate)
    batch_mode: BatchMode = 'latency-guided'    # 'fixed': only the cap and memory admit
    ranked: QueueView | None = None             # the queue as this decision ranked it (its
                                                # first len(queued) rows are still queued);
                                                # None outside an admission round
    lost_tally: LostTally | None = None         # the queue's lost goals, kept up to date
                                                # within an admission round
    batch_columns: BatchColumns | None = None   # the running batch as arrays, kept up to
                                                # date within an admission round
    decode_steps: DecodeSteps | None = None     # the engine's decode-step model for an
                                                # admission round (round_decode_steps)
    replica_batches: ReplicaBatches | None = None   # a pool's batch split by replica, kept
                                                # up to date within an admission round
    running_columns: RunningBatch | None = None  # ``running``'s columns, where the scheduler
                                                # keeps them (None: read each generation)


def fits(candidate: Generation, ctx: AdmissionContext) -> bool:
    """Batch cap and KV memory."""
    if len(ctx.running) >= ctx.max_batch:
        return False
    return ctx.engine.can_run(candidate.task_id)


def budget_s(generation: Generation, ctx: AdmissionContext) -> float:
    """Time left before the robot needs the segment being generated."""
    return generation.need_time + generation.ert_s - ctx.now - ctx.comm_s


@overload
def zero_utility_budgets(ref: float, ert: float, beta: float, alpha: float, now: float,
                         comm_s: float) -> float: ...
@overload
def zero_utility_budgets(ref: Column, ert: Column, beta: Column, alpha: Column, now: float,
                         comm_s: float) -> Column: ...
def zero_utility_budgets(ref, ert, beta, alpha, now, comm_s):  # type: ignore[no-untyped-def]
    """Time left before a segment can earn no utility any more, for one segment or a queue's
    columns (the one formula of the lost-goal rule).

    The zero-utility time of the governing TUF (TUF₀ for k = 0, TUF₁ with ERT 0 for k ≥ 1,
    :mod:`timelyllm_ros.core.tuf`) is ``ert − β/α`` after ``ref``, when the robot needs the
    segment; less the time to reach the robot: ``ref + ert − β/α − now − comm`` (``inf`` for
    a flat TUF, α = 0).
    """
    if isinstance(alpha, (float, int)):     # one segment: the same operations, on floats
        return ref + ert - (beta / alpha if alpha < 0.0 else -math.inf) - now - comm_s
    steep = np.less(alpha, 0.0)
    slope_term = np.divide(beta, alpha, out=np.full(np.shape(alpha), -np.inf), where=steep)
    return ref + ert - slope_term - now - comm_s


def zero_utility_budget_s(generation: Generation, ctx: AdmissionContext) -> float:
    """Time left before the segment being generated can earn no utility any more
    (:func:`zero_utility_budgets`)."""
    return _budget_at(generation, ctx.now, ctx.comm_s)


def _budget_at(generation: Generation, now: float, comm_s: float) -> float:
    tuf = generation.spec.tuf
    return zero_utility_budgets(generation.need_time, generation.ert_s, tuf.beta, tuf.alpha,
                                now, comm_s)


def lost(generation: Generation, ctx: AdmissionContext) -> bool:
    """Whether the segment being generated is past its zero-utility time: even delivered now
    it earns nothing (its utility only falls further, at slope α, while it waits)."""
    return zero_utility_budget_s(generation, ctx) <= 0.0


def lost_slopes(queue: QueueView, now: float, rows: int | None = None) -> LostSlopes:
    """``(Σ −α, count)`` over the queued segments past their zero-utility time (the first
    ``rows`` of the view: the queue swap-removes, so they are the ones still queued), the
    rule of :func:`lost` vectorised over the queue."""
    n = len(queue) if rows is None else rows
    alpha = queue.alpha[:n]
    late = (alpha < 0.0) & (zero_utility_budgets(queue.ref_time[:n], queue.ert[:n],
                                                 queue.beta[:n], alpha, now,
                                                 queue.comm_s) <= 0.0)
    return float(-alpha[late].sum()), int(late.sum())


class LostTally:
    """The lost queued goals' ``(Σ −α, count)`` through one admission round: computed over
    the queue at the first question (most decisions never ask: only once the most urgent
    running goal is late), then kept as the round takes generations out of the queue, so a
    decision of k admissions scans the queue at most once."""

    def __init__(self, view: QueueView, now: float, rows: Callable[[], int]) -> None:
        self._view, self._now, self._rows = view, now, rows
        self._slopes: LostSlopes | None = None

    def slopes(self) -> LostSlopes:
        if self._slopes is None:
            self._slopes = lost_slopes(self._view, self._now, self._rows())
        return self._slopes

    def taken(self, generation: Generation) -> None:
        """``generation`` left the queue during the round."""
        if self._slopes is None:
            return
        if _budget_at(generation, self._now, self._view.comm_s) <= 0.0:     # it was lost
            total, count = self._slopes
            self._slopes = (total + generation.spec.tuf.alpha, count - 1)


def queue_loss_rate(ctx: AdmissionContext, lost_slopes: LostSlopes | None = None) -> float:
    """Utility per second lost by the queued goals past their zero-utility time that could
    join the batch now: ``mean(−α) · min(count, free batch slots)``.

    Args:
        ctx: the admission context: its round's :class:`LostTally`, else its queue, scanned.
        lost_slopes: ``(Σ −α, count)`` of the lost queued generations, if already known.
    """
    total, count = lost_slopes if lost_slopes is not None else _queued_lost(ctx)
    if count <= 0:
        return 0.0
    free = max(ctx.max_batch - len(ctx.running), 0)
    return total / count * min(count, free)


def _queued_lost(ctx: AdmissionContext) -> LostSlopes:
    """``(Σ −α, count)`` of the queued goals past their zero-utility time: the round's
    :class:`LostTally`, else the queue scanned."""
    if ctx.lost_tally is not None:
        return ctx.lost_tally.slopes()
    slopes = [-g.spec.tuf.alpha for g in ctx.queued if lost(g, ctx)]
    return sum(slopes), len(slopes)


def _decode_steps(ctx: AdmissionContext) -> DecodeSteps:
    """The engine's decode-step model: the admission round's (:func:`round_decode_steps`),
    else one for this test, each batch size asked once (one test asks it for two sizes up to
    six times; within a test nothing changes the engine)."""
    return ctx.decode_steps if ctx.decode_steps is not None else round_decode_steps(ctx.engine)


def round_decode_steps(engine: EngineView) -> DecodeSteps:
    """The engine's decode-step model for one admission round, each batch size asked once.

    A round of k admissions tests batch sizes b, b + 1, …, b + k, each in two consecutive
    tests; asking the engine each size once halves the model's cost per test. The engine's
    answer for a size is the one it gave when first asked: admissions made later in the
    round (each changes the batch's mean context a little) do not move it.
    """
    known: dict[int, float] = {}
    model = engine.decode_step_s

    def decode_s(batch_size: int) -> float:
        step = known.get(batch_size)
        if step is None:
            step = known[batch_size] = model(batch_size)
        return step

    return decode_s


def wcet_s(generation: Generation, extra_s: float, batch_size: int,
           ctx: AdmissionContext, decode_s: DecodeSteps | None = None) -> float:
    """Worst-case time to finish the generation's current segment in a batch of the given size
    (``decode_s``: the engine's decode-step model, default ``ctx.engine.decode_step_s``)."""
    remaining = max(ctx.max_segment_tokens(generation) - generation.segment_tokens, 1)
    recent, scale = _step_scale(batch_size, ctx, decode_s or ctx.engine.decode_step_s)
    return extra_s + remaining * recent * scale


def seen_remaining(generation: Generation, ctx: AdmissionContext) -> int | None:
    """Tokens the generation has left to the longest segment seen for its robot kind and
    position, plus :data:`SEEN_MARGIN_TOKENS` (at most its l_max, at least one token); None
    before any such segment was seen."""
    seen = ctx.seen_segment_tokens(generation) if ctx.seen_segment_tokens is not None else None
    if seen is None:
        return None
    bound = min(seen + SEEN_MARGIN_TOKENS, ctx.max_segment_tokens(generation))
    return max(bound - generation.segment_tokens, 1)


def _step_scale(batch_size: int, ctx: AdmissionContext, decode_s: DecodeSteps
                ) -> tuple[float, float]:
    """``(r, s)``: the per-token decode time at ``batch_size`` is ``r·s``, as :func:`wcet_s`
    estimates it: the observed step time scaled by the model's time at that size over its
    time at the batch's size, or (before any step was observed) the model's time itself.
    Kept apart so that a caller multiplying by a token count rounds as :func:`wcet_s` does."""
    model_next = decode_s(batch_size)
    if ctx.recent_step_s is None:
        return 1.0, model_next
    model_now = decode_s(max(len(ctx.running), 1))
    return ctx.recent_step_s, (model_next / model_now if model_now > 0 else 1.0)


def _step_scales(size: int, ctx: AdmissionContext, decode_s: DecodeSteps
                 ) -> tuple[float, float, float]:
    """``(r, s, s′)``: :func:`_step_scale` at the batch's ``size`` (≥ 1) and at ``size + 1``
    (``r·s`` and ``r·s′`` the per-token decode times), the model asked once per size, in the
    same order (a round's model keeps the answer first given for a size)."""
    model_next = decode_s(size + 1)
    model_now = decode_s(size)
    if ctx.recent_step_s is None:
        return 1.0, model_now, model_next
    if model_now > 0:   # x / x, not 1.0: _step_scale's value for an infinite model too
        return ctx.recent_step_s, model_now / model_now, model_next / model_now
    return ctx.recent_step_s, 1.0, 1.0


@dataclass(slots=True)
class DelayWeights:
    """Running sums over a batch that bound :func:`delay_cost` without reading the batch.

    A running generation with ``r`` tokens left, budget ``B`` and slope α loses
    ``−α · max(0, extra + r·s′ − max(r·s, B))`` when a candidate joins (``s``, ``s′``: the
    step times before and after; :func:`delay_cost`). With ``extra ≥ 0`` and ``s′ ≥ s`` that
    is at most ``−α · (extra + r·(s′ − s))``, and exactly that once ``B ≤ 0`` (a late one). So
    ``extra · Σ(−α) + (s′ − s) · Σ(−α·r)`` over the batch bounds the cost from above and the
    same sums over the late ones bound it from below: under overload, where nearly every
    running generation is late, the two meet and the test needs no pass over the batch. The
    on-time ones lose nothing while the least of their budgets covers the run cost and the
    longest of their remaining segments at ``s′``; then the lower bound is the cost.
    """

    weight: float = 0.0              # Σ −α
    weighted_remaining: float = 0.0  # Σ −α·r
    late_weight: float = 0.0         # Σ −α over the generations with budget ≤ 0
    late_weighted_remaining: float = 0.0
    on_time_least_budget: float = math.inf    # over the generations with budget > 0
    on_time_most_remaining: float = 0.0

    def add(self, remaining: float, budget: float, alpha: float) -> None:
        self.weight -= alpha
        self.weighted_remaining -= alpha * remaining
        if budget <= 0.0:
            self.late_weight -= alpha
            self.late_weighted_remaining -= alpha * remaining
        else:       # as min() and max() would (the first of equals kept), without the calls
            if budget < self.on_time_least_budget:
                self.on_time_least_budget = budget
            if remaining > self.on_time_most_remaining:
                self.on_time_most_remaining = remaining

    def add_rows(self, remaining: Column, budget: Column, alpha: Column) -> None:
        late = budget <= 0.0
        self.weight -= float(alpha.sum())
        self.weighted_remaining -= float((alpha * remaining).sum())
        self.late_weight -= float(alpha[late].sum())
        self.late_weighted_remaining -= float((alpha[late] * remaining[late]).sum())
        if not late.all():
            on_time = ~late
            self.on_time_least_budget = min(self.on_time_least_budget,
                                            float(budget[on_time].min()))
            self.on_time_most_remaining = max(self.on_time_most_remaining,
                                              float(remaining[on_time].max()))

    def bounds(self, extra_s: float, step_now_s: float, step_next_s: float
               ) -> tuple[float, float, float] | None:
        """``(lower, upper, scale)``: bounds of the delay cost and the size of the terms it
        sums (what its rounding is relative to), or None where the bounds do not hold (a
        negative run cost, or a step that gets faster with the batch)."""
        slower_s = step_next_s - step_now_s
        if extra_s < 0.0 or slower_s < 0.0:
            return None
        lower = extra_s * self.late_weight + slower_s * self.late_weighted_remaining
        scale = extra_s * self.weight + step_next_s * self.weighted_remaining
        longest_s = extra_s + self.on_time_most_remaining * step_next_s
        if self.on_time_least_budget - longest_s > BOUND_MARGIN * (
                self.on_time_least_budget + longest_s):
            return lower, lower, scale
        return lower, extra_s * self.weight + slower_s * self.weighted_remaining, scale


SEEN_MARGIN_TOKENS = 1
"""Tokens added to the longest segment seen when the latency test judges by it: the step
model's error and each join's own iteration make the seen length alone too tight (authors'
drone workload, default regime, seed 0: 87 urgent goals late with no margin, 5 with one token
or two, as without the bound)."""


BOUND_MARGIN = 1e-9
"""Margin, relative to the size of the summed terms, by which a bound must clear the gain to
settle the test: the running sums and :func:`delay_cost`'s sum round differently (by less
than batch size × 1e-16 of those terms), so only a clear verdict is taken from the bounds,
the rest from the exact sum."""


_ROWS_AT_ONCE = 16      # appended generations from which a batch's rows are read as arrays
_NEED_TIME = operator.attrgetter('need_time')
_FIRST_ERT = operator.attrgetter('spec.tuf.ert_s')   # ert_s of a first segment (k = 0)
_SEGMENT = operator.attrgetter('k')
_ALPHA = operator.attrgetter('spec.tuf.alpha')
_PROFILE = operator.attrgetter('spec.profile')
_SEGMENT_TOKENS = operator.attrgetter('segment_tokens')


class BatchColumns:
    """The running batch as arrays (remaining segment tokens, budget, α), in batch order, for
    one admission round: every admission test reads the whole batch, and with a batch of
    hundreds that was the decision's cost. Built at the first test, extended as the round
    admits (``ctx.running`` is a live view in insertion order that a round only appends to),
    rebuilt if the batch changed otherwise (a preemption). Bringing it up to date looks at
    the appended generations only, not the whole batch; most tests need only the most urgent
    row and the running sums (:class:`DelayWeights`), so appended rows reach the arrays only
    when the arrays are read. On the scheduler's own batch the first test builds them from
    the columns the scheduler keeps (``ctx.running_columns``, :mod:`timelyllm_ros.core.
    running`): of each generation only its segment's token count is read."""

    def __init__(self) -> None:
        self._rows: Column = np.empty((3, 0))     # remaining, budget, α; grown by doubling
        self._l_max: dict[str, int] = {}          # l_max per robot profile, asked once
        self._tie: dict[str, float] = {}          # urgency tie per robot profile, asked once
        self.stall_s = 0.0          # run costs of the generations the round joined (priced)
        self.less_urgent_stall_s = 0.0    # of those, the ones less urgent than the batch's
        self._priced: dict[str, tuple[float, bool]] = {}   # admitted, not yet seen joining:
                                                            # run cost, less urgent
        self._reset()

    def price(self, task_id: str, run_cost_s: float, less_urgent: bool) -> None:
        """An admission test let this generation join at this run cost: once it is seen in
        the batch (:meth:`of`), the cost counts in :attr:`stall_s`, and in
        :attr:`less_urgent_stall_s` if it was less urgent than the batch's most urgent
        generation (a generation the engine then failed to start never counts)."""
        self._priced[task_id] = (run_cost_s, less_urgent)

    def _reset(self) -> None:
        self.generations: list[Generation] = []
        self._written = 0                         # rows of generations already in _rows
        self._pending: list[tuple[float, float, float]] = []   # rows not yet written
        self.most_urgent = -1     # row of the smallest budget (the first of equals), kept as
                                  # rows are appended: no scan of the batch per test
        self.most_urgent_budget = math.inf
        self.most_urgent_remaining = 1.0          # its tokens left to l_max
        self.weights = DelayWeights()
        self._floor: Column = np.empty(0)        # max(remaining · step, budget) per row
        self._floor_step, self._floor_rows = math.nan, 0
        self._anchor: tuple[float, ...] | None = None   # the last exact delay cost and where

    def delay_cost(self, extra_s: float, step_now_s: float, step_next_s: float) -> float:
        """:func:`delay_cost` over these rows at the given step times, summed exactly; kept
        as the anchor of :meth:`anchored_upper`."""
        overrun = self.remaining * step_next_s
        overrun += extra_s
        overrun -= self.delay_floor(step_now_s)
        # summed in batch order, as a loop would (cumsum is sequential): the same float
        cost = float(np.cumsum(np.where(overrun > 0, -self.alpha * overrun, 0.0))[-1])
        self._anchor = (cost, extra_s, step_now_s, step_next_s, self.weights.weight,
                        self.weights.weighted_remaining)
        return cost

    def anchored_upper(self, extra_s: float, step_now_s: float, step_next_s: float) -> float:
        """An upper bound of the delay cost from the last exact one (``inf`` without one).

        Each row's loss grows with the run cost and the next step time at most at its −α and
        −α·r: so the cost is at most the anchor's plus those growths over the rows it summed,
        plus the appended rows' own bound (:class:`DelayWeights`). It holds while the rows'
        floors are the anchor's (the same step time now: an observed one keeps it through a
        round) and rows were only appended since (a rebuild forgets the anchor).
        """
        if self._anchor is None:
            return math.inf
        cost, extra0, step_now0, step_next0, weight0, weighted0 = self._anchor
        if step_now_s != step_now0:
            return math.inf
        weights = self.weights
        return (cost + max(extra_s - extra0, 0.0) * weight0
                + max(step_next_s - step_next0, 0.0) * weighted0
                + extra_s * (weights.weight - weight0)
                + (step_next_s - step_now_s) * (weights.weighted_remaining - weighted0))

    @property
    def remaining(self) -> Column:
        """Tokens each running generation has left to its segment's ``l_max`` (at least 1)."""
        row: Column = self._arrays()[0]
        return row

    @property
    def budget(self) -> Column:
        """Each running generation's :func:`budget_s`."""
        row: Column = self._arrays()[1]
        return row

    @property
    def alpha(self) -> Column:
        """Each running generation's TUF slope α."""
        row: Column = self._arrays()[2]
        return row

    def _arrays(self) -> Column:
        """The three rows, with the appended generations' values written in."""
        if self._pending:
            end = self._written + len(self._pending)
            self._room_for(end)
            self._rows[:, self._written:end] = np.array(self._pending).T
            self._written, self._pending = end, []
        return self._rows[:, :self._written]

    def _room_for(self, rows: int) -> None:
        """Grow the arrays (by doubling) to hold ``rows`` rows, keeping those written."""
        if rows > self._rows.shape[1]:
            grown = np.empty((3, max(rows, 2 * self._rows.shape[1], 16)))
            grown[:, :self._written] = self._rows[:, :self._written]
            self._rows = grown

    def delay_floor(self, step_s: float) -> Column:
        """``max(remaining · step_s, budget)`` per row: how long each running generation can
        be delayed before it costs, at decode step ``step_s`` (kept for the step time asked
        last: with an observed step time every test of a round asks the same one)."""
        columns = self._arrays()
        n = columns.shape[1]
        if self._floor_step != step_s:
            self._floor_step, self._floor_rows = step_s, 0
        done = self._floor_rows
        if done < n:
            if len(self._floor) < n:
                grown = np.empty(self._rows.shape[1])
                grown[:done] = self._floor[:done]
                self._floor = grown
            np.maximum(columns[0, done:n] * step_s, columns[1, done:n],
                       out=self._floor[done:n])
            self._floor_rows = n
        return self._floor[:n]

    def of(self, ctx: AdmissionContext) -> BatchColumns:
        """These columns, brought up to date with ``ctx.running``."""
        added = _appended_since(ctx.running, self.generations)
        if added is None:                           # not only appended to: rebuild
            self._reset()
            added = list(ctx.running)
        elif not added:
            return self
        if self._priced:
            for g in added:
                cost, less_urgent = self._priced.pop(g.task_id, (0.0, False))
                self.stall_s += cost
                if less_urgent:
                    self.less_urgent_stall_s += cost
        start = len(self.generations)
        if len(added) >= _ROWS_AT_ONCE:
            kept = ctx.running_columns
            if kept is not None and not start and len(kept) == len(added):
                self._add_rows(added, *self._from_columns(added, kept, ctx))
            else:
                self._add_rows(added, *self._read_rows(added, ctx))
            return self
        for offset, g in enumerate(added):
            budget = budget_s(g, ctx)
            remaining = max(self._profile_l_max(g, ctx) - g.segment_tokens, 1)
            alpha = g.spec.tuf.alpha
            self._pending.append((remaining, budget, alpha))
            self.weights.add(remaining, budget, alpha)
            if budget < self.most_urgent_budget or self.most_urgent < 0:
                self.most_urgent = start + offset
                self.most_urgent_budget = budget
                self.most_urgent_remaining = remaining
        self.generations.extend(added)
        return self

    def _read_rows(self, added: list[Generation], ctx: AdmissionContext
                   ) -> tuple[Column, Column, Column]:
        """``(remaining, budget, α)`` of many generations, read with C-level getters and
        computed as arrays: the same values as one by one."""
        n = len(added)
        budget = np.fromiter(map(_NEED_TIME, added), float, n)    # budget_s, as arrays
        # ert_s without its property: TUF₀'s ERT for a first segment, 0 for a later one
        first_segment = np.fromiter(map(_SEGMENT, added), float, n) == 0.0
        budget += np.where(first_segment, np.fromiter(map(_FIRST_ERT, added), float, n), 0.0)
        budget -= ctx.now
        budget -= ctx.comm_s
        l_max = self._l_max
        profiles = list(map(_PROFILE, added))
        for g in dict(zip(profiles, added, strict=True)).values():   # one per profile
            self._profile_l_max(g, ctx)
        remaining = np.fromiter(map(l_max.__getitem__, profiles), float, n)
        remaining -= np.fromiter(map(_SEGMENT_TOKENS, added), float, n)
        np.maximum(remaining, 1.0, out=remaining)
        return remaining, budget, np.fromiter(map(_ALPHA, added), float, n)

    @staticmethod
    def _from_columns(added: list[Generation], kept: RunningBatch, ctx: AdmissionContext
                      ) -> tuple[Column, Column, Column]:
        """:meth:`_read_rows` of the whole batch from the scheduler's columns: only the
        segments' token counts are read from the generations."""
        need_ert, l_max, alpha = kept.columns()
        budget = need_ert - ctx.now
        budget -= ctx.comm_s
        remaining = l_max - np.fromiter(map(_SEGMENT_TOKENS, added), float, len(added))
        np.maximum(remaining, 1.0, out=remaining)
        return remaining, budget, alpha

    def _add_rows(self, added: list[Generation], remaining: Column, budget: Column,
                  alpha: Column) -> None:
        """Append many generations at once (a round's first test reads the whole batch)
        with their rows."""
        self._arrays()                              # nothing pending: the new rows follow
        start, end = len(self.generations), len(self.generations) + len(added)
        self._room_for(end)
        self._rows[0, start:end], self._rows[1, start:end], self._rows[2, start:end] = (
            remaining, budget, alpha)
        self._written = end
        self.weights.add_rows(remaining, budget, alpha)
        first = int(np.argmin(budget))              # the first of equals
        if budget[first] < self.most_urgent_budget or self.most_urgent < 0:
            self.most_urgent, self.most_urgent_budget = start + first, float(budget[first])
            self.most_urgent_remaining = float(remaining[first])
        self.generations.extend(added)

    def _profile_l_max(self, generation: Generation, ctx: AdmissionContext) -> int:
        """``l_max`` of the generation's robot profile (the same for every generation of it)."""
        profile = generation.spec.profile
        l_max = self._l_max.get(profile)
        if l_max is None:
            l_max = self._l_max[profile] = ctx.max_segment_tokens(generation)
        return l_max

    def urgency_tie(self, generation: Generation, ctx: AdmissionContext) -> float:
        """The urgency tie of the generation's robot profile (``ctx.urgency_tie_s``, the same
        for every generation of a profile; 0 without one)."""
        profile = generation.spec.profile
        tie = self._tie.get(profile)
        if tie is None:
            tie = self._tie[profile] = (ctx.urgency_tie_s(generation)
                                        if ctx.urgency_tie_s is not None else 0.0)
        return tie


def _appended_since(running: Collection[Generation], held: list[Generation]
                    ) -> list[Generation] | None:
    """The generations appended to ``running`` since ``held`` was read from it, or None if it
    changed otherwise. Read from the end (``running`` is reversible, a dict view or a list):
    with ``m`` more than we hold, the one before the last ``m`` must be our last (a removal
    would put an appended one there)."""
    if not held:
        return list(running)
    grown = len(running) - len(held)
    if grown < 0:
        return None
    try:
        tail = list(itertools.islice(reversed(running), grown + 1))  # type: ignore[call-overload]
    except TypeError:                           # not reversible: read again
        return None
    if tail[-1] is not held[-1]:
        return None
    return tail[-2::-1]


class ReplicaBatches:
    """A pool's running batch split by replica for one admission round: a pool's latency
    test weighs the candidate's replica only (:func:`latency_guided`), and finding that
    replica's generations in the whole fleet's batch at every test was the decision's cost.
    Each replica's share (in batch order) is found once per round, at its first test, with
    its :class:`BatchColumns` and context; an admission joins its own replica's share only."""

    def __init__(self) -> None:
        self._read: list[Generation] = []      # ctx.running as read so far, in order
        self._place: dict[str, int] = {}       # task id -> its index in _read
        self._shares: dict[EngineView, tuple[list[Generation], AdmissionContext]] = {}
        self._of: AdmissionContext | None = None   # the context the shares were split from

    def on_replica(self, ctx: AdmissionContext, replica: EngineView) -> AdmissionContext:
        """The context as ``replica`` sees it, as :func:`_on_replica` builds it, with the
        replica's share and columns kept through the round."""
        added = _appended_since(ctx.running, self._read) if ctx is self._of else None
        if added is None:                          # a new round, or not only appended to
            self._of, self._read, self._place, self._shares = ctx, [], {}, {}
            added = list(ctx.running)
        for generation in added:
            self._place[generation.task_id] = len(self._read)
            self._read.append(generation)
            home = ctx.engine.cohort(generation.task_id) if self._shares else None
            if home is not None and home in self._shares:   # a share found later reads it
                self._shares[home][0].append(generation)
        shared = self._shares.get(replica)
        if shared is None:
            place = self._place
            running = [self._read[r] for r in sorted(place[t] for t in replica.running
                                                      if t in place)]
            shared = self._shares[replica] = running, replace(
                ctx, engine=replica, running=running, max_batch=replica.max_num_seqs,
                batch_columns=BatchColumns(), decode_steps=None, running_columns=None)
        return shared[1]


def _batch(ctx: AdmissionContext) -> BatchColumns:
    return (ctx.batch_columns if ctx.batch_columns is not None else BatchColumns()).of(ctx)


def delay_cost(extra_s: float, ctx: AdmissionContext, batch: BatchColumns | None = None,
               decode_s: DecodeSteps | None = None) -> float:
    """Utility the running generations lose if a candidate with run cost ``extra_s`` joins.

    Each one's worst-case segment time grows from ``WCET(b)`` to ``WCET(b + 1)`` (plus the
    run cost, :func:`wcet_s`); the part of that delay past its deadline (``now + budget``)
    costs −α per second (Eq. 1, the same slope before and after the zero-utility time).
    ``batch``: the running batch's columns, if the caller has them up to date; ``decode_s``
    the engine's decode-step model (:func:`wcet_s`).
    """
    size = len(ctx.running)
    if not size:
        return 0.0
    decode_s = decode_s or ctx.engine.decode_step_s
    batch = batch if batch is not None else _batch(ctx)
    recent, scale_now, scale_next = _step_scales(size, ctx, decode_s)
    return batch.delay_cost(extra_s, recent * scale_now, recent * scale_next)


def delay_cost_within(gain: float, extra_s: float, ctx: AdmissionContext,
                      batch: BatchColumns | None = None,
                      decode_s: DecodeSteps | None = None) -> bool:
    """``delay_cost(extra_s, ctx, batch, decode_s) <= gain``, settled by the batch's running
    sums (:class:`DelayWeights`) where they clear ``gain``, else by the exact sum."""
    size = len(ctx.running)
    if not size:
        return 0.0 <= gain
    recent, scale_now, scale_next = _step_scales(size, ctx, decode_s or ctx.engine.decode_step_s)
    return _delay_cost_at_most(gain, extra_s, batch if batch is not None else _batch(ctx),
                               recent * scale_now, recent * scale_next)


def _delay_cost_at_most(gain: float, extra_s: float, batch: BatchColumns, step_now: float,
                        step_next: float) -> bool:
    """:func:`delay_cost_within` at the given step times (before and after the join)."""
    bounds = batch.weights.bounds(extra_s, step_now, step_next)
    if bounds is not None:
        lower, upper, scale = bounds
        margin = BOUND_MARGIN * (scale + abs(gain)) + 1e-300
        if lower > gain + margin:
            return False
        if min(upper, batch.anchored_upper(extra_s, step_now, step_next)) <= gain - margin:
            return True
    return batch.delay_cost(extra_s, step_now, step_next) <= gain


def _candidate_replica(candidate: Generation, ctx: AdmissionContext) -> AdmissionContext:
    """The context of the replica the candidate would join (its cohort), or ``ctx`` itself
    on a single engine."""
    cohort = ctx.engine.cohort(candidate.task_id)
    if cohort is None:
        return ctx
    return (ctx.replica_batches.on_replica(ctx, cohort) if ctx.replica_batches is not None
            else _on_replica(ctx, cohort))


def _on_replica(ctx: AdmissionContext, replica: EngineView) -> AdmissionContext:
    """The context as one replica of a pool sees it: its engine, its running generations, its
    batch cap (the latency test protects the iterations a candidate would slow down)."""
    members = set(replica.running)
    return replace(ctx, engine=replica, running=[g for g in ctx.running if g.task_id in members],
                   max_batch=replica.max_num_seqs, batch_columns=None, decode_steps=None,
                   running_columns=None)


def keeps_resume_reserve(candidate: Generation, ctx: AdmissionContext, reserve: float) -> bool:
    """The resume reserve (module docstring): False where ``candidate`` is an early resume (a
    later segment its robot does not need yet: budget > 0) less urgent than the batch's most
    urgent generation that would take one of the last ``reserve`` share of the batch's slots
    while no queued goal has lost its utility; True otherwise. On a pool of replicas, the
    batch and cap of the candidate's replica."""
    if candidate.k == 0:
        return True
    ctx = _candidate_replica(candidate, ctx)
    if not ctx.running or len(ctx.running) < ctx.max_batch - int(reserve * ctx.max_batch):
        return True
    budget = budget_s(candidate, ctx)
    batch = _batch(ctx)
    if budget <= 0.0 or _as_urgent(budget, batch, batch.urgency_tie(candidate, ctx)):
        return True
    return _queued_lost(ctx)[1] > 0


def _as_urgent(candidate_budget: float, batch: BatchColumns, tie: float) -> bool:
    """Whether a candidate of the given budget is at least as urgent as the batch's most
    urgent generation: budgets closer than the tie (``ctx.urgency_tie_s``) count as equal
    (:func:`latency_guided`)."""
    return candidate_budget <= batch.most_urgent_budget + tie


def latency_guided(candidate: Generation, ctx: AdmissionContext,
                   round_stall: float | None = None, waiting_weight: float = 0.0,
                   seen_bound: float | None = None, tie_run_cost: float | None = None) -> bool:
    """§4.4: admit only if the most urgent running generation keeps its budget.

    If the candidate is at least as urgent as every running generation, waiting cannot help
    it, so it is admitted (subject to :func:`fits`). Budgets that differ by less than
    ``urgency_tie_s`` (one segment generation time G by default in the scheduler) count as
    equally urgent: requests of one event arrive milliseconds apart, and serialising them
    would make each wait a whole segment for a difference of a few milliseconds. With
    ``tie_run_cost`` c, a candidate tied with the batch's most urgent generation (budgets
    within the tie, on either side) joins at once only while its run cost is at most c times
    the tie: a dearer join stalls its peers longer than the wait it saves (module docstring).

    On a pool of replicas the test weighs the candidate's replica only (its running
    generations, its batch cap and decode model): the others' iterations do not slow down.

    Once the most urgent one has missed its deadline (budget ≤ 0, module docstring), the
    candidate joins if the running generations lose less utility from its delay
    (:func:`delay_cost`) than the queue loses by waiting until the most urgent one has
    finished its segment: the candidate's own lateness meanwhile, and the lost queued goals
    that could join now (:func:`queue_loss_rate`).

    With ``round_stall`` k (module docstring), a less urgent candidate is also refused once
    the round's joins so far and its own run cost would stall the batch longer than k times
    the most urgent running generation's remaining segment time at the present step; where
    the seen bound judges that generation, only the round's less urgent joins count.

    With ``waiting_weight`` ρ (module docstring), the loss test counts the candidate's wait
    within its slack too, at ρ·(−α) per second, beside its lateness past its deadline.

    With ``seen_bound`` s (module docstring), a most urgent generation still on time that
    misses its budget at l_max even without the candidate is judged at the longest segment
    seen for it instead (:func:`seen_remaining`), while the batch with the candidate holds at
    most s of its cap.

    Args:
        candidate: the best queued generation.
        ctx: the admission context (the lost queued goals: its :class:`LostTally`; the
            round's stall so far: its :class:`BatchColumns`).
        round_stall: the round stall budget k, or None for none (the paper's test).
        waiting_weight: the waiting weight ρ ≥ 0 of the loss test (0: the paper's test).
        seen_bound: the share s of the batch cap within (0, 1] up to which the seen bound
            applies, or None for none (the paper's test).
        tie_run_cost: the tie run cost c ≥ 0, or None: every tied candidate joins at once.
    """
    ctx = _candidate_replica(candidate, ctx)
    if not ctx.running:
        return True
    batch = _batch(ctx)
    budget = batch.most_urgent_budget           # the first of equals, as min() would
    candidate_budget = budget_s(candidate, ctx)
    tie = batch.urgency_tie(candidate, ctx)
    as_urgent = _as_urgent(candidate_budget, batch, tie)
    if as_urgent and (tie_run_cost is None or candidate_budget < budget - tie):
        if round_stall is not None:
            batch.price(candidate.task_id, ctx.engine.run_cost_s(candidate.task_id),
                        less_urgent=False)
        return True
    extra = ctx.engine.run_cost_s(candidate.task_id)
    if as_urgent and tie_run_cost is not None and extra <= tie_run_cost * tie:
        if round_stall is not None:
            batch.price(candidate.task_id, extra, less_urgent=False)
        return True
    size = len(ctx.running)
    decode_s = _decode_steps(ctx)
    remaining = batch.most_urgent_remaining     # the most urgent one's WCET: as wcet_s
    recent, scale_now, scale_next = _step_scales(size, ctx, decode_s)
    wait = remaining * recent * scale_now
    seen = None                     # the seen length, where the seen bound judges
    if (budget > 0 and seen_bound is not None and wait > budget
            and size + 1 <= seen_bound * ctx.max_batch):
        seen = seen_remaining(batch.generations[batch.most_urgent], ctx)
    # where the seen bound judges, the joins at least as urgent (the most urgent one's peers,
    # often itself) prefill first whatever is refused: only the less urgent ones' stall counts
    stall = batch.stall_s if seen is None else batch.less_urgent_stall_s
    if round_stall is not None and stall > 0.0 and stall + extra > round_stall * wait:
        return False
    if budget > 0:
        admit = extra + remaining * recent * scale_next <= budget
        if not admit and seen is not None:
            admit = extra + seen * recent * scale_next <= budget
    else:
        gain = wait * queue_loss_rate(ctx)
        if not lost(candidate, ctx):        # a lost candidate is counted in the queue's rate
            slack = max(candidate_budget, 0.0)
            gain -= candidate.spec.tuf.alpha * max(0.0, wait - slack)
            if waiting_weight:
                gain -= waiting_weight * candidate.spec.tuf.alpha * min(wait, slack)
        admit = _delay_cost_at_most(gain, extra, batch, recent * scale_now,
                                    recent * scale_next)
    if admit and round_stall is not None:
        batch.price(candidate.task_id, extra, less_urgent=True)
    return admit
