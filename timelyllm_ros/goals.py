"""The plan goal a robot sends, and the one schema every goal is checked against at the edge.

A goal reaches the core from an action server, a task topic, a CLI or a test; whatever the
route, :func:`validate_goal` is the single gate: it either returns the goal (with its TUF
resolved) or raises :class:`~timelyllm_ros.errors.GoalError` with a short reason that names
the field and never echoes file contents or long input back.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from timelyllm_ros.errors import GoalError, TufError
from timelyllm_ros.profiles import PROFILE_NAME
from timelyllm_ros.tuf import TUF_CLASSES, Tuf

MAX_TASK_CHARS = 4096
MAX_ROBOT_ID_CHARS = 128
MAX_TUF_SECONDS = 86_400.0          # an ERT or zero-utility time beyond a day is a mistake
MAX_TUF_UTILITY = 1e6

ROBOT_ID_PATTERN = r'^[A-Za-z0-9_][A-Za-z0-9_.:/-]*$'
UNREADABLE_CHARS = re.compile('[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]')
"""What received text may not hold: control characters (but tab, newline, carriage return)
and lone surrogates."""


@dataclass(frozen=True, slots=True)
class PlanGoal:
    """A plan request as a robot sends it (the PlanTask action goal)."""

    robot_id: str
    robot_kind: str                 # robot profile name
    task: str
    urgency: str = 'normal'         # TUF class: normal | urgent | chatbot
    tuf: Tuf | None = None          # explicit TUF, overriding the class's
    wait_for_execution: bool = True  # end when executed (robot reports) or when generated

    @property
    def resolved_tuf(self) -> Tuf:
        """The TUF that governs the goal: the explicit one, else its class's."""
        return self.tuf if self.tuf is not None else TUF_CLASSES[self.urgency]


class _GoalSchema(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra='forbid')

    robot_id: Annotated[str, Field(max_length=MAX_ROBOT_ID_CHARS)]
    robot_kind: str
    task: Annotated[str, Field(min_length=1, max_length=MAX_TASK_CHARS)]
    urgency: str
    tuf: tuple[float, float, float] | None     # (beta, ert_s, alpha)
    wait_for_execution: bool

    @field_validator('robot_id')
    @classmethod
    def _robot_name(cls, robot_id: str) -> str:
        if not robot_id.strip():
            raise ValueError('the goal has no robot id')
        if not re.match(ROBOT_ID_PATTERN, robot_id):
            raise ValueError('a robot id is letters, digits and _ . : / - only')
        return robot_id

    @field_validator('robot_kind')
    @classmethod
    def _profile_name(cls, kind: str) -> str:
        if not PROFILE_NAME.fullmatch(kind):
            raise ValueError('a robot kind is a profile name (letters, digits, _ and -, at '
                             'most 64), never a path')
        return kind

    @field_validator('task')
    @classmethod
    def _readable_text(cls, task: str) -> str:
        if not task.strip():
            raise ValueError('the task text is empty')
        bad = UNREADABLE_CHARS.search(task)
        if bad is not None and bad.group() >= '\ud800':
            raise ValueError('the task text is not valid Unicode (a lone surrogate)')
        if bad is not None:
            raise ValueError('the task text contains control characters')
        return task

    @field_validator('urgency')
    @classmethod
    def _known_class(cls, urgency: str) -> str:
        if urgency not in TUF_CLASSES:
            raise ValueError(f'unknown TUF class; known: {", ".join(TUF_CLASSES)}')
        return urgency

    @field_validator('tuf')
    @classmethod
    def _sane_tuf(cls, tuf: tuple[float, float, float] | None
                  ) -> tuple[float, float, float] | None:
        if tuf is None:
            return tuf
        beta, ert_s, alpha = tuf
        if not all(math.isfinite(v) for v in tuf):
            raise ValueError('TUF values must be finite')
        if not 0 < beta <= MAX_TUF_UTILITY:
            raise ValueError(f'TUF beta must be in (0, {MAX_TUF_UTILITY:g}]')
        if not 0 <= ert_s <= MAX_TUF_SECONDS:
            raise ValueError(f'TUF ERT must be in [0, {MAX_TUF_SECONDS:g}] s')
        if alpha > 0:
            raise ValueError('TUF alpha must be <= 0 (utility never rises)')
        if alpha < 0 and ert_s - beta / alpha > MAX_TUF_SECONDS:
            raise ValueError(f'TUF zero-utility time must be <= {MAX_TUF_SECONDS:g} s')
        return tuf


def validate_goal(goal: PlanGoal) -> PlanGoal:
    """Check a goal against the schema; returns it unchanged when valid.

    Raises:
        GoalError: the first invalid field and why (never the field's full value).
    """
    try:
        tuf = goal.tuf
        _GoalSchema(robot_id=goal.robot_id, robot_kind=goal.robot_kind, task=goal.task,
                    urgency=goal.urgency,
                    tuf=None if tuf is None else (tuf.beta, tuf.ert_s, tuf.alpha),
                    wait_for_execution=goal.wait_for_execution)
    except ValidationError as err:
        first = err.errors(include_url=False, include_input=False)[0]
        where = '.'.join(str(part) for part in first['loc']) or 'goal'
        message = first['msg'].removeprefix('Value error, ')
        error = TufError if where.split('.')[0] in ('urgency', 'tuf') else GoalError
        raise error(f'invalid goal field {where}: {message}') from None
    except Exception as err:  # noqa: BLE001 - a malformed goal object is a bad goal, not a crash
        raise GoalError(f'malformed goal: {type(err).__name__}') from None
    return goal
