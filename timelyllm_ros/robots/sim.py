"""Simulated robots: execute segments in order with durations from the execution-time model.

A simulated robot takes a recorded duration per skill when the workload carries one (the
authors' measured times), otherwise a draw from the profile's model; optional multiplicative
jitter adds variability and ``fail_probability`` injects skill failures. Execution starts when
the segment has arrived and the previous segment has ended.
"""

from __future__ import annotations

import math

import numpy as np

from timelyllm_ros.core.request import Segment
from timelyllm_ros.language.execution import MeasuredTimes, simulate_s
from timelyllm_ros.language.profiles import RobotProfile
from timelyllm_ros.robots.base import Execution


class SimulatedRobot:
    """One robot executing one task's segments on the simulation clock."""

    def __init__(self, profile: RobotProfile, rng: np.random.Generator,
                 measured: tuple[tuple[str, float], ...] | None = None,
                 jitter: float = 0.0, fail_probability: float = 0.0) -> None:
        if not 0.0 <= fail_probability <= 1.0:
            raise ValueError('fail_probability must be within [0, 1]')
        if jitter < 0.0:
            raise ValueError('jitter must be >= 0')
        self.profile = profile
        self._rng = rng
        self._measured = MeasuredTimes(profile, measured) if measured else None
        self._jitter = jitter
        self._fail_probability = fail_probability
        self.busy_until = -math.inf

    def execute(self, segment: Segment, receive_time: float) -> Execution:
        """Run a segment received at ``receive_time`` after the previous one ends."""
        start = max(receive_time, self.busy_until)
        duration = simulate_s(self.profile, segment.statements, self._rng, self._measured)
        if self._jitter:
            duration *= max(0.0, 1.0 + self._rng.normal(0.0, self._jitter))
        if self._fail_probability and self._rng.random() < self._fail_probability:
            failed_after = duration * float(self._rng.random())
            self.busy_until = start + failed_after
            return Execution(start, start + failed_after, success=False,
                             error=f'injected failure in segment {segment.index}')
        self.busy_until = start + duration
        return Execution(start, start + duration)
