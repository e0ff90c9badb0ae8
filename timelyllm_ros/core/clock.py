"""Clocks: the core never reads wall time directly, it asks a Clock (virtual or real)."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Source of the current time, in float seconds on the clock's own timeline."""

    def now(self) -> float: ...

    def elapse(self, duration_s: float) -> None:
        """Account for work that took ``duration_s`` (a model iteration)."""


class SimClock:
    """A virtual clock that only moves when told to (simulation, replay, tests)."""

    def __init__(self, start_time: float = 0.0) -> None:
        self._now = start_time

    def now(self) -> float:
        return self._now

    def advance_to(self, when: float) -> None:
        """Move the clock forward to ``when`` (never backwards)."""
        if when < self._now:
            raise ValueError(f'clock cannot go back from {self._now} to {when}')
        self._now = when

    def elapse(self, duration_s: float) -> None:
        """Simulated work: move the clock forward by its duration."""
        self.advance_to(self._now + duration_s)


class WallClock:
    """Monotonic wall-clock time, for live nodes."""

    def __init__(self) -> None:
        self._origin = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._origin

    def elapse(self, duration_s: float) -> None:
        """Real work already took its time: nothing to do."""


class SystemClock:
    """Seconds since the Unix epoch (the ROS system clock), for stamps shared between nodes."""

    def now(self) -> float:
        return time.time()

    def elapse(self, duration_s: float) -> None:
        """Real work already took its time: nothing to do."""
