"""TimelyLLM (paper 000 §4): segmented generation, PUD priority, latency-guided batching."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from timelyllm_ros.admission import AdmissionContext, LostSlopes, fits, latency_guided
from timelyllm_ros.policies.base import Policy
from timelyllm_ros.priority import artifact_priority, pud_priority
from timelyllm_ros.queue import QueueView
from timelyllm_ros.request import Generation


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
    """Eq. 4 as the paper states it (L defined in :mod:`timelyllm_ros.priority`) + §4.4."""

    name = 'timelyllm'
    description = 'segmented, PUD priority (Eq. 4), latency-guided batch size'

    def __init__(self) -> None:
        self._decision: tuple[float, QueueView] | None = None   # (now, queue) ranked last
        self._lost: LostSlopes | None = None                    # its lost slopes, once asked
        self._lost_rows = 0                                     # ... over this many rows

    def priorities(self, queue: QueueView, now: float) -> NDArray[np.float64]:
        self._decision, self._lost = (now, queue), None
        return self._rank(queue, now)

    def _lost_slopes(self, rows: int) -> LostSlopes:
        # Only needed once the most urgent running goal is late: computed then, over the
        # goals still queued (the view is live; admitted rows were swap-removed).
        if self._lost is None or self._lost_rows != rows:
            assert self._decision is not None
            now, queue = self._decision
            self._lost, self._lost_rows = lost_slopes(queue, now, rows), rows
        return self._lost

    def _rank(self, queue: QueueView, now: float) -> NDArray[np.float64]:
        return pud_priority(now, queue.ref_time, queue.ert, queue.beta, queue.alpha, queue.g,
                            queue.comm_s)

    def admit(self, candidate: Generation, ctx: AdmissionContext) -> bool:
        if ctx.batch_mode == 'fixed':
            return fits(candidate, ctx)
        current = self._decision is not None and self._decision[0] == ctx.now
        rows = len(ctx.queued)
        return fits(candidate, ctx) and latency_guided(
            candidate, ctx, (lambda: self._lost_slopes(rows)) if current else None)


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
