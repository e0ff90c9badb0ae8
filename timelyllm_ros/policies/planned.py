"""Policies that form the next batch themselves, then let the scheduler admit exactly that.

Semantic Scheduling (stage-aware top-b, Alg. 2) and Autellix (walk the queues, stop at the
first misfit) both decide the whole next batch at once, including which running generations
it displaces. Each tick the scheduler first asks :meth:`PlannedBatchPolicy.preempt`, which
makes the plan and returns the displaced running generations; :meth:`priorities` then ranks
the planned queued generations first, in plan order, and :meth:`admit` takes only them.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from timelyllm_ros.core.admission import AdmissionContext, fits
from timelyllm_ros.core.queue import QueueView
from timelyllm_ros.core.request import Generation
from timelyllm_ros.engines.base import StepResult
from timelyllm_ros.policies.base import Eviction, Policy

PLANNED_PRIORITY = 1e12        # priority of the first planned admission; unplanned rank below


class PlannedBatchPolicy(Policy):
    """Base of the policies whose :meth:`_make_plan` chooses the batch of the next iteration."""

    def __init__(self) -> None:
        self._plan: dict[str, int] = {}          # queued task -> admission rank this tick
        self._plan_fresh = False

    @abstractmethod
    def _make_plan(self, ctx: AdmissionContext, preempting: bool) -> dict[str, Eviction]:
        """Set ``self._plan`` for this tick; return the running generations to take out (only
        when ``preempting``)."""

    @abstractmethod
    def _unplanned_priority(self, task_id: str) -> float | None:
        """Rank of a queued generation outside the plan (below every planned one), or None."""

    def _on_admitted(self, generation: Generation, ctx: AdmissionContext) -> None:
        """A planned generation joined the batch."""
        return

    # -- bookkeeping subclasses call from their observers ---------------------------------------
    def _untrack(self, generation: Generation) -> None:
        """A generation ended: it leaves the plan."""
        self._plan.pop(generation.task_id, None)

    # -- the Policy interface -------------------------------------------------------------------
    def on_step(self, result: StepResult, stepped: Sequence[Generation],
                ctx: AdmissionContext) -> None:
        self._plan_fresh = False

    def preempt(self, ctx: AdmissionContext) -> Mapping[str, Eviction]:
        decisions = self._make_plan(ctx, preempting=True)
        self._plan_fresh = True
        return decisions

    def priorities(self, queue: QueueView, now: float) -> NDArray[np.float64]:
        out = np.full(len(queue), -PLANNED_PRIORITY)
        for row, task_id in enumerate(queue.task_ids):
            rank = self._plan.get(task_id)
            if rank is not None:
                out[row] = PLANNED_PRIORITY - rank
            else:
                unplanned = self._unplanned_priority(task_id)
                if unplanned is not None:
                    out[row] = unplanned
        return out

    def admit(self, candidate: Generation, ctx: AdmissionContext) -> bool:
        if not self._plan_fresh:                   # decide() without a tick: plan, no preempt
            self._make_plan(ctx, preempting=False)
            self._plan_fresh = True
        planned = candidate.task_id in self._plan
        if not planned and not ctx.running and not self._plan:
            planned = True          # nothing runs and nothing is planned: never stall
        if not (planned and fits(candidate, ctx)):
            return False
        self._plan.pop(candidate.task_id, None)
        self._on_admitted(candidate, ctx)
        return True
