"""The policy plug-in interface: how generations are ranked and admitted.

A policy says three things: whether generations are suspended at segment boundaries
(``segmented``), whether segments are sent to the robot as they are cut (``streaming``; if not,
the whole plan is sent when generation ends), and, at each decision, the priority of every
queued generation (higher runs sooner) plus whether the best one may join the batch.
The scheduler loop never changes to add a policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from timelyllm_ros.admission import AdmissionContext, fits
from timelyllm_ros.queue import QueueView
from timelyllm_ros.request import Generation


class Policy(ABC):
    """Ranks queued generations and admits them into the running batch."""

    name: ClassVar[str]
    description: ClassVar[str] = ''
    segmented: ClassVar[bool] = True      # suspend at each segment cut, keep KV
    streaming: ClassVar[bool] = True      # dispatch each segment when it is cut

    @abstractmethod
    def priorities(self, queue: QueueView, now: float) -> np.ndarray:
        """Priority of each queued row at time ``now`` (higher first; ties go to lower seq)."""

    def admit(self, candidate: Generation, ctx: AdmissionContext) -> bool:
        """Whether ``candidate`` (the best queued generation) may join the batch now."""
        return fits(candidate, ctx)
