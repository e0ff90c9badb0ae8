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
* ``Pri = U / (G·L)`` while U > 0. Once no utility is left (U ≤ 0) the generation is ranked
  by U alone, below every generation that can still earn utility, least loss first.
"""

from __future__ import annotations

import numpy as np

from timelyllm_ros.core.queue import Column


def waiting_time(now: float, ref: Column, g: Column, comm_s: float) -> Column:
    """W(s_k; t): waiting time of the segment if its generation starts at ``now``."""
    return np.maximum(now + g + comm_s - ref, 0.0)


def pud_priority(now: float, ref: Column, ert: Column, beta: Column,
                 alpha: Column, g: Column, comm_s: float) -> Column:
    """Eq. 4 with the slack L defined in the module docstring."""
    wait = waiting_time(now, ref, g, comm_s)
    utility = alpha * (wait - ert)
    utility += beta
    np.minimum(utility, beta, out=utility)
    # L counts from the time the segment is needed (ref + ert), not from the clamped wait:
    # a segment needed later has more slack (module docstring).
    slack = ref + ert - (now + g + comm_s)
    np.maximum(slack, 0.0, out=slack)
    slack += g
    slack *= g
    return np.where(utility > 0.0, utility / slack, utility)


def artifact_priority(now: float, ref: Column, ert: Column, beta: Column,
                      alpha: Column, g: Column, comm_s: float) -> Column:
    """The authors' artifact: ``(α·max(0, Δ) + β)·exp(min(0, Δ))``, Δ = t + G + comm − need.

    Segments needed later are discounted exponentially by their slack; late ones are ranked
    by the utility they still have. ``need`` is ``ref + ert``.
    """
    delta = now + g + comm_s - (ref + ert)
    discounted: Column = (alpha * np.maximum(delta, 0.0) + beta) * np.exp(np.minimum(delta, 0.0))
    return discounted
