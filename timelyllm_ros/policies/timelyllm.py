"""TimelyLLM (paper 000 §4): segmented generation, PUD priority, latency-guided batching."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from timelyllm_ros.core.admission import AdmissionContext, fits, latency_guided
from timelyllm_ros.core.priority import (
    LOST_ORDERS,
    STRANDED_RULES,
    LostOrder,
    StrandedRule,
    artifact_priority,
    pud_priority,
)
from timelyllm_ros.core.queue import QueueView
from timelyllm_ros.core.request import Generation
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
            earning segment, as Eq. 4 ranks it) or ``'first'`` (before every other
            generation, the one that has lost most first; measured in the README).
    """

    name = 'timelyllm'
    description = 'segmented, PUD priority (Eq. 4), latency-guided batch size'

    def __init__(self, lost_order: LostOrder = 'loss-rate',
                 stranded: StrandedRule = 'eq4') -> None:
        for option, value, choices in (('lost_order', lost_order, LOST_ORDERS),
                                       ('stranded', stranded, STRANDED_RULES)):
            if value not in choices:
                raise PolicyError(f'unknown {option} {value!r}; '
                                  f'choose one of {", ".join(choices)}')
        self.lost_order: LostOrder = lost_order
        self.stranded: StrandedRule = stranded

    def priorities(self, queue: QueueView, now: float) -> NDArray[np.float64]:
        return self._rank(queue, now)

    def _rank(self, queue: QueueView, now: float) -> NDArray[np.float64]:
        return pud_priority(now, queue.ref_time, queue.ert, queue.beta, queue.alpha, queue.g,
                            queue.comm_s, self.lost_order, queue.first, self.stranded)

    def admit(self, candidate: Generation, ctx: AdmissionContext) -> bool:
        if ctx.batch_mode == 'fixed':
            return fits(candidate, ctx)
        return fits(candidate, ctx) and latency_guided(candidate, ctx)


class TimelyLlmArtifactPolicy(TimelyLlmPolicy):
    """The authors' public artifact: exponential slack discount instead of Eq. 4's 1/(G·L).

    The artifact also drops a generation once its utility reaches 0; here it is kept and
    ranked last instead, so that every robot still gets its plan.
    """

    name = 'timelyllm-artifact'
    description = "segmented, the authors' artifact priority, latency-guided batch size"

    def _rank(self, queue: QueueView, now: float) -> NDArray[np.float64]:
        return artifact_priority(now, queue.ref_time, queue.ert, queue.beta, queue.alpha,
                                 queue.g, queue.comm_s)
