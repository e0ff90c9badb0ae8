"""What a profiling run drives: a rig (backend, clock, measurement hooks) and its steps.

``lrtrace profile`` (:mod:`lrtrace.profiling`) is the driver: it asks the robot's kind
(:class:`~timelyllm_ros.robots.kind.RobotKind`) for a :class:`Rig` and a list of
:class:`Step`, executes each step through the skill executor and records it. This module holds
the parts the driver and the kinds share: the step, the rig's hooks with their defaults, and
the grid of call texts over a skill's first numeric argument.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from timelyllm_ros.core.clock import Clock
from timelyllm_ros.errors import ProfileError
from timelyllm_ros.language.profiles import RobotProfile, Skill
from timelyllm_ros.robots.backend import RobotBackend, SkillRecord


@dataclass(frozen=True, slots=True)
class Step:
    """One call of a profiling run.

    Attributes:
        skill: The canonical skill name.
        text: The call as sent through the executor, e.g. ``mf(116)``.
        record: False for set-up moves (performed, not recorded).
    """

    skill: str
    text: str
    record: bool = True


class Rig:
    """A connected backend with its clock and the profiler's measurement hooks.

    Attributes:
        backend: The connected backend.
        clock: The clock the executor times the calls on.
        description: What the robot is (for the bag's source).
        meta: Key/value pairs for the bag's meta (a rig may add to them until it closes).
    """

    def __init__(self, backend: RobotBackend, clock: Clock, description: str,
                 meta: Mapping[str, str] | None = None) -> None:
        self.backend = backend
        self.clock = clock
        self.description = description
        self.meta = dict(meta or {})

    def before(self, step: Step) -> None:
        """Called before a step is executed."""

    def measured(self, step: Step, record: SkillRecord) -> SkillRecord:
        """The record to store for one executed skill (default: as the executor timed it)."""
        return record

    def after(self, step: Step) -> None:
        """Called after a step succeeded."""

    def cleanup(self) -> None:
        """Best-effort safe state after a failed run (never raises)."""


def grid(lo: float | None, hi: float | None, integer: bool, points: int) -> list[float]:
    """``points`` argument values from the lowest positive limit to the upper limit."""
    top = hi if hi is not None else 100.0
    bottom = lo if lo is not None and lo > 0 else top / points
    if points == 1:
        values = [top]
    else:
        values = [bottom + (top - bottom) * i / (points - 1) for i in range(points)]
    return sorted({round(v) for v in values}) if integer else [round(v, 3) for v in values]


def call_text(skill: Skill, value: float | None) -> str:
    """``short(...)`` with ``value`` for the first numeric argument.

    Other numeric arguments take 0 (or their lower limit when 0 is outside it), string
    arguments ``'target'``.

    Raises:
        ProfileError: a numeric argument with a negative maximum and no minimum.
    """
    numeric = [a for a in skill.args if a.type != 'str']
    literals = []
    for arg in skill.args:
        if arg.type == 'str':
            literals.append("'target'")
            continue
        v = value if numeric and arg is numeric[0] and value is not None else (
            0.0 if (arg.min is None or arg.min <= 0) and (arg.max is None or arg.max >= 0)
            else arg.min)
        if v is None:
            raise ProfileError(f'{skill.name}: argument {arg.name} has a negative maximum and '
                               f'no minimum: no value to profile it with')
        literals.append(str(int(v)) if arg.type == 'int' else f'{float(v):g}')
    return f'{skill.short}({", ".join(literals)})'


def skill_grid(skill: Skill, points: int) -> list[float] | None:
    """The grid of the skill's first numeric argument (None: no numeric argument)."""
    numeric = [a for a in skill.args if a.type != 'str']
    if not numeric:
        return None
    return grid(numeric[0].min, numeric[0].max, numeric[0].type == 'int', points)


def profile_calls(profile: RobotProfile, points: int = 13) -> list[tuple[str, str]]:
    """``(skill, call text)`` pairs covering every skill of a profile once per grid point.

    The first numeric argument runs over its grid; other numeric arguments take 0 (or their
    lower limit when 0 is outside it), string arguments ``'target'``; skills without numeric
    arguments are called once.
    """
    calls: list[tuple[str, str]] = []
    for skill in profile.skills:
        values = skill_grid(skill, points)
        for value in values if values is not None else [None]:
            calls.append((skill.name, call_text(skill, value)))
    return calls
