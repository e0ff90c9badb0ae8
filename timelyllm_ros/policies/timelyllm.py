"""TimelyLLM (paper 000 §4): segmented generation, PUD priority, latency-guided batching."""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from timelyllm_ros.core.admission import (
    AdmissionContext,
    fits,
    keeps_resume_reserve,
    latency_guided,
)
from timelyllm_ros.core.priority import (
    LOST_ORDERS,
    STRANDED_ORDERS,
    STRANDED_RULES,
    LostOrder,
    StrandedOrder,
    StrandedRule,
    artifact_priority,
    interleaved_head,
    lead_with,
    pud_priority,
    stranded_by_loss,
    utility_if_started,
)
from timelyllm_ros.core.queue import QueueView
from timelyllm_ros.core.request import Generation
from timelyllm_ros.engines.base import EngineView
from timelyllm_ros.errors import PolicyError
from timelyllm_ros.policies.base import Policy


class TimelyLlmPolicy(Policy):
    """Eq. 4 as the paper states it (L defined in :mod:`timelyllm_ros.core.priority`) + §4.4.

    Args:
        lost_order: how generations with no utility left are ordered among themselves
            (:mod:`timelyllm_ros.core.priority`): ``'loss-rate'`` (default, steepest loss
            per second of generation first) or ``'least-loss'`` (by their utility, the
            reading of Eq. 4 this project used until issue 28).
        stranded: where a goal still waiting for its first segment goes once it can no
            longer earn utility: ``'eq4'`` (default, with the other lost ones, below every
            earning segment, as Eq. 4 ranks it), ``'first'`` (before every other
            generation, the one that has lost most first) or ``'share'`` (the ones that
            have lost most take ``stranded_share`` of the places of Eq. 4's order: all of
            them if the free batch slots hold them, else as many as the engine's KV room
            allows without harming a plan under way; measured in the README).
        stranded_share: the share of the admission order stranded goals take (``'share'``).
        stranded_plan_tokens: the KV tokens a promoted stranded goal reserves beyond its
            prompt for the plan it will generate (``'share'``).
        round_stall: the round stall budget of the latency test
            (:func:`~timelyllm_ros.core.admission.latency_guided`): once a decision has
            admitted a join, a less urgent candidate joins only while the decision's joins
            stall the batch for at most this many times the most urgent running
            generation's remaining segment time (only the less urgent joins where the seen
            bound judges that generation); None (default): the paper's test alone.
        waiting_weight: the latency test's waiting weight ρ ≥ 0
            (:func:`~timelyllm_ros.core.admission.latency_guided`): once the most urgent
            running generation is late, a waiting candidate's wait within its slack counts
            at ρ times its TUF slope against the delay its join causes; 0 (default): the
            paper's test, where waiting with slack costs nothing.
        seen_bound: the latency test's seen bound
            (:func:`~timelyllm_ros.core.admission.latency_guided`): a most urgent running
            generation that misses its budget at l_max even without a join is judged at the
            longest segment seen for its robot kind, while the batch holds at most this
            share of its cap; None (default): the paper's test.
        resume_reserve: the share of the batch's slots kept from early resumes
            (:func:`~timelyllm_ros.core.admission.keeps_resume_reserve`): a later segment
            whose robot does not need it yet, less urgent than the batch's most urgent
            generation, does not take one of them while no queued goal has lost its utility;
            None (default): no reserve, as the paper.
        stranded_order: which stranded goals take their share first (``'share'``):
            ``'loss-rate'`` (default: the steepest loss per second of generation −α/G first,
            then the one that has lost most, the lost order's rule) or ``'most-lost'`` (the
            one that has lost most first, whatever its class: the rule before; measured in
            the README).
        tie_run_cost: the latency test's tie run cost
            (:func:`~timelyllm_ros.core.admission.latency_guided`): a candidate whose budget
            is within the urgency tie of the batch's most urgent generation's, on either
            side, joins at once only while its run cost is at most this many tie windows,
            else it takes the test of a less urgent one; None (default): a candidate at least
            as urgent (within the tie) joins at once whatever its cost.
    """

    name = 'timelyllm'
    description = 'segmented, PUD priority (Eq. 4), latency-guided batch size'

    def __init__(self, lost_order: LostOrder = 'loss-rate', stranded: StrandedRule = 'eq4',
                 stranded_share: float = 0.5, stranded_plan_tokens: int = 256,
                 round_stall: float | None = None, waiting_weight: float = 0.0,
                 seen_bound: float | None = None, resume_reserve: float | None = None,
                 stranded_order: StrandedOrder = 'loss-rate',
                 tie_run_cost: float | None = None) -> None:
        for option, value, choices in (('lost_order', lost_order, LOST_ORDERS),
                                       ('stranded', stranded, STRANDED_RULES),
                                       ('stranded_order', stranded_order, STRANDED_ORDERS)):
            if value not in choices:
                raise PolicyError(f'unknown {option} {value!r}; '
                                  f'choose one of {", ".join(choices)}')
        if not 0.0 < stranded_share < 1.0:
            raise PolicyError(f'stranded_share must be within (0, 1), got {stranded_share}')
        if stranded_plan_tokens < 0:
            raise PolicyError(f'stranded_plan_tokens must be >= 0, got {stranded_plan_tokens}')
        if round_stall is not None and not round_stall > 0.0:   # NaN too
            raise PolicyError(f'round_stall must be > 0 or None, got {round_stall}')
        if not (math.isfinite(waiting_weight) and waiting_weight >= 0.0):
            raise PolicyError(f'waiting_weight must be finite and >= 0, got {waiting_weight}')
        if seen_bound is not None and not 0.0 < seen_bound <= 1.0:   # NaN too
            raise PolicyError(f'seen_bound must be within (0, 1] or None, got {seen_bound}')
        if resume_reserve is not None and not 0.0 < resume_reserve < 1.0:   # NaN too
            raise PolicyError(f'resume_reserve must be within (0, 1) or None, got '
                              f'{resume_reserve}')
        if tie_run_cost is not None and not (math.isfinite(tie_run_cost)
                                             and tie_run_cost >= 0.0):
            raise PolicyError(f'tie_run_cost must be finite and >= 0 or None, got '
                              f'{tie_run_cost}')
        self.lost_order: LostOrder = lost_order
        self.stranded: StrandedRule = stranded
        self.stranded_share = stranded_share
        self.stranded_plan_tokens = stranded_plan_tokens
        self.round_stall = round_stall
        self.waiting_weight = waiting_weight
        self.seen_bound = seen_bound
        self.resume_reserve = resume_reserve
        self.stranded_order: StrandedOrder = stranded_order
        self.tie_run_cost = tie_run_cost
        self._engine: EngineView | None = None
        self._batch_cap = 0
        self._under_way: set[str] = set()       # plans with a segment cut, still generating

    def attach(self, engine: EngineView, batch_cap: int) -> None:
        self._engine, self._batch_cap = engine, batch_cap

    def on_cut(self, generation: Generation, now: float) -> None:
        self._under_way.add(generation.task_id)

    def on_end(self, generation: Generation, now: float) -> None:
        self._under_way.discard(generation.task_id)

    def priorities(self, queue: QueueView, now: float) -> NDArray[np.float64]:
        return self._rank(queue, now)[0]

    def ranked(self, queue: QueueView, now: float
               ) -> tuple[NDArray[np.float64], NDArray[np.intp] | None]:
        return self._rank(queue, now)

    def _rank(self, queue: QueueView, now: float
              ) -> tuple[NDArray[np.float64], NDArray[np.intp] | None]:
        """The priorities, and the rows the stranded goals' share puts first (None without)."""
        stranded = self.stranded
        utility = utility_if_started(now, queue.ref_time, queue.ert, queue.beta, queue.alpha,
                                     queue.g, queue.comm_s)
        priority = pud_priority(now, queue.ref_time, queue.ert, queue.beta, queue.alpha,
                                queue.g, queue.comm_s, self.lost_order, queue.first,
                                'eq4' if stranded == 'share' else stranded, utility)
        if stranded != 'share' or priority.min(initial=1.0) > 0.0:
            return priority, None
        # _within_room reads at most the first batch cap's worth (and whether there are more)
        by_loss = stranded_by_loss(
            utility, queue.first, queue.seq, limit=self._batch_cap + 1,
            alpha_per_g=queue.alpha / queue.g if self.stranded_order == 'loss-rate' else None)
        promoted = self._within_room(queue, by_loss)
        if not len(promoted):
            return priority, None
        head = interleaved_head(priority, queue.seq, promoted, self.stranded_share)
        return lead_with(priority, head), head

    def _within_room(self, queue: QueueView, rows: NDArray[np.intp]) -> NDArray[np.intp]:
        """The leading ``rows`` that starting harms no plan under way: all of them if the
        batch has a slot for each beyond one for every plan under way (each plan still gets a
        slot when its next segment is due); else as many as fit in the engine's KV room, each
        context with ``stranded_plan_tokens`` more (no plan under way has its KV dropped and
        prefilled again). A backlog larger than the free slots is overload: starting it by
        slots would keep more plans in flight than the KV holds, each resumed late. None
        where the engine does not tell its room."""
        engine = self._engine
        room = engine.kv_room_tokens() if engine is not None else None
        if engine is None or room is None:
            return rows[:0]
        if len(rows) <= self._batch_cap - len(self._under_way):
            return rows
        fit = 0
        for row in rows[:self._batch_cap]:      # no decision admits more
            context = engine.context_tokens(queue.task_ids[row])
            if context is None:
                break
            room -= context + self.stranded_plan_tokens
            if room < 0:
                break
            fit += 1
        return rows[:fit]

    def admit(self, candidate: Generation, ctx: AdmissionContext) -> bool:
        if ctx.batch_mode == 'fixed':
            return fits(candidate, ctx)
        if not fits(candidate, ctx):
            return False
        if (self.resume_reserve is not None
                and not keeps_resume_reserve(candidate, ctx, self.resume_reserve)):
            return False
        return latency_guided(candidate, ctx, self.round_stall, self.waiting_weight,
                              self.seen_bound, self.tie_run_cost)


