"""How long a segment takes to execute: the planning estimate and the simulated duration.

The scheduler plans with the *minimum* estimate (paper §4.3): a conditional may skip its body,
so only its condition counts; a loop counts the minimum of its body ``repeat`` times; chatbot
text takes its reading time. Nested statements count by the same rules, following the tree the
segmenter parsed (:attr:`Statement.body`). Simulated robots execute every statement by that
tree, every condition taken as true (a conditional's body is run, as in the recorded traces),
using a measured duration when the workload recorded one and otherwise a draw from the skill's
execution-time model.

A statement built by hand without a body counts its flat calls: a loop's calls form its body,
a conditional's first call is its condition and the others its body.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

from timelyllm_ros.language.plan import SkillCall, Statement
from timelyllm_ros.language.profiles import RobotProfile


def _condition(statement: Statement) -> SkillCall | None:
    """A conditional's condition call (its first call when built by hand without a tree)."""
    return statement.condition or next(iter(statement.calls), None)


def _body_calls(statement: Statement) -> tuple[SkillCall, ...]:
    """The calls of a skill statement, or the body calls of a conditional or loop built by
    hand without a body."""
    return statement.calls[1:] if statement.kind == 'conditional' else statement.calls


def _min_s(profile: RobotProfile, statement: Statement) -> float:
    """Minimum execution time of one statement and its nested statements (s)."""
    if statement.kind == 'text':
        return profile.reading_time_s(statement.text)
    if statement.kind == 'conditional':
        condition = _condition(statement)
        return 0.0 if condition is None else _call_min_s(profile, condition)
    if statement.kind == 'loop' and statement.body:
        return statement.repeat * sum(_min_s(profile, child) for child in statement.body)
    return statement.repeat * sum(_call_min_s(profile, call) for call in statement.calls)


def _call_min_s(profile: RobotProfile, call: SkillCall) -> float:
    return profile.skill(call.skill).exec_time.min_s(call.args)


def estimate_min_s(profile: RobotProfile, statements: Iterable[Statement]) -> float:
    """Minimum execution-time estimate of a segment's statements (s).

    Args:
        profile: The robot profile whose execution-time models apply.
        statements: The segment's statements.

    Returns:
        The sum of the statements' minima: a conditional counts its condition only, a loop
        ``repeat`` times the minimum of its body, text its reading time.
    """
    return sum((_min_s(profile, statement) for statement in statements), 0.0)


def _max_s(profile: RobotProfile, statement: Statement) -> float:
    """Longest execution of one statement by its models: every condition true (s)."""
    if statement.kind == 'text':
        return profile.reading_time_s(statement.text)
    total = 0.0
    if statement.kind == 'conditional':
        condition = _condition(statement)
        total += 0.0 if condition is None else _call_max_s(profile, condition)
    if statement.body:
        body = sum(_max_s(profile, child) for child in statement.body)
    else:
        body = sum(_call_max_s(profile, call) for call in _body_calls(statement))
    return total + statement.repeat * body


def _call_max_s(profile: RobotProfile, call: SkillCall) -> float:
    return profile.skill(call.skill).exec_time.max_s(call.args)


def estimate_max_s(profile: RobotProfile, statements: Iterable[Statement]) -> float:
    """Longest execution-time estimate of a segment's statements (s): every conditional's
    body performed, every loop at its full count, each call at its model's maximum. What a
    robot may take before it is overdue (report deadlines), not what the scheduler plans on.
    """
    return sum((_max_s(profile, statement) for statement in statements), 0.0)


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
    """Duration of a simulated execution of the statements (s).

    Args:
        profile: The robot profile whose execution-time models apply.
        statements: The segment's statements, executed by their tree with every condition
            taken as true.
        rng: Where unmeasured durations are drawn from.
        measured: Recorded durations, taken per skill in execution order before drawing.

    Returns:
        The summed duration of every performed call and the reading time of text.
    """
    return sum((_simulate_one(profile, statement, rng, measured) for statement in statements),
               0.0)


def _simulate_one(profile: RobotProfile, statement: Statement, rng: np.random.Generator,
                  measured: MeasuredTimes | None) -> float:
    """Simulated duration of one statement, its nested statements performed by the tree."""
    if statement.kind == 'text':
        return profile.reading_time_s(statement.text)
    total = 0.0
    if statement.kind == 'conditional':
        condition = _condition(statement)
        if condition is not None:
            total += _simulate_call(profile, condition, rng, measured)
    for _ in range(statement.repeat):
        if statement.body:
            for child in statement.body:
                total += _simulate_one(profile, child, rng, measured)
        else:
            for call in _body_calls(statement):
                total += _simulate_call(profile, call, rng, measured)
    return total


def _simulate_call(profile: RobotProfile, call: SkillCall, rng: np.random.Generator,
                   measured: MeasuredTimes | None) -> float:
    """One call's duration: the next recorded one for its skill, else a draw from its model."""
    seconds = measured.take(call.skill) if measured is not None else None
    if seconds is None:
        seconds = profile.skill(call.skill).exec_time.sample_s(call.args, rng)
    return seconds
