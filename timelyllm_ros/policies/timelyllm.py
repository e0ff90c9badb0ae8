"""TimelyLLM (paper 000 §4): segmented generation, PUD priority, latency-guided batching."""

from __future__ import annotations

import numpy as np

from timelyllm_ros.admission import AdmissionContext, fits, latency_guided
from timelyllm_ros.policies.base import Policy
from timelyllm_ros.priority import artifact_priority, pud_priority
from timelyllm_ros.queue import QueueView
from timelyllm_ros.request import Generation


def lost_slopes(queue: QueueView, now: float) -> tuple[float, int]:
    """``(Σ −α, count)`` over the queued segments past their zero-utility time.

    A segment earns nothing once ``now + comm ≥ ref + ERT − β/α`` (the zero-utility time of
    its governing TUF; never for a flat TUF, α = 0). Vectorised: computed with the
    priorities, once per decision, instead of once per admission test.
    """
    alpha = queue.alpha
    steep = alpha < 0.0
    zero = np.full(len(queue), np.inf)
    np.divide(queue.beta, alpha, out=zero, where=steep)
    deadline = queue.ref_time + queue.ert - zero       # ERT − β/α for α < 0
    late = steep & (deadline - now - queue.comm_s <= 0.0)
    return float(-alpha[late].sum()), int(late.sum())


class TimelyLlmPolicy(Policy):
    """Eq. 4 as the paper states it (L defined in :mod:`timelyllm_ros.priority`) + §4.4."""

    name = 'timelyllm'
    description = 'segmented, PUD priority (Eq. 4), latency-guided batch size'

    def __init__(self) -> None:
        self._lost: tuple[float, tuple[float, int]] | None = None   # (now, lost slopes)

    def priorities(self, queue: QueueView, now: float) -> np.ndarray:
        self._lost = (now, lost_slopes(queue, now))
        return self._rank(queue, now)

    def _rank(self, queue: QueueView, now: float) -> np.ndarray:
        return pud_priority(now, queue.ref_time, queue.ert, queue.beta, queue.alpha, queue.g,
                            queue.comm_s)

    def admit(self, candidate: Generation, ctx: AdmissionContext) -> bool:
        cached = self._lost[1] if self._lost is not None and self._lost[0] == ctx.now else None
        return fits(candidate, ctx) and latency_guided(candidate, ctx, cached)


class TimelyLlmArtifactPolicy(TimelyLlmPolicy):
    """The authors' public artifact: exponential slack discount instead of Eq. 4's 1/(G·L).

    The artifact also drops a generation once its utility reaches 0; here it is kept and
    ranked last instead, so that every robot still gets its plan.
    """

    name = 'timelyllm-artifact'
    description = "segmented, the authors' artifact priority, latency-guided batch size"

    def _rank(self, queue: QueueView, now: float) -> np.ndarray:
        return artifact_priority(now, queue.ref_time, queue.ert, queue.beta, queue.alpha,
                                 queue.g, queue.comm_s)