class TimelyLlmSharePolicy(TimelyLlmPolicy):
    """TimelyLLM with stranded goals sharing the admission order (``stranded='share'``), a
    round stall budget (``round_stall=1``), a waiting weight (``waiting_weight=1``), a seen
    bound (``seen_bound=0.25``), a resume reserve (``resume_reserve=0.5``) and a tie run cost
    (``tie_run_cost=0.5``).

    Eq. 4 leaves a goal that has lost its utility before its first segment behind every
    segment that still earns; while earning resume segments keep arriving it waits (34–39 s
    on the authors' arm workload in the paper's setup). Here such goals, the steepest loss
    rate first and then the one that has lost most, take every other place of Eq. 4's order,
    as many as join without harming a plan under way. A decision's joins stall the batch for
    at most the most urgent running generation's remaining segment time (the less urgent
    ones' where the seen bound judges it), and once the most urgent one is late a waiting
    candidate's wait counts at its TUF slope even within its slack (both measured in the
    README). A most urgent running generation whose segment misses its deadline at l_max
    tokens even alone is judged at the longest segment seen for its robot kind while the
    batch holds at most a quarter of its cap, and a resume its robot does not need yet does
    not take the last half of the slots while no queued goal is lost. A goal tied in urgency
    with the batch's most urgent one (budgets within one segment generation time, on either
    side) joins at once only while its run cost is at most half that tie: a burst of goals
    whose whole prompts must be prefilled joins one after the other. Where no goal is
    stranded, no decision reaches that budget, no running generation is late, none is lost
    at l_max alone, the batch is at most half full and no tied join costs more than half the
    tie, it decides as ``timelyllm`` does.
    """

    name = 'timelyllm-share'
    description = ('timelyllm, with goals stranded before their first segment sharing '
                   "admission, a bound on a decision's prefill stall, waits weighed "
                   'once the batch is late, seen segment lengths where l_max is lost and '
                   'slots kept from early resumes, costly tied joins one by one')

    def __init__(self, lost_order: LostOrder = 'loss-rate', stranded: StrandedRule = 'share',
                 stranded_share: float = 0.5, stranded_plan_tokens: int = 256,
                 round_stall: float | None = 1.0, waiting_weight: float = 1.0,
                 seen_bound: float | None = 0.25, resume_reserve: float | None = 0.5,
                 stranded_order: StrandedOrder = 'loss-rate',
                 tie_run_cost: float | None = 0.5) -> None:
        super().__init__(lost_order, stranded, stranded_share, stranded_plan_tokens,
                         round_stall, waiting_weight, seen_bound, resume_reserve,
                         stranded_order, tie_run_cost)


class TimelyLlmArtifactPolicy(TimelyLlmPolicy):
    """The authors' public artifact: exponential slack discount instead of Eq. 4's 1/(G·L).

    The artifact also drops a generation once its utility reaches 0; here it is kept and
    ranked last instead, so that every robot still gets its plan.
    """

    name = 'timelyllm-artifact'
    description = "segmented, the authors' artifact priority, latency-guided batch size"

    def _rank(self, queue: QueueView, now: float
              ) -> tuple[NDArray[np.float64], NDArray[np.intp] | None]:
        return artifact_priority(now, queue.ref_time, queue.ert, queue.beta, queue.alpha,
                                 queue.g, queue.comm_s), None
