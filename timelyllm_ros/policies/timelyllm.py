"""TimelyLLM (paper 000 §4): segmented generation, PUD priority, latency-guided batching."""

from __future__ import annotations

import numpy as np

from timelyllm_ros.admission import AdmissionContext, fits, latency_guided
from timelyllm_ros.policies.base import Policy
from timelyllm_ros.priority import artifact_priority, pud_priority
from timelyllm_ros.queue import QueueView
from timelyllm_ros.request import Generation


class TimelyLlmPolicy(Policy):
    """Eq. 4 as the paper states it (L defined in :mod:`timelyllm_ros.priority`) + §4.4."""

    name = 'timelyllm'
    description = 'segmented, PUD priority (Eq. 4), latency-guided batch size'

    def priorities(self, queue: QueueView, now: float) -> np.ndarray:
        return pud_priority(now, queue.ref_time, queue.ert, queue.beta, queue.alpha, queue.g,
                            queue.comm_s)

    def admit(self, candidate: Generation, ctx: AdmissionContext) -> bool:
        return fits(candidate, ctx) and latency_guided(candidate, ctx)


class TimelyLlmArtifactPolicy(TimelyLlmPolicy):
    """The authors' public artifact: exponential slack discount instead of Eq. 4's 1/(G·L).

    The artifact also drops a generation once its utility reaches 0; here it is kept and
    ranked last instead, so that every robot still gets its plan.
    """

    name = 'timelyllm-artifact'
    description = "segmented, the authors' artifact priority, latency-guided batch size"

    def priorities(self, queue: QueueView, now: float) -> np.ndarray:
        return artifact_priority(now, queue.ref_time, queue.ert, queue.beta, queue.alpha,
                                 queue.g, queue.comm_s)
