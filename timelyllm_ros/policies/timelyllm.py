"""TimelyLLM (paper 000 §4): segmented generation, PUD priority, latency-guided batching."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from timelyllm_ros.core.admission import AdmissionContext, LostSlopes, fits, latency_guided
from timelyllm_ros.core.priority import artifact_priority, pud_priority
from timelyllm_ros.core.queue import QueueView
from timelyllm_ros.core.request import Generation
from timelyllm_ros.policies.base import Policy


def lost_slopes(queue: QueueView, now: float, rows: int | None = None) -> LostSlopes:
    """``(Σ −α, count)`` over the queued segments past their zero-utility time (the first
    ``rows`` of the view: the queue swap-removes, so they are the ones still queued).

    A segment earns nothing once ``now + comm ≥ ref + ERT − β/α`` (the zero-utility time of
    its governing TUF; never for a flat TUF, α = 0). Vectorised: computed with the
    priorities, once per decision, instead of once per admission test.
    """
    n = len(queue) if rows is None else rows
    alpha = queue.alpha[:n]
    steep = alpha < 0.0
    zero = np.full(n, np.inf)
    np.divide(queue.beta[:n], alpha, out=zero, where=steep)
    deadline = queue.ref_time[:n] + queue.ert[:n] - zero   # ERT − β/α for α < 0
    late = steep & (deadline - now - queue.comm_s <= 0.0)
    return float(-alpha[late].sum()), int(late.sum())


class TimelyLlmPolicy(Policy):
    """Eq. 4 as the paper states it (L defined in :mod:`timelyllm_ros.core.priority`) + §4.4."""

    name = 'timelyllm'
    description = 'segmented, PUD priority (Eq. 4), latency-guided batch size'

    def __init__(self) -> None:
        # The lost slopes of the last admission round's ranked queue, over how many rows.
        self._lost: tuple[QueueView, int, LostSlopes] | None = None

    def priorities(self, queue: QueueView, now: float) -> NDArray[np.float64]:
        return self._rank(queue, now)

    def _lost_slopes(self, queue: QueueView, now: float, rows: int) -> LostSlopes:
        # Only needed once the most urgent running goal is late: computed then, over the
        # goals still queued (the view is live; admitted rows were swap-removed), once per
        # round and queue length.
        if self._lost is None or self._lost[0] is not queue or self._lost[1] != rows:
            self._lost = (queue, rows, lost_slopes(queue, now, rows))
        return self._lost[2]

    def _rank(self, queue: QueueView, now: float) -> NDArray[np.float64]:
        return pud_priority(now, queue.ref_time, queue.ert, queue.beta, queue.alpha, queue.g,
                            queue.comm_s)

    def admit(self, candidate: Generation, ctx: AdmissionContext) -> bool:
        if ctx.batch_mode == 'fixed':
            return fits(candidate, ctx)
        ranked, rows = ctx.ranked, len(ctx.queued)
        return fits(candidate, ctx) and latency_guided(
            candidate, ctx,
            (lambda: self._lost_slopes(ranked, ctx.now, rows)) if ranked is not None else None)


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
