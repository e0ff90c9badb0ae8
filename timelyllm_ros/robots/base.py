"""The robot-side contract: execute one dispatched segment, report when it really ran."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from timelyllm_ros.core.request import Segment


@dataclass(frozen=True, slots=True)
class Execution:
    """How a segment's execution went (float seconds on the shared clock)."""

    start_time: float
    end_time: float
    success: bool = True
    error: str = ''


class SegmentExecutor(Protocol):
    """Executes the segments of one task in order (the next may arrive while one runs)."""

    def execute(self, segment: Segment, receive_time: float) -> Execution: ...
