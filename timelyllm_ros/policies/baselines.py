"""The paper's baselines (§7.1, §7.3): vLLM, vLLM-stream, segmented FCFS and segmented EDF."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from timelyllm_ros.core.queue import QueueView
from timelyllm_ros.policies.base import Policy


class VllmPolicy(Policy):
    """vLLM continuous batching: FCFS, the whole plan is generated, then executed."""

    name = 'vllm'
    description = 'FCFS continuous batching; whole plan generated, then sent'
    segmented = False
    streaming = False

    def priorities(self, queue: QueueView, now: float) -> NDArray[np.float64]:
        return -queue.arrival


class VllmStreamPolicy(VllmPolicy):
    """vLLM-stream: FCFS, generated non-stop, each executable action streamed when it appears."""

    name = 'vllm-stream'
    description = 'FCFS; whole plan generated non-stop, actions streamed as they appear'
    streaming = True


class SegmentedFcfsPolicy(Policy):
    """Segmented generation, ranked by the request's arrival (kept for suspended segments)."""

    name = 'seg-fcfs'
    description = 'segmented generation, first come first served'

    def priorities(self, queue: QueueView, now: float) -> NDArray[np.float64]:
        return -queue.arrival


class SegmentedEdfPolicy(Policy):
    """Segmented generation, ranked by the request's deadline (arrival + ERT of TUF₀)."""

    name = 'seg-edf'
    description = 'segmented generation, earliest request deadline first'

    def priorities(self, queue: QueueView, now: float) -> NDArray[np.float64]:
        # Suspended generations keep their request's deadline (paper §7.3.2).
        return -(queue.arrival + queue.ert0)
