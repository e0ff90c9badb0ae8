"""How long a segment takes to execute: the planning estimate and the simulated duration.

The scheduler plans with the *minimum* estimate (paper §4.3): a conditional may skip its body,
so only its condition counts; a loop counts its body ``repeat`` times; chatbot text takes its
reading time. Simulated robots execute every call (a conditional's body is taken as run, as in
the recorded traces), using a measured duration when the workload recorded one and otherwise
a draw from the skill's execution-time model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

from timelyllm_ros.profiles import RobotProfile
from timelyllm_ros.segmenter import Statement


def estimate_min_s(profile: RobotProfile, statements: Iterable[Statement]) -> float:
    """Minimum execution-time estimate of a segment's statements (s)."""
    total = 0.0
    for statement in statements:
        if statement.kind == 'text':
            total += profile.reading_time_s(statement.text)
        elif statement.kind == 'conditional':
            condition = statement.calls[0]
            total += profile.skill(condition.skill).exec_time.min_s(condition.args)
        else:
            body = sum(profile.skill(c.skill).exec_time.min_s(c.args) for c in statement.calls)
            total += body * statement.repeat
    return total


class MeasuredTimes:
    """Recorded per-skill durations of one task, handed out in plan order per skill."""

    def __init__(self, profile: RobotProfile, records: Iterable[tuple[str, float]]) -> None:
        self._by_skill: dict[str, deque[float]] = {}
        for key, seconds in records:
            name = profile.skill(key).name
            self._by_skill.setdefault(name, deque()).append(float(seconds))

    def take(self, skill: str) -> float | None:
        queue = self._by_skill.get(skill)
        return queue.popleft() if queue else None


def simulate_s(profile: RobotProfile, statements: Iterable[Statement],
               rng: np.random.Generator, measured: MeasuredTimes | None = None) -> float:
    """Duration of a simulated execution of the statements (s)."""
    total = 0.0
    for statement in statements:
        if statement.kind == 'text':
            total += profile.reading_time_s(statement.text)
            continue
        for _ in range(statement.repeat):
            for call in statement.calls:
                seconds = measured.take(call.skill) if measured is not None else None
                if seconds is None:
                    seconds = profile.skill(call.skill).exec_time.sample_s(call.args, rng)
                total += seconds
    return total
