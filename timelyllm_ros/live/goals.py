"""The plan goal a robot sends, and the one schema every goal is checked against at the edge.

A goal reaches the core from an action server, a CLI or a test; whatever the route,
:func:`validate_goal` is the single gate (the live service calls it on every goal; message
translation only reads fields): it either returns the goal or raises
:class:`~timelyllm_ros.errors.GoalError` with a short reason that names the field and never
echoes file contents or long input back. The field rules (:func:`check_text`,
:func:`check_urgency`, :func:`check_tuf_bounds`) also serve the robots' task topic. A
:class:`~timelyllm_ros.core.tuf.Tuf` checks its own invariant (finite, β > 0, α ≤ 0) when built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from timelyllm_ros.core.tuf import TUF_CLASSES, Tuf
from timelyllm_ros.errors import GoalError, ProfileError, TufError
from timelyllm_ros.language.profiles import check_profile_name, clip

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


def check_text(what: str, text: object, max_chars: int, *, empty: bool = False) -> str:
    """Check one text field received from outside.

    Args:
        what: The field's name, for the message.
        text: The received value.
        max_chars: Its longest allowed length.
        empty: Whether an empty (or blank) text is allowed.

    Returns:
        The text, unchanged.

    Raises:
        GoalError: not a string, empty or blank (unless allowed), longer than ``max_chars``,
            or holding a control character (other than tab, newline, carriage return) or a
            lone surrogate; the reason quotes the text cut to about 64 characters.
    """
    if not isinstance(text, str):
        raise GoalError(f'the {what} must be text, got {type(text).__name__}')
    if len(text) > max_chars:
        raise GoalError(f'the {what} is longer than {max_chars} characters ({len(text)})')
    if not empty and not text.strip():
        raise GoalError(f'the {what} is empty')
    bad = UNREADABLE_CHARS.search(text)
    if bad is not None:
        kind = 'a lone surrogate' if bad.group() >= '\ud800' else 'a control character'
        raise GoalError(f'the {what} {clip(text)} holds {kind} at {bad.start()}')
    return text


def check_urgency(urgency: object) -> str:
    """The urgency (TUF class) of a goal: ``''`` (the default) or one of the known classes.

    Raises:
        TufError: anything else, quoting it cut to about 64 characters.
    """
    if not isinstance(urgency, str):
        raise TufError(f'the urgency must be text, got {type(urgency).__name__}')
    name = urgency.strip()
    if name and name not in TUF_CLASSES:
        raise TufError(f'unknown urgency {clip(urgency)}; known: {", ".join(TUF_CLASSES)}')
    return name


def check_tuf_bounds(tuf: object) -> Tuf:
    """An explicit TUF within what a goal may ask: a :class:`Tuf` (finite, β > 0, α ≤ 0 by
    construction) with β at most :data:`MAX_TUF_UTILITY` and its ERT and zero-utility time
    at most a day.

    Raises:
        TufError: not a Tuf, or out of these bounds.
    """
    if not isinstance(tuf, Tuf):
        raise TufError(f'the TUF must be a Tuf, got {type(tuf).__name__}')
    if tuf.beta > MAX_TUF_UTILITY:
        raise TufError(f'TUF beta must be in (0, {MAX_TUF_UTILITY:g}]')
    if tuf.ert_s > MAX_TUF_SECONDS:
        raise TufError(f'TUF ERT must be in [0, {MAX_TUF_SECONDS:g}] s')
    if tuf.zero_s > MAX_TUF_SECONDS and tuf.alpha < 0:
        raise TufError(f'TUF zero-utility time must be <= {MAX_TUF_SECONDS:g} s')
    return tuf


def validate_goal(goal: PlanGoal) -> PlanGoal:
    """Check every field of a goal; returns it unchanged when valid.

    Raises:
        GoalError: every invalid field and why, in one message (``; `` between them), each
            quoting at most about 64 characters of the field (TufError when only the urgency
            or the TUF is wrong).
    """
    problems: list[GoalError] = []
    for check in (_check_robot_id, _check_robot_kind, _check_task, _check_urgency, _check_tuf,
                  _check_wait):
        try:
            check(goal)
        except GoalError as err:
            problems.append(err)
        except Exception as err:  # noqa: BLE001 - a malformed goal object is a bad goal
            problems.append(GoalError(f'malformed goal: {type(err).__name__}'))
    if len(problems) == 1:
        raise problems[0]
    if problems:
        error = TufError if all(isinstance(p, TufError) for p in problems) else GoalError
        raise error(joined_reasons([str(p) for p in problems]))
    return goal


MAX_REASON_CHARS = 400
"""Longest refusal reason a client gets: one action result line, whatever the goal held."""


def joined_reasons(reasons: list[str], limit: int = MAX_REASON_CHARS) -> str:
    """The reasons joined by ``; ``, as many whole ones as fit in ``limit`` characters with a
    count of the rest (``; and 2 more problems``): each quotes up to about 64 characters of a
    field, but four long fields together ran past a result line."""
    text = '; '.join(reasons)
    if len(text) <= limit:
        return text
    for kept in range(len(reasons) - 1, 0, -1):
        rest = len(reasons) - kept
        text = (f"{'; '.join(reasons[:kept])}; and {rest} more "
                f"problem{'s' if rest > 1 else ''}")
        if len(text) <= limit:
            return text
    return reasons[0][:limit - 3] + '...'


def _check_robot_id(goal: PlanGoal) -> None:
    robot_id = check_text('robot id', goal.robot_id, MAX_ROBOT_ID_CHARS, empty=True)
    if not robot_id.strip():
        raise GoalError('the goal has no robot id')
    if not re.match(ROBOT_ID_PATTERN, robot_id):
        raise GoalError(f'invalid robot id {clip(robot_id)}: a robot id is letters, digits and '
                        '_ . : / - only')


def _check_robot_kind(goal: PlanGoal) -> None:
    kind = goal.robot_kind
    if isinstance(kind, str) and not kind.strip():
        raise GoalError('the goal names no robot kind')
    try:
        check_profile_name(kind)
    except ProfileError as err:
        raise GoalError(str(err)) from None


def _check_task(goal: PlanGoal) -> None:
    check_text('task text', goal.task, MAX_TASK_CHARS)


def _check_urgency(goal: PlanGoal) -> None:
    if goal.urgency not in TUF_CLASSES:
        check_urgency(goal.urgency)             # says what is wrong with it, if it can
        raise TufError(f'unknown urgency {clip(goal.urgency)}; known: {", ".join(TUF_CLASSES)}')


def _check_tuf(goal: PlanGoal) -> None:
    if goal.tuf is not None:
        check_tuf_bounds(goal.tuf)


def _check_wait(goal: PlanGoal) -> None:
    if not isinstance(goal.wait_for_execution, bool):
        raise GoalError('wait_for_execution must be true or false')
