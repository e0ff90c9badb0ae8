"""Priority math, vectorised over the queue: PUD (paper Eq. 4) and the artifact's variant.

Notation (all float seconds): ``now`` = t, ``g`` = G(s_k), ``comm`` = network latency,
``ref`` = when the robot needs segment s_k (request arrival for k = 0, estimated end of
s_{k−1}'s execution for k ≥ 1), ``ert`` = ERT of the governing TUF (TUF₀ for k = 0, 0 for
TUF₁).

* Waiting time if generation starts now: ``W(s_k; t) = max(0, t + G + comm − ref)``.
* Utility: ``U = min(β, α·(W − ert) + β)``, which is TUF₀(W) for k = 0 and TUF₁(W) for k ≥ 1.
* Slack L (the paper leaves its sign loose; we make it monotone — less slack, higher priority):
  the time left before the segment starts losing utility, ``ref + ert − (t + G + comm)``,
  floored at 0 and offset by one generation time so that it stays positive:
  ``L = max(0, ref + ert − t − G − comm) + G``.
* ``Pri = U / (G·L)`` while U > 0. Once no utility is left (U ≤ 0) the generation ranks below
  every generation that can still earn utility, and the lost ones are ordered by ``lost_order``:

  - ``'loss-rate'`` (default): the most utility lost per second of generation, ``−α / G``,
    first (Smith's rule: past its zero-utility time each second of waiting costs a segment −α,
    and serving it takes about G, so this order loses least in total); among equal rates the
    one that has lost least first, as ``'least-loss'`` orders them. A lost segment's priority
    is then ``−(rank of its rate + D/(1 + D))`` with D = −U its loss so far (:func:`_places`):
    equal for equal keys, so ties still go to the earlier queued;
  - ``'least-loss'``: by U itself, the one that has lost least first (Eq. 4's U read alone).
    Under overload it serves lost normal goals before lost urgent ones, whose steeper slope
    then costs more the longer they wait (issue 28).

* ``stranded`` says where a *stranded* goal goes: one still waiting for its first segment
  (its robot has no plan at all) that can no longer earn utility:

  - ``'eq4'`` (default): as the lost generations above, below every earning segment (the
    order of the paper's Eq. 4). It waits while earning segments keep arriving: on the
    authors' arm workload in the paper's setup 11 goals of one burst waited 34–39 s
    (response p99 34.8 s; TimeBill and SLICE 3.7 and 4.2 s);
  - ``'first'``: before every other generation, the one that has lost most first (priority
    ``S·(2 − 1/(1 + D))``, S = :data:`STRANDED` above any Eq. 4 value). Only first segments
    go first: promoting late resume segments too filled the KV cache and made the engine
    re-prefill whole contexts (authors-arm without a prefix cache: 3.6 M tokens prefilled
    instead of 1.2 M). It is not the default: a goal still savable waits behind the stranded
    ones and may be lost too (``test_overload``'s fresh urgent goals behind 30 stranded
    ones), and at 5,000 robots on one engine or in replica pools it generates plans 10–33 %
    slower (more plans in flight, more KV re-prefilled); the README has the measurements;
  - ``'share'``: here as ``'eq4'``; the policy then gives the stranded goals,
    :func:`stranded_by_loss` (by default the steepest loss rate first, then the one that has
    lost most), a share of the places of that order (:func:`interleave`), as many as the
    engine has room for without harming a plan under way
    (:class:`~timelyllm_ros.policies.timelyllm.TimelyLlmSharePolicy`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import NDArray

from timelyllm_ros.core.queue import Column, best_rows

LostOrder = Literal['loss-rate', 'least-loss']
LOST_ORDERS: tuple[LostOrder, ...] = ('loss-rate', 'least-loss')
StrandedRule = Literal['first', 'eq4', 'share']
STRANDED_RULES: tuple[StrandedRule, ...] = ('first', 'eq4', 'share')
StrandedOrder = Literal['loss-rate', 'most-lost']
STRANDED_ORDERS: tuple[StrandedOrder, ...] = ('loss-rate', 'most-lost')

STRANDED = 1e200
"""The priority scale of stranded goals (``stranded='first'``): above any Eq. 4 value, whose
largest is β/G² for a segment needed now."""


def waiting_time(now: float, ref: Column, g: Column, comm_s: float) -> Column:
    """W(s_k; t): waiting time of the segment if its generation starts at ``now``."""
    return np.maximum(now + g + comm_s - ref, 0.0)


def utility_if_started(now: float, ref: Column, ert: Column, beta: Column, alpha: Column,
                       g: Column, comm_s: float) -> Column:
    """U: the utility each segment earns if its generation starts at ``now``."""
    utility = alpha * (waiting_time(now, ref, g, comm_s) - ert)
    utility += beta
    np.minimum(utility, beta, out=utility)
    return utility


def pud_priority(now: float, ref: Column, ert: Column, beta: Column,
                 alpha: Column, g: Column, comm_s: float,
                 lost_order: LostOrder = 'loss-rate', first: Column | None = None,
                 stranded: StrandedRule = 'eq4', utility: Column | None = None) -> Column:
    """Eq. 4 with the slack L defined in the module docstring; generations with no utility
    left ordered by ``lost_order``, and stranded goals (``first`` 1.0 for a goal's first
    segment; None: none is) placed by ``stranded``. ``utility``: :func:`utility_if_started`
    of the same columns at ``now``, where the caller has it (not changed here)."""
    if utility is None:
        utility = utility_if_started(now, ref, ert, beta, alpha, g, comm_s)
    # L counts from the time the segment is needed (ref + ert), not from the clamped wait:
    # a segment needed later has more slack (module docstring).
    slack = ref + ert - (now + g + comm_s)
    np.maximum(slack, 0.0, out=slack)
    slack += g
    slack *= g
    earning = utility > 0.0
    priority = np.where(earning, utility / slack, utility)
    if earning.all():
        return priority
    if lost_order != 'least-loss':
        lost = np.flatnonzero(~earning)
        priority[lost] = -_places(alpha[lost] / g[lost], utility[lost])
    if stranded == 'first' and first is not None:
        rows = np.flatnonzero(~earning & (first > 0.0))
        loss = -utility[rows]
        priority[rows] = STRANDED * (2.0 - 1.0 / (1.0 + loss))
    return priority


def stranded_by_loss(utility: Column, first: Column, seq: Column,
                     limit: int | None = None,
                     alpha_per_g: Column | None = None) -> NDArray[np.intp]:
    """The rows of the stranded goals (a first segment with no utility left: ``utility`` of
    :func:`utility_if_started`), the one that has lost most first (equal losses: the earlier
    queued first). With ``alpha_per_g`` (each row's α/G), the steepest loss rate −α/G first
    and the one that has lost most first among equal rates: the lost order's Smith's rule
    (module docstring), each second a goal of rate r waits costs r·G. With ``limit``, the
    first ``limit`` of that order only (and any tied with the last): a partial sort,
    O(n + limit·log limit), not a sort of every stranded goal."""
    rows = np.flatnonzero((first > 0.0) & (utility <= 0.0))
    loss = -utility[rows]
    if alpha_per_g is None:
        key = loss
    else:   # the rate's rank decides (a rank apart outweighs any loss), then the loss
        key = _within_rank(loss) - _rate_ranks(alpha_per_g[rows])
    ranked: NDArray[np.intp] = rows[best_rows(key, seq[rows],
                                              len(rows) if limit is None else limit)]
    return ranked


def interleave(priority: Column, seq: Column, promoted: NDArray[np.intp],
               share: float) -> Column:
    """Priorities that give the ``promoted`` rows (best first) a ``share`` of the places of
    ``priority``'s order, the rest keeping their order (ties to the lower ``seq``): the i-th
    promoted row (from 1) takes place i/share, the j-th other j/(1 − share), a promoted row
    first at equal places. Only the others placed before the last promoted row are sorted
    (a partial sort): the rows from there on keep their priorities, below the interleaved
    head's."""
    if not len(promoted):
        return priority
    return lead_with(priority, interleaved_head(priority, seq, promoted, share))


def interleaved_head(priority: Column, seq: Column, promoted: NDArray[np.intp],
                     share: float) -> NDArray[np.intp]:
    """The rows :func:`interleave` places first, best first: the ``promoted`` rows (at least
    one) and the others placed before the last of them."""
    m = len(promoted)
    other = np.ones(len(priority), dtype=bool)
    other[promoted] = False
    ahead = _others_ahead(m, len(priority) - m, share)
    if ahead:
        # the best `ahead` others are among the best `ahead + m` rows of all: no copy of the
        # others' columns to sort them apart
        best = best_rows(priority, seq, ahead + m)
        rest = best[other[best]][:ahead]
    else:
        rest = promoted[:0]
    head = np.concatenate([promoted, rest])
    place = np.concatenate([np.arange(1, m + 1) / share,
                            np.arange(1, len(rest) + 1) / (1.0 - share)])
    order: NDArray[np.intp] = head[np.lexsort((np.arange(len(head)) >= m, place))]
    return order


def lead_with(priority: Column, head: NDArray[np.intp]) -> Column:
    """Priorities that put the ``head`` rows first, in their order, above every other row
    (whose priorities are kept); ``priority`` is not changed."""
    ranked = priority.copy()
    ranked[head] = float(priority.max()) + 1.0 + np.arange(len(head), 0, -1, dtype=float)
    return ranked


def _others_ahead(promoted: int, others: int, share: float) -> int:
    """How many of ``others`` take a place before the last of ``promoted`` rows: the j-th
    other (from 1) sits at j/(1 − share), the last promoted one at promoted/share (places
    computed as :func:`interleave` computes them, over the first few others only: past
    promoted·(1 − share)/share + 2 they all sit behind)."""
    last = promoted / share
    within = min(others, int(promoted * (1.0 - share) / share) + 2)
    return int(np.searchsorted(np.arange(1, within + 1) / (1.0 - share), last))


def _places(alpha_per_g: Column, utility: Column) -> Column:
    """Each lost segment's place in the ``'loss-rate'`` order as a number: the steepest
    ``−α/G`` first, then least loss first. The rate's rank among the distinct rates (from 1)
    plus ``−U/(1 − U)``, which maps the loss so far into [0, 1) in order: equal keys give
    equal places, and finding them costs a pass per distinct rate (:func:`_rate_ranks`), not
    a sort by two keys. A flat TUF (α = 0) never loses utility, so it cannot be here."""
    places: Column = _rate_ranks(alpha_per_g) + _within_rank(-utility)
    return places


def _within_rank(loss: Column) -> Column:
    """``D/(1 + D)`` of each loss so far D ≥ 0: the losses' order mapped into [0, 1), so that
    added to a rank (an integer) it orders within the rank and never across ranks."""
    within: Column = np.minimum(loss / (1.0 + loss), _BELOW_ONE)
    return within


_FEW_RATES = 8
"""Distinct loss rates up to which :func:`_rate_ranks` ranks by one pass a rate; past it, a
sort (a fleet's rates are its TUF classes times its robot kinds: a handful)."""


def _rate_ranks(rates: Column) -> Column:
    """Each rate's rank among the distinct ``rates``, ascending, from 1 (as a float): a rank
    is one plus the count of distinct rates below it. A pass per distinct rate where there
    are at most :data:`_FEW_RATES`, else a sort of the column."""
    rank = np.ones(len(rates))
    if not len(rates):
        return rank
    below = float(rates.min())
    for _ in range(_FEW_RATES if below == below else 0):     # a NaN rate: the sort ranks it
        above = rates > below
        if not above.any():
            return rank
        rank += above
        below = float(rates[above].min())
    distinct = np.unique(rates)
    ranks: Column = np.searchsorted(distinct, rates).astype(float) + 1.0
    return ranks


_BELOW_ONE = float(np.nextafter(1.0, 0.0))     # a loss too large to tell from 1 stays in rank


def artifact_priority(now: float, ref: Column, ert: Column, beta: Column,
                      alpha: Column, g: Column, comm_s: float) -> Column:
    """The authors' artifact: ``(α·max(0, Δ) + β)·exp(min(0, Δ))``, Δ = t + G + comm − need.

    Segments needed later are discounted exponentially by their slack; late ones are ranked
    by the utility they still have. ``need`` is ``ref + ert``.
    """
    delta = now + g + comm_s - (ref + ert)
    discounted: Column = (alpha * np.maximum(delta, 0.0) + beta) * np.exp(np.minimum(delta, 0.0))
    return discounted
